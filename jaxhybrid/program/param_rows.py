"""Per-device flat parameter rows: where the hybrid program keeps the parameters each device owns.

Every parameter leaf read by nodes of a single model-axis device lives in that device's row of a
flat `[model, size]` buffer per dtype (`structure.ParamLayout` gives owner and offset). Here:
host-side packing of leaves into rows and back, and the in-program views (each owned leaf sliced
from this device's row) and the gradient rows assembled from the views' gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhybrid.program.structure import ParamLayout


def pack(layout: ParamLayout, leaves: Sequence[Any]) -> dict[str, np.ndarray]:
  """Flat parameter leaves (graph order) -> {dtype: [devices, size]} rows, on the host.

  Shared leaves (owner -1) are not in any row; padding is zero.
  """
  rows = {dt: np.zeros((layout.devices, n), dt) for dt, n in layout.sizes}
  for i, leaf in enumerate(leaves):
    d = layout.owner[i]
    if d < 0:
      continue
    flat = np.asarray(leaf).reshape(-1)
    rows[layout.dtypes[i]][d, layout.offset[i] : layout.offset[i] + flat.size] = flat
  return rows


def unpack(layout: ParamLayout, rows: dict[str, np.ndarray], shared: Sequence[np.ndarray]) -> list[np.ndarray]:
  """The inverse of `pack`: leaves in graph order from host rows and the shared leaves."""
  by_leaf = dict(zip(layout.shared, shared))
  out = []
  for i, shape in enumerate(layout.shapes):
    if layout.owner[i] < 0:
      out.append(np.asarray(by_leaf[i]))
    else:
      n = math.prod(shape)
      out.append(rows[layout.dtypes[i]][layout.owner[i], layout.offset[i] : layout.offset[i] + n].reshape(shape))
  return out


def views(layout: ParamLayout, rows: dict[str, jax.Array]) -> dict[int, jax.Array]:
  """Every owned leaf sliced from this device's row at its owner's static offsets.

  On the owner the view is the leaf; on other devices it is unused filler (only the branch of
  the owner reads it). Differentiating with respect to these views rather than the rows turns
  the backward's per-leaf full-row padding (one row-sized buffer per leaf and per slot) into
  one concatenation per device layout (`rows_from_views`).
  """
  out = {}
  for i, d in enumerate(layout.owner):
    if d >= 0:
      n = math.prod(layout.shapes[i])
      out[i] = lax.slice(rows[layout.dtypes[i]], (layout.offset[i],), (layout.offset[i] + n,)).reshape(layout.shapes[i])
  return out


def rows_from_views(layout: ParamLayout, grads: dict[int, jax.Array]) -> dict[str, jax.Array]:
  """Gradient rows from view gradients: per device layout one concatenation, summed.

  On device d the views of other devices' leaves get zero gradient (no branch that runs on d
  reads them), so the sum over layouts is d's own row.
  """
  rows = {}
  for dt, size in layout.sizes:
    total = None
    for d in range(layout.devices):
      idx = sorted(
        (i for i, o in enumerate(layout.owner) if o == d and layout.dtypes[i] == dt),
        key=lambda i: layout.offset[i],
      )
      if not idx:
        continue
      parts = [grads[i].reshape(-1) for i in idx]
      used = layout.offset[idx[-1]] + math.prod(layout.shapes[idx[-1]])
      if used < size:
        parts.append(jnp.zeros((size - used,), grads[idx[0]].dtype))
      row = jnp.concatenate(parts)
      total = row if total is None else total + row
    rows[dt] = total if total is not None else jnp.zeros((size,), dt)
  return rows
