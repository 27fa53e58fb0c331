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
  try:
    _, hybrid, _ = runner.build(config, abstract=True)
    planner_error = None
  except errors.DoesNotFitError as e:
    # Plan without caps: the table then shows what the model needs on these devices.
    planner_error = str(e)
    _, hybrid, _ = runner.build(config, abstract=True, uncapped=True)
  report = hybrid.program.memory()
  capacity = hw_lib.get(hw_name).memory_bytes
  if getattr(config, "memory_cap_gib", None):  # the user's budget per device, not the hardware's
    capacity = min(capacity, config.memory_cap_gib * 2**30)
  table = report.table(capacity)
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
    "does_not_fit": None if fits else _advice(
      config, report, capacity, hybrid.plan, hybrid.mesh.shape[mesh_lib.DATA],
      hybrid.mesh.shape[mesh_lib.MODEL])
    + (f" (the plan under the cap: {planner_error})" if planner_error else ""),
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


def _advice(config: Any, report: Any, capacity: float, plan: Any, data: int, m: int) -> str:
  """One line: which model-axis devices do not fit, by how much, and what to try."""
  gib = float(1 << 30)
  need = report.compiled if report.compiled is not None else report.predicted
  peaks = list(getattr(plan, "device_peak_bytes", ()) or ())
  over = [d for d, b in enumerate(peaks) if b > capacity] or list(range(len(peaks) or 1))
  # The program allocates the same on every device: name devices only when the plan's own
  # figures single some out.
  who = ("every model-axis device needs" if len(over) == max(len(peaks), 1) and m > 1 else
         f"model-axis device(s) {', '.join(map(str, over))} need")
  return (f"does not fit: {who} "
          f"{need / gib:.2f} GiB of {capacity / gib:.2f} GiB"
          + (" (--memory_cap_gib)" if getattr(config, "memory_cap_gib", None) else "")
          + "; try more model devices "
          f"(--mesh={data}x{2 * m}), a smaller --batch (now {config.batch})"
          + memory_check.microbatch_advice(plan, config.microbatches)
          + (", or --zero=2 (optimizer state and gradients sharded over the data replicas)"
             if data > 1 and getattr(config, "zero", 0) < 2 else ""))


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
