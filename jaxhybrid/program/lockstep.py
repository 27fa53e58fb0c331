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

Per-step work outside the nodes, priced when a `PassCosts` is given (`measure_pass_costs`):

  + max over devices d of  P_d * (update_s_per_byte + (k - 1) * add_s_per_byte)

with P_d the parameter bytes device d holds (owned + shared): the optimizer update of its
parameters, and with k micro-batches the k - 1 additions that accumulate their gradients. Both
are elementwise passes over the parameters, so (assumption, named here) linear in bytes. On one
CPU core they are not small: Adam over BigLSTM-small's 39 MB took 70 ms, one 39 MB add 21 ms,
against ~600 ms of node work.

  + sum over groups of  max over devices d of  Z_d(g) * fill_s_per_byte      (M > 1 only)

the conditionals' zero-fill: a device writes zeros for every output of another device's tasks
that leaves the group (`structure.group_outputs`) and, because JAX differentiates `lax.switch`
by making each branch output all branches' residuals, for their residuals too (forward), and
zero cotangents for every group operand its own tasks do not read (backward). Z_d(g) counts
those bytes from the graph (`residual_bytes`). Checked on Inception-V3 small (2-way plan, 43 groups): the count gives 440 MB
of conditional outputs per step, the traced program's conditionals output 411 MB (JAX merges
some residuals of equal shape). With the program's `branch_remat` policy only what it saves
counts; the recomputation that buys is priced through the node times when they were measured
under the same policy (`costs.ProfiledCostModel(branch_remat=...)`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax

from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid.graph import remat
from jaxhybrid.graph.eqn_costs import aval_bytes
from jaxhybrid.program import structure as structure_lib


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
  # Busiest device's optimizer update and gradient accumulation (0 without PassCosts).
  param_s: float = 0.0
  # Conditionals' zero-fill, busiest device per group (0 without PassCosts or on one device).
  fill_s: float = 0.0

  @property
  def step_s(self) -> float:
    return self.compute_s + self.transfer_s + self.param_s + self.fill_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassCosts:
  """Per-byte times of the per-step elementwise memory passes outside the nodes (s per byte)."""

  # The optimizer's update plus `optax.apply_updates`.
  update_s_per_byte: float
  # One gradient addition (accumulating a micro-batch's gradient).
  add_s_per_byte: float
  # Writing a constant (a conditional branch's zero outputs).
  fill_s_per_byte: float = 0.0

  def time_s(self, param_bytes: float, microbatches: int) -> float:
    return param_bytes * (self.update_s_per_byte + (microbatches - 1) * self.add_s_per_byte)


def measure_pass_costs(optimizer: Any, nbytes: int = 32 << 20, *, warmup: int = 2, repeats: int = 7) -> PassCosts:
  """Times `optimizer`'s update, one addition and one fill of a float32 buffer of `nbytes`.

  Args:
    optimizer: an optax GradientTransformation (elementwise; its state is built for the buffer).
    nbytes: buffer size; large enough to leave the caches, as a model's parameters do.
    warmup, repeats: as `costs.median_time_s`.
  """
  n = max(1, nbytes // 4)
  params = jnp.ones((n,), jnp.float32)
  grads = jnp.full((n,), 1e-3, jnp.float32)
  state = optimizer.init(params)

  @jax.jit
  def update(p, o, g):
    u, o = optimizer.update(g, o, p)
    return optax.apply_updates(p, u), o

  add = jax.jit(lambda a, b: a + b)
  fill = jax.jit(lambda c: jnp.full((n,), c))  # the value is traced: a real write pass
  t_update = costs_lib.median_time_s(lambda: update(params, state, grads), warmup=warmup, repeats=repeats)
  t_add = costs_lib.median_time_s(lambda: add(grads, params), warmup=warmup, repeats=repeats)
  t_fill = costs_lib.median_time_s(lambda: fill(jnp.float32(0)), warmup=warmup, repeats=repeats)
  return PassCosts(
    update_s_per_byte=t_update / (4 * n), add_s_per_byte=t_add / (4 * n),
    fill_s_per_byte=t_fill / (4 * n),
  )


def residual_bytes(graph: graph_lib.OpGraph, node: Any, policy: Any = None) -> int:
  """Bytes `jax.vjp` of the node saves for its backward (w.r.t. its float, non-batch inputs).

  With a `jax.checkpoint` policy (`graph.remat.BRANCH_REMAT_POLICIES`), only what the policy saves
  counts: the node's own inputs are then the branch's operands or recomputed, not saved.
  """
  kinds = dict(zip(graph.jaxpr.invars, graph.input_kinds))
  fn = graph.node_fn(node)
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in node.invars]
  diff = [
    i for i, v in enumerate(node.invars)
    if np.issubdtype(v.aval.dtype, np.inexact) and kinds.get(v, (graph_lib.PARAM, 0))[0] == graph_lib.PARAM
  ]

  def f_of(xs):
    def f(*d):
      args = list(xs)
      for i, x in zip(diff, d):
        args[i] = x
      return fn(*args)

    return f if policy is None else jax.checkpoint(f, policy=policy)

  def residuals(*xs):
    return jax.tree.leaves(jax.vjp(f_of(xs), *[xs[i] for i in diff])[1])

  if policy is None:
    shapes = jax.eval_shape(residuals, *avals)
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in shapes)
  # As jax's saved_residuals: the residual outputs of the traced vjp that are not its arguments.
  closed = jax.make_jaxpr(residuals)(*avals)
  args = set(closed.jaxpr.invars)
  saved = {v for v in closed.jaxpr.outvars if not isinstance(v, jex.core.Literal) and v not in args}
  return sum(aval_bytes(v.aval) for v in saved)


def param_bytes_per_device(graph: graph_lib.OpGraph, assignment: Sequence[int]) -> list[int]:
  """Parameter bytes each model-axis device holds in the program: its owned leaves + shared ones."""
  devices = max(assignment, default=0) + 1
  layout = structure_lib.param_layout(graph, assignment, devices)
  shared = sum(aval_bytes(graph.param_avals[i]) for i in layout.shared)
  return [b + shared for b in layout.bytes_per_device()]


def zero_fill_bytes(
  graph: graph_lib.OpGraph, tasks: Sequence[Any], devices: int, residuals: Callable[[int], int],
  outputs: Any = None,
) -> dict[int, int]:
  """Per device, the bytes of zeros it writes in one group's forward and backward conditionals.

  Forward: the outputs and residuals of the other devices' tasks. Backward: the cotangents of
  the group's differentiated operands (parameters and activations) its own tasks do not read.

  Args:
    graph: the op graph.
    tasks: one group (`HybridProgram.groups` entry).
    devices: model-axis devices.
    residuals: node id -> its residual bytes (`residual_bytes`).
    outputs: the (value, micro-batch) keys the group returns (`structure.group_outputs`); None
      counts every output of its tasks.
  """
  kinds = dict(zip(graph.jaxpr.invars, graph.input_kinds))
  consts = set(graph.jaxpr.constvars)
  made = {(v, t.microbatch) for t in tasks for v in graph.nodes[t.node].outvars}
  own = dict.fromkeys(range(devices), 0)
  readers: dict[tuple[Any, int], set[int]] = {}
  for t in tasks:
    node = graph.nodes[t.node]
    own[t.device] += residuals(t.node) + sum(
      aval_bytes(v.aval) for v in node.outvars if outputs is None or (v, t.microbatch) in outputs
    )
    for v in node.invars:
      if isinstance(v, jex.core.Literal) or v in consts or (v, t.microbatch) in made:
        continue  # literals, constants, values of this group
      kind = kinds.get(v, (None, 0))[0]
      if kind in (graph_lib.BATCH, graph_lib.STATE) or not np.issubdtype(v.aval.dtype, np.inexact):
        continue  # not differentiated: no cotangent
      readers.setdefault((v, 0 if kind == graph_lib.PARAM else t.microbatch), set()).add(t.device)
  total = sum(own.values())
  return {
    d: total - own[d] + sum(aval_bytes(v.aval) for (v, _), r in readers.items() if d not in r)
    for d in range(devices)
  }


def program_step_s(
  graph: graph_lib.OpGraph,
  groups: Sequence[Sequence[Any]],
  assignment: Sequence[int],
  costs: costs_lib.CostModel,
  pack_max_bytes: int | None = None,
  pass_costs: PassCosts | None = None,
  microbatches: int = 1,
  branch_remat: str = "none",
) -> LockstepTime:
  """Prices a program's groups (`HybridProgram.groups`) in lock step (see module docstring).

  Args:
    graph: the op graph the program replays.
    groups: lists of tasks with `.node`, `.microbatch`, `.device`, in program order.
    assignment: node -> model-axis device.
    costs: the cost model (node times, link).
    pack_max_bytes: as `HybridProgram.build`'s (default: the program's default): a packed
      message costs one link time of its longest source buffer.
    pass_costs: per-byte optimizer-update, gradient-add and fill times; None leaves them out.
    microbatches: micro-batches per step (gradient accumulations: microbatches - 1).
    branch_remat: as `HybridProgram.build`'s: what the conditionals save (and so zero-fill).
      Its recomputation is in `costs`' node times only if they were measured under it.

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
      nbytes = max(sum(aval_bytes(v.aval) for v, _ in keys) for keys in msg.payloads.values())
      # The ppermute ends when its slowest pair does; forward activations, backward gradients.
      transfer += 2 * max(
        costs.transfer_time_s(nbytes, src, (src + msg.shift) % devices) for src in msg.payloads
      )
      count += 1
  param_s = fill_s = 0.0
  cache: dict[int, int] = {}
  policy = remat.remat_policy(branch_remat)

  def _residuals(nid: int) -> int:
    if nid not in cache:
      cache[nid] = residual_bytes(graph, graph.nodes[nid], policy)
    return cache[nid]

  if pass_costs is not None:
    param_s = max(pass_costs.time_s(b, microbatches) for b in param_bytes_per_device(graph, assignment))
    if devices > 1 and pass_costs.fill_s_per_byte > 0:
      fill_s = pass_costs.fill_s_per_byte * sum(
        max(zero_fill_bytes(graph, tasks, devices, _residuals, set(outs)).values())
        for tasks, outs in zip(groups, structure_lib.group_outputs(graph, groups))
      )
  return LockstepTime(
    compute_s=compute, transfer_s=transfer, groups=len(groups), transfers=count, param_s=param_s,
    fill_s=fill_s,
  )


def plan_step_s(
  graph: graph_lib.OpGraph,
  plan: Any,
  costs: costs_lib.CostModel,
  pack_max_bytes: int | None = None,
  pass_costs: PassCosts | None = None,
  branch_remat: str = "none",
) -> LockstepTime:
  """`program_step_s` for the groups `HybridProgram.build` makes from `plan` (a planner Plan)."""
  order = structure_lib.plan_order(plan.schedule)
  slots = structure_lib.slots_from_schedule(graph, plan.assignment, plan.microbatches, order or None)
  return program_step_s(
    graph, structure_lib.group_slots(graph, slots), plan.assignment, costs, pack_max_bytes,
    pass_costs, plan.microbatches, branch_remat,
  )


def choose(
  graph: graph_lib.OpGraph,
  plans: Sequence[Any],
  costs: costs_lib.CostModel,
  pass_costs: PassCosts | None = None,
  *,
  pack_max_bytes: int | None = None,
  branch_remat: str = "none",
) -> tuple[Any, list[float]]:
  """The plan the program runs fastest in lock step (first on ties), and every plan's time.

  The MILP minimises the asynchronous schedule's makespan, which lets transfers overlap compute;
  where transfers are slow and serialised (one-core CPU processes over gloo) a heuristic plan with
  fewer transfers can run faster. Pass the MILP plan and heuristic plans for the same graph, and
  the program options the plan will run with (`pack_max_bytes`, `branch_remat`).

  Raises:
    ValueError: if `plans` is empty.
  """
  if not plans:
    raise ValueError("choose() needs at least one plan")
  times = [
    plan_step_s(graph, p, costs, pack_max_bytes, pass_costs, branch_remat).step_s for p in plans
  ]
  best = min(range(len(plans)), key=lambda i: (times[i], i))
  return plans[best], times
