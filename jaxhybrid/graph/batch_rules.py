"""Which equations keep their examples apart: the test a batch split applies to a node.

A node may be split by rows of its micro-batch (`jaxhybrid.graph.batch_split`) only when every
row of each output depends on the same rows of its inputs alone. The test compares the model's
jaxpr traced at the micro-batch size B with the same jaxpr traced at B / M (equation for
equation: the model's Python code does not depend on the batch size). A value whose shape is
the same in both traces holds no examples (a parameter, a constant, a statistic over the batch);
a value with exactly one axis M times longer carries the examples along that axis (its *batch
axis*). Each equation is then checked against its primitive's rule:

- elementwise primitives: every operand carrying examples carries them along the output's axis;
- shape primitives (`broadcast_in_dim`, `reshape`, `transpose`, `squeeze`, `expand_dims`, `pad`,
  `slice`, `rev`, `concatenate`, `dynamic_slice`, ...): the batch axis is moved, never cut into,
  padded, reversed or merged behind another axis (a reshape keeps the batch axis outermost of
  the axes it merges);
- reductions, cumulative ops and sorts: never along the batch axis;
- `dot_general` and convolutions: the batch axis is a free, batch or (convolution) batch
  dimension, never contracted;
- pooling windows: one element wide along the batch axis;
- `gather` with a table that holds no examples: the examples come from the indices;
- calls, `custom_jvp`/`custom_vjp`, `remat`, `cond`, `while`, `scan`: their inner jaxprs pass the
  same test (a scan never steps along the batch axis).

Everything else carrying examples (random draws, scatters, collectives, primitives without a
rule) fails the test with its name; so does an equation that turns a value with examples into
one without (BatchNorm's statistics in training, a mean loss): a node holding one is not split.
"""

from __future__ import annotations

import math
from typing import Any

import jax.extend as jex
import numpy as np

ELEMENTWISE = frozenset("""
  abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type
  copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag
  integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
  population_count pow real reduce_precision rem round rsqrt select_n shift_left
  shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh
  xor
""".split())
REDUCTIONS = frozenset(
  "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin"
  .split())
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
WINDOWS = frozenset(
  "reduce_window_sum reduce_window_max reduce_window_min reduce_window select_and_scatter_add "
  "select_and_gather_add".split())
# Primitives whose parameters hold jaxprs run with the same operands: pairing their inner
# values by shape is enough (scan and while are checked for their loop axis as well).
CALLS = frozenset("pjit jit closed_call core_call custom_jvp_call custom_vjp_call "
                  "custom_vjp_call_jaxpr remat checkpoint cond while scan".split())


class NotRowwise(Exception):
  """A value or an equation that mixes examples; the message says which and how."""


def axis_of(big: Any, small: Any, m: int) -> int | None:
  """The batch axis of a value traced at B (`big`) and at B / m (`small`), None if its shape
  does not change; raises `NotRowwise` for any other change."""
  s, t = tuple(getattr(big.aval, "shape", ())), tuple(getattr(small.aval, "shape", ()))
  if s == t:
    return None
  diff = [i for i in range(len(s)) if len(s) == len(t) and s[i] != t[i]]
  if len(s) != len(t) or len(diff) != 1 or s[diff[0]] != m * t[diff[0]]:
    raise NotRowwise(f"a value of shape {s} is {t} at 1/{m} of the batch")
  return diff[0]


def nested_jaxprs(params: dict[str, Any]) -> list[tuple[str, Any]]:
  """(name, jaxpr or closed jaxpr) of the jaxprs an equation's parameters hold, in a fixed
  order."""
  out = []
  for k in sorted(params):
    vals = params[k] if isinstance(params[k], (tuple, list)) else (params[k],)
    for i, v in enumerate(vals):
      inner = getattr(v, "jaxpr", v)
      if isinstance(inner, jex.core.Jaxpr):
        out.append((f"{k}[{i}]", v))
  return out


# Key of `axes` holding the constants whose values differ between the two traces.
VARYING = "__varying__"


def _same(a: Any, b: Any) -> bool:
  try:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
  except (TypeError, ValueError):
    return False


def varying_consts(big: Any, small: Any) -> set[Any]:
  """The constants of closed jaxpr `big` whose values differ in `small` (shapes may agree)."""
  consts_b, consts_s = getattr(big, "consts", ()), getattr(small, "consts", ())
  inner_b = getattr(big, "jaxpr", big)
  return {v for v, a, b in zip(inner_b.constvars, consts_b, consts_s)
          if np.shape(a) == np.shape(b) and not _same(a, b)}


def check_jaxpr(big: Any, small: Any, m: int, axes: dict[Any, int | None],
                reasons: dict[int, str] | None = None) -> None:
  """Checks every equation of `big` (paired with `small`, traced at 1/m of the batch), filling
  `axes` with the batch axis of every value; raises `NotRowwise` for the first one that mixes
  examples."""
  big, small = getattr(big, "jaxpr", big), getattr(small, "jaxpr", small)
  if len(big.eqns) != len(small.eqns):
    raise NotRowwise("the model traces to other equations at another batch size")
  for vb, vs in zip(list(big.constvars) + list(big.invars),
                    list(small.constvars) + list(small.invars)):
    axes[vb] = axis_of(vb, vs, m)
  for eb, es in zip(big.eqns, small.eqns):
    if reasons is None:
      check_eqn(eb, es, m, axes)
      continue
    try:  # record the equation (by id) and go on: other nodes may still be split
      check_eqn(eb, es, m, axes)
    except NotRowwise as e:
      reasons[id(eb)] = str(e)
      for vb, vs in zip(eb.outvars, es.outvars):
        try:
          axes[vb] = axis_of(vb, vs, m)
        except NotRowwise:
          axes[vb] = None


def _ax(v: Any, axes: dict[Any, int | None]) -> int | None:
  return None if isinstance(v, jex.core.Literal) else axes.get(v)


def check_eqn(eb: Any, es: Any, m: int, axes: dict[Any, int | None]) -> None:
  """Checks one equation (module docstring) and records its outputs' batch axes."""
  name = eb.primitive.name
  if name != es.primitive.name or len(eb.outvars) != len(es.outvars):
    raise NotRowwise("the model traces to other equations at another batch size")
  for vb, vs in zip(eb.invars, es.invars):
    if isinstance(vb, jex.core.Literal) and not _same(vb.val, getattr(vs, "val", None)):
      raise NotRowwise(f"{name} reads a constant that changes with the batch size (1/N of a "
                       "mean?)")
    if isinstance(vb, jex.core.Var) and vb in axes.get(VARYING, ()):
      raise NotRowwise(f"{name} reads a constant that changes with the batch size")
  ins = [_ax(v, axes) for v in eb.invars]
  outs = []
  for vb, vs in zip(eb.outvars, es.outvars):
    outs.append(axis_of(vb, vs, m))
    axes[vb] = outs[-1]
  if all(a is None for a in ins + outs):
    return  # holds no examples: recomputed alike by every piece
  if all(a is None for a in outs):
    raise NotRowwise(f"{name} reduces over the examples")
  why = _rule(eb, es, m, ins, outs, axes)
  if why:
    raise NotRowwise(f"{name} {why}")


def _rule(eb: Any, es: Any, m: int, ins: list, outs: list, axes: dict) -> str | None:
  name, p = eb.primitive.name, eb.params
  o = outs[0]
  shape_in = [tuple(getattr(v.aval, "shape", ())) for v in eb.invars]
  if name in ELEMENTWISE:
    if any(a is not None and a != o for a in ins) or len(set(outs)) != 1:
      return "mixes operands with examples along different axes"
    return None
  if all(a is None for a in ins):  # a value with examples made from none
    if name == "broadcast_in_dim":
      return None  # the same in every row
    if name == "iota":
      return None if p["dimension"] != o else "counts along the examples"
    return "makes per-example values from nothing (a random draw?)"
  a = ins[0]
  if name == "broadcast_in_dim":
    return None if a is None or p["broadcast_dimensions"][a] == o else "moves the examples"
  if name == "reshape":
    before_in = math.prod(shape_in[0][:a]) if a is not None else 1
    before_out = math.prod(eb.outvars[0].aval.shape[:o])
    return None if a is not None and before_in == before_out else (
      "merges the examples behind another axis")
  if name == "transpose":
    return None if list(p["permutation"]).index(a) == o else "moves the examples"
  if name in ("squeeze", "expand_dims"):
    return None  # the axis pairing by shape already fixed where the examples go
  if name in REDUCTIONS:
    return None if a not in tuple(p["axes"]) else "reduces along the examples"
  if name in CUMULATIVE:
    return None if p["axis"] != a else "accumulates along the examples"
  if name == "split":
    return None if p["axis"] != a else "cuts the examples apart"
  if name == "sort":
    return None if p["dimension"] != a else "sorts along the examples"
  if name == "rev":
    return None if a not in tuple(p["dimensions"]) else "reverses the examples"
  if name == "pad":
    lo, hi, interior = p["padding_config"][a]
    return None if (lo, hi, interior) == (0, 0, 0) else "pads along the examples"
  if name == "slice":
    ok = (p["start_indices"][a] == 0 and p["limit_indices"][a] == shape_in[0][a]
          and (p["strides"] is None or p["strides"][a] == 1))
    return None if ok else "cuts into the examples"
  if name == "concatenate":
    same = all(x == o for x in ins)
    return None if same and p["dimension"] != o else "concatenates along the examples"
  if name == "dynamic_slice":
    return None if p["slice_sizes"][a] == shape_in[0][a] else "cuts into the examples"
  if name == "dynamic_update_slice":
    ok = ins[1] == a and shape_in[1][a] == shape_in[0][a]
    return None if ok else "writes into part of the examples"
  if name == "dot_general":
    return _dot(p["dimension_numbers"], ins[0], ins[1], o, shape_in)
  if name == "conv_general_dilated":
    dn = p["dimension_numbers"]
    ok = (ins[1] is None and a == dn.lhs_spec[0] and o == dn.out_spec[0]
          and p["batch_group_count"] == 1)
    return None if ok else "convolves along the examples"
  if name in WINDOWS:
    wd = p.get("window_dimensions")
    st = p.get("window_strides")
    pad = p.get("padding")
    ok = (wd is not None and wd[a] == 1 and (st is None or st[a] == 1)
          and (pad is None or tuple(pad[a]) == (0, 0))
          and all(x in (None, a) for x in ins))
    return None if ok else "pools along the examples"
  if name == "gather":
    return _gather(p["dimension_numbers"], ins, o, eb)
  if name in CALLS:
    return _call(eb, es, m, ins, outs, axes)
  return "has no batch rule"


def _dot(dn: Any, la: int | None, ra: int | None, o: int, shapes: list) -> str | None:
  (lc, rc), (lb, rb) = dn
  if (la is not None and la in lc) or (ra is not None and ra in rc):
    return "contracts over the examples"
  if la is not None and ra is not None:
    if la not in lb or ra not in rb or list(lb).index(la) != list(rb).index(ra):
      return "pairs examples of one operand with all of the other's"
    want = list(lb).index(la)
  elif la is not None:
    free = [i for i in range(len(shapes[0])) if i not in lc and i not in lb]
    want = len(lb) + free.index(la) if la in free else list(lb).index(la)
  else:
    free_l = [i for i in range(len(shapes[0])) if i not in lc and i not in lb]
    free_r = [i for i in range(len(shapes[1])) if i not in rc and i not in rb]
    want = len(lb) + len(free_l) + free_r.index(ra) if ra in free_r else list(rb).index(ra)
  return None if want == o else "moves the examples"


def _gather(dn: Any, ins: list, o: int, eb: Any) -> str | None:
  op, idx = ins[0], ins[1]
  if idx is None:
    return "takes examples by fixed indices"
  op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if op is not None and (op not in op_batch or idx not in idx_batch
                         or op_batch.index(op) != idx_batch.index(idx)):
    return "indexes across the examples"
  idx_rank = len(eb.invars[1].aval.shape)
  out_rank = len(eb.outvars[0].aval.shape)
  ivd = idx_rank - 1  # jax's gather keeps the index vector last
  if idx == ivd:
    return "reads the examples as index components"
  positions = [i for i in range(out_rank) if i not in tuple(dn.offset_dims)]
  idx_dims = [i for i in range(idx_rank) if i != ivd]
  return None if positions[idx_dims.index(idx)] == o else "moves the examples"


def _call(eb: Any, es: Any, m: int, ins: list, outs: list, axes: dict) -> str | None:
  name = eb.primitive.name
  inner_b, inner_s = nested_jaxprs(eb.params), nested_jaxprs(es.params)
  if [k for k, _ in inner_b] != [k for k, _ in inner_s] or not inner_b:
    return "holds jaxprs that differ at another batch size"
  if name == "scan":
    p = eb.params
    lead = p["num_consts"] + p["num_carry"]
    if any(a == 0 for a in ins[lead:]) or any(a == 0 for a in outs[p["num_carry"]:]):
      return "steps along the examples"
  for (_, jb), (_, js) in zip(inner_b, inner_s):
    sub: dict[Any, Any] = {VARYING: varying_consts(jb, js)}
    try:
      check_jaxpr(jb, js, m, sub)
    except NotRowwise as e:
      return f"holds {e}"
  return None
