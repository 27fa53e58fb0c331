"""The hybrid program: a Plan runs as ONE jitted DP x MP train step on a (data, model) mesh.

Inside one `jax.shard_map` over ('data', 'model'):

* the forward loss is replayed node by node from the traced jaxpr (`OpGraph.node_fn`); the plan's
  schedule is cut into *slots*, and in each slot every model-axis device runs its own task
  through `lax.switch(axis_index('model'), branches)` (MPMD inside SPMD). A branch returns the
  values of the group that later groups read, zeros for the tasks of other devices, so all
  branches agree (`branch_remat` bounds what they also save for the backward);
* a tensor consumed on another device moves by `lax.ppermute` right after the group of slots
  that made it, outside any branch (small ones of a group packed into one message per direction);
* a worker's batch is cut into `microbatches`; the tasks of different micro-batches interleave
  as the plan scheduled them, so the pipeline fills;
* gradients come from `jax.value_and_grad` of that placed forward (the backward runs on the same
  devices in reverse), are averaged over 'data', and the optax update runs in the same program.

Parameters are owned: every leaf read by nodes of a single device lives only in that device's row
of a flat `[model, max_size]` buffer (one per dtype) sharded over 'model'; a branch slices its
leaves from its own row at static offsets. A leaf read on several devices is *shared*: replicated,
its gradient summed over 'model'. Optimizer state follows its parameters. Elementwise optimizers
(SGD, Adam, AdaGrad, ...) therefore act on exactly the right values; transforms that need a
global view of the parameters would see only one device's share: for global-norm clipping use
`jaxhybrid.train.optim.clip_by_global_norm`, which reduces over 'model'.

The static structure (parameter layout, slots, groups, messages) is built in jaxhybrid.program.structure;
the parameter rows are packed and viewed by jaxhybrid.program.param_rows; messages run in
jaxhybrid.program.transfers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid import graph as graph_lib
from jaxhybrid import noise_scale as noise_lib
from jaxhybrid.graph import convs
from jaxhybrid.graph.remat import remat_policy
from jaxhybrid.mesh import DATA, MODEL
from jaxhybrid.program import batch_shapes, param_rows, transfers
from jaxhybrid.program.structure import (
  DEFAULT_PACK_MAX_BYTES,
  ParamLayout,
  Task,
  group_messages,
  group_outputs,
  group_slots,
  param_layout,
  slots_from_schedule,
)

log = logging.getLogger(__name__)

# shard_map's varying-axes type check stays off: the program replays equations traced OUTSIDE
# shard_map, and their nested jaxprs (scan bodies, custom_jvp rules) carry no varying-axes types,
# so the check rejects e.g. a scan body's matmul of a carried state by a varying weight. With the
# check off, autodiff inserts no implicit collectives: every gradient below is the device's own,
# and the step averages and sums them explicitly (pmean over 'data', psum of shared leaves over
# 'model'), which the equivalence tests verify against the single-device reference.
CHECK_VMA = False


def _varying_axes(x: jax.Array) -> frozenset[str]:
  """Mesh axes over which a value inside shard_map varies (its 'vma' type)."""
  t = jax.typeof(x)
  mat = getattr(t, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(t, "vma", ()))  # older JAX


def _sq(tree: Any, psum_axis: str | None = None) -> jax.Array:
  """Sum of squares of a gradient pytree (psum'd over `psum_axis` for per-device shares)."""
  total = sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))
  return lax.psum(total, psum_axis) if psum_axis else total


def _global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array from a host value that every process holds in full (multi-host safe)."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _host(x: jax.Array) -> np.ndarray:
  """The full value of a global array on this host (gathers across processes if needed)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ---- the program ------------------------------------------------------------------------------

class TrainState(NamedTuple):
  """Parameters and optimizer state of the hybrid program (owned rows + shared leaves)."""

  params: dict[str, Any]  # {'owned': {dtype: [model, size]}, 'shared': [leaves]}
  opt_state: Any
  step: jax.Array


@dataclasses.dataclass
class HybridProgram:
  """One compiled DP x MP train step for a placed graph.

  Build with `HybridProgram.build(...)`; then `state = prog.init_state(param_leaves)` and
  `state, metrics = prog.step(state, batch)` (the batch is the global batch, a pytree like the
  traced one with the leading dimension data x per-worker batch).
  """

  graph: graph_lib.OpGraph
  mesh: jax.sharding.Mesh
  optimizer: optax.GradientTransformation
  assignment: tuple[int, ...]
  microbatches: int
  layout: ParamLayout
  slots: list[dict[int, Task]]
  groups: list[list[Task]]
  per_example: tuple[bool, ...]
  state_leaves: tuple[Any, ...]
  remat: frozenset[int]
  # Replay convolutions in the canonical layout (see jaxhybrid/graph/convs.py); on for CPU meshes.
  canonical_convs: bool = False
  # Transfers of one group smaller than this many bytes travel packed, one ppermute per direction
  # (see `group_messages`); 0 sends every tensor on its own.
  pack_max_bytes: int = 0
  # What a group's conditional saves for its backward (see BRANCH_REMAT_POLICIES).
  branch_remat: str = "none"
  _step: Callable | None = None

  # ---- construction ---------------------------------------------------------------------------
  @classmethod
  def build(
    cls,
    graph: graph_lib.OpGraph,
    mesh: jax.sharding.Mesh,
    optimizer: optax.GradientTransformation,
    assignment: Sequence[int],
    *,
    microbatches: int = 1,
    order: Sequence[tuple[int, int]] | None = None,
    state: Any = None,
    per_example: Sequence[bool] | None = None,
    remat: Sequence[str] = (),
    canonical_convs: bool | None = None,
    pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES,
    branch_remat: str = "none",
  ) -> HybridProgram:
    """Builds the program.

    Args:
      graph: the op graph, traced at the MICRO-batch size.
      mesh: a ('data', 'model') mesh (jaxhybrid.mesh.make).
      optimizer: an optax transformation (elementwise ones act exactly; see module docstring).
      assignment: node id -> model-axis device index.
      microbatches: micro-batches per worker batch.
      order: (node, microbatch) start order from the plan's schedule.
      state: concrete read-only model state leaves (e.g. BatchNorm statistics), if any.
      per_example: per batch leaf, whether it has a leading batch dimension (default: leaves
        whose leading dimension equals the traced micro-batch size).
      remat: node names to rematerialise in the backward pass.
      canonical_convs: replay convolutions in the canonical NHWC/HWIO layout, backward included
        (`jaxhybrid.graph.convs`). XLA:CPU leaves convolutions inside conditional branches in the
        layout autodiff wrote, which runs their gradients ~6x slower; None = on when the mesh's
        devices are CPUs.
      pack_max_bytes: a group's transfers below this size share one ppermute per direction
        (`group_messages`); 0 sends each on its own.
      branch_remat: 'none' (a group's conditional saves every residual its backward needs),
        'dots' (only matmul and convolution outputs; the rest is recomputed in the backward) or
        'full' (nothing; the forward is replayed). Every device's conditional returns the
        residuals of ALL devices' branches, zeros for the others', so fewer saved bytes also
        means less zero-filling (`BRANCH_REMAT_POLICIES`).

    Raises:
      ValueError: if the assignment does not fit the graph or the mesh.
    """
    M = mesh.shape[MODEL]
    if len(assignment) != len(graph.nodes):
      raise ValueError(
        f"the plan places {len(assignment)} nodes but the graph has {len(graph.nodes)}: "
        "re-plan for this graph"
      )
    if assignment and max(assignment) >= M:
      raise ValueError(
        f"the plan uses {max(assignment) + 1} model-axis devices but the mesh has {M}: "
        f"use a mesh with model={max(assignment) + 1} or re-plan with devices={M}"
      )
    batch_avals = [
      v.aval for v, (k, _) in zip(graph.jaxpr.invars, graph.input_kinds) if k == graph_lib.BATCH
    ]
    if per_example is None:
      sizes = [a.shape[0] for a in batch_avals if a.shape]
      mb = max(set(sizes), key=sizes.count) if sizes else 1
      per_example = [bool(a.shape) and a.shape[0] == mb for a in batch_avals]
    n_state = sum(1 for k, _ in graph.input_kinds if k == graph_lib.STATE)
    state_leaves = tuple(jax.tree.leaves(state)) if state is not None else ()
    if len(state_leaves) != n_state:
      raise ValueError(f"the graph reads {n_state} state leaves, got {len(state_leaves)}")
    remat_policy(branch_remat)  # validates the name
    names = {n.name: n.id for n in graph.nodes}
    unknown = [r for r in remat if r not in names]
    if unknown:
      raise ValueError(f"remat names unknown nodes {unknown}; known: {sorted(names)[:10]}...")
    prog = cls(
      graph=graph, mesh=mesh, optimizer=optimizer, assignment=tuple(int(a) for a in assignment),
      microbatches=microbatches, layout=param_layout(graph, assignment, M),
      slots=(slots := slots_from_schedule(graph, assignment, microbatches, order)),
      groups=group_slots(graph, slots),
      per_example=tuple(per_example), state_leaves=state_leaves,
      remat=frozenset(names[r] for r in remat),
      canonical_convs=(
        mesh.devices.flat[0].platform == "cpu" if canonical_convs is None else bool(canonical_convs)
      ),
      pack_max_bytes=int(pack_max_bytes), branch_remat=branch_remat,
    )
    return prog

  # ---- parameter packing ----------------------------------------------------------------------
  def pack(self, leaves: Sequence[Any]) -> dict[str, Any]:
    """Flat parameter leaves (graph order) -> {'owned': {dtype: [M, size]}, 'shared': [...]}.

    Built on the host with numpy (`param_rows.pack`); use for models that fit in host memory.
    """
    rows = param_rows.pack(self.layout, leaves)
    return {
      "owned": {dt: _global(r, NamedSharding(self.mesh, P(MODEL, None))) for dt, r in rows.items()},
      "shared": [_global(np.asarray(leaves[i]), NamedSharding(self.mesh, P())) for i in self.layout.shared],
    }

  def unpack(self, params: dict[str, Any]) -> list[np.ndarray]:
    """The inverse of `pack`: flat parameter leaves in graph order (on the host)."""
    rows = {dt: _host(r) for dt, r in params["owned"].items()}
    return param_rows.unpack(self.layout, rows, [_host(x) for x in params["shared"]])

  def _param_specs(self) -> dict[str, Any]:
    return {
      "owned": {dt: P(MODEL, None) for dt, _ in self.layout.sizes},
      "shared": [P() for _ in self.layout.shared],
    }

  def _opt_specs(self, opt_state: Any) -> Any:
    specs = self._param_specs()
    try:
      return optax.tree_map_params(
        self.optimizer, lambda _, s: s, opt_state, specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P),
      )
    except Exception:  # pragma: no cover - unusual optimizer state; fall back to shapes
      rows = {(self.layout.devices, n) for _, n in self.layout.sizes}
      return jax.tree.map(lambda x: P(MODEL, None) if tuple(np.shape(x)) in rows else P(), opt_state)

  def init_state(self, leaves: Sequence[Any]) -> TrainState:
    """Packs parameter leaves and initialises the optimizer state on the mesh."""
    params = self.pack(leaves)
    abstract = jax.eval_shape(self.optimizer.init, params)
    specs = self._opt_specs(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    opt_state = jax.jit(self.optimizer.init, out_shardings=shardings)(params)
    step = _global(np.zeros((), np.int32), NamedSharding(self.mesh, P()))  # as the step returns it
    return TrainState(params=params, opt_state=opt_state, step=step)

  # ---- the step -------------------------------------------------------------------------------
  def _vary(self, x: jax.Array) -> jax.Array:
    """Marks x as varying over both mesh axes (switch branches must agree on this)."""
    if not CHECK_VMA:
      return x
    have = _varying_axes(x)
    missing = tuple(a for a in (DATA, MODEL) if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x

  def _local_loss(self, views: dict[int, jax.Array], shared: list[jax.Array], state: Sequence[Any], batch: Sequence[Any]) -> jax.Array:
    """The placed forward on one device: returns the loss on the loss node's device, 0 elsewhere.

    Args:
      views: owned parameter leaves by leaf index (see `param_rows.views`).
      shared: the shared leaves, in `layout.shared` order.
      state: read-only model state leaves.
      batch: this worker's batch leaves.
    """
    g, lay, k = self.graph, self.layout, self.microbatches
    jaxpr = g.jaxpr
    kinds = dict(zip(jaxpr.invars, g.input_kinds))
    consts = dict(zip(jaxpr.constvars, g.closed_jaxpr.consts))
    shared_pos = {leaf: j for j, leaf in enumerate(lay.shared)}
    # Micro-batches: [local_batch, ...] -> k x [mb, ...]
    mbatches = []
    for j, x in enumerate(batch):
      if self.per_example[j]:
        x = x.reshape((k, x.shape[0] // k) + x.shape[1:])
        mbatches.append([x[m] for m in range(k)])
      else:
        mbatches.append([x] * k)
    env: dict[tuple[Any, int], jax.Array] = {}
    me = lax.axis_index(MODEL)

    def value(v, mb):
      if v in consts:
        return consts[v]
      if v in kinds:
        kind, idx = kinds[v]
        if kind == graph_lib.PARAM:
          return shared[shared_pos[idx]] if lay.owner[idx] < 0 else views[idx]
        if kind == graph_lib.STATE:
          return state[idx]
        return mbatches[idx][mb]
      return env[(v, mb)]

    consumers: dict[Any, set[int]] = {}
    for n in g.nodes:
      for v in n.invars:
        consumers.setdefault(v, set()).add(self.assignment[n.id])

    node_fns = {}

    def fn_of(nid):
      if nid not in node_fns:
        closed = g.node_jaxpr(g.nodes[nid])
        use = self.canonical_convs and convs.has_convs(closed.jaxpr)
        f = convs.jaxpr_fn(closed) if use else jex.core.jaxpr_as_fun(closed)
        node_fns[nid] = jax.checkpoint(f) if nid in self.remat else f
      return node_fns[nid]

    for tasks, out_keys in zip(self.groups, group_outputs(g, self.groups)):
      made = {(v, t.microbatch) for t in tasks for v in g.nodes[t.node].outvars}
      # Operands shared by all branches: every value the group's tasks read from before the group
      # (parameters of the task's node, activations, batch and state), constants excepted.
      op_keys: list[tuple[Any, int]] = []
      for t in tasks:
        for v in g.nodes[t.node].invars:
          if v in consts or (v, t.microbatch) in made:
            continue
          key = (v, 0) if v in kinds and kinds[v][0] != graph_lib.BATCH else (v, t.microbatch)
          if key not in op_keys:
            op_keys.append(key)
      out_avals = [v.aval for v, _ in out_keys]

      def make_branch(dev, tasks=tasks, op_keys=op_keys, out_keys=out_keys, out_avals=out_avals):
        def branch(ops):
          local = dict(zip(op_keys, ops))
          results: dict[tuple[Any, int], jax.Array] = {}
          for t in tasks:
            if t.device != dev:
              continue
            node = g.nodes[t.node]
            args = []
            for v in node.invars:
              if v in consts:
                args.append(consts[v])
              elif (v, t.microbatch) in results:  # made earlier in this group, same device
                args.append(results[(v, t.microbatch)])
              elif v in kinds and kinds[v][0] != graph_lib.BATCH:
                args.append(local[(v, 0)])
              else:
                args.append(local[(v, t.microbatch)])
            outs = fn_of(t.node)(*args)
            for v, o in zip(node.outvars, outs):
              results[(v, t.microbatch)] = o
          return [
            self._vary(results[key]) if key in results else self._vary(jnp.zeros(a.shape, a.dtype))
            for key, a in zip(out_keys, out_avals)
          ]

        return branch

      ops = [self._vary(value(v, mb)) for v, mb in op_keys]
      if self.layout.devices == 1:
        outs = make_branch(0)(ops)
      else:
        branches = [make_branch(d) for d in range(self.layout.devices)]
        policy = remat_policy(self.branch_remat)
        if policy is not None:  # (jax.checkpoint's own policy=None would save nothing)
          branches = [jax.checkpoint(b, policy=policy) for b in branches]
        outs = lax.switch(me, branches, ops)
      for key, o in zip(out_keys, outs):
        env[key] = o
      # Transfers: values made in this group that other devices read, outside any branch.
      for msg in group_messages(g, tasks, consumers, self.layout.devices, self.pack_max_bytes):
        transfers.send(env, msg, me, self.layout.devices)

    loss_var = jaxpr.outvars[0]
    total = sum(env[(loss_var, m)] for m in range(k)) / k
    return total

  @property
  def per_worker_batch(self) -> int:
    """Examples per worker and step (micro-batch size x micro-batches)."""
    avals = [v.aval for v, (k, _) in zip(self.graph.jaxpr.invars, self.graph.input_kinds) if k == graph_lib.BATCH]
    sizes = [a.shape[0] for a, pe in zip(avals, self.per_example) if pe]
    return (sizes[0] if sizes else 1) * self.microbatches

  def _build_step(self) -> Callable:
    mesh = self.mesh
    W = mesh.shape[DATA]
    batch_specs = tuple(P(DATA) if pe else P() for pe in self.per_example)
    state_specs = tuple(P() for _ in self.state_leaves)

    def body(params, opt_state, state, batch):
      owned = jax.tree.map(lambda r: r[0], params["owned"])  # [1, size] -> [size]
      views = {i: self._vary(x) for i, x in param_rows.views(self.layout, owned).items()}
      shared_v = [self._vary(x) for x in params["shared"]]
      state_v = [self._vary(x) for x in state]
      batch_v = [self._vary(x) for x in batch]
      loss, (g_views, g_shared) = jax.value_and_grad(self._local_loss, argnums=(0, 1))(
        views, shared_v, state_v, batch_v
      )
      g_owned = param_rows.rows_from_views(self.layout, g_views)
      g_shared = [lax.psum(x, MODEL) for x in g_shared]  # each device holds its uses' share
      # |g_worker|^2 at the per-worker batch, averaged over workers (noise-scale input).
      sq_worker = lax.pmean(_sq(g_owned, MODEL) + _sq(g_shared), DATA)
      g_owned = jax.tree.map(lambda x: lax.pmean(x, DATA), g_owned)
      g_shared = [lax.pmean(x, DATA) for x in g_shared]
      sq_global = _sq(g_owned, MODEL) + _sq(g_shared)  # |g|^2 at the global batch
      loss = lax.pmean(lax.psum(loss, MODEL), DATA)
      grads = {"owned": jax.tree.map(lambda x: x[None], g_owned), "shared": g_shared}
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return params, opt_state, loss, (sq_worker, sq_global)

    return body, batch_specs, state_specs, W

  def step_fn(self) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted step `(state, batch) -> (state, metrics)`; the state is donated."""
    if self._step is not None:
      return self._step
    body, batch_specs, state_specs, W = self._build_step()
    param_specs = self._param_specs()
    mesh = self.mesh
    b = self.per_worker_batch

    def step(ts: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
      leaves = jax.tree.leaves(batch)
      opt_specs = self._opt_specs(ts.opt_state)
      f = jax.shard_map(
        body, mesh=mesh, check_vma=CHECK_VMA,
        in_specs=(param_specs, opt_specs, state_specs, batch_specs),
        out_specs=(param_specs, opt_specs, P(), (P(), P())),
      )
      params, opt_state, loss, (sq_worker, sq_global) = f(
        ts.params, ts.opt_state, tuple(self.state_leaves), tuple(leaves)
      )
      metrics = {"loss": loss, "grad_sq_norm": sq_global, "worker_grad_sq_norm": sq_worker}
      if W > 1:  # McCandlish et al. 2018 (appendix A) from the per-worker and global gradients
        g2, tr = noise_lib.noise_scale_estimates(sq_worker, sq_global, b, W * b)
        metrics.update(noise_g2=g2, noise_trace_sigma=tr)
      return TrainState(params, opt_state, ts.step + 1), metrics

    self._step = jax.jit(step, donate_argnums=0)
    return self._step

  def step(self, ts: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """One training step on a global batch; see `step_fn`."""
    return self.step_fn()(ts, self.shard_batch(batch))

  def shard_batch(self, batch: Any) -> list[jax.Array]:
    """Puts a global batch on the mesh: per-example leaves split over 'data'."""
    leaves = jax.tree.leaves(batch)
    if len(leaves) != len(self.per_example):
      raise ValueError(f"batch has {len(leaves)} leaves, the traced loss reads {len(self.per_example)}")
    W, k = self.mesh.shape[DATA], self.microbatches
    for x, pe in zip(leaves, self.per_example):
      if pe and np.shape(x)[0] % (W * k):
        raise ValueError(
          f"batch dimension {np.shape(x)[0]} is not divisible by data ({W}) x micro-batches ({k}): "
          f"use a global batch that is a multiple of {W * k}"
        )
    batch_shapes.check(self.graph, self.per_example, W, k, leaves)
    return [
      _global(np.asarray(x), NamedSharding(self.mesh, P(DATA) if pe else P()))
      for x, pe in zip(leaves, self.per_example)
    ]

  def lower(self, ts: TrainState, batch: Any):
    """Lowers the step (for HLO inspection and `compile().memory_analysis()`)."""
    return self.step_fn().lower(ts, self.shard_batch(batch))
