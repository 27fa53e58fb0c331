"""What the step's tail (the last gradient window's addition, the squared norms and the optimizer
update) needs beyond parameters, optimizer state and the gradient row: measured by compiling that
tail alone on one device's rows from abstract inputs (`jaxhybrid.program.memory` adds it to the
prediction; it depends on the optimizer and on XLA's fusion)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxhybrid.program import gradients
from jaxhybrid.program import zero as zero_lib
from jaxhybrid.program.structure import row_dtype, rows_by_dtype


def update_temp_bytes(optimizer: Any, layout: Any, window: int = 0, row: str | None = None,
                      data_shards: int = 1, zero: int | None = None,
                      zero_cuts: dict[str, tuple[int, ...]] | None = None) -> int:
  """XLA's compiled temp bytes of the step's tail on one device, from abstract inputs.

  The tail as the step runs it: the gradient row made from zeros and windows (`window` elements
  of row `row`, default the first row, out of conditionals) added in place at traced offsets, the gradients' sum
  of squares (the noise-scale metric), then `optimizer.update` and `optax.apply_updates`
  (parameters and optimizer state donated). Returned: that temp less the gradient row itself
  (counted apart). What XLA keeps beyond its inputs depends on the optimizer and on how it fuses
  the last addition into the row's readers (on the CPU, Adam: a row-sized square and a copy).
  With `data_shards` W > 1 (ZeRO): the update runs on a 1/W slice of each row with a 1/W slice
  of the optimizer state, from the row's sum over its W parts (the reduce-scatter's output
  size), and the updated slice is repeated back to the row's length (the all-gather's).
  `zero_cuts`: the program's share segments (`HybridProgram.zero_cuts`; default one per row),
  with which the rows are made again from the shares (`zero.rows_from_shares`).
  Under ZeRO stage 2 (`zero=2`) there is no whole gradient row: the 1/W accumulator is made from
  zeros and the window's share (`window` / W elements) added into it, then as stage 1. Returned
  then: the temp less that accumulator.
  """
  import jax.numpy as jnp
  import optax

  params = {
    "owned": {r: jax.ShapeDtypeStruct((1, n), row_dtype(r)) for r, n in layout.sizes},
    "shared": [jax.ShapeDtypeStruct(layout.shapes[i], layout.dtypes[i]) for i in layout.shared],
  }
  W = int(data_shards)
  sliced = {"owned": {r: jax.ShapeDtypeStruct((1, n // W), row_dtype(r)) for r, n in layout.sizes},
            "shared": params["shared"]}
  opt = jax.eval_shape(optimizer.init, sliced)
  first = row if row is not None else min((r for r, _ in layout.sizes), default=None)
  window = min(window, dict(layout.sizes).get(first, 0))
  win = jax.ShapeDtypeStruct((window,), row_dtype(first) if first else np.float32)

  stage = (1 if W > 1 else 0) if zero is None else int(zero)

  def tail2(p, o, g, w, start):
    # As zero.tail at stage 2: the replica's share of each row, from its accumulator.
    flat, base = {}, {}
    for r, n in layout.sizes:
      dt = row_dtype(r)
      base[r] = flat.get(dt, 0)
      flat[dt] = base[r] + n // W
    flat = {dt: jnp.zeros((n,), dt) for dt, n in flat.items()}
    if window:
      dt, n = row_dtype(first), dict(layout.sizes)[first] // W
      for j, length in enumerate((1, max(1, window // W))):
        x = jax.lax.switch((start + j) % 2, [lambda x: x, lambda x: -x], w[:length])
        at = base[first] + (start + j) % (n - length + 1)
        cur = jax.lax.dynamic_slice(flat[dt], (at,), (length,))
        flat[dt] = jax.lax.dynamic_update_slice(flat[dt], cur + x, (at,))
    g_mine, p_mine, pos = {}, {}, {}
    for r, n in layout.sizes:
      dt = row_dtype(r)
      at = pos.get(dt, 0)
      g_mine[r] = (flat[dt][at:at + n // W] / W)[None]
      p_mine[r] = p["owned"][r][:, :n // W]
      pos[dt] = at + n // W
    sq = gradients.sum_of_squares(g_mine) + gradients.sum_of_squares(g["shared"])
    p, o = update_shares(p, o, {"owned": g_mine, "shared": g["shared"]}, p_mine)
    return p, o, sq

  def update_shares(p, o, g, p_mine):
    # The update on each row's share, then the rows made again from the shares as zero.tail
    # does (`zero.rows_from_shares`), each share repeated W times in place of the all-gather.
    mine = {"owned": p_mine, "shared": p["shared"]}
    u, o = optimizer.update(g, o, mine)
    mine = optax.apply_updates(mine, u)
    owned = {}
    cuts = zero_lib.whole_rows(layout.sizes) if zero_cuts is None else zero_cuts
    for keys in rows_by_dtype(layout.sizes).values():
      got = zero_lib.rows_from_shares(
        {r: p["owned"][r][0] for r in keys}, {r: mine["owned"][r][0] for r in keys}, keys, cuts,
        W, lambda x: jnp.tile(x[None], (W, 1)))
      owned.update({r: x[None] for r, x in got.items()})
    return {"owned": owned, "shared": mine["shared"]}, o

  def tail(p, o, g, w, start):
    # The gradient rows as the step makes them (executor.run_groups): one flat buffer per dtype
    # from zeros, windows out of conditionals added in place, then cut into the rows.
    flat, base = {}, {}
    for r, n in layout.sizes:
      dt = row_dtype(r)
      base[r] = flat.get(dt, 0)
      flat[dt] = base[r] + n
    flat = {dt: jnp.zeros((n,), dt) for dt, n in flat.items()}
    if window:
      dt = row_dtype(first)
      n = dict(layout.sizes)[first]
      # One element first (the buffer is then no longer plain zeros), then the last window: a
      # second whole window here would be alive beside it, which the step's groups never are.
      for j, length in enumerate((1, window)):
        x = jax.lax.switch((start + j) % 2, [lambda x: x, lambda x: -x], w[:length])
        at = base[first] + (start + j) % (n - length + 1)
        cur = jax.lax.dynamic_slice(flat[dt], (at,), (length,))
        flat[dt] = jax.lax.dynamic_update_slice(flat[dt], cur + x, (at,))
    sq = gradients.sum_of_squares(flat) + gradients.sum_of_squares(g["shared"])
    flat = jax.lax.optimization_barrier(flat)  # as the step does (hybrid.py)
    rows = gradients.cut_rows(layout, flat)
    if W == 1:
      g = {"owned": {r: x[None] for r, x in rows.items()}, "shared": g["shared"]}
      u, o = optimizer.update(g, o, p)
      return optax.apply_updates(p, u), o, sq
    # As zero.tail: per dtype the rows side by side as one [W, S] buffer, its sum over
    # the W parts (the reduce-scatter's output), the update on the slices, the slices side by
    # side repeated W times (the all-gather's output) and cut back into rows.
    by_dtype = rows_by_dtype(layout.sizes)
    g_mine, p_mine = {}, {}
    for keys in by_dtype.values():
      stacked = jnp.concatenate([rows[r].reshape(W, -1) for r in keys], axis=1)
      mine = stacked.sum(0) / W
      at = 0
      for r in keys:
        n = rows[r].shape[0] // W
        g_mine[r] = mine[at:at + n][None]
        p_mine[r] = p["owned"][r][:, :n]
        at += n
    p, o = update_shares(p, o, {"owned": g_mine, "shared": g["shared"]}, p_mine)
    return p, o, sq

  start = jax.ShapeDtypeStruct((), np.int32)
  fn = tail2 if stage == 2 else tail
  compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, opt, params, win, start).compile()
  rows = layout.row_bytes() // (W if stage == 2 else 1)
  # The tail's temp holds the gradient row itself (made inside, as in the step): counted apart.
  return max(0, int(compiled.memory_analysis().temp_size_in_bytes) - rows)
