"""How steady the link calibration is, fitted two ways from the same timings.

bench_mp prices every message between its two pinned one-core processes by a latency and a
bandwidth fitted to timed ring ppermutes (bench_mp_calibration.py). This script measures that
calibration --calibrations times, each in a fresh pair of processes (as two bench_mp runs from
empty caches would), timing each size as bench_mp does (every factor of 4 from 1 KiB to 4 MiB,
the median of LINK_REPEATS runs), and fits every calibration two ways:

- `unweighted_4_sizes`: an unweighted least-squares line through 1 KiB, 64 KiB, 1 MiB and 4 MiB
  (bench_mp's fit before `calibrate.fit_link`);
- `relative_7_sizes`: `calibrate.fit_link`, each size weighted by 1 / t, all seven sizes.

Per fit it saves each calibration's latency and bandwidth, their spread (largest / smallest
over the calibrations) and the predicted time of a 256 KiB message (a micro-batch's activation
in the bench models) with its spread.

  python experiments/bench/bench_link_fit.py --out=experiments/results/bench_link_fit.json
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
# Worker processes pin their core before JAX starts.
if __name__ == "__main__" and "--role=measure" in sys.argv:
  from jaxhybrid.program import localcluster

  localcluster.worker_setup()

import bench_mp_calibration as calib  # experiments/bench/ (the script's folder)
import provenance
from absl import app, flags

_CALIBRATIONS = flags.DEFINE_integer("calibrations", 4, "Calibrations, each in fresh processes.")
_OUT = flags.DEFINE_string("out", "", "Write the JSON results here.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/jaxhybrid_bench_link_fit", "Scratch dir.")
_ROLE = flags.DEFINE_string("role", "driver", "Internal: driver | measure.")

OLD_SIZES = (2**10, 2**16, 2**20, 2**22)
PROBE_BYTES = 2**18


def role_measure(work: pathlib.Path) -> None:
  import jax

  from jaxhybrid.costs import calibrate
  from jaxhybrid.program import localcluster

  localcluster.worker_init()
  _, sizes, sent, times = calibrate.ring_times(
    jax.devices(), repeats=calib.LINK_REPEATS)
  if jax.process_index() == 0:
    (work / "times.json").write_text(json.dumps({"sizes": sizes, "sent": sent, "times": times}))


def fits(sizes: list[int], sent: list[float], times: list[float]) -> dict[str, dict]:
  import numpy as np

  from jaxhybrid.costs import calibrate

  old = [i for i, s in enumerate(sizes) if s in OLD_SIZES]
  slope, alpha = np.polyfit([sent[i] for i in old], [times[i] for i in old], 1)
  out = {"unweighted_4_sizes": (float(alpha), float(slope))}
  out["relative_7_sizes"] = calibrate.fit_link(sent, times)
  return {name: {"alpha_s": a, "bandwidth_bytes_s": 1.0 / s if s > 0 else None,
                 "probe_s": a + PROBE_BYTES * s} for name, (a, s) in out.items()}


def driver() -> dict:
  from jaxhybrid.program import localcluster

  work = pathlib.Path(_WORKDIR.value)
  work.mkdir(parents=True, exist_ok=True)
  runs = []
  for i in range(_CALIBRATIONS.value):
    localcluster.launch([__file__, "--role=measure", f"--workdir={work}"], 2, timeout_s=600)
    got = json.loads((work / "times.json").read_text())
    runs.append({**got, "fits": fits(got["sizes"], got["sent"], got["times"])})
    print(f"calibration {i}: " + "; ".join(
      f"{k} {v['alpha_s'] * 1e3:.3f} ms, {(v['bandwidth_bytes_s'] or 0) / 1e9:.2f} GB/s"
      for k, v in runs[-1]["fits"].items()), flush=True)
  summary = {}
  for name in runs[0]["fits"]:
    for field in ("alpha_s", "bandwidth_bytes_s", "probe_s"):
      vals = [r["fits"][name][field] for r in runs]
      ok = [v for v in vals if v is not None and v > 0]
      summary[f"{name}_{field}_spread"] = max(ok) / min(ok) if len(ok) == len(vals) else None
  return {"calibrations": runs, "summary": summary, "probe_bytes": PROBE_BYTES,
          "repeats": calib.LINK_REPEATS,
          "program": provenance.program_commit()}


def main(argv):
  del argv
  if _ROLE.value == "measure":
    return role_measure(pathlib.Path(_WORKDIR.value))
  result = driver()
  print(json.dumps(result["summary"], indent=1))
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
