"""Statistical efficiency SE(B) = E(b0) / E(B): how many more epochs a larger global batch needs.

Three curves (PAPER.md, "Statistical efficiency"): `PerfectScaling` (SE = 1), `NoiseScaleSE`
(McCandlish et al. 2018: steps(B) = S_min (1 + B_noise / B)), and `MeasuredSE` (measured
(batch, steps-or-epochs) points, interpolated log-log; `se_from_csv` reads them). `fit_s_min`
fits S_min to measured points for a given noise scale. The noise scale itself is measured by
`jaxhybrid.noise_scale` during training.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


def fit_s_min(points: Sequence[tuple[float, float]], b_noise: float) -> float:
  """Least-squares S_min (in log space) of steps(B) = S_min (1 + b_noise / B) through `points`.

  McCandlish et al. 2018 (section 2.3), with B_noise fixed (e.g. the measured B_simple): the only
  free parameter is S_min; its log-space optimum is the geometric mean of steps / (1 + b_noise / B).

  Raises:
    ValueError: if there are no points or b_noise is not positive and finite.
  """
  if not points:
    raise ValueError("fit_s_min needs at least one (global_batch, steps) point.")
  if not (b_noise > 0 and math.isfinite(b_noise)):
    raise ValueError(f"b_noise={b_noise} must be positive and finite.")
  logs = [math.log(steps / (1.0 + b_noise / batch)) for batch, steps in points]
  return math.exp(sum(logs) / len(logs))


# --- SE(B) curves for the projection ---
#
# Statistical efficiency SE(B) = E(b0) / E(B), epochs to the target at the baseline batch b0 over
# epochs at the global batch B (PAPER.md, analytical framework). Each curve returns epochs up to a
# constant factor (`relative_epochs`); SE is a ratio, so the factor cancels.


def _loglog_interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
  """Piecewise-linear interpolation in log-log space, extending the end segments outside."""
  lx = [math.log(v) for v in xs]
  ly = [math.log(v) for v in ys]
  t = math.log(x)
  if len(lx) == 1:
    return ys[0]
  i = 1
  while i < len(lx) - 1 and t > lx[i]:
    i += 1
  slope = (ly[i] - ly[i - 1]) / (lx[i] - lx[i - 1])
  return math.exp(ly[i - 1] + slope * (t - lx[i - 1]))


def _check_points(
  points: Sequence[tuple[float, float]], what: str
) -> tuple[tuple[float, float], ...]:
  pts = tuple(sorted((float(b), float(v)) for b, v in points))
  if not pts:
    raise ValueError(f"{what}: no points; give at least one (batch, value) pair.")
  if any(b <= 0 or v <= 0 for b, v in pts):
    raise ValueError(f"{what}: batches and values must be positive, got {pts}.")
  if len({b for b, _ in pts}) != len(pts):
    raise ValueError(f"{what}: duplicate batch sizes in {pts}; give one value per batch.")
  return pts


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerfectScaling:
  """SE(B) = 1: epochs to the target do not depend on the batch (the optimistic bound)."""

  def relative_epochs(self, global_batch: float) -> float:
    del global_batch
    return 1.0

  def se(self, global_batch: float, base_batch: float) -> float:
    return self.relative_epochs(base_batch) / self.relative_epochs(global_batch)

  def describe(self) -> str:
    return "perfect scaling: SE(B) = 1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseScaleSE:
  """McCandlish et al. 2018's model: steps(B) = S_min (1 + B_noise/B), so E(B) ∝ 1 + B/B_noise.

  SE(B) = E(b0)/E(B) = (B_noise + b0) / (B_noise + B).
  """

  b_noise: float  # gradient noise scale, in samples (B_simple or B_crit)

  def __post_init__(self):
    if not (self.b_noise > 0 and math.isfinite(self.b_noise)):
      raise ValueError(f"b_noise={self.b_noise} must be positive and finite.")

  def relative_epochs(self, global_batch: float) -> float:
    return 1.0 + global_batch / self.b_noise

  def se(self, global_batch: float, base_batch: float) -> float:
    return self.relative_epochs(base_batch) / self.relative_epochs(global_batch)

  def describe(self) -> str:
    return f"McCandlish et al. 2018 model, B_noise = {self.b_noise:g}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredSE:
  """Measured (global batch, steps or epochs to the target) points, interpolated in log-log space.

  Outside the measured range the end segments are extended (log-log linear), so a plateau of
  steps at large batches stays a plateau. Epochs are steps * B / D; D cancels in SE.
  """

  points: tuple[tuple[float, float], ...]  # (global batch B, steps or epochs to the target)
  unit: str = "steps"  # 'steps' or 'epochs': what the second column counts
  source: str = ""  # where the points come from (a run, a paper, a CSV path)

  def __post_init__(self):
    if self.unit not in ("steps", "epochs"):
      raise ValueError(f"unit={self.unit!r}; use 'steps' or 'epochs'.")
    object.__setattr__(self, "points", _check_points(self.points, "MeasuredSE"))

  def relative_epochs(self, global_batch: float) -> float:
    xs = [b for b, _ in self.points]
    value = _loglog_interp(global_batch, xs, [v for _, v in self.points])
    return value * global_batch if self.unit == "steps" else value

  def se(self, global_batch: float, base_batch: float) -> float:
    return self.relative_epochs(base_batch) / self.relative_epochs(global_batch)

  def describe(self) -> str:
    pts = ", ".join(f"({b:g}, {v:g})" for b, v in self.points)
    return f"measured {self.unit} to target vs global batch, log-log interpolated: {pts}" + (
      f" [{self.source}]" if self.source else ""
    )


def se_from_csv(path: str) -> MeasuredSE:
  """Reads a user's CSV with a header `global_batch,steps` or `global_batch,epochs`.

  Raises:
    ValueError: if the header is not one of those or a row does not parse.
  """
  import csv

  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  header = [h.strip() for h in rows[0]] if rows else []
  if len(header) != 2 or header[0] != "global_batch" or header[1] not in ("steps", "epochs"):
    raise ValueError(
      f"{path}: header {header}; the CSV must start with 'global_batch,steps' or "
      "'global_batch,epochs'."
    )
  points = []
  for i, row in enumerate(rows[1:], start=2):
    if not row or not "".join(row).strip():
      continue
    try:
      points.append((float(row[0]), float(row[1])))
    except (ValueError, IndexError) as e:
      raise ValueError(f"{path}:{i}: cannot parse {row} as two numbers ({e}).") from e
  return MeasuredSE(points=tuple(points), unit=header[1], source=path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrajectorySE:
  """A noise scale that changes over training, integrated over a measured run.

  McCandlish et al. 2018 (section 2.3) write the steps-to-target relation for a noise scale that
  changes as training proceeds (it grows as the loss falls) step by step:
  dS = dS_min (1 + B_noise(s) / B). A reference run at global batch B_run that measured B_noise_i
  at its steps i = 1..T made dS_min_i = 1 / (1 + B_noise_i / B_run) of progress per step, so a run
  at batch B needs

    S(B) = sum_i (1 + B_noise_i / B) / (1 + B_noise_i / B_run)

  steps to cover the same progress, and E(B) is proportional to S(B) B. With a constant noise
  scale this is `NoiseScaleSE` exactly. Assumption (named): the measured run's trajectory is the
  trajectory to the target; a short run covers only the start of training, where the noise
  scale is smallest, and then under-states how much larger batches cost later.
  """

  b_noise: tuple[float, ...]  # B_noise_i at each step (or equal slices) of the reference run
  run_batch: float  # B_run: the global batch of the reference run
  source: str = ""  # where the values come from (a metrics.jsonl path)

  def __post_init__(self):
    vals = tuple(float(v) for v in self.b_noise)
    if not vals or any(not (v > 0 and math.isfinite(v)) for v in vals):
      raise ValueError(
        f"TrajectorySE needs positive finite noise scales, got {len(vals)} values "
        f"(min {min(vals, default=float('nan'))}); drop warm-up or non-finite steps first."
      )
    if not self.run_batch > 0:
      raise ValueError(f"run_batch={self.run_batch} must be the reference run's global batch > 0.")
    object.__setattr__(self, "b_noise", vals)

  def steps(self, global_batch: float) -> float:
    """S(B) in steps of the reference run's length (S(B_run) = number of values)."""
    b, r = global_batch, self.run_batch
    return sum((1.0 + v / b) / (1.0 + v / r) for v in self.b_noise)

  def relative_epochs(self, global_batch: float) -> float:
    return self.steps(global_batch) * global_batch

  def se(self, global_batch: float, base_batch: float) -> float:
    return self.relative_epochs(base_batch) / self.relative_epochs(global_batch)

  def describe(self) -> str:
    v = self.b_noise
    return (
      f"noise scale integrated over a measured run ({len(v)} steps at B_run={self.run_batch:g}, "
      f"B_noise {min(v):.4g} .. {max(v):.4g}, mean {sum(v) / len(v):.4g})"
      + (f" [{self.source}]" if self.source else "")
    )


SECurve = PerfectScaling | NoiseScaleSE | MeasuredSE | TrajectorySE
