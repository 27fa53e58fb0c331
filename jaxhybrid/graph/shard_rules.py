"""The shard rules on the jaxpr: which equations read a leaf in a way a rule can split, and the
equations each piece and the combining post node run (`jaxhybrid.graph.shard` does the rewrite).

- `inline`: jit-wrapped readers (`jnp.take`) replaced by their bodies, so readers are primitives;
- `reader_axis` / `free_axes` / `out_dim`: the rule ('lookup' or 'column') of one reader, the
  leaf axes it may split, and where the split axis lands in its output;
- `lookup_partial`: a lookup restricted to one piece's rows (zeros elsewhere, the gather's own
  out-of-range behaviour kept); `splice`: a freshly traced jaxpr's equations wired into the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend as jex
import numpy as np
from jax import lax


def fresh(v: Any) -> Any:
  return jex.core.Var(v.aval)


def is_jit(eqn: Any) -> bool:
  return eqn.primitive.name in ("pjit", "jit", "closed_call") and "jaxpr" in eqn.params


def inline(eqns: Sequence[Any], want: set[Any]) -> tuple[list[Any], dict[Any, Any]]:
  """`eqns` with every jit equation that reads a variable of `want` replaced by its body (fresh
  variables inside), repeatedly, so the readers of `want` are primitive equations. Returns the
  equations and the aliases: each removed jit output -> the value that now stands for it."""
  alias: dict[Any, Any] = {}

  def sub_all(e):
    if not alias:
      return e
    return e.replace(invars=[alias.get(v, v) if isinstance(v, jex.core.Var) else v
                             for v in e.invars])

  def walk(seq):
    out = []
    for e in seq:
      e = sub_all(e)
      closed = e.params.get("jaxpr") if is_jit(e) else None
      inner = getattr(closed, "jaxpr", closed)
      if (closed is None or not any(v in want for v in e.invars if isinstance(v, jex.core.Var))
          or inner.constvars or getattr(closed, "consts", ())):
        out.append(e)  # not a reader (or a body with constants: it stays whole)
        continue
      sub: dict[Any, Any] = dict(zip(inner.invars, e.invars))
      body = []
      for ie in inner.eqns:
        ins = [sub.get(v, v) if isinstance(v, jex.core.Var) else v for v in ie.invars]
        outs = []
        for v in ie.outvars:
          if isinstance(v, jex.core.DropVar):
            outs.append(v)
          else:
            sub[v] = nv = fresh(v)
            outs.append(nv)
        body.append(ie.replace(invars=ins, outvars=outs))
      out.extend(walk(body))
      for ov, iv in zip(e.outvars, inner.outvars):
        if not isinstance(ov, jex.core.DropVar):
          alias[ov] = sub.get(iv, iv) if isinstance(iv, jex.core.Var) else iv
    return out

  return walk(list(eqns)), alias


def free_axes(eqn: Any, v: Any) -> set[int]:
  """The leaf's axes a column reader may split: a dot_general's free (non-contracting,
  non-batch) dimensions of `v`; a convolution's kernel output-feature dimension."""
  if eqn.primitive.name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract, batch = (lc, lb) if eqn.invars[0] is v else (rc, rb)
    return {i for i in range(len(v.aval.shape)) if i not in contract and i not in batch}
  dn = eqn.params["dimension_numbers"]  # conv_general_dilated, the leaf its kernel
  return {int(dn.rhs_spec[0])}


def reader_axis(eqn: Any, v: Any) -> tuple[str | None, int | None, str]:
  """(rule, axis of the leaf, reason) for one equation reading leaf variable `v`."""
  name = eqn.primitive.name
  if name == "gather":
    if eqn.invars[0] is not v or eqn.invars[1] is v:
      return None, None, "a gather reads it as indices"
    dn = eqn.params["dimension_numbers"]
    if (tuple(dn.start_index_map) != (0,) or 0 not in tuple(dn.collapsed_slice_dims)
        or tuple(dn.operand_batching_dims)):
      return None, None, "a gather that is not a lookup of rows (axis 0)"
    return "lookup", 0, ""
  if name == "dot_general":
    if eqn.invars[0] is v and eqn.invars[1] is v:
      return None, None, "a dot_general of the leaf with itself"
    free = free_axes(eqn, v)
    if not free:
      return None, None, "a dot_general with no free dimension of the leaf"
    return "column", max(free, key=lambda i: (v.aval.shape[i], -i)), ""
  if name == "conv_general_dilated":
    if eqn.invars[1] is not v or eqn.invars[0] is v:
      return None, None, "a convolution reads it as its input"
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
      return None, None, "a grouped convolution"
    return "column", int(eqn.params["dimension_numbers"].rhs_spec[0]), ""
  return None, None, f"read by {name}"


def out_dim(eqn: Any, v: Any, axis: int) -> int:
  """Position, in a column reader's output, of the leaf's split axis."""
  if eqn.primitive.name == "conv_general_dilated":
    return int(eqn.params["dimension_numbers"].out_spec[1])
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  ls, rs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  lfree = [i for i in range(len(ls)) if i not in lc and i not in lb]
  rfree = [i for i in range(len(rs)) if i not in rc and i not in rb]
  if eqn.invars[0] is v:
    return len(lb) + lfree.index(axis)
  return len(lb) + len(lfree) + rfree.index(axis)


def splice(closed: Any, ins: Sequence[Any], outs: Sequence[Any] | None = None) -> tuple[list, list]:
  """The equations of a freshly traced jaxpr with its inputs read from `ins` (and its outputs
  written to `outs` when given); returns (equations, output variables)."""
  jaxpr = closed.jaxpr
  if jaxpr.constvars or closed.consts:
    raise RuntimeError("internal: a shard rewrite traced a constant")
  sub = dict(zip(jaxpr.invars, ins))
  if outs is not None:
    for ov, target in zip(jaxpr.outvars, outs):
      if ov in sub or not isinstance(ov, jex.core.Var):
        raise RuntimeError("internal: a shard rewrite's output is one of its inputs")
      sub[ov] = target
  eqns = []
  for e in jaxpr.eqns:
    eqns.append(e.replace(
      invars=[sub.get(v, v) if isinstance(v, jex.core.Var) else v for v in e.invars],
      outvars=[sub.get(v, v) if isinstance(v, jex.core.Var) else v for v in e.outvars],
    ))
  return eqns, [sub.get(v, v) for v in jaxpr.outvars]


def lookup_partial(eqn: Any, lo: int, hi: int, rows: int, first: bool):
  """A function (piece, indices) -> the gather's result restricted to rows [lo, hi), zeros for
  ids outside (and, on the first piece, the gather's fill for ids outside the whole table)."""
  p = eqn.params
  dn = p["dimension_numbers"]
  mode = p["mode"]
  out_aval = eqn.outvars[0].aval
  batch_dims = tuple(i for i in range(len(out_aval.shape)) if i not in tuple(dn.offset_dims))
  fill_mode = "FILL" in str(mode)

  def f(piece, idx):
    if not fill_mode:  # clip (or promised in bounds): the id the whole table would read
      idx = lax.clamp(np.asarray(0, idx.dtype), idx, np.asarray(rows - 1, idx.dtype))
    local = idx - np.asarray(lo, idx.dtype)
    inside = (local >= 0) & (local < hi - lo)
    inside = inside[..., 0]
    got = lax.gather(
      piece, lax.clamp(np.asarray(0, idx.dtype), local, np.asarray(hi - lo - 1, idx.dtype)),
      dimension_numbers=dn, slice_sizes=(1,) + tuple(p["slice_sizes"][1:]),
      indices_are_sorted=p["indices_are_sorted"], unique_indices=p["unique_indices"],
      mode=lax.GatherScatterMode.CLIP,
    )
    zero = lax.full_like(got, 0)
    mask = lax.broadcast_in_dim(inside, got.shape, batch_dims)
    out = lax.select(mask, got, zero)
    if fill_mode and first:
      outside = ((idx < 0) | (idx > rows - 1))[..., 0]
      fv = p["fill_value"]
      if fv is None:
        fv = np.nan if np.issubdtype(np.dtype(got.dtype), np.inexact) else 0
      out = lax.select(lax.broadcast_in_dim(outside, got.shape, batch_dims),
                       lax.full_like(got, fv), out)
    return out

  return f


def row_lookup_whole_rows(eqn: Any, v: Any) -> bool:
  """Whether a lookup `eqn` of leaf `v` reads whole rows (every axis but 0 in full), so each
  piece of a split along axis 1 can gather its own slice of every row."""
  dn = eqn.params["dimension_numbers"]
  shape = v.aval.shape
  return (len(shape) >= 2 and tuple(dn.collapsed_slice_dims) == (0,)
          and tuple(eqn.params["slice_sizes"][1:]) == tuple(shape[1:]))


def lookup_columns(eqn: Any, lo: int, hi: int):
  """A function (piece, indices) -> the gather's result restricted to the row features
  [lo, hi) (axis 1 of the leaf): the same gather, same index handling, on a piece holding those
  features of every row."""
  p = eqn.params

  def f(piece, idx):
    return lax.gather(
      piece, idx, dimension_numbers=p["dimension_numbers"],
      slice_sizes=(1, hi - lo) + tuple(p["slice_sizes"][2:]),
      indices_are_sorted=p["indices_are_sorted"], unique_indices=p["unique_indices"],
      mode=p["mode"], fill_value=p["fill_value"])

  return f


def lookup_feature_dim(eqn: Any) -> int:
  """Position, in a whole-row lookup's output, of the leaf's axis 1."""
  return int(tuple(eqn.params["dimension_numbers"].offset_dims)[0])


def split_bounds(size: int, m: int) -> tuple[int, ...]:
  return tuple((d * size) // m for d in range(m + 1))


def sum_all(xs):
  total = xs[0]
  for x in xs[1:]:
    total = total + x
  return total
