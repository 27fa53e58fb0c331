"""bench_mp's figures for one model from its two jobs' JSON: measured speedups and prediction errors.

`summarise(single, multi)` takes what the `single` role (profiles, plans, the one-device step) and
the `multi` role (the candidate plans, the baselines) wrote and returns the model's row; it adds
per-candidate errors to `single["candidates"]` in place. Errors are |predicted - measured| /
measured.

Two one-device references for predicted speedups, both profiled in the single role at the full
per-worker batch, plus the optimizer update priced per byte (predicted_1dev_update_s):
- predicted_1dev_s: the node times summed (what the planner's cost model adds up);
- predicted_1dev_whole_s: the whole forward + backward timed as one compiled function
  (`ProfiledCostModel.whole_step_time_s`), which includes what XLA fuses across nodes in a plain
  one-device step (the 8-layer chain: node sum 25-38 % above the plain step, whole within noise).
plan_step_prediction_error compares the plan's own lock-step price (plan_lockstep_step_s, what
the planner optimised) with the measured step directly. Fields with the node-sum reference keep
their names (prediction_error_program, ...
plan_lockstep_prediction_error); those with the whole-step reference are speedup_prediction_error
and plan_speedup_prediction_error (each with _mean / _max over every timed candidate).

The fields of a row:
Figures: step_s_1dev, step_s_plan, measured_speedup = step_s_1dev / step_s_plan, predicted_speedup
= predicted_1dev_s / the plan's predicted step, both from profiled costs (predicted_1dev_s: the
graph traced at the full per-worker batch, its node times summed; the plan's own
`plan_predicted_speedup` is against k micro-batches run on one device, which is slower than one
full batch on a CPU), prediction_error = |pred - meas| / meas; predicted_program_speedup /
prediction_error_program: the same with the plan priced as the program runs it (program.lockstep:
groups in lock step, transfers not overlapped, plus the optimizer update, gradient accumulation and
zero-fill, timed per byte in the same process), overhead_ratio_vs_jit_dp = step_s_jit_dp /
step_s_hybrid_2x1, ratio_vs_gspmd_tp = step_s_gspmd_tp / step_s_plan (> 1: the plan wins),
ratio_vs_fsdp = step_s_fsdp / step_s_plan (FSDP: every leaf sharded over both devices with
`NamedSharding`, the plan's batch split over them, plain jit; > 1: the plan wins),
zero1_step_ratio_2x1 = step_s_hybrid_2x1_zero1 / step_s_hybrid_2x1 (the one-device plan on 2x1
with the optimizer state sharded over 'data', ZeRO 1, against replicated; rotating rounds),
zero2_step_ratio_2x1 likewise with the gradients sharded too (ZeRO 2).
Shard or place (--shard_candidate, on): when a leaf is large enough to be offered a split
(`jaxhybrid.graph.shard`), the graph with shard options is profiled and planned too and that plan
is timed among the candidates (`sharded: true`); step_s_placement_only (best measured whole-leaf
candidate), step_s_sharded, sharded_over_placement_only = step_s_sharded / step_s_placement_only,
planner_keeps_sharded (the planner's choice between the two, `planner.keeps_sharded`, as
`parallelize` makes it), step_s_planner_pick and planner_pick_measured_speedup (that choice, or
the best predicted whole-leaf candidate, measured).
step_prediction_error (per candidate; _mean / _max per model) = |predicted program step - measured
step| / measured step: the lock-step model's own error, without the 1-device side;
plan_lockstep_prediction_error (_mean / _max): the plan's own lock-step price
(plan_lockstep_step_s) as a speedup over the full-batch 1-device prediction, against measured;
predicted_1dev_error = (predicted_1dev_s + predicted_1dev_update_s - step_s_1dev) / step_s_1dev.
step_s_1dev_paired: plain jit on one device timed by the two-process job just before and after the
candidate plans (mean; one process per core), in the same minutes as step_s_plan;
measured_speedup_paired = step_s_1dev_paired / step_s_plan, and prediction_error_program_paired
(_mean / _max), predicted_1dev_error_paired against it (step_s_1dev is from minutes earlier; here a
step drifts 15-25 % between runs). The same speedups against a second one-device reference,
predicted_1dev_whole_s (the whole forward + backward profiled as one compiled function, which sees
what XLA fuses across nodes in a plain step; node sums miss it, the chain's by 25-38 %):
speedup_prediction_error (lock-step program price), plan_speedup_prediction_error (the plan's own
price), each _mean / _max and _paired, predicted_1dev_whole_error; plan_step_prediction_error:
the plan's own lock-step price against the measured step. With --compare_unpacked: step_s_plan_unpacked (every transfer
its own ppermute) and packing_speedup = step_s_plan_unpacked / step_s_plan, from the same run. Step
times are medians over --steps timed steps after --warmup steps.
"""

from __future__ import annotations

from typing import Any


def err(predicted: float, measured: float) -> float:
  return abs(predicted - measured) / measured


def _mean_max(rows: list[dict], key: str) -> dict[str, float]:
  vals = [r[key] for r in rows]
  if not vals or None in vals:
    return {}
  return {f"{key}_mean": sum(vals) / len(vals), f"{key}_max": max(vals)}


def summarise(single: dict[str, Any], multi: dict[str, Any]) -> dict[str, Any]:
  """The model's figures (defined in this module's docstring); updates single['candidates'] in place."""
  t1, t1_paired = single["step_s_1dev"], multi["step_s_1dev_paired"]
  update_s = single["predicted_1dev_update_s"]
  full_1dev_s = single["predicted_1dev_s"] + update_s
  whole = single.get("predicted_1dev_whole_s")  # absent in runs before it existed
  whole_1dev_s = None if whole is None else whole + update_s
  cands = single["candidates"]
  for c, step_s in zip(cands, multi["candidate_step_s"]):
    c["step_s_plan"] = step_s
    c["prediction_error_program"] = err(c["predicted_program_speedup"], t1 / step_s)
    # The lock-step model's own error: its predicted program step against the measured one
    # (the speedup errors also carry the error of predicting plain jit on one device).
    c["step_prediction_error"] = err(c["predicted_program_step_s"], step_s)
    c["prediction_error_program_paired"] = err(c["predicted_program_speedup"], t1_paired / step_s)
    # The plan's own lock-step price as a speedup over the full-batch one-device prediction
    # (Plan.single_device_s is the k micro-batches one after another), against measured.
    lock = c.get("plan_lockstep_step_s")
    c["plan_lockstep_prediction_error"] = err(full_1dev_s / lock, t1 / step_s) if lock else None
    # The plan's own lock-step price against the measured step (no one-device side; the plan's
    # price leaves out the per-byte passes that the program's price adds, e.g. the update).
    c["plan_step_prediction_error"] = err(lock, step_s) if lock else None
    if whole_1dev_s is not None:
      c["predicted_program_speedup_whole"] = whole_1dev_s / c["predicted_program_step_s"]
      c["speedup_prediction_error"] = err(c["predicted_program_speedup_whole"], t1 / step_s)
      c["speedup_prediction_error_paired"] = err(c["predicted_program_speedup_whole"], t1_paired / step_s)
      c["plan_speedup_prediction_error"] = err(whole_1dev_s / lock, t1 / step_s) if lock else None
  run = cands[multi["chosen_candidate"]]
  meas = t1 / multi["step_s_plan"]
  first = next(c for c in cands if c["lockstep_rank"] == 0)
  row = {
    **single, **run, **multi,
    "measured_speedup": meas,
    "measured_speedup_paired": t1_paired / multi["step_s_plan"],
    "prediction_error": err(run["predicted_speedup"], meas),
    "prediction_error_program": err(run["predicted_program_speedup"], meas),
    "overhead_ratio_vs_jit_dp": multi["step_s_jit_dp"] / multi["step_s_hybrid_2x1"],
    "ratio_vs_gspmd_tp": multi["step_s_gspmd_tp"] / multi["step_s_plan"],
    "ratio_vs_fsdp": (multi["step_s_fsdp"] / multi["step_s_plan"]) if "step_s_fsdp" in multi else None,
    "predicted_1dev_error_paired": (full_1dev_s - t1_paired) / t1_paired,
    "predicted_1dev_error": (full_1dev_s - t1) / t1,
    "first_pick_method": first["plan_method"],
    "first_pick_measured_speedup": t1 / first["step_s_plan"],
    "first_pick_prediction_error": first["prediction_error_program"],
    "ratio_vs_dp_bucketed": multi["step_s_dp_bucketed"] / multi["step_s_hybrid_2x1"],
  }
  # Shard or place, measured in the same rounds: the best placement-only candidate, the plan
  # with shard options, and the one of the two the planner keeps (`planner.keeps_sharded`).
  whole_s = [c["step_s_plan"] for c in cands if not c.get("sharded")]
  sharded_s = [c["step_s_plan"] for c in cands if c.get("sharded")]
  if whole_s and sharded_s:
    row["step_s_placement_only"], row["step_s_sharded"] = min(whole_s), min(sharded_s)
    row["sharded_over_placement_only"] = min(sharded_s) / min(whole_s)
    if "planner_keeps_sharded" in single:
      first_whole = min((c for c in cands if not c.get("sharded")),
                        key=lambda c: c["lockstep_rank"])  # the best predicted placement
      picked = (min(sharded_s) if single["planner_keeps_sharded"] else first_whole["step_s_plan"])
      row["step_s_planner_pick"] = picked
      row["planner_pick_measured_speedup"] = t1 / picked
  for key in ("prediction_error_program", "step_prediction_error", "prediction_error_program_paired",
              "plan_lockstep_prediction_error", "plan_step_prediction_error"):
    row.update(_mean_max(cands, key))
  if whole_1dev_s is not None:
    row["predicted_1dev_whole_error"] = (whole_1dev_s - t1) / t1
    row["predicted_1dev_whole_error_paired"] = (whole_1dev_s - t1_paired) / t1_paired
    row["first_pick_speedup_prediction_error"] = first["speedup_prediction_error"]
    for key in ("speedup_prediction_error", "speedup_prediction_error_paired", "plan_speedup_prediction_error"):
      row.update(_mean_max(cands, key))
  if "step_s_plan_unpacked" in multi:
    row["packing_speedup"] = multi["step_s_plan_unpacked"] / multi["step_s_plan"]
  return row
