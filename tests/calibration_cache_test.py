"""jaxhybrid.costs.calibration_cache: calibrations cached per machine and setup, with provenance,
and isolated from the user's cache in tests."""

from __future__ import annotations

import json
import os

from jaxhybrid.costs import calibration_cache as cc

MACHINE = {"host": "a", "cpu": "cpu model", "cores": 2, "jax": "0.0"}


def test_tests_never_touch_the_users_cache():
  home = os.path.expanduser("~/.cache/jaxhybrid/calibration")
  assert os.environ[cc.ENV_CACHE_DIR] and cc.default_cache_dir() != cc.pathlib.Path(home)
  assert cc.CalibrationCache(fields=MACHINE).dir == cc.default_cache_dir()


def test_measured_once_then_read_with_its_provenance(tmp_path):
  cache = cc.CalibrationCache(tmp_path, MACHINE)
  calls = []

  def measure():
    calls.append(1)
    return {"link_alpha_s": 1e-4, "update_s_per_byte": 2e-10}

  setup = {"processes": 2, "optimizer": "adam"}
  first, measured = cache.get_or_measure("bench", measure, setup, how="timed")
  again, measured_again = cache.get_or_measure("bench", measure, setup)
  assert (measured, measured_again, len(calls)) == (True, False, 1)
  assert again["values"] == first["values"] == {"link_alpha_s": 1e-4, "update_s_per_byte": 2e-10}
  prov = again["provenance"]
  assert prov["machine"] == MACHINE and prov["setup"] == setup and prov["how"] == "timed"
  assert prov["measured_at"]
  # refresh measures again and replaces the entry.
  _, re = cache.get_or_measure("bench", lambda: {"link_alpha_s": 3e-4}, setup, refresh=True)
  assert re and cache.load("bench", setup)["values"] == {"link_alpha_s": 3e-4}


def test_keyed_by_machine_and_setup(tmp_path):
  cache = cc.CalibrationCache(tmp_path, MACHINE)
  cache.store("bench", {"x": 1.0}, {"processes": 2})
  # Another machine (host, processor, cores or software) or another setup has no entry.
  for other in ({**MACHINE, "host": "b"}, {**MACHINE, "cores": 4}, {**MACHINE, "jax": "0.1"}):
    assert cc.CalibrationCache(tmp_path, other).load("bench", {"processes": 2}) is None
  assert cache.load("bench", {"processes": 4}) is None
  assert cache.load("other", {"processes": 2}) is None
  assert cache.load("bench", {"processes": 2})["values"] == {"x": 1.0}


def test_unreadable_or_other_format_entries_are_measured_again(tmp_path):
  cache = cc.CalibrationCache(tmp_path, MACHINE)
  p = cache.path("bench")
  p.parent.mkdir(parents=True, exist_ok=True)
  p.write_text("{not json")
  assert cache.load("bench") is None
  p.write_text(json.dumps({"format": cc.FORMAT + 1, "values": {"x": 1}}))
  assert cache.load("bench") is None
  entry, measured = cache.get_or_measure("bench", lambda: {"x": 2})
  assert measured and json.loads(p.read_text())["values"] == {"x": 2}


def test_machine_fields_name_this_machine():
  f = cc.machine_fields(backend=False)
  assert f["host"] and f["cpu"] and f["cores"] >= 1 and f["jax"]
  assert cc.key_of(f) == cc.key_of(dict(reversed(list(f.items()))))  # order-free
