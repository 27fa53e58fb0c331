"""Spread a split leaf's pieces, one per device, when the step pays (almost) nothing for it.

A leaf split into M pieces (`jaxhybrid.graph.shard`: shard nodes named `<node>/shard<d>` or
`<node>/<key>.shard<d>`) divides its memory by M only if the pieces sit on different devices. The
lock-step search minimises the step time, and under a roomy memory cap it has no reason to
spread the pieces of a cheap lookup. This pass tries, for each split leaf (largest first), the
M rotations "piece d on device (d + r) mod M" and keeps the one with the smallest per-device
peak memory whose lock-step price stays within `tolerance` of the search's price: memory for
(nearly) free, never more than that tolerance of step time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.pricing import lockstep_rule
from jaxhybrid.planner.search import fbw_search



def piece_groups(names: Sequence[str], devices: int) -> list[tuple[int, ...]]:
  """Node ids of each split leaf's M shard nodes, piece order (only complete groups)."""
  found: dict[str, dict[int, int]] = {}
  for i, name in enumerate(names):
    m = lockstep_rule.PIECE_NAME.match(name)
    if m:
      found.setdefault(m.group(1), {})[int(m.group(2))] = i
  return [tuple(g[d] for d in range(devices)) for _, g in sorted(found.items())
          if sorted(g) == list(range(devices))]


def spread(
  problem: Problem, k: int, caps: Sequence[float] | None, choice: fbw_search.Choice,
  tolerance: float, kinds: Sequence[str],
) -> fbw_search.Choice:
  """`choice` with the pieces of split leaves spread where the price allows (module docstring)."""
  M = problem.devices
  groups = piece_groups(problem.names, M)
  if M < 2 or not groups or tolerance < 0:
    return choice
  limit = choice.step_s * (1 + tolerance)
  params = problem.param_bytes or (0,) * problem.num_nodes
  best = choice
  for group in sorted(groups, key=lambda g: -sum(params[n] for n in g)):
    if len({best.assignment[n] for n in group}) == M:
      continue
    options = []
    for r in range(M):
      a = list(best.assignment)
      for d, n in enumerate(group):
        a[n] = (d + r) % M
      got = fbw_search.best_schedule(problem, a, k, caps, kinds=[x for x in kinds if x != "custom"])
      if got is not None and got[2] <= limit:
        name, sch, step, mem = got
        options.append((max(mem), step, r, a, sch, mem))
    if options and min(options)[0] < max(best.peak_bytes or (float("inf"),)):
      _, step, _, a, sch, mem = min(options)
      best = dataclasses.replace(best, assignment=tuple(a), schedule=sch, step_s=step,
                                 peak_bytes=tuple(mem),
                                 found_by=best.found_by.split("+spread")[0] + "+spread")
  return best
