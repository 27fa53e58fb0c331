"""The static structure of a hybrid program: parameter ownership, slots, groups and messages.

Parameters: every leaf read by nodes of one device is owned by that device and lives in its row
of a flat per-dtype buffer (`ParamLayout`); a leaf read on several devices is shared.

Schedule: the SPMD program (jaxhybrid.program) cannot let each device start a task when its
inputs arrive, as the planner's schedule does; it runs the schedule as a sequence of *slots* (at most one task
per device), merges slots into *groups* (one `lax.switch` each, no transfer inside), and after a
group sends what other devices read as *messages* (one `lax.ppermute` each). The cost of this
structure is priced by jaxhybrid.program.lockstep.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxhybrid import graph as graph_lib
from jaxhybrid.graph.eqn_costs import aval_bytes


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Where each flat parameter leaf lives.

  Attributes:
    owner: per leaf, the model-axis device that owns it, or -1 for a shared (replicated) leaf.
    offset: per owned leaf, its offset in the owner's flat buffer of its dtype.
    sizes: per dtype name, the flat buffer length per device (max over devices, >= 1).
    shared: indices of shared leaves, in order.
    shapes, dtypes: per leaf.
  """

  owner: tuple[int, ...]
  offset: tuple[int, ...]
  sizes: tuple[tuple[str, int], ...]
  shared: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  devices: int

  def bytes_per_device(self) -> list[int]:
    """Parameter bytes each model-axis device owns (excluding shared and padding)."""
    out = [0] * self.devices
    for i, d in enumerate(self.owner):
      if d >= 0:
        out[d] += math.prod(self.shapes[i]) * np.dtype(self.dtypes[i]).itemsize
    return out


def param_layout(graph: graph_lib.OpGraph, assignment: Sequence[int], devices: int) -> ParamLayout:
  """Assigns every parameter leaf to the device of the nodes that read it (or shares it)."""
  avals = graph.param_avals
  users: list[set[int]] = [set() for _ in avals]
  for node in graph.nodes:
    for leaf in node.param_leaves:
      users[leaf].add(int(assignment[node.id]))
  owner, offset = [], []
  fill: dict[tuple[int, str], int] = {}
  shared = []
  for i, aval in enumerate(avals):
    dt = np.dtype(aval.dtype).name
    if len(users[i]) > 1:
      owner.append(-1)
      offset.append(0)
      shared.append(i)
      continue
    d = next(iter(users[i])) if users[i] else 0  # unused leaves: device 0 (zero gradient)
    pos = fill.get((d, dt), 0)
    owner.append(d)
    offset.append(pos)
    fill[(d, dt)] = pos + int(math.prod(aval.shape))
  dtypes = sorted({np.dtype(a.dtype).name for a in avals})
  sizes = tuple((dt, max([1] + [fill.get((d, dt), 0) for d in range(devices)])) for dt in dtypes)
  return ParamLayout(
    owner=tuple(owner), offset=tuple(offset), sizes=sizes, shared=tuple(shared),
    shapes=tuple(tuple(a.shape) for a in avals), dtypes=tuple(np.dtype(a.dtype).name for a in avals),
    devices=devices,
  )


class Task(NamedTuple):
  node: int
  microbatch: int
  device: int


def plan_order(schedule: Sequence[Any]) -> list[tuple[int, int]]:
  """(node, micro-batch) in the order a plan's schedule starts them (ties: node, micro-batch)."""
  return [(t.node, t.microbatch) for t in sorted(schedule, key=lambda t: (t.start_s, t.node, t.microbatch))]


def slots_from_schedule(
  graph: graph_lib.OpGraph,
  assignment: Sequence[int],
  microbatches: int,
  order: Sequence[tuple[int, int]] | None = None,
) -> list[dict[int, Task]]:
  """Cuts a schedule into lock-step slots: per slot, at most one task per device.

  A task goes to the first slot after its inputs' slots and after its device's previous task.

  Args:
    graph: the op graph.
    assignment: node -> model-axis device.
    microbatches: number of micro-batches.
    order: (node, microbatch) in the order the plan starts them; default: micro-batch-major
      topological order (GPipe-like fill).

  Returns:
    A list of slots, each a dict device -> Task.
  """
  preds: dict[int, set[int]] = {n.id: set() for n in graph.nodes}
  for e in graph.edges:
    preds[e.dst].add(e.src)
  if order is None:
    order = [(n.id, m) for m in range(microbatches) for n in graph.nodes]
  slot_of: dict[tuple[int, int], int] = {}
  last: dict[int, int] = {}
  slots: list[dict[int, Task]] = []
  for node, mb in order:
    d = int(assignment[node])
    s = last.get(d, -1) + 1
    for p in preds[node]:
      if (p, mb) not in slot_of:
        raise ValueError(f"schedule order runs node {node} (micro-batch {mb}) before its input {p}")
      s = max(s, slot_of[(p, mb)] + 1)
    while len(slots) <= s:
      slots.append({})
    if d in slots[s]:  # cannot happen: s > last[d]
      raise RuntimeError("internal: two tasks on one device in one slot")
    slots[s][d] = Task(node, mb, d)
    slot_of[(node, mb)] = s
    last[d] = s
  return slots


def group_slots(graph: graph_lib.OpGraph, slots: list[dict[int, Task]]) -> list[list[Task]]:
  """Merges consecutive slots into groups that need no transfer inside them.

  A slot joins the current group unless one of its tasks reads a value that another device made
  in the group. Each group becomes ONE `lax.switch` (a device runs its tasks of the group in
  order) followed by the transfers, so a run of same-device work pays one conditional, not one
  per node; devices still work side by side within a group, and every transfer still happens as
  soon as a reader on another device needs it.
  """
  made_by: dict[tuple[Any, int], int] = {}
  groups: list[list[Task]] = []
  for slot in slots:
    tasks = [slot[d] for d in sorted(slot)]
    crosses = any(
      made_by.get((v, t.microbatch), t.device) != t.device
      for t in tasks for v in graph.nodes[t.node].invars
    )
    if crosses or not groups:
      groups.append([])
      made_by = {}
    groups[-1].extend(tasks)
    for t in tasks:
      for v in graph.nodes[t.node].outvars:
        made_by[(v, t.microbatch)] = t.device
  # Within a group keep slot order per device (tasks were appended slot by slot).
  return groups


def group_outputs(graph: graph_lib.OpGraph, groups: Sequence[Sequence[Task]]) -> list[list[tuple[Any, int]]]:
  """Per group, the (value, micro-batch) keys its conditional must return, in task order.

  A value leaves its group only when a later group reads it or it is the loss; one made and read
  inside a group stays inside the branch, so the other devices write no zeros for it.
  """
  later = {(graph.jaxpr.outvars[0], m) for g in groups for m in {t.microbatch for t in g}}
  outs: list[list[tuple[Any, int]]] = []
  for tasks in reversed(groups):
    outs.append([
      (v, t.microbatch) for t in tasks for v in graph.nodes[t.node].outvars
      if (v, t.microbatch) in later
    ])
    for t in tasks:
      later.update((v, t.microbatch) for v in graph.nodes[t.node].invars)
  outs.reverse()
  return outs


# One message's fixed cost dominates small tensors on slow links (gloo over TCP: ~1 ms), while
# packing copies the payload once more (a few GB/s on one CPU core). Below this size, a group's
# transfers that go the same way travel together. Not in the paper (its transfers are single
# tensors over NVLink); `HybridProgram.build(pack_max_bytes=...)` overrides it.
DEFAULT_PACK_MAX_BYTES = 1 << 20


class Message(NamedTuple):
  """One ppermute after a group: every source d sends `payloads[d]` to device d + shift (mod M)."""

  shift: int
  dtype: Any
  payloads: dict[int, list[tuple[Any, int]]]  # source device -> (var, micro-batch) keys


def group_messages(
  graph: graph_lib.OpGraph,
  tasks: Sequence[Task],
  consumers: dict[Any, set[int]],
  devices: int,
  pack_max_bytes: int,
) -> list[Message]:
  """The messages that carry a group's transfers.

  Every value a task of the group makes and a device other than its maker reads is one transfer.
  Transfers of at least `pack_max_bytes` are a message each; the smaller ones are packed, one
  message per (shift, dtype): all sources send at once (one ppermute with a cyclic-shift
  permutation), each its own values concatenated.
  """
  alone: list[Message] = []
  packed: dict[tuple[int, Any], dict[int, list[tuple[Any, int]]]] = {}
  for t in tasks:
    for v in graph.nodes[t.node].outvars:
      for dst in sorted(consumers.get(v, set()) - {t.device}):
        shift, key = (dst - t.device) % devices, (v, t.microbatch)
        if aval_bytes(v.aval) >= pack_max_bytes:
          alone.append(Message(shift=shift, dtype=np.dtype(v.aval.dtype), payloads={t.device: [key]}))
        else:
          packed.setdefault((shift, np.dtype(v.aval.dtype)), {}).setdefault(t.device, []).append(key)
  return alone + [Message(shift=s, dtype=dt, payloads=p) for (s, dt), p in packed.items()]
