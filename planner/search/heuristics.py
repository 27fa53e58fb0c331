"""Placement heuristics: baselines for the MILP and its warm start / fallback.

- `single`: everything on device 0.
- `etf`: Baechi's m-ETF (Jeon et al. 2020): list scheduling that starts the earliest-startable
  task on the device where it starts earliest, skipping devices whose memory would overflow.
- `dp`: a contiguous split of the topological order into at most M stages, balanced by dynamic
  programming (PipeDream / GPipe style), each stage on its own device.
- `interleaved`: round-robin chunks of the node order (an interleaved pipeline, for k > 1).
- `local`: simulated annealing from the best of the others (one-node, swap and run moves); with
  k > 1 optionally followed by `window_search` (PlannerOptions.window_search_share), an
  exhaustive re-placement of windows of consecutive nodes. With the MILP and k > 1 the CP-SAT
  search (cpsat.py) then starts from it; its result is listed as `cpsat`.
Each returns a `Candidate` (placement + schedule) or None when it cannot respect the memory caps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from typing import Sequence

import numpy as np

from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.core.problem import Problem


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


def retimed(problem: Problem, assignment: Sequence[int], starts: sched.Starts) -> Candidate:
  """A placement with starts from a solver or a list scheduler, left-shifted on the real times
  (schedule.retime, which keeps each device's order)."""
  real = sched.retime(problem, assignment, starts)
  return Candidate(
    assignment=tuple(int(d) for d in assignment),
    starts=tuple(tuple(r) for r in real),
    makespan=sched.makespan(problem, real),
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
  return retimed(problem, assign, starts)


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


def interleaved(problem: Problem, k: int, caps: Sequence[float] | None,
                max_rounds: int = 8) -> Candidate | None:
  """Interleaved pipeline stages (as in Megatron-LM's interleaved schedule, Narayanan et al. 2021).

  The topological order is cut into r M chunks of about equal compute and chunk j goes to device
  j mod M, for r = 1..max_rounds; with k > 1 micro-batches more rounds shorten the pipeline's fill
  and drain at the price of more transfers. The best schedule that fits the caps is returned.
  """
  n, M, p = problem.num_nodes, problem.devices, problem.compute_s
  total = sum(p)
  if n == 0 or total <= 0:
    return None
  best = None
  for rounds in range(1, max_rounds + 1):
    chunks, acc, assign = rounds * M, 0.0, []
    for i in range(n):
      mid = acc + p[i] / 2  # a node joins the chunk holding its midpoint
      assign.append(min(int(mid / total * chunks), chunks - 1) % M)
      acc += p[i]
    if not fits(problem, assign, k, caps):
      continue
    cand = evaluate(problem, assign, k)
    if best is None or cand.makespan < best.makespan:
      best = cand
  return best


def local_search(
  problem: Problem,
  k: int,
  caps: Sequence[float] | None,
  start: Candidate,
  time_budget_s: float,
  seed: int = 0,
  fixed: dict[int, int] | None = None,
  max_evaluations: int | None = None,
  temperature: float = 0.02,
  target: float = 0.0,
) -> Candidate:
  """Simulated annealing over placements from `start`, each placement list-scheduled.

  A move reassigns one node, swaps the devices of two nodes, or moves a run of 2..6 consecutive
  nodes (in topological order) to one device. A worse placement is accepted with probability
  exp(-increase / T), T cooling linearly from `temperature` x the start makespan to 0; the search
  restarts from the best placement at each quarter of its budget.

  Args:
    problem: the problem.
    k: micro-batches.
    caps: memory cap per device, or None.
    start: the placement to start from (its makespan is never worsened).
    time_budget_s: wall-clock budget.
    seed: random seed.
    fixed: node -> device for nodes that must not move.
    max_evaluations: most placements evaluated (default 200 per (node, device) pair); the search
      is reproducible when this, not the time budget, ends it.
    temperature: initial temperature relative to the start makespan.
    target: stop once the best makespan is at most this (e.g. within the gap of a lower bound).

  Returns:
    The best candidate seen.
  """
  rng = random.Random(seed)
  t0 = time.monotonic()
  n, M = problem.num_nodes, problem.devices
  fixed = fixed or {}
  movable = [i for i in range(n) if i not in fixed]
  if not movable or M < 2:
    return start
  budget = max_evaluations if max_evaluations is not None else 200 * len(movable) * M
  mem = problem.memory_bytes(k)
  best = cur = start
  seen: dict[tuple[int, ...], float] = {start.assignment: start.makespan}
  t_start = temperature * start.makespan
  quarter = 0
  for it in range(budget):
    elapsed = time.monotonic() - t0
    if elapsed >= time_budget_s or best.makespan <= target:
      break
    frac = max(it / budget, elapsed / time_budget_s)
    if int(frac * 4) > quarter:
      quarter, cur = int(frac * 4), best
    assign = list(cur.assignment)
    move = rng.random()
    if move < 0.6:
      assign[rng.choice(movable)] = rng.randrange(M)
    elif move < 0.8:
      i, j = rng.choice(movable), rng.choice(movable)
      assign[i], assign[j] = assign[j], assign[i]
    else:
      i, d = rng.choice(movable), rng.randrange(M)
      for j in range(i, min(n, i + rng.randint(2, 6))):
        if j not in fixed:
          assign[j] = d
    key = tuple(assign)
    if key == cur.assignment:
      continue
    if caps is not None:
      used = [0.0] * M
      for i, d in enumerate(assign):
        used[d] += mem[i]
      if any(u > c for u, c in zip(used, caps)):
        continue
    if key in seen and seen[key] >= cur.makespan:
      continue  # known not to help; revisits cost a schedule each
    cand = evaluate(problem, assign, k)
    seen[key] = cand.makespan
    delta = cand.makespan - cur.makespan
    temp = t_start * (1 - frac)
    if delta <= 0 or (temp > 0 and rng.random() < math.exp(-delta / temp)):
      cur = cand
      if cand.makespan < best.makespan * (1 - 1e-9):
        best = cand
  return best


def window_search(
  problem: Problem,
  k: int,
  caps: Sequence[float] | None,
  start: Candidate,
  time_budget_s: float,
  max_window_placements: int = 512,
  fixed: dict[int, int] | None = None,
  target: float = 0.0,
) -> Candidate:
  """Exhaustive re-placement of windows of consecutive nodes (a large-neighbourhood descent).

  For each window of w consecutive nodes in topological order (w the largest with M^w <=
  `max_window_placements`), every placement of the window's nodes is list-scheduled with the rest
  kept where they are, and the first improvement is taken; the windows slide over the graph until
  a full pass finds nothing or the time is up. It reaches placements that annealing
  (`local_search`) does not, where several neighbouring nodes must move together: on Inception-V3
  (M = 2, k = 4) windows of 9 nodes took an annealed 0.674 s schedule to 0.665 s in 40 s, windows
  of 5 found nothing.

  Args:
    problem: the problem.
    k: micro-batches.
    caps: memory cap per device, or None.
    start: the placement to start from (never worsened).
    time_budget_s: wall-clock budget.
    max_window_placements: most placements tried per window (sets w).
    fixed: node -> device for nodes that must not move.
    target: stop once the makespan is at most this.

  Returns:
    The best candidate found.
  """
  t0 = time.monotonic()
  n, M = problem.num_nodes, problem.devices
  fixed = fixed or {}
  if M < 2 or n == 0:
    return start
  w = max(1, min(n, int(math.log(max_window_placements) / math.log(M) + 1e-9)))
  mem = problem.memory_bytes(k)
  best = start
  improved = True
  while improved:
    improved = False
    for s in range(n - w + 1):
      free = [i for i in range(s, s + w) if i not in fixed]
      for combo in itertools.product(range(M), repeat=len(free)):
        if time.monotonic() - t0 >= time_budget_s or best.makespan <= target:
          return best
        assign = list(best.assignment)
        for i, d in zip(free, combo):
          assign[i] = d
        if tuple(assign) == best.assignment:
          continue
        if caps is not None:
          used = [0.0] * M
          for i, d in enumerate(assign):
            used[d] += mem[i]
          if any(u > c for u, c in zip(used, caps)):
            continue
        cand = evaluate(problem, assign, k)
        if cand.makespan < best.makespan * (1 - 1e-9):
          best, improved = cand, True
  return best
