"""The gradient exchange of the analytical framework (`framework`): how the all-reduce is
modelled (`CommConfig`), its time over the hardware's topology (`allreduce_time`: a flat ring
whose bottleneck is the slower of the node's NVLink ring and its NICs, or hierarchically, or the
faster of the two), which (data, model) layouts a machine can hold (`check_layout`), and the part
of the exchange the backward pass does not hide (`exposed_comm_s`, ZeRO stages included).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from jaxhybrid.costs import hardware as hw_lib


# --- Communication ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
  """How the gradient all-reduce is modelled (none of it is pinned down by the paper)."""

  overlap: float = 0.0  # fraction of the all-reduce hidden behind the backward pass (0: exposed)
  link_efficiency: float = 0.8  # achieved fraction of NVLink bandwidth (assumption: NCCL reaches
  # ~120-130 GB/s bus bandwidth of the DGX-1V's 150 GB/s per GPU)
  nic_efficiency: float = 0.8  # achieved fraction of InfiniBand bandwidth (assumption)
  algorithm: str = "auto"  # 'ring' (flat), 'hierarchical', or 'auto' (the faster of the two)
  # ZeRO stage over the data axis (jaxhybrid.program.HybridProgram.zero). 0: one all-reduce,
  # `overlap` of it hidden. 1: its two halves at the same bytes, a reduce-scatter (`overlap` of
  # it hidden behind the backward pass) and an all-gather of the updated parameters, which runs
  # after the optimizer and is never hidden (assumption: the next step's forward does not start
  # before it ends, as in our program). 2: a reduce-scatter per micro-batch (`reduce_scatters`
  # of them, `overlap` of each hidden) and the all-gather.
  zero: int = 0
  # Gradient reduce-scatters per step under ZeRO stage 2: the program reduce-scatters each
  # micro-batch's gradients as they are made, so its micro-batches per step.
  reduce_scatters: int = 1

  def __post_init__(self):
    if not 0 <= self.overlap <= 1:
      raise ValueError(f"overlap={self.overlap} must be in [0, 1].")
    for name in ("link_efficiency", "nic_efficiency"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"{name}={getattr(self, name)} must be in (0, 1].")
    if self.zero not in (0, 1, 2):
      raise ValueError(f"zero={self.zero}; use 0, 1 or 2.")
    if self.reduce_scatters < 1:
      raise ValueError(f"reduce_scatters={self.reduce_scatters}; use 1 or more.")
    if self.algorithm not in ("ring", "hierarchical", "auto"):
      raise ValueError(f"algorithm={self.algorithm!r}; use 'ring', 'hierarchical' or 'auto'.")


@functools.lru_cache(maxsize=4096)
def intra_node_bus_bandwidth(hw: hw_lib.Hardware, devices: tuple[int, ...]) -> float:
  """Bytes/s each device can push into an all-reduce among `devices` of one node (peak).

  Switched nodes: the per-device link bandwidth. Point-to-point meshes (the DGX-1 cube-mesh): the
  smallest total bandwidth of a member's direct links to the other members, the bound that
  several concurrent rings over disjoint links reach (NCCL builds such rings on the DGX-1), but at
  least the best single ring through `hw.bandwidth` (two-hop routes for missing links).

  Returns:
    Bytes/s per device; infinity for fewer than two devices (no communication).
  """
  if len(devices) < 2:
    return math.inf
  if hw.switched:
    return min(hw.bandwidth(i, j) for i in devices for j in devices if i != j)
  degree = min(sum(hw.link_bandwidth[d][e] for e in devices if e != d) for d in devices)
  first, rest = devices[0], devices[1:]
  best_ring = 0.0
  for order in itertools.permutations(rest):
    cycle = (first, *order, first)
    best_ring = max(best_ring, min(hw.bandwidth(a, b) for a, b in itertools.pairwise(cycle)))
  return max(degree, best_ring)


def allreduce_time(
  bytes_per_device: float,
  devices: int,
  hw: hw_lib.Hardware,
  comm: CommConfig = CommConfig(),
  *,
  devices_per_worker: int = 1,
) -> float:
  """Seconds to all-reduce the gradients of W = devices / devices_per_worker workers.

  Layout: devices fill nodes in order; a worker is `devices_per_worker` consecutive devices of one
  node; model-axis index j of every worker joins the all-reduce of shard j (`bytes_per_device`).

  Args:
    bytes_per_device: gradient bytes each device contributes (P for DP, about P / M for hybrid).
    devices: N, all devices.
    hw: the node type.
    comm: algorithm and efficiency assumptions.
    devices_per_worker: M.

  Returns:
    The full all-reduce time (before any overlap with the backward pass).

  Raises:
    ValueError: for a layout that does not fit (M not dividing N, or M not dividing the devices
      of a node when several nodes are used, or M larger than a node).
  """
  m = devices_per_worker
  check_layout(devices, m, hw)
  workers = devices // m
  if workers == 1 or bytes_per_device == 0:
    return 0.0
  per_node = min(devices, hw.devices_per_node)
  g = per_node // m  # members of one data ring inside a node
  nodes = math.ceil(workers / g)
  groups = [tuple(range(j, per_node, m))[:g] for j in range(m)]
  intra = min(intra_node_bus_bandwidth(hw, grp) for grp in groups) * comm.link_efficiency
  link_alpha = hw.link_alpha_s  # the multi-ring bandwidth model uses direct links (one hop)
  nic = hw.nic_bandwidth * comm.nic_efficiency  # shared by the m concurrent all-reduces
  s = bytes_per_device

  # Flat ring over all W workers (per model index); between nodes the m rings share the NICs.
  bw_flat = intra if nodes == 1 else min(intra, nic / m)
  alpha_flat = link_alpha if nodes == 1 else max(link_alpha, hw.nic_alpha_s)
  t_flat = 2 * (workers - 1) * alpha_flat + 2 * (workers - 1) / workers * s / bw_flat
  if nodes == 1 or g == 1 or comm.algorithm == "ring":
    return t_flat
  # Hierarchical: reduce-scatter over g in the node, all-reduce of the 1/g shards between the
  # nodes (g * m concurrent rings through the NICs: 2 (n-1)/n * s * m bytes leave each node),
  # all-gather over g in the node.
  t_intra = 2 * ((g - 1) * link_alpha + (g - 1) / g * s / intra)
  t_inter = 2 * (nodes - 1) * hw.nic_alpha_s + 2 * (nodes - 1) / nodes * s * m / nic
  t_hier = t_intra + t_inter
  if comm.algorithm == "hierarchical":
    return t_hier
  return min(t_flat, t_hier)


def check_layout(devices: int, devices_per_worker: int, hw: hw_lib.Hardware) -> None:
  """Raises ValueError unless N devices split into workers of M devices inside nodes."""
  n, m = devices, devices_per_worker
  if n < 1 or m < 1:
    raise ValueError(f"devices={n} and devices_per_worker={m} must be >= 1.")
  if n % m:
    raise ValueError(f"devices={n} is not a multiple of devices_per_worker={m}.")
  if m > hw.devices_per_node:
    raise ValueError(
      f"devices_per_worker={m} exceeds the {hw.devices_per_node} devices of a {hw.name} node; "
      "model parallelism across nodes is not modelled."
    )
  if n > hw.devices_per_node and hw.devices_per_node % m:
    raise ValueError(
      f"devices_per_worker={m} must divide the {hw.devices_per_node} devices of a node."
    )


def exposed_comm_s(t_ar: float, comm: CommConfig) -> float:
  """The part of a step's gradient exchange (`t_ar`: the ring all-reduce's time) the backward
  pass does not hide: all of it but `overlap` for an all-reduce; under ZeRO stage 1 the
  reduce-scatter half hidden likewise, the all-gather half never; under stage 2 one such
  reduce-scatter per micro-batch (see CommConfig.zero)."""
  if comm.zero:
    scatters = comm.reduce_scatters if comm.zero == 2 else 1
    return (1.0 - comm.overlap) * scatters * t_ar / 2 + t_ar / 2
  return (1.0 - comm.overlap) * t_ar
