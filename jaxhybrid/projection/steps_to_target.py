"""Steps to a target loss at several global batches, measured on one device.

The DP global-batch run in exact arithmetic: each global batch is trained (for each learning rate)
until the eval loss reaches a target, and the gradient noise scale is measured on the way
(`jaxhybrid.noise_scale`). The (batch, steps) points feed `stat_eff.fit_s_min` and
`stat_eff.MeasuredSE`; experiments/bench/stat_eff.py is the entry point.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.noise_scale import (
  init_noise_scale,
  noise_scale_estimates,
  smoothed_noise_scale,
  tree_sq_norm,
  update_noise_scale,
)

log = logging.getLogger(__name__)

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
      log.info(line)
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
