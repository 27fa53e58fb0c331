"""Link models and the alpha-beta formulas for transfers and ring all-reduces.

A message of n bytes between two devices takes `alpha + n / bandwidth`; a ring all-reduce of P
bytes over W workers takes `2 (W - 1) alpha + 2 (W - 1) / W * P / bandwidth` (PAPER.md;
Patarasuk & Yuan 2009; Thakur et al. 2005). A link is a `hardware.Hardware` spec or a `Link`
(e.g. fitted by `calibrate.calibrate_link`); both satisfy `Interconnect`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol


class Interconnect(Protocol):
  """What transfer costs need of a link model; `hardware.Hardware` and `Link` both provide it."""

  def alpha(self, src: int, dst: int) -> float: ...

  def bandwidth(self, src: int, dst: int) -> float: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
  """A uniform link between any two devices (e.g. fitted by `calibrate.calibrate_link`)."""

  alpha_s: float  # latency of one message, seconds
  bandwidth_bytes_s: float  # bytes/s per direction
  source: str = ""  # where the numbers come from (measurement, backend, device kind)

  def __post_init__(self):
    if self.alpha_s < 0 or not self.bandwidth_bytes_s > 0:
      raise ValueError(
        f"Link(alpha_s={self.alpha_s}, bandwidth_bytes_s={self.bandwidth_bytes_s}): the latency "
        "must be >= 0 and the bandwidth > 0."
      )

  def alpha(self, src: int, dst: int) -> float:
    return 0.0 if src == dst else self.alpha_s

  def bandwidth(self, src: int, dst: int) -> float:
    return self.bandwidth_bytes_s


def _pair(link: Interconnect, src: int, dst: int) -> tuple[float, float]:
  """(alpha, bandwidth) between two devices; devices past one node cross the NIC."""
  per_node = getattr(link, "devices_per_node", None)
  if per_node is not None and src // per_node != dst // per_node:
    return link.nic_alpha_s, link.nic_bandwidth
  if per_node is not None:
    src, dst = src % per_node, dst % per_node
  return link.alpha(src, dst), link.bandwidth(src, dst)


def transfer_time_s(link: Interconnect, nbytes: float, src: int, dst: int) -> float:
  """Time to send `nbytes` from device `src` to `dst`: `alpha + nbytes / bandwidth`, 0 if same.

  Raises:
    ValueError: for negative `nbytes` or device indices.
  """
  if nbytes < 0 or src < 0 or dst < 0:
    raise ValueError(f"transfer of {nbytes} bytes {src}->{dst}: sizes and devices must be >= 0.")
  if src == dst:
    return 0.0
  alpha, bw = _pair(link, src, dst)
  return alpha + nbytes / bw


def ring_allreduce_time_s(nbytes: float, workers: int, alpha_s: float, bandwidth: float) -> float:
  """Ring all-reduce: `2 (W - 1) alpha + 2 (W - 1) / W * P / BW` (PAPER.md; Patarasuk & Yuan 2009).

  Raises:
    ValueError: if `workers` < 1 or `nbytes` < 0.
  """
  if workers < 1:
    raise ValueError(f"workers={workers}: an all-reduce needs at least one worker.")
  if nbytes < 0:
    raise ValueError(f"nbytes={nbytes} must be >= 0.")
  w = workers
  return 2 * (w - 1) * alpha_s + 2 * (w - 1) / w * nbytes / bandwidth


def ring_bottleneck(link: Interconnect, workers: int) -> tuple[float, float]:
  """(alpha, bandwidth) of the slowest hop of the best ring over devices 0..workers-1.

  Workers are assumed to be consecutive devices filling nodes. Inside one node the ring order
  that maximises the slowest hop is searched (exhaustively up to 8 devices, which covers the
  DGX-1's cube-mesh where the naive order 0..7 hits a missing link); a ring across nodes is
  limited by the NIC. One ring is modelled; NCCL may run several at once (pass a `Link` with
  the measured bus bandwidth to account for that).
  """
  per_node = getattr(link, "devices_per_node", None)
  if per_node is not None and workers > per_node:
    inside = ring_bottleneck(link, per_node)
    return max(inside[0], link.nic_alpha_s), min(inside[1], link.nic_bandwidth)
  devices = list(range(workers))

  def hops(order):
    ring = list(order) + [order[0]]
    return [_pair(link, a, b) for a, b in zip(ring, ring[1:])]

  orders = (
    ((0,) + p for p in itertools.permutations(devices[1:])) if workers <= 8 else [tuple(devices)]
  )
  best = None
  for order in orders:
    h = hops(order)
    key = (min(bw for _, bw in h), -max(a for a, _ in h))
    if best is None or key > best[0]:
      best = (key, h)
  h = best[1]
  return max(a for a, _ in h), min(bw for _, bw in h)
