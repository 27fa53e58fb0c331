"""The step time of a hybrid program as it actually runs: task groups in lock step.

The program (jaxhybrid.program) is SPMD: it runs a task schedule (F, B and, split, W tasks per
device; `planner.task_schedule`) as a sequence of *groups* (`program.tasks`): one `lax.switch`
each, then one `ppermute` per (shift, dtype) that all model-axis devices enter together. So a
group lasts as long as its busiest device, and messages are paid one after another.
`program_step_s` prices that structure with the same cost model the planner used:

  T = sum over groups g of  max over devices d of  sum_{tasks of d in g} t(task)
      + sum over groups of  sum over messages x of  max_src t_link(src, src + shift, bytes(x))

t(F) is the node's forward time, t(B) its backward time (input cotangent and weight gradient)
and, split, t(B) and t(W) the cost model's `input_grad_time_s` and `weight_grad_time_s` (a
recurrence's W repeats its recurrent cotangent, so B + W can exceed the backward), or the
backward shared by INPUT_GRAD_SHARE where it has none (`split_task_times`). Cost models that
give only forward + backward (`node_time_s`) split it with `FORWARD_SHARE` (assumption, named in
planner.problem: the backward costs twice the forward, the usual figure for matmul-dominated
layers; Kaplan et al. 2020).

Per-step work outside the tasks, priced when a `PassCosts` is given (`measure_pass_costs`):

  + max over devices d of  P_d * (update_s_per_byte + k * add_s_per_byte)
  + R * fill_s_per_byte

with P_d the parameter bytes device d holds (owned row + shared): the optimizer update of its
parameters and, per micro-batch, adding the gradient into its gradient row (assumption, named
here: elementwise passes, linear in bytes, in place as the step runs them); R the bytes of a
device's parameter rows (padded to the largest share): the gradient buffer the step zero-fills
afresh (a new buffer, first-touch page faults included, as `measure_pass_costs` times the fill).

  + sum over groups of  max over d (tasks of d + fill_s_per_byte * fill_d) - max over d (tasks of d)

(M > 1 only) fill_d: what device d writes to build its group outputs after its tasks
(`Structure.fill_bytes_per_device`): packed buffers (its own values copied in, zeros for the
regions other devices need) and lanes it does not fill with exactly one value; a value as long
as its lane is returned without a copy. An idle device's zeros cost nothing while another
device computes.

  + G * group_s,  with each task's time t(task) + task_fixed_s above

(M > 1 only) G groups, each paying for the devices meeting beyond its messages' link time, and
each task for its place in the group's branch (`program.group_cost`: both measured once per
machine; the planner adds the same, `PlannerOptions.group_s` and `task_fixed_s`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid.graph.eqn_costs import aval_bytes
from jaxhybrid.planner.core import task_schedule as sched_lib
from jaxhybrid.planner.core.problem import FORWARD_SHARE, INPUT_GRAD_SHARE
from jaxhybrid.program import executor
from jaxhybrid.program import structure as structure_lib
from jaxhybrid.program import tasks as tasks_lib

# FORWARD_SHARE (imported above, re-exported): the share of a node's forward + backward time that
# is the forward when a cost model gives only the sum; the planner owns it (planner.problem) so
# that the planner's prices and the program's use the same figure.


@dataclasses.dataclass(frozen=True, kw_only=True)
class LockstepTime:
  """Predicted step of a program's group structure (seconds)."""

  # Sum over groups of the busiest device's tasks.
  compute_s: float
  # Sum of all message times (activations forward, cotangents backward).
  transfer_s: float
  # Number of groups (switches) and of messages (ppermutes).
  groups: int
  transfers: int
  # Busiest device's optimizer update and gradient accumulation (0 without PassCosts).
  param_s: float = 0.0
  # What writing the groups' output buffers adds to the groups' times (0 without PassCosts or
  # on one device).
  fill_s: float = 0.0
  # Groups x PassCosts.group_s: the devices meeting at each group (0 without it, or on one
  # device).
  group_sync_s: float = 0.0
  # What PassCosts.task_fixed_s per task adds to the groups' busiest devices (0 without it,
  # or on one device).
  task_overhead_s: float = 0.0

  @property
  def step_s(self) -> float:
    return (self.compute_s + self.transfer_s + self.param_s + self.fill_s + self.group_sync_s
            + self.task_overhead_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassCosts:
  """Measured costs of the per-step work outside the nodes' tasks and the link: per-byte times
  of the elementwise memory passes (s per byte) and the fixed cost of a lock-step group."""

  # The optimizer's update plus `optax.apply_updates`.
  update_s_per_byte: float
  # One gradient addition (accumulating a micro-batch's gradient).
  add_s_per_byte: float
  # Writing a buffer (a conditional branch's outputs and zeros).
  fill_s_per_byte: float = 0.0
  # Seconds each group costs on several devices beyond its tasks and its messages' link time
  # (the devices meeting; `program.group_cost.measure`); 0 = not counted.
  group_s: float = 0.0
  # Seconds each task costs on several devices beyond its profiled time (its place in the
  # group's branch: reading and writing the group buffers; `program.group_cost.measure`).
  task_fixed_s: float = 0.0

  def time_s(self, param_bytes: float, microbatches: int) -> float:
    return param_bytes * (self.update_s_per_byte + microbatches * self.add_s_per_byte)


def measure_pass_costs(
  optimizer: Any, nbytes: int = 32 << 20, *, warmup: int = 2, repeats: int = 7
) -> PassCosts:
  """Times `optimizer`'s update, one addition and one fill of a float32 buffer of `nbytes`.

  Args:
    optimizer: an optax GradientTransformation (elementwise; its state is built for the buffer).
    nbytes: buffer size; large enough to leave the caches, as a model's parameters do.
    warmup, repeats: as `costs.median_time_s`.
  """
  n = max(1, nbytes // 4)
  params = jnp.ones((n,), jnp.float32)
  grads = jnp.full((n,), 1e-3, jnp.float32)

  # The update and the addition run in place, as in the step (which donates its state and adds
  # gradient windows into its buffer in place): a fresh output buffer per call would also time
  # the kernel's first-touch page faults, 4x the pass itself on this machine.
  def update(p, o, g):
    u, o = optimizer.update(g, o, p)
    return optax.apply_updates(p, u), o

  update = jax.jit(update, donate_argnums=(0, 1))
  add = jax.jit(lambda a, b: a + b, donate_argnums=0)
  fill = jax.jit(lambda c: jnp.full((n,), c))  # the value is traced: a real write pass
  carry = {"update": (jnp.array(params, copy=True), optimizer.init(params)), "add": jnp.zeros_like(grads)}

  def run_update():
    carry["update"] = update(*carry["update"], grads)
    return carry["update"]

  def run_add():
    carry["add"] = add(carry["add"], grads)
    return carry["add"]

  med = costs_lib.median_time_s
  t_update = med(run_update, warmup=warmup, repeats=repeats)
  t_add = med(run_add, warmup=warmup, repeats=repeats)
  t_fill = med(lambda: fill(jnp.float32(0)), warmup=warmup, repeats=repeats)
  return PassCosts(
    update_s_per_byte=t_update / (4 * n), add_s_per_byte=t_add / (4 * n),
    fill_s_per_byte=t_fill / (4 * n),
  )


def param_bytes_per_device(graph: graph_lib.OpGraph, assignment: Sequence[int]) -> list[int]:
  """Parameter bytes each model-axis device holds in the program: its owned leaves + shared ones."""
  devices = max(assignment, default=0) + 1
  layout = structure_lib.param_layout(graph, assignment, devices)
  shared = sum(aval_bytes(graph.param_avals[i]) for i in layout.shared)
  return [b + shared for b in layout.bytes_per_device()]


def task_times(graph: graph_lib.OpGraph, costs: costs_lib.CostModel) -> tuple[list, list]:
  """Per node: (forward seconds, backward seconds) under `costs`."""
  fwd, bwd = [], []
  for n in graph.nodes:
    total = costs.node_time_s(n)
    f = costs.forward_time_s(n) if hasattr(costs, "forward_time_s") else FORWARD_SHARE * total
    f = min(f, total)
    fwd.append(f)
    bwd.append(total - f)
  return fwd, bwd


def split_task_times(graph: graph_lib.OpGraph, costs: costs_lib.CostModel) -> tuple[list, list]:
  """Per node: (B, W) seconds of a split schedule under `costs`: its `input_grad_time_s` and
  `weight_grad_time_s` where it has them (B at most the backward), else the backward shared by
  INPUT_GRAD_SHARE, as the planner's Problem does."""
  _, bwd = task_times(graph, costs)
  if hasattr(costs, "input_grad_time_s"):
    b_in = [min(costs.input_grad_time_s(n), b) for n, b in zip(graph.nodes, bwd)]
    return b_in, [costs.weight_grad_time_s(n) for n in graph.nodes]
  return [INPUT_GRAD_SHARE * b for b in bwd], [(1 - INPUT_GRAD_SHARE) * b for b in bwd]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupPrice:
  """One lock-step group's price: each device's tasks and each message (seconds)."""

  tasks_s: tuple[float, ...]  # per model-axis device (0.0: no task in this group)
  messages_s: tuple[float, ...]  # per message, the slowest sender's time


def group_prices(
  graph: graph_lib.OpGraph, structure: tasks_lib.Structure, costs: costs_lib.CostModel
) -> list[GroupPrice]:
  """The price of each of a program's groups (`program_step_s` sums them; experiments/
  trace_groups.py sets them beside a traced step)."""
  devices = structure.devices
  split = structure.schedule.split
  fwd, bwd = task_times(graph, costs)
  if split:
    b_in, w = split_task_times(graph, costs)

  def t(op: sched_lib.Op) -> float:
    if op.kind == "F":
      return fwd[op.node]
    if not split:
      return bwd[op.node]
    return b_in[op.node] if op.kind == "B" else w[op.node]

  out = []
  for g, lay in enumerate(structure.groups):
    per_device = [0.0] * devices
    for d, op in lay.tasks:
      per_device[d] += t(op)
    messages = []
    for shift, dt, _, length in structure.message_plan(g):
      nbytes = length * jax.numpy.dtype(tasks_lib.lane_dtype(dt)).itemsize
      messages.append(max(
        costs.transfer_time_s(nbytes, src, (src + shift) % devices) for src in range(devices)
      ))
    out.append(GroupPrice(tasks_s=tuple(per_device), messages_s=tuple(messages)))
  return out


def program_step_s(
  graph: graph_lib.OpGraph,
  structure: tasks_lib.Structure,
  assignment: Sequence[int],
  costs: costs_lib.CostModel,
  pass_costs: PassCosts | None = None,
) -> LockstepTime:
  """Prices a program's task groups (`HybridProgram.structure`) in lock step.

  Args:
    graph: the op graph the program replays.
    structure: the program's lock-step structure (`program.tasks.build`).
    assignment: node -> model-axis device.
    costs: the cost model (node times, link).
    pass_costs: per-byte optimizer-update, gradient-add and fill times; None leaves them out.

  Returns:
    The predicted compute, transfer and total step time.
  """
  devices = structure.devices
  k = structure.schedule.microbatches
  compute = transfer = fill_s = 0.0
  count = 0
  fill_rate = pass_costs.fill_s_per_byte if pass_costs is not None and devices > 1 else 0.0
  per_task = pass_costs.task_fixed_s if pass_costs is not None and devices > 1 else 0.0
  overhead = 0.0
  for g, price in enumerate(group_prices(graph, structure, costs)):
    busiest = max(price.tasks_s, default=0.0)
    compute += busiest
    tasks_s = price.tasks_s
    if per_task:
      counts = [0] * devices
      for d, _ in structure.groups[g].tasks:
        counts[d] += 1
      tasks_s = tuple(t + per_task * n for t, n in zip(tasks_s, counts))
      overhead += max(tasks_s, default=0.0) - busiest
      busiest = max(tasks_s, default=0.0)
    if fill_rate:
      # Each device builds its outputs after its tasks; the group waits for the slowest.
      fills = structure.fill_bytes_per_device(g)
      fill_s += max(tasks_s[d] + fill_rate * b for d, b in enumerate(fills)) - busiest
    for m in price.messages_s:  # summed in the same order as before the per-group prices
      transfer += m
      count += 1
  param_s = 0.0
  if pass_costs is not None:
    param_s = max(pass_costs.time_s(b, k) for b in param_bytes_per_device(graph, assignment))
    # Every device starts the step's gradient rows as a fresh zero-filled buffer, as long as its
    # parameter rows (padded to the largest device's share).
    layout = structure_lib.param_layout(graph, assignment, devices)
    param_s += pass_costs.fill_s_per_byte * layout.row_bytes()
  sync = 0.0
  if pass_costs is not None and devices > 1:
    sync = pass_costs.group_s * len(structure.groups)
  return LockstepTime(
    compute_s=compute, transfer_s=transfer, groups=len(structure.groups), transfers=count,
    param_s=param_s, fill_s=fill_s, group_sync_s=sync, task_overhead_s=overhead,
  )


def busiest_task_count(structure: tasks_lib.Structure) -> int:
  """Sum over groups of the busiest device's number of tasks (what a per-task cost adds to the
  lock-step step when tasks cost nothing else)."""
  total = 0
  for lay in structure.groups:
    counts: dict[int, int] = {}
    for d, _ in lay.tasks:
      counts[d] = counts.get(d, 0) + 1
    total += max(counts.values(), default=0)
  return total


def plan_step_s(
  graph: graph_lib.OpGraph,
  plan: Any,
  costs: costs_lib.CostModel,
  pack_max_bytes: int | None = None,
  pass_costs: PassCosts | None = None,
  branch_remat: str = "none",
  schedule: str | sched_lib.TaskSchedule | None = None,
) -> LockstepTime:
  """`program_step_s` of the program `HybridProgram.build` makes from `plan` (a planner Plan).

  Args:
    graph, costs, pass_costs: as `program_step_s`.
    plan: the placement (assignment, micro-batches, and its start order for the forwards).
    pack_max_bytes: unused (kept for callers of the v1 signature).
    branch_remat: the program's `branch_remat` (what F saves; 'full' replays every node).
    schedule: the task schedule; default: the plan's own (`plan.task_schedule`) if it has one,
      else '1f1b' generated from the placement.
  """
  del pack_max_bytes
  if schedule is None:
    schedule = getattr(plan, "task_schedule", None) or sched_lib.DEFAULT_KIND
  order = structure_lib.plan_order(plan.schedule)
  fwd, _ = task_times(graph, costs)
  _, structure, _ = executor.structure_for(
    graph, plan.assignment, plan.devices, plan.microbatches, schedule, order=order or None,
    forward_s=fwd, branch_remat=branch_remat,
  )
  return program_step_s(graph, structure, plan.assignment, costs, pass_costs)


def choose(
  graph: graph_lib.OpGraph,
  plans: Sequence[Any],
  costs: costs_lib.CostModel,
  pass_costs: PassCosts | None = None,
  *,
  pack_max_bytes: int | None = None,
  branch_remat: str = "none",
  schedule: str | None = None,
) -> tuple[Any, list[float]]:
  """The plan the program runs fastest in lock step (first on ties), and every plan's time.

  The MILP minimises the asynchronous schedule's makespan, which lets transfers overlap compute;
  where transfers are slow and serialised (one-core CPU processes over gloo) a heuristic plan with
  fewer transfers can run faster. Pass the MILP plan and heuristic plans for the same graph, and
  the program options the plan will run with.

  Raises:
    ValueError: if `plans` is empty.
  """
  if not plans:
    raise ValueError("choose() needs at least one plan")
  times = [
    plan_step_s(graph, p, costs, pack_max_bytes, pass_costs, branch_remat, schedule).step_s
    for p in plans
  ]
  best = min(range(len(plans)), key=lambda i: (times[i], i))
  return plans[best], times
