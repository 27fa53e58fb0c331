"""S_MP(M) from our own planner: trace at the projection's size, plan, price as the program runs.

For one model, per-worker batch b and hardware: trace the training loss abstractly (nothing is
allocated) at the micro-batch size b / k for every k of the grid, place it on M devices with each
planner of the grid, price every plan as the compiled program runs it (`price_plan`), check its
memory (`device_memory_bytes`, `fits_memory`), and keep the best plan per M:

  S_MP(M) = T_1 / min over (k, planner) of T_M(k, planner)

with T_1 the one-device step at batch b priced the same way. The two replaceable seams are
`price_plan` (today: `jaxhybrid.program.lockstep.plan_step_s`, groups in lock step) and
`device_memory_bytes` (today: the planner's per-device parameter + gradient + optimizer-state +
activation estimate, `Plan.device_memory`); swap either once Program v2's schedules and memory
model land.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from jaxhybrid.costs import hardware as hw_lib
from jaxhybrid.projection.s_mp import SMPEstimate

log = logging.getLogger(__name__)

HEURISTICS = ("dp", "interleaved", "etf")  # deterministic planners (no time-limited search)
PRICING = "priced in lock step (jaxhybrid.program.lockstep)"  # what price_plan does; keep in sync


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchConfig:
  """The grid of plans tried for S_MP and how each is searched (none of it is in the paper)."""

  devices: tuple[int, ...] = (2, 4, 8)  # M values
  microbatches: tuple[int, ...] = (1, 2, 4, 8)  # k values (those not dividing b are skipped)
  planners: tuple[str, ...] = (*HEURISTICS, "milp")  # methods tried per (M, k)
  time_limit_s: float = 5.0  # per MILP plan: short, so the default grid runs in minutes on 2 cores
  threads: int = 1  # solver threads
  seed: int = 0  # solver and search seed
  optimizer_state_factor: float = 2.0  # memory model: optimizer bytes per parameter byte (Adam 2,
  # AdaGrad 1); the planner's PlannerOptions field of the same name
  usable_memory_fraction: float = 0.9  # share of a device's memory a plan may use (assumption:
  # the rest goes to the runtime, workspace and fragmentation)
  depth: int = 2  # module-path components that name a node (graph.trace)
  max_nodes: int | None = None  # merge adjacent nodes down to this many (None: no merging)

  def __post_init__(self):
    for name in ("devices", "microbatches"):
      vals = getattr(self, name)
      if not vals or any(not isinstance(v, int) or v < 1 for v in vals):
        raise ValueError(f"{name}={vals!r}: give integers >= 1, e.g. (2, 4).")
    if not self.planners:
      raise ValueError("planners is empty; give at least one, e.g. ('dp',).")
    if not self.time_limit_s > 0:
      raise ValueError(f"time_limit_s={self.time_limit_s}: use a positive number of seconds.")
    if not 0 < self.usable_memory_fraction <= 1:
      raise ValueError(f"usable_memory_fraction={self.usable_memory_fraction}: use (0, 1].")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """One plan of the grid, priced."""

  m: int  # M
  k: int  # micro-batches
  planner: str  # method asked for
  found_by: str  # what produced the schedule (Plan.found_by or the method)
  step_s: float  # T_M: priced as the program runs (price_plan)
  async_step_s: float  # the plan's own asynchronous makespan (for comparison)
  s_mp: float  # T_1 / step_s
  memory_bytes_per_device: float  # largest device's bytes (device_memory_bytes)
  fits: bool  # fits_memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class SMPSearch:
  """Every priced plan of the grid, and the one-device reference."""

  model: str  # model name (registry name or the user's)
  size: str  # size preset ('' for a user's module)
  per_worker_batch: int  # b
  hardware: str  # cost model hardware
  single_device_s: float  # T_1: one device, batch b, k = 1, priced by price_plan
  single_device_memory_bytes: float  # bytes one device needs for the whole model (DP)
  single_device_fits: bool  # whether data parallelism fits a device at all
  param_bytes: int  # parameter bytes of the model (gradient bytes a DP worker all-reduces)
  memory_capacity_bytes: float  # usable bytes per device (memory x usable_memory_fraction)
  candidates: tuple[Candidate, ...]  # every plan tried
  config: SearchConfig
  # Model config fields replaced before tracing (registry models), e.g. (("time_chunks", 4),).
  model_overrides: tuple[tuple[str, Any], ...] = ()

  def best(self, m: int, *, fitting_only: bool = False) -> Candidate | None:
    """The fastest plan for M (among fitting plans first); None if none (fits)."""
    cands = [c for c in self.candidates if c.m == m]
    fitting = [c for c in cands if c.fits]
    pool = fitting if (fitting or fitting_only) else cands
    return min(pool, key=lambda c: (c.step_s, c.k, c.planner), default=None)

  def estimate(self, m: int, *, fitting_only: bool = False) -> SMPEstimate | None:
    """S_MP(M) of the best plan, with its source and plan details."""
    c = self.best(m, fitting_only=fitting_only)
    if c is None:
      return None
    return SMPEstimate(
      m=m, s_mp=c.s_mp,
      source=(f"planner: {self.model} {self.size}{_overrides_text(self.model_overrides)} "
              f"b={self.per_worker_batch} on {self.hardware}, "
              f"best of {sum(x.m == m for x in self.candidates)} plans: M={m} k={c.k} "
              f"{c.planner} (found by {c.found_by}), {PRICING}"),
      microbatches=c.k, planner=c.planner, predicted_step_s=c.step_s,
      single_device_s=self.single_device_s, memory_bytes_per_device=c.memory_bytes_per_device,
      fits=c.fits, hardware=self.hardware,
    )

  def estimates(self, *, fitting_only: bool = False) -> tuple[SMPEstimate, ...]:
    """The best S_MP per M of the grid (Ms without a plan left out)."""
    ms = sorted({c.m for c in self.candidates})
    out = (self.estimate(m, fitting_only=fitting_only) for m in ms)
    return tuple(e for e in out if e is not None)

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["best"] = {str(e.m): e.to_json() for e in self.estimates()}
    return d

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> SMPSearch:
    """Inverse of `to_json` (e.g. the `s_mp_search` that project.py saves per model)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw["candidates"] = tuple(Candidate(**c) for c in d["candidates"])
    kw["model_overrides"] = tuple(tuple(x) for x in d.get("model_overrides", ()))
    kw["config"] = SearchConfig(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in d["config"].items()})
    return cls(**kw)


def _overrides_text(overrides: tuple[tuple[str, Any], ...]) -> str:
  return "".join(f" {k}={v}" for k, v in overrides)


# --- The two replaceable seams ---------------------------------------------------------------


def price_plan(graph: Any, plan: Any, costs: Any) -> float:
  """Lock-step price of the program (jaxhybrid.program.lockstep.plan_step_s), seconds.

  One function so that Program v2's pricing can replace it.
  """
  from jaxhybrid.program import lockstep

  return lockstep.plan_step_s(graph, plan, costs).step_s


def device_memory_bytes(plan: Any) -> float:
  """The largest device's bytes under `plan`: the planner's parameter + gradient + optimizer-state
  + activation (x micro-batches) estimate. One function so Program v2's memory model can replace it.
  """
  return float(max(plan.device_memory()))


def fits_memory(nbytes: float, hw: hw_lib.Hardware, usable_fraction: float) -> bool:
  """Whether `nbytes` fit the usable share of one device of `hw`."""
  return nbytes <= hw.memory_bytes * usable_fraction


# --- The search ------------------------------------------------------------------------------


def search(
  trace_fn: Callable[[int], Any],
  *,
  per_worker_batch: int,
  hardware: str,
  config: SearchConfig = SearchConfig(),
  model: str = "model",
  size: str = "",
  model_overrides: tuple[tuple[str, Any], ...] = (),
) -> SMPSearch:
  """Plans and prices the grid for a model given as `trace_fn(micro_batch) -> OpGraph`.

  Raises:
    ValueError: no k of the grid divides the batch, or bad options.
  """
  from jaxhybrid import costs as costs_lib
  from jaxhybrid import planner as planner_lib

  hw = hw_lib.get(hardware)
  costs = costs_lib.AnalyticCostModel(hw)
  b = per_worker_batch
  ks = [k for k in config.microbatches if b % k == 0]
  if not ks:
    raise ValueError(f"per_worker_batch={b}: no micro-batch count of {config.microbatches} "
                     "divides it; give a k that does (e.g. 1).")
  cap = hw.memory_bytes * config.usable_memory_fraction
  # No planner memory cap: the advisor checks each candidate's memory itself (fits_memory, with
  # usable_memory_fraction) and keeps the ones that do not fit in its table.
  opts = dict(threads=config.threads, seed=config.seed, time_limit_s=config.time_limit_s,
              optimizer_state_factor=config.optimizer_state_factor, memory_caps_bytes=None)
  graphs = {k: trace_fn(b // k) for k in ks}
  base = graphs[1] if 1 in graphs else trace_fn(b)
  one = planner_lib.place(base, costs, devices=1, microbatches=1, method="single", **opts)
  t1 = price_plan(base, one, costs)
  mem1 = device_memory_bytes(one)
  cands = []
  for k in ks:
    for m in config.devices:
      for method in config.planners:
        try:
          plan = planner_lib.place(graphs[k], costs, devices=m, microbatches=k, method=method,
                                   **opts)
        except planner_lib.InfeasibleError as e:  # pragma: no cover - no caps are passed
          log.info("M=%d k=%d %s: %s", m, k, method, e)
          continue
        step = price_plan(graphs[k], plan, costs)
        mem = device_memory_bytes(plan)
        cands.append(Candidate(
          m=m, k=k, planner=method, found_by=plan.found_by or plan.method, step_s=step,
          async_step_s=plan.fused_makespan_s, s_mp=t1 / step, memory_bytes_per_device=mem,
          fits=fits_memory(mem, hw, config.usable_memory_fraction),
        ))
        log.info("%s M=%d k=%d %s: %.4f s lock-step (S_MP %.3f), %.2f GB/device", model, m, k,
                 method, step, t1 / step, mem / 1e9)
  return SMPSearch(
    model=model, size=size, per_worker_batch=b, hardware=hw.name, single_device_s=t1,
    single_device_memory_bytes=mem1, single_device_fits=fits_memory(
      mem1, hw, config.usable_memory_fraction),
    param_bytes=int(base.total_param_bytes), memory_capacity_bytes=cap,
    candidates=tuple(cands), config=config, model_overrides=tuple(model_overrides),
  )


def registry_trace_fn(name: str, size: str, **overrides: Any) -> Callable[[int], Any]:
  """`trace_fn` of a registry model (jaxhybrid.models.get), traced abstractly."""
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import models

  spec = models.get(name, size, **overrides)

  def trace(micro: int) -> Any:
    return graph_lib.trace(spec.abstract_model(), spec.loss_fn, spec.batch_spec(micro))

  return trace


def planned_s_mp(
  name: str,
  *,
  size: str = "paper",
  per_worker_batch: int,
  hardware: str,
  config: SearchConfig = SearchConfig(),
  model_overrides: Mapping[str, Any] | None = None,
) -> SMPSearch:
  """The S_MP search for a registry model at `size` (e.g. a paper model at paper size).

  `model_overrides` replace fields of the model's config before tracing (e.g. BigLSTM's
  `time_chunks`, which cuts each LSTM layer into that many graph nodes over time); they are
  recorded in the search and in every estimate's source.
  """
  overrides = dict(model_overrides or {})
  return search(registry_trace_fn(name, size, **overrides), per_worker_batch=per_worker_batch,
                hardware=hardware, config=config, model=name, size=size,
                model_overrides=tuple(sorted(overrides.items())))
