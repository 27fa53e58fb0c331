"""The (data, model) device mesh: parsing `16x2`, simulated CPU devices, multi-host start-up.

This is the one module that creates meshes. Axis names are constants so no other module spells
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

DATA = "data"  # data-parallel axis: workers, gradients all-reduced over it
MODEL = "model"  # model-parallel axis: the devices of one worker, placed by the planner
AXES = (DATA, MODEL)

# The axes the hybrid program's owned parameter rows are split over while it traces the
# optimizer update: 'model' (a row per model-axis device), or ('model', 'data') under ZeRO (each
# data replica updates a slice). Reductions over all parameters (global-norm clipping) read it.
_OWNED_AXES: list = [MODEL]


@contextlib.contextmanager
def owned_rows_over(axes):
  """Within the block, `owned_rows_axes()` is `axes` (set by the program's ZeRO tail)."""
  _OWNED_AXES.append(axes)
  try:
    yield
  finally:
    _OWNED_AXES.pop()


def owned_rows_axes():
  """The mesh axes the owned rows are split over in the update being traced (see above)."""
  return _OWNED_AXES[-1]


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """A (data, model) mesh shape; `-1` in a spec is filled from the device count."""

  data: int
  model: int

  @property
  def size(self) -> int:
    return self.data * self.model

  def __str__(self) -> str:
    return f"{self.data}x{self.model}"


_SPEC = re.compile(r"^\s*(-1|\d+)\s*[xX]\s*(-1|\d+)\s*$")


def parse(spec: str, num_devices: int | None = None) -> MeshShape:
  """Parses `"DATAxMODEL"` (e.g. `"16x2"`, `"-1x2"`).

  Args:
    spec: the mesh string; one side may be -1 to fill from `num_devices`.
    num_devices: device count used to fill -1 (defaults to `jax.device_count()`).

  Returns:
    The MeshShape.

  Raises:
    ValueError: for a malformed spec, zero sizes, two -1s, or -1 that does not divide.
  """
  m = _SPEC.match(spec or "")
  if not m:
    raise ValueError(f"mesh {spec!r} is malformed: write DATAxMODEL, e.g. 16x2 or -1x2")
  data, model = int(m.group(1)), int(m.group(2))
  if data == 0 or model == 0:
    raise ValueError(f"mesh {spec!r} has a zero axis: both sizes must be >= 1 (or -1 to fill)")
  if data == -1 and model == -1:
    raise ValueError(f"mesh {spec!r}: only one axis may be -1")
  if -1 in (data, model):
    n = jax.device_count() if num_devices is None else num_devices
    other = model if data == -1 else data
    if n % other:
      raise ValueError(f"mesh {spec!r}: {n} devices do not divide by {other}; pick sizes that divide {n}")
    data, model = (n // other, model) if data == -1 else (data, n // other)
  return MeshShape(data, model)


def backend_started() -> bool:
  """Whether JAX has already initialised a backend (device flags can no longer change)."""
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)  # noqa: SLF001
  except Exception:  # pragma: no cover - private API moved
    return False


def simulate_cpu_devices(n: int) -> None:
  """Arranges `n` simulated CPU devices; must run before JAX starts its backend.

  For correctness only: simulated devices share the process's cores, so they say nothing about
  model-parallel speed (see experiments/bench/bench_mp.py for one-core-per-device timing).

  Raises:
    RuntimeError: if the backend has started with fewer devices.
  """
  if backend_started():
    if jax.device_count() >= n:
      return
    raise RuntimeError(
      f"JAX already started with {jax.device_count()} devices, {n} needed: call "
      "simulate_cpu_devices before any JAX computation, or set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
    )
  flags = os.environ.get("XLA_FLAGS", "")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  jax.config.update("jax_num_cpu_devices", n)


def make(shape: MeshShape | str, devices: list | None = None) -> Mesh:
  """Builds the (data, model) Mesh with Auto axis types (shard_map specs place the inputs).

  Args:
    shape: a MeshShape or a spec string.
    devices: devices to use (default: all of `jax.devices()`, in order).

  Raises:
    ValueError: if the mesh needs more devices than exist, with how to get them.
  """
  if isinstance(shape, str):
    shape = parse(shape, len(devices) if devices is not None else None)
  devs = list(jax.devices() if devices is None else devices)
  if shape.size > len(devs):
    platform = devs[0].platform if devs else "cpu"
    hint = (
      f"set XLA_FLAGS=--xla_force_host_platform_device_count={shape.size} (or call "
      "jaxhybrid.mesh.simulate_cpu_devices) before JAX starts"
      if platform == "cpu"
      else "use a smaller mesh or more hosts (jax.distributed)"
    )
    raise ValueError(f"mesh {shape} needs {shape.size} devices but {len(devs)} {platform} devices exist: {hint}")
  grid = np.array(devs[: shape.size], dtype=object).reshape(shape.data, shape.model)
  auto = jax.sharding.AxisType.Auto
  return Mesh(grid, AXES, axis_types=(auto, auto))


def init_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids: list[int] | None = None,
) -> None:
  """Joins a multi-host job through `jax.distributed.initialize` (arguments or environment).

  On the CPU backend, collectives between processes use gloo.
  """
  if coordinator_address is None and num_processes is None:
    return
  if jax.default_backend() == "cpu" if backend_started() else True:
    try:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # pragma: no cover - option name changed
      pass
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    local_device_ids=local_device_ids,
  )
