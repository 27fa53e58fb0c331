r"""Which node profile prices a model's program: its one-device hybrid program timed against its
price at the back-to-back (warm) and the cache-flushed (cold) node times.

    python experiments/bench/bench_mp.py --workdir=/tmp/bmp --out=bench_mp.json
    python experiments/bench/blend_check.py --workdir=/tmp/bmp --bench=bench_mp.json \
        --models=chain,gnmt,biglstm,inception_v3 --out=blend_check.json

bench_mp picks warm or cold per model from the model's fused forward + backward (one compiled
function) against the warm node sum (`jaxhybrid.costs.cache_blend`). XLA fuses across nodes in
that step and not in the program, so the test can pick warm for a model whose program's tasks
run cold. Here, per model, in one pinned one-core process (`localcluster`), the hybrid program of
the one-device plan on a 1x1 mesh (the same tasks as the plans, one group) is timed and priced
with both profiles from bench_mp's workdir (its profile cache: nothing is profiled again) and its
calibration; `program_share` = (measured - warm price) / (cold price - warm price), clipped to
[0, 1]. Beside it, every candidate bench_mp timed on the unsplit graph is re-priced at that share
and at bench_mp's, against its measured step from --bench.
"""

from __future__ import annotations

import json
import pathlib
import sys

if __name__ == "__main__" and "--role=one" in sys.argv:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from jaxhybrid.program import localcluster

  localcluster.worker_setup()

from absl import app, flags

flags.DEFINE_string("workdir", "/tmp/jaxhybrid_bench_mp", "bench_mp's workdir (profiles, plans).")
flags.DEFINE_string("bench", "", "bench_mp's results JSON of that workdir's run.")
flags.DEFINE_list("models", ["chain", "gnmt", "biglstm", "inception_v3"], "Models to check.")
flags.DEFINE_string("size", "small", "Model size preset (as bench_mp's --size).")
flags.DEFINE_integer("steps", 10, "Timed steps (median) after 2 untimed.")
flags.DEFINE_string("out", "", "Write the JSON here.")
flags.DEFINE_string("role", "driver", "Internal: driver | one.")
flags.DEFINE_string("model", "", "Internal: the model of a `one` job.")
FLAGS = flags.FLAGS


def _spec(name: str, overrides: dict):
  if name == "chain":
    import chain_model  # experiments/bench/ (the script's folder)

    return chain_model.spec(**overrides)
  from jaxhybrid import models

  return models.get(name, FLAGS.size, **overrides)


def role_one(work: pathlib.Path, name: str) -> None:
  import time

  import jax
  import numpy as np
  import optax
  from flax import nnx

  from jaxhybrid import api, costs, planner
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import localcluster, lockstep

  localcluster.worker_init()
  single = json.loads((work / f"single_{name}.json").read_text())
  b, k, remat = single["batch"], single["microbatches"], single["branch_remat"]
  spec = _spec(name, single.get("model_overrides", {}))
  model = spec.make(nnx.Rngs(0))
  batch = spec.synthetic_batch(0, b)
  micro_spec, _ = api.microbatch_spec(batch, b, b // k)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn)
  g = graph_lib.trace_function(pure, p, s, micro_spec)
  cal = json.loads((work / "calibration.json").read_text())["values"]
  link = costs.Link(alpha_s=cal["link_alpha_s"], bandwidth_bytes_s=cal["link_bandwidth_bytes_s"],
                    source="bench_mp")
  pc = lockstep.PassCosts(
    update_s_per_byte=cal["update_s_per_byte"], add_s_per_byte=cal["add_s_per_byte"],
    fill_s_per_byte=cal["fill_s_per_byte"], group_s=cal.get("group_s", 0.0),
    task_fixed_s=cal.get("task_fixed_s", 0.0))
  kw = {"cache_dir": work / "profiles", "branch_remat": remat, "tasks": True, "link": link,
        "min_time_s": single.get("profile_min_time_s", 0.0)}
  flush = single.get("profile_flush_bytes", 0)
  blend = costs.cache_blended(g, flush_bytes=flush, **kw)
  blend.profile_all()
  one = planner.place(g, blend.warm, devices=1, microbatches=k, method="single")
  hy = api.parallelize(model, spec.loss_fn, optax.adam(1e-4), batch, mesh=mesh_lib.make("1x1"),
                       microbatches=k, plan=one, program_options={"branch_remat": remat,
                                                                  "schedule": "1f1b"})
  fn, state, shards = hy.program.step_fn(), hy.init(), hy.program.shard_batch(batch)
  for _ in range(2):
    state, m = fn(state, shards)
  jax.block_until_ready(state)
  times = []
  for _ in range(FLAGS.steps):
    t0 = time.perf_counter()
    state, m = fn(state, shards)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t0)
  measured = float(np.median(times))
  warm = lockstep.plan_step_s(g, one, blend.warm, pass_costs=pc, branch_remat=remat,
                              schedule="1f1b").step_s
  cold = lockstep.plan_step_s(g, one, blend.cold, pass_costs=pc, branch_remat=remat,
                              schedule="1f1b").step_s
  share = min(1.0, max(0.0, (measured - warm) / (cold - warm))) if cold != warm else None
  out = {"model": name, "program_1x1_step_s": measured, "warm_price_s": warm,
         "cold_price_s": cold, "program_share": share, "bench_share": blend.fit.cold_share,
         "candidates": []}
  if FLAGS.bench:
    rows = {r["model"]: r for r in json.loads(pathlib.Path(FLAGS.bench).read_text())}
    for c in rows.get(name, {}).get("candidates", []):
      plan = planner.Plan.load(work / f"{c['plan_id']}.json")
      if plan.shards or plan.batch_splits:
        continue  # priced on its split graph; not rebuilt here
      got = {"plan_id": c["plan_id"], "measured_step_s": c["measured_step_s"]}
      for label, sh in (("bench", blend.fit.cold_share), ("program", share)):
        if sh is None:
          continue
        cm = costs.cache_blended(g, flush_bytes=flush, cold_share=sh, **kw)
        t = lockstep.plan_step_s(g, plan, cm, pass_costs=pc, branch_remat=remat, schedule="1f1b")
        got[f"predicted_step_s_{label}_share"] = t.step_s
        got[f"error_{label}_share"] = t.step_s / c["measured_step_s"] - 1.0
      out["candidates"].append(got)
  if jax.process_index() == 0:
    (work / f"blend_check_{name}.json").write_text(json.dumps(out))


def main(argv):
  del argv
  work = pathlib.Path(FLAGS.workdir)
  if FLAGS.role == "one":
    return role_one(work, FLAGS.model)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from jaxhybrid.program import localcluster

  rows = []
  for name in FLAGS.models:
    argv = [__file__, "--role=one", f"--model={name}", f"--workdir={work}",
            f"--size={FLAGS.size}", f"--steps={FLAGS.steps}", f"--bench={FLAGS.bench}"]
    localcluster.launch(argv, 1, timeout_s=1800)
    rows.append(json.loads((work / f"blend_check_{name}.json").read_text()))
    print(json.dumps(rows[-1]))
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  app.run(main)
