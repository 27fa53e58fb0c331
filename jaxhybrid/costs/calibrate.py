"""Measurements on the current backend that check or feed the cost model.

- `calibrate_link`: fits a link's latency and bandwidth (`costs.Link`) from timed `ppermute`s of a
  few message sizes: `t(n) = alpha + n / bandwidth` by relative least squares (`fit_link`; the
  alpha-beta model of PAPER.md; Hockney 1994).
- `predict_vs_measure`: a cost model's predicted single-device step time (sum of node times)
  next to the measured jitted forward + backward step, with the relative error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxhybrid import graph as graph_lib
from jaxhybrid import mesh as mesh_lib
from jaxhybrid.costs import cost_model as costs_lib
from jaxhybrid.costs import links

log = logging.getLogger(__name__)

# Message bytes per device, 1 KiB .. 4 MiB, every factor of 4: a pipeline's messages lie between
# (one activation or cotangent of a micro-batch, ~0.1-1 MiB for the bench models).
DEFAULT_SIZES = tuple(2**e for e in range(10, 23, 2))


def fit_link(sent: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
  """(alpha seconds, seconds per byte) of `t = alpha + n * s` fitted to message sizes and times
  by least squares on RELATIVE residuals (each point weighted by 1 / t): the latency is then
  pinned by the small messages and the per-byte time by the large ones. Unweighted, the large
  messages' times set the line: three bench_mp calibrations of one machine (four sizes, 1 KiB-4
  MiB) read latencies of 0.95, 0.85 and 1.63 ms with 3.3, 2.2 and 9.9 GB/s."""
  n, t = np.asarray(sent, np.float64), np.asarray(times, np.float64)
  slope, intercept = np.polyfit(n, t, 1, w=1.0 / np.maximum(t, 1e-12))
  return float(intercept), float(slope)


def calibrate_link(
  mesh_or_devices: Mesh | Sequence[jax.Device],
  *,
  axis: str = mesh_lib.MODEL,
  sizes: Sequence[int] = DEFAULT_SIZES,
  warmup: int = 2,
  repeats: int = 5,
) -> links.Link:
  """Fits `alpha + n / bandwidth` to timed ring `ppermute`s along one mesh axis.

  Every device sends `n` bytes to the next one along `axis` at once, so the fit is of a link
  under a full ring's load (what a pipeline's activation exchange and a ring all-reduce see).

  Args:
    mesh_or_devices: a (data, model) Mesh from `jaxhybrid.mesh`, or devices to put on the model
      axis of a 1 x len(devices) mesh.
    axis: the mesh axis along which messages move.
    sizes: message sizes in bytes per device (at least two distinct).
    warmup: untimed runs per size (the first compiles).
    repeats: timed runs per size; the median is kept. A fixed count, not a least time: every
      process of a multi-process job must make the same calls (collectives), and a time
      budget ends at different counts in different processes (it deadlocked two pinned ones).

  Returns:
    The fitted `costs.Link`, its `source` naming the backend, device kind and sizes.

  Raises:
    ValueError: for fewer than 2 devices on `axis`, fewer than 2 sizes, or an unknown axis.
  """
  mesh, sizes, sent, times = ring_times(mesh_or_devices, axis=axis, sizes=sizes, warmup=warmup,
                                        repeats=repeats)
  intercept, slope = fit_link(sent, times)
  if slope <= 0:
    log.warning("ppermute times do not grow with size (%s): bandwidth fit unreliable", times)
    slope = max(float(np.max(times)) / sent[-1], 1e-15)
  dev = mesh.devices.flat[0]
  link = links.Link(
    alpha_s=max(float(intercept), 0.0),
    bandwidth_bytes_s=float(1.0 / slope),
    source=(
      f"calibrate_link: ring ppermute over {mesh.shape[axis]} {dev.platform} devices "
      f"({dev.device_kind}), "
      f"sizes {sizes} B, median of {repeats}: times {[f'{t * 1e6:.1f}us' for t in times]}"
    ),
  )
  log.info(
    "calibrated link: alpha %.2f us, %.2f GB/s", link.alpha_s * 1e6, link.bandwidth_bytes_s / 1e9
  )
  return link


def ring_times(
  mesh_or_devices: Mesh | Sequence[jax.Device], *, axis: str = mesh_lib.MODEL,
  sizes: Sequence[int] = DEFAULT_SIZES, warmup: int = 2, repeats: int = 5,
) -> tuple[Mesh, list[int], list[float], list[float]]:
  """(mesh, sorted distinct sizes, bytes each device sent, median seconds) of ring `ppermute`s
  of each size along `axis` (`calibrate_link`'s measurement; arguments as there)."""
  if isinstance(mesh_or_devices, Mesh):
    mesh = mesh_or_devices
  else:
    devs = list(mesh_or_devices)
    mesh = mesh_lib.make(mesh_lib.MeshShape(1, len(devs)), devs)
  if axis not in mesh.axis_names:
    raise ValueError(f"axis {axis!r} is not in the mesh {mesh.axis_names}: pass one of them.")
  n_dev = mesh.shape[axis]
  if n_dev < 2:
    raise ValueError(f"calibrate_link needs >= 2 devices on axis {axis!r}, got {n_dev}.")
  sizes = sorted({int(s) for s in sizes})
  if len(sizes) < 2:
    raise ValueError(f"sizes={sizes}: give at least two distinct message sizes to fit a line.")
  perm = [(i, (i + 1) % n_dev) for i in range(n_dev)]
  spec = P(*mesh.axis_names)
  times = []
  for nbytes in sizes:
    n = max(nbytes // 4, 1)
    shape = tuple(mesh.shape[a] for a in mesh.axis_names) + (n,)
    x = jax.device_put(
      jnp.ones(shape, jnp.float32), jax.sharding.NamedSharding(mesh, P(*mesh.axis_names))
    )
    step = jax.jit(
      jax.shard_map(
        lambda b: jax.lax.ppermute(b, axis, perm), mesh=mesh, in_specs=spec, out_specs=spec
      )
    )
    times.append(costs_lib.median_time_s(lambda: step(x), warmup=warmup, repeats=repeats))
  sent = [float(max(s // 4, 1) * 4) for s in sizes]
  return mesh, sizes, sent, times


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepComparison:
  """A predicted single-device step time next to the measured one."""

  predicted_s: float  # the cost model's sum of node times (forward + backward)
  measured_s: float  # median wall time of the jitted value_and_grad step
  relative_error: float  # (predicted - measured) / measured; > 0 means over-predicted
  source: str  # the cost model's source ('analytic' | 'profiled')
  hardware_name: str  # the cost model's hardware
  backend: str  # where the measurement ran
  device_kind: str  # the device the measurement ran on

  def __str__(self) -> str:
    return (
      f"step time: predicted {self.predicted_s * 1e3:.3f} ms ({self.source}, {self.hardware_name})"
      f", measured {self.measured_s * 1e3:.3f} ms ({self.backend}, {self.device_kind}), "
      f"error {self.relative_error:+.1%}"
    )


def measure_step_s(
  fn: Callable[[Any, Any, Any], jax.Array], params: Any, state: Any, batch: Any,
  *, warmup: int = 2, repeats: int = 5,
) -> float:
  """Median seconds of one jitted `jax.value_and_grad(fn)` call (forward + backward, no update)."""
  step = jax.jit(jax.value_and_grad(fn))
  return costs_lib.median_time_s(lambda: step(params, state, batch), warmup=warmup, repeats=repeats)


def predict_vs_measure(
  graph: graph_lib.OpGraph,
  costs: costs_lib.CostModel,
  fn: Callable[[Any, Any, Any], jax.Array],
  params: Any,
  state: Any,
  batch: Any,
  *,
  warmup: int = 2,
  repeats: int = 5,
) -> StepComparison:
  """Compares `costs.step_time_s(graph)` with the measured jitted step of `fn` on one device.

  Args:
    graph: the graph traced from `fn` (e.g. by `graph.trace`).
    costs: the cost model to check.
    fn: the pure loss `fn(params, state, batch) -> scalar` (e.g. from `graph.nnx_pure_loss`).
    params, state, batch: concrete inputs, on the device to measure.
    warmup: untimed runs (the first compiles).
    repeats: timed runs; the median is kept.

  Returns:
    The StepComparison.
  """
  predicted = costs.step_time_s(graph)
  measured = measure_step_s(fn, params, state, batch, warmup=warmup, repeats=repeats)
  dev = jax.devices()[0]
  return StepComparison(
    predicted_s=predicted,
    measured_s=measured,
    relative_error=(predicted - measured) / measured,
    source=costs.source,
    hardware_name=costs.hardware_name,
    backend=jax.default_backend(),
    device_kind=dev.device_kind,
  )
