"""Holding a plan to its memory cap as the program allocates it.

The planner counts a device's memory as the longest device's rows (parameters, optimizer state,
gradient row: every model-axis device allocates rows that long) plus the lock-step groups'
buffers at their peak, each as long as its largest device's part
(`planner.pricing.price.peak_memory_bytes`). The program's figure still differs: the planner
knows neither the packing of small values nor, unless it is given them (`planner_task_temp`),
each task's own temporaries (`jaxhybrid.program.memory` does).

`refit` closes that gap: after a plan is built into a program, the program's predicted memory
(`MemoryReport.predicted`, within 7.5 % of XLA's compiled figure over bench_memory's rows) is
checked against the cap; when it is above, the planner's caps are lowered and the model
re-planned, a few times at most: the first time by the excess, then by the excess over the
program bytes saved per byte of planner cap in the last re-plan (a secant step; paper BigLSTM
1x8 under 8 GiB: 9.28, 8.58, 8.39 GiB per device after caps lowered by the excess each time, the
program shrinking by about half of each cut); when no plan fits the lowered caps, half way back
towards the last caps that had one.

With a `deadline` (the planner's time limit counted from the first plan), the re-plans share
what is left of it: each gets the time left over the re-plans still allowed, and at least
`REFIT_MIN_SHARE` of the whole limit (a first plan that used its whole limit leaves nothing, and
a re-plan without time returns the heuristic's plan only). Planning plus re-plans therefore end
within the limit, or at most `FIT_ATTEMPTS x REFIT_MIN_SHARE` of it later.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("jaxhybrid")

GiB = 2**30

# Assumption, named here: the program's memory is checked against the cap only when the
# planner's own peak of some device is above this fraction of its cap (the program's predicted
# memory costs a compile of every node's tasks; far below the cap the gap cannot matter: over
# bench_memory's rows the program allocates at most ~5x the planner's largest device figure
# only for models of a few MiB, where the hardware cap is thousands of times larger).
FIT_CHECK_FRACTION = 0.5
# Assumption, named here: re-plans tried before the cap is declared out of reach.
FIT_ATTEMPTS = 3
# Assumption, named here: each re-plan lowers the caps by its estimate times this factor (>1, so
# a re-plan that lands exactly on the planner's new cap leaves room for the model's error).
FIT_MARGIN = 1.05
# Assumption, named here: the smallest secant rate used (program bytes saved per byte of cap).
FIT_MIN_RATE = 0.25
# Assumption, named here: a program predicted at most this fraction above the cap is compiled
# and judged by XLA's figure: at least the prediction's worst error over bench_memory's rows
# on the high side (9.1 %, a GNMT small 1x8 planned row; 10.05 % before the accumulators were
# counted from the group that makes them; a program compiled just under the cap and predicted
# that much above it would otherwise be re-planned for nothing).
FIT_COMPILE_BAND = 0.11
# Assumption, named here: the least share of the planner's time limit a memory re-plan gets,
# whatever is left of the limit (paper GNMT 1x4: the first plan uses the whole limit).
REFIT_MIN_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class Refit:
  """One check of a built program against the planner's cap (bytes per device)."""

  cap: float  # the cap the program must keep (the smallest of the asked caps)
  planner_caps: tuple[float, ...]  # the caps the plan was made under
  planner_peak: float  # the plan's largest per-device figure, as the planner counts it
  program_bytes: int  # the program's predicted bytes per device (every device)
  compiled: bool = False  # program_bytes is XLA's compiled figure (near the cap), not predicted

  @property
  def fits(self) -> bool:
    return self.program_bytes <= self.cap


def _size(b: float) -> str:
  return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.2f} MiB"


# Assumption, named here: `parallelize` gives the planner each node's compiled task temporaries
# (a compile of every node's F and B alone) when the model's parameters, gradients and optimizer
# state would fill this fraction of the smallest cap on one device. Without them the planner's
# per-device figure ran 8-10.6 % under the compiled step on GNMT and Inception-V3 small
# (bench_memory.json, `planner_device_error`); for a model far below the cap they cannot matter.
TASK_TEMP_FRACTION = 0.25


def planner_task_temp(planner_options: dict[str, Any] | None, graph: Any, costs: Any,
                      state_factor: float, prog_opts: dict[str, Any], remat: Any,
                      mesh: Any) -> dict[str, Any]:
  """`planner_options` with `task_temp` resolved to the function the planner calls, or None.

  `task_temp` may be a function (kept), 'auto' (the default: the program's compiled figure,
  `node_calls.planner_task_temp`, when the model's static bytes reach TASK_TEMP_FRACTION of the
  cap, `memory_caps_bytes` or the hardware's), 'program' (always) or 'none'.
  """
  from jaxhybrid.program import node_calls

  opts = dict(planner_options or {})
  mode = opts.get("task_temp", "auto")
  if mode is None or callable(mode):
    return opts
  if mode not in ("auto", "program", "none"):
    raise ValueError(f"planner_options task_temp={mode!r}: use 'auto', 'program', 'none' or a "
                     "function (graph, node) -> (F bytes, B bytes).")
  caps = opts.get("memory_caps_bytes") or (
    getattr(getattr(costs, "hardware", None), "memory_bytes", 0) or 0)
  caps = tuple(caps) if isinstance(caps, (tuple, list)) else (caps,)
  need = graph.total_param_bytes * (2.0 + state_factor)
  if mode == "none" or (mode == "auto" and not (0 < min(caps) <= need / TASK_TEMP_FRACTION)):
    opts["task_temp"] = None
    return opts
  opts["task_temp"] = node_calls.planner_task_temp(
    canonical_convs=node_calls.canonical_convs_for(mesh, prog_opts.get("canonical_convs")),
    branch_remat=prog_opts.get("branch_remat", "none"), remat=tuple(remat),
    sparse_lookups=prog_opts.get("sparse_lookups", True))
  return opts


def program_bytes(prog: Any) -> int:
  """The program's predicted per-device bytes (no compile of the step)."""
  from jaxhybrid.program import memory

  return int(memory.report(prog, compile=False).predicted)


def compiled_bytes(prog: Any) -> int:
  """The program's per-device bytes as XLA compiles its step (from abstract inputs)."""
  from jaxhybrid.program import memory

  return int(memory.report(prog, compile=True).compiled)


def needs_check(plan: Any, caps: tuple[float, ...] | None = None) -> bool:
  """Whether some device's planner peak of `plan` is near its cap (`caps`, default the plan's
  own; none: no check). A plan without schedule peaks (the one-device fall-back, planned
  without caps) is judged by its nodes' static bytes per device; without either, it is checked."""
  caps = tuple(caps if caps is not None else getattr(plan, "memory_caps_bytes", ()) or ())
  peaks = tuple(getattr(plan, "device_peak_bytes", ()) or ())
  if not peaks and hasattr(plan, "device_memory"):  # no schedule peaks: the nodes' static bytes
    peaks = tuple(plan.device_memory())
  if not caps:
    return False
  if not peaks:
    return True
  return any(p > FIT_CHECK_FRACTION * c for p, c in zip(peaks, caps))


def refit(
  plan: Any,
  prog: Any,
  replan: Callable[[tuple[float, ...]], tuple[Any, Any]],
  *,
  measure: Callable[[Any], int] = program_bytes,
  compiled: Callable[[Any], int] | None = None,
  attempts: int = FIT_ATTEMPTS,
  deadline: tuple[float, float] | None = None,
  clock: Callable[[], float] = time.monotonic,
) -> tuple[Any, Any, list[Refit]]:
  """Re-plans until the program's predicted memory is within the plan's cap.

  Args:
    plan, prog: the planner's plan (with `memory_caps_bytes`) and the program built from it.
    replan: caps per device -> (plan, program) planned under those caps and built.
    measure: program -> its predicted bytes per device.
    compiled: program -> its compiled bytes per device (`compiled_bytes`), asked when the
      prediction is above the cap by at most FIT_COMPILE_BAND; that figure then decides. None:
      the prediction alone decides.
    attempts: the most re-plans.
    deadline: (time limit, the `clock` reading it ends at), seconds: `replan` is then called as
      `replan(caps, time_limit_s=...)` with its share of what is left (module docstring). None:
      `replan(caps)`.
    clock: the clock `deadline` is read on.

  Returns:
    (plan, program, checks): the first that fits (or the given ones when no check is due), and
    every check made, in order.

  Raises:
    planner.InfeasibleError: the program stays above the cap after `attempts` re-plans, or the
      lowered caps leave nothing (the message gives the program's bytes and the cap).
  """
  from jaxhybrid.planner.core.options import InfeasibleError

  checks: list[Refit] = []
  user_caps = tuple(float(c) for c in plan.memory_caps_bytes or ())
  caps = user_caps
  replans = 0
  while True:
    if not needs_check(plan, caps):
      return plan, prog, checks
    need, was_compiled = measure(prog), False
    peak = max(plan.device_peak_bytes or (0.0,))
    cap = min(user_caps)
    if compiled is not None and cap < need <= cap * (1 + FIT_COMPILE_BAND):
      got = compiled(prog)
      log.info("the program is predicted at %s per device, over the %s cap by less than the "
               "prediction's error: compiled, it needs %s", _size(need), _size(cap), _size(got))
      need, was_compiled = got, True
    checks.append(Refit(cap=cap, planner_caps=caps, planner_peak=float(peak), program_bytes=need,
                        compiled=was_compiled))
    if need <= cap:
      return plan, prog, checks
    if replans == attempts:
      break
    # Program bytes saved per byte of planner cap over the last re-plan, kept within [1/4, 1]
    # (1: the first step; a re-plan that saved nothing would otherwise stall the search).
    rate = 1.0
    if len(checks) > 1:
      cut = min(checks[-2].planner_caps) - min(checks[-1].planner_caps)
      saved = checks[-2].program_bytes - checks[-1].program_bytes
      rate = min(1.0, max(FIT_MIN_RATE, saved / cut)) if cut > 0 else 1.0
    excess = (need - cap) / rate * FIT_MARGIN
    last_ok = caps
    caps = tuple(max(c - excess, 0.0) for c in caps)
    log.info("the program needs %s per device, over the %s cap (group buffers and values "
             "beyond the planner's count): re-planning with caps %s lower",
             _size(need), _size(cap), _size(excess))
    while True:
      replans += 1
      try:
        if deadline is None:
          plan, prog = replan(caps)
        else:
          limit, end = deadline
          share = max((end - clock()) / (attempts - replans + 1), limit * REFIT_MIN_SHARE)
          plan, prog = replan(caps, time_limit_s=share)
        break
      except InfeasibleError as e:
        if replans == attempts:
          raise InfeasibleError(
            f"the program needs {_size(need)} per device, over the cap of {_size(cap)}, and no "
            f"plan fits the planner's caps lowered to leave room for that excess ({e})") from None
        # Too far: half way back towards the last caps that had a plan.
        caps = tuple((a + b) / 2 for a, b in zip(caps, last_ok))
        log.info("no plan fits the lowered caps: re-planning with caps half way back, %s",
                 _size(min(caps)))
  raise InfeasibleError(
    f"the program needs {_size(checks[-1].program_bytes)} per device, over the cap of "
    f"{_size(min(user_caps))}, after {replans} re-plan(s) with lower planner caps "
    "(every device's rows are as long as the fullest device's, and group buffers as large as "
    "the largest device's values): use more model devices, more micro-batches or a larger cap")


def uncapped_if_it_fits(error: Exception, opts: dict[str, Any], planned: Callable, build: Callable,
                        device_memory_bytes: int, devices: int) -> tuple[Any, Any, Any, Any]:
  """When the planner finds no plan under the memory caps (`error`): a plan made under looser
  caps, if its program compiles within the caps, as (graph, plan, check, program); else `error`
  is raised. Tried in order: the hardware's own memory (when the caps asked for are below it;
  the planner still splits and spreads to fit that), then no cap. The planner's search under a
  cap can miss a plan its own model would nearly accept: paper BigLSTM 1x8 with batch and leaf
  splits under 5 GiB, the closest placement it priced 6.6 GB over by its model, while the
  uncapped plan compiled to 4.97 GiB. `planned(opts)` and `build(graph, plan)` are
  `parallelize`'s planning and building steps; `device_memory_bytes` is the hardware's memory,
  the caps under the planner's default."""
  from jaxhybrid.planner.core import options as options_lib

  caps = options_lib.PlannerOptions(
    devices=devices, memory_caps_bytes=opts.get("memory_caps_bytes", options_lib.DEVICE_MEMORY),
  ).caps(device_memory_bytes)
  if not caps:
    raise error
  looser = [None]
  if device_memory_bytes and min(caps) < device_memory_bytes:
    looser.insert(0, int(device_memory_bytes))
  for cap in looser:
    try:
      g, plan, check = planned({**opts, "memory_caps_bytes": cap})
    except options_lib.InfeasibleError:
      continue
    plan, prog = build(g, plan)
    need = compiled_bytes(prog)
    if need <= min(caps):
      made = "without it" if cap is None else f"under the hardware's {_size(cap)}"
      log.warning("no plan under the memory cap in the planner's search; the plan made %s "
                  "compiles to %.2f GiB per device, within the %.2f GiB cap", made, need / GiB,
                  min(caps) / GiB)
      return g, dataclasses.replace(plan, memory_caps_bytes=tuple(caps)), check, prog
  raise error