r"""Benchmarks the DLPlacer MILP against the heuristics on the paper-size models.

  python experiments/bench/bench_planner.py --out=/tmp/bench_planner.json

For each model (abstract trace, analytic costs on --hardware) and each M in --devices, k in
--microbatches: nodes, edges, solve time, status, gap, MILP makespan, lower bound, each
heuristic's makespan and the predicted MP speedup. With --out, each case's full plan (Plan JSON:
placement, schedule, bound) and the problem it solved (per-node times and memory, edges and their
transfer times: the costs the plan can be checked against, with their fingerprint) are written to
--plans_dir (default: beside --out, `<out>_plans/`), and the summary names the files. Expect
every case within --time_limit_s, the
MILP never worse than a heuristic, and the Inception-V3 2-way speedup printed beside the paper's
1.32x (PAPER.md). The gap is (makespan - lower bound) / makespan, with the bound proven as
planner/place.py describes; with k > 1 the cases run until the gap tolerance or the time limit,
so their times depend on the load of the machine. These cases plan the fused forward+backward
tasks (objective='makespan', no memory cap), as DLPlacer does.

  python experiments/bench/bench_planner.py --fbw --out=experiments/results/bench_planner_fbw.json

F/B/W cases (--fbw): the default objective, the lock-step price of the F/B/W task schedule the
program runs, within memory caps over time from the hardware's device memory (the V100's 16 GiB on
dgx1-v100). Per case: the chosen plan's lock-step price beside GPipe, 1F1B and ZB-H1 on the best
contiguous split (within the caps), the lock-step bound, the gap (price - bound) / price, the
per-device planner memory and the solve time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time

from absl import app, flags

from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid import models, planner

_MODELS = flags.DEFINE_list("models", ["inception_v3", "gnmt", "biglstm"], "Models to place.")
_SIZE = flags.DEFINE_string("size", "paper", "Model size preset.")
_DEVICES = flags.DEFINE_list("devices", ["2", "4"], "Values of M.")
_MICROBATCHES = flags.DEFINE_list("microbatches", ["1", "4"], "Values of k.")
_HARDWARE = flags.DEFINE_string("hardware", "dgx1-v100", "Hardware of the analytic cost model.")
# Per-GPU batches of the paper (PAPER.md): BigLSTM 128, GNMT 128 (sequence length 50 is the GNMT
# config's default), Inception-V3 64.
_BATCH_INCEPTION = flags.DEFINE_integer("batch_inception_v3", 64, "Per-GPU batch, Inception-V3.")
_BATCH_GNMT = flags.DEFINE_integer("batch_gnmt", 128, "Per-GPU batch, GNMT.")
_BATCH_BIGLSTM = flags.DEFINE_integer("batch_biglstm", 128, "Per-GPU batch, BigLSTM.")
_GNMT_SEQ = flags.DEFINE_integer("gnmt_seq_len", 50, "GNMT source and target length.")
_DEPTH = flags.DEFINE_integer("depth", 2, "Module-path components that name a node.")
_MAX_NODES = flags.DEFINE_integer("max_nodes", None, "Merge adjacent nodes down to this many.")
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 60.0, "Planner time limit per case.")
_THREADS = flags.DEFINE_integer("threads", 2, "Solver threads.")
_GAP = flags.DEFINE_float("gap", 0.01, "Relative gap tolerance.")
_OUT = flags.DEFINE_string("out", None, "Write the cases as JSON here.")
_FBW = flags.DEFINE_boolean(
  "fbw", False, "Run the F/B/W cases (lock-step objective, caps from the device memory) only.")
_BOUND_SHARE = flags.DEFINE_float(
  "lockstep_bound_share", planner.PlannerOptions.lockstep_bound_share,
  "F/B/W cases: PlannerOptions.lockstep_bound_share (0: without the transfers bound, for A/B).")
_GROUPS_MAX = flags.DEFINE_float(
  "lockstep_groups_max_s", planner.PlannerOptions.lockstep_groups_max_s,
  "F/B/W cases: PlannerOptions.lockstep_groups_max_s, the most seconds CP-SAT chooses the "
  "lock-step groups after the search (0: skip it, for A/B).")
_PLANS_DIR = flags.DEFINE_string(
  "plans_dir", None, "Write each case's plan and problem here (default: <out>_plans/ with --out)."
)

PAPER_INCEPTION_2WAY = 1.32  # DLPlacer's predicted 2-way MP speedup for Inception-V3 (PAPER.md)


def _trace(name: str):
  batch = {"inception_v3": _BATCH_INCEPTION, "gnmt": _BATCH_GNMT, "biglstm": _BATCH_BIGLSTM}
  overrides = {}
  if name == "gnmt":
    overrides = dict(max_source_length=_GNMT_SEQ.value, max_target_length=_GNMT_SEQ.value)
  spec = models.get(name, _SIZE.value, **overrides)
  return graph_lib.trace(
    spec.abstract_model(), spec.loss_fn, spec.batch_spec(batch[name].value),
    depth=_DEPTH.value, max_nodes=_MAX_NODES.value,
  )


def _plans_dir() -> str | None:
  """Where each case's Plan JSON goes (--plans_dir, else beside --out), created."""
  plans_dir = _PLANS_DIR.value
  if plans_dir is None and _OUT.value:
    plans_dir = os.path.splitext(_OUT.value)[0] + "_plans"
  if plans_dir:
    os.makedirs(plans_dir, exist_ok=True)
  return plans_dir


def _grid():
  """(model name, traced graph, M, k) for every case of the flags."""
  for name in _MODELS.value:
    graph = _trace(name)
    for m in (int(v) for v in _DEVICES.value):
      for k in (int(v) for v in _MICROBATCHES.value):
        yield name, graph, m, k


def main(argv):
  del argv
  logging.getLogger("mip").setLevel(logging.WARNING)
  if _FBW.value:
    return _main_fbw()
  cost_model = costs_lib.AnalyticCostModel(_HARDWARE.value)
  cases = []
  plans_dir = _plans_dir()
  header = (f"{'model':<13}{'M':>2}{'k':>3}{'nodes':>6}{'edges':>6}{'time_s':>8}  {'status':<9}"
            f"{'gap':>7}{'milp_ms':>10}{'lb_ms':>10}  heuristics (ms){'':<30}speedup")
  print(header)
  for name, graph, m, k in _grid():
    opts = planner.PlannerOptions(
      devices=m, microbatches=k, time_limit_s=_TIME_LIMIT.value, threads=_THREADS.value,
      gap=_GAP.value, objective="makespan", memory_caps_bytes=None,
    )
    problem = planner.Problem.from_graph(graph, cost_model, opts)  # what place() solves
    start = time.perf_counter()
    plan = planner.place_problem(problem, opts)
    solve_time_s = time.perf_counter() - start
    planner.validate_schedule(problem, plan.assignment, plan.schedule, k, opts.caps())
    case = dict(
      model=name, devices=m, microbatches=k, nodes=len(graph.nodes),
      edges=len({(e.src, e.dst) for e in graph.edges}),
      solve_time_s=solve_time_s, status=plan.status, gap=plan.gap,
      makespan=plan.fused_makespan_s, lower_bound=plan.lower_bound_s,
      heuristics=dict(plan.heuristics), found_by=plan.found_by,
      predicted_speedup=plan.fused_speedup,
      single_device_s=plan.single_device_s,
      milp_not_worse=plan.fused_makespan_s <= min(plan.heuristics.values()) * (1 + 1e-9),
      time_limit_s=_TIME_LIMIT.value,
      within_time_limit=solve_time_s <= 1.05 * _TIME_LIMIT.value,
      costs_fingerprint=problem.digest(), schedule_valid=True,
    )
    if plans_dir:
      case.update(_write_plan(plans_dir, f"{name}_M{m}_k{k}", plan, problem))
    cases.append(case)
    heur = " ".join(f"{h}={v * 1e3:.2f}" for h, v in plan.heuristics.items())
    line = (f"{name:<13}{m:>2}{k:>3}{case['nodes']:>6}{case['edges']:>6}"
            f"{case['solve_time_s']:>8.2f}  {plan.status:<9}{plan.gap:>7.2%}"
            f"{plan.fused_makespan_s * 1e3:>10.2f}{plan.lower_bound_s * 1e3:>10.2f}  "
            f"{heur:<44} {plan.fused_speedup:.3f}x")
    if name == "inception_v3" and m == 2:
      line += f" (paper: {PAPER_INCEPTION_2WAY}x)"
    print(line, flush=True)
  times = [c["solve_time_s"] for c in cases]
  within = sum(c["within_time_limit"] for c in cases)
  print(f"cases {len(cases)}: max time {max(times):.1f}s, median {statistics.median(times):.1f}s,"
        f" max gap {max(c['gap'] for c in cases):.2%}, MILP never worse than a heuristic: "
        f"{all(c['milp_not_worse'] for c in cases)}, within the time limit + 5 %: "
        f"{within}/{len(cases)}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(cases, f, indent=1)


def _main_fbw():
  """The F/B/W cases (see the module docstring)."""
  cost_model = costs_lib.AnalyticCostModel(_HARDWARE.value)
  plans_dir = _plans_dir()
  print(f"{'model':<13}{'M':>2}{'k':>3}{'nodes':>6}{'time_s':>8}{'lockstep_ms':>13}{'bound_ms':>10}"
        f"{'gap':>8}  baselines on the best contiguous split (ms)        found_by / peak GiB")
  cases = []
  gib = float(1 << 30)
  for name, graph, m, k in _grid():
    opts = planner.PlannerOptions(
      devices=m, microbatches=k, time_limit_s=_TIME_LIMIT.value, threads=_THREADS.value,
      gap=_GAP.value, lockstep_bound_share=_BOUND_SHARE.value,
      lockstep_groups_max_s=_GROUPS_MAX.value,
    )
    problem = planner.Problem.from_graph(graph, cost_model, opts)
    start = time.perf_counter()
    try:
      plan = planner.place_problem(problem, opts)
    except planner.InfeasibleError as err:
      print(f"{name:<13}{m:>2}{k:>3}  infeasible: {err}", flush=True)
      cases.append(dict(model=name, devices=m, microbatches=k, infeasible=str(err)))
      continue
    solve_time_s = time.perf_counter() - start
    step, bound = plan.lockstep_step_s, plan.lockstep_bound_s
    base = dict(plan.lockstep_baselines)
    caps = plan.memory_caps_bytes
    case = dict(
      model=name, devices=m, microbatches=k, nodes=len(graph.nodes),
      solve_time_s=solve_time_s, time_limit_s=_TIME_LIMIT.value,
      within_time_limit=solve_time_s <= 1.05 * _TIME_LIMIT.value,
      lockstep_step_s=step, lockstep_bound_s=bound,
      gap=(step - bound) / step if step > 0 else 0.0,
      baselines=base,
      not_worse_than_baselines=all(step <= v * (1 + 1e-12) for v in base.values()),
      gain_over_best_baseline=(min(base.values()) / step - 1) if base and step else None,
      lockstep_found_by=plan.lockstep_found_by,
      schedule_kind=getattr(plan.task_schedule, "kind", str(plan.task_schedule)),
      single_device_s=plan.single_device_s, lockstep_speedup=plan.lockstep_speedup,
      device_peak_bytes=list(plan.device_peak_bytes), memory_caps_bytes=list(caps),
      fits=all(b <= c for b, c in zip(plan.device_peak_bytes, caps)) if caps else True,
      fused_makespan=plan.fused_makespan_s, costs_fingerprint=problem.digest(),
      lockstep_bound_share=_BOUND_SHARE.value, lockstep_groups_max_s=_GROUPS_MAX.value,
      explicit_groups=getattr(plan.task_schedule, "groups", None) is not None,
    )
    if plans_dir:
      case.update(_write_plan(plans_dir, f"fbw_{name}_M{m}_k{k}", plan, problem))
    cases.append(case)
    if _OUT.value:  # after every case: a crash keeps the cases done
      with open(_OUT.value, "w") as f:
        json.dump(cases, f, indent=1)
    bl = " ".join(f"{h}={v * 1e3:.2f}" for h, v in base.items())
    peaks = "/".join(f"{b / gib:.1f}" for b in plan.device_peak_bytes)
    print(f"{name:<13}{m:>2}{k:>3}{case['nodes']:>6}{solve_time_s:>8.2f}{step * 1e3:>13.2f}"
          f"{bound * 1e3:>10.2f}{case['gap']:>8.2%}  {bl:<50} {plan.lockstep_found_by} "
          f"{peaks}", flush=True)
  done = [c for c in cases if "lockstep_step_s" in c]
  if done:
    times = [c["solve_time_s"] for c in done]
    print(f"cases {len(done)} (+{len(cases) - len(done)} infeasible): max time {max(times):.1f}s, "
          f"median {statistics.median(times):.1f}s, max gap {max(c['gap'] for c in done):.2%}, "
          f"never worse than GPipe/1F1B/ZB-H1 on the best contiguous split: "
          f"{all(c['not_worse_than_baselines'] for c in done)}, all fit: "
          f"{all(c['fits'] for c in done)}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(cases, f, indent=1)


def _write_plan(folder: str, stem: str, plan: planner.Plan, problem: planner.Problem) -> dict:
  """Writes `<stem>.plan.json` (Plan.load reads it) and `<stem>.problem.json` (the Problem's
  fields; `planner.Problem(**json)` with tuples restores it) and returns their names for the
  summary."""
  plan_file, problem_file = f"{stem}.plan.json", f"{stem}.problem.json"
  plan.save(os.path.join(folder, plan_file))
  with open(os.path.join(folder, problem_file), "w") as f:
    json.dump(dict(dataclasses.asdict(problem), digest=problem.digest()), f)
  return dict(plan_file=os.path.join(os.path.basename(folder), plan_file),
              problem_file=os.path.join(os.path.basename(folder), problem_file))


if __name__ == "__main__":
  app.run(main)
