"""Renders the figure tables of README.md and docs/benchmarks.md from experiments/results/*.json.

  python experiments/bench/docs_figures.py           # rewrite the tables in place
  python experiments/bench/docs_figures.py --check   # exit 1 if a table differs from its results file

Each table sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` and is generated
here, so that a figure in the docs cannot drift from the file it names (tests/docs_figures_test.py
runs the check).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "experiments", "results")
DOCS = ("README.md", os.path.join("docs", "benchmarks.md"), os.path.join("docs", "paper.md"))


def _load(name: str):
  with open(os.path.join(RESULTS, name)) as f:
    return json.load(f)


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f} %"


def _x(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.2f}x"


def _per_row(name: str, columns: list[tuple[str, Any]], keep=lambda r: True) -> str:
  """A table with one row per entry of results file `name` that `keep` accepts: (header,
  entry -> cell) columns."""
  rows = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
  rows += ["| " + " | ".join(str(cell(r)) for _, cell in columns) + " |"
           for r in _load(name) if keep(r)]
  return "\n".join(rows) + f"\n\nSource: `experiments/results/{name}`."


_SETUP = [("model", lambda r: r["model"]), ("M", lambda r: r["devices"]),
          ("k", lambda r: r["microbatches"])]


def bench_mp(name: str = "bench_mp.json") -> str:
  """Measured 2-way speedup on two pinned one-core processes, per model, and how well every timed
  candidate's step was predicted (bench_mp_errors.py defines each field)."""
  return _per_row(name, [
    ("model", lambda r: r["model"]),
    ("one device (s)", lambda r: f"{r['one_device']['measured_step_s']:.3f}"),
    ("plan speedup", lambda r: _x(r.get("measured_speedup"))),
    ("both cores busy", lambda r: _x(r.get("measured_speedup_both_busy"))),
    ("vs DP bucketed", lambda r: _x(r.get("ratio_vs_dp_bucketed"))),
    ("vs GSPMD TP", lambda r: _x(r.get("ratio_vs_gspmd_tp"))),
    ("vs FSDP", lambda r: _x(r.get("ratio_vs_fsdp"))),
    ("vs FSDP, one buffer", lambda r: _x(r.get("ratio_vs_fsdp_bucketed"))),
    ("candidates", lambda r: len(r["candidates"])),
    ("step error mean / max", lambda r: f"{_pct(r['step_error_mean'])} / {_pct(r['step_error_max'])}"),
    ("rank corr.", lambda r: "n/a" if r.get("rank_correlation") is None
     else f"{r['rank_correlation']:.2f}"),
    ("one-device error", lambda r: _pct(r["one_device"]["error"])),
    ("2x1 step, ZeRO 1 over 0", lambda r: _x(r.get("zero1_step_ratio_2x1"))),
    ("2x1 step, ZeRO 2 over 0", lambda r: _x(r.get("zero2_step_ratio_2x1"))),
    ("calibration", lambda r: r.get("calibration", {}).get("source", "-")),
    ("program", lambda r: r.get("program") or "earlier run"),
  ], keep=lambda r: "one_device" in r)  # skipped models have no figures


def bench_memory() -> str:
  """Per-device compiled memory against FSDP and one device, and the k-growth ratios."""
  s = _load("bench_memory.json")["summary"]
  keys = [k for k in sorted(s) if k.endswith("_over_fsdp") or k.endswith("_over_1x1")
          or "k16_over_k4" in k or k.endswith("_zero2_over_zero0")]
  rows = ["| figure | value |", "|---|---|"]
  rows += [f"| `{k}` | {s[k]:.3f} |" for k in keys]
  if "prediction_error_max" in s:
    rows.append(f"| `prediction_error_max` (predicted vs compiled) | {_pct(s['prediction_error_max'])} |")
  if "planner_device_error_max" in s:
    rows.append("| `planner_device_error_max` (the planner's per-device figure vs compiled) | "
                f"{_pct(s['planner_device_error_max'])} |")
  return "\n".join(rows) + "\n\nSource: `experiments/results/bench_memory.json` (`summary`)."


def bench_planner_fbw() -> str:
  """Lock-step price, bound gap and solve time of the planner on the paper-size problems."""
  return _per_row("bench_planner_fbw.json", _SETUP + [
    ("lock-step step (ms)", lambda r: f"{1e3 * r['lockstep_step_s']:.0f}"),
    ("gap", lambda r: _pct(r["gap"])), ("solve (s)", lambda r: f"{r['solve_time_s']:.1f}"),
    ("speedup vs one device", lambda r: _x(r.get("lockstep_speedup"))),
  ])


def bench_planner() -> str:
  """DLPlacer's asynchronous objective on the paper-size problems."""
  return _per_row("bench_planner.json", _SETUP + [
    ("predicted speedup", lambda r: _x(r["predicted_speedup"])),
    ("gap", lambda r: _pct(r["gap"])), ("solve (s)", lambda r: f"{r['solve_time_s']:.1f}"),
    ("found by", lambda r: r.get("found_by", "")),
  ])


# The command that writes each results file the headline table quotes (docs/benchmarks.md has
# the full commands and what each measures).
COMMANDS = {
  "bench_mp.json": "bench_mp.py",
  # The memory figures were measured with slot rows from 64 KiB (jaxhybrid.program.structure).
  "bench_memory.json": "bench_memory.py --slot_min_bytes=65536",
  "bench_planner_fbw.json": "bench_planner.py --fbw",
}


def _source(name: str) -> str:
  return (f"[`{name}`](experiments/results/{name}) | "
          f"`python experiments/bench/{COMMANDS[name]} --out=experiments/results/{name}`")


def headline() -> str:
  """The README's table: one figure per benchmark, its results file and the command."""
  mp = {r["model"]: r for r in _load("bench_mp.json") if "one_device" in r}
  mem = _load("bench_memory.json")["summary"]
  fbw = _load("bench_planner_fbw.json")
  rows = ["| what | figure | file | command |", "|---|---|---|---|"]
  for m in ("inception_v3", "gnmt", "biglstm"):
    if m in mp:
      rows.append(f"| 2-way MP speedup over one device with both cores busy, {m} small "
                  f"(2 pinned CPU cores) | {_x(mp[m]['measured_speedup_both_busy'])} | "
                  f"{_source('bench_mp.json')} |")
  for m in ("inception_v3", "gnmt", "biglstm"):
    if m in mp:
      rows.append(f"| predicted vs measured step, mean over the {len(mp[m]['candidates'])} plans "
                  f"timed, {m} small | {_pct(mp[m]['step_error_mean'])} | "
                  f"{_source('bench_mp.json')} |")
  for m in ("inception_v3", "gnmt", "biglstm"):
    if mp.get(m, {}).get("ratio_vs_fsdp"):
      rows.append(f"| 2-way plan's speed over FSDP with `NamedSharding` (XLA's collectives per "
                  f"leaf) on the same 2 cores, {m} small | "
                  f"{_x(mp[m]['ratio_vs_fsdp'])} | {_source('bench_mp.json')} |")
  for m in ("inception_v3", "gnmt", "biglstm"):
    if mp.get(m, {}).get("ratio_vs_fsdp_bucketed"):
      rows.append(f"| 2-way plan's speed over FSDP with every parameter in one buffer (one "
                  f"all-gather, one reduce-scatter per step) on the same 2 cores, {m} small | "
                  f"{_x(mp[m]['ratio_vs_fsdp_bucketed'])} | {_source('bench_mp.json')} |")
  for z in (1, 2):
    ratios = [mp[m][f"zero{z}_step_ratio_2x1"] for m in sorted(mp)
              if mp[m].get(f"zero{z}_step_ratio_2x1")]
    if ratios:
      rows.append(f"| data-parallel 2x1 step with ZeRO stage {z} (`--zero={z}`) over without, "
                  f"largest over the {len(ratios)} bench models (2 pinned CPU cores) | "
                  f"{max(ratios):.2f} | {_source('bench_mp.json')} |")
  for key, what in (("chain_1x8_over_1x1", "uniform chain, memory per device 1x8 over 1x1"),
                    ("biglstm:paper@planner_1x8_over_fsdp",
                     "paper BigLSTM 1x8, the plan `parallelize` makes under the 16 GiB cap, "
                     "memory over FSDP's"),
                    ("biglstm:paper@planner_cap5GiB_batch_split_1x8_over_fsdp",
                     "paper BigLSTM 1x8 under a 5 GiB cap with `--batch_split "
                     "--batch_split_params=split` (2 micro-batches), memory over FSDP's"),
                    ("chain_1x4_1f1b_temp_k16_over_k4_fixed_microbatch",
                     "1F1B temp k=16 over k=4 at a fixed micro-batch (chain 1x4)"),
                    ("biglstm:paper_16x2_zero1_over_zero0",
                     "paper BigLSTM 16x2, memory with the optimizer state sharded over the data "
                     "axis (`--zero=1`) over without"),
                    ("biglstm:paper_16x2_zero2_over_zero0",
                     "paper BigLSTM 16x2, memory with the optimizer state and gradients sharded "
                     "over the data axis (`--zero=2`) over without")):
    if key in mem:
      rows.append(f"| {what} | {mem[key]:.2f} | {_source('bench_memory.json')} |")
  if "prediction_error_max" in mem:
    rows.append(f"| memory predicted vs compiled, worst row | {_pct(mem['prediction_error_max'])} "
                f"| {_source('bench_memory.json')} |")
  if "planner_device_error_max" in mem:
    rows.append("| the planner's per-device memory vs compiled, worst device of the planned rows | "
                f"{_pct(mem['planner_device_error_max'])} | {_source('bench_memory.json')} |")
  gaps = sorted(r["gap"] for r in fbw)
  rows.append(f"| planner gap to its bound, paper sizes, median of {len(gaps)} cases | "
              f"{_pct(gaps[len(gaps) // 2])} | {_source('bench_planner_fbw.json')} |")
  return "\n".join(rows)


def paper() -> str:
  """Our projection (S_MP from our own plans) beside the paper's end-to-end gains."""
  d = _load(os.path.join("projection_ours", "projection.json"))
  rows = ["| model | our S_MP(2) (lock-step price of our plan) | our crossover N* | our gain at scale "
          "| paper's gain (from the paper) |", "|---|---|---|---|---|"]
  for m, v in d["models"].items():
    rows.append(f"| {m} | {v['s_mp']:.3f} | {v['crossover_devices']} | {_pct(v['gain_at_scale'])} | "
                f"{_pct(d['paper_gains'][m])} |")
  return "\n".join(rows) + "\n\nSource: `experiments/results/projection_ours/projection.json`."


def dry_run() -> str:
  """Paper BigLSTM on two 16 GiB devices: `run.py --dry_run`'s totals, default and auto schedule."""
  rows = ["| schedule | predicted (GiB) | compiled (GiB) | predicted vs compiled | verdict | file |",
          "|---|---|---|---|---|---|"]
  for schedule, name in (("1f1b", "biglstm_paper_1x2_dry_run.txt"),
                         ("auto", "biglstm_paper_1x2_dry_run_auto.txt")):
    with open(os.path.join(RESULTS, name)) as f:
      lines = [ln.strip() for ln in f]
    value = {ln.rsplit(None, 1)[0]: ln.rsplit(None, 1)[1] for ln in lines
             if ln.startswith(("predicted total", "compiled total", "predicted vs compiled"))}
    verdict = next(ln for ln in lines if ln.startswith(("fits", "does not fit")))
    rows.append(f"| {schedule} | {value['predicted total']} | {value['compiled total']} | "
                f"{value['predicted vs compiled']} | {verdict} | `{name}` |")
  return "\n".join(rows)


TABLES = {"paper": paper, "headline": headline, "bench_mp": bench_mp,
          "bench_memory": bench_memory, "bench_planner": bench_planner,
          "bench_planner_fbw": bench_planner_fbw, "dry_run": dry_run}


# A figure quoted in prose names its source right after it, e.g. `predicted 1.28x<!-- value:
# bench_planner.json model=inception_v3&devices=2&microbatches=1.predicted_speedup -->` (on one
# line). The path's parts are dict keys, list indices, or `key=value&...` picking the one list item
# that matches.
INLINE = re.compile(r"((?<![\d.])-?\d+(?:\.\d+)?)( ?%|x|)<!-- value: (\S+) (\S+) -->")


def _lookup(data, path: str):
  for part in path.split("."):
    if isinstance(data, list) and "=" in part:
      want = dict(kv.split("=", 1) for kv in part.split("&"))
      hits = [r for r in data if all(str(r.get(k)) == v for k, v in want.items())]
      if len(hits) != 1:
        raise KeyError(f"{part!r} matches {len(hits)} rows, not one")
      data = hits[0]
    elif isinstance(data, list):
      data = data[int(part)]
    else:
      data = data[part]
  return data


def inline_mismatches(text: str) -> list[str]:
  """Prose figures tagged with `<!-- value: FILE PATH -->` that differ from FILE's value at PATH,
  rounded as printed (a `%` figure is the value times 100)."""
  bad = []
  for m in INLINE.finditer(text):
    printed, unit, name, path = m.groups()
    value = float(_lookup(_load(name), path)) * (100 if "%" in unit else 1)
    digits = len(printed.split(".")[1]) if "." in printed else 0
    if f"{value:.{digits}f}" != printed:
      bad.append(f"{printed}{unit} but {name} {path} is {value:.{digits}f}")
  return bad


def render(text: str) -> str:
  """`text` with every marked table regenerated."""
  def fill(m: re.Match) -> str:
    return f"<!-- figures:{m.group(1)} -->\n{TABLES[m.group(1)]()}\n<!-- /figures:{m.group(1)} -->"

  return re.sub(r"<!-- figures:(\w+) -->.*?<!-- /figures:\1 -->", fill, text, flags=re.S)


def main(argv: list[str]) -> int:
  stale, wrong = [], []
  for rel in DOCS:
    path = os.path.join(ROOT, rel)
    with open(path) as f:
      text = f.read()
    new = render(text)
    wrong += [f"{rel}: {bad}" for bad in inline_mismatches(text)]
    if new != text:
      stale.append(rel)
      if "--check" not in argv:
        with open(path, "w") as f:
          f.write(new)
  if stale and "--check" in argv:
    print(f"figures differ from experiments/results in: {', '.join(stale)}; run "
          "python experiments/bench/docs_figures.py", file=sys.stderr)
    return 1
  if wrong:  # prose is not rewritten: its sentence may need more than the new number
    print("figures in prose differ from experiments/results (edit them by hand):\n"
          + "\n".join(wrong), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
