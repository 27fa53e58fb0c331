"""Is the plan worth running? Its lock-step price against one device's, and the one-device
reference a speedup is measured against (`jaxhybrid.parallelize` calls these)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

from jaxhybrid import graph as graph_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanCheck:
  """The chosen plan and the single-device program, priced as the program runs them.

  Both are `jaxhybrid.program.lockstep.plan_step_s` step times (seconds per worker step, without
  the optimizer-update and zero-fill passes, which need timing on the device) under the cost
  model the planner used.
  """

  # Lock-step price of the planner's plan.
  plan_step_s: float
  # Lock-step price of every node on model-axis device 0 (the single-device program).
  single_step_s: float
  # The plan's predicted step as the planner reported it (`Plan.predicted_step_s`).
  planner_step_s: float
  # True when the planner's plan priced slower than one device and the hybrid runs on one.
  fell_back: bool
  # The planner's plan, kept even when the hybrid fell back to one device.
  planned: Any = None
  # The checks of the built program's predicted memory against the cap, in order (more than
  # one: the plan was re-made under lower planner caps; `jaxhybrid.program.fit`).
  memory_refits: tuple[Any, ...] = ()

  @property
  def speedup(self) -> float:
    """Single-device over plan step time, as the program runs (< 1: the plan is slower)."""
    return self.single_step_s / self.plan_step_s if self.plan_step_s > 0 else 1.0


def reference_step(whole_batch_graph: graph_lib.OpGraph, costs: Any) -> dict[str, Any]:
  """One device's step on the worker's whole batch in one pass (forward + backward, seconds),
  as the Plan fields `reference_step_s` and `reference_source`.

  A cost model that can time the traced loss whole (`ProfiledCostModel.whole_step_time_s`: XLA
  fuses across nodes, as in a plain `jax.jit` step) does; otherwise the sum of its node times.
  """
  if hasattr(costs, "whole_step_time_s"):
    return {"reference_step_s": float(costs.whole_step_time_s(whole_batch_graph)),
            "reference_source": "whole-step profile"}
  return {"reference_step_s": float(costs.step_time_s(whole_batch_graph)), "reference_source": "node sum"}


def check_plan(
  g: graph_lib.OpGraph, plan: Any, costs: Any, devices: int, microbatches: int,
  program_options: dict[str, Any], *, fall_back: bool,
) -> tuple[Any, PlanCheck | None]:
  """Prices `plan` and the single-device program in lock step; falls back to one device (with a
  warning giving both figures) when the plan is slower and `fall_back` is set."""
  from jaxhybrid import planner as planner_lib
  from jaxhybrid.program import lockstep

  if devices < 2 or len(set(plan.assignment)) < 2:
    return plan, None
  # The single-device reference is priced, not run: no memory cap (the planner's default caps
  # every device at its memory, which a paper-size model on one device exceeds).
  single = planner_lib.place(g, costs, devices=devices, microbatches=microbatches, method="single",
                             memory_caps_bytes=None)
  sched = program_options.get("schedule") or plan.task_schedule or None
  kw = {
    "pack_max_bytes": program_options.get("pack_max_bytes"),
    "branch_remat": program_options.get("branch_remat", "none"),
  }
  t_plan = lockstep.plan_step_s(g, plan, costs, schedule=sched, **kw).step_s
  # One device runs the same kind of schedule (a given TaskSchedule is for the plan's devices).
  kind = sched.kind if isinstance(sched, planner_lib.TaskSchedule) else sched
  if isinstance(sched, planner_lib.TaskSchedule) and kind not in planner_lib.core.task_schedule.KINDS:
    # A plan's own order (the F/B/W MILP's 'custom'): one device runs the generated schedule of
    # the same split.
    kind = "zb" if sched.split else "1f1b"
  t_single = lockstep.plan_step_s(g, single, costs, schedule=kind, **kw).step_s
  slower = t_plan > t_single
  # One device is a fall-back only when the model fits it under the plan's caps.
  caps = tuple(plan.memory_caps_bytes or ())
  fits_one = not caps or sum(single.node_memory_bytes) <= min(caps)
  fall_back = fall_back and fits_one
  check = PlanCheck(
    plan_step_s=t_plan, single_step_s=t_single, planner_step_s=float(plan.predicted_step_s),
    fell_back=slower and fall_back, planned=plan,
  )
  if slower:
    what = ("running everything on model-axis device 0" if fall_back else
            "keeping the plan (one device would not fit the memory cap)" if not fits_one else
            "keeping the given plan")
    msg = (
      f"the plan (method {plan.method}, predicted "
      f"{plan.predicted_step_s * 1e3:.3g} ms by the planner) runs in "
      f"{t_plan * 1e3:.3g} ms per step as the program runs it (lock step), slower than one "
      f"device ({t_single * 1e3:.3g} ms): {what}"
    )
    warnings.warn(msg, stacklevel=3)
    log.warning("%s", msg)
    if fall_back:
      return single, check
  return plan, check
