"""A uniform chain for the benchmarks: input -> `layers` x (Linear width x width, tanh) -> head.

The textbook pipeline: equal stages, so its ideal model-parallel speedup and memory split are
known (1F1B with k micro-batches on M devices: M k / (k + M - 1)).
"""

from __future__ import annotations

from typing import Any


def make(width: int, layers: int, features: int, rngs: Any) -> Any:
  """The NNX chain (an `nnx.Module`; abstract under `nnx.eval_shape`)."""
  import jax.numpy as jnp
  from flax import nnx

  class Chain(nnx.Module):
    def __init__(self, *, rngs):
      self.inp = nnx.Linear(features, width, rngs=rngs)
      self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])
      self.head = nnx.Linear(width, features, rngs=rngs)

    def __call__(self, x):
      h = self.inp(x)
      for layer in self.layers:
        h = jnp.tanh(layer(h))
      return self.head(h)

  return Chain(rngs=rngs)


def loss_fn(m: Any, batch: Any) -> Any:
  """Mean squared error of the chain's output against batch['y']."""
  import jax.numpy as jnp

  return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)


class ChainSpec:
  """The chain with the registry spec's interface (make, loss_fn, synthetic_batch)."""

  width, layers, features = 256, 8, 64

  def make(self, rngs: Any) -> Any:
    return make(self.width, self.layers, self.features, rngs)

  loss_fn = staticmethod(loss_fn)

  def synthetic_batch(self, seed: int, n: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, self.features)).astype(np.float32),
            "y": rng.normal(size=(n, self.features)).astype(np.float32)}


def spec(**overrides: Any) -> ChainSpec:
  """A ChainSpec with `width`, `layers` or `features` overridden (ints or their strings)."""
  out = ChainSpec()
  for key, value in overrides.items():
    if key not in ("width", "layers", "features"):
      raise ValueError(f"--set {key}: the chain takes width, layers, features")
    setattr(out, key, int(value))
  return out
