"""Forward cost of jaxpr equations: FLOPs (exact for `dot_general` and convolutions, an element
count for the rest; a `scan` costs its body times its length) and bytes read and written.

Used by `jaxhybrid.graph` to cost each node; a cost model turns these into time
(`jaxhybrid.costs`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax.extend as jex
import numpy as np

log = logging.getLogger(__name__)


# Primitives whose cost rule below is deliberate; any other primitive without a sub-jaxpr is
# costed as one FLOP per output element and flagged opaque with a warning.
_ELEMENTWISE_OK = frozenset("""
  abs acos acosh add and asin asinh atan atan2 atanh broadcast_in_dim cbrt ceil clamp
  concatenate convert_element_type copy copy_p cos cosh cumsum cumprod cummax cummin
  custom_lin div dynamic_slice dynamic_update_slice eq erf erf_inv erfc exp exp2 expm1 floor
  gather ge gt imag integer_pow iota is_finite le lgamma digamma log log1p logistic lt max min
  mul ne neg nextafter not or pad pjit population_count pow real reduce_and reduce_max
  reduce_min reduce_or reduce_prod reduce_sum reduce_precision rem reshape rev round rsqrt
  scatter scatter-add scatter_add scatter-mul scatter-min scatter-max select_n sign sin sinh
  slice sort sqrt square squeeze stop_gradient sub tan tanh transpose xor argmax argmin
  shift_left shift_right_logical shift_right_arithmetic split top_k random_bits random_seed
  random_wrap random_unwrap threefry2x32 erf_inv select_and_scatter_add reduce_window_sum
  reduce_window_max reduce_window_min reduce_window argsort mul_add polygamma igamma
  igammac random_gamma_grad bessel_i0e bessel_i1e pcast device_put optimization_barrier
  convert clz
""".split())


# Primitives that read only as many operand elements as they output.
_READS_OUTPUT_ONLY = frozenset({"gather", "dynamic_slice", "slice"})


def aval_bytes(aval: Any) -> int:
  """Bytes of an abstract value (0 for non-arrays; 8 per element for extended dtypes)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  try:
    itemsize = np.dtype(dtype).itemsize
  except TypeError:  # extended dtypes (PRNG keys)
    itemsize = 8
  return int(math.prod(shape)) * itemsize


def _aval_size(aval: Any) -> int:
  shape = getattr(aval, "shape", None)
  return int(math.prod(shape)) if shape is not None else 0


@dataclasses.dataclass(frozen=True)
class EqnCost:
  """Forward cost of one equation (recursively through sub-jaxprs)."""

  flops: float
  bytes_accessed: float
  opaque: tuple[str, ...] = ()

  def __add__(self, other: EqnCost) -> EqnCost:
    return EqnCost(
      self.flops + other.flops,
      self.bytes_accessed + other.bytes_accessed,
      self.opaque + other.opaque,
    )

  def scale(self, k: float) -> EqnCost:
    return EqnCost(self.flops * k, self.bytes_accessed * k, self.opaque)


def dot_general_flops(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers) -> int:
  """FLOPs of a `dot_general`: 2 x (batch x M x N x K), a multiply and an add per term."""
  (_, rhs_contract), (_, rhs_batch) = dimension_numbers
  rhs_free = [d for i, d in enumerate(rhs_shape) if i not in rhs_contract and i not in rhs_batch]
  return 2 * int(math.prod(lhs_shape)) * int(math.prod(rhs_free))


def conv_flops(out_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers) -> int:
  """FLOPs of a convolution: 2 x output elements x (kernel elements per output feature)."""
  rhs_spec = dimension_numbers.rhs_spec  # (out feature dim, in feature dim, spatial...)
  out_features = rhs_shape[rhs_spec[0]]
  return 2 * int(math.prod(out_shape)) * (int(math.prod(rhs_shape)) // max(out_features, 1))


def _jaxpr_cost(jaxpr: Any) -> EqnCost:
  total = EqnCost(0.0, 0.0)
  for eqn in jaxpr.eqns:
    total = total + eqn_cost(eqn)
  return total


def _inner_jaxpr(j: Any) -> Any:
  return j.jaxpr if hasattr(j, "jaxpr") and not hasattr(j, "eqns") else j


def eqn_cost(eqn: Any) -> EqnCost:
  """Forward FLOPs and bytes of one equation; recurses into nested jaxprs."""
  name = eqn.primitive.name
  in_bytes = sum(aval_bytes(v.aval) for v in eqn.invars)
  out_bytes = sum(aval_bytes(v.aval) for v in eqn.outvars)
  io = float(in_bytes + out_bytes)
  if name in _READS_OUTPUT_ONLY:
    # An embedding lookup or a slice reads only the elements it returns (and its indices), not
    # the whole operand.
    io = float(2 * out_bytes + sum(aval_bytes(v.aval) for v in eqn.invars[1:]))
  if name == "dot_general":
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    return EqnCost(float(dot_general_flops(lhs.shape, rhs.shape, eqn.params["dimension_numbers"])), io)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    out = eqn.outvars[0].aval
    flops = conv_flops(out.shape, rhs.shape, eqn.params["dimension_numbers"])
    return EqnCost(float(flops // max(eqn.params.get("batch_group_count", 1), 1)), io)
  if name == "scan":
    body = _jaxpr_cost(_inner_jaxpr(eqn.params["jaxpr"]))
    return body.scale(eqn.params["length"])
  if name == "while":
    body = _jaxpr_cost(_inner_jaxpr(eqn.params["body_jaxpr"]))
    log.warning("while loop: trip count unknown, its body is counted once")
    return body + EqnCost(0.0, 0.0, ("while",))
  if name == "cond":
    branches = [_jaxpr_cost(_inner_jaxpr(b)) for b in eqn.params["branches"]]
    return max(branches, key=lambda c: c.flops)
  subs = list(jex.core.jaxprs_in_params(eqn.params))
  if subs:
    total = EqnCost(0.0, 0.0)
    for sub in subs:
      total = total + _jaxpr_cost(_inner_jaxpr(sub))
    return total
  if name in _ELEMENTWISE_OK:
    n = max(sum(_aval_size(v.aval) for v in eqn.outvars), 1)
    if name.startswith("reduce") or name in ("argmax", "argmin", "cumsum", "sort"):
      n = max(sum(_aval_size(v.aval) for v in eqn.invars), 1)
    return EqnCost(float(n), io)
  n = max(sum(_aval_size(v.aval) for v in eqn.outvars), 1)
  return EqnCost(float(n), io, (name,))
