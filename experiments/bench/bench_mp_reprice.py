r"""How well each cache-share rule prices a bench_mp run's timed plans: the run's candidates
re-priced from its own cached node profiles, beside the steps the run measured.

    python experiments/bench/bench_mp.py --out=/tmp/run.json --workdir=/tmp/bmp
    python experiments/bench/bench_mp_reprice.py --workdir=/tmp/bmp --results=/tmp/run.json \
        --out=experiments/results/bench_mp_reprice.json

bench_mp profiles every node back to back (warm) and after a cache-sized write (cold), and the
run's plans are priced at one share between the two (`jaxhybrid.costs.cache_blend`). Which share
prices a two-device program best is a measured question; this answers it for a finished run
without timing anything again: each timed candidate's plan is priced in lock step
(`lockstep.plan_step_s`, the run's calibrated passes and link) at every rule's share, and its
error against the run's measured step is reported. Rules: 'warm' (0), 'cold' (1), 'whole_test'
(the whole-step test, `cache_blend.fit_cold_share`, from the run's recorded sums) and, if the run
fitted one, 'run' (the share the run priced with). Per model and rule: the share, each
candidate's (predicted_step_s, measured_step_s, error) and `step_error_mean` (mean |error|);
`overall` the mean over every candidate of every model, per rule. A profile that is not in the
workdir's cache is an error (no node is timed again). The dispatch time every cost model takes
off its profiles is read from the same cache where the run stored it; runs made before it was
cached have none, and this process measures its own, which moves a price by under 1 % (the
chain's plans re-priced warm came out 0.3-0.6 % from the run's own warm prices). With --append,
the rows are added to --out's runs (one entry per bench_mp run, keyed by --run_name or else its
program commit).
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app, flags

import bench_mp_calibration as calib  # experiments/bench/ (the script's folder)
from bench_mp_flags import batch_k, model, profile_flush_bytes  # and bench_mp's flags

flags.DEFINE_string("results", None, "bench_mp results of the run (its --out).")
flags.DEFINE_boolean("append", False, "Keep --out's other runs, replacing this run's entry.")
flags.DEFINE_string("run_name", "", "The run's key in --out (default: its program commit); name "
                    "two runs of one commit apart, e.g. <commit>-first and <commit>-second.")
FLAGS = flags.FLAGS


def reprice_row(work: pathlib.Path, row: dict) -> dict:
  from jaxhybrid import api, costs, planner
  from jaxhybrid import graph as graph_lib
  from jaxhybrid.costs import cache_blend
  from jaxhybrid.graph import shard as shard_lib
  from jaxhybrid.program import lockstep

  spec, m = model(row["model"])
  b, k = batch_k(row["model"])
  batch = spec.synthetic_batch(0, b)
  micro_spec, _ = api.microbatch_spec(batch, b, b // k)
  _, p, s, pure = graph_lib.nnx_pure_loss(m, spec.loss_fn)
  g = graph_lib.trace_function(pure, p, s, micro_spec)
  graphs = {False: g, True: shard_lib.shard_leaves(g, 2)[0]}
  fit = row["profile"]["cache_blend"]
  if not fit:
    raise ValueError(f"{row['model']}: the run recorded no cache blend (--profile_cache_blend "
                     "off): it profiled one way only, there is nothing to re-price")
  rules = {"warm": 0.0, "cold": 1.0,
           "whole_test": cache_blend.fit_cold_share(fit["warm_sum_s"], fit["whole_s"])}
  if fit.get("anchor", "whole") != "whole":
    rules["run"] = fit["cold_share"]
  link, passes = calib.link(work), calib.pass_costs(work)
  out = {}
  for rule, share in rules.items():
    cands = []
    for c in row["candidates"]:
      gc = graphs[bool(c["sharded"])]
      cm = costs.cache_blended(
        gc, flush_bytes=profile_flush_bytes(), cache_dir=work / "profiles", link=link,
        warmup_s=FLAGS.profile_warmup_s, min_time_s=FLAGS.profile_min_time_s,
        branch_remat=FLAGS.branch_remat, tasks=FLAGS.task_profiles, cold_share=share)
      plan = planner.Plan.load(work / f"{c['plan_id']}.json")
      t = lockstep.plan_step_s(gc, plan, cm, pass_costs=passes,
                               branch_remat=FLAGS.branch_remat, schedule=row.get("schedule")).step_s
      if cm.measured:
        raise RuntimeError(f"{c['plan_id']}: a profile was not in {work / 'profiles'}; give the "
                           "run's own --workdir")
      meas = c["measured_step_s"]
      cands.append({"plan_id": c["plan_id"], "predicted_step_s": t, "measured_step_s": meas,
                    "error": (t - meas) / meas})
    out[rule] = {"share": share, "candidates": cands,
                 "step_error_mean": sum(abs(x["error"]) for x in cands) / len(cands)}
  return out


def main(argv):
  del argv
  work = pathlib.Path(FLAGS.workdir)
  rows = [r for r in json.loads(pathlib.Path(FLAGS.results).read_text()) if "candidates" in r]
  per_model = {r["model"]: reprice_row(work, r) for r in rows}
  rules = sorted({rule for v in per_model.values() for rule in v})
  overall = {}
  for rule in rules:
    errs = [abs(c["error"]) for v in per_model.values() if rule in v for c in v[rule]["candidates"]]
    overall[rule] = sum(errs) / len(errs)
  program = {r.get("program") for r in rows}
  entry = {"program": sorted(x for x in program if x), "results": FLAGS.results,
           "models": per_model, "overall_step_error_mean": overall}
  for name, v in per_model.items():
    print(name, " ".join(f"{rule} {x['share']:.2f}: {100 * x['step_error_mean']:.1f} %"
                         for rule, x in v.items()))
  print("overall", " ".join(f"{rule}: {100 * e:.1f} %" for rule, e in overall.items()))
  if FLAGS.out:
    path = pathlib.Path(FLAGS.out)
    runs = json.loads(path.read_text())["runs"] if FLAGS.append and path.exists() else {}
    runs[FLAGS.run_name or ",".join(entry["program"]) or "unknown"] = entry
    path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  app.run(main)
