"""Multi-host: 2 processes x 2 CPU devices (jax.distributed, gloo) train like 1 process x 4 devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
from conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "experiments", "run.py")
COMMON = ["--model=biglstm", "--size=tiny", "--mesh=2x2", "--batch=4", "--microbatches=2",
          "--planner=etf", "--steps=4", "--checkpoint_every=2", "--progress=false",
          "--noprojection"]  # (planning the paper model for the projection: 14 s per process)


def _env() -> dict[str, str]:
  return subprocess_env()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _losses(workdir) -> list[float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["loss"] for line in f]


def test_two_processes_match_one_process(tmp_path):
  port = _free_port()
  multi = str(tmp_path / "multi")
  procs = [
    subprocess.Popen(
      [sys.executable, RUN, *COMMON, f"--workdir={multi}", f"--coordinator_address=localhost:{port}",
       "--num_processes=2", f"--process_id={i}"],
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for i in range(2)
  ]
  single = subprocess.run([sys.executable, RUN, *COMMON, f"--workdir={tmp_path / 'single'}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert single.returncode == 0, single.stderr[-3000:]
  results = json.load(open(os.path.join(multi, "results.json")))
  assert results["devices"]["processes"] == 2 and results["devices"]["count"] == 4
  a, b = _losses(multi), _losses(tmp_path / "single")
  assert len(a) == len(b) == 4
  np.testing.assert_allclose(a, b, rtol=1e-6)
