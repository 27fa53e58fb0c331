r"""How much one plan's step moves between fresh pairs of pinned processes.

    python experiments/bench/bench_mp.py --models=inception_v3 --workdir=/tmp/bmp   # plans
    python experiments/bench/pair_times.py --workdir=/tmp/bmp --model=inception_v3 \
        --plans=plan_inception_v3_0.json,plan_inception_v3_1.json --pairs=2 \
        --out=experiments/results/pair_times.json

bench_mp times each candidate in one pair of processes started for it (two one-core processes,
`jaxhybrid.program.localcluster`) and compares that step with the candidate's price. This script
starts --pairs such pairs per plan, each timing --steps steps after --warmup, as bench_mp's time
stage builds the program (its workdir's batch, micro-batches, branch remat, 1F1B), and reports
per pair the median and fastest step, and per plan the spread of the pairs' medians
((largest - smallest) / smallest). With --idle_spinners=both every pair is run twice in turn,
without and with a SCHED_IDLE busy loop on each core (`localcluster.IDLE_SPINNER`: a waiting
device then never leaves its core idle). The model's parameters come from `ModelSpec.init`
(one compiled initializer), not bench_mp's eager `make`: the values differ, the program is the
same.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

from absl import app, flags

flags.DEFINE_string("workdir", "/tmp/jaxhybrid_bench_mp", "bench_mp's workdir (its plans).")
flags.DEFINE_string("model", "inception_v3", "Registry model the plans were made for.")
flags.DEFINE_string("size", "small", "Model size preset (as bench_mp's --size).")
flags.DEFINE_list("plans", [], "Plan JSON files, relative to --workdir.")
flags.DEFINE_integer("pairs", 2, "Fresh process pairs per plan (and spinner setting).")
flags.DEFINE_integer("steps", 15, "Timed steps per pair.")
flags.DEFINE_integer("warmup", 3, "Untimed steps per pair before them (the first compiles).")
flags.DEFINE_enum("idle_spinners", "off", ["off", "on", "both"],
                  "Run the pairs without, with, or alternately without and with idle spinners.")
flags.DEFINE_string("out", "", "Write the JSON here.")
flags.DEFINE_string("role", "driver", "Internal: driver | time.")
flags.DEFINE_string("plan", "", "Internal: the plan a `time` role times.")
flags.DEFINE_string("result", "", "Internal: where rank 0 of a `time` role writes its times.")
FLAGS = flags.FLAGS


def role_time() -> None:
  import bench_baselines  # experiments/bench/ (the script's folder)
  import jax
  import optax

  from jaxhybrid import api, models, planner
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import localcluster

  localcluster.worker_init()
  work = pathlib.Path(FLAGS.workdir)
  single = json.loads((work / f"single_{FLAGS.model}.json").read_text())
  spec = models.get(FLAGS.model, FLAGS.size, **single.get("model_overrides", {}))
  batch = spec.synthetic_batch(0, single["batch"])
  hy = api.parallelize(
    spec.init(0), spec.loss_fn, optax.adam(1e-4), batch, mesh=mesh_lib.make("1x2"),
    microbatches=single["microbatches"], plan=planner.Plan.load(work / FLAGS.plan),
    program_options={"pack_max_bytes": single["pack_max_bytes"],
                     "branch_remat": single["branch_remat"], "schedule": "1f1b"})
  fn, state, shards = hy.program.step_fn(), hy.init(), hy.program.shard_batch(batch)
  times, _, _ = bench_baselines.step_times(fn, state, shards, FLAGS.steps, FLAGS.warmup)
  if jax.process_index() == 0:
    pathlib.Path(FLAGS.result).write_text(json.dumps(times))


def driver() -> dict:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  import provenance  # experiments/bench/ (the script's folder)

  from jaxhybrid.program import localcluster

  work = pathlib.Path(FLAGS.workdir)
  settings = {"off": (False,), "on": (True,), "both": (False, True)}[FLAGS.idle_spinners]
  rows = []
  for plan in FLAGS.plans:
    for pair in range(FLAGS.pairs):
      for spin in settings:
        result = work / "pair_times_result.json"
        result.unlink(missing_ok=True)
        argv = [__file__, "--role=time", f"--plan={plan}", f"--result={result}",
                *(f"--{n}={getattr(FLAGS, n)}" for n in ("workdir", "model", "size", "steps",
                                                         "warmup"))]
        localcluster.launch(argv, 2, timeout_s=1800, idle_spinners=spin)
        times = json.loads(result.read_text())
        rows.append({"plan": plan, "pair": pair, "idle_spinners": spin,
                     "median_s": statistics.median(times), "min_s": min(times), "times": times})
        print(f"{plan} pair {pair} spinners {spin}: median {rows[-1]['median_s']:.4f} s, "
              f"fastest {rows[-1]['min_s']:.4f} s", flush=True)
  summary = {}
  for plan in FLAGS.plans:
    for spin in settings:
      med = [r["median_s"] for r in rows if r["plan"] == plan and r["idle_spinners"] == spin]
      summary[f"{plan}{' spinners' if spin else ''}"] = {
        "medians_s": med, "spread": (max(med) - min(med)) / min(med)}
  return {"model": FLAGS.model, "size": FLAGS.size, "workdir": str(work), "steps": FLAGS.steps,
          "warmup": FLAGS.warmup, "rows": rows, "summary": summary,
          "program": provenance.program_commit()}


def main(argv):
  del argv
  if FLAGS.role == "time":
    from jaxhybrid.program import localcluster

    localcluster.worker_setup()
    return role_time()
  if not FLAGS.plans:
    raise app.UsageError("--plans: give the plan files (relative to --workdir) to time")
  out = driver()
  print(json.dumps(out["summary"], indent=1))
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  app.run(main)
