"""One training run end to end: model -> trace -> costs -> plan -> hybrid program -> train -> report.

The library behind `experiments/run.py` (which only parses flags). Order of calls:

  config = RunConfig(model="biglstm", mesh="16x2")
  setup_devices(config)          # BEFORE JAX starts: simulated CPU devices, multi-host init
  results = run(config)          # writes the workdir, returns results.json's content
  print(format_report(results))

Bad input raises `jaxhybrid.errors.UsageError` (one line naming the bad value and the fix); the
entry point turns it into exit status 2.

The workdir holds: config.json (the run's config; --resume checks it), plan.json, metrics.jsonl
(one JSON object per step), checkpoints/ (orbax), results.json (config, plan summary, metrics,
predicted and measured step time, projection), gantt.png, loss.png, projection.png.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
from typing import Any

import numpy as np

from jaxhybrid import errors
from jaxhybrid import mesh as mesh_lib
from jaxhybrid.train import calibration, predict, solve_progress
from jaxhybrid.train.memory_check import check_fits, memory_summary
from jaxhybrid.train.overrides import parse_overrides  # noqa: F401 - runner.parse_overrides (run.py, advise.py)
from jaxhybrid.train.run_data import make_batch_fn
from jaxhybrid.train.run_report import plot_loss
from jaxhybrid.train.validation import model_spec, validate  # noqa: F401 - runner.validate

log = logging.getLogger(__name__)

# The optimizer when neither --optimizer nor the paper (at --size=paper) names one.
DEFAULT_OPTIMIZER = "adam"
# ZeRO stage of the main job (see RunConfig.zero). Stage 1 divides the rows' optimizer state by
# the data width (paper BigLSTM 16x2: 0.77x the memory per device, paper GNMT 8x2: 0.91x;
# bench_memory.json) for the all-reduce's bytes on the wire, and its step measured no slower on
# 2 one-core processes with gloo collectives at 2x1 (bench_mp.json, zero1_step_ratio_2x1
# 0.92-1.01 over four models, the reduce-scatter a ppermute ring: zero.RING_SCATTER_PLATFORMS).
# Stage 2 divides the gradient rows too (0.44x, 0.87x) for one reduce-scatter per micro-batch
# (zero2_step_ratio_2x1 0.96-1.02 at one micro-batch; more bytes with more), so it is chosen when
# memory binds: --dry_run's advice names it. --resume keeps a run's stage (a workdir written at
# another stage is refused with the flag to pass).
DEFAULT_ZERO = 1
# Run-config fields whose default has changed, with the value a saved run that predates the
# field ran with.
FORMER_DEFAULTS = {"zero": 0}
# Config fields that change the training trajectory: --resume refuses a workdir that differs.
TRAJECTORY_FIELDS = ("model", "size", "mesh", "batch", "microbatches", "data", "seed", "overrides",
                     "optimizer", "learning_rate", "clip_norm", "schedule", "zero")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """Everything one run depends on (the flags of experiments/run.py)."""

  # Registry model name: biglstm | gnmt | inception_v3.
  model: str = "biglstm"
  # Size preset: tiny | small | paper; None = 'paper' on a GPU, 'tiny' on a CPU.
  size: str | None = None
  # "DATAxMODEL" mesh, e.g. "16x2"; one side may be -1 (filled from the real devices).
  mesh: str = "4x2"
  # Per-worker batch b (the global batch is data x b); None = the paper's per-GPU batch on a GPU,
  # 4 on a CPU.
  batch: int | None = None
  # Micro-batches per worker batch (pipelining across the model axis); must divide `batch`.
  microbatches: int = 2
  # Placement: milp (DLPlacer) | etf | dp | single.
  planner: str = "milp"
  # Planner wall-clock budget, seconds.
  time_limit_s: float = 30.0
  # Task schedule the program runs: gpipe | 1f1b | zb (planner.task_schedule), or 'auto': the
  # planner picks the cheapest in lock step among all of them and its own orders ('custom').
  schedule: str = "1f1b"
  # ZeRO stage over the data axis: 0 = every data replica keeps its model row's full optimizer
  # state; 1 = that state is sharded over the data replicas (gradients reduce-scattered, updated
  # parameters all-gathered: the all-reduce's bytes); 2 = the gradient rows too (reduce-scattered
  # per micro-batch). See HybridProgram.zero.
  zero: int = DEFAULT_ZERO
  # Offer shard options: large parameter leaves (embedding and softmax tables, big dense layers)
  # may be split into one piece per model device, each placed by the planner
  # (jaxhybrid.graph.shard); False keeps every leaf whole.
  shard: bool = True
  # Also offer the batch split: nodes of at least PlannerOptions.batch_split_min_fraction of the
  # forward FLOPs may run as one piece per model device on their rows of the micro-batch
  # (jaxhybrid.graph.batch_split). Off by default: not yet measured on the pinned benchmark.
  batch_split: bool = False
  # How a batch-split node's parameters are stored (PlannerOptions.batch_split_params):
  # 'replicated' or 'split' (one slice per model device, gathered per micro-batch).
  batch_split_params: str = "replicated"
  # The planner's memory cap per device, GiB; None = the hardware profile's device memory.
  memory_cap_gib: float | None = None
  # Plan, compile from abstract inputs and report per-device memory; allocate and train nothing.
  dry_run: bool = False
  # Hardware profile of the analytic cost model (jaxhybrid.costs.hardware names); None = detect.
  hardware: str | None = None
  # Training data: 'generated' (a learnable task, the default so a short run shows learning),
  # 'synthetic' (random labels: nothing to learn, for timing) or a path.
  data: str = "generated"
  # Total training steps.
  steps: int = 30
  # Output folder; None = runs/<model>-<size>-<mesh>-<timestamp>.
  workdir: str | None = None
  # Continue the run in `workdir` from its latest checkpoint.
  resume: bool = False
  # Seed of the parameters and of the data (batch of step s = f(seed, s)).
  seed: int = 0
  # Model config overrides (field, value), applied with dataclasses.replace.
  overrides: tuple[tuple[str, Any], ...] = ()
  # A plan file to apply instead of planning (must be for this model, size, batch, mesh).
  plan: str | None = None
  # Optimizer (optax name) and its learning rate. Optimizer None: the paper's for --size=paper
  # where PAPER.md names one (BigLSTM: AdaGrad 0.2), else DEFAULT_OPTIMIZER. Learning rate None:
  # that paper figure, else TINY_LEARNING_RATE for the tiny preset, DEFAULT_LEARNING_RATE otherwise.
  optimizer: str | None = None
  learning_rate: float | None = None
  # Clip gradients to this global L2 norm over all devices' parameters (jaxhybrid.train.optim); 0: off.
  clip_norm: float = 0.0
  # Checkpoint every this many steps (0: only at the end).
  checkpoint_every: int = 10
  # Draw a progress bar.
  progress: bool = True
  # Measure this machine's link, per-byte passes and lock-step group and task costs on two of
  # the run's model devices (cached per machine; jaxhybrid.train.calibration), and plan and
  # predict with them.
  calibrate: bool = False
  # Compute and plot the DP-vs-hybrid projection.
  projection: bool = True
  # Multi-host: coordinator "host:port", number of processes, this process's id (None: single).
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None


# ---- parsing helpers --------------------------------------------------------------------------

def _mesh_shape_early(spec: str) -> mesh_lib.MeshShape | None:
  """Parses the mesh without starting JAX; None when a side is -1 (needs the device count)."""
  try:
    m = mesh_lib._SPEC.match(spec or "")  # noqa: SLF001 - the same grammar as mesh.parse
    if m and "-1" in (m.group(1), m.group(2)):
      other = [int(g) for g in m.groups() if g != "-1"]
      mesh_lib.parse(spec, num_devices=other[0] if other else 1)  # validates the rest
      return None
    return mesh_lib.parse(spec, num_devices=1)
  except ValueError as e:
    raise errors.UsageError(f"--mesh: {e}") from None


def setup_devices(config: RunConfig) -> None:
  """Arranges devices before JAX starts: simulated CPU devices for the mesh, multi-host init.

  Simulated devices only affect the CPU platform, so this is harmless on a GPU machine. A mesh
  with -1 uses the real devices as they are.

  Raises:
    UsageError: a malformed mesh or inconsistent multi-host flags.
  """
  shape = _mesh_shape_early(config.mesh)
  procs = config.num_processes or 1
  multi = config.coordinator_address is not None or config.num_processes is not None
  if multi and (config.coordinator_address is None or config.num_processes is None
                or config.process_id is None):
    raise errors.UsageError(
      "multi-host needs all of --coordinator_address, --num_processes and --process_id")
  if multi and not 0 <= config.process_id < procs:
    raise errors.UsageError(
      f"--process_id={config.process_id} is outside [0, {procs}): use 0 .. --num_processes - 1")
  if shape is not None:
    if shape.size % procs:
      raise errors.UsageError(
        f"--mesh={shape} ({shape.size} devices) does not split over {procs} processes: "
        "use a mesh whose size is a multiple of --num_processes")
    if not mesh_lib.backend_started():
      mesh_lib.simulate_cpu_devices(shape.size // procs)
  if multi:
    mesh_lib.init_distributed(config.coordinator_address, config.num_processes, config.process_id)


# ---- validation ------------------------------------------------------------------------------

# Default Adam learning rates. Tiny presets: measured with the default 30 steps on the generated
# task (BigLSTM, mesh 16x2): loss 3.72 -> 3.66 at 1e-3, 2.14 at 3e-3, 2.57 at 1e-2 (Inception-V3
# tiny 2.55 -> 2.07 at 1e-2; GNMT tiny shows no trend in 30-60 steps at 1e-3..1e-2). Other
# presets: the usual Adam default.
TINY_LEARNING_RATE = 3e-3
DEFAULT_LEARNING_RATE = 1e-3


def _resolve(config: RunConfig) -> RunConfig:
  """Fills the device-dependent defaults (size, batch, learning rate, workdir)."""
  import jax

  on_gpu = jax.default_backend() == "gpu"
  size = config.size or ("paper" if on_gpu else "tiny")
  batch = config.batch
  if batch is None:
    from jaxhybrid.projection import paper_scenario

    paper = paper_scenario.PAPER_MODELS.get(config.model)
    batch = paper.per_gpu_batch if on_gpu and paper else 4
  workdir = config.workdir
  if workdir is None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = os.path.join("runs", f"{config.model}-{size}-{config.mesh}-{stamp}")
  from jaxhybrid.projection import paper_scenario

  paper = paper_scenario.PAPER_MODELS.get(config.model)
  paper_opt = paper.optimizer if paper is not None and size == "paper" else None
  optimizer, lr = config.optimizer, config.learning_rate
  if optimizer is None:
    optimizer = paper_opt[0] if paper_opt else DEFAULT_OPTIMIZER
    if lr is None and paper_opt:
      lr = paper_opt[1]
  if lr is None:
    lr = TINY_LEARNING_RATE if size == "tiny" else DEFAULT_LEARNING_RATE
  return dataclasses.replace(
    config, size=size, batch=batch, optimizer=optimizer, learning_rate=lr, workdir=workdir
  )


def _prepare_workdir(config: RunConfig) -> None:
  """Creates the workdir and checks it can hold this run.

  Raises:
    UsageError: an unwritable workdir, an existing run without --resume, or a --resume of a run
      with another config.
  """
  wd = config.workdir
  try:
    os.makedirs(wd, exist_ok=True)
    probe = os.path.join(wd, f".write_test_{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise errors.UsageError(
      f"--workdir={wd!r} is not writable ({e.strerror or e}): pass a folder you can write to") from None
  saved = os.path.join(wd, "config.json")
  has_run = os.path.exists(saved) or os.path.exists(os.path.join(wd, "metrics.jsonl"))
  if has_run and not config.resume:
    raise errors.UsageError(
      f"--workdir={wd!r} already holds a run: pass --resume to continue it or choose another --workdir")
  if has_run and os.path.exists(saved):
    try:
      with open(saved) as f:
        old = json.load(f)
    except (OSError, ValueError):
      raise errors.UsageError(f"{saved} is unreadable: repair it or choose another --workdir") from None
    new = _config_json(config)
    # A field newer than the saved run had its default there (the one it had then, where the
    # default has changed since: FORMER_DEFAULTS).
    defaults = {**_config_json(RunConfig(workdir=config.workdir)), **FORMER_DEFAULTS}
    was = {k: old.get(k, defaults.get(k)) for k in TRAJECTORY_FIELDS}
    now = {k: new.get(k) for k in TRAJECTORY_FIELDS}
    shape = _mesh_shape_early(str(now["mesh"]))
    if was["mesh"] == now["mesh"] and shape is not None and shape.data == 1:
      was["zero"] = now["zero"] = 0  # one data replica runs every stage as 0 (HybridProgram.build)
    diff = [k for k in TRAJECTORY_FIELDS if was[k] != now[k]]
    if diff:
      k = diff[0]
      raise errors.UsageError(
        f"--resume: the run in {wd!r} has {k}={was[k]!r} but this command gives {now[k]!r}: "
        "use the same flags or another --workdir")


def _config_json(config: RunConfig) -> dict[str, Any]:
  d = dataclasses.asdict(config)
  d["overrides"] = [[k, v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)]
                    for k, v in config.overrides]
  return json.loads(json.dumps(d))


# ---- the run ---------------------------------------------------------------------------------

def _optimizer(config: RunConfig):
  import optax

  from jaxhybrid.train import optim

  opt = getattr(optax, config.optimizer)(config.learning_rate)
  return optax.chain(optim.clip_by_global_norm(config.clip_norm), opt) if config.clip_norm else opt


def calibrated(config: RunConfig) -> dict[str, Any] | None:
  """The machine's calibration entry with `config.calibrate` (cached, else measured on the
  run's mesh), or None."""
  if not config.calibrate:
    return None
  try:
    mesh = mesh_lib.make(mesh_lib.parse(config.mesh))
    return calibration.load_or_measure(mesh, _optimizer(config), _config_json(config)["optimizer"])
  except ValueError as e:
    raise errors.UsageError(f"--calibrate: {e}") from None


def build(config: RunConfig, *, abstract: bool = False, uncapped: bool = False,
          calib: dict[str, Any] | None = None):
  """Model, data and the placed, compiled hybrid step for a resolved config (`abstract`: the
  model from `nnx.eval_shape`, no parameter allocated, for `--dry_run`; `uncapped`: plan without
  memory caps, so that a dry run can show what a model that fits nowhere would need; `calib`:
  the machine's calibration entry, else `calibrated(config)`'s).

  Returns:
    (spec, hybrid, batch_fn).

  Raises:
    UsageError: unknown size or override, a mesh that does not fit the devices, a batch that does
      not divide, an unreadable plan or one made for another graph.
  """
  from flax import nnx

  from jaxhybrid import api
  from jaxhybrid import planner as planner_lib

  spec = model_spec(config)
  try:
    mesh = mesh_lib.make(mesh_lib.parse(config.mesh))
  except ValueError as e:
    raise errors.UsageError(f"--mesh: {e}") from None
  data_ax = mesh.shape[mesh_lib.DATA]
  global_batch = data_ax * config.batch
  batch_fn = make_batch_fn(spec, config.data, config.seed, global_batch)

  plan = None
  plan_path = config.plan
  resumed_plan = os.path.join(config.workdir, "plan.json")
  if plan_path is None and config.resume and os.path.exists(resumed_plan):
    plan_path = resumed_plan  # the resumed run keeps its plan (the MILP is time-limited)
  if plan_path is not None:
    try:
      plan = planner_lib.Plan.load(plan_path)
    except (OSError, ValueError) as e:
      msg = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise errors.UsageError(f"--plan={plan_path!r} cannot be read ({msg}): pass a plan.json written by run.py or drop --plan to re-plan") from None
  if calib is None:
    calib = calibrated(config)
  fixed = calibration.planner_options(calib["values"]) if calib is not None else {}
  make = lambda: spec.make(nnx.Rngs(config.seed))  # noqa: E731
  model = nnx.eval_shape(make) if abstract else make()
  # The solve's progress line (elapsed, incumbent, bound, gap) while the planner runs.
  shown = config.progress and plan is None
  progress = solve_progress.SolveProgress() if shown else contextlib.nullcontext()
  try:
    with progress:
      hybrid = api.parallelize(
        model, spec.loss_fn, _optimizer(config), batch_fn(0), mesh=mesh,
        microbatches=config.microbatches, planner=config.planner, hardware=config.hardware,
        costs=(api.default_costs(config.hardware, link=calibration.link(calib["values"]))
               if calib is not None else None),
        planner_options={"time_limit_s": config.time_limit_s, "seed": config.seed, **fixed,
                         **({"progress": progress} if shown else {}),
                         **({"shard_rules": (("lookup", "column") if config.shard else ())
                             + (("batch",) if config.batch_split else ())}),
                         "batch_split_params": config.batch_split_params,
                         **({"memory_caps_bytes": int(config.memory_cap_gib * 2**30)}
                            if config.memory_cap_gib else {}),
                         **({"memory_caps_bytes": None} if uncapped else {})}, plan=plan,
        # 'auto': no schedule named, so the plan's own (or a saved plan's) runs.
        program_options={"zero": config.zero,
                         **({} if config.schedule == "auto" else {"schedule": config.schedule})},
      )
  except planner_lib.InfeasibleError as e:
    raise errors.DoesNotFitError(f"{e}") from None
  except ValueError as e:
    raise errors.UsageError(f"{e}") from None
  # api.parallelize gives every process process 0's plan.
  return spec, hybrid, batch_fn


def _replicate_step(state: Any, mesh: Any) -> Any:
  """Puts the step counter on the mesh, replicated, as the compiled step returns it.

  A fresh or restored state holds it on one device; without this the step would compile twice.
  """
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  sharding = NamedSharding(mesh, P())
  if isinstance(state.step, jax.Array) and state.step.sharding == sharding:
    return state  # already as the compiled step returns it (HybridProgram.init_state)
  if getattr(state.step, "is_fully_addressable", True):
    step = np.asarray(jax.device_get(state.step))
  else:  # replicated across processes: every process holds the value
    step = np.asarray(state.step.addressable_data(0))
  return state._replace(step=jax.make_array_from_callback((), sharding, lambda _: step))


def run(config: RunConfig) -> dict[str, Any]:
  """Runs (or resumes) one training run and writes its workdir; call `setup_devices` first.

  Returns:
    The content of results.json.

  Raises:
    UsageError: bad input (see `validate`, `build`), or NonFiniteLossError when the loss diverges.
  """
  import jax

  from jaxhybrid import planner as planner_lib
  from jaxhybrid import projection as projection_lib
  from jaxhybrid.train import checkpoint
  from jaxhybrid.train import loop as train

  validate(config)
  if config.dry_run:
    raise errors.UsageError("a dry run is jaxhybrid.train.dry_run.run(config), not runner.run")
  config = _resolve(config)
  validate(config)
  primary = jax.process_index() == 0
  _prepare_workdir(config)
  wd = config.workdir
  if config.resume and config.plan is None and os.path.exists(os.path.join(wd, "plan.json")):
    # The checkpoints' own plan: a new time-limited search may place differently (other rows).
    config = dataclasses.replace(config, plan=os.path.join(wd, "plan.json"))
  calib = calibrated(config)  # cached per machine, else measured now (before planning)
  spec, hybrid, batch_fn = build(config, calib=calib)
  check_fits(hybrid)  # before anything is allocated or written
  log.info("%s", hybrid.plan.summary())
  if primary:
    with open(os.path.join(wd, "config.json"), "w") as f:
      json.dump(_config_json(config), f, indent=1)
    hybrid.plan.save(os.path.join(wd, "plan.json"))
    planner_lib.gantt(hybrid.plan, os.path.join(wd, "gantt.png"))

  state = _replicate_step(hybrid.init(), hybrid.mesh)  # the model was built with the seed
  ckpt = checkpoint.Checkpointer(os.path.join(wd, "checkpoints"), every=config.checkpoint_every)
  metrics_path = os.path.join(wd, "metrics.jsonl")
  start = 0
  if config.resume and (last := ckpt.latest_step()) is not None:
    state = _replicate_step(ckpt.restore(last, like=state), hybrid.mesh)
    start = last
  if primary and os.path.exists(metrics_path):
    train.truncate_metrics(metrics_path, start)
  data_ax = hybrid.mesh.shape[mesh_lib.DATA]
  try:
    result = train.fit(
      hybrid.step, state, batch_fn, steps=config.steps, start_step=start, checkpointer=ckpt,
      metrics_path=metrics_path, progress=config.progress,
      noise_scale=train.NoiseScaleOptions(per_worker_batch=config.batch, workers=data_ax),
    )
  finally:
    ckpt.close()

  rows = train.read_metrics(metrics_path) if primary else list(result.rows)
  predicted = predict.predicted_step_s(hybrid, config.hardware,
                                       calib["values"] if calib is not None else None)
  results: dict[str, Any] = {
    "config": _config_json(config),
    "devices": {"count": jax.device_count(), "platform": jax.default_backend(),
                "kind": jax.devices()[0].device_kind, "processes": jax.process_count()},
    "graph": {"nodes": len(hybrid.graph.nodes), "fingerprint": hybrid.graph.fingerprint()},
    "plan": {"summary": hybrid.plan.summary(), "method": hybrid.plan.method,
             "status": hybrid.plan.status, "assignment": list(hybrid.plan.assignment),
             "predicted_speedup": hybrid.plan.predicted_speedup, "gap": hybrid.plan.gap,
             "hardware": hybrid.plan.hardware, "solve_time_s": hybrid.plan.solve_time_s,
             "reference_step_s": hybrid.plan.reference_step_s, "reference_speedup": hybrid.plan.reference_speedup},
    "metrics": {"steps": result.final_step, "resumed_from": start,
                "first_loss": rows[0]["loss"] if rows else None,
                "final_loss": rows[-1]["loss"] if rows else None,
                "first_step_s": result.first_step_s,
                "noise_scale": next((r["noise_scale"] for r in reversed(rows) if "noise_scale" in r), None)},
    "predicted_step_s": predicted["step_s"],
    "predicted": predicted,
    "memory": memory_summary(hybrid),
    "measured_step_s": result.measured_step_s,
    "calibration": calib,
    "projection": None,
  }
  if config.projection:
    try:
      proj, est = predict.project(config, hybrid.plan, hybrid.mesh.shape[mesh_lib.MODEL])
      results["projection"] = {**proj.to_json(), "s_mp_plan": est.to_json()}
      results["projection_table"] = projection_lib.format_table(proj)
      if primary:
        projection_lib.plot([proj], os.path.join(wd, "projection.png"))
    except ValueError as e:  # a model without a paper scenario
      log.warning("projection skipped: %s", e)
  if primary:
    if rows:
      plot_loss(rows, os.path.join(wd, "loss.png"), f"{config.model} ({config.size}) on {config.mesh}")
    with open(os.path.join(wd, "results.json"), "w") as f:
      json.dump(results, f, indent=1, default=str)
  return results
