"""Statistical efficiency from the run itself: the gradient noise scale (McCandlish et al. 2018).

The noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish, Kaplan, Amodei et al., "An Empirical
Model of Large-Batch Training", arXiv 1812.06162, section 2 and appendix A) predicts how the steps
to a target fall with the batch: steps(B) = S_min (1 + B_noise / B) (their section 2.3), where G is
the true gradient and Sigma the per-sample gradient covariance.

Estimating it costs almost nothing in data-parallel training. With per-sample-mean losses, a
gradient estimate from a batch of B samples satisfies E|G_B|^2 = |G|^2 + tr(Sigma) / B. Every DP
worker already holds a gradient at its own batch b_small = b, and the all-reduced mean holds one at
b_big = W * b. Appendix A's two-batch estimators are unbiased:

  |G|^2     ~ (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
  tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)

Each is noisy, so both are smoothed separately with an exponential moving average and B_simple is
the ratio of the averages (appendix A's advice: a ratio of averages, not an average of ratios).

How to call it in a shard_map train step with a 'data' axis of W workers, per-worker batch b:
  local_sq = tree_sq_norm(local_grads)   # this worker's gradient (batch b), before the pmean
  mean_sq = tree_sq_norm(mean_grads)     # after lax.pmean over 'data' (batch W * b)
  g_small_sq = lax.pmean(local_sq, 'data')  # averaging over workers keeps it unbiased
  g2, trace = noise_scale_estimates(g_small_sq, mean_sq, b, W * b)
  state = update_noise_scale(state, g2, trace)
`data_axis_estimates` does exactly this (plus the psum over a 'model' axis whose devices own
disjoint parameter shards).

This module also measures steps-to-target at several global batches on a single device (the DP
global-batch run in exact arithmetic), for experiments/stat_eff.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ArrayLike = jax.typing.ArrayLike


def tree_sq_norm(tree: Any) -> jax.Array:
  """Squared L2 norm of all leaves of a pytree, accumulated in float32."""
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return sum(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in leaves)


def noise_scale_estimates(
  g_small_sq_norm: ArrayLike,
  g_big_sq_norm: ArrayLike,
  b_small: ArrayLike,
  b_big: ArrayLike,
) -> tuple[jax.Array, jax.Array]:
  """Unbiased estimates of |G|^2 and tr(Sigma) from gradients at two batch sizes.

  McCandlish et al. 2018, appendix A. Both inputs must be squared norms of *mean* (not summed)
  per-sample gradients, i.e. the loss is averaged over the batch.

  Args:
    g_small_sq_norm: |G_small|^2, squared norm of a gradient from `b_small` samples (or the mean of
      several such squared norms, e.g. over the DP workers: still unbiased, less noisy).
    g_big_sq_norm: |G_big|^2, squared norm of a gradient from `b_big` samples (the all-reduced
      mean gradient of the DP workers).
    b_small: the small batch (per-worker batch b).
    b_big: the big batch (global batch W * b); must be larger than `b_small`.

  Returns:
    (g2, trace_sigma): estimates of |G|^2 and of tr(Sigma), the trace of the per-sample gradient
    covariance. Single estimates can be negative; smooth them before taking a ratio.
  """
  gs = jnp.asarray(g_small_sq_norm, jnp.float32)
  gb = jnp.asarray(g_big_sq_norm, jnp.float32)
  bs = jnp.asarray(b_small, jnp.float32)
  bb = jnp.asarray(b_big, jnp.float32)
  g2 = (bb * gb - bs * gs) / (bb - bs)
  trace_sigma = (gs - gb) / (1.0 / bs - 1.0 / bb)
  return g2, trace_sigma


def b_simple(g2: ArrayLike, trace_sigma: ArrayLike) -> jax.Array:
  """The simple noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, section 2)."""
  return jnp.asarray(trace_sigma, jnp.float32) / jnp.asarray(g2, jnp.float32)


class NoiseScaleState(NamedTuple):
  """Exponential moving averages of the two estimates (Adam-style, debiased by `count`)."""

  g2: jax.Array  # EMA of the |G|^2 estimates, not debiased
  trace_sigma: jax.Array  # EMA of the tr(Sigma) estimates, not debiased
  count: jax.Array  # number of updates so far (int32)


def init_noise_scale() -> NoiseScaleState:
  """An empty smoother state (all zeros)."""
  zero = jnp.zeros((), jnp.float32)
  return NoiseScaleState(g2=zero, trace_sigma=zero, count=jnp.zeros((), jnp.int32))


def update_noise_scale(
  state: NoiseScaleState, g2: ArrayLike, trace_sigma: ArrayLike, decay: float = 0.99
) -> NoiseScaleState:
  """Folds one pair of estimates into the moving averages.

  Args:
    state: the current smoother state.
    g2: one |G|^2 estimate (from `noise_scale_estimates`).
    trace_sigma: one tr(Sigma) estimate.
    decay: EMA decay per update (0.99 averages over about 100 steps; assumption, the noise
      scale drifts slowly during training).

  Returns:
    The new state.
  """
  g2 = jnp.asarray(g2, jnp.float32)
  trace_sigma = jnp.asarray(trace_sigma, jnp.float32)
  return NoiseScaleState(
    g2=decay * state.g2 + (1.0 - decay) * g2,
    trace_sigma=decay * state.trace_sigma + (1.0 - decay) * trace_sigma,
    count=state.count + 1,
  )


def smoothed_noise_scale(state: NoiseScaleState, decay: float = 0.99) -> jax.Array:
  """B_simple from the debiased moving averages (NaN before the first update).

  `decay` must be the one passed to `update_noise_scale`. The debiasing factor 1 - decay^count is
  common to both averages and cancels in the ratio; it is kept for clarity of the estimates.
  """
  correction = 1.0 - jnp.power(jnp.float32(decay), state.count.astype(jnp.float32))
  g2 = state.g2 / correction
  trace_sigma = state.trace_sigma / correction
  return jnp.where(state.count > 0, b_simple(g2, trace_sigma), jnp.nan)


def data_axis_estimates(
  local_grads: Any,
  mean_grads: Any,
  *,
  per_worker_batch: int,
  workers: int,
  data_axis: str = "data",
  model_axis: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The two estimates inside a shard_map train step (call it there; it uses collectives).

  Args:
    local_grads: this device's gradients from its worker's batch, before the data all-reduce.
    mean_grads: the same gradients after `lax.pmean` over `data_axis`.
    per_worker_batch: b, the samples behind `local_grads`.
    workers: W, the size of `data_axis` (must be >= 2 for an estimate).
    data_axis: the data-parallel mesh axis.
    model_axis: the model-parallel axis if parameters are split across it; its devices must hold
      disjoint parameter shards (pass replicated shared parameters on one device only), because
      the squared norms are summed over it.

  Returns:
    (g2, trace_sigma), identical on every device.

  Raises:
    ValueError: if `workers` < 2.
  """
  if workers < 2:
    raise ValueError(f"workers={workers}: the noise scale needs >= 2 data-parallel workers.")
  local_sq = tree_sq_norm(local_grads)
  mean_sq = tree_sq_norm(mean_grads)
  if model_axis is not None:
    local_sq = jax.lax.psum(local_sq, model_axis)
    mean_sq = jax.lax.psum(mean_sq, model_axis)
  small_sq = jax.lax.pmean(local_sq, data_axis)
  mean_sq = jax.lax.pmean(mean_sq, data_axis)  # already equal; makes it invariant over 'data'
  return noise_scale_estimates(small_sq, mean_sq, per_worker_batch, workers * per_worker_batch)


# --- Steps to a target at several global batches (single device, for experiments/stat_eff.py) ---


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepsToTargetConfig:
  """How each (global batch, learning rate) run is trained and judged."""

  target_loss: float  # the run has reached the target when the eval loss is <= this
  max_steps: int = 2000  # a run that has not reached the target by then counts as not reached
  eval_every: int = 10  # steps between evaluations (steps-to-target is rounded up to this)
  learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2)  # Adam LRs tried; the fastest counts
  # (McCandlish et al.'s model assumes a tuned LR per batch size)
  noise_chunks: int = 4  # the batch is split in this many chunks to measure the noise scale
  noise_decay: float = 0.95  # EMA decay of the noise-scale estimates
  seed: int = 0  # init seed; data seeds are derived from it and the step
  shared_keys: tuple[str, ...] = ("sampled_ids",)  # batch leaves without a batch axis, reused by
  # every chunk (the registry's convention for BigLSTM's shared negative samples)

  def __post_init__(self):
    if not self.learning_rates:
      raise ValueError("learning_rates is empty; give at least one, e.g. (1e-3,).")
    if self.max_steps < 1 or self.eval_every < 1 or self.noise_chunks < 1:
      raise ValueError(
        f"max_steps={self.max_steps}, eval_every={self.eval_every}, "
        f"noise_chunks={self.noise_chunks} must all be >= 1."
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
  """One global batch: the best steps-to-target over the learning rates and the noise scale."""

  global_batch: int  # B
  steps: int | None  # steps to reach the target (None: not within max_steps for any LR)
  learning_rate: float  # the LR that reached the target first
  b_simple: float  # smoothed B_simple measured during the best run (NaN if not measurable)
  final_loss: float  # eval loss at the end of the best run


class _Trainer:
  """Jitted train and eval steps of one spec, compiled once per batch shape for every LR."""

  def __init__(self, spec: Any, config: StepsToTargetConfig):
    import optax
    from flax import nnx

    self.spec, self.config = spec, config
    self.graphdef, _ = nnx.split(spec.make(nnx.Rngs(config.seed)))
    # The LR lives in the optimizer state, so one compiled step serves every LR.
    self.opt = optax.inject_hyperparams(optax.adam)(learning_rate=1.0)
    eval_fn = getattr(spec, "eval_loss_fn", None) or spec.loss_fn
    self.eval_loss = jax.jit(lambda p, b: eval_fn(nnx.merge(self.graphdef, p), b))
    self.step = jax.jit(self._step)

  def _loss(self, params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
    from flax import nnx

    return self.spec.loss_fn(nnx.merge(self.graphdef, params), batch)

  def _step(self, params, opt_state, noise, batch):
    import optax

    config = self.config
    batch_size = next(v.shape[0] for k, v in batch.items() if k not in config.shared_keys)
    chunks = config.noise_chunks if batch_size % config.noise_chunks == 0 else 1
    # Gradients of `chunks` equal slices: their mean is the full-batch gradient (batch B), each
    # one is a gradient at batch B / chunks; together they give the noise scale for free.
    split = {
      k: v if k in config.shared_keys else v.reshape((chunks, -1) + v.shape[1:])
      for k, v in batch.items()
    }
    axes = {k: None if k in config.shared_keys else 0 for k in batch}
    grads = jax.vmap(jax.grad(self._loss), in_axes=(None, axes))(params, split)
    mean = jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), grads)
    if chunks > 1:
      small = jnp.mean(jax.vmap(tree_sq_norm)(grads))
      g2, tr = noise_scale_estimates(small, tree_sq_norm(mean), batch_size // chunks, batch_size)
      noise = update_noise_scale(noise, g2, tr, config.noise_decay)
    updates, opt_state = self.opt.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, noise

  def run(
    self, batch_size: int, learning_rate: float, eval_batch: Mapping[str, np.ndarray]
  ) -> tuple[int | None, float, float]:
    """Trains one run; returns (steps to target or None, smoothed B_simple, last eval loss)."""
    from flax import nnx

    config = self.config
    _, params = nnx.split(self.spec.make(nnx.Rngs(config.seed)))
    opt_state = self.opt.init(params)
    opt_state.hyperparams["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
    noise = init_noise_scale()
    last = float("nan")
    for s in range(1, config.max_steps + 1):
      batch = self.spec.generated_task(config.seed * 1_000_003 + s, batch_size)
      params, opt_state, noise = self.step(params, opt_state, noise, batch)
      if s % config.eval_every == 0 or s == config.max_steps:
        last = float(self.eval_loss(params, eval_batch))
        if last <= config.target_loss:
          return s, float(smoothed_noise_scale(noise, config.noise_decay)), last
    return None, float(smoothed_noise_scale(noise, config.noise_decay)), last


def steps_to_target(
  spec: Any,
  global_batches: Sequence[int],
  config: StepsToTargetConfig,
  eval_batch: Mapping[str, np.ndarray],
  progress: Callable[[str], None] | None = None,
) -> tuple[RunResult, ...]:
  """Trains `spec` to `config.target_loss` at each global batch; one result per batch.

  Plain single-device `jax.jit` + optax training: in exact arithmetic the same as a DP run with
  that global batch. The gradient noise scale is measured in the same runs, from `noise_chunks`
  slices of every batch.

  Args:
    spec: a model spec with `.make(rngs)`, `.loss_fn(model, batch)` (mean over the batch) and
      `.generated_task(seed, batch_size)` (a dict of numpy arrays, batch on axis 0).
    global_batches: the global batch sizes B to try.
    config: training and target settings.
    eval_batch: the fixed batch the target loss is judged on.
    progress: optional callback receiving one line per finished run.

  Returns:
    One `RunResult` per batch size, in the given order.
  """
  trainer = _Trainer(spec, config)
  results = []
  for batch_size in global_batches:
    best: tuple[int | None, float, float, float] | None = None
    for lr in config.learning_rates:
      steps, noise, final = trainer.run(batch_size, lr, eval_batch)
      line = f"B={batch_size} lr={lr:g}: steps={steps} B_simple={noise:.1f} loss={final:.4f}"
      logging.info(line)
      if progress:
        progress(line)
      better = best is None or (steps is not None and (best[0] is None or steps < best[0]))
      if better:
        best = (steps, lr, noise, final)
    assert best is not None  # learning_rates is non-empty (checked by the config)
    results.append(
      RunResult(
        global_batch=batch_size,
        steps=best[0],
        learning_rate=best[1],
        b_simple=best[2],
        final_loss=best[3],
      )
    )
  return tuple(results)


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


SECurve = PerfectScaling | NoiseScaleSE | MeasuredSE
