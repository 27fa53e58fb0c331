"""What a node keeps from its forward for its backward, per micro-batch, from the jaxpr.

The planner counts a node's memory per micro-batch in flight (from its forward to its backward).
Its outputs are not the measure: an LSTM layer keeps every time step's gates (paper BigLSTM:
0.66 MB of output, 64 MB kept, at 8 rows), a convolution followed by batch norm keeps its
input and the normalised values. `saved_bytes` traces the node's `jax.vjp` on abstract inputs
(nothing is computed; ~20 ms a node) and counts the arrays its pullback holds that are neither
the node's inputs (parameters, and activations another node already holds) nor constants filled
in place (`jax.nn.relu`'s derivative holds zeros as large as its input), plus the node's outputs
(which the next node or the loss reads).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import jax
import jax.extend as jex

from jaxhybrid.graph.eqn_costs import aval_bytes

log = logging.getLogger(__name__)

# Per graph: node id -> bytes (a graph's nodes do not change after tracing or a shard rewrite).
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_fill(eqn: Any, constvars: set[Any]) -> bool:
  """A broadcast of a literal or constant: made again in the backward, never stored."""
  return eqn is not None and eqn.primitive.name == "broadcast_in_dim" and all(
    not isinstance(v, jex.core.Var) or v in constvars for v in eqn.invars)


def saved_bytes(graph: Any, node: Any) -> int:
  """Bytes node `node` of `graph` keeps per micro-batch: its outputs plus its pullback's
  residuals (module docstring). Cached per graph."""
  cache = _SAVED.setdefault(graph, {})
  if node.id in cache:
    return cache[node.id]
  closed = graph.node_jaxpr(node)
  f = jex.core.jaxpr_as_fun(closed)
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in node.invars]

  def probe(*xs):
    outs, pullback = jax.vjp(f, *xs)
    return outs, jax.tree.leaves(pullback)

  try:
    traced = jax.make_jaxpr(probe)(*args).jaxpr
  except Exception as e:  # noqa: BLE001 - an estimate: a node autodiff cannot probe keeps its outputs
    log.info("node %s: no residual probe (%s: %s); counting its outputs", node.name,
             type(e).__name__, str(e)[:120])
    cache[node.id] = int(node.out_bytes)
    return cache[node.id]
  n_out = len(node.outvars)
  inputs = set(traced.invars)
  constvars = set(traced.constvars)
  made_by = {v: e for e in traced.eqns for v in e.outvars}
  outputs = {v for v in traced.outvars[:n_out] if isinstance(v, jex.core.Var)}
  seen: set[Any] = set()
  kept = 0
  for v in traced.outvars[n_out:]:
    if (not isinstance(v, jex.core.Var) or v in inputs or v in outputs or v in constvars
        or v in seen or _is_fill(made_by.get(v), constvars)):
      continue
    seen.add(v)
    kept += aval_bytes(v.aval)
  cache[node.id] = total = int(node.out_bytes) + kept
  return total
