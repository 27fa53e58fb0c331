"""The run's memory check before anything is allocated: the program's predicted per-device
memory against what a device holds, and the figures results.json reports."""

from __future__ import annotations

from typing import Any

from jaxhybrid import errors


def predicted_memory(hybrid: Any) -> Any:
  """The program's predicted per-device memory (jaxhybrid.program.memory; nothing compiled),
  computed once per program."""
  report = getattr(hybrid, "_predicted_memory", None)
  if report is None:
    report = hybrid.program.memory(compile=False)
    object.__setattr__(hybrid, "_predicted_memory", report)
  return report


def microbatch_advice(plan: Any, k: int) -> str:
  """The micro-batch part of a does-not-fit message (' or ...', or nothing). More micro-batches
  make each smaller, but a plan whose split nodes keep their weights in slices gathers a copy per
  micro-batch in flight, so there fewer take less (paper BigLSTM 1x8 with sliced weights:
  4.59 GiB at k=2, 4.00 GiB at k=1)."""
  sliced = any(s.get("split_params") for s in getattr(plan, "batch_splits", ()) or ())
  if not sliced:
    return f" or more --microbatches (now {k})"
  if k > 1:
    return (f" or fewer --microbatches (now {k}: each micro-batch in flight keeps its own "
            "gathered copy of the sliced weights)")
  return ""


def check_fits(hybrid: Any, limit_bytes: int | None = None) -> None:
  """Raises a one-line UsageError when the program's predicted per-device memory exceeds the
  device's (`limit_bytes`, default: the accelerator's `bytes_limit`; CPU hosts are not checked:
  their devices share the host's memory)."""
  if limit_bytes is None:
    dev = hybrid.mesh.devices.flat[0]
    if dev.platform == "cpu":
      return
    limit_bytes = (dev.memory_stats() or {}).get("bytes_limit")
    if not limit_bytes:
      return
  need = predicted_memory(hybrid).predicted
  if need > limit_bytes:
    raise errors.UsageError(
      f"the plan needs {need / 2**30:.2f} GiB per device (predicted), more than the "
      f"{limit_bytes / 2**30:.2f} GiB a device holds: use more model-axis devices (--mesh=DxM "
      "with a larger M), a smaller --batch"
      + microbatch_advice(hybrid.plan, hybrid.program.microbatches)
      + "; --dry_run prints the table"
    )


def memory_summary(hybrid: Any) -> dict[str, Any]:
  """Per-device memory of the step as the memory model predicts it (bytes), by part."""
  r = predicted_memory(hybrid)
  # The stage the program runs (one data replica runs every stage as 0).
  return {"zero": hybrid.program.zero, "predicted_bytes": int(r.predicted),
          "params_bytes": int(r.params), "optimizer_bytes": int(r.optimizer),
          "gradients_bytes": int(r.gradients)}
