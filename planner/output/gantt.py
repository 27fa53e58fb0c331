"""Gantt chart of a Plan's schedule (matplotlib, Agg backend)."""

from __future__ import annotations

import os

from jaxhybrid.planner.output.plan import Plan
from jaxhybrid.planner.core.task_schedule import TaskSchedule, timeline


def gantt(plan: Plan, path: str | os.PathLike[str], *, max_labels: int = 60) -> None:
  """Draws one row per device, a bar per task, and an arrow per cross-device transfer.

  Args:
    plan: the plan.
    path: PNG file to write.
    max_labels: label bars with node ids only when there are at most this many tasks.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  scale = 1e3  # seconds -> ms
  if isinstance(plan.task_schedule, TaskSchedule):
    _task_gantt(plan, path, plt, scale, max_labels)
    return
  fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * plan.devices))
  cmap = plt.get_cmap("tab10")
  for t in plan.schedule:
    ax.barh(
      t.device, (t.end_s - t.start_s) * scale, left=t.start_s * scale, height=0.6,
      color=cmap(t.microbatch % 10), edgecolor="black", linewidth=0.3,
    )
    if len(plan.schedule) <= max_labels:
      ax.text((t.start_s + t.end_s) / 2 * scale, t.device, str(t.node), ha="center",
              va="center", fontsize=6)
  for x in plan.transfers:
    ax.annotate(
      "", xy=(x.end_s * scale, x.dst_device - 0.3), xytext=(x.start_s * scale, x.src_device + 0.3),
      arrowprops=dict(arrowstyle="->", color="gray", linewidth=0.5),
    )
  ax.set_yticks(range(plan.devices))
  ax.set_yticklabels([f"device {d}" for d in range(plan.devices)])
  ax.invert_yaxis()
  ax.set_xlabel("time (ms); colour = micro-batch; arrows = transfers")
  ax.set_title(
    f"{plan.method}/{plan.status}: predicted step {plan.predicted_step_s * scale:.3f} ms, "
    f"speedup {plan.predicted_speedup:.2f}x"
    + (f"; bars: the fused task model's schedule (warm start), makespan "
       f"{plan.fused_makespan_s * scale:.3f} ms" if plan.lockstep_step_s else f", gap {plan.gap:.1%}")
  )
  fig.tight_layout()
  fig.savefig(os.fspath(path), dpi=120)
  plt.close(fig)


# Task kinds: hatch and label prefix (F forward, B backward or input cotangent, W weight gradient).
_KIND_STYLE = {"F": ("", "F"), "B": ("//", "B"), "W": ("xx", "W")}


def _task_gantt(plan: Plan, path, plt, scale: float, max_labels: int) -> None:
  """The F/B/W tasks the program runs, timed from the plan's per-node times (forward = 1/3 of
  forward + backward) with the cross-device dependencies of its transfers."""
  ts = plan.task_schedule
  deps = sorted({(x.src_node, x.dst_node) for x in plan.transfers})
  times = timeline(ts, deps, plan.node_compute_s)
  fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * plan.devices))
  cmap = plt.get_cmap("tab10")
  n_tasks = sum(len(ops) for ops in ts.devices)
  end = 0.0
  for d, ops in enumerate(ts.devices):
    for op in ops:
      start, stop = times[op]
      end = max(end, stop)
      hatch, prefix = _KIND_STYLE[op.kind]
      ax.barh(d, (stop - start) * scale, left=start * scale, height=0.6,
              color=cmap(op.microbatch % 10), hatch=hatch, edgecolor="black", linewidth=0.3)
      if n_tasks <= max_labels:
        ax.text((start + stop) / 2 * scale, d, f"{prefix}{op.node}", ha="center", va="center",
                fontsize=6)
  ax.set_yticks(range(plan.devices))
  ax.set_yticklabels([f"device {d}" for d in range(plan.devices)])
  ax.invert_yaxis()
  ax.set_xlabel("time (ms); colour = micro-batch; plain F, // B, xx W")
  predicted = (f"predicted step {plan.lockstep_step_s * scale:.3f} ms (lock-step); "
               if plan.lockstep_step_s else "")
  ax.set_title(f"{ts.kind} task schedule of {plan.method}: {predicted}tasks drawn as run "
               f"asynchronously, {end * scale:.3f} ms", fontsize=9)
  fig.tight_layout()
  fig.savefig(os.fspath(path), dpi=120)
  plt.close(fig)
