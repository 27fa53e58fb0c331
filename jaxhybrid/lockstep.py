"""The step time of a hybrid program as it actually runs: group by group, in lock step.

The planner's schedule lets each device start a task as soon as its inputs arrive. The compiled
program (jaxhybrid.program) is SPMD: it runs the schedule as a sequence of *groups* (one
`lax.switch` each), and every `ppermute` after a group is a collective that all model-axis
devices enter together. So a group lasts as long as its busiest device, and transfers are
paid one after another. The backward pass runs the same groups in reverse (the transposed
switches and ppermutes).

`program_step_s` prices that structure with the same cost model the planner used:

  T = sum over groups g of  max over devices d of  sum_{tasks of d in g} t(node)
      + sum over groups of  sum over messages x of  2 * t_link(bytes(x))

with t(node) the node's forward + backward time and each message (one ppermute; small transfers
of a group share one, `program.group_messages`) paid twice (the activations forward, their
gradients backward). Assumption (named here, not in the paper): a node's forward
and backward times keep the same ratio across nodes, so pricing the forward and backward
phases of a group by the fwd+bwd sum per device gives the same maximum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid import structure as structure_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class LockstepTime:
  """Predicted step of a program's group structure (seconds)."""

  # Sum over groups of the busiest device's compute.
  compute_s: float
  # Sum of all transfer times, forward activations and backward gradients.
  transfer_s: float
  # Number of groups (switches) and of messages (ppermutes, forward only).
  groups: int
  transfers: int

  @property
  def step_s(self) -> float:
    return self.compute_s + self.transfer_s


def program_step_s(
  graph: graph_lib.OpGraph,
  groups: Sequence[Sequence[Any]],
  assignment: Sequence[int],
  costs: costs_lib.CostModel,
  pack_max_bytes: int | None = None,
) -> LockstepTime:
  """Prices a program's groups (`HybridProgram.groups`) in lock step (see module docstring).

  Args:
    graph: the op graph the program replays.
    groups: lists of tasks with `.node`, `.microbatch`, `.device`, in program order.
    assignment: node -> model-axis device.
    costs: the cost model (node times, link).
    pack_max_bytes: as `HybridProgram.build`'s (default: the program's default): a packed
      message costs one link time of its longest source buffer.

  Returns:
    The predicted compute, transfer and total step time.
  """
  if pack_max_bytes is None:
    pack_max_bytes = structure_lib.DEFAULT_PACK_MAX_BYTES
  devices = max(assignment, default=0) + 1
  consumers: dict[Any, set[int]] = {}
  for n in graph.nodes:
    for v in n.invars:
      consumers.setdefault(v, set()).add(int(assignment[n.id]))
  node_s = [costs.node_time_s(n) for n in graph.nodes]
  compute = transfer = 0.0
  count = 0
  for tasks in groups:
    per_device: dict[int, float] = {}
    for t in tasks:
      per_device[t.device] = per_device.get(t.device, 0.0) + node_s[t.node]
    compute += max(per_device.values(), default=0.0)
    for msg in structure_lib.group_messages(graph, tasks, consumers, devices, pack_max_bytes):
      nbytes = max(sum(structure_lib.aval_nbytes(v.aval) for v, _ in keys) for keys in msg.payloads.values())
      # The ppermute ends when its slowest pair does; forward activations, backward gradients.
      transfer += 2 * max(
        costs.transfer_time_s(nbytes, src, (src + msg.shift) % devices) for src in msg.payloads
      )
      count += 1
  return LockstepTime(compute_s=compute, transfer_s=transfer, groups=len(groups), transfers=count)


def plan_step_s(
  graph: graph_lib.OpGraph, plan: Any, costs: costs_lib.CostModel, pack_max_bytes: int | None = None
) -> LockstepTime:
  """`program_step_s` for the groups `HybridProgram.build` makes from `plan` (a planner Plan)."""
  order = structure_lib.plan_order(plan.schedule)
  slots = structure_lib.slots_from_schedule(graph, plan.assignment, plan.microbatches, order or None)
  return program_step_s(graph, structure_lib.group_slots(graph, slots), plan.assignment, costs, pack_max_bytes)


def choose(graph: graph_lib.OpGraph, plans: Sequence[Any], costs: costs_lib.CostModel) -> tuple[Any, list[float]]:
  """The plan the program runs fastest in lock step (first on ties), and every plan's time.

  The MILP minimises the asynchronous schedule's makespan, which lets transfers overlap compute;
  where transfers are slow and serialised (one-core CPU processes over gloo) a heuristic plan with
  fewer transfers can run faster. Pass the MILP plan and heuristic plans for the same graph.

  Raises:
    ValueError: if `plans` is empty.
  """
  if not plans:
    raise ValueError("choose() needs at least one plan")
  times = [plan_step_s(graph, p, costs).step_s for p in plans]
  best = min(range(len(plans)), key=lambda i: (times[i], i))
  return plans[best], times
