"""Measured cost-model parameters cached per machine, with their provenance.

What the lock-step price needs beyond node times (a link's latency and bandwidth, the per-byte
times of the optimizer update, gradient addition and buffer fill) is a property of the machine
and of how its devices are run, not of a model. It is measured once (`jaxhybrid.costs.calibrate`,
`jaxhybrid.program.lockstep.measure_pass_costs`) and kept here, so every later plan and benchmark
on the same machine prices with the same figures, and a machine that never measured them
measures them first.

An entry is one JSON file ``<cache>/<name>-<key>.json`` holding the figures and
their provenance (what was measured, how, when, and the machine fields behind the key).
`machine_fields` is what makes two machines different: the host name, processor model, number
of cores this process may use, the JAX and jaxlib versions, the backend and its device kind;
callers add the measurement setup (`setup`: e.g. how many processes, pinned how, which
optimizer) so one machine keeps one entry per setup.

The cache directory is `$JAXHYBRID_CALIBRATION_CACHE`, else `~/.cache/jaxhybrid/calibration`
(beside the node profiles' `$JAXHYBRID_PROFILE_CACHE`); an explicit `cache_dir` wins over both.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import socket
from collections.abc import Callable, Mapping
from typing import Any

ENV_CACHE_DIR = "JAXHYBRID_CALIBRATION_CACHE"
FORMAT = 1


def default_cache_dir() -> pathlib.Path:
  """`$JAXHYBRID_CALIBRATION_CACHE`, else `~/.cache/jaxhybrid/calibration`."""
  return pathlib.Path(os.environ.get(ENV_CACHE_DIR) or "~/.cache/jaxhybrid/calibration").expanduser()


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_fields(backend: bool = True) -> dict[str, Any]:
  """What identifies this machine for a calibration: host, processor, usable cores, software and,
  with `backend`, JAX's default backend and device kind (starts JAX's backend)."""
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cores = os.cpu_count() or 1
  fields: dict[str, Any] = {
    "host": socket.gethostname(), "cpu": _cpu_model(), "arch": platform.machine(),
    "cores": cores, "python": platform.python_version(),
  }
  try:
    import jax
    import jaxlib

    fields["jax"], fields["jaxlib"] = jax.__version__, jaxlib.__version__
    if backend:
      dev = jax.devices()[0]
      fields["backend"], fields["device_kind"] = dev.platform, dev.device_kind
  except ImportError:
    pass
  return fields


def key_of(fields: Mapping[str, Any]) -> str:
  """A short stable hash of `fields` (sorted JSON)."""
  return hashlib.sha256(json.dumps(dict(fields), sort_keys=True, default=str).encode()).hexdigest()[:16]


class CalibrationCache:
  """Calibrations of this machine, one file per (name, machine and setup)."""

  def __init__(self, cache_dir: str | os.PathLike | None = None,
               fields: Mapping[str, Any] | None = None):
    """`cache_dir`: where entries live (default `default_cache_dir()`); `fields`: the machine's
    identity (default `machine_fields()`; tests pass their own)."""
    self.dir = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    self.fields = dict(fields) if fields is not None else machine_fields()

  def path(self, name: str, setup: Mapping[str, Any] | None = None) -> pathlib.Path:
    ident = {**self.fields, "setup": dict(setup or {})}
    return self.dir / f"{name}-{key_of(ident)}.json"

  def load(self, name: str, setup: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The cached entry (`values`, `provenance`), or None when this machine and setup have none
    (an unreadable or other-format file counts as none)."""
    p = self.path(name, setup)
    try:
      entry = json.loads(p.read_text())
    except (OSError, ValueError):
      return None
    if entry.get("format") != FORMAT or not isinstance(entry.get("values"), dict):
      return None
    return entry

  def store(self, name: str, values: Mapping[str, Any], setup: Mapping[str, Any] | None = None,
            how: str = "") -> dict[str, Any]:
    """Writes `values` with their provenance (atomically: a reader never sees half a file) and
    returns the entry."""
    entry = {
      "format": FORMAT, "name": name, "values": dict(values),
      "provenance": {
        "machine": self.fields, "setup": dict(setup or {}), "how": how,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      },
    }
    p = self.path(name, setup)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entry, indent=1, sort_keys=True))
    os.replace(tmp, p)
    return entry

  def get_or_measure(self, name: str, measure: Callable[[], Mapping[str, Any]],
                     setup: Mapping[str, Any] | None = None, how: str = "",
                     refresh: bool = False) -> tuple[dict[str, Any], bool]:
    """(entry, measured now): the cached entry, or `measure()`'s values stored first (always,
    with `refresh`)."""
    entry = None if refresh else self.load(name, setup)
    if entry is not None:
      return entry, False
    return self.store(name, measure(), setup, how), True
