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
start/W of the share. Stage 1 uses one segment per row (the row viewed as [W, n/W]). `tail` is
the step's end under either stage (the sliced update and the all-gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxhybrid.mesh import DATA, MODEL, owned_rows_over
from jaxhybrid.program import gradients
from jaxhybrid.program.structure import rows_by_dtype

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


# Platforms on which a reduce-scatter over 'data' is a ring of W - 1 `ppermute`s rather than
# `lax.psum_scatter`. XLA's CPU collectives over gloo run psum_scatter as gloo's halving-doubling
# reduce-scatter on a full-size host copy of the input; on this project's 2-core VM (two one-core
# processes, experiments/results/bench_collectives.json) 38 MiB took 35.5 ms that way and 17.7 ms
# as one ppermute of the half plus an add, while the all-reduce it replaces took 42.7 ms and the
# all-gather 17.7 ms: reduce-scatter + all-gather 1.25x the all-reduce with psum_scatter, 0.83x
# with the ring. Elsewhere (NCCL on GPUs) the library's reduce-scatter is the tuned primitive.
RING_SCATTER_PLATFORMS = ("cpu",)


def ring_scatter(mesh) -> bool:
  """Whether reduce-scatters over 'data' on `mesh` go round a ppermute ring
  (RING_SCATTER_PLATFORMS)."""
  return mesh.devices.flat[0].platform in RING_SCATTER_PLATFORMS


def reduce_scatter(x: jax.Array, W: int, ring: bool) -> jax.Array:
  """Inside shard_map: `x` [W, c] -> [c], at replica r the sum over the 'data' replicas of their
  row r (`lax.psum_scatter(x, DATA, scatter_dimension=0, tiled=False)`). With `ring`, W - 1
  ppermutes to the next replica: replica r starts from its row r - 1, and at hop s adds its
  row r - 1 - s to what it received, so after W - 1 hops it holds the whole sum of row r."""
  if W == 1:
    return x[0]
  if not ring:
    return lax.psum_scatter(x, DATA, scatter_dimension=0, tiled=False)
  r = lax.axis_index(DATA)
  nxt = [(i, (i + 1) % W) for i in range(W)]
  acc = lax.dynamic_index_in_dim(x, (r - 1) % W, 0, keepdims=False)
  for s in range(1, W):
    acc = lax.ppermute(acc, DATA, perm=nxt) + lax.dynamic_index_in_dim(x, (r - 1 - s) % W, 0,
                                                                       keepdims=False)
  return acc


# A segment whose gathered shares (W x its share) exceed this many bytes is all-gathered in
# pieces of at most this many bytes inside a loop that writes each into the old row in place
# (the rows are donated): the whole gathered segment is never alive beside the rows. Paper
# BigLSTM at 16x2, stage 2: one all-gather per dtype kept 3.31 GiB of temporaries (the whole
# row); in pieces, the step's temporaries went from 3.52 to 2.28 GiB per device. (Unrolled
# pieces did not do it: XLA ran every all-gather first, or copied the row.)
GATHER_CHUNK_BYTES = 256 << 20


def rows_from_shares(rows: dict[str, jax.Array], shares: dict[str, jax.Array],
                     keys: Sequence[str], cuts: dict[str, Cuts], W: int, gather: Any,
                     after: jax.Array | None = None) -> dict[str, jax.Array]:
  """The whole rows ([n] each) of one dtype's row keys `keys` from this replica's updated
  shares ([n/W] each), with `gather` ([c] -> [W, c], every replica's piece: `lax.all_gather`
  over 'data'). Segments larger than `GATHER_CHUNK_BYTES` gathered are written piece by piece
  into the old rows `rows` in place; the others are gathered at once, as one buffer.
  `after`: a float scalar the in-place writes wait for (the step's loss: a conditional that
  only makes the loss may still read the old rows, and XLA copies a row overwritten while an
  unordered reader remains)."""
  item = shares[keys[0]].dtype.itemsize
  big, small = [], []  # (key, segment start, share length)
  for k in keys:
    for a, b in pieces(0, shares[k].shape[0] * W, cuts[k]):
      (big if (b - a) * item > GATHER_CHUNK_BYTES else small).append((k, a, (b - a) // W))
  if not big:
    slices = [shares[k] for k in keys]
    flat = jnp.concatenate(slices) if len(slices) > 1 else slices[0]
    full = gather(flat)  # [W, S]
    out, at = {}, 0
    for k, x in zip(keys, slices):
      n = x.shape[0]
      part = full[:, at:at + n] if len(keys) > 1 else full
      out[k] = from_chunks(part, cuts[k], W)
      at += n
    return out
  out = dict(rows)
  dep = (after * 0).astype(out[keys[0]].dtype) if after is not None else None
  if small:
    parts = [lax.slice_in_dim(shares[k], a // W, a // W + m) for k, a, m in small]
    flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    got = gather(flat if dep is None else flat + dep)  # [W, sum of m]
    at = 0
    for k, a, m in small:
      for r in range(W):
        start = lax.optimization_barrier(jnp.int32(a + r * m))
        out[k] = lax.dynamic_update_slice(out[k], got[r, at:at + m], (start,))
      at += m
  c = max(1, GATHER_CHUNK_BYTES // (W * item))
  for k, a, m in big:
    n_chunks = -(-m // c)
    share = shares[k]

    def body(j, row, k=k, a=a, m=m, share=share):
      at = jnp.minimum(j * c, m - c).astype(jnp.int32)  # the last piece ends at the share's end
      piece = lax.dynamic_slice_in_dim(share, a // W + at, c)
      if dep is not None:
        piece = piece + dep
      got = gather(piece)
      for r in range(W):
        row = lax.dynamic_update_slice(row, got[r], (a + r * m + at,))
      return row

    out[k] = lax.fori_loop(0, n_chunks, body, out[k])
  return out


def tail(prog: Any, params, opt_state, g_owned, g_shared, loss, sq_worker, W):
  """The step's tail under ZeRO, inside shard_map: each data replica takes its share of the
  gradient rows (averaged over 'data'), updates its share of the parameters with its share of the
  optimizer state, and all-gathers the updated shares into whole rows (`jaxhybrid.program.zero`
  says which elements are a replica's share).

  Stage 1: `g_owned` are the whole flat gradient buffers; one reduce-scatter per dtype, not per
  row: the rows of the dtype, each viewed as [W, n/W], are laid side by side as one [W, S]
  buffer and scattered over its first axis. (Per row, the collectives cost their latency each;
  over gloo on 2 CPU processes that made GNMT-small's 2x1 step 24 % slower than the all-reduce
  of the flat buffer.) Stage 2: `g_owned` are already this replica's shares, summed over the
  replicas as the groups made them (executor.run_groups). One all-gather per dtype either way,
  except for segments too large to gather whole beside the rows (`rows_from_shares`).
  """
  cuts, sizes = prog.zero_cuts, dict(prog.layout.sizes)
  r = lax.axis_index(DATA)
  by_dtype = rows_by_dtype(prog.layout.sizes)
  g_mine, p_mine = {}, {}
  if prog.zero == 1:
    g_owned = lax.optimization_barrier(g_owned)  # as in the replicated tail (hybrid.py, see there)
    g_rows = gradients.cut_rows(prog.layout, g_owned)
  for dt, keys in by_dtype.items():
    if prog.zero == 1:
      parts = [to_chunks(g_rows[k], 0, cuts[k], W) for k in keys]
      stacked = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
      mine = reduce_scatter(stacked, W, ring_scatter(prog.mesh))
    else:
      mine = g_owned[dt]
    mine = mine / W  # the replicas' sum -> their mean, as pmean
    at = 0
    for k in keys:
      n = sizes[k] // W
      g_mine[k] = (lax.slice_in_dim(mine, at, at + n) if len(keys) > 1 else mine)[None]
      p_mine[k] = share(params["owned"][k][0], cuts[k], r, W)[None]
      at += n
  # |g|^2 at the global batch: the slices over both axes, plus the (replicated) shared leaves.
  sq_global = (lax.psum(gradients.sum_of_squares(g_mine), (MODEL, DATA))
               + gradients.sum_of_squares(g_shared))
  grads = {"owned": g_mine, "shared": g_shared}
  mine = {"owned": p_mine, "shared": params["shared"]}
  with owned_rows_over((MODEL, DATA)):  # global norms see every slice
    updates, opt_state = prog.optimizer.update(grads, opt_state, mine)
  mine = optax.apply_updates(mine, updates)
  owned = {}

  def gather(x):
    return lax.all_gather(x, DATA, axis=0, tiled=False) if W > 1 else x[None]

  for keys in by_dtype.values():
    got = rows_from_shares({k: params["owned"][k][0] for k in keys},
                           {k: mine["owned"][k][0] for k in keys}, keys, cuts, W, gather,
                           after=loss)
    owned.update({k: x[None] for k, x in got.items()})
  return {"owned": owned, "shared": mine["shared"]}, opt_state, loss, (sq_worker, sq_global)
