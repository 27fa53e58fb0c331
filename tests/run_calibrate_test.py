"""`run.py --calibrate` (jaxhybrid/train/calibration.py): measured once per machine, cached, and
planned and priced with. The measurements themselves are tested where they live
(calibrate_link_test, group_cost_test); here they are replaced by known figures."""

from __future__ import annotations

import pytest

from jaxhybrid import errors
from jaxhybrid import mesh as mesh_lib
from jaxhybrid.train import calibration, runner

VALUES = {"link_alpha_s": 2e-4, "link_bandwidth_bytes_s": 1e9, "update_s_per_byte": 1e-10,
          "add_s_per_byte": 5e-11, "fill_s_per_byte": 3e-11, "group_s": 0.01,
          "task_fixed_s": 0.002, "group_fit": {"points": []}}


@pytest.fixture
def known(monkeypatch, tmp_path):
  """A calibration cache of this test only, and `measure` returning VALUES (counted)."""
  monkeypatch.setenv("JAXHYBRID_CALIBRATION_CACHE", str(tmp_path / "cache"))
  calls = []

  def fake(mesh, optimizer):
    calls.append(dict(mesh.shape))
    return dict(VALUES)

  monkeypatch.setattr(calibration, "measure", fake)
  return calls


def test_measured_once_then_read_from_the_cache(known):
  import optax

  mesh = mesh_lib.make("1x2")
  first = calibration.load_or_measure(mesh, optax.adam(1e-3), "adam")
  again = calibration.load_or_measure(mesh, optax.adam(1e-3), "adam")
  assert (first["source"], again["source"]) == ("measured", "cache")
  assert again["values"]["group_s"] == VALUES["group_s"] and len(known) == 1
  assert again["provenance"]["setup"]["optimizer"] == "adam"
  # Another optimizer is another setup: measured again.
  assert calibration.load_or_measure(mesh, optax.sgd(1e-3), "sgd")["source"] == "measured"
  opts = calibration.planner_options(again["values"])
  assert opts == {"group_s": 0.01, "task_fixed_s": 0.002}
  pc = calibration.pass_costs(again["values"])
  assert (pc.group_s, pc.task_fixed_s, pc.fill_s_per_byte) == (0.01, 0.002, 3e-11)
  assert calibration.link(again["values"]).alpha_s == 2e-4


def test_a_cached_entry_is_priced_by_this_version_s_fit_of_its_points(known, monkeypatch):
  import optax

  from jaxhybrid.program import group_cost

  # Points on 1 ms a group and 0.2 ms a task (measured - priced; priced 0).
  points = [[g, g - 1, t, 0.003 + 0.001 * g + 0.0002 * t, 0.0]
            for g, t in ((6, 40), (17, 40), (32, 90), (62, 70))]
  stale = dict(VALUES, group_s=0.5, task_fixed_s=0.5, group_fit={"points": points})
  monkeypatch.setattr(calibration, "measure", lambda mesh, optimizer: dict(stale))
  mesh = mesh_lib.make("1x2")
  for source in ("measured", "cache"):
    got = calibration.load_or_measure(mesh, optax.adam(1e-3), "adam")
    assert got["source"] == source
    want = group_cost.fit([tuple(p) for p in points])
    assert (got["values"]["group_s"], got["values"]["task_fixed_s"]) == want[:2]
    assert got["values"]["group_s"] == pytest.approx(0.001)
    assert got["values"]["group_fit"]["points"] == points
  # Without points (an entry from before they were kept): as stored.
  assert calibration.refit_groups(dict(VALUES)) == VALUES


def test_a_model_axis_of_one_is_refused(known):
  import optax

  with pytest.raises(ValueError, match="model axis of 2 or more"):
    calibration.load_or_measure(mesh_lib.make("2x1"), optax.adam(1e-3), "adam")
  assert not known


def test_measure_wires_the_three_measurements(monkeypatch):
  import optax

  from jaxhybrid import costs
  from jaxhybrid.costs import calibrate
  from jaxhybrid.program import group_cost, lockstep

  seen = {}

  def link(devices, **kw):
    seen["devices"] = len(devices)
    return costs.Link(alpha_s=1e-4, bandwidth_bytes_s=2e9)

  def groups(mesh, link, **kw):
    seen["pair"] = dict(mesh.shape)
    return group_cost.GroupCost(group_s=3e-3, task_fixed_s=0.0, intercept_s=0.0, points=())

  monkeypatch.setattr(calibrate, "calibrate_link", link)
  monkeypatch.setattr(lockstep, "measure_pass_costs",
                      lambda opt: lockstep.PassCosts(update_s_per_byte=1.0, add_s_per_byte=2.0,
                                                     fill_s_per_byte=3.0))
  monkeypatch.setattr(group_cost, "measure", groups)
  got = calibration.measure(mesh_lib.make("2x4"), optax.adam(1e-3))
  assert seen == {"devices": 2, "pair": {"data": 1, "model": 2}}
  assert (got["link_alpha_s"], got["update_s_per_byte"], got["group_s"]) == (1e-4, 1.0, 3e-3)


def test_a_calibrated_build_plans_and_prices_the_measured_group_cost(known, tmp_path):
  from jaxhybrid.train import predict

  cfg = runner.RunConfig(model="biglstm", size="tiny", mesh="1x2", batch=4, microbatches=2,
                         planner="etf", steps=1, progress=False, projection=False,
                         calibrate=True, workdir=str(tmp_path / "w"))
  cfg = runner._resolve(cfg)
  entry = runner.calibrated(cfg)
  assert entry["values"]["group_s"] == VALUES["group_s"] and entry["source"] == "measured"
  _, hybrid, _ = runner.build(cfg, abstract=True, calib=entry)
  parts = predict.predicted_step_s(hybrid, None, entry["values"])["lockstep_parts_s"]
  # Every group adds group_s (10 ms here, far above any tiny task), and the passes are priced.
  groups = parts["group_sync_s"] / VALUES["group_s"]
  assert groups == len(hybrid.program.structure.groups) and parts["param_s"] > 0
  # Without it: no fixed costs priced.
  plain = predict.predicted_step_s(hybrid, None)["lockstep_parts_s"]
  assert plain["group_sync_s"] == 0 and plain["param_s"] == 0


def test_calibrate_on_a_one_device_model_axis_is_a_usage_error(known, tmp_path):
  cfg = runner.RunConfig(model="biglstm", size="tiny", mesh="2x1", batch=4, microbatches=2,
                         planner="etf", steps=1, progress=False, projection=False,
                         calibrate=True, workdir=str(tmp_path / "w"))
  with pytest.raises(errors.UsageError, match="--calibrate"):
    runner.run(cfg)
