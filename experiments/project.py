r"""Projects DP versus hybrid (DP x MP) time-to-accuracy at scale; finds the crossover N*.

  python experiments/project.py --scenario=paper                  # all three models, DGX-1 V100
  python experiments/project.py --model=inception_v3 --mp=2 --devices=8,16,32,64,128,256,512,1024
  python experiments/project.py --model=gnmt --plan=results/plan_gnmt.json --overlap=0.5
  python experiments/project.py --scenario=paper --s_mp=gnmt=1.15,biglstm=1.4 \
      --se_csv=biglstm=results/stat_eff/biglstm_tiny.csv

Per-model overrides take `value` (all models) or `model=value,...`. Prints a table per model, the
named assumptions, and our gains beside the paper's 26.5 % / 8 % / 22 %; writes projection.json
(per model: crossover_devices, gain_at_scale, s_mp, curves, assumptions) and projection.png.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from absl import app, flags

from jaxhybrid import projection
from jaxhybrid.costs import hardware
from jaxhybrid.projection import paper_scenario, stat_eff

_SCENARIO = flags.DEFINE_enum("scenario", None, ["paper"], "All three paper models.")
_MODEL = flags.DEFINE_enum("model", None, list(paper_scenario.PAPER_MODELS), "One model.")
_HARDWARE = flags.DEFINE_enum("hardware", "dgx1-v100", list(hardware.names()), "Node type.")
_MP = flags.DEFINE_integer("mp", 2, "M: devices per hybrid worker.")
_DEVICES = flags.DEFINE_list(
  "devices", [str(2**k) for k in range(1, 11)], "Device counts N (2 ... 1024 by default)."
)
_OVERLAP = flags.DEFINE_float("overlap", 0.0, "Fraction of the all-reduce hidden by backward.")
_LINK_EFF = flags.DEFINE_float("link_efficiency", 0.8, "Achieved fraction of NVLink bandwidth.")
_NIC_EFF = flags.DEFINE_float("nic_efficiency", 0.8, "Achieved fraction of NIC bandwidth.")
_ALGO = flags.DEFINE_enum("allreduce", "auto", ["auto", "ring", "hierarchical"], "Algorithm.")
_S_MP = flags.DEFINE_list("s_mp", [], "S_MP(M) override: value or model=value.")
_PLAN = flags.DEFINE_string("plan", None, "Plan JSON: S_MP = its predicted_speedup (one model).")
_BENCH = flags.DEFINE_string("planner_bench", None, "Planner bench JSON: S_MP per model and M.")
_B_NOISE = flags.DEFINE_list("b_noise", [], "Gradient noise scale override: value or model=value.")
_SE_CSV = flags.DEFINE_list("se_csv", [], "SE CSV (global_batch,steps|epochs): path or model=path.")
_STEP_MS = flags.DEFINE_list("step_time_ms", [], "T_comp(b) in ms: value or model=value.")
_GRAD_MB = flags.DEFINE_list("grad_mb", [], "Gradient MB per step: value or model=value.")
_BATCH = flags.DEFINE_list("batch", [], "Per-GPU batch b: value or model=value.")
_OUT = flags.DEFINE_string("out_dir", "results/project", "Output directory.")


def _per_model(entries: list[str], model: str) -> str | None:
  """The override for `model` from `value` or `model=value` entries (None if absent)."""
  found = None
  for entry in entries:
    name, sep, value = entry.partition("=")
    if not sep:
      found = entry
    elif name not in paper_scenario.PAPER_MODELS:
      raise ValueError(f"Override {entry!r}: unknown model {name!r}; use one of "
                       f"{', '.join(paper_scenario.PAPER_MODELS)}.")
    elif name == model:
      return value
  return found


def _number(entries: list[str], model: str) -> float | None:
  value = _per_model(entries, model)
  return None if value is None else float(value)


def _workload(name: str, hw: hardware.Hardware) -> projection.Workload:
  s_mp = _number(_S_MP.value, name)
  if _PLAN.value:
    s_mp = projection.s_mp_from_json(_PLAN.value)
  elif _BENCH.value and s_mp is None:
    s_mp = projection.s_mp_from_json(_BENCH.value, name, _MP.value)
  csv = _per_model(_SE_CSV.value, name)
  step_ms = _number(_STEP_MS.value, name)
  grad_mb = _number(_GRAD_MB.value, name)
  batch = _number(_BATCH.value, name)
  return paper_scenario.paper_workload(
    name,
    hw,
    s_mp_2=s_mp,
    b_noise=_number(_B_NOISE.value, name),
    step_time_s=None if step_ms is None else step_ms / 1e3,
    grad_bytes=None if grad_mb is None else grad_mb * 1e6,
    per_gpu_batch=None if batch is None else int(batch),
    se=stat_eff.se_from_csv(csv) if csv else None,
  )


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  if (_SCENARIO.value is None) == (_MODEL.value is None):
    raise app.UsageError("Give exactly one of --scenario=paper or --model=NAME.")
  if _PLAN.value and _SCENARIO.value:
    raise app.UsageError("--plan holds one model's plan; use it with --model (or --planner_bench).")
  if _MP.value != 2 and not (_S_MP.value or _PLAN.value or _BENCH.value):
    raise app.UsageError(
      f"--mp={_MP.value}: the defaults only know S_MP(2); pass --s_mp or --plan."
    )
  names = list(paper_scenario.PAPER_MODELS) if _SCENARIO.value else [_MODEL.value]
  hw = hardware.get(_HARDWARE.value)
  comm = projection.CommConfig(
    overlap=_OVERLAP.value,
    link_efficiency=_LINK_EFF.value,
    nic_efficiency=_NIC_EFF.value,
    algorithm=_ALGO.value,
  )
  devices = [int(n) for n in _DEVICES.value]
  results = []
  for name in names:
    w = _workload(name, hw)
    if _MP.value != 2:  # the workload's S_MP was given for this M
      w = dataclasses.replace(w, s_mp=((_MP.value, w.speedup_mp(2)),))
    results.append(projection.project(w, hw, comm, devices, m=_MP.value))

  for p in results:
    print(projection.format_table(p))
    print("assumptions:")
    for key, value in p.assumptions:
      print(f"  {key}: {value}")
    print()
  print(f"{'model':<14} {'N*':>6} {'our gain':>9} {'paper':>7}   (hybrid over best DP, at scale)")
  for p in results:
    paper = paper_scenario.PAPER_GAINS.get(p.model)
    print(
      f"{p.model:<14} {str(p.crossover_devices):>6} {p.gain_at_scale * 100:>8.1f}% "
      f"{'' if paper is None else f'{paper * 100:>6.1f}%'}"
    )

  os.makedirs(_OUT.value, exist_ok=True)
  out = {
    "hardware": hw.name,
    "comm": dataclasses.asdict(comm),
    "paper_gains": paper_scenario.PAPER_GAINS,
    "models": {p.model: p.to_json() for p in results},
  }
  json_path = os.path.join(_OUT.value, "projection.json")
  with open(json_path, "w") as f:
    json.dump(out, f, indent=2)
  png_path = os.path.join(_OUT.value, "projection.png")
  projection.plot(results, png_path)
  logging.info("wrote %s and %s", json_path, png_path)


if __name__ == "__main__":
  app.run(main)
