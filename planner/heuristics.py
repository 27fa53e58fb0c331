"""Placement heuristics: baselines for the MILP and its warm start / fallback.

- `single`: everything on device 0.
- `etf`: Baechi's m-ETF (Jeon et al. 2020): list scheduling that starts the earliest-startable
  task on the device where it starts earliest, skipping devices whose memory would overflow.
- `dp`: a contiguous split of the topological order into at most M stages, balanced by dynamic
  programming (PipeDream / GPipe style), each stage on its own device.
- `local`: hill climbing from the best of the others, moving one node at a time.
Each returns a `Candidate` (placement + schedule) or None when it cannot respect the memory caps.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Sequence

import numpy as np

from jaxhybrid.planner import schedule as sched
from jaxhybrid.planner.problem import Problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """A placement with a valid schedule."""

  assignment: tuple[int, ...]
  starts: tuple[tuple[float, ...], ...]  # starts[i][c]
  makespan: float


def fits(problem: Problem, assignment: Sequence[int], k: int, caps: Sequence[float] | None) -> bool:
  """Whether `assignment` respects the memory caps."""
  if caps is None:
    return True
  return all(u <= c for u, c in zip(sched.device_memory(problem, assignment, k), caps))


def evaluate(problem: Problem, assignment: Sequence[int], k: int) -> Candidate:
  """Schedules a fixed placement by list scheduling."""
  starts = sched.list_schedule(problem, assignment, k)
  return Candidate(
    assignment=tuple(int(d) for d in assignment),
    starts=tuple(tuple(r) for r in starts),
    makespan=sched.makespan(problem, starts),
  )


def single(problem: Problem, k: int, caps: Sequence[float] | None) -> Candidate | None:
  """All nodes on device 0 (the single-device baseline)."""
  assignment = [0] * problem.num_nodes
  return evaluate(problem, assignment, k) if fits(problem, assignment, k, caps) else None


def etf(
  problem: Problem,
  k: int,
  caps: Sequence[float] | None,
  fixed: dict[int, int] | None = None,
) -> Candidate | None:
  """m-ETF list scheduling with placement (a node's device is chosen with its micro-batch 0).

  Nodes in `fixed` (node -> device) keep their device.
  """
  n, p, M, T = problem.num_nodes, problem.compute_s, problem.devices, problem.transfer_s
  mem = problem.memory_bytes(k)
  prio = sched.priorities(problem)
  preds, succs = problem.predecessors(), problem.successors()
  assign = [-1] * n
  used = [0.0] * M
  for i, d in (fixed or {}).items():
    assign[i] = d
    used[d] += mem[i]
  waiting = [[len(preds[i]) + (1 if c else 0) for c in range(k)] for i in range(n)]
  starts = [[0.0] * k for _ in range(n)]
  ends = [[0.0] * k for _ in range(n)]
  dev_free = [0.0] * M
  ready = [(i, 0) for i in range(n) if not preds[i]]
  for _ in range(n * k):
    best_key, best = None, None
    for r, (i, c) in enumerate(ready):
      devs = [assign[i]] if assign[i] >= 0 else range(M)
      for d in devs:
        if assign[i] < 0 and caps is not None and used[d] + mem[i] > caps[d]:
          continue
        t = dev_free[d]
        for j, e in preds[i]:
          t = max(t, ends[j][c] + T[e][assign[j]][d])
        if c:
          t = max(t, ends[i][c - 1])
        key = (t, c, -prio[i], d, i)
        if best_key is None or key < best_key:
          best_key, best = key, (r, d)
    if best is None:
      return None  # some node fits on no device
    r, d = best
    i, c = ready.pop(r)
    if assign[i] < 0:
      assign[i] = d
      used[d] += mem[i]
    starts[i][c] = best_key[0]
    ends[i][c] = best_key[0] + p[i]
    dev_free[d] = ends[i][c]
    for j, _ in succs[i]:
      waiting[j][c] -= 1
      if not waiting[j][c]:
        ready.append((j, c))
    if c + 1 < k:
      waiting[i][c + 1] -= 1
      if not waiting[i][c + 1]:
        ready.append((i, c + 1))
  starts = sched.retime(problem, assign, starts)
  return Candidate(
    assignment=tuple(assign),
    starts=tuple(tuple(r) for r in starts),
    makespan=sched.makespan(problem, starts),
  )


def contiguous_dp(problem: Problem, k: int, caps: Sequence[float] | None) -> Candidate | None:
  """Balanced contiguous split of the node order into s <= M stages (stage j on device j).

  For each s the DP minimises the bottleneck stage time (compute plus the delay of edges entering
  the stage, with device 0 -> 1 delays), subject to each stage's memory fitting the smallest cap.
  Every s is then scheduled with k micro-batches and the best makespan is kept.
  """
  n, M, p = problem.num_nodes, problem.devices, np.asarray(problem.compute_s)
  if n == 0:
    return None
  mem = np.asarray(problem.memory_bytes(k), dtype=float)
  cap = min(caps) if caps is not None else np.inf
  cp = np.concatenate([[0.0], np.cumsum(p)])
  cm = np.concatenate([[0.0], np.cumsum(mem)])
  # A[s, d]: delay of edge s -> d; incoming(i, j) = sum over edges with src < i <= dst < j.
  A = np.zeros((n + 1, n + 1))
  for e, (s, d) in enumerate(problem.edges):
    A[s + 1, d + 1] += problem.transfer_s[e][0][1 % M]
  P = A.cumsum(0).cumsum(1)  # P[a, b] = sum of A[:a+1, :b+1]

  def cost(i: int, j: int) -> float:  # stage = nodes i..j-1
    if cm[j] - cm[i] > cap:
      return np.inf
    incoming = P[i, j] - P[i, i] if i > 0 else 0.0
    return cp[j] - cp[i] + incoming

  best_cand = None
  inf = float("inf")
  # f[s][j]: best bottleneck of the first j nodes in s stages; arg for the split point.
  f = [[inf] * (n + 1) for _ in range(M + 1)]
  arg = [[0] * (n + 1) for _ in range(M + 1)]
  f[0][0] = 0.0
  for s in range(1, M + 1):
    for j in range(1, n + 1):
      for i in range(s - 1, j):
        if f[s - 1][i] == inf:
          continue
        v = max(f[s - 1][i], cost(i, j))
        if v < f[s][j]:
          f[s][j], arg[s][j] = v, i
    if f[s][n] == inf:
      continue
    assign, j = [0] * n, n
    for stage in range(s, 0, -1):
      i = arg[stage][j]
      assign[i:j] = [stage - 1] * (j - i)
      j = i
    cand = evaluate(problem, assign, k)
    if best_cand is None or cand.makespan < best_cand.makespan:
      best_cand = cand
  return best_cand


def local_search(
  problem: Problem,
  k: int,
  caps: Sequence[float] | None,
  start: Candidate,
  time_budget_s: float,
  seed: int = 0,
  fixed: dict[int, int] | None = None,
) -> Candidate:
  """First-improvement hill climbing over single-node moves, from `start`, within a time budget."""
  rng = random.Random(seed)
  deadline = time.monotonic() + time_budget_s
  best = start
  mem = problem.memory_bytes(k)
  n, M = problem.num_nodes, problem.devices
  improved = True
  while improved and time.monotonic() < deadline:
    improved = False
    moves = [(i, d) for i in range(n) if i not in (fixed or {}) for d in range(M)]
    rng.shuffle(moves)
    used = sched.device_memory(problem, best.assignment, k)
    for i, d in moves:
      if time.monotonic() >= deadline:
        break
      if best.assignment[i] == d:
        continue
      if caps is not None and used[d] + mem[i] > caps[d]:
        continue
      assign = list(best.assignment)
      assign[i] = d
      cand = evaluate(problem, assign, k)
      if cand.makespan < best.makespan * (1 - 1e-9):
        best, improved = cand, True
        used = sched.device_memory(problem, best.assignment, k)
  return best
