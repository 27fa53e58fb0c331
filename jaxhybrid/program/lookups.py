"""Parameter tables read by row lookups: their gradients leave a task as rows, not as a table.

A node that reads a parameter only through whole-row gathers (`table[ids]`, `jnp.take(table,
ids, axis=0)`, flax's `Embed`, a sampled softmax's `w[sampled_ids]`) has a gradient that is zero
except on the rows it read. Differentiated as written, its backward builds the whole table's
gradient (a scatter-add into zeros): 3.25 GiB per task for paper BigLSTM's embedding, one
window of the device's gradient row (`gradients.gradient_windows`).

Such a node is replayed here with each lookup's output given an input of its own: the rows are
read from the table under `stop_gradient` and a zero *proxy* of the rows' shape is added to
them, so the proxy's cotangent is the rows' gradient; the lookups' indices are extra outputs of
the node's function (saved for the backward as residuals, int32). The executor adds the rows'
gradients into the device's gradient row with one scatter-add per group (`executor.run_groups`),
or, under ZeRO stage 2, passes them round the 'data' replicas, each adding those in its share.

Only lookups at the top of the node's computation or inside plain `jit` calls are recognised;
a table that is also read any other way (a tied output projection, a cast before the lookup)
keeps its dense gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax import lax

from jaxhybrid.graph import interpret

_CALLS = ("pjit", "jit", "closed_call", "core_call")


@dataclasses.dataclass(frozen=True)
class Lookup:
  """One row gather of a parameter table inside a node."""

  arg: int  # the table's position among the node's inputs
  table_shape: tuple[int, ...]
  dtype: str
  ids_shape: tuple[int, ...]  # the gather's index operand ([..., 1])
  out_shape: tuple[int, ...]  # the rows read ([..., *table_shape[1:]])
  mode: str  # 'clip' (ids clamped into the table) or 'drop' (ids outside read nothing)

  @property
  def rows(self) -> int:
    return math.prod(self.ids_shape[:-1])

  @property
  def row_elems(self) -> int:
    return math.prod(self.table_shape[1:])

  @property
  def elems(self) -> int:
    """Gradient elements one task emits for this lookup."""
    return self.rows * self.row_elems


def _is_var(v: Any) -> bool:
  return isinstance(v, jex.core.Var) and not isinstance(v, jex.core.Literal)


def _row_gather(eqn: Any, var: Any) -> bool:
  """Whether `eqn` gathers whole rows (axis 0) of `var`, with ids in a trailing index axis."""
  if eqn.primitive.name != "gather" or eqn.invars[0] is not var or var in eqn.invars[1:]:
    return False
  p = eqn.params
  dn = p["dimension_numbers"]
  shape = tuple(var.aval.shape)
  ids = tuple(eqn.invars[1].aval.shape)
  out = tuple(eqn.outvars[0].aval.shape)
  trailing = tuple(range(len(out) - len(shape) + 1, len(out)))
  return (
    len(shape) >= 1 and len(ids) >= 1 and ids[-1] == 1
    and tuple(dn.start_index_map) == (0,) and tuple(dn.collapsed_slice_dims) == (0,)
    and not tuple(getattr(dn, "operand_batching_dims", ()))
    and tuple(p["slice_sizes"]) == (1,) + shape[1:]
    and tuple(dn.offset_dims) == trailing
    and out == ids[:-1] + shape[1:]
  )


def _inner(eqn: Any) -> Any | None:
  if eqn.primitive.name not in _CALLS:
    return None
  j = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
  return j


def _only_looked_up(jaxpr: Any, var: Any) -> bool:
  """Whether every use of `var` in `jaxpr` is a row gather (directly or inside jit calls)."""
  if any(v is var for v in jaxpr.outvars):
    return False
  for eqn in jaxpr.eqns:
    at = [i for i, v in enumerate(eqn.invars) if v is var]
    if not at:
      continue
    if at == [0] and _row_gather(eqn, var):
      continue
    inner = _inner(eqn)
    if inner is None:
      return False
    ij = getattr(inner, "jaxpr", inner)
    if not all(_only_looked_up(ij, ij.invars[i]) for i in at):
      return False
  return True


def _walk(jaxpr: Any, tables: dict[Any, int]) -> Iterator[tuple[Any, int]]:
  """The row gathers of the tables, in evaluation order: (gather eqn, the table's node input)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "gather" and _is_var(eqn.invars[0]) and eqn.invars[0] in tables:
      yield eqn, tables[eqn.invars[0]]
      continue
    inner = _inner(eqn)
    if inner is None:
      continue
    ij = getattr(inner, "jaxpr", inner)
    sub = {ij.invars[i]: tables[v] for i, v in enumerate(eqn.invars) if _is_var(v) and v in tables}
    if sub:
      yield from _walk(ij, sub)


def find(closed: Any, params: Sequence[int]) -> tuple[Lookup, ...]:
  """The row lookups of the node's tables: its inputs at positions `params` (parameters) that
  the node reads only by row gathers. () if there are none."""
  jaxpr = closed.jaxpr
  tables = {jaxpr.invars[i]: i for i in params if _only_looked_up(jaxpr, jaxpr.invars[i])}
  out = []
  for eqn, arg in _walk(jaxpr, tables):
    mode = eqn.params["mode"]
    out.append(Lookup(
      arg=arg, table_shape=tuple(eqn.invars[0].aval.shape),
      dtype=np.dtype(eqn.invars[0].aval.dtype).name, ids_shape=tuple(eqn.invars[1].aval.shape),
      out_shape=tuple(eqn.outvars[0].aval.shape),
      mode="clip" if mode == lax.GatherScatterMode.CLIP else "drop",
    ))
  return tuple(out)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], tables: dict[Any, int],
          proxies: Iterator[Any], ids: list[Any]) -> list[Any]:
  """`jaxpr` evaluated as `jax.core.eval_jaxpr` does, except the tables' row gathers: rows read
  under stop_gradient plus the next proxy; their index operands appended to `ids`."""

  def rule(eqn, vals):
    if eqn.primitive.name == "gather" and _is_var(eqn.invars[0]) and eqn.invars[0] in tables:
      rows = eqn.primitive.bind(lax.stop_gradient(vals[0]), vals[1], **eqn.params)
      ids.append(vals[1])
      return [rows + next(proxies)]
    inner = _inner(eqn)
    sub = {} if inner is None else {
      getattr(inner, "jaxpr", inner).invars[i]: tables[v]
      for i, v in enumerate(eqn.invars) if _is_var(v) and v in tables}
    if sub:
      return _eval(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), vals, sub,
                   proxies, ids)
    return None

  return interpret.eval_jaxpr_with(jaxpr, consts, args, rule)


def rows_fn(closed: Any, found: Sequence[Lookup]) -> Callable[..., list[Any]]:
  """The node's function with its lookups' rows as inputs: f(*args, *proxies) -> [*outputs,
  *ids], one zero proxy (shape `out_shape`) and one index array (`ids_shape`) per lookup."""
  jaxpr = closed.jaxpr
  tables = {jaxpr.invars[i]: i for i in sorted({lk.arg for lk in found})}
  n_in = len(jaxpr.invars)

  def f(*xs):
    ids: list[Any] = []
    outs = _eval(jaxpr, closed.consts, xs[:n_in], tables, iter(xs[n_in:]), ids)
    if len(ids) != len(found):
      raise RuntimeError(f"internal: {len(ids)} lookups replayed, {len(found)} found")
    return list(outs) + ids

  return f


def proxies(found: Sequence[Lookup]) -> list[Any]:
  """Zero proxies for the lookups (their cotangents are the rows' gradients)."""
  import jax.numpy as jnp
  return [jnp.zeros(lk.out_shape, lk.dtype) for lk in found]


def row_ids(lk: Lookup, idx: jax.Array) -> jax.Array:
  """The table row each gathered row came from ([rows] int32), -1 where the lookup read none."""
  import jax.numpy as jnp
  r = idx.reshape(-1).astype(jnp.int32)
  n = lk.table_shape[0]
  if lk.mode == "clip":
    return jnp.clip(r, 0, n - 1)
  return jnp.where((r >= 0) & (r < n), r, -1)


# Position of a row gradient element that is added nowhere (dropped by the scatter).
NOWHERE = int(np.iinfo(np.int32).max)


def flat_positions(lk: Lookup, rid: jax.Array, leaf_offset: int, row_base: int, flat_len: int,
                   W: int = 1, cuts: Sequence[int] | None = None) -> jax.Array:
  """Where each element of the rows' gradients ([rows * row_elems]) is added: its position in
  the device's flat gradient buffer of the dtype (`executor.run_groups`), NOWHERE for rows the
  lookup read none of.

  Args:
    lk, rid: the lookup and its row ids (`row_ids`).
    leaf_offset: the table's offset in its gradient row; row_base: the row's offset in the flat
      buffer (of the whole rows); flat_len: the flat buffer's length (whole rows).
    W, cuts: under ZeRO stage 2, the data width and the row's segment cuts (`zero.row_cuts`):
      the position is then owner * (flat_len / W) + the element's place in its owner's share
      (the replicas' shares of the flat buffer, side by side).
  """
  import jax.numpy as jnp
  if flat_len >= NOWHERE:
    raise ValueError(
      f"a gradient buffer of {flat_len} elements is too long for int32 positions: split the "
      "table (more model devices) or build the program with sparse_lookups=False")
  D = lk.row_elems
  p = leaf_offset + rid[:, None] * D + jnp.arange(D, dtype=jnp.int32)[None, :]
  if cuts is None:
    pos = row_base + p
  else:
    c = jnp.asarray(np.asarray(cuts, np.int64).astype(np.int32))
    seg = jnp.clip(jnp.searchsorted(c, p, side="right") - 1, 0, c.shape[0] - 2)
    a = c[seg]
    share = (c[seg + 1] - a) // W
    q = p - a
    pos = (q // share) * (flat_len // W) + row_base // W + a // W + q % share
  return jnp.where(rid[:, None] >= 0, pos, NOWHERE).reshape(-1).astype(jnp.int32)


def padded(pos: Sequence[jax.Array], vals: Sequence[jax.Array], length: int,
           dtype: str) -> tuple[jax.Array, jax.Array]:
  """The row gradients of a device's lookups side by side, padded to `length` elements (every
  device's branch returns the same shapes)."""
  import jax.numpy as jnp
  n = sum(int(p.shape[0]) for p in pos)
  if n > length:
    raise RuntimeError(f"internal: {n} row-gradient elements for a buffer of {length}")
  pos = list(pos) + [jnp.full((length - n,), NOWHERE, jnp.int32)]
  vals = list(vals) + [jnp.zeros((length - n,), dtype)]
  return jnp.concatenate(pos), jnp.concatenate(vals)


def scatter_add(buf: jax.Array, pos: jax.Array, vals: jax.Array, W: int = 1) -> jax.Array:
  """`vals` added into `buf` at `pos` (`flat_positions`). With W > 1 (ZeRO stage 2, `buf` this
  replica's share): the row gradients go round the 'data' ring (W - 1 `ppermute`s) and each
  replica adds, from every replica's, those in its share: the sum over the replicas, as the
  windows' reduce-scatter gives, with the bytes of one all-gather on the wire but one replica's
  rows alive at a time (an all-gather held W: 1.9 GiB on paper BigLSTM at 16x2)."""
  import jax.numpy as jnp
  from jaxhybrid.mesh import DATA
  if W == 1:
    return buf.at[pos].add(vals, mode="drop")
  S = buf.shape[0]
  base = lax.axis_index(DATA).astype(jnp.int32) * S
  ring = [(i, (i + 1) % W) for i in range(W)]
  for t in range(W):
    local = pos - base
    buf = buf.at[jnp.where((local >= 0) & (local < S), local, S)].add(vals, mode="drop")
    if t < W - 1:
      # The next hop reads the buffer just updated (0 * an element of it), so XLA cannot send
      # every hop ahead and keep them all alive (as executor._token does for the groups).
      vals = vals + (lax.dynamic_slice_in_dim(buf, 0, 1) * 0).astype(vals.dtype)
      pos, vals = lax.ppermute((pos, vals), DATA, perm=ring)
  return buf
