"""Analytical time-to-accuracy projection: data parallelism (DP) versus hybrid DP x MP at scale.

Follows the framework of Pal et al. 2019 as written down in PAPER.md ("The analytical framework"):
N devices, M devices per worker, W = N / M workers, per-worker batch b, global batch B = W b.

  T_step(N)        = T_comp(b) + (1 - overlap) T_ar(N workers)                      (DP)
  T_step_hyb(W)    = T_comp(b) / S_MP(M) + (1 - overlap) T_ar(W workers, P / M each)  (hybrid)
  T_ar(W)          = 2 (W - 1) alpha + 2 (W - 1) / W * P / BW_bottleneck        (ring, alpha-beta)
  S_DP(N)          = N T_step(1) / T_step(N) * SE(N b)
  S_hyb(N, M)      = W T_step(1) / T_step_hyb(W) * SE(W b)
  T_train(N, M)    = E(B) (D / B) T_step = T_train(1, 1) / S                 (time-to-accuracy)
  crossover N*     = the smallest N with S_hyb(N, M) >= S_DP(N)

T_step(1) = T_comp(b): one device, no communication. SE curves live in `jaxhybrid.projection.stat_eff`.

The all-reduce runs over the hardware's topology (`jaxhybrid.costs.hardware`): a flat ring whose
bottleneck is the slower of the node's NVLink ring and the node's NICs, or hierarchically
(reduce-scatter inside the node, all-reduce of the shards between nodes, all-gather inside), or
whichever is faster ('auto'). Under hybrid parallelism the M devices of a worker own disjoint
parameter shards, so M all-reduces of P / M bytes run at once, one per model-axis index, over the
devices holding that index; they share the node's NICs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxhybrid.costs import hardware as hw_lib
from jaxhybrid.projection import stat_eff
from jaxhybrid.projection.comm import (  # noqa: F401 (re-exported: framework's names before)
  CommConfig,
  allreduce_time,
  check_layout,
  exposed_comm_s,
  intra_node_bus_bandwidth,
)

_REL_TOL = 1e-9  # S_hyb >= S_DP is tested with this relative slack (float rounding)


# --- Compute time per step -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredStepTime:
  """T_comp(b) from measured (per-worker batch, seconds) points, log-log interpolated.

  One point means that time at every batch; several are interpolated in log-log space and the end
  segments extended outside their range.
  """

  points: tuple[tuple[float, float], ...]  # (per-worker batch b, seconds per step on one device)
  source: str = ""  # where the times come from (device kind, run, profile)

  def __post_init__(self):
    object.__setattr__(
      self, "points", stat_eff._check_points(self.points, "MeasuredStepTime")  # noqa: SLF001
    )

  def __call__(self, batch: float) -> float:
    return stat_eff._loglog_interp(  # noqa: SLF001
      batch, [b for b, _ in self.points], [t for _, t in self.points]
    )

  def describe(self) -> str:
    pts = ", ".join(f"b={b:g}: {t * 1e3:.2f} ms" for b, t in self.points)
    return f"measured step time ({pts})" + (f" [{self.source}]" if self.source else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlopStepTime:
  """T_comp(b) = b * train_flops_per_sample / achieved_flops + overhead_s (a compute roofline)."""

  train_flops_per_sample: float  # forward + backward FLOPs of one sample
  achieved_flops: float  # FLOP/s one device sustains (peak * efficiency)
  overhead_s: float = 0.0  # batch-independent time per step (launches, optimizer)
  source: str = ""  # derivation of the FLOP count

  def __post_init__(self):
    if self.train_flops_per_sample <= 0 or self.achieved_flops <= 0 or self.overhead_s < 0:
      raise ValueError(
        f"FlopStepTime needs positive FLOPs and FLOP/s and overhead >= 0, got "
        f"{self.train_flops_per_sample}, {self.achieved_flops}, {self.overhead_s}."
      )

  def __call__(self, batch: float) -> float:
    return batch * self.train_flops_per_sample / self.achieved_flops + self.overhead_s

  def describe(self) -> str:
    return (
      f"{self.train_flops_per_sample / 1e9:.2f} GFLOP/sample at "
      f"{self.achieved_flops / 1e12:.2f} TFLOP/s achieved"
      + (f" [{self.source}]" if self.source else "")
    )


StepTime = MeasuredStepTime | FlopStepTime | Callable[[float], float]


# --- The workload ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """Everything the projection needs to know about one model's training run."""

  name: str  # model name, for tables and JSON
  per_worker_batch: int  # b: samples per worker per step (kept fixed as N grows)
  step_time: StepTime  # T_comp(b) on one device, seconds
  grad_bytes: float  # P: gradient bytes all-reduced per step by a DP worker
  se: stat_eff.SECurve  # SE(B): statistical efficiency versus global batch
  s_mp: tuple[tuple[int, float], ...] = ()  # (M, S_MP(M)) known model-parallel speedups
  s_mp_source: tuple[tuple[int, str], ...] = ()  # (M, where S_MP(M) comes from): one per s_mp
  # entry ('planner: ...', 'paper: ...', 'user: ...'; see projection.s_mp.SMPEstimate)
  mp_grad_share: tuple[tuple[int, float], ...] = ()  # (M, largest share of P one device of a
  # worker holds); default 1/M (parameters balanced across the worker's devices; assumption)
  dataset_size: float | None = None  # D samples per epoch (only scales time-to-accuracy)
  epochs_at_base: float | None = None  # E(b): epochs to the target at global batch b (ditto)
  assumptions: tuple[tuple[str, str], ...] = ()  # (name, value and why) of every assumption

  def __post_init__(self):
    if self.per_worker_batch < 1 or self.grad_bytes < 0:
      raise ValueError(
        f"per_worker_batch={self.per_worker_batch} must be >= 1 and grad_bytes={self.grad_bytes} "
        ">= 0."
      )
    for m, s in self.s_mp:
      if m < 1 or s <= 0:
        raise ValueError(f"s_mp entry ({m}, {s}): need M >= 1 and S_MP > 0.")
    missing = sorted({m for m, _ in self.s_mp} - {m for m, _ in self.s_mp_source})
    if missing:
      raise ValueError(
        f"Workload {self.name!r}: S_MP for M={missing} has no source; pass s_mp_source "
        "(e.g. Workload.with_s_mp(estimates)) saying where each S_MP comes from."
      )

  def with_s_mp(self, estimates: Sequence[Any]) -> Workload:
    """A copy whose S_MP table is `estimates` (`projection.s_mp.SMPEstimate`s), with sources."""
    return dataclasses.replace(
      self,
      s_mp=tuple((e.m, e.s_mp) for e in estimates),
      s_mp_source=tuple((e.m, e.source) for e in estimates),
    )

  def s_mp_source_of(self, m: int) -> str:
    """Where S_MP(M) comes from ('' for M = 1, which needs none)."""
    return dict(self.s_mp_source).get(m, "")

  def speedup_mp(self, m: int) -> float:
    """S_MP(M); 1 for M = 1. Raises ValueError if M has no known speedup."""
    if m == 1:
      return 1.0
    known = dict(self.s_mp)
    if m not in known:
      raise ValueError(
        f"No S_MP for M={m} in workload {self.name!r} (known: {sorted(known)}); pass it in s_mp."
      )
    return known[m]

  def bytes_per_device(self, m: int) -> float:
    return self.grad_bytes * dict(self.mp_grad_share).get(m, 1.0 / m)


def step_time(w: Workload, devices: int, m: int, hw: hw_lib.Hardware, comm: CommConfig) -> float:
  """T_step (m = 1) or T_step_hyb (m > 1) at N = `devices`, seconds."""
  check_layout(devices, m, hw)
  t_comp = w.step_time(w.per_worker_batch) / w.speedup_mp(m)
  t_ar = allreduce_time(w.bytes_per_device(m), devices, hw, comm, devices_per_worker=m)
  return t_comp + exposed_comm_s(t_ar, comm)


def speedup(w: Workload, devices: int, m: int, hw: hw_lib.Hardware, comm: CommConfig) -> float:
  """S_DP(N) for m = 1, S_hyb(N, M) for m > 1: time-to-accuracy speedup over one device."""
  workers = devices // m
  t1 = w.step_time(w.per_worker_batch)  # T_step(1): one device, no communication
  b = w.per_worker_batch
  return workers * t1 / step_time(w, devices, m, hw, comm) * w.se.se(workers * b, b)


def single_device_time_to_accuracy(w: Workload) -> float | None:
  """T_train(1, 1) = E(b) * D / b * T_comp(b) in seconds, if D and E(b) are known."""
  if w.dataset_size is None or w.epochs_at_base is None:
    return None
  b = w.per_worker_batch
  return w.epochs_at_base * w.dataset_size / b * w.step_time(b)


def _valid(devices: int, m: int, hw: hw_lib.Hardware) -> bool:
  try:
    check_layout(devices, m, hw)
  except ValueError:
    return False
  return True


def crossover(
  w: Workload,
  m: int,
  hw: hw_lib.Hardware,
  comm: CommConfig,
  devices: Sequence[int],
  *,
  refine: bool = True,
) -> int | None:
  """The smallest N with S_hyb(N, M) >= S_DP(N).

  Scans `devices` (sorted); with `refine`, then every valid N between the last grid point where DP
  wins and the first where hybrid wins, so the answer is exact, not a grid point.

  Returns:
    N*, or None if hybrid never wins on the grid.
  """
  grid = sorted(n for n in devices if _valid(n, m, hw))

  def hybrid_wins(n: int) -> bool:
    s_dp = speedup(w, n, 1, hw, comm)
    return speedup(w, n, m, hw, comm) >= s_dp * (1 - _REL_TOL)

  for i, n in enumerate(grid):
    if hybrid_wins(n):
      if not refine:
        return n
      lo = grid[i - 1] if i else 0
      for cand in range(lo + 1, n):
        if _valid(cand, m, hw) and hybrid_wins(cand):
          return cand
      return n
  return None


def best_factorisation(
  w: Workload, devices: int, hw: hw_lib.Hardware, comm: CommConfig
) -> tuple[int, int, float]:
  """The (data W, model M) split of N devices with the highest speedup, over M in {1} + s_mp.

  Returns:
    (W, M, speedup).
  """
  options = [1] + sorted(m for m, _ in w.s_mp if m > 1)
  best = None
  for m in options:
    if _valid(devices, m, hw):
      s = speedup(w, devices, m, hw, comm)
      if best is None or s > best[2]:
        best = (devices // m, m, s)
  assert best is not None  # M = 1 is always valid
  return best


@dataclasses.dataclass(frozen=True, kw_only=True)
class Projection:
  """DP versus hybrid for one workload on one hardware over a range of device counts."""

  model: str  # workload name
  hardware: str  # hardware spec name
  m: int  # devices per hybrid worker
  s_mp: float  # S_MP(M)
  devices: tuple[int, ...]  # N grid (valid for both DP and hybrid)
  s_dp: tuple[float, ...]  # S_DP(N)
  s_hyb: tuple[float, ...]  # S_hyb(N, M)
  t_step_dp_s: tuple[float, ...]  # T_step(N)
  t_step_hyb_s: tuple[float, ...]  # T_step_hyb(N / M)
  se_dp: tuple[float, ...]  # SE(N b)
  se_hyb: tuple[float, ...]  # SE(N b / M)
  time_to_accuracy_dp_h: tuple[float, ...] | None  # T_train(N, 1) in hours, if D and E known
  time_to_accuracy_hyb_h: tuple[float, ...] | None  # T_train(N, M) in hours
  crossover_devices: int | None  # N* (exact, refined between grid points)
  gain_at_scale: float  # max_N S_hyb / max_N S_DP - 1 over the grid (best hybrid vs best DP)
  gain_at_max_devices: float  # S_hyb / S_DP - 1 at the largest N
  best: tuple[tuple[int, int, int, float], ...]  # (N, W, M, speedup) best factorisation per N
  assumptions: tuple[tuple[str, str], ...]  # (name, value and why)
  s_mp_source: str = ""  # where S_MP(M) comes from (Workload.s_mp_source)

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["assumptions"] = dict(self.assumptions)
    d["best"] = [dict(zip(("devices", "data", "model", "speedup"), r)) for r in self.best]
    return d


def assumptions(w: Workload, hw: hw_lib.Hardware, comm: CommConfig) -> tuple[tuple[str, str], ...]:
  """Every input the paper does not pin down, named, with its value (for printing and JSON)."""
  step = w.step_time
  describe = getattr(step, "describe", None)
  out = [
    ("per_worker_batch", f"{w.per_worker_batch}"),
    ("t_comp", f"{step(w.per_worker_batch) * 1e3:.1f} ms at b={w.per_worker_batch}"
     + (f": {describe()}" if describe else "")),
    ("gradient_bytes", f"{w.grad_bytes / 1e6:.1f} MB per DP worker per step"),
    ("se_curve", w.se.describe()),
    ("s_mp", ", ".join(f"M={m}: {s:g} [{w.s_mp_source_of(m)}]" for m, s in w.s_mp) or "none"),
    ("mp_grad_share", ", ".join(f"M={m}: {s:g}" for m, s in w.mp_grad_share) or "1/M (balanced)"),
    ("overlap", f"{comm.overlap:g} of the all-reduce hidden behind the backward pass"),
    ("link_efficiency", f"{comm.link_efficiency:g} of NVLink/NVSwitch bandwidth"),
    ("nic_efficiency", f"{comm.nic_efficiency:g} of InfiniBand bandwidth"),
    ("allreduce_algorithm", comm.algorithm),
    ("zero", "all-reduce" if not comm.zero else
     "ZeRO 1: reduce-scatter (overlap applies) + all-gather after the update (exposed)"
     if comm.zero == 1 else
     f"ZeRO 2: {comm.reduce_scatters} reduce-scatter(s) (overlap applies) + all-gather after "
     "the update (exposed)"),
    ("hardware", f"{hw.name}: {hw.device_kind}, {hw.peak_flops / 1e12:g} TFLOP/s "
     f"{hw.peak_flops_dtype} at efficiency {hw.efficiency:g}; {hw.source}"),
    ("latencies",
     f"NVLink alpha {hw.link_alpha_s * 1e6:g} us, NIC alpha {hw.nic_alpha_s * 1e6:g} us"),
    ("layout", "workers are consecutive devices of one node; nodes filled in order"),
  ]
  return tuple(out) + tuple(w.assumptions)


def project(
  w: Workload,
  hw: hw_lib.Hardware,
  comm: CommConfig,
  devices: Sequence[int],
  m: int = 2,
) -> Projection:
  """S_DP, S_hyb, time-to-accuracy, crossover, gains and best factorisations over `devices`.

  Raises:
    ValueError: if no device count in `devices` fits M-device workers on `hw`.
  """
  grid = tuple(sorted(n for n in set(devices) if _valid(n, m, hw)))
  if not grid:
    raise ValueError(f"None of devices={list(devices)} fits workers of M={m} on {hw.name}.")
  b = w.per_worker_batch
  s_dp = tuple(speedup(w, n, 1, hw, comm) for n in grid)
  s_hyb = tuple(speedup(w, n, m, hw, comm) for n in grid)
  t1 = single_device_time_to_accuracy(w)
  tta_dp = tta_hyb = None
  if t1 is not None:
    tta_dp = tuple(t1 / s / 3600 for s in s_dp)
    tta_hyb = tuple(t1 / s / 3600 for s in s_hyb)
  return Projection(
    model=w.name,
    hardware=hw.name,
    m=m,
    s_mp=w.speedup_mp(m),
    devices=grid,
    s_dp=s_dp,
    s_hyb=s_hyb,
    t_step_dp_s=tuple(step_time(w, n, 1, hw, comm) for n in grid),
    t_step_hyb_s=tuple(step_time(w, n, m, hw, comm) for n in grid),
    se_dp=tuple(w.se.se(n * b, b) for n in grid),
    se_hyb=tuple(w.se.se(n // m * b, b) for n in grid),
    time_to_accuracy_dp_h=tta_dp,
    time_to_accuracy_hyb_h=tta_hyb,
    crossover_devices=crossover(w, m, hw, comm, grid),
    gain_at_scale=max(s_hyb) / max(s_dp) - 1,
    gain_at_max_devices=s_hyb[-1] / s_dp[-1] - 1,
    best=tuple((n, *best_factorisation(w, n, hw, comm)) for n in grid),
    assumptions=assumptions(w, hw, comm),
    s_mp_source=w.s_mp_source_of(m),
  )
