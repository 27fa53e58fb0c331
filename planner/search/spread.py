"""Spread a split leaf's pieces, one per device, and balance the devices' rows, when the step
pays (almost) nothing for it.

A leaf split into M pieces (`jaxhybrid.graph.shard`: shard nodes named `<node>/shard<d>` or
`<node>/<key>.shard<d>`) divides its memory by M only if the pieces sit on different devices. The
lock-step search minimises the step time, and under a roomy memory cap it has no reason to
spread the pieces of a cheap lookup. This pass tries, for each split leaf (largest first), the
M rotations "piece d on device (d + r) mod M" (first for every split leaf at once) and keeps the
one with the smallest per-device peak memory whose lock-step price stays within `tolerance` of the
search's price: memory for (nearly) free, never more than that tolerance of step time.
`spread_seeds` gives the lock-step search the same placements spread from the start.

`balance` does the same for whole nodes: every device allocates the fullest device's rows, so
moving a node off the fullest device lowers every device's memory; it moves one node at a time
(the move that lowers the peak most while the price stays within the tolerance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.pricing import lockstep_rule
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.search import fbw_search

# Assumption (deterministic work limit, no clock): placements the balance pass prices at most.
BALANCE_MAX_EVALUATIONS = 400


def piece_groups(names: Sequence[str], devices: int) -> list[tuple[int, ...]]:
  """Node ids of each split leaf's M shard nodes, piece order (only complete groups)."""
  found: dict[str, dict[int, int]] = {}
  for i, name in enumerate(names):
    m = lockstep_rule.PIECE_NAME.match(name)
    if m:
      found.setdefault(m.group(1), {})[int(m.group(2))] = i
  return [tuple(g[d] for d in range(devices)) for _, g in sorted(found.items())
          if sorted(g) == list(range(devices))]


def spread_all(assignment: Sequence[int], groups: Sequence[tuple[int, ...]], devices: int,
               rotation: int = 0) -> tuple[int, ...]:
  """`assignment` with piece d of every split leaf on device (d + rotation) mod `devices`."""
  a = list(assignment)
  for group in groups:
    for d, n in enumerate(group):
      a[n] = (d + rotation) % devices
  return tuple(a)


def spread_seeds(
  problem: Problem, seeds: Mapping[str, tuple[Sequence[int], Any]],
) -> dict[str, tuple[tuple[int, ...], None]]:
  """Each seed placement with every split leaf spread (piece d on device d), named
  `<seed>+spread`. The searches that find the seeds cap what each device owns; every device
  allocates the longest device's rows, so a plan that keeps two large leaves whole on different
  devices can fit their caps and not the program's, where the same plan with the leaves spread
  fits (paper BigLSTM on 1x8 under 6 GiB)."""
  groups = piece_groups(problem.names, problem.devices)
  if problem.devices < 2 or not groups:
    return {}
  out = {}
  for name, (assignment, _) in seeds.items():
    a = spread_all(assignment, groups, problem.devices)
    if a != tuple(assignment):
      out[f"{name}+spread"] = (a, None)
  return out


def spread(
  problem: Problem, k: int, caps: Sequence[float] | None, choice: fbw_search.Choice,
  tolerance: float, kinds: Sequence[str],
) -> fbw_search.Choice:
  """`choice` with the pieces of split leaves spread where the price allows (module docstring).
  Every leaf spread at once (each rotation) is tried before one leaf at a time: spreading one
  leaf alone can raise the peak (its pieces land beside another leaf kept whole)."""
  M = problem.devices
  groups = piece_groups(problem.names, M)
  if M < 2 or not groups or tolerance < 0:
    return choice
  limit = choice.step_s * (1 + tolerance)
  params = problem.param_bytes or (0,) * problem.num_nodes
  best = choice
  generated = [x for x in kinds if x != "custom"]

  def option(a: tuple[int, ...]):
    got = fbw_search.best_schedule(problem, a, k, caps, kinds=generated)
    if got is None or got[2] > limit:
      return None
    _, sch, step, mem = got
    return max(mem), step, a, sch, mem

  def take(options) -> None:
    nonlocal best
    options = [o for o in options if o is not None]
    if options and min(options)[0] < max(best.peak_bytes or (float("inf"),)):
      _, step, a, sch, mem = min(options, key=lambda o: (o[0], o[1], o[2]))
      best = dataclasses.replace(best, assignment=a, schedule=sch, step_s=step,
                                 peak_bytes=tuple(mem),
                                 found_by=best.found_by.split("+spread")[0] + "+spread")

  def spread_already(group: tuple[int, ...]) -> bool:
    return len({best.assignment[n] for n in group}) == M

  if len(groups) > 1 and not all(spread_already(g) for g in groups):
    take(option(spread_all(best.assignment, groups, M, r)) for r in range(M))
  for group in sorted(groups, key=lambda g: -sum(params[n] for n in g)):
    if spread_already(group):
      continue
    take(option(spread_all(best.assignment, [group], M, r)) for r in range(M))
  return best


def balance(
  problem: Problem, k: int, caps: Sequence[float] | None, choice: fbw_search.Choice,
  tolerance: float, kinds: Sequence[str], evaluations: int = BALANCE_MAX_EVALUATIONS,
) -> fbw_search.Choice:
  """`choice` with nodes moved off the device that owns the most static bytes (parameters,
  optimizer state, gradients) while that lowers the per-device peak and the lock-step price
  stays within `tolerance` of `choice`'s. Each round prices every move of a node with static
  bytes from the fullest device to another device (largest nodes first) and keeps the one with
  the lowest peak, then the lowest price; it stops when no move lowers the peak or after
  `evaluations` priced placements. Deterministic (no clock). The pass runs after the MILP
  search only: a placement asked for by name (planner='single', 'interleaved', ...) is kept as
  the heuristic made it. Only problems with split leaves (`piece_groups`) are balanced: on
  whole-node plans the peak it lowers is the planner's, which misses the program's group buffers
  (GNMT small 1x4, bench_memory's planned row: balanced, 0.063 -> 0.077 GiB compiled)."""
  M = problem.devices
  if M < 2 or tolerance < 0 or not any(problem.static_bytes):
    return choice
  if not piece_groups(problem.names, M):
    return choice  # no split leaf (docstring)
  limit = choice.step_s * (1 + tolerance)
  generated = [x for x in kinds if x != "custom"]
  best, spent = choice, 0
  while spent < evaluations:
    static = price_lib.device_static_bytes(problem, best.assignment)
    full = max(range(M), key=lambda d: (static[d], -d))
    movable = sorted((i for i, d in enumerate(best.assignment)
                      if d == full and problem.static_bytes[i] > 0),
                     key=lambda i: (-problem.static_bytes[i], i))
    peak = max(best.peak_bytes or (float("inf"),))
    options = []
    for i in movable:
      for d in sorted(range(M), key=lambda d: (static[d], d)):
        if d == full or spent >= evaluations:
          continue
        a = list(best.assignment)
        a[i] = d
        spent += 1
        got = fbw_search.best_schedule(problem, a, k, caps, kinds=generated)
        if got is None or got[2] > limit or max(got[3]) >= peak:
          continue
        options.append((max(got[3]), got[2], tuple(a), got[1], tuple(got[3])))
    if not options:
      break
    mem, step, a, sch, peaks = min(options, key=lambda o: (o[0], o[1], o[2]))
    best = dataclasses.replace(best, assignment=a, schedule=sch, step_s=step, peak_bytes=peaks,
                               found_by=best.found_by.split("+balance")[0] + "+balance")
  return best
