"""The model state a step carries (`TrainState.model_state`): its writes combined over the mesh
and its leaves placed on it (`HybridProgram` uses both)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

from jaxhybrid.mesh import DATA, MODEL
from jaxhybrid.program.host_arrays import to_global


def combine_writes(writes: Sequence[jax.Array], data: int) -> tuple[jax.Array, ...]:
  """The state writes' values on every device (inside the step's shard_map): the shares of the
  model devices summed (only the maker's is nonzero); over data replicas a floating-point write
  is averaged (as data-parallel training averages BatchNorm statistics), any other taken as the
  largest (a counter every replica advances alike). The writes of one dtype travel as one flat
  buffer, one collective each: one psum per write cost Inception-V3's 188 BatchNorm statistics
  188 collectives a step, which over gloo between two processes tripled its step."""
  by_dtype: dict[Any, list[int]] = {}
  for j, x in enumerate(writes):
    by_dtype.setdefault(jnp.int32 if x.dtype == jnp.bool_ else x.dtype, []).append(j)
  out: list[Any] = list(writes)
  for dt, idx in by_dtype.items():
    flat = jnp.concatenate([writes[j].astype(dt).reshape(-1) for j in idx])
    flat = lax.psum(flat, MODEL)
    if data > 1:
      flat = lax.pmean(flat, DATA) if jnp.issubdtype(dt, jnp.floating) else lax.pmax(flat, DATA)
    pos = 0
    for j in idx:
      n = writes[j].size
      out[j] = flat[pos:pos + n].reshape(writes[j].shape).astype(writes[j].dtype)
      pos += n
  return tuple(out)


def replicated(x: Any, sharding: NamedSharding) -> jax.Array:
  """A new array of a state leaf on every device (PRNG keys, which numpy cannot hold, copied
  on device: the step donates what it is given, and the program keeps `x`)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.device_put(x.copy(), sharding)
  return to_global(np.asarray(x), sharding)
