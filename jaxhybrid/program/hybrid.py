"""The hybrid program: a Plan runs as ONE jitted DP x MP train step on a (data, model) mesh.

Inside one `jax.shard_map` over ('data', 'model'), the step runs a *task schedule*
(`jaxhybrid.planner.core.task_schedule`: per model-axis device an ordered list of forward (F),
backward (B) and, for zero-bubble schedules, weight-gradient (W) tasks) in lock step
(`jaxhybrid.program.tasks`): per group of tasks one `lax.switch(axis_index('model'), ...)` runs
each device's own tasks (MPMD inside SPMD), then `ppermute`s carry activations forward and
cotangents backward. F calls `jax.vjp` of its node and keeps only the new arrays of the pullback
(packed into one union-sized buffer per dtype per group); the matching B on the same device
rebuilds the pullback and applies it (`jaxhybrid.program.executor`). No `jax.grad` wraps a
conditional, so no device writes another's residuals, and the schedule (GPipe, 1F1B, ZB-H1 or a
solver's) decides how many micro-batches' residuals are alive at once.

Parameters are owned: every leaf read by nodes of a single device lives only in that device's row
of a flat `[model, max_size]` buffer (one per dtype) sharded over 'model'; a task slices its node's
leaves from its own row at static offsets and adds their gradients into its own gradient row. A
leaf read on several devices is *shared*: replicated, its gradient summed over 'model'. Gradients
are averaged over 'data' and the optax update runs in the same program; optimizer state follows
its parameters. Elementwise optimizers (SGD, Adam, AdaGrad, ...) act on exactly the right values;
for global-norm clipping use `jaxhybrid.train.optim.clip_by_global_norm`, which reduces over
'model'.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid import graph as graph_lib
from jaxhybrid.graph import shard as shard_lib
from jaxhybrid import noise_scale as noise_lib
from jaxhybrid.mesh import DATA, MODEL
from jaxhybrid.planner.core import task_schedule as sched_lib
from jaxhybrid.program import batch_shapes, executor, gradients, node_calls, param_rows
from jaxhybrid.program.host_arrays import to_global as _global, to_host as _host
from jaxhybrid.program import model_state as model_state_lib
from jaxhybrid.program import tasks as tasks_lib
from jaxhybrid.program import zero as zero_lib
from jaxhybrid.program.structure import (
  DEFAULT_PACK_MAX_BYTES,
  ParamLayout,
  TrainState,
  param_layout,
)

log = logging.getLogger(__name__)

# shard_map's varying-axes type check stays off: the program replays equations traced OUTSIDE
# shard_map, and their nested jaxprs (scan bodies, custom_jvp rules) carry no varying-axes types,
# so the check rejects e.g. a scan body's matmul of a carried state by a varying weight. With the
# check off, `jax.vjp` inside a task inserts no implicit collectives: every gradient is the
# device's own, and the step averages and sums them explicitly (pmean over 'data', psum of shared leaves over
# 'model'), which the equivalence tests verify against the single-device reference.
CHECK_VMA = False


def _sq(tree: Any, psum_axis: str | None = None) -> jax.Array:
  """Sum of squares of a gradient pytree (psum'd over `psum_axis` for per-device shares)."""
  total = gradients.sum_of_squares(tree)
  return lax.psum(total, psum_axis) if psum_axis else total


# ZeRO stages the program runs (see HybridProgram.zero).
ZERO_STAGES = (0, 1, 2)


# ---- the program ------------------------------------------------------------------------------

@dataclasses.dataclass
class HybridProgram:
  """One compiled DP x MP train step for a placed graph and a task schedule.

  Build with `HybridProgram.build(...)`; then `state = prog.init_state(param_leaves)` and
  `state, metrics = prog.step(state, batch)` (the batch is the global batch, a pytree like the
  traced one with the leading dimension data x per-worker batch). `step` DONATES `state`: use
  the returned state, not the one passed in.
  """

  graph: graph_lib.OpGraph
  mesh: jax.sharding.Mesh
  optimizer: optax.GradientTransformation
  assignment: tuple[int, ...]
  microbatches: int
  layout: ParamLayout
  schedule: sched_lib.TaskSchedule
  structure: tasks_lib.Structure
  calls: executor.NodeCalls
  per_example: tuple[bool, ...]
  state_leaves: tuple[Any, ...]
  remat: frozenset[int]
  # Replay convolutions in the canonical layout (see jaxhybrid/graph/convs.py); on for CPU meshes.
  canonical_convs: bool = False
  # Kept for compatibility of the build options; v2 programs pack each (shift, dtype) of a group
  # into one message whatever the tensor sizes.
  pack_max_bytes: int = 0
  # What F saves for B: 'none' (every residual), 'dots' (matmul/conv outputs; the rest is
  # recomputed in B), 'full' (nothing: B replays the node's forward).
  branch_remat: str = "none"
  # ZeRO stage over 'data' (Rajbhandari et al. 2020): 0 keeps a full copy of every model row's
  # optimizer state on each data replica and all-reduces the gradients; 1 shards the owned rows'
  # optimizer state over 'data' (rows padded to a multiple of the data width), reduce-scatters
  # the gradient rows in place of the all-reduce, updates each replica's slice and all-gathers
  # the updated parameters: the same bytes on the wire (a ring all-reduce is a reduce-scatter
  # plus an all-gather), 1/W of the optimizer state. 2 also keeps only a 1/W share of the
  # gradient rows: each group's gradient windows are reduce-scattered over 'data' as they are
  # made (k reduce-scatters per step, not one), so the whole gradient row never exists; every
  # leaf is padded to a multiple of W. Under stage 2 the step reports no per-worker gradient
  # norm (no replica holds its whole gradient), so no noise-scale metrics. Shared (replicated)
  # leaves keep the all-reduce and a full optimizer state. See jaxhybrid.program.zero.
  zero: int = 0
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
    schedule: str | sched_lib.TaskSchedule = sched_lib.DEFAULT_KIND,
    forward_s: Sequence[float] | None = None,
    state: Any = None,
    per_example: Sequence[bool] | None = None,
    remat: Sequence[str] = (),
    canonical_convs: bool | None = None,
    pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES,
    branch_remat: str = "none",
    zero: int = 0,
    sparse_lookups: bool = True,
  ) -> HybridProgram:
    """Builds the program.

    Args:
      graph: the op graph, traced at the MICRO-batch size.
      mesh: a ('data', 'model') mesh (jaxhybrid.mesh.make).
      optimizer: an optax transformation (elementwise ones act exactly; see module docstring).
      assignment: node id -> model-axis device index.
      microbatches: micro-batches per worker batch.
      order: (node, microbatch) forward priority, e.g. a plan's start order.
      schedule: 'gpipe', '1f1b' (default) or 'zb' to generate the task schedule from the
        placement (`task_schedule.generate`), or a `TaskSchedule` to run as given.
      forward_s: estimated forward time per node, to order generated schedules (default: FLOPs).
      state: concrete read-only model state leaves (e.g. BatchNorm statistics), if any.
      per_example: per batch leaf, whether it has a leading batch dimension (default: leaves
        whose leading dimension equals the traced micro-batch size).
      remat: node names whose forward saves nothing (the backward replays it).
      canonical_convs: replay convolutions in the canonical NHWC/HWIO layout, backward included
        (`jaxhybrid.graph.convs`). XLA:CPU leaves convolutions inside conditional branches in the
        layout autodiff wrote, which runs their gradients ~6x slower; None = on when the mesh's
        devices are CPUs.
      pack_max_bytes: accepted for compatibility; messages are packed per (shift, dtype).
      branch_remat: 'none', 'dots' (F saves matmul/conv outputs only) or 'full' (every node
        rematerialised).
      zero: 0 (optimizer state replicated over 'data'), 1 (sharded over 'data') or 2 (the
        gradient rows too; see the `zero` attribute). On a mesh with one data replica every
        stage runs as 0.
      sparse_lookups: a parameter table a node reads only by row lookups (an embedding, a
        sampled softmax's weights) gets its gradient as the rows read, added into the gradient
        row by a scatter, not as a table-sized window (`jaxhybrid.program.lookups`).

    Raises:
      ValueError: if the assignment or the schedule does not fit the graph or the mesh.
    """
    M = mesh.shape[MODEL]
    if zero not in ZERO_STAGES:
      raise ValueError(f"zero={zero!r}: use one of {', '.join(map(str, ZERO_STAGES))} (0: optimizer "
                       "state replicated over 'data'; 1: sharded over 'data'; 2: gradients too)")
    if mesh.shape[DATA] == 1:
      # One data replica: nothing to shard. The sliced tail would only copy whole rows (paper
      # BigLSTM 1x8 under stage 1: 12.8 GiB of compiled temporaries against 5.5 at stage 0).
      zero = 0
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
    names = {n.name: n.id for n in graph.nodes}
    unknown = [r for r in remat if r not in names]
    if unknown:
      raise ValueError(f"remat names unknown nodes {unknown}; known: {sorted(names)[:10]}...")
    assignment = tuple(int(a) for a in assignment)
    canonical = node_calls.canonical_convs_for(mesh, canonical_convs)
    schedule, structure, calls = executor.structure_for(
      graph, assignment, M, microbatches, schedule, order=order, forward_s=forward_s,
      branch_remat=branch_remat, remat=frozenset(names[r] for r in remat),
      canonical_convs=canonical, sparse_lookups=sparse_lookups,
    )
    remat_ids = calls.remat
    return cls(
      graph=graph, mesh=mesh, optimizer=optimizer, assignment=assignment,
      microbatches=microbatches,
      layout=param_layout(graph, assignment, M, row_multiple=mesh.shape[DATA] if zero else 1,
                          leaf_multiple=mesh.shape[DATA] if zero == 2 else 1),
      schedule=schedule, structure=structure, calls=calls,
      per_example=tuple(per_example), state_leaves=state_leaves, remat=remat_ids,
      canonical_convs=canonical, pack_max_bytes=int(pack_max_bytes), branch_remat=branch_remat,
      zero=int(zero),
    )

  @property
  def zero_cuts(self) -> dict[str, tuple[int, ...]]:
    """Per row key, the segments whose 1/W pieces are a data replica's share (zero.py)."""
    if "_zero_cuts" not in self.__dict__:
      W = self.mesh.shape[DATA]
      if self.zero == 2:
        windows = gradients.gradient_windows(self.structure, self.graph, self.layout,
                                             lookups=self.calls.lookups)
        self.__dict__["_zero_cuts"] = zero_lib.row_cuts(self.layout, windows, W)
      else:
        self.__dict__["_zero_cuts"] = zero_lib.whole_rows(self.layout.sizes)
    return self.__dict__["_zero_cuts"]

  # ---- parameter packing ----------------------------------------------------------------------
  def pack(self, leaves: Sequence[Any]) -> dict[str, Any]:
    """The user's flat parameter leaves -> {'owned': {dtype: [M, size]}, 'shared': [...]}.

    A leaf the graph splits (`jaxhybrid.graph.shard`) is cut into its pieces here. Built on the
    host with numpy (`param_rows.pack`); use for models that fit in host memory.
    """
    leaves = shard_lib.split_leaves(self.graph, list(leaves))
    rows = param_rows.pack(self.layout, leaves)
    return {
      "owned": {dt: _global(r, NamedSharding(self.mesh, P(MODEL, None))) for dt, r in rows.items()},
      "shared": [_global(np.asarray(leaves[i]), NamedSharding(self.mesh, P())) for i in self.layout.shared],
    }

  def unpack(self, params: dict[str, Any]) -> list[np.ndarray]:
    """The inverse of `pack`: the user's flat parameter leaves (on the host)."""
    rows = {dt: _host(r) for dt, r in params["owned"].items()}
    return shard_lib.join_leaves(
      self.graph, param_rows.unpack(self.layout, rows, [_host(x) for x in params["shared"]]))

  def _param_specs(self) -> dict[str, Any]:
    return {
      "owned": {dt: P(MODEL, None) for dt, _ in self.layout.sizes},
      "shared": [P() for _ in self.layout.shared],
    }

  def _opt_specs(self, opt_state: Any) -> Any:
    """Shardings of the optimizer state: each leaf like its parameter (owned rows over 'model',
    and over 'data' too under ZeRO), everything else (step counts) replicated."""
    specs = self._param_specs()
    if self.zero:
      specs = {"owned": {r: P(MODEL, DATA) for r in specs["owned"]}, "shared": specs["shared"]}
    try:
      return optax.tree_map_params(
        self.optimizer, lambda _, s: s, opt_state, specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P),
      )
    except Exception as e:
      if self.zero:  # a shape rule could shard a leaf that is not a parameter's slice
        raise ValueError(
          f"zero={self.zero}: cannot match this optimizer's state to the parameters "
          f"(optax.tree_map_params: {type(e).__name__}: {e}); use zero=0 with this optimizer"
        ) from None
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
    return TrainState(params=params, opt_state=opt_state, step=step,
                      model_state=self.init_model_state())

  def init_model_state(self) -> tuple[Any, ...]:
    """The model state a `TrainState` carries: every state leaf, replicated, when the loss
    writes some (`graph.state_writes`); () when it writes none (the step then reads the state
    leaves given to `build` as constants)."""
    if not self.graph.state_writes:
      return ()
    rep = NamedSharding(self.mesh, P())
    return tuple(model_state_lib.replicated(x, rep) for x in self.state_leaves)

  def unpack_model_state(self, ts: TrainState) -> list[np.ndarray]:
    """The model's state leaves as the step left them (on the host), in `graph.state_paths`
    order: the initial ones when the loss writes none."""
    return [x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else _host(x)
            for x in (ts.model_state or self.state_leaves)]

  # ---- the step -------------------------------------------------------------------------------
  def _local_loss_and_grads(
    self, owned: dict[str, jax.Array], shared: list[jax.Array], state: Sequence[Any],
    batch: Sequence[Any],
  ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array], list[jax.Array], list[Any]]:
    """Runs the task schedule on one device: (loss share, own flat gradients, own rows given
    whole by one window, shared grads, state writes' shares); see `executor.run_groups`."""
    k = self.microbatches
    mbatches = []
    for j, x in enumerate(batch):
      if self.per_example[j]:
        x = x.reshape((k, x.shape[0] // k) + x.shape[1:])
        mbatches.append([x[m] for m in range(k)])
      else:
        mbatches.append([x] * k)
    consts = dict(zip(self.graph.jaxpr.constvars, self.graph.closed_jaxpr.consts))
    inputs = executor.Inputs(rows=owned, shared=list(shared), state=state, microbatches=mbatches)
    return executor.run_groups(
      self.structure, self.calls, self.layout, inputs, consts,
      zero_cuts=self.zero_cuts if self.zero == 2 else None, data=self.mesh.shape[DATA],
      single_windows=not self.zero, scatter_ring=zero_lib.ring_scatter(self.mesh))

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
      loss, g_flat, g_whole, g_shared, writes = self._local_loss_and_grads(
        owned, list(params["shared"]), list(state), list(batch)
      )
      writes = model_state_lib.combine_writes(writes, W)
      g_owned = {"flat": g_flat, "whole": g_whole}
      g_shared = [lax.psum(x, MODEL) for x in g_shared]  # each device holds its uses' share
      # |g_worker|^2 at the per-worker batch, averaged over workers (noise-scale input); under
      # stage 2 no replica holds its worker's whole gradient: not reported.
      sq_worker = (jnp.full((), jnp.nan, jnp.float32) if self.zero == 2
                   else lax.pmean(_sq(g_owned, MODEL) + _sq(g_shared), DATA))
      if W > 1:  # (on one worker the all-reduce would only copy the gradient rows)
        if not self.zero:
          g_owned = jax.tree.map(lambda x: lax.pmean(x, DATA), g_owned)
        g_shared = [lax.pmean(x, DATA) for x in g_shared]
      loss = lax.pmean(lax.psum(loss, MODEL), DATA)
      if self.zero:
        return zero_lib.tail(
          self, params, opt_state, g_owned["flat"], g_shared, loss, sq_worker, W) + (writes,)
      sq_global = _sq(g_owned, MODEL) + _sq(g_shared)  # |g|^2 at the global batch
      # g_owned: one flat buffer per dtype (padding zeros add nothing above); the rows are cut
      # from it only now, for the optimizer alone. The barrier keeps XLA from fusing the last
      # window's addition into the optimizer's and the sums' passes: fused, the CPU backend
      # made that addition again in two row-sized buffers (Adam: a row-sized square and a copy).
      # Rows given whole by one window take no barrier: each is updated as soon as it exists.
      g_rows = gradients.cut_rows(
        self.layout, lax.optimization_barrier(g_owned["flat"]), g_owned["whole"])
      grads = {"owned": jax.tree.map(lambda x: x[None], g_rows), "shared": g_shared}
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return params, opt_state, loss, (sq_worker, sq_global), writes

    return body, batch_specs, state_specs, W

  def step_fn(self) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted step `(state, batch) -> (state, metrics)`; the state is donated."""
    if self._step is not None:
      return self._step
    body, batch_specs, state_specs, W = self._build_step()
    param_specs = self._param_specs()
    write_specs = tuple(P() for _ in self.graph.state_writes)
    mesh = self.mesh
    b = self.per_worker_batch

    def step(ts: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
      leaves = jax.tree.leaves(batch)
      opt_specs = self._opt_specs(ts.opt_state)
      f = jax.shard_map(
        body, mesh=mesh, check_vma=CHECK_VMA,
        in_specs=(param_specs, opt_specs, state_specs, batch_specs),
        out_specs=(param_specs, opt_specs, P(), (P(), P()), write_specs),
      )
      state_in = tuple(ts.model_state) if self.graph.state_writes else tuple(self.state_leaves)
      params, opt_state, loss, (sq_worker, sq_global), writes = f(
        ts.params, ts.opt_state, state_in, tuple(leaves)
      )
      model_state = ts.model_state
      if self.graph.state_writes:
        new = list(ts.model_state)
        for j, x in zip(self.graph.state_writes, writes):
          new[j] = x
        model_state = tuple(new)
      metrics = {"loss": loss, "grad_sq_norm": sq_global}
      if self.zero != 2:
        metrics["worker_grad_sq_norm"] = sq_worker
      if W > 1 and self.zero != 2:  # McCandlish et al. 2018 (appendix A) from the per-worker and global gradients
        g2, tr = noise_lib.noise_scale_estimates(sq_worker, sq_global, b, W * b)
        metrics.update(noise_g2=g2, noise_trace_sigma=tr)
      return TrainState(params, opt_state, ts.step + 1, model_state), metrics

    self._step = jax.jit(step, donate_argnums=0)
    return self._step

  def step(self, ts: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """One training step on a global batch; see `step_fn`.

    Raises:
      ValueError: the state was donated to an earlier step (its buffers are deleted; passing
        them to XLA aborts the process instead of raising), or the batch is not the one the
        step was compiled for.
    """
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(ts)):
      raise ValueError(
        "this state was donated to an earlier step and its arrays are deleted: pass the state "
        "the last step returned (state, metrics = step(state, batch)), or copy it first with "
        "jax.tree.map(jnp.copy, state)"
      )
    return self.step_fn()(ts, self.shard_batch(batch))

  def shard_batch(self, batch: Any) -> list[jax.Array]:
    """Puts a global batch on the mesh: per-example leaves split over 'data'."""
    leaves = jax.tree.leaves(batch)
    if len(leaves) != len(self.per_example):
      names = ", ".join(p or "batch" for p in self.graph.batch_paths)
      raise ValueError(
        f"batch has {len(leaves)} leaves, the traced loss reads {len(self.per_example)} "
        f"({names}): pass a batch with the structure of the sample batch"
      )
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

  def memory(self, *, compile: bool = True):
    """Per-device memory of the step: our prediction and XLA's compiled analysis.

    Lowers from abstract inputs (`jax.ShapeDtypeStruct`s with shardings), so nothing is
    allocated: paper-size models can be checked for fit on any host. See
    `jaxhybrid.program.memory.MemoryReport` (and its `table()`).
    """
    from jaxhybrid.program import memory

    return memory.report(self, compile=compile)

  def lower(self, ts: TrainState, batch: Any):
    """Lowers the step (for HLO inspection and `compile().memory_analysis()`)."""
    return self.step_fn().lower(ts, self.shard_batch(batch))
