"""The gradient noise scale a run measured (metrics.jsonl), as inputs to statistical efficiency.

`experiments/run.py` writes one JSON object per step to metrics.jsonl; rows carry `noise_scale`
(the smoothed B_simple of `jaxhybrid.noise_scale`, measured on the data axis) once the run has
two or more data-parallel workers. `read_noise_scale` collects that column with its mean and
spread; `se_from_noise_scale` turns it into an SE curve: one constant noise scale (the mean) or
the whole trajectory integrated step by step (`stat_eff.TrajectorySE`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics

from jaxhybrid.projection import stat_eff

MODES = ("trajectory", "mean")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredNoiseScale:
  """The noise-scale column of one run: values per step and their summary."""

  steps: tuple[int, ...]  # the steps with a usable value
  values: tuple[float, ...]  # B_noise (B_simple) at those steps, in samples
  run_batch: float  # global batch of the run (data x per-worker batch)
  source: str  # the metrics file
  skipped: int  # rows without a usable value (missing, non-finite or <= 0)

  @property
  def mean(self) -> float:
    return statistics.fmean(self.values)

  @property
  def std(self) -> float:
    return statistics.pstdev(self.values) if len(self.values) > 1 else 0.0

  def summary(self) -> dict[str, float]:
    v = sorted(self.values)
    return {"count": len(v), "mean": self.mean, "std": self.std, "min": v[0], "max": v[-1],
            "first": self.values[0], "last": self.values[-1], "run_batch": self.run_batch,
            "skipped": self.skipped}


def _run_batch_from_config(folder: str) -> float | None:
  """data x batch from the config.json run.py writes next to metrics.jsonl (None if absent)."""
  path = os.path.join(folder, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    cfg = json.load(f)
  m = re.fullmatch(r"(\d+)x(\d+)", str(cfg.get("mesh", "")))
  if not m or not cfg.get("batch"):
    return None
  return float(int(m.group(1)) * int(cfg["batch"]))


def read_noise_scale(
  path: str, *, run_batch: float | None = None, skip_first: int = 0
) -> MeasuredNoiseScale:
  """Reads the `noise_scale` column of a metrics.jsonl.

  Args:
    path: the metrics file.
    run_batch: the run's global batch; None reads it from the config.json beside the file.
    skip_first: steps to drop at the start (assumption to choose: the first estimates of the
      moving average rest on few steps).

  Raises:
    ValueError: an unreadable file, no usable value, or an unknown global batch.
  """
  steps, values, skipped = [], [], 0
  try:
    with open(path) as f:
      lines = [line for line in f if line.strip()]
  except OSError as e:
    raise ValueError(f"{path}: cannot read the metrics ({e.strerror or e}); pass a metrics.jsonl "
                     "written by experiments/run.py.") from None
  for i, line in enumerate(lines):
    row = json.loads(line)
    step = int(row.get("step", i + 1))
    v = row.get("noise_scale")
    if step <= skip_first:
      continue
    if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
      steps.append(step)
      values.append(float(v))
    else:
      skipped += 1
  if not values:
    raise ValueError(
      f"{path}: no positive finite 'noise_scale' in {len(lines)} rows; the noise scale needs a "
      "run with 2 or more data-parallel workers (e.g. run.py --mesh=4x2)."
    )
  if run_batch is None:
    run_batch = _run_batch_from_config(os.path.dirname(os.path.abspath(path)))
  if run_batch is None:
    raise ValueError(f"{path}: no config.json beside it gives the run's global batch; pass "
                     "run_batch (data x per-worker batch).")
  return MeasuredNoiseScale(steps=tuple(steps), values=tuple(values), run_batch=float(run_batch),
                            source=path, skipped=skipped)


def se_from_noise_scale(measured: MeasuredNoiseScale, mode: str = "trajectory") -> stat_eff.SECurve:
  """The SE curve of a measured noise scale.

  Args:
    measured: from `read_noise_scale`.
    mode: 'trajectory' integrates the per-step values (`stat_eff.TrajectorySE`); 'mean' uses their
      mean as one constant B_noise (`stat_eff.NoiseScaleSE`).

  Raises:
    ValueError: an unknown mode.
  """
  if mode == "trajectory":
    return stat_eff.TrajectorySE(b_noise=measured.values, run_batch=measured.run_batch,
                                 source=measured.source)
  if mode == "mean":
    return stat_eff.NoiseScaleSE(b_noise=measured.mean)
  raise ValueError(f"mode={mode!r}; use one of {', '.join(MODES)}.")
