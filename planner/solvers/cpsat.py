"""Placement and pipelined schedule with OR-Tools CP-SAT: the k > 1 search before the MILP.

The model is the pipelined MILP's (milp.py): node i goes on one device d (x[i, d]); each of its k
tasks (i, c) is an interval of length p_i on that device; the tasks of a node run in micro-batch
order; a device runs one task at a time; task (i, c) starts after (j, c) ends plus the delay
T_e[a][b] of edge e = (j, i) when j is on a and i on b; the makespan C ends every task. CP-SAT
states the device choice as optional intervals (one per device, present iff x[i, d]) under a
NoOverlap per device, the textbook form of flexible job-shop scheduling, and searches it with
its scheduling neighbourhoods (large neighbourhood search on intervals, precedences and time
windows). On Inception-V3 (M = 4, k = 4, DGX-1 costs, two workers) it finds 0.39-0.40 s
schedules in 40 s where the annealing and window descent of heuristics.py reach 0.42-0.44 s.

CP-SAT works on integers. Every time is scaled by `scale` and rounded DOWN, which makes the
integer model a relaxation of the real one: a real schedule with starts s maps to the integer
starts floor(scale s), which satisfy every rounded-down constraint (floor(a + b) >= floor(a) +
floor(b)). So CP-SAT's proven bound, divided by `scale`, is a lower bound on the real makespan.
Memory is rounded down and the caps up, for the same reason. Its schedules are not used as they
are: the placement and each device's order of tasks are re-timed with the real times
(schedule.retime) and checked against the real caps, so a returned candidate is exactly valid.

OR-Tools and python-mip cannot share a process: both bundle COIN-OR libraries (libOsiClp and
others) under the same sonames but built differently, so whichever loads second fails to resolve
its symbols. The CP-SAT model is therefore built and solved in a child Python process
(cpsat_worker.py, run as a plain script so that it imports nothing of jaxhybrid), fed the
integer data as JSON.

The MILP remains the optimiser of record (place.py): it starts from this search's best schedule.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Sequence

from jaxhybrid.planner.lower_bounds import bounds as bounds_lib
from jaxhybrid.planner.solvers import decompose
from jaxhybrid.planner.search import heuristics as heur
from jaxhybrid.planner.core.problem import Problem

log = logging.getLogger(__name__)

# Integer time units over the warm start's makespan: rounding each time down loses at most one
# unit per constraint, ~1e-7 of the makespan along a path of the paper's graphs.
_UNITS = 10_000_000
# Seconds kept back from the limit for the child process to start and import OR-Tools.
_STARTUP_S = 0.7
# Seconds past the limit after which a child process that has not answered is killed.
_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpResult:
  """What the CP-SAT search returned."""

  # The best schedule found, re-timed with the real times (never worse than the warm start).
  candidate: heur.Candidate
  # A lower bound on the makespan of every placement and schedule (CP-SAT's proven bound).
  bound: float
  # CP-SAT's status name: OPTIMAL, FEASIBLE, UNKNOWN or INFEASIBLE.
  status: str
  solve_time_s: float


def _symmetries(
  problem: Problem, caps: Sequence[float] | None = None
) -> list[tuple[int, ...]]:
  """Device permutations that leave every transfer matrix AND every memory cap unchanged.

  Only such a permutation maps each valid schedule to a valid schedule of the same makespan, so
  only these may restrict where the first node goes (decompose.symmetry_group gives the link
  symmetries; a device with a smaller cap is not interchangeable with one with a larger cap).

  Returns:
    Permutations (perm[d] is the image of device d) whose orbits are the classes of
    interchangeable devices, the identity included.
  """
  uniform, group = decompose.symmetry_group(problem)
  M = problem.devices
  cap = tuple(caps) if caps is not None else (0.0,) * M
  if not uniform:
    return [g for g in group if all(cap[g[d]] == cap[d] for d in range(M))]
  # All permutations preserve the links; the transpositions (0 b), (a b) among devices of equal
  # cap generate the permutations that also preserve the caps, and have the same orbits.
  out = [tuple(range(M))]
  for a in range(M):
    for b in range(a + 1, M):
      if cap[a] == cap[b]:
        out.append(tuple(b if d == a else a if d == b else d for d in range(M)))
  return out


def _device_orbits(group: Sequence[tuple[int, ...]], devices: int) -> list[int]:
  """One device of each orbit under `group`: any schedule can be relabelled by a symmetry so
  that the first node sits on one of these."""
  reps, seen = [], set()
  for d in range(devices):
    if d not in seen:
      reps.append(d)
      seen.update(perm[d] for perm in group)
      seen.add(d)
  return reps


def _relabel(warm: heur.Candidate, group: Sequence[tuple[int, ...]], reps: Sequence[int]):
  """`warm` with its devices permuted by a symmetry that puts its first node on a device of
  `reps` (the same schedule; device d becomes perm[d])."""
  if not warm.assignment or warm.assignment[0] in reps:
    return warm
  perm = next(g for g in group if g[warm.assignment[0]] in reps)
  return dataclasses.replace(warm, assignment=tuple(perm[d] for d in warm.assignment))


def solve(
  problem: Problem,
  k: int,
  *,
  warm: heur.Candidate,
  caps: Sequence[float] | None = None,
  lower_bound: float = 0.0,
  time_limit_s: float = 10.0,
  threads: int = 1,
  seed: int = 0,
  gap: float = 0.0,
  deterministic_time: float | None = None,
) -> CpResult:
  """Searches placements and pipelined schedules from `warm` (see the module docstring).

  Args:
    problem: the problem.
    k: micro-batches.
    warm: a valid candidate (its placement and starts are given to CP-SAT as a hint).
    caps: memory cap per device, or None.
    lower_bound: a proven lower bound on the makespan (added as a constraint; CP-SAT's bound is
      never below it).
    time_limit_s: wall-clock limit, the child process's start included.
    threads: CP-SAT workers. With one, its subsolvers are interleaved in the one thread so that
      the neighbourhood search still runs.
    seed: CP-SAT's random seed.
    gap: stop once the best schedule is within this relative gap of the bound.
    deterministic_time: CP-SAT's deterministic time limit (`max_deterministic_time`), or None;
      with threads=1 the search is then reproducible whatever the machine's load, as long as
      `time_limit_s` does not stop it first.

  Returns:
    The best candidate (the warm start when CP-SAT finds nothing better) and the bound. When the
    child process fails, the warm start and `lower_bound`, with status 'ERROR' (and a warning).
  """
  t0 = time.monotonic()
  n, M, p, T = problem.num_nodes, problem.devices, problem.compute_s, problem.transfer_s
  horizon = warm.makespan
  if n == 0 or horizon <= 0:
    return CpResult(candidate=warm, bound=lower_bound, status="OPTIMAL", solve_time_s=0.0)
  scale = _UNITS / horizon
  group = _symmetries(problem, caps)
  reps = _device_orbits(group, M)
  hint = _relabel(warm, group, reps)

  def units(seconds: float) -> int:  # rounded down: the integer model relaxes the real one
    return math.floor(seconds * scale)

  data = dict(
    k=k, devices=M,
    durations=[units(v) for v in p],
    edges=[list(e) for e in problem.edges],
    delays=[[[units(v) for v in row] for row in T[e]] for e in range(len(T))],
    horizon=_UNITS + 1,  # every improving schedule ends within the warm start's makespan
    lower=max(0, units(lower_bound)),
    # Rounded so that the integer caps relax the real ones (the bound stays valid); schedules
    # that then overflow a real cap are dropped below.
    memory=None if caps is None else [math.floor(v) for v in problem.memory_bytes(k)],
    caps=None if caps is None else [math.ceil(c) for c in caps],
    first_devices=reps,
    # Earliest start of each task and least time from its end to the makespan, valid for every
    # placement (bounds._earliest): they narrow CP-SAT's domains.
    release=[[units(v) for v in row] for row in bounds_lib._earliest(problem, k, False)],
    tail=[[units(v) for v in row] for row in bounds_lib._earliest(problem, k, True)],
    hint_assignment=list(hint.assignment),
    hint_starts=[[min(_UNITS + 1, units(v)) for v in row] for row in hint.starts],
    time_limit_s=max(0.1, time_limit_s - (time.monotonic() - t0) - _STARTUP_S),
    threads=threads, seed=seed, gap=gap, deterministic_time=deterministic_time,
  )
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpsat_worker.py")
  try:
    proc = subprocess.run(
      [sys.executable, worker], input=json.dumps(data), capture_output=True, text=True,
      timeout=time_limit_s + _GRACE_S, check=True,
    )
    out = json.loads(proc.stdout)
  except (subprocess.SubprocessError, OSError, ValueError) as err:
    detail = getattr(err, "stderr", "") or ""
    log.warning("The CP-SAT search failed (%s%s); keeping the warm start.", type(err).__name__,
                f": {detail.strip().splitlines()[-1]}" if detail.strip() else "")
    return CpResult(candidate=warm, bound=lower_bound, status="ERROR",
                    solve_time_s=time.monotonic() - t0)
  elapsed = time.monotonic() - t0
  status = out["status"]
  if status == "INFEASIBLE":
    # Nothing ends before the warm start's makespan (the horizon): the warm start is optimal.
    return CpResult(candidate=warm, bound=warm.makespan, status=status, solve_time_s=elapsed)
  bound = lower_bound
  if out.get("bound") is not None:
    bound = max(bound, out["bound"] / scale)
  best = warm
  if out.get("assignment") is not None:
    assignment = out["assignment"]
    cand = heur.retimed(problem, assignment, [[float(v) for v in row] for row in out["starts"]])
    if cand.makespan < best.makespan and heur.fits(problem, assignment, k, caps):
      best = cand
  log.debug("cpsat n=%d k=%d M=%d %s best=%.6g bound=%.6g %.1fs", n, k, M, status, best.makespan,
            bound, elapsed)
  return CpResult(candidate=best, bound=bound, status=status, solve_time_s=elapsed)
