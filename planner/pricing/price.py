"""Pure-number prices of a (placement, task schedule): lock-step step time, memory over time, and
the asynchronous makespan of the same per-device orders.

The program (jaxhybrid.program) runs a TaskSchedule in lock step: slots and groups by the rule of
`lockstep_rule.lockstep_groups` (or the schedule's explicit groups), one `lax.switch` per group, then one `ppermute` per (shift,
dtype) of the values that leave the group for another device. `lockstep_price` is that structure
priced with the problem's numbers (program.lockstep.program_step_s prices the program itself):

  T = sum over groups g of  max over devices d of  sum_{tasks of d in g} t(task)
      + sum over groups g, shifts s, dtypes:  max over devices a of  link(a -> a + s, L)
      + G * group_s  (M > 1: each of the G groups' devices meeting, `Problem.group_s`; and each
        task's time t(task) above counts `Problem.task_fixed_s` more)

where L is the longest device's bytes in that message (the message buffer is the union of the
devices' parts). With no link model in the problem (hand-built problems) a message costs the
largest sum over senders of its edges' one-way times.

`peak_memory_bytes` is the planner's memory of a device as the SPMD program allocates it, the
same on every model-axis device (so the smallest cap binds): the static bytes (parameters,
optimizer state, gradient row) of the device that owns the most, since every device allocates
rows as long as the longest (row padding), plus the parameter leaves several devices read (the
program replicates them: `device_static_bytes`), plus the values of the step at their peak,
the larger of two figures:

- per device, the peak over its task order of the residuals of every F(i, c) whose B(i, c)
  (W(i, c) when split) has not finished, the largest over devices;
- on several devices, per lock-step group (`group_peak_bytes`: one conditional, whose operands
  and results live while it runs), the group buffers alive after it, each as long as
  its longest device's part (a group's buffers hold every device's values, so the sum over
  groups of the largest device's part, not the largest device's sum), plus the residuals its
  branch makes and frees inside, plus the parameter gradients its gradient tasks return.

Paper BigLSTM on 1x8 with both vocabulary tables whole: two devices own 13.3 GiB, six own
nothing, and all eight compile to 13.3 GiB. GNMT small on 1x8: its groups' buffers and windows
17 MiB at the peak against 3.4 MiB of one device's residuals. The placement solvers cap what each
device owns and one device's residuals (a relaxation of this rule, so their bounds stay valid);
their placements are kept only when this rule fits.

`async_makespan` runs the same per-device orders as soon as their inputs arrive, each edge paying
its one-way delay (activations forward, cotangents backward). It is what the F/B/W MILP
(fbw_milp.py) minimises: the lock-step price of a schedule is never below it (fbw_milp's docstring
says why).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxhybrid.planner.pricing import lockstep_rule
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule


@dataclasses.dataclass(frozen=True, kw_only=True)
class LockstepPrice:
  """Predicted lock-step step of a task schedule (seconds), without per-byte passes."""

  # Sum over groups of the busiest device's tasks.
  compute_s: float
  # Sum of the message times.
  transfer_s: float
  # Number of groups (switches) and of messages (ppermutes).
  groups: int
  transfers: int
  # Groups x Problem.group_s (the devices meeting at each group; 0 on one device).
  group_sync_s: float = 0.0
  # What Problem.task_fixed_s per task adds to the groups' busiest devices (0 on one device).
  task_overhead_s: float = 0.0

  @property
  def step_s(self) -> float:
    return self.compute_s + self.transfer_s + self.group_sync_s + self.task_overhead_s


def task_reads(problem: Problem, schedule: TaskSchedule) -> dict[Op, list[Op]]:
  """Per task, the tasks whose values it reads (as the program wires them).

  F(n, c) reads its predecessors' activations; B(n, c) and W(n, c) read n's residuals (from
  F(n, c)), n's input activations (arguments the pullback keeps; assumed all of them: it does not
  change slots or groups, as F(n, c) already reads them) and the cotangents the B tasks of n's
  consumers send back (edges with float values only).
  """
  preds = problem.predecessors()
  succs = problem.successors()
  out: dict[Op, list[Op]] = {}
  for ops in schedule.devices:
    for op in ops:
      n, c = op.node, op.microbatch
      fwd_in = [Op("F", p, c) for p, _ in preds[n]]
      if op.kind == "F":
        out[op] = fwd_in
      else:
        cts = [Op("B", s, c) for s, e in succs[n] if problem.has_cotangent(e)]
        out[op] = [Op("F", n, c)] + fwd_in + cts
  return out


# The last groups `groups_of` made (the searches price a schedule's time and memory in turn):
# (id(problem), assignment, schedule) -> (problem, groups).
_GROUPS_MEMO: collections.OrderedDict = collections.OrderedDict()
_GROUPS_MEMO_SIZE = 8


def groups_of(
  problem: Problem, assignment: Sequence[int], schedule: TaskSchedule
) -> tuple[tuple[tuple[int, Op], ...], ...]:
  """The lock-step groups of `schedule` (lockstep_rule.lockstep_groups), remembered for the
  last few (problem, assignment, schedule)."""
  key = (id(problem), tuple(assignment), schedule)
  hit = _GROUPS_MEMO.get(key)
  if hit is not None and hit[0] is problem:
    _GROUPS_MEMO.move_to_end(key)
    return hit[1]
  _, groups = lockstep_rule.lockstep_groups(
    schedule, problem.edges, assignment, task_reads(problem, schedule),
    grad_bytes=problem.param_bytes or None, grad_unit=problem.grad_units)
  out = tuple(tuple(g) for g in groups)
  _GROUPS_MEMO[key] = (problem, out)
  while len(_GROUPS_MEMO) > _GROUPS_MEMO_SIZE:
    _GROUPS_MEMO.popitem(last=False)
  return out


def _messages(
  problem: Problem, assignment: Sequence[int], group: Sequence[tuple[int, Op]],
  adjacency: tuple[list, list, list[bool]],
) -> dict[tuple[int, str], dict[int, list[tuple[int, int, bool]]]]:
  """(shift, dtype) -> sender -> [(edge, value, backward)] leaving `group` for other devices.

  A forward value goes once to each other device that holds one of its readers; a cotangent goes
  from B(n, c) to the device of the value's producer (one per consumer, as the program sends)."""
  M = problem.devices
  succs, preds, floats = adjacency
  out: dict[tuple[int, str], dict[int, list[tuple[int, int, bool]]]] = {}
  for d, op in group:
    if op.kind == "F":
      sent: set[tuple[int, int]] = set()
      for s, e in succs[op.node]:
        b = assignment[s]
        if b == d:
          continue
        for v in problem.edge_values[e]:
          if (v, b) in sent:
            continue
          sent.add((v, b))
          key = ((b - d) % M, problem.value_dtypes[v])
          out.setdefault(key, {}).setdefault(d, []).append((e, v, False))
    elif op.kind == "B":
      for p, e in preds[op.node]:
        a = assignment[p]
        if a == d:
          continue
        for v in problem.edge_values[e]:
          if floats[v]:
            key = ((a - d) % M, problem.value_dtypes[v])
            out.setdefault(key, {}).setdefault(d, []).append((e, v, True))
  return out


def lockstep_price(
  problem: Problem, assignment: Sequence[int], schedule: TaskSchedule
) -> LockstepPrice:
  """The lock-step step time of `schedule` on `assignment` (see the module docstring).

  Raises:
    ValueError: the schedule cannot run in lock step.
  """
  M = problem.devices
  split = schedule.split
  compute = transfer = 0.0
  count = 0
  groups = groups_of(problem, assignment, schedule)
  adjacency = (problem.successors(), problem.predecessors(),
               [problem.is_float(v) for v in range(len(problem.value_bytes))])
  fixed = problem.task_fixed_s if M > 1 else 0.0
  overhead = 0.0
  for group in groups:
    per_device: dict[int, float] = {}
    counts: dict[int, int] = {}
    for d, op in group:
      per_device[d] = per_device.get(d, 0.0) + problem.task_s(op.kind, op.node, split)
      counts[d] = counts.get(d, 0) + 1
    busiest = max(per_device.values(), default=0.0)
    compute += busiest
    if fixed:
      overhead += max((t + fixed * counts[d] for d, t in per_device.items()), default=0.0) - busiest
    for (shift, _), by_src in sorted(_messages(problem, assignment, group, adjacency).items()):
      if problem.link_latency_s:
        # As the program sends them (program.tasks): small values packed in one message, each
        # value of at least LANE_MIN_BYTES in a lane of its own (j-th largest per sender).
        small, big = {}, {}
        for a, items in by_src.items():
          sizes = [problem.value_bytes[v] for _, v, _ in items]
          small[a] = sum(b for b in sizes if b < lockstep_rule.LANE_MIN_BYTES)
          big[a] = sorted((b for b in sizes if b >= lockstep_rule.LANE_MIN_BYTES), reverse=True)
        lengths = [max(small.values())] if any(small.values()) else []
        lengths += [max(b[j] for b in big.values() if j < len(b))
                    for j in range(max(len(b) for b in big.values()))]
        for length in lengths:
          count += 1
          transfer += max(problem.link_s(length, a, (a + shift) % M) for a in range(M))
      else:
        count += 1
        # No link model: each edge's one-way time; a value sent once per edge.
        worst = 0.0
        for a, items in by_src.items():
          edges = {(e, back) for e, _, back in items}
          worst = max(worst, sum(
            problem.direction_s(e, a, (a + shift) % M, back) for e, back in edges))
        transfer += worst
  sync = problem.group_s * len(groups) if M > 1 else 0.0
  return LockstepPrice(compute_s=compute, transfer_s=transfer, groups=len(groups),
                       transfers=count, group_sync_s=sync, task_overhead_s=overhead)


def residual_release(op: Op, split: bool) -> bool:
  """Whether `op` is the task after which F(op.node, op.microbatch)'s residuals are freed."""
  return op.kind == ("W" if split else "B")


def memory_profile(
  residual_bytes: Sequence[float], ops: Sequence[Op], split: bool
) -> list[float]:
  """Residual bytes alive at each position of one device's task order.

  Position t counts every F(i, c) at or before t whose release task (B(i, c), or W(i, c) when
  split) is at or after t: the residuals exist from their forward to the end of the task that
  consumes them last.
  """
  alive = 0.0
  out = []
  for op in ops:
    if op.kind == "F":
      alive += residual_bytes[op.node]
    out.append(alive)
    if residual_release(op, split):
      alive -= residual_bytes[op.node]
  return out


def group_peak_bytes(
  problem: Problem, assignment: Sequence[int], schedule: TaskSchedule
) -> list[float]:
  """Per lock-step group, the bytes of the step's values every device holds while it runs
  (module docstring), as the program (`jaxhybrid.program.tasks`) lays them out:

  - a value a later group reads leaves its group's conditional in the group's buffers, alive
    until its last reader's group: F(n, c)'s outputs and residuals (`activation_bytes`) until n's
    release task (B, or W when split); a value sent to another device, in the receiver's buffer
    until the consumer's release task (its pullback may keep the argument); a cotangent until
    the producer's B. A group's buffers are as long as their longest device's part, so after
    group t each device holds, for every group g <= t, the largest device's bytes of g still to
    be read;
  - inside the group's branch: the residuals of the device's F tasks released in the same group,
    at their peak over the device's order;
  - the gradient windows the group returns: the parameter bytes its gradient tasks write as
    windows (`window_bytes`, else `param_bytes`; once per gradient unit), the largest device's;
  - while a task runs, its own temporaries (`task_temp_bytes`) beside what its branch holds.
  """
  groups = groups_of(problem, assignment, schedule)
  group_of = {op: g for g, tasks in enumerate(groups) for _, op in tasks}
  release = "W" if schedule.split else "B"
  succs, preds = problem.successors(), problem.predecessors()
  M, units = problem.devices, problem.grad_units
  params = problem.window_bytes or problem.param_bytes
  # (group, device) -> [(bytes, last group reading them)] of the values leaving the group.
  leaving: dict[tuple[int, int], list[tuple[float, int]]] = {}
  inner = [0.0] * len(groups)
  windows = [0.0] * len(groups)
  for g, tasks in enumerate(groups):
    per_device: dict[int, list[Op]] = {}
    for d, op in tasks:
      per_device.setdefault(d, []).append(op)
    for d, ops in per_device.items():
      alive = peak = 0.0
      grads: dict[int, int] = {}
      for op in ops:
        n, c = op.node, op.microbatch
        if op.kind == "F":
          last = group_of[Op(release, n, c)]
          if last > g:
            leaving.setdefault((g, d), []).append((problem.activation_bytes[n], last))
          else:
            alive += problem.activation_bytes[n]
          sent: set[tuple[int, int]] = set()
          for s_, e in succs[n]:
            b = assignment[s_]
            if b == d:
              continue
            last = max(group_of[Op("F", s_, c)], group_of[Op(release, s_, c)])
            for v in problem.edge_values[e]:
              if (v, b) not in sent:
                sent.add((v, b))
                leaving.setdefault((g, b), []).append((problem.value_bytes[v], last))
        elif op.kind == "B":
          for p_, e in preds[n]:
            last = group_of[Op("B", p_, c)]
            if last > g and problem.has_cotangent(e):
              leaving.setdefault((g, assignment[p_]), []).append(
                (problem.edge_value_bytes(e, True), last))
        peak = max(peak, alive + task_temp(problem, op))
        if params and lockstep_rule.is_grad_task(op, schedule.split):
          grads[units[n]] = grads.get(units[n], 0) + params[n]
        if op.kind == release and group_of[Op("F", n, c)] == g:
          alive -= problem.activation_bytes[n]
      inner[g] = max(inner[g], peak)
      windows[g] = max(windows[g], float(sum(grads.values())))
  G = len(groups)
  held = np.zeros(G)
  for g in range(G):
    # by_last[d, t]: device d's bytes of group g read last in group t; reversed cumulative
    # sums give what is still to be read after each group t >= g.
    by_last = np.zeros((M, G - g))
    for d in range(M):
      for b, last in leaving.get((g, d), ()):
        by_last[d, max(last, g) - g] += b
    held[g:] += np.cumsum(by_last[:, ::-1], axis=1)[:, ::-1].max(axis=0)
  return [float(h) + i + w for h, i, w in zip(held, inner, windows)]


def task_temp(problem: Problem, op: Op) -> float:
  """Bytes task `op` needs beyond its inputs and outputs while it runs (`Problem.
  task_temp_bytes`: F's, or B's for a B or W task; 0 when not counted)."""
  if not problem.task_temp_bytes:
    return 0.0
  return float(problem.task_temp_bytes[op.node][0 if op.kind == "F" else 1])


def peak_memory_bytes(
  problem: Problem, assignment: Sequence[int], schedule: TaskSchedule
) -> list[float]:
  """Per device, the same figure on every device: the longest device's static bytes + the
  larger of the largest peak of `memory_profile` (plus the running task's `task_temp`) over a
  device's order and, on several devices, the largest `group_peak_bytes` (module docstring). On one device the program's groups are not
  conditionals: a group buffer dies at its last read, as the residual profile counts it. A
  schedule that cannot run in lock step is priced by the profile alone."""
  row = max(device_static_bytes(problem, assignment), default=0.0)
  live = max((max((r + task_temp(problem, op) for r, op in zip(
    memory_profile(problem.activation_bytes, ops, schedule.split), ops)), default=0.0)
    for ops in schedule.devices), default=0.0)
  if problem.devices > 1:
    try:
      live = max(live, max(group_peak_bytes(problem, assignment, schedule), default=0.0))
    except ValueError:  # no lock-step groups (lockstep_rule): the program cannot run it
      pass
  return [row + live] * problem.devices


def device_static_bytes(problem: Problem, assignment: Sequence[int]) -> list[float]:
  """Static bytes (parameters, optimizer state, gradient rows) each device holds: of the nodes
  it owns, and each parameter leaf several nodes read (`Problem.shared_static`) once, on every
  device when its readers are on several (the program replicates it)."""
  static = [0.0] * problem.devices
  for i, d in enumerate(assignment):
    static[d] += problem.static_bytes[i]
  for b, readers in problem.shared_static:
    where = {assignment[r] for r in readers}
    for d in (where if len(where) == 1 else range(problem.devices)):
      static[d] += b
  return static


def fits(
  problem: Problem, assignment: Sequence[int], schedule: TaskSchedule,
  caps: Sequence[float] | None,
) -> bool:
  """Whether every device's `peak_memory_bytes` is within its cap (None: no caps)."""
  if caps is None:
    return True
  return all(m <= c for m, c in zip(peak_memory_bytes(problem, assignment, schedule), caps))


def fbw_dependencies(problem: Problem, op: Op) -> list[tuple[Op, int, bool]]:
  """(task, edge or -1, backward) pairs `op` waits for in the asynchronous F/B/W model.

  F(n, c) <- F(p, c) over edge (p, n); B(n, c) <- F(n, c) and B(s, c) over each edge (n, s)
  that carries a cotangent; W(n, c) <- B(n, c).
  """
  n, c = op.node, op.microbatch
  if op.kind == "F":
    return [(Op("F", p, c), e, False) for p, e in problem.predecessors()[n]]
  if op.kind == "B":
    return [(Op("F", n, c), -1, False)] + [
      (Op("B", s, c), e, True) for s, e in problem.successors()[n]
      if problem.has_cotangent(e)
    ]
  return [(Op("B", n, c), -1, False)]


def async_makespan(
  problem: Problem, assignment: Sequence[int], schedule: TaskSchedule,
  starts: Mapping[Op, float] | None = None,
) -> float:
  """Makespan when each device runs its order, every task as soon as its inputs have arrived.

  Args:
    problem, assignment, schedule: the plan.
    starts: if a dict is given, filled with every task's start time.

  Returns:
    The makespan, or inf when the device orders wait on each other.
  """
  split = schedule.split
  deps = {op: fbw_dependencies(problem, op) for ops in schedule.devices for op in ops}
  end: dict[Op, float] = {}
  pos = [0] * len(schedule.devices)
  free = [0.0] * len(schedule.devices)
  left = sum(len(o) for o in schedule.devices)
  progress = True
  while left and progress:
    progress = False
    for d, ops in enumerate(schedule.devices):
      while pos[d] < len(ops):
        op = ops[pos[d]]
        ready = free[d]
        ok = True
        for dep, e, back in deps[op]:
          if dep not in end:
            ok = False
            break
          delay = 0.0
          if e >= 0:
            a, b = assignment[dep.node], assignment[op.node]
            delay = problem.direction_s(e, a, b, back)
          ready = max(ready, end[dep] + delay)
        if not ok:
          break
        if starts is not None:
          starts[op] = ready  # type: ignore[index]
        end[op] = free[d] = ready + problem.task_s(op.kind, op.node, split)
        pos[d] += 1
        left -= 1
        progress = True
  if left:
    return float("inf")
  return max(end.values(), default=0.0)
