"""bench_mp's calibration: the link between two pinned one-core processes (latency, bandwidth),
the per-byte update, addition and fill times and the fixed costs of one lock-step group and of
one task beyond the tasks' profiled times and the link (`jaxhybrid.program.group_cost`),
measured once per machine and setup and cached
(`jaxhybrid.costs.calibration_cache`), then read by every model's jobs from the workdir; and the
rule that sets the share between a model's warm and flushed node profiles (`share_rule`)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

from absl import logging


def role_calibrate(work: pathlib.Path) -> None:
  """Both processes: the link between them, the per-byte passes timed on both cores at once
  (as the program's devices update together), then the per-group and per-task costs of tiny
  hybrid programs priced with that link; rank 0 writes what it measured."""
  import jax
  import optax

  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import localcluster
  from jaxhybrid.train import calibration as run_calibration

  localcluster.worker_init()
  values = run_calibration.measure(mesh_lib.make("1x2"), optax.adam(1e-4),
                                   link_repeats=LINK_REPEATS, group_steps=GROUP_STEPS)
  if jax.process_index() == 0:
    (work / "calibration_measured.json").write_text(json.dumps(values))


# How bench_mp's calibration is measured: part of its cache key, so a different setup on the same
# machine (or a changed measurement: bump `version`) measures its own. The workers' malloc
# setting (localcluster's huge pages: it moves the per-byte passes through page faults) is added
# to it.
# Timed ppermutes per message size (a count, the same in both processes: each call is a
# collective; at 1-3 ms a call, 31 calls cover a tenth of a second of the other process's
# scheduling).
LINK_REPEATS = 31
# Timed steps of each tiny program of the per-group fit (a count, as LINK_REPEATS).
GROUP_STEPS = 40
CALIBRATION_SETUP = {"bench": "bench_mp", "version": 4, "processes": 2,
                     "pinning": "one core per process", "collectives": "gloo", "backend": "cpu",
                     "optimizer": "adam(1e-4)", "pass_bytes": 32 << 20,
                     "xla_flags": os.environ.get("XLA_FLAGS", "")}


def calibrate_machine(work: pathlib.Path, cache_dir: str, recalibrate: bool,
                      launch: Callable[[], None], idle_spinners: bool = False) -> dict:
  """This machine's calibration: the cached one, or measured by `launch()` (bench_mp's
  `calibrate` role in two pinned processes) and cached. `cache_dir`: '' the default directory,
  'off' none. `idle_spinners`: whether `launch` runs with them (part of the cache key). Writes work/calibration.json (the entry and where it came from) and
  work/link.json."""
  from jaxhybrid.costs import calibration_cache
  from jaxhybrid.program import localcluster

  off = cache_dir == "off"
  setup = {**CALIBRATION_SETUP, "glibc_tunables": localcluster.with_malloc_tunables(
    dict(os.environ)).get("GLIBC_TUNABLES", "")}
  if idle_spinners:  # only when on: the caches measured without keep their keys
    setup["idle_spinners"] = True
  cache = calibration_cache.CalibrationCache(None if off or not cache_dir else cache_dir,
                                             calibration_cache.machine_fields(backend=False))
  how = (f"ring ppermute of 1 KiB-4 MiB (every factor of 4, median of {LINK_REPEATS} runs per "
         "size) fitted alpha + n / bandwidth by relative least squares; adam update, addition "
         "and fill of a 32 MiB float32 buffer, both processes at once; per-group and per-task "
         "costs: least squares of measured - priced step over groups and busiest-device tasks "
         f"of {group_cost_programs()} (median of {GROUP_STEPS} steps each)")

  def measure() -> dict:
    logging.info("calibrating the link and the per-byte passes on two one-core processes")
    launch()
    return json.loads((work / "calibration_measured.json").read_text())

  if off:
    entry, measured = {"values": measure(), "provenance": {"how": how}}, True
  else:
    entry, measured = cache.get_or_measure("bench_mp", measure, setup, how, refresh=recalibrate)
  source = "measured" if measured else "cache"
  from jaxhybrid.train import calibration as run_calibration

  # The cached points fitted by this version's group-cost fit (a new entry's are fitted alike).
  entry = {**entry, "values": run_calibration.refit_groups(entry["values"])}
  out = {"source": source, "path": None if off else str(cache.path("bench_mp", setup)),
         **entry}
  (work / "calibration.json").write_text(json.dumps(out))
  v = entry["values"]
  (work / "link.json").write_text(json.dumps({"alpha_s": v["link_alpha_s"],
                                              "bandwidth": v["link_bandwidth_bytes_s"]}))
  return out


def calibration(work: pathlib.Path) -> dict:
  return json.loads((work / "calibration.json").read_text())


def link(work: pathlib.Path):
  from jaxhybrid.train import calibration as run_calibration

  return run_calibration.link(calibration(work)["values"],
                              source="calibrated ppermute, one-core processes")


def pass_costs(work: pathlib.Path):
  from jaxhybrid.train import calibration as run_calibration

  return run_calibration.pass_costs(calibration(work)["values"])


def planner_fixed_costs(work: pathlib.Path) -> dict[str, float]:
  """The calibrated per-group and per-task costs (s) as planner options."""
  from jaxhybrid.train import calibration as run_calibration

  return run_calibration.planner_options(calibration(work)["values"])


def group_cost_programs() -> str:
  from jaxhybrid.program import group_cost

  blocks = "/".join("one per node" if b <= 0 else str(b) for b in group_cost.BLOCKS)
  layers = " and ".join(str(n) for n in group_cost.LAYER_COUNTS)
  return f"chains of {layers} 16-wide layers at {blocks} blocks"


def share_rule(rule: str, cm, model, loss_fn, batch, graph, k: int, work: pathlib.Path):
  """`cm` (a cache-blended profile of `graph`) at --profile_share_rule's share: 'cold' (1),
  'whole' (`cm` as fitted to the whole step) or 'program' (`program_anchored`)."""
  from bench_mp_flags import FLAGS, schedule

  if rule == "cold":
    return cm.at_share(1.0, "cold")
  if rule == "whole":
    return cm
  return program_anchored(cm, model, loss_fn, batch, graph, k, pass_costs=pass_costs(work),
                          schedule=schedule(), branch_remat=FLAGS.branch_remat,
                          steps=FLAGS.steps, warmup=FLAGS.warmup)


def program_anchored(cm, model, loss_fn, batch, graph, k: int, *, pass_costs, schedule,
                     branch_remat: str, steps: int, warmup: int):
  """`cm` (a cache-blended profile of `graph`, the micro-batch graph the plans are made from)
  with its cold share fitted to the model's hybrid program on this process's device with every
  node on it and `k` micro-batches: timed (median of `steps` after `warmup`), priced with every
  task warm and every task cold as the plans are priced (`lockstep.plan_step_s`), the share
  interpolated (`CacheBlendedCostModel.anchored`)."""
  import statistics

  import jax
  import optax

  import bench_baselines
  from jaxhybrid import api, planner
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.costs import CacheBlendedCostModel
  from jaxhybrid.program import lockstep

  one = planner.place(graph, cm, devices=1, microbatches=k, method="single")
  hy = api.parallelize(
    model, loss_fn, optax.adam(1e-4), batch,
    mesh=mesh_lib.make("1x1", devices=jax.local_devices()[:1]), microbatches=k, plan=one,
    program_options={"branch_remat": branch_remat, **({"schedule": schedule} if schedule else {})})
  times, _, _ = bench_baselines.step_times(lambda st, bt: hy.program.step_fn()(st, bt),
                                           hy.init(), hy.program.shard_batch(batch), steps, warmup)

  def price(share: float) -> float:
    blend = CacheBlendedCostModel(cm.warm, cm.cold, cold_share=share)
    return lockstep.plan_step_s(graph, one, blend, pass_costs=pass_costs,
                                branch_remat=branch_remat, schedule=schedule).step_s

  out = cm.anchored(statistics.median(times), price(0.0), price(1.0))
  logging.info("cache blend fitted to the one-device program (%d micro-batches): %s", k,
               out.fit.to_dict())
  return out
