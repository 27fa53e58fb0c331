"""Tests for statistical efficiency from a measured, changing noise scale."""

from __future__ import annotations

import json

import pytest

from jaxhybrid import projection
from jaxhybrid.projection import stat_eff


def test_constant_trajectory_is_the_noise_scale_model():
  traj = stat_eff.TrajectorySE(b_noise=(300.0,) * 7, run_batch=64)
  const = stat_eff.NoiseScaleSE(b_noise=300.0)
  for b in (32, 128, 1024, 8192):
    assert traj.se(b, 32) == pytest.approx(const.se(b, 32), rel=1e-12)
  assert traj.steps(64) == pytest.approx(7.0)  # the reference run's own length


def test_trajectory_hand_computed():
  # Two steps at B_run = 100 with B_noise 100 then 300: progress 1/2 + 1/4 in S_min units.
  traj = stat_eff.TrajectorySE(b_noise=(100.0, 300.0), run_batch=100)
  want_steps = (1 + 100 / 400) / 2 + (1 + 300 / 400) / 4  # at B = 400
  assert traj.steps(400) == pytest.approx(want_steps)
  e = lambda b: ((1 + 100 / b) / 2 + (1 + 300 / b) / 4) * b  # noqa: E731
  assert traj.se(400, 100) == pytest.approx(e(100) / e(400))
  # Between the constant models of its smallest and largest value (a larger noise scale makes
  # large batches more useful).
  lo, hi = stat_eff.NoiseScaleSE(b_noise=100.0), stat_eff.NoiseScaleSE(b_noise=300.0)
  assert lo.se(4000, 100) < traj.se(4000, 100) < hi.se(4000, 100)
  with pytest.raises(ValueError, match="positive finite"):
    stat_eff.TrajectorySE(b_noise=(1.0, float("nan")), run_batch=8)


def test_read_noise_scale_from_a_run(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"mesh": "4x2", "batch": 8}))
  rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9, "noise_scale": float("nan")},
          {"step": 3, "loss": 2.8, "noise_scale": 20.0}, {"step": 4, "noise_scale": -5.0},
          {"step": 5, "noise_scale": 40.0}]
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  m = projection.read_noise_scale(str(path))
  assert m.values == (20.0, 40.0) and m.steps == (3, 5) and m.skipped == 3
  assert m.run_batch == 32 and m.mean == 30.0 and m.std == 10.0
  se = projection.se_from_noise_scale(m, "mean")
  assert se.b_noise == 30.0
  traj = projection.se_from_noise_scale(m)
  assert traj.b_noise == (20.0, 40.0) and traj.run_batch == 32
  assert projection.read_noise_scale(str(path), skip_first=4).values == (40.0,)
  with pytest.raises(ValueError, match="mode"):
    projection.se_from_noise_scale(m, "median")
  (tmp_path / "empty.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
  with pytest.raises(ValueError, match="data-parallel"):
    projection.read_noise_scale(str(tmp_path / "empty.jsonl"), run_batch=8)
