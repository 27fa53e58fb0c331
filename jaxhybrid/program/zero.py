"""ZeRO over the data axis (Rajbhandari et al. 2020) inside the hybrid step.

Each data replica r of a model-axis device owns a 1/W share of that device's parameter rows: it
keeps the optimizer state of its share, updates only its share, and the updated shares are
all-gathered into every replica's full rows.

- Stage 1: the step accumulates the whole gradient row (as without ZeRO), then one
  reduce-scatter per dtype gives each replica the sum of its share.
- Stage 2: the gradient row never exists whole. Each group's gradient windows are
  reduce-scattered over 'data' as they leave the group's conditional and added into a 1/W
  accumulator: per-device gradient memory is 1/W of the row, for one reduce-scatter per window
  per micro-batch (k reduce-scatters of the row's bytes and one all-gather, against one
  all-reduce = one reduce-scatter + one all-gather).

Which elements are a replica's share. A row is cut into *segments* at every boundary the step
needs: each owned leaf's extent (padded to a multiple of W, `structure.param_layout`'s
`leaf_multiple`) and, under stage 2, each gradient window's range, on every model-axis device
(one cut list per row serves all of them, SPMD). Replica r owns the r-th 1/W of each segment; its
share of the row is those pieces side by side. A window then maps onto the shares without
moving data between segments: its [W, L/W] chunk-major form is its segments, each viewed as
[W, len/W], side by side; row by row it is each replica's share of the window, at offset
start/W of the share. Stage 1 uses one segment per row (the row viewed as [W, n/W]).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

Cuts = tuple[int, ...]  # sorted row offsets, 0 and the row length included


def whole_rows(sizes: Sequence[tuple[str, int]]) -> dict[str, Cuts]:
  """One segment per row (stage 1)."""
  return {r: (0, n) for r, n in sizes}


def row_cuts(layout, windows, W: int) -> dict[str, Cuts]:
  """Per row key, the segment boundaries of stage 2: every owned leaf's padded extent and every
  window's range on every model-axis device (see the module docstring).

  Args:
    layout: the program's ParamLayout, built with leaf_multiple=W.
    windows: `gradients.gradient_windows` of the program (per group, a list or None).
    W: the data width.
  """
  sizes = dict(layout.sizes)
  cuts: dict[str, set[int]] = {r: {0, n} for r, n in sizes.items()}
  for i, d in enumerate(layout.owner):
    if d < 0:
      continue
    n = 1
    for s in layout.shapes[i]:
      n *= s
    r, lo = layout.row_of[i], layout.offset[i]
    cuts[r].update((lo, lo + -(-n // W) * W))
  for ws in windows:
    for w in ws or ():
      for s in w.starts:
        cuts[w.row_key].update((s, s + w.length))
  out = {}
  for r, cs in cuts.items():
    cs = tuple(sorted(c for c in cs if 0 <= c <= sizes[r]))
    bad = [c for c in cs if c % W]
    if bad:
      raise RuntimeError(f"internal: row {r} cut at {bad[:3]}, not multiples of the data width {W}")
    out[r] = cs
  return out


def pieces(lo: int, hi: int, cuts: Cuts) -> list[tuple[int, int]]:
  """The segments of row range [lo, hi) (cut at `cuts`)."""
  edges = [lo] + [c for c in cuts if lo < c < hi] + [hi]
  return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def to_chunks(x: jax.Array, lo: int, cuts: Cuts, W: int) -> jax.Array:
  """[L] values of row range [lo, lo + L) -> [W, L/W]: row r is replica r's share of them."""
  parts = [x[a - lo:b - lo].reshape(W, (b - a) // W) for a, b in pieces(lo, lo + x.shape[0], cuts)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def share(row: jax.Array, cuts: Cuts, r: jax.Array, W: int) -> jax.Array:
  """Replica r's share ([n/W]) of a whole row ([n]); r may be traced."""
  parts = [lax.dynamic_slice_in_dim(row, a + r * ((b - a) // W), (b - a) // W)
           for a, b in pieces(0, row.shape[0], cuts)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def from_chunks(full: jax.Array, cuts: Cuts, W: int) -> jax.Array:
  """Every replica's share side by side ([W, n/W], an all-gather's output) -> the row [n]."""
  n = full.shape[1] * W
  parts = [full[:, a // W:b // W].reshape(-1) for a, b in pieces(0, n, cuts)]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
