"""experiments/bench/bench_mp_errors.py: bench_mp's speedups and prediction errors from its jobs' JSON."""

from __future__ import annotations

import pytest
from conftest import experiment_module


@pytest.fixture(scope="module")
def be():
  return experiment_module("bench_mp_errors")


def _jobs(whole=None):
  cands = [
    {"plan_method": "milp", "lockstep_rank": 1, "predicted_speedup": 1.5, "predicted_program_speedup": 1.6,
     "predicted_program_step_s": 0.5, "plan_lockstep_step_s": 0.4},
    {"plan_method": "dp", "lockstep_rank": 0, "predicted_speedup": 1.2, "predicted_program_speedup": 1.25,
     "predicted_program_step_s": 0.64, "plan_lockstep_step_s": None},
  ]
  single = {"step_s_1dev": 1.0, "predicted_1dev_s": 0.9, "predicted_1dev_update_s": 0.1, "candidates": cands}
  if whole is not None:
    single["predicted_1dev_whole_s"] = whole
  multi = {"candidate_step_s": [0.5, 0.8], "chosen_candidate": 0, "step_s_plan": 0.5, "step_s_1dev_paired": 1.1,
           "step_s_jit_dp": 2.0, "step_s_hybrid_2x1": 1.0, "step_s_gspmd_tp": 1.0, "step_s_dp_bucketed": 0.9,
           "step_s_fsdp": 0.6}
  return single, multi


def test_errors_of_every_candidate_and_the_first_pick(be):
  single, multi = _jobs()
  row = be.summarise(single, multi)
  assert row["measured_speedup"] == pytest.approx(2.0)
  assert row["prediction_error_program"] == pytest.approx(abs(1.6 - 2.0) / 2.0)
  # Every timed candidate counts: |1.6 - 2| / 2 = 0.2 and |1.25 - 1.25| / 1.25 = 0.
  assert row["prediction_error_program_mean"] == pytest.approx(0.1)
  assert row["prediction_error_program_max"] == pytest.approx(0.2)
  assert row["step_prediction_error_max"] == pytest.approx(0.2)  # 0.64 predicted vs 0.8 measured
  assert row["first_pick_method"] == "dp" and row["first_pick_measured_speedup"] == pytest.approx(1.25)
  assert row["ratio_vs_fsdp"] == pytest.approx(0.6 / 0.5)  # FSDP's step over the plan's
  # A candidate without the plan's own price leaves the plan error out of the summary.
  assert "plan_lockstep_prediction_error_mean" not in row and "plan_step_prediction_error_mean" not in row
  assert single["candidates"][0]["plan_step_prediction_error"] == pytest.approx(0.2)  # 0.4 vs 0.5
  assert single["candidates"][0]["plan_lockstep_prediction_error"] == pytest.approx(abs(1.0 / 0.4 - 2.0) / 2.0)
  # No whole-step profile (a run before it existed): no whole-step fields.
  assert "speedup_prediction_error_mean" not in row and "predicted_1dev_whole_error" not in row


def test_whole_step_reference_gets_its_own_fields(be):
  single, multi = _jobs(whole=0.75)
  row = be.summarise(single, multi)
  # Node sum 0.9 + 0.1 update against 1.0 measured: 0 %; whole 0.75 + 0.1: -15 %.
  assert row["predicted_1dev_error"] == pytest.approx(0.0)
  assert row["predicted_1dev_whole_error"] == pytest.approx(-0.15)
  c0, c1 = single["candidates"]
  assert c0["predicted_program_speedup_whole"] == pytest.approx(0.85 / 0.5)
  assert c0["speedup_prediction_error"] == pytest.approx(abs(1.7 - 2.0) / 2.0)
  assert c1["speedup_prediction_error"] == pytest.approx(abs(0.85 / 0.64 - 1.25) / 1.25)
  assert c0["plan_speedup_prediction_error"] == pytest.approx(abs(0.85 / 0.4 - 2.0) / 2.0)
  assert row["speedup_prediction_error_max"] == max(c0["speedup_prediction_error"], c1["speedup_prediction_error"])
  assert row["first_pick_speedup_prediction_error"] == c1["speedup_prediction_error"]
  # The node-sum fields keep their meaning.
  assert row["prediction_error_program"] == pytest.approx(0.2)


@pytest.mark.parametrize("keeps", [True, False])
def test_shard_or_place_figures_compare_the_candidates_timed_together(be, keeps):
  single, multi = _jobs()
  single["candidates"].append(
    {"plan_method": "milp+shard", "lockstep_rank": 2, "sharded": True, "predicted_speedup": 1.4,
     "predicted_program_speedup": 1.4, "predicted_program_step_s": 0.7, "plan_lockstep_step_s": 0.6})
  single["planner_keeps_sharded"] = keeps
  multi["candidate_step_s"] = [0.5, 0.8, 0.4]
  row = be.summarise(single, multi)
  assert row["step_s_placement_only"] == pytest.approx(0.5)  # best of the two whole candidates
  assert row["step_s_sharded"] == pytest.approx(0.4)
  assert row["sharded_over_placement_only"] == pytest.approx(0.8)
  # The planner's pick: the sharded plan if kept, else the best predicted placement-only
  # candidate ('dp', lock-step rank 0, measured 0.8 s).
  assert row["step_s_planner_pick"] == pytest.approx(0.4 if keeps else 0.8)
  assert row["planner_pick_measured_speedup"] == pytest.approx(1.0 / (0.4 if keeps else 0.8))
  # Without a sharded candidate there are no such fields.
  plain = be.summarise(*_jobs())
  assert "step_s_sharded" not in plain and "step_s_planner_pick" not in plain
