"""bench_mp's row for one model from its jobs' JSON, the row's schema, and two runs compared.

`summarise(single, multi, calibration)` takes what the `single` role (profiles, plans, the
one-device step), the `multi` role (candidate plans and baselines timed in the same processes)
and the machine's calibration wrote, and returns the model's row. All times are seconds per
training step (medians over timed steps); every error is signed, (predicted - measured) /
measured; ratios > 1 favour the plan.

The row (experiments/results/bench_mp.json holds one per model):

- `model`, `size`, `schedule`, `batch` (per worker), `microbatches`, `nodes`, `program` (the
  commit measured).
- `calibration`: where the machine's figures came from (`source`: 'measured' in this run or
  'cache'), `values` (link latency and bandwidth, per-byte update, addition and fill times,
  `group_s` and `task_fixed_s` the per-group and per-task costs and `group_fit` their points:
  groups, messages, busiest-device tasks, measured and priced step of each tiny program) and
  `measured_at`.
- `one_device`: the model's plain `jax.jit` step on one pinned core. `measured_step_s` timed
  alone, in the process that profiled and planned; `measured_step_s_both_busy` timed by both
  processes at once (both cores busy, as under a plan) in a pair of processes of its own, once
  before the candidates and once after them (`measured_step_s_before_after`: the two runs'
  medians; their difference is the drift over the stage). Every configuration of that stage (the
  one-device runs, each candidate, each baseline) runs in its own two processes, started for it:
  one program per process, as a user runs it. `predicted_step_s`: the profiled node times summed plus the
  optimizer update, the cost model every candidate's price is built from; `error` against the
  alone figure (`error_both_busy` against the other); `predicted_step_s_whole` / `error_whole`:
  the whole forward + backward profiled as one compiled function plus the update, which sees
  what XLA fuses across nodes (the 8-layer chain's node sum is 25-38 % above its plain step).
- `profile`: how the node times were priced: `flush_bytes` (the cache-sized write before each
  cold timed run) and, with bench_mp's --profile_cache_blend, `cache_blend` (the micro-batch
  graph the candidates are priced on) and `cache_blend_one_device` (the one-device step's graph):
  `warm_sum_s` and `cold_sum_s` (node times summed, back to back and flushed), `whole_s` (the
  whole forward + backward back to back), the `cold_share` the candidates were priced at (0:
  warm times, 1: the flushed ones; `jaxhybrid.costs.cache_blend`) and `anchor`, the rule that
  set it (bench_mp's --profile_share_rule: 'cold', 'whole' or 'program', the last with
  `program_s`, `program_warm_s`, `program_cold_s`); null without a blend.
- `candidates`: every plan timed on mesh 1x2, best predicted first: `plan_id` (its file in the
  workdir), `method`, `sharded` (made on the graph with shard options), `schedule`, `k`,
  `groups`, `transfers`, `predicted_step_s` (the lock-step price of the program that runs:
  groups, messages, group-output fills, optimizer update and gradient passes, the groups' and
  tasks' fixed costs; `jaxhybrid.program.lockstep.plan_step_s`) and its `predicted_parts_s`
  (`tasks`: the busiest device's tasks summed over groups, `transfers`, `update_and_gradient_passes`,
  `fills`, `group_sync`: groups x the calibrated per-group cost, `task_overhead`: what the
  calibrated per-task cost adds to the groups' busiest devices),
  `measured_step_s`, `error`.
- `chosen_candidate`: index of the fastest measured candidate, the run's plan; `step_s_plan`.
- `measured_speedup` = one_device.measured_step_s / step_s_plan;
  `measured_speedup_both_busy` with the both-busy one-device step (the figure the README leads
  with: both sides timed with both cores busy, each in processes of its own); `predicted_speedup` =
  one_device.predicted_step_s / the chosen candidate's predicted_step_s;
  `predicted_reference_speedup` = one_device.predicted_step_s_whole / the same: the speedup the
  plan's summary prints (`Plan.reference_speedup`, over one device's plain step profiled whole).
- `step_error_mean`, `step_error_max`: mean and max |error| over every timed candidate;
  `rank_correlation`: Spearman's rho of predicted against measured steps over the candidates
  (null below 3 candidates).
- `baselines`: steps of what a user would otherwise run. On the two devices with the plan's
  batch: `fsdp` (every leaf and the batch sharded over both devices with `NamedSharding`, plain
  jit: XLA's collectives per leaf), `fsdp_bucketed` (every parameter in one flat buffer sharded
  over both devices: one all-gather and one reduce-scatter per step, the optimizer on each
  device's half; `bench_baselines.bucketed_fsdp_step`), `gspmd_tp` (mesh 1x2, each weight
  sharded over 'model' on its largest divisible dimension). On mesh 2x1 with twice the batch:
  `jit_dp` (XLA's per-leaf all-reduces), `dp_bucketed` (one flat all-reduce),
  `hybrid_2x1` (the one-device plan as the hybrid program), `hybrid_2x1_zero1` and `_zero2`
  (optimizer state, and gradients too, sharded over 'data'). The one-buffer baselines
  (`fsdp_bucketed`, `dp_bucketed`) are medians over as many timed steps as a candidate gets
  (--steps x --rounds), the per-leaf ones over --steps.
- `ratio_vs_fsdp` = baselines.fsdp / step_s_plan, `ratio_vs_fsdp_bucketed` and
  `ratio_vs_gspmd_tp` likewise;
  `ratio_vs_dp_bucketed` = baselines.dp_bucketed / baselines.hybrid_2x1 (same mesh and batch);
  `zero1_step_ratio_2x1`, `zero2_step_ratio_2x1` = hybrid_2x1_zero{1,2} / hybrid_2x1.
- Shard or place (when the graph has leaves to split): `sharded_over_placement_only` (the
  sharded candidate's step over the best placement-only one), `planner_keeps_sharded` (the
  choice `parallelize` makes between them, `planner.keeps_sharded`), `planner_pick_measured_speedup`.
- Batch split (with --batch_candidate): `batch_split_over_placement_only` (the step of the
  plan with big nodes split by rows over the best placement-only candidate's) and
  `planner_keeps_batch_split` (whether `planner.keeps_sharded` keeps it); a candidate's
  `batch_split` lists its split nodes.
- `plan`: the planner's `plan_status`, `plan_gap`, `plan_time_s` (profiling + placement),
  `place_s`.
- With --compare_unpacked: `step_s_plan_unpacked` (every transfer its own ppermute) and
  `packing_speedup` = step_s_plan_unpacked / step_s_plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def err(predicted: float, measured: float) -> float:
  """Signed relative error, (predicted - measured) / measured."""
  return (predicted - measured) / measured


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
  """Spearman's rank correlation (ties get their mean rank); None below 3 pairs or when either
  side is constant."""
  if len(xs) != len(ys) or len(xs) < 3:
    return None

  def ranks(v):
    v = np.asarray(v, dtype=float)
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=float)
    for val in np.unique(v):  # ties: their mean rank
      tie = v == val
      r[tie] = r[tie].mean()
    return r

  rx, ry = ranks(xs), ranks(ys)
  if rx.std() == 0 or ry.std() == 0:
    return None
  return float(np.corrcoef(rx, ry)[0, 1])


def summarise(single: dict[str, Any], multi: dict[str, Any],
              calibration: dict[str, Any] | None = None) -> dict[str, Any]:
  """The model's row (the schema in this module's docstring)."""
  t1, t1_rounds = single["step_s_1dev"], multi["step_s_1dev_paired"]
  pred_1dev = single["predicted_1dev_s"] + single["predicted_1dev_update_s"]
  cands = []
  for c, step_s in zip(single["candidates"], multi["candidate_step_s"]):
    cands.append({**c, "measured_step_s": step_s, "error": err(c["predicted_step_s"], step_s)})
  chosen = multi["chosen_candidate"]
  step_plan = multi["step_s_plan"]
  errors = [abs(c["error"]) for c in cands]
  base = {
    "fsdp": multi.get("step_s_fsdp"), "fsdp_bucketed": multi.get("step_s_fsdp_bucketed"),
    "gspmd_tp": multi["step_s_gspmd_tp"],
    "jit_dp": multi["step_s_jit_dp"], "dp_bucketed": multi["step_s_dp_bucketed"],
    "hybrid_2x1": multi["step_s_hybrid_2x1"],
    **{f"hybrid_2x1_zero{z}": multi[f"step_s_hybrid_2x1_zero{z}"] for z in (1, 2)
       if f"step_s_hybrid_2x1_zero{z}" in multi},
  }
  row: dict[str, Any] = {
    "batch": single["batch"], "microbatches": single["microbatches"], "nodes": single["nodes"],
    "one_device": {
      "predicted_step_s": pred_1dev, "measured_step_s": t1,
      "measured_step_s_both_busy": t1_rounds, "error": err(pred_1dev, t1),
      "error_both_busy": err(pred_1dev, t1_rounds),
      **({"measured_step_s_before_after": multi["step_s_1dev_before_after"]}
         if "step_s_1dev_before_after" in multi else {}),
    },
    "candidates": cands, "chosen_candidate": chosen, "step_s_plan": step_plan,
    "measured_speedup": t1 / step_plan, "measured_speedup_both_busy": t1_rounds / step_plan,
    "predicted_speedup": pred_1dev / cands[chosen]["predicted_step_s"],
    "step_error_mean": float(np.mean(errors)), "step_error_max": float(np.max(errors)),
    "rank_correlation": spearman([c["predicted_step_s"] for c in cands],
                                 [c["measured_step_s"] for c in cands]),
    "baselines": base,
    "ratio_vs_fsdp": base["fsdp"] / step_plan if base["fsdp"] else None,
    "ratio_vs_fsdp_bucketed": (base["fsdp_bucketed"] / step_plan if base["fsdp_bucketed"]
                               else None),
    "ratio_vs_gspmd_tp": base["gspmd_tp"] / step_plan,
    "ratio_vs_dp_bucketed": base["dp_bucketed"] / base["hybrid_2x1"],
    **{f"zero{z}_step_ratio_2x1": base[f"hybrid_2x1_zero{z}"] / base["hybrid_2x1"] for z in (1, 2)
       if f"hybrid_2x1_zero{z}" in base},
    "plan": {k: single.get(k) for k in ("plan_status", "plan_gap", "plan_time_s", "place_s")},
    "profile": {"flush_bytes": single.get("profile_flush_bytes"),
                "cache_blend": single.get("profile_blend"),
                "cache_blend_one_device": single.get("profile_blend_one_device")},
  }
  if single.get("predicted_1dev_whole_s") is not None:
    whole_s = single["predicted_1dev_whole_s"] + single["predicted_1dev_update_s"]
    row["one_device"].update(predicted_step_s_whole=whole_s, error_whole=err(whole_s, t1))
    row["predicted_reference_speedup"] = whole_s / cands[chosen]["predicted_step_s"]
  if "step_s_plan_unpacked" in multi:
    row["step_s_plan_unpacked"] = multi["step_s_plan_unpacked"]
    row["packing_speedup"] = multi["step_s_plan_unpacked"] / step_plan
  if calibration is not None:
    row["calibration"] = {"source": calibration.get("source"), "values": calibration["values"],
                          "measured_at": calibration.get("provenance", {}).get("measured_at")}
  # Shard or place, measured in the same rounds: the best placement-only candidate, the plan
  # with shard options, and the one of the two the planner keeps (`planner.keeps_sharded`).
  whole = [c for c in cands if not c.get("sharded") and not c.get("batch_split")]
  sharded = [c for c in cands if c.get("sharded")]
  by_rows = [c for c in cands if c.get("batch_split")]
  if whole and by_rows:
    row["batch_split_over_placement_only"] = (min(c["measured_step_s"] for c in by_rows)
                                              / min(c["measured_step_s"] for c in whole))
    if "planner_keeps_batch_split" in single:
      row["planner_keeps_batch_split"] = bool(single["planner_keeps_batch_split"])
  if whole and sharded:
    row["sharded_over_placement_only"] = (min(c["measured_step_s"] for c in sharded)
                                          / min(c["measured_step_s"] for c in whole))
    if "planner_keeps_sharded" in single:
      keeps = bool(single["planner_keeps_sharded"])
      first_whole = min(whole, key=lambda c: c["predicted_rank"])  # the best predicted placement
      picked = min(c["measured_step_s"] for c in sharded) if keeps else first_whole["measured_step_s"]
      row["planner_keeps_sharded"] = keeps
      row["planner_pick_measured_speedup"] = t1 / picked
  return row


# The figures compared: the speedups, the baseline ratios and the chosen plan's step (ratios and
# times; an error is compared by its two values, not by a relative difference of errors).
FIGURES = ("measured_speedup", "measured_speedup_both_busy", "step_s_plan", "ratio_vs_fsdp",
           "ratio_vs_fsdp_bucketed", "ratio_vs_dp_bucketed", "ratio_vs_gspmd_tp")


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
