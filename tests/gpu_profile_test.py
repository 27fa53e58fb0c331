"""experiments/bench/gpu_profile.py, the prepared device script, run as a user runs it (on the CPU here:
tiny BigLSTM, a few steps)."""

import json
import os
import subprocess
import sys

from conftest import subprocess_env

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "bench", "gpu_profile.py")


def _run(tmp_path, *args):
  out = tmp_path / "g.json"
  proc = subprocess.run([sys.executable, SCRIPT, f"--out={out}", *args], capture_output=True,
                        text=True, env=subprocess_env(), timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(out.read_text()), out


def test_each_part_records_memory_time_and_profiles(tmp_path):
  res, _ = _run(tmp_path, "--models=biglstm", "--size=tiny", "--steps=2", "--warmup=1", "--budget_s=400")
  assert res["skipped"] == []
  hyb, plain = res["models"]["biglstm"]["hybrid"], res["models"]["biglstm"]["plain"]
  for part in (hyb, plain):
    assert "error" not in part, part
    assert part["backend"] == "cpu" and part["step_s"] > 0 and len(part["step_times_s"]) == 2
    # The CPU keeps no allocator statistics: no measured figure is made up.
    assert part["measured"]["peak_bytes_in_use"] is None
  mem = hyb["memory"]
  assert mem["compiled"] == mem["compiled_arguments"] + mem["compiled_temp"] > 0
  assert mem["predicted"] > 0 and mem["devices"] == 1
  assert plain["compiled"]["total"] == plain["compiled"]["arguments"] + plain["compiled"]["temp"] > 0
  # Same model, batch, optimizer and number of steps: the one-device hybrid computes the plain step.
  assert abs(hyb["loss"] - plain["loss"]) <= 1e-4 * max(1.0, abs(plain["loss"]))
  prof = plain["profile"]
  assert prof["nodes_profiled"] == prof["nodes"] == hyb["nodes"] == len(prof["node_times"])
  assert all(n["fwd_bwd_s"] > 0 and 0 < n["forward_s"] for n in prof["node_times"])
  assert prof["whole_fwd_bwd_s"] > 0
  # The profiles are kept where the results are, for the planner to read back.
  with open(prof["cache"]) as f:
    cache = json.load(f)
  assert os.path.dirname(prof["cache"]) == str(tmp_path / "profiles") and len(cache) >= prof["nodes"]
  assert not list(tmp_path.glob(".gpu_profile_*"))  # the children's files are merged and removed


def test_a_spent_budget_skips_parts_and_says_so(tmp_path):
  res, _ = _run(tmp_path, "--models=biglstm,gnmt", "--size=tiny", "--budget_s=1")
  assert res["models"] == {}
  assert res["skipped"] == [f"{m} {p}: time budget spent" for m in ("biglstm", "gnmt") for p in ("hybrid", "plain")]
