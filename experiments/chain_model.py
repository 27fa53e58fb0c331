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
