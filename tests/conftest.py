"""Test setup: 8 simulated CPU devices, configured before JAX starts its backend."""

from __future__ import annotations

import os

# Tests check values, never speed: XLA's CPU backend compiles without LLVM's optimisation passes
# (Inception-V3 tiny's value-and-grad: 14 s instead of 21 s here; most of the suite's time is
# compiling). Subprocesses started by tests get it too (`subprocess_env`).
COMPILE_FLAGS = "--xla_backend_optimization_level=0"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Measured CPU costs (hardware profile, node profiles) go to a cache of this test run only, so no
# test's plan depends on the user's cache or on what ran before it on this machine. Set before
# anything reads it; subprocesses started by tests inherit it.
if "JAXHYBRID_PROFILE_CACHE" not in os.environ:
  import tempfile

  os.environ["JAXHYBRID_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="jaxhybrid-test-profiles-")
  # A fixed CPU spec (figures of one measurement on the 2-core CI machine kind), so that the
  # analytic CPU costs, and with them the plans and how long their searches take, do not depend
  # on how busy the machine is while a test process measures it (measured 172-204 GFLOP/s in
  # one afternoon; the same test then planned in 16 s or 128 s).
  import json

  with open(os.path.join(os.environ["JAXHYBRID_PROFILE_CACHE"], "hardware-cpu-cpu.json"), "w") as f:
    json.dump({"schema": 1, "device_kind": "cpu", "flops": 190e9, "mem_bw": 36.5e9,
               "link_bw": 18.25e9, "t_op": 5.7e-6, "n": 512, "reps": 5, "copy_bytes": 2**25,
               "t_mm": 2 * 512**3 / 190e9, "t_copy": 2**26 / 36.5e9}, f)
# Likewise the machine calibrations (jaxhybrid.costs.calibration_cache): none is read from, or
# written to, the user's cache.
if "JAXHYBRID_CALIBRATION_CACHE" not in os.environ:
  import tempfile

  os.environ["JAXHYBRID_CALIBRATION_CACHE"] = tempfile.mkdtemp(prefix="jaxhybrid-test-calibration-")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
  _flags = f"{_flags} {COMPILE_FLAGS}"
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()

import re  # noqa: E402

import jax  # noqa: E402

# The count set above, or the one a subprocess running a test module was given.
jax.config.update("jax_num_cpu_devices", int(re.findall(
  r"--xla_force_host_platform_device_count=(\d+)", os.environ["XLA_FLAGS"])[-1]))

import logging  # noqa: E402

import pytest  # noqa: E402


class _BoundErrors(logging.Handler):
  """Collects the planner's reports of a lower bound above a schedule it found
  (jaxhybrid.planner.lower_bounds.bounds.audited_bound)."""

  def __init__(self):
    super().__init__(level=logging.ERROR)
    self.names: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    if hasattr(record, "planner_bound_error"):
      self.names.append(record.planner_bound_error)


@pytest.fixture(autouse=True)
def planner_bound_errors():
  """Fails every test in which the planner reported an invalid lower bound. A test that provokes
  one on purpose reads the names from this list and clears it."""
  handler = _BoundErrors()
  logger = logging.getLogger("jaxhybrid.planner")
  logger.addHandler(handler)
  try:
    yield handler.names
  finally:
    logger.removeHandler(handler)
  assert not handler.names, f"the planner reported invalid lower bounds: {handler.names}"


# Planner options that stop every search by work done, never by the clock (the time limit is a
# safety net far above the work): the same test plans the same way on a busy machine.
DETERMINISTIC_PLANNER = dict(
  time_limit_s=600.0, threads=1, seed=0, milp_max_nodes=500, cpsat_deterministic_time=0.5,
  search_evaluations=20, lockstep_evaluations=30, lockstep_groups_max_s=None,
  warm_start_max_s=None,
)


# The same, with less work: for tests that only run what the plan gives (no claim on its price).
LIGHT_DETERMINISTIC_PLANNER = dict(
  DETERMINISTIC_PLANNER, milp_max_nodes=50, cpsat_deterministic_time=0.05, search_evaluations=4,
  lockstep_evaluations=4, lockstep_groups_max_s=0.0,
)


@pytest.fixture
def deterministic_place(monkeypatch):
  """Makes every `jaxhybrid.planner.place` call of the test stop by work done
  (LIGHT_DETERMINISTIC_PLANNER), for entry points whose own options carry only a wall-clock limit (the
  runner's `time_limit_s`, the advisor's SearchConfig): their plans then do not depend on how busy
  the machine is."""
  from jaxhybrid import planner

  place = planner.place

  def by_work(*args, **kwargs):
    return place(*args, **{**kwargs, **LIGHT_DETERMINISTIC_PLANNER})

  monkeypatch.setattr(planner, "place", by_work)


def subprocess_env(**extra: str) -> dict[str, str]:
  """The environment for a command a test starts: this one's, on the CPU, with the test compile
  flags but no device count (the command simulates the devices it needs), plus `extra`."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  env.update(extra)
  return env


def experiment_module(name: str):
  """Loads experiments/<name>.py or experiments/bench/<name>.py as a fresh module (neither folder
  is a package); the benchmark's folder is on sys.path, as when it runs as a script."""
  import importlib.util
  import sys

  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
  path = os.path.join(root, f"{name}.py")
  if not os.path.exists(path):
    path = os.path.join(root, "bench", f"{name}.py")
    if os.path.dirname(path) not in sys.path:
      sys.path.append(os.path.dirname(path))
  spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# The suite's longest tests (30-100 s each on 2 cores, most of them run.py subprocesses), started
# first: pytest-xdist hands tests out in collection order, and one of these started last kept the
# other worker idle for its length at the end of the run.
LONG_TESTS = (
  "readme_test.py::test_the_command_line_block_runs_as_written",
  "multihost_test.py::test_two_processes_match_one_process",
  "run_test.py::test_sigkill_then_resume_reproduces_uninterrupted_losses",
  "program_models_test.py::test_sequence_models_match_reference[gnmt-2x2-2-milp-zb]",
  "sweep_test.py::test_sweep_rows_plot_and_skip",
  "readme_test.py::test_quick_start_runs_as_written",
  "run_test.py::test_other_models_run_end_to_end[gnmt]",
  "planner_lockstep_cpsat_test.py::test_place_returns_explicit_groups_that_beat_every_order",
)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONG_TESTS)}

  def key(item):
    name = item.nodeid.split("/")[-1]
    return rank.get(name, len(LONG_TESTS))

  items.sort(key=key)  # stable: every other test keeps its order
