"""bench_mp's settings: its absl flags, per-model defaults and the helpers that read them (the
model, batch, micro-batches, schedule); experiments/bench/bench_mp.py says what the benchmark
measures. Imported by bench_mp, whose worker roles get these flags on their command lines."""

from __future__ import annotations

from absl import flags

FLAGS = flags.FLAGS

flags.DEFINE_list("models", ["chain", "gnmt", "biglstm", "inception_v3"], "Models to benchmark.")
flags.DEFINE_string("size", "small", "Model size preset (a step of about a second on one core).")
flags.DEFINE_integer("batch", 0, "Per-worker batch (0: the model's bench default).")
flags.DEFINE_integer("microbatches", 0, "Micro-batches for the plan (0: model default).")
flags.DEFINE_string("planner", "milp", "Planner method.")
# On by default since the lock-step model prices the conditionals' zero-fill (one run, batch 64,
# k=4: it chose the interleaved plan for Inception-V3 and the dp plan for GNMT over the MILP plan,
# and those ran faster).
flags.DEFINE_boolean("choose_lockstep", True, "Run whichever of the planner's plan and the "
                     "LOCKSTEP_CANDIDATES heuristic plans is fastest in lock step.")
flags.DEFINE_boolean("shard_candidate", True, "Also plan the graph with shard options (large "
                     "leaves split over the two devices) and time that plan beside the "
                     "placement-only candidates.")
flags.DEFINE_boolean("batch_candidate", False, "Also plan the graph with its big nodes split by "
                     "rows of the micro-batch over the two devices and time that plan beside "
                     "the placement-only candidates.")
flags.DEFINE_integer("autotune", 3, "Time this many distinct candidate plans (best predicted "
                     "first) on the two devices and run the fastest; 1 runs the lock-step "
                     "model's choice untimed against the others.")
flags.DEFINE_boolean("idle_spinners", False, "Keep a SCHED_IDLE busy loop on each pinned core "
                     "while the calibration, profiling and timing jobs run, so that a device "
                     "waiting for a message never leaves its core idle "
                     "(jaxhybrid.program.localcluster.IDLE_SPINNER); part of the calibration's "
                     "cache key when on.")
flags.DEFINE_integer("pack_max_bytes", -1, "A group's transfers below this size share one "
                     "ppermute per direction (-1: the program's DEFAULT_PACK_MAX_BYTES; 0: off).")
flags.DEFINE_boolean("compare_unpacked", False, "Also time the plan with pack_max_bytes=0 "
                     "(step_s_plan_unpacked; v2 programs pack every group's messages alike).")
flags.DEFINE_enum("schedule", "1f1b", ["gpipe", "1f1b", "zb", "auto"],
                  "Task schedule the program runs; 'auto': the planner's own choice among all of "
                  "them and its lock-step orders and explicit groups ('custom').")
flags.DEFINE_float("budget_s", 4800.0, "Wall time for the whole run, calibration included: a "
                   "model's jobs get what is left and are stopped when it is spent, and models "
                   "left then are skipped (each model's results are written as soon as they exist).")
flags.DEFINE_enum("branch_remat", "none", ["none", "dots", "full"], "What each forward task "
                  "saves for its backward (HybridProgram.build's branch_remat).")
flags.DEFINE_boolean("task_profiles", True, "Time each node's F and B tasks apart, as the program "
                     "runs them (ProfiledCostModel tasks=True); False: fused, F share assumed.")
flags.DEFINE_float("time_limit", 30.0, "MILP time limit (s).")
flags.DEFINE_integer("steps", 8, "Timed steps per configuration (per round for the candidate plans and the paired one-device step).")
flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first compiles).")
flags.DEFINE_integer("rounds", 4, "Blocks of --steps timed steps (each after --warmup untimed "
                     "ones) per candidate plan and per one-device run, each configuration in its "
                     "own pair of processes; each figure is the median of all its steps.")
flags.DEFINE_float("profile_warmup_s", 1.0, "ProfiledCostModel warmup_s: untimed runs per profiled node.")
flags.DEFINE_float("profile_min_time_s", 0.5, "ProfiledCostModel min_time_s: time each profiled "
                   "function until its timed runs add up to this long (0: 5 runs).")
flags.DEFINE_integer("profile_flush_bytes", -1, "ProfiledCostModel flush_bytes: write this many "
                     "bytes before every timed run (data out of the caches, as in the program); "
                     "-1: 1.5x the host's largest cache (costs.cache_flush_bytes); 0: off.")
flags.DEFINE_boolean("profile_cache_blend", True, "Profile each node back to back and flushed "
                     "(jaxhybrid.costs.cache_blended; needs a flush, --profile_flush_bytes != 0), "
                     "both recorded so a run can be re-priced; --profile_share_rule sets the "
                     "price. False: the flushed profile alone.")
flags.DEFINE_enum("profile_share_rule", "cold", ["cold", "whole", "program"], "The share "
                  "between the warm and the cold profile the plans are priced at: 'cold', the "
                  "flushed times (two runs of four models re-priced, bench_mp_reprice.py: mean "
                  "step error 6.8 and 8.1 % against 10.9 and 9.2 % for 'whole'); 'whole', the "
                  "whole-step test (cache_blend.fit_cold_share); 'program', interpolated to the "
                  "model's hybrid program on one device at the plans' micro-batch count.")
flags.DEFINE_boolean("profile_under_load", True, "Profile (and plan) while a second process runs the "
                     "model's plain step on the other core, as the program keeps both cores busy.")
flags.DEFINE_boolean("load_microbatch", False, "The load's plain step takes one micro-batch (b/k "
                     "rows, what the program's other device works on) instead of the full batch.")
flags.DEFINE_multi_string("set", [], "Model config override key=value (repeatable).")
flags.DEFINE_string("workdir", "/tmp/jaxhybrid_bench_mp", "Scratch dir (plans, profiles).")
flags.DEFINE_boolean("reuse_profiles", False, "Keep the node profiles an earlier run left in "
                     "--workdir (default: measure them again, under this run's conditions).")
flags.DEFINE_integer("lane_min_bytes", -1, "Values of at least this many bytes leave a group in "
                     "a buffer of their own (-1: lockstep_rule.LANE_MIN_BYTES).")
flags.DEFINE_integer("group_grad_bytes", -1, "Most gradient bytes per device in one group "
                     "(-1: lockstep_rule.GROUP_GRAD_BYTES).")
flags.DEFINE_string("calibration_cache", "", "Where this machine's calibration (link latency "
                    "and bandwidth, per-byte update, addition and fill times) is cached ('': "
                    "jaxhybrid.costs.calibration_cache's default directory; 'off': measure it "
                    "afresh and keep nothing).")
flags.DEFINE_boolean("recalibrate", False, "Measure the calibration again and replace the cached one.")
flags.DEFINE_string("out", "", "Write the JSON results here.")
flags.DEFINE_boolean("update", False, "Keep the rows of other models already in --out and replace "
                     "only those of the models this run measures; each row records the commit of "
                     "the program that measured it ('program').")
flags.DEFINE_string("role", "driver", "Internal: driver | calibrate | single | time.")
flags.DEFINE_string("config", "", "Internal: the configuration a `time` role times (one_before, "
                    "plan_<i>, one_after, zero, dp, gspmd_tp, fsdp, unpacked_<i>).")
flags.DEFINE_string("model", "", "Internal: the model of a worker role.")

# Per-model bench defaults: (per-worker batch, micro-batches).
# Batch 64: a one-core step of about a second on the small presets; four micro-batches of 4
# cost GNMT 44 % over one batch of 16 on one core (small LSTM matmuls), of 16 over 64 9 %.
# chain: 8 tanh layers of 256, batch 8192: a ~0.6 s one-core step; M=2, k=8 1F1B bound 16/9 =
# 1.78x. (Width 1024 at batch 512: 8 micro-batches cost 1.6x the full batch, a ~1.1x cap.)
# BigLSTM: each LSTM layer in 4 time chunks (BENCH_SETS), k=1: the layers overlap as a
# wavefront over time on the full batch (measured 1.32x, paired 1.46x). Without chunks it
# needs micro-batches, and 32-row ones cost 1.48x per row on one core: k=2 ran 0.96-1.07x
# (paired 0.92-1.11x; --set time_chunks=1 --microbatches=2).
BENCH_DEFAULTS = {"inception_v3": (64, 4), "gnmt": (64, 4), "biglstm": (64, 1), "chain": (8192, 8)}
# Per-model config overrides under --set's (which win).
BENCH_SETS = {"biglstm": {"time_chunks": 4}}

# Heuristic plans weighed against the planner's by `--choose_lockstep` (few transfers each).
LOCKSTEP_CANDIDATES = ("dp", "interleaved")


# ---- the settings as the worker roles read them ----------------------------------------------

def pack_max_bytes() -> int:
  from jaxhybrid import program as program_lib

  return program_lib.DEFAULT_PACK_MAX_BYTES if FLAGS.pack_max_bytes < 0 else FLAGS.pack_max_bytes


def overrides() -> dict:
  import ast

  out = {}
  for kv in FLAGS.set:
    k, _, v = kv.partition("=")
    try:
      out[k] = ast.literal_eval(v)
    except (ValueError, SyntaxError):
      out[k] = v
  return out


def model_sets(name: str) -> dict:
  """The model's config overrides: BENCH_SETS under --set."""
  return {**BENCH_SETS.get(name, {}), **overrides()}


def batch_k(name: str) -> tuple[int, int]:
  b, k = BENCH_DEFAULTS.get(name, (8, 1))
  return FLAGS.batch or b, FLAGS.microbatches or k


def model(name):
  from flax import nnx

  import chain_model

  from jaxhybrid import models

  if name == "chain":
    spec = chain_model.spec(**overrides())  # --set width=512, --set layers=8
  else:
    spec = models.get(name, FLAGS.size, **model_sets(name))
  return spec, spec.make(nnx.Rngs(0))


def schedule() -> str | None:
  """The schedule the program is told to run: None for 'auto' (the plan's own)."""
  return None if FLAGS.schedule == "auto" else FLAGS.schedule


def load_rows(b: int, k: int) -> int:
  """Rows of the load step --profile_under_load runs: a micro-batch's (--load_microbatch) or the
  whole batch's."""
  return b // k if FLAGS.load_microbatch else b


def profile_flush_bytes() -> int:
  """--profile_flush_bytes, with -1 resolved to this host's cache-sized flush."""
  from jaxhybrid.costs import timing

  if FLAGS.profile_flush_bytes < 0:
    return timing.cache_flush_bytes()
  return FLAGS.profile_flush_bytes


def profiled(graph, cold_share=None, **kwargs):
  """The cost model the `single` role prices with: `costs.cache_blended` under
  --profile_cache_blend (with a flush; `cold_share`: a fixed share, e.g. the one another graph of
  the model was fitted to), else one `ProfiledCostModel` with --profile_flush_bytes."""
  from jaxhybrid import costs

  flush = profile_flush_bytes()
  if FLAGS.profile_cache_blend and flush > 0:
    return costs.cache_blended(graph, flush_bytes=flush, cold_share=cold_share, **kwargs)
  return costs.ProfiledCostModel(graph, flush_bytes=flush, **kwargs)


def blend_fit(cm) -> dict | None:
  """The fitted warm/cold share of a `profiled` model (None when it is a single profile)."""
  return cm.fit.to_dict() if hasattr(cm, "fit") else None
