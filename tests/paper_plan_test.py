"""A paper-configured model planned for four model devices from abstract shapes only."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest


def _live_bytes() -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.live_arrays())


# The README's fit-check command (tests/readme_test.py) checks the plan and the memory table of
# the same dry run; this one, that nothing of the model's size is allocated in the process.
@pytest.mark.slow
def test_paper_gnmt_plans_for_1x4_without_allocating(tmp_path, deterministic_place):
  """--size=paper --mesh=1x4 --dry_run: the plan places every node on one of the four model
  devices, the memory table has a row per device, and no array of the model's size is made."""
  from jaxhybrid import models
  from jaxhybrid.train import dry_run, runner

  before = _live_bytes()
  config = runner.RunConfig(model="gnmt", size="paper", mesh="1x4", microbatches=2, planner="milp",
                            dry_run=True, workdir=str(tmp_path / "dry"), hardware="dgx1-v100")
  results = dry_run.run(config)
  params = models.get("gnmt", "paper").num_params()
  assert params > 100_000_000  # the paper's GNMT, not a tiny one
  # Nothing of the model's size was allocated: live arrays grew by far less than its fp32 bytes.
  assert _live_bytes() - before < 4 * params / 100

  saved = json.loads((tmp_path / "dry" / "results.json").read_text())
  assign = saved["plan"]["assignment"]
  assert len(assign) == saved["graph"]["nodes"] > 0
  assert set(assign) <= {0, 1, 2, 3} and len(set(assign)) > 1, assign
  assert saved["mesh"] == {"data": 1, "model": 4}
  mem = saved["memory"]
  assert mem["compiled"] == mem["compiled_arguments"] + mem["compiled_temp"] > 0
  # The fp32 parameters alone are more than 4 bytes each over the model devices together.
  assert 4 * mem["compiled"] > 4 * params
  assert "memory per device" in results["memory_table"]
  assert len(saved["plan"]["device_peak_bytes"]) == 4
  assert (tmp_path / "dry" / "plan.json").exists()
