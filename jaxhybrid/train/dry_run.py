"""`run.py --dry_run`: plan, compile from abstract inputs and report per-device memory.

Nothing is allocated: the model comes from `nnx.eval_shape`, the program is lowered from
`jax.ShapeDtypeStruct`s with shardings and XLA's compile-time memory analysis gives each
device's argument and temporary bytes (`HybridProgram.memory`). So a paper-size model can be
checked for fit on a CPU host before any accelerator time is spent.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxhybrid import errors
from jaxhybrid import mesh as mesh_lib
from jaxhybrid.planner.core.options import size_text
from jaxhybrid.train import memory_check


def run(config: Any) -> dict[str, Any]:
  """Plans and compiles `config`'s program without allocating it; writes results.json + plan.json.

  Returns:
    The content of results.json: config, plan, memory (per device, predicted and compiled),
    memory_table (text), capacity and fits.

  Raises:
    UsageError: bad input (as `runner.build`).
  """
  import jax

  from jaxhybrid.costs import hardware as hw_lib
  from jaxhybrid.projection import paper_scenario
  from jaxhybrid.train import runner

  if config.batch is None and config.size == "paper":
    paper = paper_scenario.PAPER_MODELS.get(config.model)
    if paper is not None:  # the paper's per-GPU batch, whatever the host
      config = dataclasses.replace(config, batch=paper.per_gpu_batch)
  hw_name = config.hardware
  if hw_name is None:
    kind = jax.devices()[0].device_kind.lower()
    hw_name = next((n for n, key in (("dgx-h200", "h200"), ("dgx-h100", "h100"),
                                     ("dgx-a100", "a100"), ("dgx1-v100", "v100")) if key in kind),
                   "dgx1-v100")
    # Plan for the accelerator the memory is checked against (its costs, and its device memory
    # as the planner's memory cap), not for this host.
    config = dataclasses.replace(config, hardware=hw_name)
  config = runner._resolve(config)  # noqa: SLF001 (the run's own defaults)
  runner.validate(config)
  os.makedirs(config.workdir, exist_ok=True)
  capacity = hw_lib.get(hw_name).memory_bytes
  user_cap = getattr(config, "memory_cap_gib", None)
  if user_cap:  # the user's budget per device, not the hardware's
    capacity = min(capacity, user_cap * 2**30)
  hybrid, planner_error, shown = _closest_plan(config, runner, hw_lib.get(hw_name).memory_bytes)
  report = hybrid.program.memory()
  table = report.table(capacity)
  if shown:
    table = shown + "\n" + table
  fits = report.fits(capacity) and planner_error is None
  plan_memory = _plan_memory(hybrid.plan, report, getattr(hybrid.check, "memory_refits", ()))
  if plan_memory["lines"]:
    table = table + "\n" + "\n".join(plan_memory["lines"])
  results = {
    "config": runner._config_json(config),  # noqa: SLF001
    "dry_run": True,
    "graph": {"nodes": len(hybrid.graph.nodes), "fingerprint": hybrid.graph.fingerprint()},
    "plan": {"summary": hybrid.plan.summary(), "method": hybrid.plan.method,
             "assignment": list(hybrid.plan.assignment),
             "predicted_speedup": hybrid.plan.predicted_speedup,
             "lockstep_step_s": hybrid.plan.lockstep_step_s,
             "lockstep_speedup": hybrid.plan.lockstep_speedup,
             "reference_step_s": hybrid.plan.reference_step_s,
             "reference_speedup": hybrid.plan.reference_speedup,
             "memory_caps_bytes": list(hybrid.plan.memory_caps_bytes),
             "device_peak_bytes": list(hybrid.plan.device_peak_bytes)},
    "plan_memory": {k: v for k, v in plan_memory.items() if k != "lines"},
    "schedule": {"kind": hybrid.program.schedule.kind,
                 "in_flight": hybrid.program.schedule.in_flight()},
    "memory": report.to_dict(),
    "memory_table": table,
    "memory_hardware": hw_name,
    "memory_capacity_bytes": capacity,
    "fits": fits,
    # The planner's own reason under the cap (the table is then the uncapped plan's).
    "planner_error": planner_error,
    # Which plan the table shows when none was found under the cap ('' when it is the capped one).
    "plan_shown": shown,
    "does_not_fit": None if fits else _advice(
      config, report, capacity, hybrid.plan, hybrid.mesh.shape[mesh_lib.DATA],
      hybrid.mesh.shape[mesh_lib.MODEL], planner_error),
    "mesh": {"data": hybrid.mesh.shape[mesh_lib.DATA], "model": hybrid.mesh.shape[mesh_lib.MODEL]},
  }
  try:
    with open(os.path.join(config.workdir, "results.json"), "w") as f:
      json.dump(results, f, indent=1)
    hybrid.plan.save(os.path.join(config.workdir, "plan.json"))
  except OSError as e:
    raise errors.UsageError(
      f"--workdir={config.workdir!r} is not writable ({e.strerror or e}): pass a folder you can "
      "write to") from None
  return results


def _closest_plan(config: Any, runner: Any, hardware_bytes: int) -> tuple[Any, str | None, str]:
  """(hybrid, the planner's error under the cap or None, a line naming the plan shown or '').

  When the planner finds no plan under the user's --memory_cap_gib, the table shows the plan
  made under the hardware's own memory (the planner then still splits and spreads to fit it:
  paper BigLSTM 1x8 compiles to 5.80 GiB per device under the V100's 16 GiB, 12.13 GiB with no
  cap), and only when none fits that either, the plan made with no cap."""
  try:
    _, hybrid, _ = runner.build(config, abstract=True)
    return hybrid, None, ""
  except errors.DoesNotFitError as e:
    planner_error = str(e)
  gib = float(1 << 30)
  user_cap = getattr(config, "memory_cap_gib", None)
  if user_cap and user_cap * gib < hardware_bytes:
    try:
      _, hybrid, _ = runner.build(dataclasses.replace(config, memory_cap_gib=None), abstract=True)
      return hybrid, planner_error, (
        f"no plan found under the {size_text(user_cap * gib)} cap; below: the plan made under "
        f"the {config.hardware} memory ({size_text(hardware_bytes)} per device)")
    except errors.DoesNotFitError:
      pass
  _, hybrid, _ = runner.build(config, abstract=True, uncapped=True)
  return hybrid, planner_error, ("no plan found under the memory cap; below: the plan made with "
                                 "no cap")


def _advice(config: Any, report: Any, capacity: float, plan: Any, data: int, m: int,
            planner_error: str | None = None) -> str:
  """One line: which model-axis devices do not fit, by how much, and what to try."""
  need = report.compiled if report.compiled is not None else report.predicted
  peaks = list(getattr(plan, "device_peak_bytes", ()) or ())
  over = [d for d, b in enumerate(peaks) if b > capacity] or list(range(len(peaks) or 1))
  # The program allocates the same on every device: name devices only when the plan's own
  # figures single some out.
  who = ("every model-axis device needs" if len(over) == max(len(peaks), 1) and m > 1 else
         f"model-axis device(s) {', '.join(map(str, over))} need")
  cap_flag = " (--memory_cap_gib)" if getattr(config, "memory_cap_gib", None) else ""
  head = f"does not fit: {who} {size_text(need)} of {size_text(capacity)}{cap_flag}"
  if planner_error is not None:
    head += (" in the plan shown (table above); the planner found no plan within the cap ("
             + _closest(planner_error) + ")")
  batch_split = ("" if m < 2 or getattr(config, "batch_split", False) else
                 ", --batch_split --batch_split_params=split (split big nodes by rows of the "
                 "micro-batch, their weights in one slice per device)")
  return (head + "; try more model devices "
          f"(--mesh={data}x{2 * m}), a smaller --batch (now {config.batch})" + batch_split
          + memory_check.microbatch_advice(plan, config.microbatches)
          + (", or --zero=2 (optimizer state and gradients sharded over the data replicas)"
             if data > 1 and getattr(config, "zero", 0) < 2 else ""))


def _closest(planner_error: str) -> str:
  """The planner's own figure from its message: how far its closest placement was."""
  import re

  found = re.search(r"the closest needs ([0-9.]+ [GMK]iB|[0-9]+ bytes) more", planner_error)
  if found:
    return f"the closest placement it priced needs {found.group(1)} more by its memory model"
  from jaxhybrid.planner.place_lockstep import REMEDY

  why = planner_error.replace(f": {REMEDY}", "").replace(f"; {REMEDY}", "").rstrip(".")
  return why[:1].lower() + why[1:]


def _plan_memory(plan: Any, report: Any, refits: Any = ()) -> dict[str, Any]:
  """The planner's memory per device beside the program's compiled (and predicted) memory.

  The planner counts, per device, the static bytes (parameters, optimizer state, gradient row)
  of the device that owns the most (every device allocates rows that long), the leaves several
  devices read, the lock-step groups' buffers and gradient windows at their peak, and the batch
  (planner.price.peak_memory_bytes).
  The program is SPMD: its compiled figure is per device and the same on every model-axis device
  (rows padded to the largest device's), so each device's plan figure is compared with it.
  `refits`: the checks of the program's predicted memory against the cap (`program.fit`); more
  than one means the plan was re-made under lower planner caps.
  """
  peaks = list(getattr(plan, "device_peak_bytes", ()) or ())
  compiled = report.compiled
  out: dict[str, Any] = {"planner_bytes": peaks, "compiled_bytes": compiled,
                         "predicted_bytes": report.predicted, "lines": [],
                         "refits": [dataclasses.asdict(r) for r in refits]}
  if not peaks:
    return out
  gib = float(1 << 30)
  lines = ["planner memory per device (the fullest device's rows + the step's values at their "
           "peak, group buffers as long as the largest device's + the batch) vs the program:"]
  if len(refits) > 1:
    lines.insert(0, f"re-planned {len(refits) - 1} time(s) under lower planner caps: the program "
                 "needed " + ", ".join(f"{r.program_bytes / gib:.2f}"
                                      + (" (compiled)" if r.compiled else "") for r in refits[:-1])
                 + f" GiB per device over the {refits[0].cap / gib:.2f} GiB cap")
  caps = list(getattr(plan, "memory_caps_bytes", ()) or ())
  if compiled and caps and any(b > c for b, c in zip(peaks, caps)) and compiled <= min(caps):
    lines.insert(0, "the planner's search found no plan under the cap; this plan, made without "
                 "it, is kept because its program compiles within the cap")
  for d, b in enumerate(peaks):
    cap = plan.memory_caps_bytes[d] if d < len(plan.memory_caps_bytes) else None
    row = f"  device {d}: planner {b / gib:7.3f} GiB"
    if cap:
      row += f" (cap {cap / gib:.2f} GiB)"
    if compiled:
      row += f", compiled {compiled / gib:7.3f} GiB ({compiled / b - 1:+.1%} vs planner)" if b else ""
    lines.append(row)
  out["max_ratio_compiled_to_planner"] = (compiled / max(peaks)) if compiled and max(peaks) else None
  out["lines"] = lines
  return out
