"""experiments/bench/bench_mp_errors.py: bench_mp's row (speedups, every candidate's error, the
rank correlation, baseline ratios) from its jobs' JSON."""

from __future__ import annotations

import pytest
from conftest import experiment_module


@pytest.fixture(scope="module")
def be():
  return experiment_module("bench_mp_errors")


def _cand(rank, predicted, method="milp", sharded=False):
  return {"plan_id": f"plan_m_{rank}", "method": method, "sharded": sharded, "predicted_rank": rank,
          "schedule": "1f1b", "k": 4, "groups": 6, "transfers": 10, "predicted_step_s": predicted}


def _jobs(whole=None):
  cands = [_cand(0, 0.55), _cand(1, 0.64, "dp")]
  single = {"step_s_1dev": 1.0, "predicted_1dev_s": 0.9, "predicted_1dev_update_s": 0.1,
            "candidates": cands, "batch": 64, "microbatches": 4, "nodes": 12,
            "plan_status": "optimal", "plan_gap": 0.0, "plan_time_s": 3.0, "place_s": 1.0}
  if whole is not None:
    single["predicted_1dev_whole_s"] = whole
  multi = {"candidate_step_s": [0.5, 0.8], "chosen_candidate": 0, "step_s_plan": 0.5,
           "step_s_1dev_paired": 1.1, "step_s_jit_dp": 2.0, "step_s_hybrid_2x1": 1.0,
           "step_s_gspmd_tp": 1.0, "step_s_dp_bucketed": 0.9, "step_s_fsdp": 0.6,
           "step_s_hybrid_2x1_zero1": 1.05, "step_s_hybrid_2x1_zero2": 0.98}
  return single, multi


def test_every_candidate_carries_its_predicted_and_measured_step(be):
  single, multi = _jobs()
  row = be.summarise(single, multi)
  c0, c1 = row["candidates"]
  assert (c0["measured_step_s"], c1["measured_step_s"]) == (0.5, 0.8)
  # Signed: 0.55 predicted vs 0.5 measured is +10 %; 0.64 vs 0.8 is -20 %.
  assert c0["error"] == pytest.approx(0.1) and c1["error"] == pytest.approx(-0.2)
  assert row["step_error_mean"] == pytest.approx(0.15) and row["step_error_max"] == pytest.approx(0.2)
  assert row["rank_correlation"] is None  # two candidates: no rank correlation
  assert row["measured_speedup"] == pytest.approx(2.0)
  assert row["measured_speedup_both_busy"] == pytest.approx(2.2)
  assert row["predicted_speedup"] == pytest.approx(1.0 / 0.55)  # node sum + update over the chosen
  assert row["one_device"]["error"] == pytest.approx(0.0)
  assert row["one_device"]["error_both_busy"] == pytest.approx(1.0 / 1.1 - 1.0)
  # The row keeps only the schema's fields (the jobs' inputs are not copied in).
  assert "step_s_1dev" not in row and "predicted_1dev_s" not in row and "predicted_step_s_whole" not in row["one_device"]


def test_baseline_ratios_compare_like_with_like(be):
  row = be.summarise(*_jobs())
  assert row["ratio_vs_fsdp"] == pytest.approx(0.6 / 0.5)  # FSDP's step over the plan's (1x2)
  assert row["ratio_vs_gspmd_tp"] == pytest.approx(1.0 / 0.5)
  assert row["ratio_vs_dp_bucketed"] == pytest.approx(0.9 / 1.0)  # both on 2x1
  assert row["zero1_step_ratio_2x1"] == pytest.approx(1.05)
  assert row["zero2_step_ratio_2x1"] == pytest.approx(0.98)
  assert row["baselines"]["jit_dp"] == 2.0


def test_whole_step_reference_and_calibration_provenance(be):
  single, multi = _jobs(whole=0.75)
  cal = {"source": "cache", "values": {"link_alpha_s": 1e-4}, "provenance": {"measured_at": "t"}}
  row = be.summarise(single, multi, cal)
  assert row["one_device"]["predicted_step_s_whole"] == pytest.approx(0.85)
  assert row["one_device"]["error_whole"] == pytest.approx(-0.15)
  assert row["calibration"] == {"source": "cache", "values": {"link_alpha_s": 1e-4}, "measured_at": "t"}


@pytest.mark.parametrize("keeps", [True, False])
def test_shard_or_place_figures_compare_the_candidates_timed_together(be, keeps):
  single, multi = _jobs()
  single["candidates"].append(_cand(2, 0.7, "milp+shard", sharded=True))
  single["planner_keeps_sharded"] = keeps
  multi["candidate_step_s"] = [0.5, 0.8, 0.4]
  row = be.summarise(single, multi)
  assert row["sharded_over_placement_only"] == pytest.approx(0.4 / 0.5)
  # The planner's pick: the sharded plan if kept, else the best predicted placement-only
  # candidate (rank 0, measured 0.5 s).
  assert row["planner_pick_measured_speedup"] == pytest.approx(1.0 / (0.4 if keeps else 0.5))
  # Predicted 0.55 / 0.64 / 0.7 against measured 0.5 / 0.8 / 0.4: ranks (0, 1, 2) vs (1, 2, 0).
  assert row["rank_correlation"] == pytest.approx(-0.5)
  plain = be.summarise(*_jobs())
  assert "sharded_over_placement_only" not in plain and "planner_pick_measured_speedup" not in plain


def test_spearman_ranks_with_ties(be):
  assert be.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert be.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # Ties take their mean rank: x ranks (0, 1.5, 1.5, 3) against (0, 1, 2, 3).
  assert be.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)
  assert be.spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side has no ranking


def test_two_runs_compared_figure_by_figure(be):
  first = [{"model": "a", "measured_speedup": 1.5, "step_s_plan": 0.4, "calibration": {"source": "measured"}},
           {"model": "b", "skipped": "budget"}]
  second = [{"model": "a", "measured_speedup": 1.35, "step_s_plan": 0.42, "calibration": {"source": "cache"}}]
  out = be.compare(first, second)
  a = out["models"]["a"]
  assert a["figures"]["measured_speedup"]["difference"] == pytest.approx(-0.1)
  assert a["figures"]["step_s_plan"]["difference"] == pytest.approx(0.05)
  assert a["calibration"] == ["measured", "cache"]
  assert out["max_abs_difference"] == pytest.approx(0.1) and set(out["models"]) == {"a"}
