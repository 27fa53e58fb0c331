r"""Projects DP versus hybrid (DP x MP) time-to-accuracy at scale; finds the crossover N*.

  python experiments/project.py --scenario=paper                  # all three models, DGX-1 V100
  python experiments/project.py --scenario=paper --s_mp_source=paper   # the paper's S_MP figures
  python experiments/project.py --model=biglstm --b_noise=measured:runs/x/metrics.jsonl
  python experiments/project.py --model=inception_v3 --mp=2 --devices=8,16,32,64,128,256,512,1024
  python experiments/project.py --model=gnmt --plan=results/plan_gnmt.json --overlap=0.5
  python experiments/project.py --scenario=paper --s_mp=gnmt=1.15,biglstm=1.4 \
      --se_csv=biglstm=results/stat_eff/biglstm_tiny.csv

S_MP comes from our own planner by default: each model is traced at paper size, planned for every
(M, k, planner) of --search_* and priced as the program runs (jaxhybrid.advisor.planned); the
best plan per M gives S_MP, and its source is printed and saved. `--s_mp_source=paper` uses the
paper's figures instead (labelled so); --s_mp / --plan / --planner_bench give S_MP by hand.
`--b_noise=measured:<metrics.jsonl>` takes the noise scale a run measured (--b_noise_mode:
'trajectory' integrates it over the run, 'mean' uses one constant); --se_csv still overrides.

Per-model overrides take `value` (all models) or `model=value,...`. Prints a table per model, the
named assumptions, and our gains beside the paper's 26.5 % / 8 % / 22 %; writes projection.json
(per model: crossover_devices, gain_at_scale, s_mp, s_mp_source, s_mp_plan, curves, assumptions)
and projection.png.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from absl import app, flags

from jaxhybrid import advisor, projection
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
_B_NOISE = flags.DEFINE_list(
  "b_noise", [], "Gradient noise scale: value, measured:<metrics.jsonl>, or model=either.")
_B_NOISE_MODE = flags.DEFINE_enum(
  "b_noise_mode", "trajectory", list(projection.measured_noise.MODES),
  "Measured noise scale: integrate the run, or its mean.")
_S_MP_SOURCE = flags.DEFINE_enum("s_mp_source", "planner", ["planner", "paper"],
                                 "S_MP from our planner (default) or the paper's figures.")
_SEARCH_DEVICES = flags.DEFINE_list("search_devices", ["2", "4", "8"], "M values planned.")
_SEARCH_K = flags.DEFINE_list("search_microbatches", ["1", "2", "4", "8"], "k values planned.")
_SEARCH_PLANNERS = flags.DEFINE_list("search_planners", ["dp", "interleaved", "etf", "milp"],
                                     "Planners tried per (M, k).")
_SEARCH_TIME = flags.DEFINE_float("search_time_limit", 5.0, "Seconds per MILP plan.")
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


def _search_config() -> advisor.SearchConfig:
  devices = sorted({int(v) for v in _SEARCH_DEVICES.value} | {_MP.value} - {1})
  return advisor.SearchConfig(
    devices=tuple(devices), microbatches=tuple(int(v) for v in _SEARCH_K.value),
    planners=tuple(_SEARCH_PLANNERS.value), time_limit_s=_SEARCH_TIME.value,
  )


def _s_mp(name: str, hw: hardware.Hardware) -> tuple[list[projection.SMPEstimate], dict | None]:
  """S_MP estimates for `name` (with sources) and the planner search behind them (or None)."""
  given = _number(_S_MP.value, name)
  if _PLAN.value:
    given = projection.s_mp_from_json(_PLAN.value)
  elif _BENCH.value and given is None:
    given = projection.s_mp_from_json(_BENCH.value, name, _MP.value)
  if given is not None:
    return [projection.user_s_mp(_MP.value, given, "--s_mp / --plan / --planner_bench")], None
  if _S_MP_SOURCE.value == "paper":
    if _MP.value != 2:
      raise app.UsageError(f"--mp={_MP.value}: the paper gives S_MP(2) only; use --mp=2.")
    return [paper_scenario.paper_s_mp(name)], None
  pm = paper_scenario.PAPER_MODELS[name]
  batch = _number(_BATCH.value, name)
  found = advisor.planned_s_mp(name, size="paper", per_worker_batch=int(batch or pm.per_gpu_batch),
                               hardware=hw.name, config=_search_config())
  return list(found.estimates()), found.to_json()


def _se(name: str) -> tuple[stat_eff.SECurve | None, float | None, dict | None]:
  """(SE curve, constant B_noise, measured summary) from --se_csv / --b_noise."""
  csv = _per_model(_SE_CSV.value, name)
  if csv:
    return stat_eff.se_from_csv(csv), None, None
  value = _per_model(_B_NOISE.value, name)
  if value is None:
    return None, None, None
  if value.startswith("measured:"):
    measured = projection.read_noise_scale(value.partition(":")[2])
    return (projection.se_from_noise_scale(measured, _B_NOISE_MODE.value), None,
            {**measured.summary(), "mode": _B_NOISE_MODE.value, "source": measured.source})
  return None, float(value), None


def _workload(name: str, hw: hardware.Hardware) -> tuple[projection.Workload, dict]:
  estimates, search = _s_mp(name, hw)
  se, b_noise, measured = _se(name)
  step_ms = _number(_STEP_MS.value, name)
  grad_mb = _number(_GRAD_MB.value, name)
  batch = _number(_BATCH.value, name)
  w = paper_scenario.paper_workload(
    name,
    hw,
    s_mp=estimates,
    b_noise=b_noise,
    step_time_s=None if step_ms is None else step_ms / 1e3,
    grad_bytes=None if grad_mb is None else grad_mb * 1e6,
    per_gpu_batch=None if batch is None else int(batch),
    se=se,
  )
  extra = {"s_mp_plan": {str(e.m): e.to_json() for e in estimates}, "s_mp_search": search,
           "measured_noise_scale": measured}
  return w, extra


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  if (_SCENARIO.value is None) == (_MODEL.value is None):
    raise app.UsageError("Give exactly one of --scenario=paper or --model=NAME.")
  if _PLAN.value and _SCENARIO.value:
    raise app.UsageError("--plan holds one model's plan; use it with --model (or --planner_bench).")
  names = list(paper_scenario.PAPER_MODELS) if _SCENARIO.value else [_MODEL.value]
  hw = hardware.get(_HARDWARE.value)
  comm = projection.CommConfig(
    overlap=_OVERLAP.value,
    link_efficiency=_LINK_EFF.value,
    nic_efficiency=_NIC_EFF.value,
    algorithm=_ALGO.value,
  )
  devices = [int(n) for n in _DEVICES.value]
  results, extras = [], {}
  for name in names:
    w, extras[name] = _workload(name, hw)
    results.append(projection.project(w, hw, comm, devices, m=_MP.value))

  for p in results:
    print(projection.format_table(p))
    print(f"S_MP({p.m}) = {p.s_mp:.3f} from {p.s_mp_source}")
    print("assumptions:")
    for key, value in p.assumptions:
      print(f"  {key}: {value}")
    print()
  source = "user" if (_S_MP.value or _PLAN.value or _BENCH.value) else _S_MP_SOURCE.value
  print(f"{'model':<14} {'S_MP':>6} {'N*':>6} {'our gain':>9} {'paper':>7}   (hybrid over best "
        f"DP, at scale; S_MP from {source})")
  for p in results:
    paper = paper_scenario.PAPER_GAINS.get(p.model)
    print(
      f"{p.model:<14} {p.s_mp:>6.3f} {str(p.crossover_devices):>6} {p.gain_at_scale * 100:>8.1f}% "
      f"{'' if paper is None else f'{paper * 100:>6.1f}%'}"
    )

  os.makedirs(_OUT.value, exist_ok=True)
  out = {
    "hardware": hw.name,
    "comm": dataclasses.asdict(comm),
    "paper_gains": paper_scenario.PAPER_GAINS,
    "s_mp_source_flag": _S_MP_SOURCE.value,
    "models": {p.model: {**p.to_json(), **extras[p.model]} for p in results},
  }
  json_path = os.path.join(_OUT.value, "projection.json")
  with open(json_path, "w") as f:
    json.dump(out, f, indent=2)
  png_path = os.path.join(_OUT.value, "projection.png")
  projection.plot(results, png_path)
  logging.info("wrote %s and %s", json_path, png_path)


if __name__ == "__main__":
  app.run(main)
