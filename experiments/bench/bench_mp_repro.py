r"""How far two bench_mp runs' figures are apart: is the benchmark's claim reproducible?

    python experiments/bench/bench_mp.py --out=/tmp/first.json --calibration_cache=/tmp/fresh \
        --workdir=/tmp/work1   # measures the calibration
    python experiments/bench/bench_mp.py --out=/tmp/second.json --calibration_cache=/tmp/fresh \
        --workdir=/tmp/work2   # reads it; profiles and plans afresh
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
from bench_mp_errors import compare  # experiments/bench/ (the script's folder)

flags.DEFINE_string("first", None, "bench_mp results of the first run.")
flags.DEFINE_string("second", None, "bench_mp results of the second run.")
flags.DEFINE_string("out", "", "Write the comparison (JSON) here.")
FLAGS = flags.FLAGS

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
