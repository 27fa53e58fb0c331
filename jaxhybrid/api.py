"""The one-call API: trace -> cost -> place -> compile a hybrid DP x MP train step.

Example (NNX):

```python
import jaxhybrid, optax
hybrid = jaxhybrid.parallelize(model, loss_fn, optax.adam(1e-3), batch, mesh="4x2",
                               microbatches=2)
print(hybrid.plan.summary())
state = hybrid.init()
for batch in data:
  state, metrics = hybrid.step(state, batch)
```
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxhybrid import graph as graph_lib
from jaxhybrid import mesh as mesh_lib
from jaxhybrid import program as program_lib
from jaxhybrid.graph import batch_split as batch_lib
from jaxhybrid.graph import shard as shard_lib
from jaxhybrid.graph import offer as offer_lib
from jaxhybrid.program.plan_check import PlanCheck, reference_step
from jaxhybrid.program.plan_check import check_plan as _check_plan
from jaxhybrid.program import fit as fit_lib
from jaxhybrid.program import structure

log = logging.getLogger(__name__)

PLANNERS = ("milp", "etf", "dp", "interleaved", "single")


def _leading(x: Any) -> int | None:
  shape = np.shape(x) if not hasattr(x, "shape") else x.shape
  return shape[0] if len(shape) else None


# Batch leaves with these names are shared by the whole batch (not split into micro-batches),
# whatever their shape: e.g. BigLSTM's sampled-softmax negatives `sampled_ids`.
SHARED_BATCH_KEYS = ("sampled_ids",)


def per_example_leaves(batch: Any, global_batch: int, shared_keys: Sequence[str] = SHARED_BATCH_KEYS) -> list[bool]:
  """Per leaf: True if it has a leading batch dimension to split over workers/micro-batches.

  A leaf is per-example when its leading dimension equals the global batch size and its key is
  not in `shared_keys`.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(batch)
  return [_leading(x) == global_batch and _leaf_name(path) not in shared_keys for path, x in flat]


def _leaf_name(path: Any) -> str:
  """The last key of a leaf's path (a dict key or attribute name; '' otherwise)."""
  return str(getattr(path[-1], "key", getattr(path[-1], "name", ""))) if path else ""


def microbatch_spec(
  batch: Any, global_batch: int, micro: int, per_example: Sequence[bool] | None = None
) -> tuple[Any, list[bool]]:
  """Abstract batch at the micro-batch size and, per leaf, whether it is per-example.

  Per-example leaves (see `per_example_leaves`) are cut to `micro` examples; the others (e.g.
  BigLSTM's shared `sampled_ids`) are passed whole to every micro-batch.
  """
  leaves, treedef = jax.tree.flatten(batch)
  per_example = list(per_example) if per_example is not None else per_example_leaves(batch, global_batch)
  out = [
    jax.ShapeDtypeStruct((micro,) + tuple(x.shape[1:]), x.dtype) if pe
    else jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    for x, pe in zip(leaves, per_example)
  ]
  return jax.tree.unflatten(treedef, out), per_example


def default_costs(hardware: str | None = None, link: Any = None):
  """Analytic costs for the named hardware, or for the current backend's device (`link`: a
  measured link instead of the profile's, e.g. `costs.calibrate.calibrate_link`'s)."""
  from jaxhybrid import costs as costs_lib
  from jaxhybrid.costs import hardware as hw_lib

  if hardware is None:
    kind = jax.devices()[0].device_kind.lower()
    hardware = "cpu"
    for name, key in (("dgx-h200", "h200"), ("dgx-h100", "h100"), ("dgx-a100", "a100"), ("dgx1-v100", "v100")):
      if key in kind:
        hardware = name
    log.info("costs: analytic for hardware %s (device kind %r)", hardware, kind)
  return costs_lib.AnalyticCostModel(hw_lib.get(hardware), link=link)


@dataclasses.dataclass
class Hybrid:
  """A placed, compiled hybrid training step and everything that produced it.

  Attributes:
    graph: the traced op graph.
    plan: the plan the program runs (`plan.assignment`: node -> model-axis device; see README).
    program: the compiled `HybridProgram`.
    mesh: the (data, model) mesh.
    check: the plan and the single-device program priced in lock step (None when a plan was
      given for one device or the model axis has one device).
  """

  graph: graph_lib.OpGraph
  plan: Any
  program: program_lib.HybridProgram
  mesh: Any
  init_leaves: Callable[[], list[Any]]
  reference_loss: Callable[[Any, Any, Any], jax.Array]  # f(params, state, batch) single device
  check: PlanCheck | None = None

  def init(self, seed: int | None = None) -> program_lib.TrainState:
    """The model's initial parameters packed onto the mesh, plus optimizer state.

    The parameters are the ones the model carries (NNX: the module's values; linen: the
    `params=` given to `parallelize`); choose the seed when building the model.

    Raises:
      ValueError: if a seed is given (it would be ignored).
    """
    if seed is not None:
      raise ValueError(
        f"init(seed={seed!r}): the hybrid starts from the model's own parameters; build the "
        "model with that seed instead (nnx.Rngs(seed), or linen model.init(jax.random.key(seed), "
        "...)) and call init()"
      )
    return self.program.init_state(self.init_leaves())

  def step(self, state: program_lib.TrainState, batch: Any):
    """One training step on a global batch -> (new state, metrics).

    The state passed in is DONATED: its buffers are reused for the new state and deleted, so
    keep only the returned state (`state, m = hybrid.step(state, batch)`); to keep a copy, take
    `jax.tree.map(jnp.copy, state)` first.

    Raises:
      ValueError: if the batch's shapes are not the ones the step was compiled for (one line
        naming the expected global batch and leaf shapes).
    """
    return self.program.step(state, batch)

  def memory(self, *, compile: bool = True):
    """Per-device memory: predicted and XLA's compiled analysis from abstract inputs, nothing
    allocated (`HybridProgram.memory`; `print(hybrid.memory().table())`)."""
    return self.program.memory(compile=compile)

  def params(self, state: program_lib.TrainState) -> Any:
    """The parameters as the model's pytree (gathered on the host)."""
    return jax.tree.unflatten(self.graph.param_treedef, self.program.unpack(state.params))

  def model_state(self, state: program_lib.TrainState) -> Any:
    """The model's non-parameter state (NNX: BatchNorm statistics, RNG counters) as the steps
    left it, as the model's pytree (`nnx.update(model, hybrid.model_state(state))`); a loss
    that writes no state leaves it at the model's initial values."""
    return jax.tree.unflatten(self.graph.state_treedef, self.program.unpack_model_state(state))


def broadcast_text(text: str) -> str:
  """Process 0's `text` on every process (one process: unchanged)."""
  if jax.process_count() == 1:
    return text
  from jax.experimental import multihost_utils

  data = np.frombuffer(text.encode(), np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
  buf = np.zeros((n,), np.uint8)
  buf[: min(n, len(data))] = data[:n]
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode()


def parallelize(
  model: Any,
  loss_fn: Callable[..., jax.Array],
  optimizer: optax.GradientTransformation,
  sample_batch: Any,
  *,
  mesh: str | Any = "1x1",
  microbatches: int = 1,
  params: Any = None,
  planner: str = "milp",
  costs: Any = None,
  hardware: str | None = None,
  planner_options: dict[str, Any] | None = None,
  plan: Any = None,
  depth: int | None = None,
  max_nodes: int | None = graph_lib.DEFAULT_MAX_NODES,
  remat: Sequence[str] = (),
  program_options: dict[str, Any] | None = None,
  shared_batch_keys: Sequence[str] = SHARED_BATCH_KEYS,
) -> Hybrid:
  """Traces, places and compiles a hybrid DP x MP train step for a Flax model.

  Args:
    model: an `nnx.Module` (concrete) or a linen `nn.Module`.
    loss_fn: NNX: `loss_fn(model, batch)`; linen: `loss_fn(params, batch)`; a scalar mean loss
      that weighs every example equally (the step averages micro-batch and worker losses with
      equal weights: a loss divided by a data-dependent count, e.g. a masked token mean, would
      become a mean of per-shard means).
    optimizer: an optax transformation.
    sample_batch: one GLOBAL batch (arrays or `jax.ShapeDtypeStruct`), leading dimension
      data x per-worker batch on per-example leaves.
    mesh: "DATAxMODEL" or a Mesh from `jaxhybrid.mesh.make`.
    microbatches: micro-batches per worker batch (pipelining across the model axis).
    params: linen only: the concrete parameter pytree.
    planner: 'milp' (DLPlacer) or a heuristic: 'etf', 'dp', 'interleaved', 'single'.
    costs: a cost model (default: analytic for `hardware` or the current device).
    hardware: hardware profile name for the default costs.
    planner_options: extra `PlannerOptions` fields (time_limit_s, gap, threads, seed, ...);
      `task_temp` also takes 'auto' (default), 'program' or 'none' (`fit.planner_task_temp`).
    plan: an existing Plan to apply instead of planning (must be for this graph).
    depth, max_nodes: graph coarsening (see `jaxhybrid.graph.trace`): by default the module
      tree is cut from the top towards `max_nodes` nodes (lists of layers become one node per
      layer); `depth=d` asks for a uniform cut at d module-path components instead.
    remat: node names to rematerialise.
    program_options: extra `HybridProgram.build` arguments (schedule, zero, canonical_convs,
      pack_max_bytes, branch_remat); e.g. `{"zero": 1}` shards the optimizer state over 'data'.
    shared_batch_keys: names (last key of the leaf's path) of batch leaves that every example
      shares, passed whole to every worker and micro-batch: a leaf is split as per-example when
      its leading dimension equals the global batch and its name is not here (e.g. a per-class
      weight table whose length happens to equal the batch size needs its name here).

  Returns:
    A `Hybrid` with `.graph`, `.plan`, `.program`, `.check`, `.init()`, `.step()`. The plan is
    priced as the program runs it (`jaxhybrid.program.lockstep.plan_step_s`) against the
    single-device program; if the planner's plan is slower, a warning gives both figures and
    the hybrid runs everything on one model-axis device (a given `plan` is kept, with the
    warning). `hybrid.check` records the figures.

  Raises:
    ValueError: on an unknown planner, a batch that does not divide, a plan for another graph,
      `params=` with an NNX model, or a linen model without `params=`.
  """
  from jaxhybrid import planner as planner_lib

  if planner not in PLANNERS:
    raise ValueError(f"planner={planner!r} is unknown: use one of {', '.join(PLANNERS)}")
  if microbatches < 1:
    raise ValueError(f"microbatches={microbatches}: use 1 or more")
  m = mesh_lib.make(mesh) if isinstance(mesh, str) else mesh
  data, model_ax = m.shape[mesh_lib.DATA], m.shape[mesh_lib.MODEL]
  flat, _ = jax.tree_util.tree_flatten_with_path(sample_batch)
  sizes = [_leading(x) for p, x in flat
           if _leading(x) is not None and _leaf_name(p) not in shared_batch_keys]
  if not sizes:
    raise ValueError("the sample batch has no leaf with a batch dimension")
  global_batch = max(set(sizes), key=sizes.count)
  if global_batch % (data * microbatches):
    raise ValueError(
      f"global batch {global_batch} is not divisible by data ({data}) x micro-batches "
      f"({microbatches}): use a batch that is a multiple of {data * microbatches}"
    )
  micro = global_batch // (data * microbatches)
  spec, per_example = microbatch_spec(
    sample_batch, global_batch, micro,
    per_example_leaves(sample_batch, global_batch, tuple(shared_batch_keys)))

  if graph_lib.is_nnx_module(model):
    if params is not None:
      raise ValueError(
        f"params= is for linen models; {type(model).__name__} is an nnx.Module, which carries "
        "its parameters: drop params="
      )
    _, p, s, pure = graph_lib.nnx_pure_loss(model, loss_fn, with_state=True)

    def trace_at(spec_):
      return graph_lib.trace_function(pure, p, s, spec_, depth=depth, max_nodes=max_nodes)

    def small_trace():  # the loss at 1/M of the micro-batch, for splits by rows
      return batch_lib.trace_small(pure, p, s, spec, per_example, model_ax)

    g = trace_at(spec)
    if g.state_uncarried:
      _warn_state_writes(g.state_uncarried)
    _, _, _, pure_plain = graph_lib.nnx_pure_loss(model, loss_fn, scopes=False)
    # An abstract model (nnx.eval_shape) plans and compiles without allocating its parameters
    # (e.g. `program.memory()` at paper size); its small read-only state is zeros.
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(p))
    state_leaves = [np.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
                    for x in jax.tree.leaves(s)]

    def init_leaves() -> list[Any]:
      if abstract:
        raise ValueError(
          "the model is abstract (nnx.eval_shape): build it concretely to train, or use "
          "hybrid.program.memory() to check the fit without parameters"
        )
      return jax.tree.leaves(p)  # the NNX model carries its own initial values

    reference = pure_plain
  elif graph_lib.is_linen_module(model):
    if params is None:
      raise ValueError("a linen model needs params=... (concrete, from model.init)")

    def trace_at(spec_):
      return graph_lib.trace(model, loss_fn, spec_, params=params, depth=depth, max_nodes=max_nodes)

    def small_trace():
      return batch_lib.trace_small(lambda p_, s_, b_: loss_fn(p_, b_), params, {}, spec,
                                   per_example, model_ax)

    g = trace_at(spec)
    state_leaves = []

    def init_leaves() -> list[Any]:
      return jax.tree.leaves(params)

    def reference(p_, s_, b_):
      del s_
      return loss_fn(p_, b_)
  else:
    raise ValueError(f"cannot parallelize {type(model).__name__}: pass an nnx.Module or a linen Module")

  # Shard options: large leaves split into one piece per model device, each piece a node the
  # planner places (`jaxhybrid.graph.shard`); a given plan brings the split it was made for.
  g_traced = g
  skipped: tuple[tuple[str, str], ...] = ()

  def apply_splits(g_: graph_lib.OpGraph, plan_: Any) -> graph_lib.OpGraph:
    if getattr(plan_, "batch_splits", ()):
      g_ = batch_lib.apply(g_, small_trace(), model_ax, plan_.batch_splits)
    return shard_lib.apply(g_, model_ax, getattr(plan_, "shards", ()))

  if plan is not None:
    g = apply_splits(g, plan)
  elif model_ax > 1:
    popts = planner_lib.PlannerOptions(devices=model_ax).replace(**{
      k: v for k, v in (planner_options or {}).items()
      if k in ("shard_rules", "shard_min_fraction", "batch_split_min_fraction",
               "batch_split_params")})
    g, skipped = offer_lib.offer_splits(
      g, model_ax, micro, small_trace, shard_rules=popts.shard_rules,
      shard_min_fraction=popts.shard_min_fraction, batch_split_params=popts.batch_split_params,
      batch_split_min_fraction=popts.batch_split_min_fraction)
  c = costs if costs is not None else default_costs(hardware)
  state_factor = optimizer_state_factor(optimizer, g_traced)
  prog_opts = dict(program_options or {})
  _check_program_options(prog_opts)
  planner_options = fit_lib.planner_task_temp(planner_options, g, c, state_factor, prog_opts,
                                              remat, m)
  def planned(opts: dict[str, Any]) -> tuple[graph_lib.OpGraph, Any, PlanCheck | None]:
    g_ = g
    if g_.shards or g_.batch_splits:
      plan_, sharded = planner_lib.place_shard_or_whole(g_, g_traced, c, model_ax, **opts)
      g_ = g_ if sharded else g_traced
    else:
      plan_ = planner_lib.place(g_, c, devices=model_ax, **opts)
    plan_, check_ = _check_plan(g_, plan_, c, model_ax, microbatches, prog_opts, fall_back=True)
    plan_ = dataclasses.replace(plan_, shards=tuple(x.to_json() for x in g_.shards),
                                batch_splits=tuple(x.to_json() for x in g_.batch_splits),
                                shard_skipped=skipped)
    if jax.process_count() > 1:
      # Every process must run the same program: time-limited searches (and ties) can differ
      # between processes, and different plans would deadlock in the first collective.
      plan_ = planner_lib.Plan.from_json(broadcast_text(plan_.to_json()))
      g_ = apply_splits(g_traced, plan_)
    return g_, plan_, check_

  def build(g_: graph_lib.OpGraph, plan_: Any) -> tuple[Any, Any]:
    kw = dict(prog_opts)
    if plan_.task_schedule and "schedule" not in kw:
      kw["schedule"] = plan_.task_schedule  # the schedule a saved plan was run with
    elif (isinstance(plan_.task_schedule, planner_lib.TaskSchedule)
          and kw.get("schedule") == plan_.task_schedule.kind):
      kw["schedule"] = plan_.task_schedule  # the planned schedule of the asked kind
    order = structure.plan_order(plan_.schedule)
    try:
      prog_ = program_lib.HybridProgram.build(
        g_, m, optimizer, plan_.assignment, microbatches=microbatches, order=order or None,
        state=state_leaves, per_example=per_example, remat=remat, **kw,
      )
    except ValueError as e:
      raise ValueError(f"{e}") from None
    # The plan records the task schedule the program runs (plan.json carries it; schema 2), and
    # its lock-step price and memory are those of that schedule.
    if plan_.lockstep_step_s and prog_.schedule != plan_.task_schedule:
      popts = planner_lib.PlannerOptions(devices=model_ax, microbatches=microbatches,
        optimizer_state_factor=state_factor, **structure.planner_options(prog_opts.get("zero", 0))
      ).replace(**{k: v for k, v in (planner_options or {}).items() if k not in ("devices",)})
      plan_ = planner_lib.reprice(plan_, planner_lib.Problem.from_graph(g_, c, popts), prog_.schedule)
    return dataclasses.replace(plan_, task_schedule=prog_.schedule), prog_

  check = None
  if plan is None:
    # The planner's memory counts optimizer state per parameter byte (this optimizer's) and
    # lays parameters and gradients out as the program does.
    opts = {"optimizer_state_factor": state_factor, "microbatches": microbatches,
            "method": planner, **structure.planner_options(prog_opts.get("zero", 0)),
            **(planner_options or {})}
    if isinstance(prog_opts.get("schedule"), str):
      # The planner picks the schedule of the kind the program is asked to run (plus order).
      opts.setdefault("schedule_kinds", (prog_opts["schedule"],))
    limit = float(opts.get("time_limit_s")
                  or planner_lib.PlannerOptions(devices=max(model_ax, 1)).time_limit_s)
    deadline = (limit, time.monotonic() + limit)
    try:
      g, plan, check = planned(opts)
    except planner_lib.InfeasibleError as e:
      memory = int(getattr(getattr(c, "hardware", None), "memory_bytes", 0) or 0)
      g, plan, check, prog = fit_lib.uncapped_if_it_fits(e, opts, planned, build, memory, model_ax)
    else:
      plan, prog = build(g, plan)
    if model_ax > 1:
      # The cap holds for what the program allocates (row padding, group buffers), which the
      # planner's per-device count leaves out: re-plan under lower caps while it is above.
      def replan(caps: tuple[float, ...], time_limit_s: float) -> tuple[Any, Any]:
        nonlocal check
        g_, plan_, check = planned(
          {**opts, "memory_caps_bytes": caps, "time_limit_s": time_limit_s})
        return build(g_, plan_)

      # The re-plans share what is left of the planner's time limit (fit.refit).
      plan, prog, refits = fit_lib.refit(plan, prog, replan, compiled=fit_lib.compiled_bytes,
                                         deadline=deadline)
      g = prog.graph
      if check is not None and refits:
        check = dataclasses.replace(check, memory_refits=tuple(refits))
  elif getattr(plan, "graph_fingerprint", g.fingerprint()) != g.fingerprint():
    raise ValueError(
      f"the plan was made for graph {plan.graph_fingerprint}, this model traces to "
      f"{g.fingerprint()}: re-plan (or check model size, batch and micro-batches)"
    )
  else:
    plan, check = _check_plan(g, plan, c, model_ax, microbatches, prog_opts, fall_back=False)
    plan, prog = build(g, plan)
  if model_ax > 1:
    g_whole = g if microbatches == 1 else trace_at(
      microbatch_spec(sample_batch, global_batch, global_batch // data, per_example)[0])
    plan = dataclasses.replace(plan, **reference_step(g_whole, c))
  return Hybrid(
    graph=g, plan=plan, program=prog, mesh=m, init_leaves=init_leaves,
    reference_loss=reference, check=check,
  )


def optimizer_state_factor(optimizer: Any, graph: graph_lib.OpGraph) -> float:
  """Bytes of `optimizer`'s state per parameter byte, for the graph's parameters (from
  `jax.eval_shape` of its init: Adam 2, AdaGrad 1, SGD 0; nothing is allocated)."""
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
           for v, (kind, _) in zip(graph.jaxpr.invars, graph.input_kinds)
           if kind == graph_lib.PARAM]

  def nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

  params = nbytes(avals)
  return nbytes(jax.eval_shape(optimizer.init, avals)) / params if params else 0.0


def _check_program_options(options: dict[str, Any]) -> None:
  """One-line errors for a misspelled program option or an unknown schedule name."""
  import inspect

  params = inspect.signature(program_lib.HybridProgram.build).parameters
  known = sorted(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(f"program_options {unknown} are not HybridProgram.build options: use some "
                     f"of {', '.join(known)}")
  from jaxhybrid.planner.core.task_schedule import KINDS as kinds

  sched = options.get("schedule")
  if isinstance(sched, str) and sched not in kinds:
    raise ValueError(f"schedule={sched!r} is not a task schedule: use one of {', '.join(kinds)} "
                     "(or pass a planner.TaskSchedule)")


def _warn_state_writes(paths: Sequence[str]) -> None:
  """One warning when the traced loss writes non-parameter model state the hybrid step cannot
  carry to the next step (`OpGraph.state_uncarried`: e.g. a PRNG key)."""
  shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
  msg = (
    f"the loss writes model state the hybrid step does not carry to the next step ({shown}): "
    "such writes are lost after every step; feed per-step randomness through the batch (a "
    "per-example array of noise) instead"
  )
  warnings.warn(msg, stacklevel=4)
  log.warning("%s", msg)
