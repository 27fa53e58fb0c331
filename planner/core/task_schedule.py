"""Task schedules: per model-axis device, the ordered forward / backward tasks the program runs.

A training step of a placed graph with k micro-batches is a set of tasks (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024, use the same names):

- F(n, c): the forward of node n on micro-batch c; it saves n's residuals for the backward;
- B(n, c): the backward of n on c; it consumes the cotangents of n's outputs (from the backward
  tasks of n's consumers) and the residuals F(n, c) saved, and produces the cotangents of n's
  inputs. In a *split* schedule B makes only the input cotangents and
- W(n, c): the weight gradient of n on c, which nothing else waits for, so it can fill idle time.

A schedule is data: per device, the order in which that device runs its tasks (a task runs on the
device of its node). The program runs it in lock step; the order decides the pipeline's bubble
and how many micro-batches' residuals are alive at once. Three schedules are generated from any
placement (any DAG, branchy or unequal stages), by list scheduling with estimated task times:

- 'gpipe': every device runs all its forwards, then all its backwards (GPipe, Huang et al. 2019):
  all k micro-batches' residuals are alive at the turn.
- '1f1b': a backward runs as soon as it is ready; a device starts the forward of a new micro-batch
  only while fewer than `depth` micro-batches are in flight on it (started, backward not done),
  where `depth` is one plus the number of device changes on the longest path from the device's
  nodes to the loss (S - s for stage s of an S-stage chain; PipeDream-Flush, Narayanan et al.
  2021). Residuals alive per device: at most `depth` micro-batches.
- 'zb': ZB-H1 (Qi et al. 2024): as '1f1b' with B split into B and W; W runs when the device would
  otherwise wait, or when `depth` weight gradients are pending. Same in-flight limit as '1f1b'.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxhybrid.planner.core.problem import FORWARD_SHARE

KINDS = ("gpipe", "1f1b", "zb")
DEFAULT_KIND = "1f1b"

# Estimated task times relative to the node's forward time, for ordering only (the lock-step
# model prices the result with real costs): backward = 2 x forward (Kaplan et al. 2020's rule
# of thumb for matmul-dominated layers), split as input cotangent = weight gradient = 1 x forward.
BACKWARD_FACTOR = 2.0
SPLIT_FACTOR = 1.0


class Op(NamedTuple):
  """One task: kind 'F', 'B' or 'W', node id and micro-batch."""

  kind: str
  node: int
  microbatch: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSchedule:
  """Per device, its tasks in the order it runs them."""

  # 'gpipe', '1f1b', 'zb', or 'custom' for a schedule given by hand or by a solver.
  kind: str
  # Whether backward tasks are split into B (input cotangent) and W (weight gradient).
  split: bool
  microbatches: int
  # devices[d]: device d's tasks, in order.
  devices: tuple[tuple[Op, ...], ...]
  # Optional explicit lock-step groups: groups[d][j] is the group in which devices[d][j] runs
  # (non-decreasing along each device's order). None: the program derives the groups from the
  # orders (lockstep_rule.lockstep_groups, as early as each task can run). Given, the program
  # runs exactly these groups (a device may wait out a group idle), as a planner that chose
  # them priced them (lockstep_cpsat).
  groups: tuple[tuple[int, ...], ...] | None = None

  def __post_init__(self):
    if self.groups is None:
      return
    if len(self.groups) != len(self.devices):
      raise ValueError(f"groups has {len(self.groups)} device rows, the schedule "
                       f"{len(self.devices)}: one row of group indices per device")
    for d, (ops, gs) in enumerate(zip(self.devices, self.groups)):
      if len(ops) != len(gs):
        raise ValueError(f"device {d}: {len(ops)} tasks but {len(gs)} group indices")
      if any(g < 0 for g in gs) or any(b < a for a, b in zip(gs, gs[1:])):
        raise ValueError(f"device {d}: group indices must be >= 0 and non-decreasing along "
                         "the device's order")

  def to_dict(self) -> dict[str, Any]:
    out = {
      "kind": self.kind, "split": self.split, "microbatches": self.microbatches,
      "devices": [[list(op) for op in ops] for ops in self.devices],
    }
    if self.groups is not None:
      out["groups"] = [list(g) for g in self.groups]
    return out

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> TaskSchedule:
    try:
      return cls(
        kind=str(data["kind"]), split=bool(data["split"]),
        microbatches=int(data["microbatches"]),
        devices=tuple(
          tuple(Op(str(k), int(n), int(c)) for k, n, c in ops) for ops in data["devices"]
        ),
        groups=(None if data.get("groups") is None
                else tuple(tuple(int(g) for g in gs) for gs in data["groups"])),
      )
    except (KeyError, TypeError, ValueError) as err:
      raise ValueError(f"malformed task schedule: {err}") from err

  def in_flight(self) -> list[int]:
    """Per device, the most micro-batches whose residuals are alive at once.

    A micro-batch is alive on a device from its first F there to its last B (W, if split).
    """
    out = []
    for ops in self.devices:
      last: dict[int, int] = {}
      first: dict[int, int] = {}
      for pos, op in enumerate(ops):
        first.setdefault(op.microbatch, pos)
        if op.kind in ("B", "W"):
          last[op.microbatch] = pos
      peak = 0
      for pos in range(len(ops)):
        peak = max(peak, sum(1 for c in first if first[c] <= pos <= last.get(c, pos)))
      out.append(peak)
    return out


def depths(
  num_nodes: int, edges: Sequence[tuple[int, int]], assignment: Sequence[int], devices: int
) -> list[int]:
  """Per device, 1 + the most device changes on a path from one of its nodes to a sink."""
  succs: list[list[int]] = [[] for _ in range(num_nodes)]
  for s, t in edges:
    succs[s].append(t)
  hops = [0] * num_nodes
  for n in reversed(_topo(num_nodes, edges)):
    hops[n] = max(
      (hops[t] + (assignment[t] != assignment[n]) for t in succs[n]), default=0
    )
  out = [1] * devices
  for n in range(num_nodes):
    out[assignment[n]] = max(out[assignment[n]], hops[n] + 1)
  return out


def _adjacency(
  num_nodes: int, edges: Sequence[tuple[int, int]]
) -> tuple[list[list[int]], list[list[int]]]:
  """Per node, its predecessors and its successors."""
  preds: list[list[int]] = [[] for _ in range(num_nodes)]
  succs: list[list[int]] = [[] for _ in range(num_nodes)]
  for s, t in edges:
    preds[t].append(s)
    succs[s].append(t)
  return preds, succs


def _topo(num_nodes: int, edges: Sequence[tuple[int, int]]) -> list[int]:
  indeg = [0] * num_nodes
  succs: list[list[int]] = [[] for _ in range(num_nodes)]
  for s, t in edges:
    succs[s].append(t)
    indeg[t] += 1
  ready = [n for n in range(num_nodes) if indeg[n] == 0]
  heapq.heapify(ready)
  order = []
  while ready:
    n = heapq.heappop(ready)
    order.append(n)
    for t in succs[n]:
      indeg[t] -= 1
      if indeg[t] == 0:
        heapq.heappush(ready, t)
  if len(order) != num_nodes:
    raise ValueError("the graph has a cycle: a task schedule needs a DAG")
  return order


def dependencies(
  op: Op, preds: Sequence[Sequence[int]], succs: Sequence[Sequence[int]], split: bool
) -> list[Op]:
  """The tasks `op` waits for (their results are its inputs)."""
  n, c = op.node, op.microbatch
  if op.kind == "F":
    return [Op("F", p, c) for p in preds[n]]
  if op.kind == "B":
    return [Op("F", n, c)] + [Op("B", s, c) for s in succs[n]]
  if op.kind == "W" and split:
    return [Op("B", n, c)]
  raise ValueError(f"task kind {op.kind!r} is not F, B or W (W only in split schedules)")


def generate(
  kind: str,
  num_nodes: int,
  edges: Sequence[tuple[int, int]],
  assignment: Sequence[int],
  devices: int,
  microbatches: int,
  *,
  forward_s: Sequence[float] | None = None,
  order: Sequence[tuple[int, int]] | None = None,
) -> TaskSchedule:
  """A GPipe, 1F1B or ZB-H1 task schedule of a placement (see the module docstring).

  Args:
    kind: 'gpipe', '1f1b' or 'zb'.
    num_nodes, edges: the DAG (edges (src, dst) by node id).
    assignment: node -> model-axis device.
    devices: model-axis devices M.
    microbatches: k.
    forward_s: estimated forward time per node (default 1 each); orders tasks only.
    order: (node, micro-batch) priority of forwards (e.g. a plan's start order); default:
      micro-batch, then topological order.

  Returns:
    The TaskSchedule.

  Raises:
    ValueError: an unknown kind or a placement that does not fit `devices`.
  """
  if kind not in KINDS:
    raise ValueError(f"schedule={kind!r} is unknown: use one of {', '.join(KINDS)}")
  if len(assignment) != num_nodes or (assignment and not 0 <= min(assignment)):
    raise ValueError(f"assignment has {len(assignment)} entries for {num_nodes} nodes")
  if assignment and max(assignment) >= devices:
    raise ValueError(f"assignment uses device {max(assignment)} but there are {devices}")
  if microbatches < 1:
    raise ValueError(f"microbatches={microbatches} must be >= 1")
  split = kind == "zb"
  f = list(forward_s) if forward_s is not None else [1.0] * num_nodes
  f = [max(float(x), 1e-12) for x in f]
  preds, succs = _adjacency(num_nodes, edges)
  topo = {n: i for i, n in enumerate(_topo(num_nodes, edges))}
  fprio = {(n, c): (c, topo[n]) for n in range(num_nodes) for c in range(microbatches)}
  if order is not None:
    fprio.update({(n, c): (i, 0) for i, (n, c) in enumerate(order)})
  depth = [min(d, microbatches) for d in depths(num_nodes, edges, assignment, devices)]

  def duration(op: Op) -> float:
    if op.kind == "F":
      return f[op.node]
    return f[op.node] * (SPLIT_FACTOR if split else BACKWARD_FACTOR)

  kinds = ("F", "B", "W") if split else ("F", "B")
  todo = {
    d: {Op(k, n, c) for k in kinds for n in range(num_nodes) if assignment[n] == d
        for c in range(microbatches)}
    for d in range(devices)
  }
  done: dict[Op, float] = {}
  busy_until = [0.0] * devices
  running: list[tuple[float, int, Op]] = []
  seq: list[list[Op]] = [[] for _ in range(devices)]
  open_mb: list[set[int]] = [set() for _ in range(devices)]  # started F, B not all done
  b_left = [
    {c: sum(1 for n in range(num_nodes) if assignment[n] == d) for c in range(microbatches)}
    for d in range(devices)
  ]
  w_pending = [0] * devices
  now = 0.0

  # A task is ready once every task it depends on has finished (popped from `running`): kept
  # incrementally (a count of unfinished dependencies per task) instead of re-checked per pick.
  waiting: dict[Op, int] = {}
  dependents: dict[Op, list[Op]] = {}
  for d in todo:
    for op in todo[d]:
      deps = dependencies(op, preds, succs, split)
      waiting[op] = len(deps)
      for dep in deps:
        dependents.setdefault(dep, []).append(op)
  ready_set = [{op for op in todo[d] if waiting[op] == 0} for d in range(devices)]
  f_left = [sum(op.kind == "F" for op in todo[d]) for d in range(devices)]

  def finish(op: Op) -> None:
    for other in dependents.get(op, ()):
      waiting[other] -= 1
      if waiting[other] == 0:
        ready_set[assignment[other.node]].add(other)

  def pick(d: int, relax: bool) -> Op | None:
    cands = list(ready_set[d])
    if not cands:
      return None
    fs = [op for op in cands if op.kind == "F"]
    bs = [op for op in cands if op.kind == "B"]
    ws = [op for op in cands if op.kind == "W"]
    if kind == "gpipe":
      if fs:
        return min(fs, key=lambda o: fprio[(o.node, o.microbatch)])
      if f_left[d]:
        return None  # GPipe: the backward waits for every forward on the device
      return min(bs, key=lambda o: (o.microbatch, -topo[o.node]), default=None)
    if ws and w_pending[d] >= depth[d]:
      return min(ws, key=lambda o: (o.microbatch, -topo[o.node]))
    if bs:
      return min(bs, key=lambda o: (o.microbatch, -topo[o.node]))
    allowed = [
      op for op in fs
      if relax or op.microbatch in open_mb[d] or len(open_mb[d]) < depth[d]
    ]
    if allowed:
      return min(allowed, key=lambda o: fprio[(o.node, o.microbatch)])
    if ws:
      return min(ws, key=lambda o: (o.microbatch, -topo[o.node]))
    return None

  total = sum(len(t) for t in todo.values())
  while len(done) < total:
    started = False
    for relax in (False, True):
      for d in range(devices):
        if busy_until[d] > now:
          continue
        op = pick(d, relax)
        if op is None:
          continue
        todo[d].discard(op)
        ready_set[d].discard(op)
        f_left[d] -= op.kind == "F"
        seq[d].append(op)
        end = now + duration(op)
        busy_until[d] = end
        heapq.heappush(running, (end, len(seq[d]), op))
        done[op] = float("inf")  # started; finishes at `end`
        if op.kind == "F":
          open_mb[d].add(op.microbatch)
        elif op.kind == "B":
          b_left[d][op.microbatch] -= 1
          if b_left[d][op.microbatch] == 0:
            open_mb[d].discard(op.microbatch)
          w_pending[d] += split
        else:
          w_pending[d] -= 1
        started = True
      if started or running:
        break
    if not running:
      raise RuntimeError("internal: task scheduling made no progress")
    end, _, op = heapq.heappop(running)
    now = max(now, end)
    done[op] = end
    finish(op)
    while running and running[0][0] <= now:
      _, _, other = heapq.heappop(running)
      done[other] = now
      finish(other)
  return TaskSchedule(
    kind=kind, split=split, microbatches=microbatches,
    devices=tuple(tuple(ops) for ops in seq),
  )


def validate(
  schedule: TaskSchedule,
  num_nodes: int,
  edges: Sequence[tuple[int, int]],
  assignment: Sequence[int],
) -> None:
  """Checks that `schedule` runs every task of this placement once, each on its node's device,
  each after the same-device tasks it depends on, and that its order can finish (no cycle).

  Raises:
    ValueError: naming the first problem found.
  """
  k = schedule.microbatches
  kinds = ("F", "B", "W") if schedule.split else ("F", "B")
  want = {Op(t, n, c) for t in kinds for n in range(num_nodes) for c in range(k)}
  seen: dict[Op, tuple[int, int]] = {}
  for d, ops in enumerate(schedule.devices):
    for pos, op in enumerate(ops):
      if op not in want:
        raise ValueError(f"the schedule has task {tuple(op)}, which this plan does not have")
      if op in seen:
        raise ValueError(f"the schedule runs task {tuple(op)} twice")
      if assignment[op.node] != d:
        raise ValueError(
          f"the schedule runs task {tuple(op)} on device {d} but the plan places node "
          f"{op.node} on device {assignment[op.node]}: a schedule for another plan"
        )
      seen[op] = (d, pos)
  missing = want - set(seen)
  if missing:
    raise ValueError(
      f"the schedule misses {len(missing)} task(s), e.g. {tuple(min(missing))}: "
      "a schedule for another plan or micro-batch count"
    )
  preds, succs = _adjacency(num_nodes, edges)
  # Lock-step feasibility: each device's order plus the dependencies must be acyclic.
  pos = {op: p for op, (_, p) in seen.items()}
  nxt = [0] * len(schedule.devices)
  finished: set[Op] = set()
  progress = True
  while progress:
    progress = False
    for d, ops in enumerate(schedule.devices):
      while nxt[d] < len(ops):
        op = ops[nxt[d]]
        if all(dep in finished for dep in dependencies(op, preds, succs, schedule.split)):
          finished.add(op)
          nxt[d] += 1
          progress = True
        else:
          break
  if len(finished) != len(seen):
    stuck = [ops[nxt[d]] for d, ops in enumerate(schedule.devices) if nxt[d] < len(ops)]
    raise ValueError(
      f"the schedule cannot run: device orders wait on each other (e.g. {tuple(stuck[0])} "
      f"at position {pos[stuck[0]]} of device {assignment[stuck[0].node]})"
    )


def timeline(
  schedule: TaskSchedule,
  edges: Sequence[tuple[int, int]],
  node_s: Sequence[float],
  forward_share: float = FORWARD_SHARE,
) -> dict[Op, tuple[float, float]]:
  """(start, end) of every task when each device runs its tasks in order, as soon as the tasks
  it depends on (over `edges`; same-device ones are implied by the order) have ended.

  A task of node n takes `forward_share * node_s[n]` (F), the rest (B), or half the rest (B and
  W of split schedules). No transfer delays: a sketch of the order, for charts.
  """
  n = len(node_s)
  preds, succs = _adjacency(n, edges)

  def dur(op: Op) -> float:
    f = forward_share * node_s[op.node]
    if op.kind == "F":
      return f
    rest = node_s[op.node] - f
    return rest / 2 if schedule.split else rest

  dev_of = {op: d for d, ops in enumerate(schedule.devices) for op in ops}
  out: dict[Op, tuple[float, float]] = {}
  pos = [0] * len(schedule.devices)
  free = [0.0] * len(schedule.devices)
  progress = True
  while progress:
    progress = False
    for d, ops in enumerate(schedule.devices):
      while pos[d] < len(ops):
        op = ops[pos[d]]
        deps = dependencies(op, preds, succs, schedule.split)
        if any(x not in out and dev_of.get(x) != d for x in deps):
          break
        start = max([free[d]] + [out[x][1] for x in deps if x in out])
        out[op] = (start, start + dur(op))
        free[d] = start + dur(op)
        pos[d] += 1
        progress = True
  return out
