r"""Model-parallel speed on one-core CPU devices: measured vs predicted, and against plain JAX.

    python experiments/bench/bench_mp.py --out=bench_mp.json   # chain, gnmt, biglstm, inception_v3

Each device is its own process pinned to its own core (jaxhybrid.program.localcluster), joined by
jax.distributed with gloo collectives; the 1-device baseline is one such process. Once per
machine (cached, below), 2 processes calibrate the ppermute link between two such devices (alpha,
bandwidth) and the per-byte update, addition and fill passes. Per model:
1. (1 process, and with --profile_under_load a second one running the model's plain step on the
   other core meanwhile, as the program keeps both busy) node times are profiled (one core; F
   and B tasks apart, --task_profiles; each timed run after writing 1.5x the host's largest
   cache, --profile_flush_bytes, as a task in the program starts after other work; and again
   back to back; the plans are priced at the flushed times by default, --profile_share_rule,
   --profile_cache_blend, jaxhybrid.costs.cache_blend, bench_mp_reprice.py), the
   DLPlacer plan for 2 devices is made from them and weighed against the `dp` and `interleaved`
   heuristic plans by the lock-step model; the plain `jax.jit` single-device step is timed alone;
2. (2 processes per configuration, started for it and ended after it: one program per process,
   as a user runs it) the plain one-device step (each process on its own core at once), the
   --autotune best-predicted candidate plans as the hybrid program on mesh 1x2, the one-device
   step again (the two one-device runs bracket the candidates: their difference is the drift
   over the stage), then the baselines; the fastest candidate is the run's plan (each
   candidate's prediction and time are in `candidates`, so the model is checked on every plan
   timed, not only the fastest); a plain `jax.jit` data-parallel step and the hybrid program are
   timed on mesh 2x1; a GSPMD tensor-parallel `jax.jit` step (each weight sharded over 'model' on
   its largest divisible dimension) and FSDP on the same two devices.
Models: inception_v3, gnmt, biglstm (registry, --size) and chain (8 equal tanh layers of 256, batch
8192, k=8: a uniform pipeline of 1024-row micro-batches; `--set width=1024 --batch=512` is the
earlier chain, whose 64-row micro-batches bind it, see BENCH_DEFAULTS); BigLSTM runs each LSTM
layer in 4 time chunks at k=1 (BENCH_SETS; `--set time_chunks=1 --microbatches=2` is the earlier
micro-batched run). The program runs --schedule
(default 1F1B). Every timed candidate's predicted and measured step is in the row, with the
mean and max error and the rank correlation over them. Data-parallel baselines on 2x1: plain
`jax.jit` (XLA all-reduces each leaf) and the DP a user would write over slow links, every
gradient in ONE flat all-reduce.
Results are written after each model; --budget_s bounds the whole run (models left when it is
spent, or whose job fails or runs past it, are listed as skipped with the reason). Quick models run
first (Inception-V3 compiles for minutes per candidate).
The calibration (link latency and bandwidth, per-byte update, addition and fill times, the
fixed costs of a lock-step group and of a task beyond the tasks' profiles and the link) is
measured once per machine and setup and cached (bench_mp_calibration.py,
jaxhybrid.costs.calibration_cache; --calibration_cache, --recalibrate); the row says whether this
run measured it or read it.
The result rows' schema (every field and its definition): bench_mp_errors.py's docstring. Step
times are medians over --steps timed steps after --warmup steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import sys
import time

# Worker processes pin their core before JAX starts.
if __name__ == "__main__" and "--role=" in " ".join(sys.argv) and "--role=driver" not in sys.argv:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from jaxhybrid.program import localcluster

  localcluster.worker_setup()

import bench_baselines  # experiments/bench/ (the script's folder)
import bench_mp_calibration as calib
import bench_mp_errors
import bench_mp_flags  # noqa: F401  (defines the flags)
import provenance
from absl import app, flags, logging
from bench_mp_flags import (LOCKSTEP_CANDIDATES, batch_k as _batch_k, blend_fit as _blend_fit,
                            load_rows as _load_rows, model as _model, model_sets as _model_sets,
                            overrides as _overrides, profile_flush_bytes as _flush_bytes,
                            profiled as _profiled, pack_max_bytes as _pack_max_bytes,
                            schedule as _schedule)

FLAGS = flags.FLAGS


# ---- worker roles -----------------------------------------------------------------------------

def role_single(work: pathlib.Path, name: str) -> None:
  """Profiles, plans, times one device (`_single`); with --profile_under_load rank 1 of this
  two-process job runs the model's plain step on the other core meanwhile."""
  from jaxhybrid.program import localcluster

  flags_ = [bench_baselines.LOAD_RUNNING, bench_baselines.LOAD_STOP, bench_baselines.LOAD_STOPPED]
  running, stop, stopped = (work / f.format(name) for f in flags_)
  if not FLAGS.profile_under_load:
    return _single(work, name, lambda: None)
  if os.environ.get(localcluster.ENV_RANK, "0") == "1":
    spec, model = _model(name)
    b, k = _batch_k(name)
    return bench_baselines.run_model_load(model, spec.loss_fn, spec.synthetic_batch(0, _load_rows(b, k)),
                                          work, name, FLAGS.budget_s)
  bench_baselines.wait_for(running, 900, fail_if=stopped)
  try:  # the plain one-device step is timed alone, as before
    _single(work, name, lambda: (stop.touch(), bench_baselines.wait_for(stopped, 300)))
  finally:
    stop.touch()


def _single(work: pathlib.Path, name: str, stop_load) -> None:
  import jax
  import numpy as np
  import optax

  from jaxhybrid import api, planner
  from jaxhybrid import graph as graph_lib
  from jaxhybrid.program import lockstep

  spec, model = _model(name)
  b, k = _batch_k(name)
  batch = spec.synthetic_batch(0, b)
  micro_spec, per_example = api.microbatch_spec(batch, b, b // k)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn)
  g = graph_lib.trace_function(pure, p, s, micro_spec)
  cm = _profiled(g, cache_dir=work / "profiles", link=calib.link(work), warmup_s=FLAGS.profile_warmup_s,
                 min_time_s=FLAGS.profile_min_time_s, branch_remat=FLAGS.branch_remat, tasks=FLAGS.task_profiles)
  t0 = time.perf_counter()
  cm.profile_all()  # plan_time_s = profile_s (every F and B task) + place_s
  if hasattr(cm, "at_share"):  # the blend's share: --profile_share_rule
    cm = calib.share_rule(FLAGS.profile_share_rule, cm, model, spec.loss_fn, batch, g, k, work)
  t1 = time.perf_counter()
  # Plan the kind the program runs ('auto': any, the plan's own schedule runs).
  # Priced with this machine's calibrated per-group and per-task costs, as the program is.
  kinds = {"schedule_kinds": ("gpipe", "1f1b", "zb", "custom") if FLAGS.schedule == "auto"
           else (FLAGS.schedule,), **calib.planner_fixed_costs(work)}
  plan = planner.place(g, cm, devices=2, microbatches=k, method=FLAGS.planner,
                       time_limit_s=FLAGS.time_limit, **kinds)
  plan_s, profile_s, place_s = time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1
  # Its per-step memory passes (optimizer update, gradient accumulation, the conditionals'
  # zero-fill) are priced from this machine's calibration (CALIBRATION_SETUP's optimizer).
  opt = optax.adam(1e-4)
  pc = calib.pass_costs(work)
  cands, methods = [plan], [FLAGS.planner]
  if FLAGS.choose_lockstep:
    # The program runs in lock step: weigh the planner's plan against the pipeline heuristics'
    # plans priced that way (as jaxhybrid.program.lockstep.choose does), best predicted first.
    cands += [planner.place(g, cm, devices=2, microbatches=k, method=m, **kinds) for m in LOCKSTEP_CANDIDATES]
    methods += list(LOCKSTEP_CANDIDATES)
  graphs = [(g, cm)] * len(cands)
  pick = {}
  def split_candidate(g_x, method: str, **record):
    """The same planner on a split graph, seeded by the placement-only plan mapped onto it (as
    `parallelize` does), appended to the candidates; returns its plan."""
    cm_x = _profiled(
      g_x, cache_dir=work / "profiles", link=calib.link(work), warmup_s=FLAGS.profile_warmup_s,
      min_time_s=FLAGS.profile_min_time_s, branch_remat=FLAGS.branch_remat,
      tasks=FLAGS.task_profiles, cold_share=getattr(cm, "cold_share", None))
    cm_x.profile_all()
    seed = planner.place_shards.whole_on_split(plan, g_x)
    x = planner.place(g_x, cm_x, devices=2, microbatches=k, method=FLAGS.planner,
                      time_limit_s=FLAGS.time_limit, seed_assignments=(seed,), **kinds)
    x = dataclasses.replace(x, **record)
    cands.append(x)
    methods.append(f"{FLAGS.planner}+{method}")
    graphs.append((g_x, cm_x))
    return x

  if FLAGS.shard_candidate:
    # The graph with shard options (large leaves split into one piece per device,
    # `jaxhybrid.graph.shard`); the plan a user gets is whichever of the two
    # `planner.keeps_sharded` keeps.
    from jaxhybrid.graph import shard as shard_lib

    g_sh, _ = shard_lib.shard_leaves(g, 2)
    if g_sh.shards:
      sh = split_candidate(g_sh, "shard", shards=tuple(x.to_json() for x in g_sh.shards))
      pick["planner_keeps_sharded"] = bool(planner.keeps_sharded(sh, plan, graph=g_sh))
  if FLAGS.batch_candidate:
    # The graph with its big nodes split by rows of the micro-batch
    # (`jaxhybrid.graph.batch_split`, PlannerOptions.batch_split_min_fraction): the plan
    # `parallelize` makes with shard_rules including 'batch'.
    from jaxhybrid.graph import batch_split as batch_lib

    small = batch_lib.trace_small(pure, p, s, micro_spec, per_example, 2)
    g_b, _ = batch_lib.split_batch(
      g, small, 2, min_fraction=planner.PlannerOptions().batch_split_min_fraction)
    if g_b.batch_splits:
      bp = split_candidate(g_b, "batch",
                           batch_splits=tuple(x.to_json() for x in g_b.batch_splits))
      pick["planner_keeps_batch_split"] = bool(planner.keeps_sharded(bp, plan, graph=g_b))
  priced = [lockstep.plan_step_s(gc, c, cmc, pass_costs=pc, branch_remat=FLAGS.branch_remat,
                                 schedule=_schedule()) for c, (gc, cmc) in zip(cands, graphs)]
  rank = sorted(range(len(cands)), key=lambda i: (priced[i].step_s, i))
  chosen = {"lockstep_candidates": {m: t.step_s for m, t in zip(methods, priced)}} if FLAGS.choose_lockstep else {}
  # Every candidate the time stage will time, in predicted order; a plan two methods found
  # (same placement and task schedule) is timed once.
  tuned, distinct = [], {}
  for i in rank:
    distinct.setdefault((tuple(cands[i].assignment), repr(cands[i].task_schedule)), i)
  for stale in work.glob(f"plan_{name}_*.json"):
    stale.unlink()
  timed = list(distinct.values())[: max(1, FLAGS.autotune)]
  # The sharded graph's plan is always timed (beside the best placement-only ones).
  timed += [i for i in distinct.values()
            if (cands[i].shards or cands[i].batch_splits) and i not in timed]
  for i in timed:
    plan_id = f"plan_{name}_{len(tuned)}"
    cands[i].save(work / f"{plan_id}.json")
    t = priced[i]
    tuned.append({
      "plan_id": plan_id, "method": methods[i], "sharded": bool(cands[i].shards),
      "batch_split": [x["node"] for x in cands[i].batch_splits],
      "predicted_rank": len(tuned),
      "schedule": _schedule() or getattr(getattr(cands[i], "task_schedule", None), "kind", None),
      "k": cands[i].microbatches, "groups": t.groups, "transfers": t.transfers,
      # The program's lock-step price (tasks, messages, fills, update and gradient passes).
      "predicted_step_s": t.step_s,
      "predicted_parts_s": {"tasks": t.compute_s, "transfers": t.transfer_s,
                            "update_and_gradient_passes": t.param_s, "fills": t.fill_s,
                            "group_sync": t.group_sync_s, "task_overhead": t.task_overhead_s},
    })
  full_spec, _ = api.microbatch_spec(batch, b, b)
  g_full = graph_lib.trace_function(pure, p, s, full_spec)
  cm_full = _profiled(g_full, cache_dir=work / "profiles", link=calib.link(work),
                      warmup_s=FLAGS.profile_warmup_s, min_time_s=FLAGS.profile_min_time_s)
  full_1dev_s = cm_full.step_time_s(g_full)
  whole_1dev_s = cm_full.whole_step_time_s()  # one compiled function: XLA fuses across nodes
  update_1dev_s = pc.time_s(sum(lockstep.param_bytes_per_device(g, [0] * len(g.nodes))), 1)
  stop_load()
  _, p_plain, s_plain, pure_plain = graph_lib.nnx_pure_loss(model, spec.loss_fn, scopes=False)
  step = jax.jit(bench_baselines.plain_step(pure_plain, opt), donate_argnums=0)
  carry = (p_plain, opt.init(p_plain), s_plain)
  t, _ = bench_baselines.timeit(step, carry, jax.tree.map(np.asarray, batch), FLAGS.steps, FLAGS.warmup)
  (work / f"single_{name}.json").write_text(json.dumps({
    "step_s_1dev": t, "predicted_1dev_s": full_1dev_s, "predicted_1dev_whole_s": whole_1dev_s,
    "predicted_1dev_update_s": update_1dev_s,
    "pack_max_bytes": _pack_max_bytes(), "branch_remat": FLAGS.branch_remat,
    "plan_status": plan.status, "plan_gap": plan.gap, "plan_time_s": plan_s, "profile_s": profile_s, "place_s": place_s,
    "nodes": len(g.nodes), "batch": b, "microbatches": k, "task_profiles": FLAGS.task_profiles,
    "model_overrides": _model_sets(name) if name != "chain" else _overrides(),
    "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # localcluster.MALLOC_TUNABLES
    "profiled_under_load": FLAGS.profile_under_load, "idle_spinners": FLAGS.idle_spinners,
    "load_rows": _load_rows(b, k) if FLAGS.profile_under_load else 0,
    "profile_flush_bytes": _flush_bytes(), "profile_min_time_s": FLAGS.profile_min_time_s,
    "profile_blend": _blend_fit(cm), "profile_blend_one_device": _blend_fit(cm_full),
    "candidates": tuned, **chosen, **pick,
  }))


# Every configuration the second stage times runs in its own pair of processes, started for it
# and ended after it (`role_time`). Measured when they shared one pair: Inception-V3's plain
# one-device step ran 0.62 s alone and 0.88 s timed in rotating rounds beside four compiled
# hybrid programs in the same processes, and its chosen plan 0.47-0.49 s alone against 0.55 s
# there (bench_mp.json and trace_groups_inception_v3.json as of commit faa053e; also
# process_reuse.json); a figure a user's process (one program) would see needs one program per
# process.
def _configs(n: int) -> list[str]:
  """The configurations of one model, in the order they are timed: the one-device step before
  and after the candidates (the two bracket the stage: their difference is the drift over it),
  every candidate, then the baselines."""
  return ["one_before", *[f"plan_{i}" for i in range(n)], "one_after", "zero", "dp", "gspmd_tp",
          "fsdp"]


def _best_baseline_steps() -> int:
  """Timed steps of the one-buffer baselines (FSDP and DP at their best, the ratios the plans
  are held to): as many as a candidate gets over its rounds (--steps x --rounds). Timed over
  --steps alone, `ratio_vs_dp_bucketed` moved by up to 29 % between two runs of the defaults
  (bench_mp_repro.json as of commit 0f364ea) while the candidates' steps moved by at most 10 %.
  The per-leaf baselines (1-4 s steps) keep --steps."""
  return FLAGS.steps * max(1, FLAGS.rounds)


def role_time(work: pathlib.Path, name: str, config: str) -> None:
  """Times one configuration (`_configs`, or `unpacked_<i>`) on this job's two processes; rank 0
  writes `time_<model>_<config>.json`: the per-block step times (--rounds blocks of --steps timed
  steps after --warmup untimed ones) or the baseline's median step(s)."""
  import jax
  import optax

  from jaxhybrid import api, planner
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import localcluster

  localcluster.worker_init()
  spec, model = _model(name)
  b, k = _batch_k(name)
  opt = optax.adam(1e-4)
  batch = spec.synthetic_batch(0, b)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn, scopes=False)
  out: dict = {"config": config}

  def blocks(fn, state, bt):
    times = []
    for _ in range(max(1, FLAGS.rounds)):
      t, state, _ = bench_baselines.step_times(fn, state, bt, FLAGS.steps, FLAGS.warmup)
      times.append(t)
    return times

  if config.startswith("one_"):
    # One device, as a user would run it: each process runs plain jit on its own core at the
    # same time (both cores busy, as under the plan).
    step1 = jax.jit(bench_baselines.plain_step(pure, opt), donate_argnums=0)
    one = bench_baselines.local_carry(opt, (p, s), batch)
    out["times"] = blocks(step1, *one)
  elif config.startswith(("plan_", "unpacked_")):
    plan = planner.Plan.load(work / f"plan_{name}_{config.split('_')[-1]}.json")
    pack = 0 if config.startswith("unpacked_") else _pack_max_bytes()
    hy = api.parallelize(
      model, spec.loss_fn, opt, batch, mesh=mesh_lib.make("1x2"), microbatches=k, plan=plan,
      program_options={"pack_max_bytes": pack, "branch_remat": FLAGS.branch_remat,
                       **({"schedule": _schedule()} if _schedule() else {})},
    )
    out["times"] = blocks(lambda st, bt: hy.program.step_fn()(st, bt), hy.init(),
                          hy.program.shard_batch(batch))
  elif config == "zero":
    # Data parallel 2x1, the hybrid program with the one-device plan with the optimizer state
    # replicated (ZeRO 0), sharded over 'data' (ZeRO 1) and the gradients sharded too (ZeRO 2),
    # in rotating rounds in these processes (their ratios are the figures).
    zero_s = bench_baselines.hybrid_zero_steps_s(
      model, spec.loss_fn, opt, spec.synthetic_batch(0, 2 * b), mesh_lib.make("2x1"), (0, 1, 2),
      FLAGS.rounds, FLAGS.steps, FLAGS.warmup)
    out["step_s_hybrid_2x1"] = zero_s[0]
    for z in (1, 2):
      out[f"step_s_hybrid_2x1_zero{z}"] = zero_s[z]
      out[f"zero{z}_step_ratio_2x1"] = zero_s[z] / zero_s[0]
  elif config == "dp":
    out["step_s_jit_dp"], out["step_s_dp_bucketed"] = bench_baselines.dp_steps_s(
      pure, opt, (p, s), spec.synthetic_batch(0, 2 * b), mesh_lib.make("2x1"), FLAGS.steps,
      FLAGS.warmup, steps_bucketed=_best_baseline_steps())
  elif config == "gspmd_tp":  # GSPMD tensor parallel on 1x2
    out["step_s_gspmd_tp"] = bench_baselines.gspmd_tp_step_s(
      pure, opt, (p, s), batch, mesh_lib.make("1x2"), FLAGS.steps, FLAGS.warmup)
  elif config == "fsdp":  # FSDP on the same two devices and the same batch per step as the plan
    out["step_s_fsdp"] = bench_baselines.fsdp_step_s(
      pure, opt, (p, s), batch, mesh_lib.make("2x1"), FLAGS.steps, FLAGS.warmup)
    out["step_s_fsdp_bucketed"] = bench_baselines.fsdp_bucketed_step_s(
      pure, opt, (p, s), batch, mesh_lib.make("2x1"), _best_baseline_steps(), FLAGS.warmup)
  else:
    raise ValueError(f"unknown --config={config!r}: one of {_configs(1)} (plan_<i>: candidate i)")
  if jax.process_index() == 0:
    (work / f"time_{name}_{config}.json").write_text(json.dumps(out))


def _time_stage(work: pathlib.Path, name: str, t_start: float) -> dict:
  """Launches `role_time` for every configuration of `name` (each its own two processes) and
  gathers what they wrote into the stage's figures (the field names bench_mp_errors.summarise
  reads)."""
  import numpy as np

  from jaxhybrid import planner
  from jaxhybrid.program import localcluster

  n = len(json.loads((work / f"single_{name}.json").read_text())["candidates"])
  for stale in work.glob(f"time_{name}_*.json"):
    stale.unlink()

  def run(config):
    logging.info("%s: time %s", name, config)
    localcluster.launch(_worker_argv("time", name) + [f"--config={config}"], 2,
                        timeout_s=_job_s(t_start), idle_spinners=FLAGS.idle_spinners)
    return json.loads((work / f"time_{name}_{config}.json").read_text())

  got = {c: run(c) for c in _configs(n)}
  med = lambda xs: float(np.median(xs))
  cand = [got[f"plan_{i}"]["times"] for i in range(n)]
  ones = got["one_before"]["times"] + got["one_after"]["times"]
  out = {
    "rounds": max(1, FLAGS.rounds), "one_program_per_process": True,
    "candidate_step_s": [med(np.concatenate(t)) for t in cand],
    "candidate_step_s_rounds": [[med(x) for x in t] for t in cand],
    "step_s_1dev_paired_each": [med(x) for x in ones],
    "step_s_1dev_paired": med(np.concatenate(ones)),
    "step_s_1dev_before_after": [med(np.concatenate(got[c]["times"]))
                                 for c in ("one_before", "one_after")],
  }
  best = min(range(n), key=lambda i: out["candidate_step_s"][i])
  out["chosen_candidate"], out["step_s_plan"] = best, out["candidate_step_s"][best]
  planner.Plan.load(work / f"plan_{name}_{best}.json").save(work / f"plan_{name}.json")
  if FLAGS.compare_unpacked and _pack_max_bytes() > 0:
    out["step_s_plan_unpacked"] = med(np.concatenate(run(f"unpacked_{best}")["times"]))
  for c in ("zero", "dp", "gspmd_tp", "fsdp"):
    out.update({key: v for key, v in got[c].items() if key != "config"})
  return out


# ---- driver -----------------------------------------------------------------------------------

def _worker_argv(role: str, model: str = "") -> list[str]:
  argv = [
    __file__, f"--role={role}", f"--model={model}", f"--size={FLAGS.size}", f"--batch={FLAGS.batch}",
    f"--microbatches={FLAGS.microbatches}", f"--planner={FLAGS.planner}", f"--choose_lockstep={FLAGS.choose_lockstep}", f"--time_limit={FLAGS.time_limit}",
    f"--pack_max_bytes={FLAGS.pack_max_bytes}", f"--compare_unpacked={FLAGS.compare_unpacked}",
    f"--branch_remat={FLAGS.branch_remat}", f"--autotune={FLAGS.autotune}",
    f"--task_profiles={FLAGS.task_profiles}", f"--profile_warmup_s={FLAGS.profile_warmup_s}",
    f"--profile_min_time_s={FLAGS.profile_min_time_s}",
    f"--profile_flush_bytes={FLAGS.profile_flush_bytes}",
    f"--profile_under_load={FLAGS.profile_under_load}", f"--load_microbatch={FLAGS.load_microbatch}",
    f"--profile_share_rule={FLAGS.profile_share_rule}",
    f"--budget_s={FLAGS.budget_s}", f"--shard_candidate={FLAGS.shard_candidate}",
    f"--batch_candidate={FLAGS.batch_candidate}",
    f"--schedule={FLAGS.schedule}", f"--lane_min_bytes={FLAGS.lane_min_bytes}", f"--group_grad_bytes={FLAGS.group_grad_bytes}",
    f"--steps={FLAGS.steps}", f"--warmup={FLAGS.warmup}", f"--rounds={FLAGS.rounds}", f"--workdir={FLAGS.workdir}",
  ]
  return argv + [f"--set={kv}" for kv in FLAGS.set]


def driver() -> list[dict]:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from jaxhybrid.program import localcluster

  (work := pathlib.Path(FLAGS.workdir)).mkdir(parents=True, exist_ok=True)
  if not FLAGS.reuse_profiles and (work / "profiles").exists():
    # Node profiles of an earlier run were measured under that run's load; re-measure.
    shutil.rmtree(work / "profiles")
  t_start = time.perf_counter()
  calib.calibrate_machine(
    work, FLAGS.calibration_cache, FLAGS.recalibrate, lambda: localcluster.launch(
      _worker_argv("calibrate"), 2, timeout_s=_job_s(t_start), idle_spinners=FLAGS.idle_spinners),
    idle_spinners=FLAGS.idle_spinners)
  cases = []
  for name in FLAGS.models:
    why = None
    if _job_s(t_start) < MIN_JOB_S:
      why = f"under {MIN_JOB_S:.0f} s of the {FLAGS.budget_s:.0f} s budget left"
    else:
      # Each job gets what is left of the budget; a job that fails or runs out of time is
      # reported as this model's skip reason and the next model runs.
      try:
        logging.info("%s: profile, plan, time 1 device", name)
        for f in (bench_baselines.LOAD_RUNNING, bench_baselines.LOAD_STOP, bench_baselines.LOAD_STOPPED):
          (work / f.format(name)).unlink(missing_ok=True)
        localcluster.launch(_worker_argv("single", name), 1 + FLAGS.profile_under_load,
                            timeout_s=_job_s(t_start), idle_spinners=FLAGS.idle_spinners)
        multi = _time_stage(work, name, t_start)
      except RuntimeError as e:
        why = re.sub(r"\[.*\]", "[...]", str(e).splitlines()[0])  # the job's argv elided
    if why:
      logging.warning("%s skipped: %s", name, why)
      cases.append({"model": name, "skipped": why})
      _write(cases)
      continue
    single = json.loads((work / f"single_{name}.json").read_text())
    (work / f"multi_{name}.json").write_text(json.dumps(multi))
    cases.append({"model": name, "size": FLAGS.size, "schedule": FLAGS.schedule,
                  **bench_mp_errors.summarise(single, multi, calib.calibration(work))})
    _write(cases)
  return cases


MIN_JOB_S = 120.0  # a model is not started with less left of the budget (profiling takes longer)


def _job_s(t_start: float) -> float:
  """What is left of the budget (s); the budget is a hard limit on the whole run."""
  return FLAGS.budget_s - (time.perf_counter() - t_start)


_ROWS: provenance.RowsFile | None = None


def _write(cases: list[dict]) -> None:
  """Writes the results so far (a model's row as soon as it exists)."""
  global _ROWS
  if _ROWS is None:  # --update: the other models' rows of the earlier --out are kept
    _ROWS = provenance.RowsFile(FLAGS.out, FLAGS.update, lambda r: r.get("model") in FLAGS.models)
  _ROWS.write(cases)


def main(argv):
  del argv
  work = pathlib.Path(FLAGS.workdir)
  from jaxhybrid.planner.pricing import lockstep_rule

  if FLAGS.lane_min_bytes >= 0:
    lockstep_rule.LANE_MIN_BYTES = FLAGS.lane_min_bytes
  if FLAGS.group_grad_bytes >= 0:
    lockstep_rule.GROUP_GRAD_BYTES = FLAGS.group_grad_bytes
  if FLAGS.role == "calibrate":
    return calib.role_calibrate(work)
  if FLAGS.role == "single":
    return role_single(work, FLAGS.model)
  if FLAGS.role == "time":
    return role_time(work, FLAGS.model, FLAGS.config)
  cases = driver()
  cols = ["model", "step_s_plan", "measured_speedup", "measured_speedup_both_busy",
          "predicted_speedup", "step_error_mean", "step_error_max", "rank_correlation",
          "ratio_vs_dp_bucketed", "ratio_vs_gspmd_tp", "ratio_vs_fsdp", "ratio_vs_fsdp_bucketed",
          "zero1_step_ratio_2x1", "zero2_step_ratio_2x1"]
  print(" ".join(f"{c[-16:]:>16}" for c in cols))
  for c in cases:
    if "skipped" in c:
      print(f"{c['model']:>16} skipped: {c['skipped']}")
      continue
    print(" ".join(f"{c.get(k):>16.4g}" if isinstance(c.get(k), float) else f"{c.get(k)!s:>16}"
                   for k in cols))
  _write(cases)
  print(f"wrote {FLAGS.out}" if FLAGS.out else "no --out given: nothing written")


if __name__ == "__main__":
  app.run(main)
