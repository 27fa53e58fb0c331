"""The training loop: steps, metrics (one JSON object per line), checkpoints, progress bar.

The loop is independent of how the step was built: it takes a step function
`(state, batch) -> (state, metrics)` (e.g. `Hybrid.step`) and a batch function `step -> batch`.
Batches must be a deterministic function of the step index (and the run's seed), so that a run
resumed from a checkpoint sees exactly the batches the uninterrupted run saw.

Example:
  result = train.fit(hybrid.step, hybrid.init(), lambda s: data(seed, s), steps=100,
                     checkpointer=Checkpointer(workdir + "/checkpoints", every=20),
                     metrics_path=workdir + "/metrics.jsonl")
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxhybrid import errors
from jaxhybrid import noise_scale as noise_lib

log = logging.getLogger(__name__)

StepFn = Callable[[Any, Any], tuple[Any, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseScaleOptions:
  """Inputs of the gradient-noise-scale estimate (McCandlish et al. 2018, appendix A)."""

  # b: samples behind one worker's gradient.
  per_worker_batch: int
  # W: data-parallel workers (the estimate needs W >= 2).
  workers: int
  # EMA decay of the two estimates (assumption: ~100-step average; see jaxhybrid.noise_scale).
  decay: float = 0.99


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainResult:
  """What a `fit` call did."""

  # The state after the last completed step.
  state: Any
  # Steps completed in total (including those before a resume).
  final_step: int
  # The metric rows written by this call (one per step).
  rows: tuple[dict[str, float], ...]
  # Median wall time of a step after the first of this call (the first includes compilation).
  measured_step_s: float | None
  # Wall time of the first step of this call (compilation + one step).
  first_step_s: float | None


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The rows of a metrics.jsonl file (an empty list if it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> None:
  """Keeps only rows with `step <= last_step` (on resume: drop steps the checkpoint lacks)."""
  rows = [r for r in read_metrics(path) if r["step"] <= last_step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)


def _progress(total: int, initial: int, enabled: bool):
  if not enabled:
    return None
  from tqdm import tqdm

  return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stdout,
              dynamic_ncols=True, mininterval=0.5)


def fit(
  step_fn: StepFn,
  state: Any,
  batch_fn: Callable[[int], Any],
  *,
  steps: int,
  start_step: int = 0,
  checkpointer: Any = None,
  metrics_path: str | None = None,
  progress: bool = True,
  noise_scale: NoiseScaleOptions | None = None,
) -> TrainResult:
  """Runs steps `start_step .. steps - 1`; step s trains on `batch_fn(s)`.

  Each completed step s + 1 appends a row {"step", "loss", "grad_sq_norm", "step_time_s",
  "steps_per_s", and "noise_scale" when the metrics allow it} to `metrics_path` (flushed, so a
  killed run keeps them), then checkpoints if due; the final step is always checkpointed. Only
  process 0 writes metrics and draws the progress bar.

  Args:
    step_fn: `(state, batch) -> (state, metrics)`; metrics hold at least a scalar 'loss'.
    state: the state before step `start_step`.
    batch_fn: step index -> global batch (deterministic).
    steps: total steps of the run (not of this call).
    start_step: steps already done (0, or the restored checkpoint's step).
    checkpointer: a `jaxhybrid.train.checkpoint.Checkpointer` (or None: no checkpoints).
    metrics_path: metrics.jsonl to append to (None: not written).
    progress: draw a tqdm progress bar (loss, steps/s).
    noise_scale: estimate the gradient noise scale when the step's metrics carry
      'worker_grad_sq_norm' (|g_worker|^2 averaged over workers) and 'grad_sq_norm'.

  Returns:
    The `TrainResult`.

  Raises:
    NonFiniteLossError: the loss became NaN or infinite; nothing of that step is saved and the
      last good checkpoint is kept.
  """
  primary = jax.process_index() == 0
  rows: list[dict[str, float]] = []
  times: list[float] = []
  ema = noise_lib.init_noise_scale() if noise_scale else None
  bar = _progress(steps, start_step, progress and primary)
  out = open(metrics_path, "a") if metrics_path and primary else None  # noqa: SIM115
  try:
    for s in range(start_step, steps):
      batch = batch_fn(s)
      t0 = time.perf_counter()
      state, metrics = step_fn(state, batch)
      metrics = jax.device_get(metrics)  # waits for the step
      dt = time.perf_counter() - t0
      loss = float(metrics["loss"])
      if not math.isfinite(loss):
        last = None
        if checkpointer is not None:
          checkpointer.wait()
          last = checkpointer.latest_step()
        where = f"the last good checkpoint is step {last}" if last is not None else "no checkpoint was written"
        raise errors.NonFiniteLossError(
          f"loss is {loss} at step {s + 1}; training stopped and {where}: lower --learning_rate "
          "(or check the data) and rerun with --resume",
          step=s + 1, last_checkpoint=last,
        )
      times.append(dt)
      row = {"step": s + 1, "loss": loss, "step_time_s": dt, "steps_per_s": 1.0 / dt if dt > 0 else 0.0}
      if "grad_sq_norm" in metrics:
        row["grad_sq_norm"] = float(metrics["grad_sq_norm"])
      if noise_scale and noise_scale.workers >= 2 and "worker_grad_sq_norm" in metrics:
        b = noise_scale.per_worker_batch
        g2, tr = noise_lib.noise_scale_estimates(
          metrics["worker_grad_sq_norm"], metrics["grad_sq_norm"], b, noise_scale.workers * b)
        ema = noise_lib.update_noise_scale(ema, g2, tr, noise_scale.decay)
        row["noise_scale"] = float(noise_lib.smoothed_noise_scale(ema, noise_scale.decay))
      rows.append(row)
      if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", steps_per_s=f"{row['steps_per_s']:.2f}")
      if checkpointer is not None:
        checkpointer.maybe_save(s + 1, state, force=s + 1 == steps)
    if checkpointer is not None:
      checkpointer.wait()
  finally:
    if bar is not None:
      bar.close()
    if out is not None:
      out.close()
  later = times[1:] or times
  return TrainResult(
    state=state,
    final_step=max(start_step, steps),
    rows=tuple(rows),
    measured_step_s=statistics.median(later) if later else None,
    first_step_s=times[0] if times else None,
  )
