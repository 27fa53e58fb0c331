"""Loss helpers shared by the models (pure functions of logits and labels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float) -> jax.Array:
  """Cross-entropy against label-smoothed targets, per position.

  The target puts `1 - smoothing` on the true class and spreads `smoothing` uniformly over all
  classes (Szegedy et al. 2016, "label-smoothing regularization", Sec. 7), so the loss is
  `(1 - smoothing) * nll + smoothing * mean_k(-log p_k)`.

  Args:
    logits: [..., num_classes].
    labels: int [...], class indices.
    smoothing: smoothing mass in [0, 1).

  Returns:
    float32 [...] loss per position.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if smoothing == 0.0:
    return nll
  return (1.0 - smoothing) * nll - smoothing * jnp.mean(logp, axis=-1)
