"""Per-device flat parameter rows: where the hybrid program keeps the parameters each device owns.

Every parameter leaf read by nodes of a single model-axis device lives in that device's row of a
flat `[model, size]` buffer (`structure.ParamLayout` gives owner, row and offset: a packed row per
dtype and slot rows for large leaves). Here:
host-side packing of leaves into rows and back (in the program each task slices its node's
leaves from its own row; `jaxhybrid.program.executor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxhybrid.program.structure import ParamLayout, row_dtype


def pack(layout: ParamLayout, leaves: Sequence[Any]) -> dict[str, np.ndarray]:
  """Flat parameter leaves (graph order) -> {row key: [devices, size]} rows, on the host.

  Shared leaves (owner -1) are not in any row; padding is zero.
  """
  rows = {r: np.zeros((layout.devices, n), row_dtype(r)) for r, n in layout.sizes}
  for i, leaf in enumerate(leaves):
    d = layout.owner[i]
    if d < 0:
      continue
    flat = np.asarray(leaf).reshape(-1)
    rows[layout.row_of[i]][d, layout.offset[i] : layout.offset[i] + flat.size] = flat
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
      row = rows[layout.row_of[i]]
      out.append(row[layout.owner[i], layout.offset[i] : layout.offset[i] + n].reshape(shape))
  return out
