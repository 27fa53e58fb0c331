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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

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
