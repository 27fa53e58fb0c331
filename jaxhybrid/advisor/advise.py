"""Where hybrid parallelism wins: per device count, the best (data, model, micro-batches, planner).

For each N of a grid, every (W = N / M, M) split whose M has a priced plan (`planned.search`) is
scored by the projection's time-to-accuracy speedup (`jaxhybrid.projection.speedup`: step time
with the all-reduce over the topology, statistical efficiency of the global batch W b); a split
whose plan does not fit the device memory is reported but never recommended. The crossover is
the smallest N at which a fitting hybrid split beats data parallelism: per M it is exactly
`projection.crossover` (refined between grid points), and the advisor's crossover is the
smallest of those over the fitting Ms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxhybrid import projection
from jaxhybrid.advisor import planned
from jaxhybrid.advisor.planned import SMPSearch
from jaxhybrid.costs import hardware as hw_lib
from jaxhybrid.projection import stat_eff


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
  """One way to use N devices."""

  devices: int  # N
  data: int  # W workers
  model: int  # M devices per worker
  microbatches: int  # k of M's best plan (1 for data parallelism)
  planner: str  # planner of that plan ('' for data parallelism)
  s_mp: float  # S_MP(M) (1 for data parallelism)
  step_s: float  # T_step (DP) or T_step_hyb at N
  se: float  # SE(W b)
  speedup: float  # time-to-accuracy speedup over one device
  time_to_accuracy_h: float | None  # hours, if the workload knows D and E(b)
  memory_bytes_per_device: float  # the plan's largest device
  fits: bool  # whether it fits the device memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class Advice:
  """The advisor's answer for one model on one hardware over a device grid."""

  model: str
  hardware: str
  devices: tuple[int, ...]  # N grid
  recommended: tuple[Option | None, ...]  # per N: the fastest fitting option (None: none fits)
  best_dp: tuple[Option, ...]  # per N: data parallelism (may not fit)
  options: tuple[tuple[Option, ...], ...]  # per N: every option, fitting or not
  crossover_devices: int | None  # smallest N where a fitting hybrid beats DP (see module doc)
  crossover_by_m: tuple[tuple[int, int | None], ...]  # (M, projection.crossover) per M
  dp_fits: bool  # whether one device holds the whole model
  s_mp: tuple[projection.SMPEstimate, ...]  # the S_MP used per M, with sources
  search: dict[str, Any]  # the planner search (SMPSearch.to_json)
  assumptions: tuple[tuple[str, str], ...]

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["assumptions"] = dict(self.assumptions)
    d["crossover_by_m"] = {str(m): c for m, c in self.crossover_by_m}
    return d


def advise_workload(
  w: projection.Workload,
  found: SMPSearch,
  hw: hw_lib.Hardware,
  comm: projection.CommConfig,
  devices: Sequence[int],
) -> Advice:
  """The advice for a workload whose S_MP table comes from `found` (set here).

  Raises:
    ValueError: no N of `devices` fits one-device workers (N < 1).
  """
  estimates = found.estimates()
  w = w.with_s_mp(estimates)
  by_m = {e.m: e for e in estimates}
  grid = tuple(sorted({n for n in devices if n >= 1}))
  if not grid:
    raise ValueError(f"devices={list(devices)}: give device counts >= 1, e.g. 8,16,32.")
  t1 = projection.single_device_time_to_accuracy(w)
  recommended, best_dp, options = [], [], []
  for n in grid:
    row = []
    for m in [1, *sorted(by_m)]:
      try:
        step = projection.step_time(w, n, m, hw, comm)
      except ValueError:
        continue  # M does not divide N or a node
      s = projection.speedup(w, n, m, hw, comm)
      e = by_m.get(m)
      row.append(Option(
        devices=n, data=n // m, model=m, microbatches=e.microbatches if e else 1,
        planner=e.planner if e else "", s_mp=w.speedup_mp(m), step_s=step,
        se=w.se.se(n // m * w.per_worker_batch, w.per_worker_batch), speedup=s,
        time_to_accuracy_h=None if t1 is None else t1 / s / 3600,
        memory_bytes_per_device=(e.memory_bytes_per_device if e
                                 else found.single_device_memory_bytes),
        fits=bool(e.fits) if e else found.single_device_fits,
      ))
    fitting = [o for o in row if o.fits]
    recommended.append(max(fitting, key=lambda o: (o.speedup, -o.model), default=None))
    best_dp.append(row[0])
    options.append(tuple(row))
  cross_by_m = tuple((m, projection.crossover(w, m, hw, comm, grid)) for m in sorted(by_m))
  fit_m = [m for m in sorted(by_m) if by_m[m].fits]
  if found.single_device_fits:
    hits = [c for m, c in cross_by_m if m in fit_m and c is not None]
    cross = min(hits, default=None)
  else:  # data parallelism does not fit: hybrid wins wherever a hybrid fits
    hits = [n for n, r in zip(grid, recommended) if r is not None and r.model > 1]
    cross = min(hits, default=None)
  notes = dict(projection.assumptions(w, hw, comm))
  notes["memory"] = (
    f"fits when the planner's per-device parameter + gradient + optimizer-state (x"
    f"{found.config.optimizer_state_factor:g}) + activation estimate <= "
    f"{found.config.usable_memory_fraction:g} x {hw.memory_bytes / 1e9:.1f} GB")
  notes["crossover"] = ("smallest N where a fitting hybrid beats data parallelism"
                        if found.single_device_fits else
                        "data parallelism does not fit one device: smallest N with a fitting "
                        "hybrid")
  return Advice(
    model=w.name, hardware=hw.name, devices=grid, recommended=tuple(recommended),
    best_dp=tuple(best_dp), options=tuple(options), crossover_devices=cross,
    crossover_by_m=cross_by_m, dp_fits=found.single_device_fits, s_mp=estimates,
    search=found.to_json(), assumptions=tuple(notes.items()),
  )


def format_advice(a: Advice) -> str:
  """A plain-text table: per N the recommended split, the DP speedup and the hybrid's gain."""
  lines = [
    f"{a.model} on {a.hardware}: data parallelism {'fits' if a.dp_fits else 'does NOT fit'} one "
    "device",
    f"{'N':>6} {'best W x M':>11} {'k':>3} {'planner':<12} {'speedup':>9} {'S_DP':>9} "
    f"{'gain':>7} {'GB/dev':>7}",
  ]
  for n, rec, dp in zip(a.devices, a.recommended, a.best_dp):
    if rec is None:
      lines.append(f"{n:>6} {'nothing fits':>11}")
      continue
    gain = rec.speedup / dp.speedup - 1
    lines.append(
      f"{n:>6} {f'{rec.data} x {rec.model}':>11} {rec.microbatches:>3} {rec.planner or 'DP':<12} "
      f"{rec.speedup:>9.2f} {dp.speedup:>9.2f}{'' if dp.fits else '*'} {gain * 100:>6.1f}% "
      f"{rec.memory_bytes_per_device / 1e9:>7.2f}"
    )
  by_m = ", ".join(f"M={m}: {c}" for m, c in a.crossover_by_m)
  lines.append(f"crossover N* = {a.crossover_devices} (per M: {by_m})"
               + ("" if a.dp_fits else "; * = DP does not fit, shown for comparison"))
  for e in a.s_mp:
    lines.append(f"S_MP({e.m}) = {e.s_mp:.3f}{'' if e.fits else ' (does not fit)'}: {e.source}")
  return "\n".join(lines)


def plot_advice(advices: Sequence[Advice], path: str) -> None:
  """Speedup versus N: DP and every M (dashed where it does not fit), recommendation marked."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(advices), figsize=(5 * len(advices), 4), squeeze=False)
  for ax, a in zip(axes[0], advices):
    ms = sorted({o.model for row in a.options for o in row})
    for m in ms:
      pts = [(o.devices, o.speedup, o.fits) for row in a.options for o in row if o.model == m]
      fits = all(f for _, _, f in pts)
      label = "DP" if m == 1 else f"M={m}"
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" if fits else ":", marker="o",
              label=label + ("" if fits else " (does not fit)"))
    rec = [(r.devices, r.speedup) for r in a.recommended if r is not None]
    ax.plot([r[0] for r in rec], [r[1] for r in rec], "k*", ms=10, label="recommended")
    if a.crossover_devices is not None:
      ax.axvline(a.crossover_devices, color="gray", ls="--", label=f"N* = {a.crossover_devices}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("devices N")
    ax.set_ylabel("time-to-accuracy speedup over 1 device")
    ax.set_title(f"{a.model} ({a.hardware})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _se_curve(b_noise: float | None, se: Any) -> Any:
  if se is not None:
    return se
  if b_noise is None or not (b_noise > 0 and math.isfinite(b_noise)):
    raise ValueError(
      f"b_noise={b_noise}: the advisor needs the gradient noise scale of your model (samples), "
      "e.g. the mean of the 'noise_scale' column of a run (projection.read_noise_scale), or se=."
    )
  return stat_eff.NoiseScaleSE(b_noise=b_noise)


DEFAULT_DEVICES = tuple(2**i for i in range(3, 11))  # 8 ... 1024


def advise_model(
  name: str,
  *,
  hardware: str = "dgx1-v100",
  devices: Sequence[int] = DEFAULT_DEVICES,
  size: str = "paper",
  config: planned.SearchConfig = planned.SearchConfig(),
  comm: projection.CommConfig = projection.CommConfig(),
  found: SMPSearch | None = None,
  model_overrides: Mapping[str, Any] | None = None,
  **workload_overrides: Any,
) -> Advice:
  """The advice for a paper model: its paper-scenario workload with S_MP from our planner.

  Args:
    name: 'inception_v3', 'gnmt' or 'biglstm'.
    hardware: hardware name (jaxhybrid.costs.hardware).
    devices: N grid.
    size: model size traced for the plans.
    config: the S_MP search grid.
    comm: all-reduce assumptions.
    found: a search already run (skips planning).
    model_overrides: model config fields replaced before tracing (e.g. {"time_chunks": 4}).
    **workload_overrides: `paper_scenario.paper_workload` keywords (b_noise, se, step_time_s...).
  """
  from jaxhybrid.projection import paper_scenario

  hw = hw_lib.get(hardware)
  pm = paper_scenario.PAPER_MODELS.get(name)
  if pm is None:
    raise ValueError(f"model={name!r}: use one of {', '.join(paper_scenario.PAPER_MODELS)}, or "
                     "jaxhybrid.advise(model, loss_fn, batch, ...) for your own module.")
  b = workload_overrides.get("per_gpu_batch") or pm.per_gpu_batch
  if found is None:
    found = planned.planned_s_mp(name, size=size, per_worker_batch=b, hardware=hw.name,
                                 config=config, model_overrides=model_overrides)
  w = paper_scenario.paper_workload(name, hw, s_mp=found.estimates(), **workload_overrides)
  return advise_workload(w, found, hw, comm, devices)


def advise(
  model: Any,
  loss_fn: Any,
  batch: Any,
  *,
  hardware: str = "dgx1-v100",
  devices: Sequence[int] = DEFAULT_DEVICES,
  b_noise: float | None = None,
  se: Any = None,
  config: planned.SearchConfig = planned.SearchConfig(),
  comm: projection.CommConfig = projection.CommConfig(),
  name: str | None = None,
  params: Any = None,
) -> Advice:
  """Where hybrid parallelism wins for your own Flax module.

  The module is traced abstractly at the per-worker batch of `batch` (leading dimension b; pass
  `jax.ShapeDtypeStruct`s to allocate nothing), planned and priced for every (M, k, planner) of
  `config`; T_comp(b) is the priced one-device step and the gradient bytes are the parameter
  bytes, both on `hardware`'s analytic costs.

  Args:
    model: an `nnx.Module` (abstract is enough) or a linen module (then `params`).
    loss_fn: `loss_fn(model, batch)` (NNX) or `loss_fn(params, batch)` (linen), a scalar mean.
    batch: one worker's batch (per-example leaves lead with b).
    hardware: hardware name.
    devices: N grid.
    b_noise: your model's gradient noise scale, samples (e.g. a run's measured mean); or `se`.
    se: an SE curve (stat_eff.MeasuredSE, TrajectorySE, ...) instead of `b_noise`.
    config: the S_MP search grid.
    comm: all-reduce assumptions.
    name: the model's name in reports (default: its class name).
    params: linen only.

  Raises:
    ValueError: no b_noise or se, or a batch without a batch dimension.
  """
  import jax

  from jaxhybrid import api
  from jaxhybrid import graph as graph_lib

  curve = _se_curve(b_noise, se)
  name = name or type(model).__name__
  sizes = [x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "shape", ())]
  if not sizes:
    raise ValueError("batch has no leaf with a batch dimension; pass one worker's batch.")
  b = max(set(sizes), key=sizes.count)

  def trace(micro: int) -> Any:
    spec, _ = api.microbatch_spec(batch, b, micro)
    return graph_lib.trace(model, loss_fn, spec, params=params, depth=config.depth,
                           max_nodes=config.max_nodes)

  found = planned.search(trace, per_worker_batch=b, hardware=hardware, config=config, model=name)
  w = projection.Workload(
    name=name, per_worker_batch=b,
    step_time=projection.MeasuredStepTime(
      points=((b, found.single_device_s),), source=f"one-device step priced on {hardware}"),
    grad_bytes=float(found.param_bytes), se=curve,
    assumptions=(("gradient_bytes", "the model's parameter bytes (dense gradients)"),),
  )
  return advise_workload(w, found, hw_lib.get(hardware), comm, devices)
