r"""How far two bench_mp runs' figures are apart: is the benchmark's claim reproducible?

    python experiments/bench/bench_mp.py --out=/tmp/first.json --calibration_cache=/tmp/fresh  # measures it
    python experiments/bench/bench_mp.py --out=/tmp/second.json --calibration_cache=/tmp/fresh # reads it
    python experiments/bench/bench_mp_repro.py --first=/tmp/first.json --second=/tmp/second.json \
        --out=experiments/results/bench_mp_repro.json

Per model measured in both runs and per figure in FIGURES: both values and their relative
difference, (second - first) / first; per model and overall the largest |difference|
(`max_abs_difference`); beside them each run's mean step error and the chosen plan's number of
lock-step groups (a different number: the two runs' profiles led to different plans). Each run's calibration source ('measured' or 'cache') is recorded, so the
file shows whether the first run started from an empty cache.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

flags.DEFINE_string("first", None, "bench_mp results of the first run.")
flags.DEFINE_string("second", None, "bench_mp results of the second run.")
flags.DEFINE_string("out", "", "Write the comparison (JSON) here.")
FLAGS = flags.FLAGS

# The figures compared: the speedups, the baseline ratios and the chosen plan's step (ratios and
# times; an error is compared by its two values, not by a relative difference of errors).
FIGURES = ("measured_speedup", "measured_speedup_same_rounds", "step_s_plan", "ratio_vs_fsdp",
           "ratio_vs_dp_bucketed", "ratio_vs_gspmd_tp")


def compare(first: list[dict], second: list[dict]) -> dict:
  """The comparison of two bench_mp result lists (rows without a figure are skipped for it)."""
  a = {r["model"]: r for r in first if "skipped" not in r}
  b = {r["model"]: r for r in second if "skipped" not in r}
  models = {}
  for m in [m for m in a if m in b]:
    figs = {}
    for f in FIGURES:
      x, y = a[m].get(f), b[m].get(f)
      if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x:
        figs[f] = {"first": x, "second": y, "difference": (y - x) / x}
    models[m] = {
      "figures": figs,
      "step_error_mean": [r[m].get("step_error_mean") for r in (a, b)],
      "chosen_plan_groups": [r[m]["candidates"][r[m]["chosen_candidate"]].get("groups")
                             if "candidates" in r[m] else None for r in (a, b)],
      "calibration": [r[m].get("calibration", {}).get("source") for r in (a, b)],
      "max_abs_difference": max((abs(v["difference"]) for v in figs.values()), default=None),
    }
  worst = [v["max_abs_difference"] for v in models.values() if v["max_abs_difference"] is not None]
  return {"models": models, "max_abs_difference": max(worst, default=None)}


def main(argv):
  del argv
  with open(FLAGS.first) as f, open(FLAGS.second) as g:
    out = compare(json.load(f), json.load(g))
  out.update(first=FLAGS.first, second=FLAGS.second)
  for m, v in out["models"].items():
    diffs = " ".join(f"{k}={d['difference']:+.1%}" for k, d in v["figures"].items())
    print(f"{m:>14} (calibration {v['calibration'][0]} then {v['calibration'][1]}): {diffs}")
  print(f"largest |difference|: {out['max_abs_difference']}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {FLAGS.out}")
  return 0


if __name__ == "__main__":
  flags.mark_flags_as_required(["first", "second"])
  sys.exit(app.run(main))
