"""A device's parameter gradients in the task-scheduled step: windows and the flat buffers.

Each group's conditional returns the parameter gradients of its gradient tasks as *windows* of
the device's gradient rows (`gradient_windows`); the step adds them, in place and outside the
conditional, into one flat buffer per dtype (`executor.run_groups`), and cuts that buffer into
the rows only for the optimizer (`cut_rows`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhybrid import graph as graph_lib
from jaxhybrid.program import structure as structure_lib
from jaxhybrid.program import tasks as tasks_lib
from jaxhybrid.program.structure import ParamLayout

# Touched leaves of at least this many bytes get a gradient window of their own; smaller ones
# that lie next to each other in the row share one (assumption, named here: a shared window is
# made by concatenation, which copies its leaves once; a leaf alone is returned as it is, so a
# large gradient such as a softmax's is never copied).
WINDOW_SPLIT_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Window:
  """A range of every device's gradient row that one group's conditional returns.

  Device d's branch returns `length` elements of dtype `dtype`: its gradients of `leaves[d]`
  placed at their offsets relative to `starts[d]`, zeros elsewhere; the range is added into
  the row at `starts[d]` outside the conditional.
  """

  dtype: str
  length: int
  starts: tuple[int, ...]
  leaves: tuple[tuple[int, ...], ...]
  row: str = ""  # the row key (ParamLayout.sizes); '' = the packed row of `dtype`

  @property
  def row_key(self) -> str:
    return self.row or self.dtype

  @property
  def nbytes(self) -> int:
    return self.length * np.dtype(self.dtype).itemsize

  def copies(self, layout: ParamLayout) -> int:
    """Bytes a device's branch builds before the output (leaves concatenated or padded)."""
    out = 0
    for lv in self.leaves:
      n = sum(math.prod(layout.shapes[i]) for i in lv)
      if len(lv) > 1 or (lv and n != self.length):
        out = max(out, n * np.dtype(self.dtype).itemsize)
    return out


def makes_gradients(op: Any, split: bool) -> bool:
  """Whether task `op` makes parameter gradients: a W task, or a B task when the schedule does
  not split B from W."""
  return op.kind == "W" or (op.kind == "B" and not split)


def _lookup_tables(lookups: Callable[[int], Sequence[Any]] | None, nid: int) -> set[int]:
  return set() if lookups is None else {lk.arg for lk in lookups(nid)}


def gradient_windows(
  st: tasks_lib.Structure, graph: graph_lib.OpGraph, layout: ParamLayout,
  split_bytes: int | None = None, lookups: Callable[[int], Sequence[Any]] | None = None,
) -> list[list[Window] | None]:
  """Per group (None without gradient tasks), the windows of the devices' gradient rows its
  conditional returns.

  Each device's gradient task of the group touches some owned leaves; they are cut, in row
  order, into runs (a leaf of at least `split_bytes` is a run alone; neighbours closer than
  `split_bytes` share one; default WINDOW_SPLIT_BYTES). The j-th longest run of every device shares the j-th window, as long
  as the longest of them; starts are clamped so each window fits the row. A window leaves the
  conditional and is added into the row outside it (a row carried through a conditional is
  copied by XLA); a window that is one leaf's gradient is that array itself, not a copy.
  `lookups` (`NodeCalls.lookups`): a node's tables read only by row lookups are left out (their
  gradients leave as rows, `lookup_lengths`).
  """
  if split_bytes is None:
    split_bytes = WINDOW_SPLIT_BYTES
  kinds = dict(zip(graph.jaxpr.invars, graph.input_kinds))
  sizes = dict(layout.sizes)
  M = st.devices
  out: list[list[Window] | None] = []
  for lay in st.groups:
    touched: dict[tuple[str, int], set[int]] = {}
    has = False
    for d, op in lay.tasks:
      if not makes_gradients(op, st.schedule.split):
        continue
      has = True
      tables = _lookup_tables(lookups, op.node)
      for i, v in enumerate(graph.nodes[op.node].invars):
        if i in tables:
          continue
        if v in kinds and kinds[v][0] == graph_lib.PARAM and layout.owner[kinds[v][1]] >= 0:
          idx = kinds[v][1]
          touched.setdefault((layout.row_of[idx], d), set()).add(idx)
    if not has:
      out.append(None)
      continue
    wins: list[Window] = []
    for row in sorted({r for r, _ in touched}):
      dt = structure_lib.row_dtype(row)
      item = np.dtype(dt).itemsize
      runs: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}  # device -> (lo, hi, leaves)
      for d in range(M):
        cur: list[Any] = []
        for idx in sorted(touched.get((row, d), ()), key=lambda i: layout.offset[i]):
          lo, n = layout.offset[idx], math.prod(layout.shapes[idx])
          n = -(-n // layout.leaf_multiple) * layout.leaf_multiple  # the leaf's extent
          big = n * item >= split_bytes
          if cur and not cur[3] and not big and (lo - cur[1]) * item < split_bytes:
            cur[1], cur[2] = lo + n, cur[2] + (idx,)
            continue
          if cur:
            runs.setdefault(d, []).append((cur[0], cur[1], cur[2]))
          cur = [lo, lo + n, (idx,), big]
        if cur:
          runs.setdefault(d, []).append((cur[0], cur[1], cur[2]))
      for d in runs:
        runs[d].sort(key=lambda r: (-(r[1] - r[0]), r[0]))
      for j in range(max(len(r) for r in runs.values())):
        have = {d: r[j] for d, r in runs.items() if j < len(r)}
        length = max(hi - lo for lo, hi, _ in have.values())
        starts = tuple(
          min(have[d][0], sizes[row] - length) if d in have else 0 for d in range(M)
        )
        leaves = tuple(have[d][2] if d in have else () for d in range(M))
        wins.append(Window(dtype=dt, length=length, starts=starts, leaves=leaves, row=row))
    out.append(wins)
  return out


def _looked_up(st: tasks_lib.Structure, graph: graph_lib.OpGraph, layout: ParamLayout,
               lookups: Callable[[int], Sequence[Any]]):
  """Per group, the (device, lookup, leaf) of its gradient tasks' row lookups of owned leaves."""
  kinds = dict(zip(graph.jaxpr.invars, graph.input_kinds))
  for lay in st.groups:
    out = []
    for d, op in lay.tasks:
      if not makes_gradients(op, st.schedule.split):
        continue
      node = graph.nodes[op.node]
      for lk in lookups(op.node):
        idx = kinds[node.invars[lk.arg]][1]
        if layout.owner[idx] >= 0:
          out.append((d, lk, idx))
    yield out


def lookup_lengths(st: tasks_lib.Structure, graph: graph_lib.OpGraph, layout: ParamLayout,
                   lookups: Callable[[int], Sequence[Any]]) -> list[dict[str, int]]:
  """Per group, dtype -> the row-gradient elements its conditional returns per device: the
  most any device's row lookups of owned tables make in the group (`program.lookups`)."""
  out = []
  for found in _looked_up(st, graph, layout, lookups):
    per: dict[tuple[int, str], int] = {}
    for d, lk, _ in found:
      per[(d, lk.dtype)] = per.get((d, lk.dtype), 0) + lk.elems
    lengths: dict[str, int] = {}
    for (_, dt), n in per.items():
      lengths[dt] = max(lengths.get(dt, 0), n)
    out.append(lengths)
  return out


def looked_up_rows(st: tasks_lib.Structure, graph: graph_lib.OpGraph, layout: ParamLayout,
                   lookups: Callable[[int], Sequence[Any]]) -> set[str]:
  """The row keys holding a table whose gradient arrives as rows."""
  return {layout.row_of[idx] for found in _looked_up(st, graph, layout, lookups)
          for _, _, idx in found}


def single_window_rows(
  windows: list[list[Window] | None], layout: ParamLayout, exclude: set[str] = frozenset(),
) -> dict[str, Window]:
  """Rows whose whole gradient is ONE window of the step: row key -> that window.

  A row qualifies when exactly one window of all groups writes it and that window covers the
  row on every device (length = the row's length, starts 0): with one micro-batch, a slot row
  whose leaf's gradient task runs once. Its gradient is then the window itself, with no
  accumulator: no zero-filled row, no addition, and the optimizer can update the row as soon
  as the window exists (as plain `jax.jit` does per leaf) instead of after every group.
  """
  seen: dict[str, list[Window]] = {}
  for ws in windows:
    for w in ws or ():
      seen.setdefault(w.row_key, []).append(w)
  sizes = dict(layout.sizes)
  return {
    r: ws[0] for r, ws in seen.items()
    if r not in exclude and len(ws) == 1 and ws[0].length == sizes[r] and not any(ws[0].starts)
  }


def sum_of_squares(tree: Any) -> jax.Array:
  """Sum of squares of every leaf of `tree`, in float32."""
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(tree):
    total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
  return total


def cut_rows(
  layout: ParamLayout, flat: dict[str, jax.Array], whole: dict[str, jax.Array] | None = None
) -> dict[str, jax.Array]:
  """The gradient rows (`layout.sizes` keys) cut from `run_groups`' flat buffers per dtype (the
  rows of a dtype lie side by side in `layout.sizes` order, except the rows in `whole`, which
  are given as they are). Cut last, just before the optimizer: slices with one elementwise
  reader are fused into it, not copied."""
  whole = whole or {}
  out, pos = dict(whole), {}
  for r, n in layout.sizes:
    if r in whole:
      continue
    dt = structure_lib.row_dtype(r)
    at = pos.get(dt, 0)
    out[r] = flat[dt] if (at == 0 and n == flat[dt].shape[0]) else lax.slice(flat[dt], (at,), (at + n,))
    pos[dt] = at + n
  return out
