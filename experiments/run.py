r"""Trains a model with a planned hybrid DP x MP step and reports predicted versus measured time.

  python experiments/run.py --model=biglstm --mesh=16x2

On a CPU this runs the tiny model on 32 simulated devices in a few minutes: trace, costs, MILP
plan, one compiled hybrid program, training steps with a progress bar, predicted versus measured
step time and the DP-vs-hybrid projection; outputs go to --workdir (results.json, plan.json,
metrics.jsonl, checkpoints/, gantt.png, loss.png, projection.png). Bad input prints one line on
stderr and exits with status 2. The logic lives in jaxhybrid/train/runner.py.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging

from jaxhybrid import errors
from jaxhybrid.train import dry_run, run_report, runner

FLAGS = flags.FLAGS
_MODEL = flags.DEFINE_string("model", "biglstm", "biglstm | gnmt | inception_v3.")
_SIZE = flags.DEFINE_string("size", None, "tiny | small | paper (default: paper on GPU, tiny on CPU).")
_MESH = flags.DEFINE_string("mesh", "4x2", "DATAxMODEL device mesh, e.g. 16x2 (-1 fills from devices).")
_BATCH = flags.DEFINE_integer("batch", None, "Per-worker batch (default: the paper's on GPU, 4 on CPU).")
_MICRO = flags.DEFINE_integer("microbatches", 2, "Micro-batches per worker batch (pipelining).")
_PLANNER = flags.DEFINE_string("planner", "milp", "milp | etf | dp | interleaved | single.")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 30.0, "Planner time limit, seconds.")
_SCHEDULE = flags.DEFINE_string(
  "schedule", "1f1b", "Task schedule: gpipe | 1f1b | zb | auto (the planner picks the cheapest "
  "in lock step, its own group-by-group orders included).")
_ZERO = flags.DEFINE_integer(
  "zero", runner.DEFAULT_ZERO,
  "ZeRO stage over the data axis: 0 = full optimizer state per data replica, 1 = sharded over "
  "them, 2 = gradients sharded too (reduce-scattered per micro-batch).")
_SHARD = flags.DEFINE_boolean(
  "shard", True, "Let the planner split large parameter leaves (embedding, softmax and big dense "
  "tables) into one piece per model device; --noshard keeps every leaf whole.")
_BATCH_SPLIT = flags.DEFINE_boolean(
  "batch_split", False, "Also let the planner split big nodes by rows of the micro-batch, one "
  "piece per model device (its parameters replicated on those devices).")
_BATCH_SPLIT_PARAMS = flags.DEFINE_enum(
  "batch_split_params", "replicated", ["replicated", "split"],
  "With --batch_split, how a split node's parameters are stored: replicated on the devices its "
  "pieces run on, or split in one slice per model device (gathered for each micro-batch).")
_MEMORY_CAP = flags.DEFINE_float(
  "memory_cap_gib", None, "Planner memory cap per device, GiB (default: the hardware's memory).")
_DRY_RUN = flags.DEFINE_boolean(
  "dry_run", False, "Plan, compile from abstract inputs and print per-device memory; no training.")
_HARDWARE = flags.DEFINE_string("hardware", None, "Cost-model hardware profile (default: detect).")
_DATA = flags.DEFINE_string("data", "generated", "generated (learnable) | synthetic (random, timing) | a data folder.")
_STEPS = flags.DEFINE_integer("steps", 30, "Training steps.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: runs/<model>-<size>-<mesh>-<time>).")
_RESUME = flags.DEFINE_boolean("resume", False, "Continue the run in --workdir from its last checkpoint.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of parameters and data.")
_SET = flags.DEFINE_multi_string("set", [], "Model config override key=value (repeatable).")
_PLAN = flags.DEFINE_string("plan", None, "Apply this plan.json instead of planning.")
_OPTIMIZER = flags.DEFINE_string(
  "optimizer", None, "adam | sgd | adagrad (default: the paper's at --size=paper, BigLSTM's AdaGrad 0.2; else adam).")
_LR = flags.DEFINE_float("learning_rate", None, "Learning rate (default: 3e-3 on tiny presets, else 1e-3).")
_CLIP = flags.DEFINE_float("clip_norm", 0.0, "Clip gradients to this global norm over all devices (0: off).")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint every K steps (0: at the end only).")
_PROGRESS = flags.DEFINE_boolean("progress", True, "Show a progress bar.")
_PROJECTION = flags.DEFINE_boolean(
  "projection", True, "Project DP against hybrid time-to-accuracy at scale after the run (it plans "
  "the paper-size model); --noprojection skips it.")
_CALIBRATE = flags.DEFINE_boolean(
  "calibrate", False, "Measure this machine's link, optimizer passes and per-group costs on two "
  "model devices (cached per machine) and plan and predict with them.")
_COORD = flags.DEFINE_string("coordinator_address", None, "Multi-host: coordinator host:port.")
_NPROC = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")


def main(argv):
  if len(argv) > 1:
    sys.stderr.write(f"error: unexpected arguments {argv[1:]}: flags are written --name=value\n")
    sys.exit(2)
  # Logs and progress go to stdout; stderr is kept for the one-line error.
  absl_logging.get_absl_handler().python_handler.stream = sys.stdout
  # Quiet by default: the progress bar and the final report (plan and results); the planner's
  # and the advisor's INFO lines (bounds, warm starts, every priced plan) with --verbosity=1.
  # JAX's backend probing ('Unable to initialize backend tpu') counts as such a detail.
  detail = logging.INFO if FLAGS.verbosity >= 1 else logging.WARNING
  for name in ("jaxhybrid", "mip", "jax"):
    logging.getLogger(name).setLevel(detail)
  # Warnings only, at any verbosity: orbax's per-save chatter (through absl), and the DEBUG lines
  # --verbosity=1 lets through from the root logger (matplotlib's font search alone is ~2,300
  # lines per run, asyncio's selector one per checkpoint thread).
  for name in ("absl", "matplotlib", "PIL", "asyncio"):
    logging.getLogger(name).setLevel(logging.WARNING)
  try:
    config = runner.RunConfig(
      model=_MODEL.value, size=_SIZE.value, mesh=_MESH.value, batch=_BATCH.value,
      microbatches=_MICRO.value, planner=_PLANNER.value, time_limit_s=_TIME_LIMIT.value,
      schedule=_SCHEDULE.value, zero=_ZERO.value, shard=_SHARD.value,
      batch_split=_BATCH_SPLIT.value, batch_split_params=_BATCH_SPLIT_PARAMS.value,
      memory_cap_gib=_MEMORY_CAP.value, dry_run=_DRY_RUN.value,
      hardware=_HARDWARE.value, data=_DATA.value, steps=_STEPS.value, workdir=_WORKDIR.value,
      resume=_RESUME.value, seed=_SEED.value, overrides=runner.parse_overrides(_SET.value),
      plan=_PLAN.value, optimizer=_OPTIMIZER.value, learning_rate=_LR.value, clip_norm=_CLIP.value,
      checkpoint_every=_CKPT_EVERY.value, progress=_PROGRESS.value, projection=_PROJECTION.value,
      calibrate=_CALIBRATE.value,
      coordinator_address=_COORD.value, num_processes=_NPROC.value, process_id=_PID.value,
    )
    runner.setup_devices(config)  # before anything starts JAX
    results = (dry_run.run if config.dry_run else runner.run)(config)
  except errors.UsageError as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(2)
  if "memory" in results and "metrics" not in results:
    print(results["memory_table"])
    if results.get("does_not_fit"):
      sys.stderr.write(f"error: {results['does_not_fit']}\n")
      sys.exit(2)
  else:
    print(run_report.format_report(results))


if __name__ == "__main__":
  app.run(main)
