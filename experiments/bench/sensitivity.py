r"""How much each assumption moves the paper scenario's hybrid gain: B_noise, overlap and S_MP.

  python experiments/project.py --scenario=paper --out_dir=results/projection_ours   # first
  python experiments/bench/sensitivity.py --from_projection=results/projection_ours/projection.json

Per paper model (DGX-1 V100, M=2, N = 2 ... 1024), the gain at scale (best hybrid / best DP - 1)
and the crossover with our planner's S_MP (read from the projection.json that project.py saved,
or searched again with the heuristics when --from_projection is not given), then with one input
changed at a time: B_noise x 1/4, 1/2, 2, 4; overlap 0.5 and 1; S_MP x 0.9, 1.1 and the paper's
figure. Prints a table and writes experiments/results/sensitivity.json.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from jaxhybrid import advisor, projection
from jaxhybrid.costs import hardware
from jaxhybrid.projection import paper_scenario

_FROM = flags.DEFINE_string("from_projection", None, "projection.json with s_mp_search per model.")
_OUT = flags.DEFINE_string("out", "experiments/results/sensitivity.json", "Output JSON.")
DEVICES = [2**k for k in range(1, 11)]


def _gain(name, hw, estimates, *, b_noise=None, overlap=0.0, s_mp_scale=1.0):
  est = [projection.SMPEstimate(m=e.m, s_mp=e.s_mp * s_mp_scale, source=e.source
                                + ("" if s_mp_scale == 1 else f" (x{s_mp_scale:g}, sensitivity)"))
         for e in estimates]
  w = paper_scenario.paper_workload(name, hw, s_mp=est, b_noise=b_noise)
  p = projection.project(w, hw, projection.CommConfig(overlap=overlap), DEVICES, m=2)
  return {"gain": p.gain_at_scale, "crossover": p.crossover_devices, "s_mp": p.s_mp}


def main(argv):
  del argv
  hw = hardware.get("dgx1-v100")
  saved = None
  if _FROM.value:
    with open(_FROM.value) as f:
      saved = json.load(f)["models"]
  out = {}
  for name, pm in paper_scenario.PAPER_MODELS.items():
    if saved:
      found = advisor.SMPSearch.from_json(saved[name]["s_mp_search"])
    else:
      cfg = advisor.SearchConfig(planners=advisor.planned.HEURISTICS)
      found = advisor.planned_s_mp(name, per_worker_batch=pm.per_gpu_batch, hardware=hw.name,
                                   config=cfg)
    ours = [e for e in found.estimates() if e.m == 2]
    rows = {"ours": _gain(name, hw, ours)}
    for f in (0.25, 0.5, 2.0, 4.0):
      rows[f"b_noise x{f:g}"] = _gain(name, hw, ours, b_noise=pm.b_noise * f)
    for o in (0.5, 1.0):
      rows[f"overlap {o:g}"] = _gain(name, hw, ours, overlap=o)
    for f in (0.9, 1.1):
      rows[f"s_mp x{f:g}"] = _gain(name, hw, ours, s_mp_scale=f)
    rows["s_mp paper"] = _gain(name, hw, [paper_scenario.paper_s_mp(name)])
    base = rows["ours"]["gain"]
    out[name] = {"paper_gain": paper_scenario.PAPER_GAINS[name], "b_noise": pm.b_noise,
                 "s_mp_source": ours[0].source, "rows": rows,
                 "largest_move": max((k for k in rows if k != "ours"),
                                     key=lambda k: abs(rows[k]["gain"] - base))}
  print(f"{'model':<13} {'case':<14} {'S_MP':>6} {'gain':>7} {'N*':>6}")
  for name, d in out.items():
    for case, r in d["rows"].items():
      print(f"{name:<13} {case:<14} {r['s_mp']:>6.3f} {r['gain'] * 100:>6.1f}% "
            f"{str(r['crossover']):>6}")
    print(f"{name:<13} paper's gain {d['paper_gain'] * 100:.1f}%; "
          f"largest move: {d['largest_move']}")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
