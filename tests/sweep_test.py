"""experiments/sweep.py: one row per run, a summary plot, and a rerun that skips finished rows."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = os.path.join(ROOT, "experiments", "sweep.py")


def _sweep(workdir, meshes: str, batches: str) -> subprocess.CompletedProcess:
  env = subprocess_env()
  args = [sys.executable, SWEEP, "--models=biglstm", f"--meshes={meshes}", f"--batches={batches}",
          "--planners=etf", "--size=tiny", "--steps=2", f"--workdir={workdir}"]
  return subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_sweep_rows_plot_and_skip(tmp_path):
  first = _sweep(tmp_path, "1x2,2x2", "2")
  assert first.returncode == 0, first.stderr[-3000:]
  rows = [json.loads(x) for x in open(tmp_path / "sweep.jsonl")]
  assert [r["name"] for r in rows] == ["biglstm-1x2-b2-etf", "biglstm-2x2-b2-etf"]
  assert all(r["status"] == "ok" and r["measured_step_s"] > 0 and r["predicted_step_s"] > 0
             for r in rows)
  with open(tmp_path / "sweep.csv") as f:
    assert len(list(csv.DictReader(f))) == 2
  assert os.path.getsize(tmp_path / "sweep.png") > 0
  assert os.path.exists(tmp_path / "biglstm-2x2-b2-etf" / "results.json")

  again = _sweep(tmp_path, "1x2", "2,4")
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("skip ") == 1
  rows = [json.loads(x) for x in open(tmp_path / "sweep.jsonl")]
  assert [r["name"] for r in rows][2:] == ["biglstm-1x2-b4-etf"]  # only the new run was added
  with open(tmp_path / "sweep.csv") as f:
    assert len(list(csv.DictReader(f))) == 3
