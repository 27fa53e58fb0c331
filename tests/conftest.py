"""Test setup: 8 simulated CPU devices, configured before JAX starts its backend."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import logging  # noqa: E402

import pytest  # noqa: E402


class _BoundErrors(logging.Handler):
  """Collects the planner's reports of a lower bound above a schedule it found
  (jaxhybrid.planner.bounds.audited_bound)."""

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
