"""How a task schedule runs in lock step: slots, groups, and what leaves a group how.

The rule the program builds (`jaxhybrid.program.tasks`) and the planner prices (`planner.price`),
kept pure (no JAX) so both use the same one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxhybrid.planner.core.pieces import PIECE_NAME, grad_units  # noqa: F401  (the rule's)
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule, _adjacency, dependencies

# The most bytes of parameter gradients one device's tasks of one lock-step group may write
# (assumption, named here): they leave the group's conditional together, so a larger figure
# means fewer groups (fewer synchronisations and messages) and more memory held at once. 64 MiB
# lets a stage of mid-sized layers (a 2048x2048 float32 chain: 4 layers) finish its backward in
# one group, and keeps a large gradient (paper BigLSTM's 3 GiB softmax) alone.
GROUP_GRAD_BYTES = 64 << 20

# A value of at least this many bytes leaves its group's conditional in a buffer (a *lane*) of
# its own, returned and sent as the array the task made; smaller ones are copied side by side
# into the group's packed buffer of their dtype (assumption, named here: one message more costs
# the link's latency, ~0.1-0.2 ms between two CPU processes over gloo, about what copying
# 256 KiB costs on one core). The program (program.tasks) and the planner's pricer follow it.
LANE_MIN_BYTES = 256 << 10


def is_grad_task(op: Op, split: bool) -> bool:
  """Whether `op` writes its node's parameter gradient (B unsplit, or W)."""
  return op.kind == "W" or (op.kind == "B" and not split)


def writes_grads(op: Op, split: bool, grad_bytes: Sequence[int] | None) -> bool:
  """Whether `op` is a gradient task of a node with parameters (`grad_bytes` None: unknown, any
  gradient task). A node without parameters (a split leaf's pre node, an activation) writes
  no gradient window, so its tasks never split a group by the gradient cap: on paper
  BigLSTM 1x8 the softmax's pre node, after its pieces' backward, started a group of its own
  and kept the two LSTM devices out of each other's groups (the plan priced 35 % over its
  whole-leaf twin)."""
  return is_grad_task(op, split) and (grad_bytes is None or grad_bytes[op.node] > 0)


def too_many_grads(nodes: set[int], grad_bytes: Sequence[int] | None, cap: int,
                   units: Sequence[int] | None = None) -> bool:
  """Whether gradient tasks of `nodes` (distinct nodes, non-empty) write more than `cap` bytes
  of parameter gradients (`grad_bytes` None: unknown, more than one node is too many). Nodes of
  one gradient unit (`grad_units`: the pieces of one split leaf) are always allowed together."""
  if len({units[n] for n in nodes} if units is not None else nodes) < 2:
    return False
  if grad_bytes is None:
    return True
  return sum(grad_bytes[n] for n in nodes) > cap


def lockstep_groups(
  schedule: TaskSchedule,
  edges: Sequence[tuple[int, int]],
  assignment: Sequence[int],
  reads: Mapping[Op, Sequence[Op]],
  grad_bytes: Sequence[int] | None = None,
  group_grad_bytes: int | None = None,
  grad_unit: Sequence[int] | None = None,
) -> tuple[list[list[tuple[int, Op]]], list[list[tuple[int, Op]]]]:
  """Slots and groups of a task schedule run in lock step (the rule `program.tasks` builds).

  - A task goes to the first *slot* after its device's previous task and after the slots of the
    tasks it depends on (`dependencies`) and of the tasks whose values it reads (`reads`).
  - Consecutive slots merge into one *group* (one `lax.switch`) unless a task of the slot reads
    a value another device made in the current group, or a device's gradient tasks (B unsplit,
    or W) in the group would write more than `group_grad_bytes` of parameter gradients: they
    leave the conditional together (as windows of the device's row), so this bounds the extra
    memory a group holds. A device's first gradient task in a group is always allowed.

  Args:
    schedule: the per-device task order.
    edges: the DAG's edges (src, dst).
    assignment: node -> device.
    reads: task -> the tasks that make the values it reads (activations, cotangents, residuals).
      Tasks absent read nothing beyond their dependencies.
    grad_bytes: per node, the bytes of the parameter gradient its gradient task writes (the
      node's parameter bytes). None: unknown, every gradient task ends up alone in its group
      (per device).
    group_grad_bytes: the most gradient bytes one device's tasks of a group may write (default
      GROUP_GRAD_BYTES); distinct nodes counted once.
    grad_unit: per node, its gradient unit (`grad_units`); nodes of one unit may always share a
      group, as one node may. None: every node its own.

  Returns:
    (slots, groups): each a list of [(device, task), ...], tasks of a device in schedule order
    (groups: sorted by device within each slot).

  A schedule with explicit `groups` runs those groups (empty ones dropped), each one slot; they
  are checked against the same rules (`explicit_groups`).

  Raises:
    ValueError: the device orders wait on each other (no lock-step run exists), or explicit
      groups break a rule.
  """
  if schedule.groups is not None:
    return explicit_groups(schedule, edges, assignment, reads, grad_bytes, group_grad_bytes,
                           grad_unit)
  devices = len(schedule.devices)
  num_nodes = len(assignment)
  preds, succs = _adjacency(num_nodes, edges)
  slot_of: dict[Op, int] = {}
  pos = [0] * devices
  last = [-1] * devices
  slots: list[list[tuple[int, Op]]] = []
  remaining = sum(len(ops) for ops in schedule.devices)
  while remaining:
    progress = False
    for d, ops in enumerate(schedule.devices):
      while pos[d] < len(ops):
        op = ops[pos[d]]
        deps = list(reads.get(op, ())) + dependencies(op, preds, succs, schedule.split)
        if any(t not in slot_of for t in deps):
          break
        s = max([last[d] + 1] + [slot_of[t] + 1 for t in deps])
        while len(slots) <= s:
          slots.append([])
        slots[s].append((d, op))
        slot_of[op] = s
        last[d] = s
        pos[d] += 1
        remaining -= 1
        progress = True
    if not progress:
      raise ValueError("the task schedule cannot run in lock step (device orders wait on each other)")
  groups: list[list[tuple[int, Op]]] = []
  made_in: dict[Op, int] = {}  # task of the current group -> its device
  grad_nodes: dict[int, set[int]] = {}  # device -> nodes of its gradient tasks in the group
  cap = GROUP_GRAD_BYTES if group_grad_bytes is None else group_grad_bytes

  def grad_task(op: Op) -> bool:
    return writes_grads(op, schedule.split, grad_bytes)

  for slot in slots:
    crosses = any(made_in.get(t, d) != d for d, op in slot for t in reads.get(op, ()))
    if not crosses:
      for d in {d for d, op in slot if grad_task(op)}:
        have = grad_nodes.get(d, set())
        new = have | {op.node for dd, op in slot if dd == d and grad_task(op)}
        if have and too_many_grads(new, grad_bytes, cap, grad_unit):
          crosses = True
          break
    if crosses or not groups:
      groups.append([])
      made_in = {}
      grad_nodes = {}
    for d, op in slot:
      if grad_task(op):
        grad_nodes.setdefault(d, set()).add(op.node)
    for d, op in sorted(slot):
      groups[-1].append((d, op))
      made_in[op] = d
  return slots, groups


def explicit_groups(
  schedule: TaskSchedule,
  edges: Sequence[tuple[int, int]],
  assignment: Sequence[int],
  reads: Mapping[Op, Sequence[Op]],
  grad_bytes: Sequence[int] | None = None,
  group_grad_bytes: int | None = None,
  grad_unit: Sequence[int] | None = None,
) -> tuple[list[list[tuple[int, Op]]], list[list[tuple[int, Op]]]]:
  """The groups a schedule names (`TaskSchedule.groups`), as (slots, groups) of
  `lockstep_groups`: one slot per non-empty group, renumbered in order.

  Checked: a task's dependencies and the tasks whose values it reads ran in an earlier group
  when on another device (a value crosses only between groups) or earlier in the device's order;
  and no device's gradient tasks in one group write more than `group_grad_bytes` (its first one
  always may), as the derived groups never do.

  Raises:
    ValueError: naming the first task or group that breaks a rule.
  """
  num_nodes = len(assignment)
  preds, succs = _adjacency(num_nodes, edges)
  where: dict[Op, tuple[int, int, int]] = {}  # task -> (group, device, position)
  for d, (ops, gs) in enumerate(zip(schedule.devices, schedule.groups)):
    for pos, (op, g) in enumerate(zip(ops, gs)):
      where[op] = (g, d, pos)
  cap = GROUP_GRAD_BYTES if group_grad_bytes is None else group_grad_bytes
  grads: dict[tuple[int, int], set[int]] = {}
  for op, (g, d, pos) in where.items():
    for t in list(reads.get(op, ())) + dependencies(op, preds, succs, schedule.split):
      if t not in where:
        raise ValueError(f"task {tuple(op)} needs {tuple(t)}, which the schedule does not run")
      tg, td, tpos = where[t]
      if (td != d and tg >= g) or (td == d and tpos >= pos):
        raise ValueError(
          f"task {tuple(op)} in group {g} on device {d} needs {tuple(t)} (group {tg}, device "
          f"{td}): a value from another device arrives only after its group, and a device runs "
          "its own tasks in order")
    if writes_grads(op, schedule.split, grad_bytes):
      grads.setdefault((d, g), set()).add(op.node)
  for (d, g), nodes in sorted(grads.items()):
    # Several micro-batches of one node share its gradient window: one node always may.
    if len(nodes) > 1 and too_many_grads(nodes, grad_bytes, cap, grad_unit):
      raise ValueError(f"group {g}: device {d}'s gradient tasks write more than "
                       f"{cap} bytes of parameter gradients; put them in separate groups")
  order = sorted({g for g, _, _ in where.values()})
  groups: list[list[tuple[int, Op]]] = [[] for _ in order]
  renumber = {g: j for j, g in enumerate(order)}
  for d, (ops, gs) in enumerate(zip(schedule.devices, schedule.groups)):
    for op, g in zip(ops, gs):
      groups[renumber[g]].append((d, op))
  return [list(g) for g in groups], groups
