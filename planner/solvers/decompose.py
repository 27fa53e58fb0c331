"""Exact decomposition of a one-micro-batch problem at cut vertices.

A node v is a cut vertex when every other node is its ancestor or its descendant and no edge
jumps over it. With one micro-batch, everything before v ends before v starts and everything after
starts after v ends, so the makespan is the sum of the spans of the segments between consecutive
cut vertices, and a segment's best span depends only on the devices of its two cut vertices. Each
segment is solved by the MILP for each (entry device, exit device) pair (one pair per orbit of the
devices' symmetry group), and a dynamic program over the device of each cut vertex combines them.
The combination is exact; its gap is that of the segment solves (the DP of their lower bounds).
A segment MILP too big to leave every ordering free (milp.solve's `max_free_pairs`) keeps some of
its warm start's orderings; its own bound then holds for those orderings only, so the segment's
lower bound is bounds.fixed_bound instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Sequence

import numpy as np

from jaxhybrid.planner.lower_bounds import bounds as bounds_lib
from jaxhybrid.planner.search import heuristics as heur
from jaxhybrid.planner.solvers import milp
from jaxhybrid.planner.search.heuristics import Candidate, retimed
from jaxhybrid.planner.core.problem import Problem

log = logging.getLogger(__name__)

# Largest M for which the device symmetry group is found by enumerating permutations.
MAX_ENUMERATED_DEVICES = 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecompositionResult:
  """A one-micro-batch plan assembled from segment solves."""

  candidate: Candidate
  bound: float  # a valid lower bound on the optimal makespan
  all_optimal: bool  # every segment solve reached optimality (within the gap tolerance)
  segments: int
  solves: int


def cut_vertices(problem: Problem) -> list[int]:
  """Nodes comparable to all others with no edge jumping over them, in order."""
  n = problem.num_nodes
  anc = milp.ancestors(problem)
  desc_count = [0] * n
  for i in range(n):
    a = anc[i]
    while a:
      low = a & -a
      desc_count[low.bit_length() - 1] += 1
      a ^= low
  jump = np.zeros(n + 1, dtype=int)
  for s, d in problem.edges:
    jump[s + 1] += 1
    jump[d] -= 1
  jumped = np.cumsum(jump)
  return [
    v
    for v in range(n)
    if anc[v].bit_count() == v and desc_count[v] == n - 1 - v and jumped[v] == 0
  ]


def symmetry_group(problem: Problem) -> tuple[bool, list[tuple[int, ...]]]:
  """Device permutations that leave every transfer matrix unchanged.

  Returns:
    (uniform, group): uniform is True when each edge has one delay for every pair of distinct
    devices (then all permutations are symmetries and `group` is left empty).
  """
  M = problem.devices
  T = np.asarray(problem.transfer_s, dtype=float).reshape(len(problem.edges), M, M)
  off = ~np.eye(M, dtype=bool)
  if M < 2 or not len(problem.edges) or all(np.ptp(T[e][off]) == 0 for e in range(len(T))):
    return True, []
  if M > MAX_ENUMERATED_DEVICES:
    return False, [tuple(range(M))]
  group = [
    perm for perm in itertools.permutations(range(M))
    if np.array_equal(T[:, perm][:, :, perm], T)
  ]
  return False, group


def _pair_key(ab: tuple[int | None, int | None]) -> tuple[int, int]:
  return tuple(-1 if v is None else v for v in ab)


def _orbit_rep(a: int | None, b: int | None, uniform: bool, group, M: int):
  """A canonical (entry device, exit device) pair of the orbit of (a, b)."""
  if uniform:
    if a is None or b is None:
      return (None if a is None else 0, None if b is None else 0)
    return (0, 0) if a == b else (0, 1)
  images = [(None if a is None else g[a], None if b is None else g[b]) for g in group]
  return min(images, key=_pair_key)


def _map_candidate(cand: Candidate, a, b, ra, rb, uniform, group, M) -> Candidate:
  """Relabels devices of a solution for orbit representative (ra, rb) to serve (a, b)."""
  if (ra, rb) == (a, b):
    return cand
  if uniform:
    # Build a permutation sending ra -> a and rb -> b.
    want = {}
    if ra is not None:
      want[ra] = a
    if rb is not None and rb not in want:
      want[rb] = b
    rest_src = [d for d in range(M) if d not in want]
    rest_dst = [d for d in range(M) if d not in want.values()]
    want.update(zip(rest_src, rest_dst))
    perm = [want[d] for d in range(M)]
  else:
    perm = next(
      g for g in group
      if (ra is None or g[ra] == a) and (rb is None or g[rb] == b)
    )
  return dataclasses.replace(cand, assignment=tuple(perm[d] for d in cand.assignment))


def _sub_problem(problem: Problem, nodes: Sequence[int]) -> Problem:
  """The induced sub-problem on `nodes` (sorted), renumbered 0..len-1."""
  return problem.subproblem(nodes)


def solve(
  problem: Problem,
  *,
  time_limit_s: float,
  threads: int = 1,
  seed: int = 0,
  gap: float = 0.01,
  solver: str = "cbc",
  cuts: int = 0,
  max_nodes: int | None = None,
  evaluations: int | None = None,
  max_free_pairs: int = 4000,
) -> DecompositionResult:
  """Solves a one-micro-batch, uncapped problem segment by segment (see the module docstring).

  Args:
    problem: the problem (one micro-batch, memory caps not binding).
    time_limit_s: wall-clock budget of all segment solves together.
    threads, seed, gap, solver, cuts: MILP settings (PlannerOptions).
    max_nodes: branch-and-bound nodes of each segment solve (None: time alone).
    evaluations: placements the warm-start annealing of a segment evaluates per (node, device)
      pair (None: 200, and its time share may stop it first).
    max_free_pairs: most ordering binaries per segment MILP (milp.solve). A segment solved with
      fixed orderings only bounds the schedules that keep them; its bound is then the one of
      bounds.fixed_bound, valid for every schedule with the segment's entry and exit devices.

  Returns:
    The assembled schedule and a valid lower bound on the optimal makespan.
  """
  t0 = time.monotonic()
  n, M = problem.num_nodes, problem.devices
  cut_nodes = cut_vertices(problem)
  uniform, group = symmetry_group(problem)
  # Segments: (entry cut or None, exit cut or None, nodes).
  bounds = [None] + cut_nodes + [None]
  segments = []
  for a, b in zip(bounds, bounds[1:]):
    lo = 0 if a is None else a
    hi = n - 1 if b is None else b
    if a is None and b is not None and b == 0:
      continue  # empty prefix
    if b is None and a is not None and a == n - 1:
      segments.append((a, None, [a]))
      continue
    segments.append((a, b, list(range(lo, hi + 1))))
  # Work list of MILP solves, so that the time can be shared out.
  jobs = []
  for s_idx, (a, b, nodes) in enumerate(segments):
    if _trivial(a, b, nodes):
      continue
    reps = {
      _orbit_rep(da, db, uniform, group, M)
      for da in ([None] if a is None else range(M))
      for db in ([None] if b is None else range(M))
    }
    jobs.extend((s_idx, r) for r in sorted(reps, key=_pair_key))
  cache: dict[tuple, tuple[Candidate, float, bool]] = {}
  results: dict[tuple[int, tuple], tuple[Candidate, float, bool]] = {}
  solves = 0
  for job_idx, (s_idx, (ra, rb)) in enumerate(jobs):
    a, b, nodes = segments[s_idx]
    sub = _sub_problem(problem, nodes)
    fixed = {}
    if a is not None:
      fixed[0] = ra
    if b is not None:
      fixed[len(nodes) - 1] = rb
    key = (sub.compute_s, sub.edges, sub.transfer_s, ra, rb)
    if key in cache:
      results[(s_idx, (ra, rb))] = cache[key]
      continue
    warm = _warm_start(sub, fixed, seed, evaluations)
    if uniform:
      inter = [d for d in range(M) if d not in fixed.values()]
    else:
      inter = []
    left = time_limit_s - (time.monotonic() - t0)
    share = max(0.05, left / (len(jobs) - job_idx))
    res = milp.solve(
      sub, 1, warm=warm, fixed=fixed, interchangeable=inter,
      lower_bound=bounds_lib.lower_bound(sub, 1),
      time_limit_s=share, threads=threads, seed=seed, gap=gap, solver=solver, cuts=cuts,
      max_nodes=max_nodes, max_free_pairs=max_free_pairs,
    )
    solves += 1
    cand = res.candidate or warm
    # A restricted solve's bound holds only for the orderings it kept: use a bound valid for
    # every schedule of the segment with these end devices instead.
    lo = bounds_lib.fixed_bound(sub, 1, fixed) if res.restricted else res.bound
    out = (cand, lo, res.status == "optimal")
    cache[key] = results[(s_idx, (ra, rb))] = out

  # Spans per segment and device pair: (upper, lower, candidate or None).
  def span(s_idx: int, da, db):
    a, b, nodes = segments[s_idx]
    p = problem.compute_s
    if _trivial(a, b, nodes) and b is None:  # suffix holding only its entry
      return p[nodes[0]], p[nodes[0]], None, True
    if _trivial(a, b, nodes):  # two consecutive cut vertices
      e = problem.edges.index((a, b))
      v = p[a] + problem.transfer_s[e][da][db]
      return v, v, None, True
    ra, rb = _orbit_rep(da, db, uniform, group, M)
    cand, lo, opt = results[(s_idx, (ra, rb))]
    cand = _map_candidate(cand, da, db, ra, rb, uniform, group, M)
    last = len(nodes) - 1
    if b is None:
      return cand.makespan, lo, cand, opt
    pb = p[nodes[last]]
    first = 0.0 if a is None else cand.starts[0][0]
    return cand.starts[last][0] - first, max(0.0, lo - pb), cand, opt

  # DP over the device of each cut vertex: f[d] = (upper, lower) of everything before cut at d.
  inf = float("inf")
  f_up = {d: 0.0 for d in range(M)}
  f_lo = dict(f_up)
  choice = []
  all_opt = True
  for s_idx, (a, b, nodes) in enumerate(segments):
    prev_devs = [None] if a is None else list(range(M))
    next_devs = [None] if b is None else list(range(M))
    new_up, new_lo, arg = {}, {}, {}
    for db in next_devs:
      best = (inf, None)
      best_lo = inf
      for da in prev_devs:
        base_up = 0.0 if a is None else f_up[da]
        base_lo = 0.0 if a is None else f_lo[da]
        up, lo, _, _ = span(s_idx, da, db)
        if base_up + up < best[0]:
          best = (base_up + up, da)
        best_lo = min(best_lo, base_lo + lo)
      new_up[db], new_lo[db], arg[db] = best[0], best_lo, best[1]
    choice.append(arg)
    f_up, f_lo = new_up, new_lo
  upper, lower = f_up[None], f_lo[None]
  # Walk back the choices and assemble the schedule.
  devs = [None] * (len(segments) + 1)
  for s_idx in reversed(range(len(segments))):
    devs[s_idx] = choice[s_idx][devs[s_idx + 1]]
  assign = [0] * n
  starts = [[0.0] for _ in range(n)]
  offset = 0.0
  for s_idx, (a, b, nodes) in enumerate(segments):
    da, db = devs[s_idx], devs[s_idx + 1]
    up, _, cand, opt = span(s_idx, da, db)
    all_opt &= opt
    if cand is None:
      if a is not None:
        assign[a] = da
        starts[a][0] = offset
      if b is not None:
        assign[b] = db
    else:
      first = 0.0 if a is None else cand.starts[0][0]
      for r, v in enumerate(nodes):
        assign[v] = cand.assignment[r]
        starts[v][0] = offset + cand.starts[r][0] - first
    offset += up
  cand = retimed(problem, assign, starts)
  log.info("decomposition: %d cut vertices, %d segments, %d MILP solves, makespan %.6g "
           "(DP %.6g), bound %.6g, %.2fs", len(cut_nodes), len(segments), solves, cand.makespan,
           upper, lower, time.monotonic() - t0)
  return DecompositionResult(
    candidate=cand, bound=lower, all_optimal=all_opt,
    segments=len(segments), solves=solves,
  )


def _trivial(a: int | None, b: int | None, nodes: Sequence[int]) -> bool:
  """A segment needing no MILP: a lone last cut vertex, or two consecutive cut vertices."""
  return (b is None and len(nodes) == 1) or (a is not None and b is not None and len(nodes) == 2)


def _warm_start(sub: Problem, fixed: dict[int, int], seed: int,
                evaluations: int | None = None) -> Candidate:
  """The best of simple placements of a segment with fixed ends."""
  n = sub.num_nodes
  cands = []
  for d in sorted(set(fixed.values()) or {0}):
    assign = [fixed.get(i, d) for i in range(n)]
    cands.append(heur.evaluate(sub, assign, 1))
  e = heur.etf(sub, 1, None, fixed=fixed)
  if e is not None:
    cands.append(e)
  best = min(cands, key=lambda c: c.makespan)
  if evaluations is None:
    return heur.local_search(sub, 1, None, best, time_budget_s=0.05 * n, seed=seed, fixed=fixed)
  movable = max(1, n - len(fixed))
  return heur.local_search(sub, 1, None, best, time_budget_s=float("inf"), seed=seed, fixed=fixed,
                           max_evaluations=evaluations * movable * sub.devices)
