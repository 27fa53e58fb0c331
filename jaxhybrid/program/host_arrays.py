"""Arrays between the host and the mesh, safe when the mesh spans several processes."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def to_global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array from a host value that every process holds in full."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x: jax.Array) -> np.ndarray:
  """The full value of a global array on this host (gathered across processes if needed)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
