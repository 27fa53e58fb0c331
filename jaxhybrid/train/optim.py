"""Optimizer transforms that need a global view of the parameters, for the hybrid program.

The hybrid program (jaxhybrid.program) runs the optax update inside its `shard_map`: each
model-axis device sees only its own parameter row (`{'owned': {dtype: [1, size]}, 'shared':
[...]}`), so a transform that reduces over all parameters, such as `optax.clip_by_global_norm`,
would see one device's share. The transforms here complete the reduction over the 'model' axis.

They also work outside the program (on any pytree, with no mesh axis bound): there the norm is
the ordinary global norm, so one optimizer serves the hybrid program and a single-device
reference alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxhybrid.mesh import MODEL, owned_rows_axes


def _is_program_tree(updates: Any) -> bool:
  return isinstance(updates, dict) and set(updates) == {"owned", "shared"}


def _axis_bound(name: str) -> bool:
  try:
    lax.axis_index(name)
  except NameError:
    return False
  return True


def global_norm(updates: Any, axis_name: str = MODEL) -> jax.Array:
  """The L2 norm over all parameters of the model, wherever they live.

  Inside the hybrid program: sqrt(psum over `axis_name` of |owned rows|^2 + |shared leaves|^2);
  row padding is zero and shared leaves are identical on every device (their gradients are
  summed over the axis before the update), so this is the norm of the full gradient. Elsewhere:
  `optax.tree.norm(updates)`.
  """
  if not (_is_program_tree(updates) and _axis_bound(axis_name)):
    return optax.tree.norm(updates)
  sq = lambda tree: sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))  # noqa: E731
  axes = owned_rows_axes() if axis_name == MODEL else axis_name
  return jnp.sqrt(lax.psum(sq(updates["owned"]), axes) + sq(updates["shared"]))


def clip_by_global_norm(max_norm: float, axis_name: str = MODEL) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` that sees every model-axis device's parameters.

  Scales the updates by min(1, max_norm / global_norm) (Pascanu et al. 2013), with the norm of
  `global_norm` above. Use it in place of `optax.clip_by_global_norm` with
  `jaxhybrid.parallelize`, e.g. `optax.chain(jaxhybrid.train.optim.clip_by_global_norm(5.0),
  optax.adam(1e-3))` (GNMT clips at 5, Wu et al. 2016).

  Raises:
    ValueError: if `max_norm` is not positive.
  """
  if not max_norm > 0:
    raise ValueError(f"max_norm={max_norm}: use a positive clipping norm")

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates, axis_name)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
    return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state

  return optax.GradientTransformation(init, update)
