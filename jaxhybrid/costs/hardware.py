"""Hardware specs: compute, memory and interconnect of the machines the projection reasons about.

Every number is a fact with a source (cited per spec in `Hardware.source` and in the comments
below) or a named assumption (`efficiency`, latencies, launch overhead), never a hidden constant.
The local CPU is measured, not assumed (`measure_cpu`).

Bandwidths are bytes/s *per direction*; FLOP rates are FLOP/s for the dtype named in
`peak_flops_dtype`.

Example:
  >>> from jaxhybrid.costs import hardware
  >>> hw = hardware.get('dgx1-v100')
  >>> hw.bandwidth(0, 3) / 1e9   # two NVLink 2.0 links between GPU0 and GPU3
  50.0
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import tempfile
import time

import numpy as np

log = logging.getLogger(__name__)

# Measured costs (profiled node times, the measured CPU spec) are cached here, per backend and
# device kind, and reused across processes so plans are reproducible.
DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/jaxhybrid/profiles")
CACHE_ENV = "JAXHYBRID_PROFILE_CACHE"  # overrides DEFAULT_CACHE_DIR when set

_GB = 1e9  # vendor datasheets use decimal gigabytes
_GIB = 2**30

# NVLink 2.0 (V100): 25 GB/s per direction per link (NVIDIA Tesla V100 GPU Architecture
# whitepaper, WP-08608-001, "NVLink 2.0": 6 links x 50 GB/s bidirectional = 300 GB/s).
NVLINK2_LINK_BANDWIDTH = 25 * _GB

# Hybrid cube-mesh of the DGX-1 with V100 (NVIDIA DGX-1 With Tesla V100 System Architecture
# whitepaper, WP-08437-002, figure "DGX-1 uses an 8-GPU hybrid cube-mesh interconnection network
# topology"; the same matrix is what `nvidia-smi topo -m` prints on a DGX-1V as NV1/NV2).
# Entry [i][j] = number of NVLink 2.0 links between GPU i and GPU j. Two fully connected quads
# (0-3, 4-7) plus the "cube" edges i <-> i+4; every GPU uses its 6 links.
DGX1_V100_NVLINKS: tuple[tuple[int, ...], ...] = (
  # 0  1  2  3  4  5  6  7
  (0, 1, 1, 2, 2, 0, 0, 0),  # GPU0
  (1, 0, 2, 1, 0, 2, 0, 0),  # GPU1
  (1, 2, 0, 2, 0, 0, 1, 0),  # GPU2
  (2, 1, 2, 0, 0, 0, 0, 1),  # GPU3
  (2, 0, 0, 0, 0, 1, 1, 2),  # GPU4
  (0, 2, 0, 0, 1, 0, 2, 1),  # GPU5
  (0, 0, 1, 0, 1, 2, 0, 2),  # GPU6
  (0, 0, 0, 1, 2, 1, 2, 0),  # GPU7
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
  """One kind of node (a machine of identical accelerators) and its interconnect.

  Pairs of devices without a direct link (a zero in `link_bandwidth`, e.g. GPU0-GPU5 of the
  DGX-1 cube-mesh) are served by the best two-hop route through another device of the node
  (the bandwidth of the slower leg, the latency of both legs). Every node in this module is
  connected enough for such a route to exist; if none does, the host path
  (`host_bandwidth`, PCIe/system memory) is used. `bandwidth` therefore never returns 0.
  """

  name: str  # registry key: 'dgx1-v100', 'dgx-a100', 'dgx-h100', 'dgx-h200', 'cpu'
  device_kind: str  # the accelerator, as jax.Device.device_kind spells it
  peak_flops: float  # FLOP/s of one device for `peak_flops_dtype` (datasheet or measured)
  peak_flops_dtype: str = "float32"  # the dtype `peak_flops` is quoted for
  mem_bandwidth: float  # bytes/s of one device's memory (HBM / DRAM)
  memory_bytes: int  # memory of one device
  devices_per_node: int  # accelerators in one node
  link_bandwidth: tuple[tuple[float, ...], ...]  # bytes/s per direction, device pairs of a node
  link_alpha_s: float  # latency of one transfer between two devices of a node (assumption)
  nic_bandwidth: float  # bytes/s per direction per node to the network (all NICs together)
  nic_alpha_s: float  # latency of one transfer between nodes (assumption)
  op_overhead_s: float  # launch overhead added to every op by the roofline (assumption)
  efficiency: float = 0.5  # achieved fraction of peak FLOP/s and memory bandwidth (assumption:
  # dense fp32 DNN training kernels on V100/A100 class GPUs reach roughly 40-70 % of peak)
  switched: bool = False  # True when pairs connect through a switch (NVSwitch): a pair alone
  # gets the full per-device bandwidth, concurrent transfers share the device's links
  host_bandwidth: float = 16 * _GB  # bytes/s per direction of the last-resort host path
  # (PCIe 3.0 x16: 15.75 GB/s, PCI-SIG); only used if no NVLink route exists
  source: str  # citations for the numbers above

  def __post_init__(self):
    n = self.devices_per_node
    if n < 1:
      raise ValueError(f"devices_per_node={n} must be >= 1.")
    if len(self.link_bandwidth) != n or any(len(row) != n for row in self.link_bandwidth):
      raise ValueError(
        f"link_bandwidth of {self.name!r} must be a {n}x{n} matrix (devices_per_node={n})."
      )
    if not 0 < self.efficiency <= 1:
      raise ValueError(f"efficiency={self.efficiency} must be in (0, 1].")

  def _check(self, src: int, dst: int) -> None:
    n = self.devices_per_node
    if not (0 <= src < n and 0 <= dst < n):
      raise ValueError(
        f"devices ({src}, {dst}) out of range for {self.name!r}: use indices in [0, {n})."
      )

  def _route(self, src: int, dst: int) -> tuple[float, int]:
    """(bandwidth, hops) of the best route between two distinct devices of a node."""
    direct = self.link_bandwidth[src][dst]
    if direct > 0:
      return direct, 1
    two_hop = max(
      (
        min(self.link_bandwidth[src][k], self.link_bandwidth[k][dst])
        for k in range(self.devices_per_node)
        if k not in (src, dst)
      ),
      default=0.0,
    )
    if two_hop > 0:
      return two_hop, 2
    return self.host_bandwidth, 2

  def bandwidth(self, src: int, dst: int) -> float:
    """Bytes/s per direction from device `src` to device `dst` of one node.

    Args:
      src: index of the sending device inside the node.
      dst: index of the receiving device inside the node.

    Returns:
      The direct link bandwidth; for pairs without one, the best two-hop route (the slower leg);
      for `src == dst`, the device's own memory bandwidth (a local copy). Never 0.

    Raises:
      ValueError: if an index is outside [0, devices_per_node).
    """
    self._check(src, dst)
    if src == dst:
      return self.mem_bandwidth
    return self._route(src, dst)[0]

  def alpha(self, src: int, dst: int) -> float:
    """Latency in seconds of one transfer from `src` to `dst` (0 for a device to itself).

    Raises:
      ValueError: if an index is outside [0, devices_per_node).
    """
    self._check(src, dst)
    if src == dst:
      return 0.0
    return self.link_alpha_s * self._route(src, dst)[1]

  def achieved_flops(self) -> float:
    """FLOP/s the cost model assumes one device achieves: `peak_flops * efficiency`."""
    return self.peak_flops * self.efficiency


def _uniform(n: int, bw: float) -> tuple[tuple[float, ...], ...]:
  """An n x n all-to-all bandwidth matrix (a switched node) with zeros on the diagonal."""
  return tuple(tuple(0.0 if i == j else bw for j in range(n)) for i in range(n))


# Shared latency assumptions (not pinned down by the paper): a few microseconds per NVLink /
# NVSwitch transfer and about 10 us across InfiniBand including the NCCL protocol step, the
# order of magnitude NCCL's own tuning model uses; 5 us kernel launch overhead on a GPU.
_NVLINK_ALPHA_S = 5e-6
_IB_ALPHA_S = 10e-6
_GPU_LAUNCH_S = 5e-6


def _dgx1_v100() -> Hardware:
  return Hardware(
    name="dgx1-v100",
    device_kind="Tesla V100-SXM2-16GB",
    peak_flops=15.7e12,  # fp32, V100 SXM2 (NVIDIA Tesla V100 datasheet); 125e12 fp16 tensor
    peak_flops_dtype="float32",
    mem_bandwidth=900 * _GB,  # HBM2 (V100 datasheet)
    memory_bytes=16 * _GIB,  # the DGX-1 V100's 16 GB variant (a 32 GB one exists)
    devices_per_node=8,
    link_bandwidth=tuple(
      tuple(links * NVLINK2_LINK_BANDWIDTH for links in row) for row in DGX1_V100_NVLINKS
    ),
    link_alpha_s=_NVLINK_ALPHA_S,
    nic_bandwidth=4 * 100e9 / 8,  # 4x 100 Gb/s EDR InfiniBand per node (DGX-1 datasheet)
    nic_alpha_s=_IB_ALPHA_S,
    op_overhead_s=_GPU_LAUNCH_S,
    switched=False,
    source=(
      "NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2: 15.7 TFLOP/s fp32, 900 GB/s HBM2, "
      "16/32 GB, 300 GB/s NVLink); NVIDIA Tesla V100 GPU Architecture whitepaper WP-08608-001 "
      "(NVLink 2.0: 6 links x 25 GB/s per direction); NVIDIA DGX-1 With Tesla V100 System "
      "Architecture whitepaper WP-08437-002 (hybrid cube-mesh, 4x 100 Gb/s EDR InfiniBand)."
    ),
  )


def _dgx_a100() -> Hardware:
  return Hardware(
    name="dgx-a100",
    device_kind="NVIDIA A100-SXM4-40GB",
    peak_flops=19.5e12,  # fp32 non-tensor (A100 datasheet); TF32 tensor: 156e12
    peak_flops_dtype="float32",
    mem_bandwidth=1555 * _GB,  # HBM2, 40 GB SXM4 (A100 datasheet)
    memory_bytes=40 * _GIB,
    devices_per_node=8,
    # NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction per GPU, through 6 NVSwitches.
    link_bandwidth=_uniform(8, 300 * _GB),
    link_alpha_s=_NVLINK_ALPHA_S,
    nic_bandwidth=8 * 200e9 / 8,  # 8x 200 Gb/s HDR InfiniBand compute NICs (DGX A100 datasheet)
    nic_alpha_s=_IB_ALPHA_S,
    op_overhead_s=_GPU_LAUNCH_S,
    switched=True,
    source=(
      "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 19.5 TFLOP/s fp32, 1,555 GB/s, 600 GB/s "
      "NVLink bidirectional); NVIDIA DGX A100 System Architecture whitepaper (6 NVSwitches, "
      "8x ConnectX-6 200 Gb/s HDR InfiniBand)."
    ),
  )


def _dgx_h100() -> Hardware:
  return Hardware(
    name="dgx-h100",
    device_kind="NVIDIA H100 80GB HBM3",
    peak_flops=67e12,  # fp32 non-tensor, H100 SXM5 (H100 datasheet); TF32 tensor ~495e12 dense
    peak_flops_dtype="float32",
    mem_bandwidth=3350 * _GB,  # HBM3 (H100 SXM datasheet: 3.35 TB/s)
    memory_bytes=80 * _GIB,
    devices_per_node=8,
    # NVLink 4: 18 links, 900 GB/s bidirectional = 450 GB/s per direction, via 4 NVSwitches.
    link_bandwidth=_uniform(8, 450 * _GB),
    link_alpha_s=_NVLINK_ALPHA_S,
    nic_bandwidth=8 * 400e9 / 8,  # 8x 400 Gb/s ConnectX-7 NDR (DGX H100 datasheet)
    nic_alpha_s=_IB_ALPHA_S,
    op_overhead_s=_GPU_LAUNCH_S,
    switched=True,
    source=(
      "NVIDIA H100 Tensor Core GPU datasheet (SXM: 67 TFLOP/s fp32, 3.35 TB/s HBM3, 80 GB, "
      "900 GB/s NVLink); NVIDIA DGX H100 datasheet / DGX SuperPOD reference architecture "
      "(4 NVSwitches, 8x ConnectX-7 400 Gb/s)."
    ),
  )


def _dgx_h200() -> Hardware:
  return Hardware(
    name="dgx-h200",
    device_kind="NVIDIA H200",
    peak_flops=67e12,  # fp32 non-tensor, H200 SXM (H200 datasheet; same compute as H100 SXM)
    peak_flops_dtype="float32",
    mem_bandwidth=4800 * _GB,  # HBM3e (H200 datasheet: 4.8 TB/s)
    memory_bytes=141 * _GB,  # 141 GB (decimal, as the datasheet quotes it)
    devices_per_node=8,
    link_bandwidth=_uniform(8, 450 * _GB),  # NVLink 4 via NVSwitch, as DGX H100
    link_alpha_s=_NVLINK_ALPHA_S,
    nic_bandwidth=8 * 400e9 / 8,  # 8x 400 Gb/s ConnectX-7 (DGX H200 datasheet)
    nic_alpha_s=_IB_ALPHA_S,
    op_overhead_s=_GPU_LAUNCH_S,
    switched=True,
    source=(
      "NVIDIA H200 Tensor Core GPU datasheet (SXM: 67 TFLOP/s fp32, 4.8 TB/s HBM3e, 141 GB, "
      "900 GB/s NVLink); NVIDIA DGX H200 datasheet (NVSwitch, 8x ConnectX-7 400 Gb/s)."
    ),
  )


def _best_seconds(fn, reps: int) -> float:
  """Best wall time of `reps` calls of `fn` (the minimum filters out scheduler noise)."""
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def measure_cpu(
  *,
  matmul_size: int = 512,
  copy_bytes: int = 32 * 2**20,
  reps: int = 5,
  devices_per_node: int | None = None,
) -> Hardware:
  """Measures this machine's CPU and returns it as a `Hardware` spec (takes well under 2 s).

  Compute: the best time of a jitted float32 `matmul_size`^3 matmul on JAX's first CPU device
  (2 n^3 FLOP), i.e. what XLA achieves, not a vendor peak, so `efficiency` is 1. Memory: the best
  time of a numpy copy of `copy_bytes` (read + write = 2x the bytes moved). Devices of one node
  are the JAX CPU devices (simulated ones share memory, so device-to-device bandwidth is the copy
  bandwidth). Launch overhead: the best dispatch time of a tiny jitted op.

  Args:
    matmul_size: side of the square float32 matmul that is timed.
    copy_bytes: size of the buffer copied to time memory bandwidth.
    reps: repetitions of each measurement; the fastest is kept.
    devices_per_node: number of CPU devices of the node; default: `len(jax.devices('cpu'))`.

  Returns:
    The measured spec, named 'cpu'.
  """
  figures = _measure_cpu_figures(matmul_size=matmul_size, copy_bytes=copy_bytes, reps=reps)
  return _cpu_spec(figures, devices_per_node)


def _measure_cpu_figures(*, matmul_size: int, copy_bytes: int, reps: int) -> dict:
  """The timings behind `measure_cpu`, as a JSON-able dict."""
  import jax  # deferred: importing this module must not start a JAX backend
  import jax.numpy as jnp

  cpu = jax.devices("cpu")[0]
  n = matmul_size
  a = jax.device_put(np.ones((n, n), np.float32), cpu)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()  # compile
  t_mm = _best_seconds(lambda: matmul(a).block_until_ready(), reps)
  flops = 2.0 * n**3 / t_mm

  src = np.ones(copy_bytes // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # touch the pages first
  t_copy = _best_seconds(lambda: np.copyto(dst, src), reps)
  mem_bw = 2.0 * src.nbytes / t_copy  # a copy reads and writes every byte

  tiny = jax.jit(lambda x: x + 1)
  one = jax.device_put(jnp.zeros((), jnp.float32), cpu)
  tiny(one).block_until_ready()
  t_op = _best_seconds(lambda: tiny(one).block_until_ready(), 4 * reps)

  figures = {
    "device_kind": cpu.device_kind, "flops": flops, "mem_bw": mem_bw,
    "link_bw": src.nbytes / t_copy,
    "t_op": t_op, "t_mm": t_mm, "t_copy": t_copy, "n": n, "copy_bytes": copy_bytes, "reps": reps,
  }
  log.info(
    "measured cpu: %.1f GFLOP/s, %.1f GB/s memory, %.1f us/op", flops / 1e9, mem_bw / 1e9,
    t_op * 1e6,
  )
  return figures


def _cpu_spec(f: dict, devices_per_node: int | None) -> Hardware:
  """The 'cpu' spec from measured figures (see `measure_cpu`)."""
  import jax  # deferred: importing this module must not start a JAX backend

  if devices_per_node is None:
    devices_per_node = len(jax.devices("cpu"))
  link_bw = f["link_bw"]  # device-to-device = one copy through shared memory
  t_op = f["t_op"]
  try:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    memory = 0
  return Hardware(
    name="cpu",
    device_kind=f["device_kind"],
    peak_flops=f["flops"],
    peak_flops_dtype="float32",
    mem_bandwidth=f["mem_bw"],
    memory_bytes=int(memory),
    devices_per_node=devices_per_node,
    link_bandwidth=_uniform(devices_per_node, link_bw),
    link_alpha_s=t_op,  # a transfer between CPU devices costs about one dispatch
    nic_bandwidth=link_bw,  # no network: a single-host machine; kept finite for formulas
    nic_alpha_s=t_op,
    op_overhead_s=t_op,
    efficiency=1.0,  # peak_flops is already what was achieved
    switched=True,
    host_bandwidth=link_bw,
    source=(
      f"measured on this machine by jaxhybrid.costs.hardware.measure_cpu: jitted float32 "
      f"{f['n']}^3 matmul {f['t_mm'] * 1e3:.2f} ms, numpy copy of {f['copy_bytes'] / 2**20:.0f} "
      f"MiB {f['t_copy'] * 1e3:.2f} ms, tiny jitted op dispatch {t_op * 1e6:.1f} us (best of "
      f"{f['reps']})" + (f"; cached in {f['cached_in']}" if f.get("cached_in") else "") + "."
    ),
  )


def _cpu_cache_path():
  import jax  # deferred: importing this module must not start a JAX backend

  root = pathlib.Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE_DIR)).expanduser()
  kind = "".join(c if c.isalnum() or c in "-_." else "_" for c in jax.devices("cpu")[0].device_kind)
  return root / f"hardware-cpu-{kind}.json"


def measured_cpu_cached(path: pathlib.Path | None = None) -> Hardware:
  """The 'cpu' spec, measured once per machine: read from the profile cache, else measured and
  stored there (`$JAXHYBRID_PROFILE_CACHE`, default `~/.cache/jaxhybrid/profiles`), so plans on
  CPU costs are the same in every process. Delete the file to measure again."""
  path = path or _cpu_cache_path()
  try:
    figures = json.loads(path.read_text())
    if figures.get("schema") == 1:
      return _cpu_spec({**figures, "cached_in": str(path)}, None)
  except (OSError, ValueError, KeyError):
    pass
  figures = _measure_cpu_figures(matmul_size=512, copy_bytes=32 * 2**20, reps=5)
  hw = _cpu_spec(figures, None)
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
      json.dump({"schema": 1, **figures}, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
  except OSError as e:
    log.warning("could not cache the measured cpu spec in %s: %s", path, e)
  return hw


@functools.cache
def _measured_cpu() -> Hardware:
  return measured_cpu_cached()


_REGISTRY = {
  "dgx1-v100": _dgx1_v100,
  "dgx-a100": _dgx_a100,
  "dgx-h100": _dgx_h100,
  "dgx-h200": _dgx_h200,
  "cpu": _measured_cpu,
}


def names() -> tuple[str, ...]:
  """The names `get` accepts."""
  return tuple(_REGISTRY)


def get(name: str) -> Hardware:
  """Returns the spec called `name`; 'cpu' is measured once per machine and cached on disk
  (`measured_cpu_cached`).

  Raises:
    ValueError: if `name` is not one of `names()`.
  """
  if name not in _REGISTRY:
    raise ValueError(f"Unknown hardware {name!r}; use one of {', '.join(names())}.")
  return _REGISTRY[name]()
