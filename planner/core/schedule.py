"""Schedules of a placed problem: list scheduling, re-timing and an independent checker.

Lower bounds live in bounds.py.

A schedule runs every node i once per micro-batch c (the task (i, c)) on the node's device. The
timing model is PAPER.md's: a task takes p_i; a task may start once, for every edge (j, i), task
(j, c) has ended and the edge's transfer delay (0 on one device) has passed; one task at a time per
device. Micro-batches of one node run in order (c before c + 1), as in GPipe.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxhybrid.planner.core.problem import Problem

# Tolerance of the schedule checker, seconds (solver output is rounded to ~1e-9).
TOLERANCE_S = 1e-7


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
  """One node run on one micro-batch."""

  node: int
  microbatch: int
  device: int
  start_s: float
  end_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transfer:
  """An activation (and, in training, its gradient) crossing devices."""

  src_node: int
  dst_node: int
  microbatch: int
  src_device: int
  dst_device: int
  start_s: float
  end_s: float
  bytes: int


Starts = list[list[float]]  # starts[i][c]: start time of task (i, c)


def heads_tails(problem: Problem) -> tuple[list[float], list[float]]:
  """Longest paths ignoring transfers: head_i (before i starts) and tail_i (after i ends)."""
  n, p = problem.num_nodes, problem.compute_s
  head, tail = [0.0] * n, [0.0] * n
  preds, succs = problem.predecessors(), problem.successors()
  for i in range(n):
    head[i] = max((head[j] + p[j] for j, _ in preds[i]), default=0.0)
  for i in reversed(range(n)):
    tail[i] = max((p[j] + tail[j] for j, _ in succs[i]), default=0.0)
  return head, tail


def priorities(problem: Problem) -> list[float]:
  """Bottom levels p_i + tail_i (HEFT's upward rank without transfers): larger runs first."""
  _, tail = heads_tails(problem)
  return [p + t for p, t in zip(problem.compute_s, tail)]


def list_schedule(
  problem: Problem,
  assignment: Sequence[int],
  microbatches: int,
  prio: Sequence[float] | None = None,
) -> Starts:
  """Earliest-task-first list scheduling of a fixed placement.

  Repeatedly starts the ready task that can start earliest on its device; ties go to the earlier
  micro-batch (GPipe order), then the larger priority.

  Args:
    problem: the problem.
    assignment: device of each node.
    microbatches: k.
    prio: priority per node (default: bottom levels).

  Returns:
    starts[i][c].
  """
  n, k, p = problem.num_nodes, microbatches, problem.compute_s
  prio = prio if prio is not None else priorities(problem)
  preds, succs = problem.predecessors(), problem.successors()
  T = problem.transfer_s
  waiting = [[len(preds[i]) + (1 if c else 0) for c in range(k)] for i in range(n)]
  ready_at = [[0.0] * k for _ in range(n)]
  starts: Starts = [[0.0] * k for _ in range(n)]
  dev_free = [0.0] * problem.devices
  ready = [(i, 0) for i in range(n) if not preds[i]]
  for _ in range(n * k):
    best, best_key = -1, None
    for r, (i, c) in enumerate(ready):
      key = (max(ready_at[i][c], dev_free[assignment[i]]), c, -prio[i], i)
      if best_key is None or key < best_key:
        best, best_key = r, key
    i, c = ready.pop(best)
    t0 = best_key[0]
    end = t0 + p[i]
    starts[i][c] = t0
    dev_free[assignment[i]] = end
    for j, e in succs[i]:
      arrive = end + T[e][assignment[i]][assignment[j]]
      ready_at[j][c] = max(ready_at[j][c], arrive)
      waiting[j][c] -= 1
      if not waiting[j][c]:
        ready.append((j, c))
    if c + 1 < k:
      ready_at[i][c + 1] = max(ready_at[i][c + 1], end)
      waiting[i][c + 1] -= 1
      if not waiting[i][c + 1]:
        ready.append((i, c + 1))
  return starts


def retime(problem: Problem, assignment: Sequence[int], starts: Starts) -> Starts:
  """Left-shifts a schedule, keeping each device's order of tasks (a semi-active schedule).

  The order on a device is that of `starts` (ties by node, then micro-batch). No start moves
  later, so a valid schedule stays valid and its makespan does not grow. Should rounding in
  `starts` make that order contradict precedence, the placement is list-scheduled instead.
  """
  n, p, T, M = problem.num_nodes, problem.compute_s, problem.transfer_s, problem.devices
  k = len(starts[0]) if n else 0
  preds = problem.predecessors()
  queues: list[list[tuple[int, int]]] = [[] for _ in range(M)]
  for _, i, c in sorted((starts[i][c], i, c) for i in range(n) for c in range(k)):
    queues[assignment[i]].append((i, c))
  new: Starts = [[0.0] * k for _ in range(n)]
  done = [[False] * k for _ in range(n)]
  ptr, dev_free, left = [0] * M, [0.0] * M, n * k
  while left:
    progressed = False
    for d in range(M):
      while ptr[d] < len(queues[d]):
        i, c = queues[d][ptr[d]]
        if any(not done[j][c] for j, _ in preds[i]) or (c and not done[i][c - 1]):
          break
        t = dev_free[d]
        for j, e in preds[i]:
          t = max(t, new[j][c] + p[j] + T[e][assignment[j]][d])
        if c:
          t = max(t, new[i][c - 1] + p[i])
        new[i][c], done[i][c] = t, True
        dev_free[d] = t + p[i]
        ptr[d] += 1
        left -= 1
        progressed = True
    if not progressed:
      return list_schedule(problem, assignment, k)
  return new


def makespan(problem: Problem, starts: Starts) -> float:
  """The time the last task ends."""
  p = problem.compute_s
  return max((s + p[i] for i, row in enumerate(starts) for s in row), default=0.0)


def to_tasks(problem: Problem, assignment: Sequence[int], starts: Starts) -> tuple[Task, ...]:
  """The schedule as Tasks sorted by (start, node, micro-batch)."""
  p = problem.compute_s
  tasks = [
    Task(node=i, microbatch=c, device=int(assignment[i]), start_s=s, end_s=s + p[i])
    for i, row in enumerate(starts)
    for c, s in enumerate(row)
  ]
  return tuple(sorted(tasks, key=lambda t: (t.start_s, t.node, t.microbatch)))


def to_transfers(
  problem: Problem, assignment: Sequence[int], starts: Starts
) -> tuple[Transfer, ...]:
  """Cross-device edges of the schedule, each starting when its source task ends."""
  out = []
  p, T = problem.compute_s, problem.transfer_s
  for e, (s, d) in enumerate(problem.edges):
    a, b = assignment[s], assignment[d]
    if a == b:
      continue
    for c, t in enumerate(starts[s]):
      end = t + p[s]
      out.append(
        Transfer(
          src_node=s, dst_node=d, microbatch=c, src_device=a, dst_device=b,
          start_s=end, end_s=end + T[e][a][b], bytes=problem.edge_bytes[e],
        )
      )
  return tuple(sorted(out, key=lambda x: (x.start_s, x.src_node, x.dst_node, x.microbatch)))


def device_memory(
  problem: Problem, assignment: Sequence[int], microbatches: int
) -> list[float]:
  """Bytes each device holds under `assignment`."""
  mem = [0.0] * problem.devices
  for i, m in enumerate(problem.memory_bytes(microbatches)):
    mem[assignment[i]] += m
  return mem


def validate_schedule(
  problem: Problem,
  assignment: Sequence[int],
  tasks: Sequence[Task],
  microbatches: int,
  caps: Sequence[float] | None = None,
  tol: float = TOLERANCE_S,
) -> None:
  """Checks a schedule from first principles, without any solver code.

  Checks: every (node, micro-batch) runs exactly once, on its node's device, for p_i seconds, from
  t >= 0; every edge's destination starts after the source ends plus the transfer delay between
  their devices; tasks on one device do not overlap; memory fits the caps.

  Raises:
    ValueError: listing every violation found.
  """
  errors: list[str] = []
  n, k, p, M = problem.num_nodes, microbatches, problem.compute_s, problem.devices
  if len(assignment) != n:
    raise ValueError(f"assignment has {len(assignment)} entries for {n} nodes.")
  for i, d in enumerate(assignment):
    if not 0 <= d < M:
      errors.append(f"node {i} on device {d}, not in [0, {M}).")
  seen: dict[tuple[int, int], Task] = {}
  for t in tasks:
    key = (t.node, t.microbatch)
    if key in seen:
      errors.append(f"task {key} runs twice.")
    seen[key] = t
    if not (0 <= t.node < n and 0 <= t.microbatch < k):
      errors.append(f"task {key} is not a (node, micro-batch) of the problem.")
      continue
    if t.device != assignment[t.node]:
      errors.append(f"task {key} on device {t.device}, its node is on {assignment[t.node]}.")
    if abs(t.end_s - t.start_s - p[t.node]) > tol or t.start_s < -tol:
      errors.append(f"task {key} runs [{t.start_s}, {t.end_s}], needs {p[t.node]} s from t >= 0.")
  missing = [(i, c) for i in range(n) for c in range(k) if (i, c) not in seen]
  if missing:
    errors.append(f"tasks never run: {missing[:10]}{' ...' if len(missing) > 10 else ''}.")
  if not errors:
    for e, (s, d) in enumerate(problem.edges):
      delay = problem.transfer_s[e][assignment[s]][assignment[d]]
      for c in range(k):
        ready = seen[(s, c)].end_s + delay
        if seen[(d, c)].start_s < ready - tol:
          errors.append(
            f"edge {s}->{d} micro-batch {c}: starts {seen[(d, c)].start_s}, data ready {ready}."
          )
    for dev in range(M):
      on = sorted((t for t in tasks if t.device == dev), key=lambda t: (t.start_s, t.end_s))
      for a, b in zip(on, on[1:]):
        if b.start_s < a.end_s - tol:
          errors.append(
            f"device {dev}: task {(a.node, a.microbatch)} [{a.start_s}, {a.end_s}] overlaps "
            f"{(b.node, b.microbatch)} [{b.start_s}, {b.end_s}]."
          )
  if caps is not None and not any(d >= M or d < 0 for d in assignment):
    for dev, used in enumerate(device_memory(problem, assignment, k)):
      if used > caps[dev] * (1 + 1e-12):
        errors.append(f"device {dev} holds {used:.0f} bytes, cap {caps[dev]:.0f}.")
  if errors:
    raise ValueError("Invalid schedule:\n  " + "\n  ".join(errors))
