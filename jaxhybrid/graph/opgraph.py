"""Op graph of a training loss: a Flax model's forward loss lowered to a jaxpr, grouped into nodes.

The graph is built from `jax.make_jaxpr` of the forward loss on abstract inputs (no parameter is
ever allocated, so a 1.8 B-parameter BigLSTM traces in seconds). Top-level equations are grouped
by Flax module path (`jaxhybrid.graph.coarsen`): linen records module paths in each equation's
name stack; for NNX, `trace` opens a name scope around every submodule method call while
tracing. By default the module tree is cut from the top towards a target node count
(`max_nodes`, default `coarsen.DEFAULT_MAX_NODES`), so lists of layers become one node per
layer; `depth` asks for a uniform cut instead. Glue between module calls (activations, concats,
the loss) joins its producer or its consumer only where that adds no false dependency, so
independent module calls stay independent. The node graph is acyclic. A module called twice
becomes two nodes that share parameters.

Each node keeps its equations, so a program can replay it (`OpGraph.node_fn`); this is how the
hybrid program evaluates the forward node by node on different devices.

Costs per node are of the forward pass, summed from `jaxhybrid.graph.eqn_costs`; a cost model turns
them into forward + backward time (see `jaxhybrid.costs`). NNX models are traced through
`jaxhybrid.graph.flax_adapters`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex
import numpy as np

from jaxhybrid.graph import coarsen
from jaxhybrid.graph.coarsen import DEFAULT_MAX_NODES
from jaxhybrid.graph.eqn_costs import EqnCost, aval_bytes, eqn_cost
from jaxhybrid.graph.flax_adapters import is_linen_module, is_nnx_module, nnx_pure_loss

log = logging.getLogger(__name__)

# Kinds of the traced function's inputs.
PARAM, STATE, BATCH, CONST = "param", "state", "batch", "const"

@dataclasses.dataclass(eq=False)
class Node:
  """A coarse op: a contiguous run of top-level equations under one module path.

  Attributes:
    id: index in `OpGraph.nodes` (nodes are in topological order).
    name: module path of the node's unit (unique; a repeated call gets `#k`).
    eqns: the top-level jaxpr equations, in trace order.
    invars: variables read from outside the node (other nodes, params, batch, consts).
    outvars: variables produced here and read by later nodes or by the loss output.
    flops: forward FLOPs.
    bytes_accessed: forward bytes read + written by the equations.
    param_leaves: indices of the flat parameter leaves the node reads.
    param_bytes: bytes of those parameters.
    out_bytes: bytes of `outvars` (activations this node sends on).
    opaque: primitives costed by the fallback rule (unknown to the cost model).
  """

  id: int
  name: str
  eqns: list[Any]
  invars: list[Any] = dataclasses.field(default_factory=list)
  outvars: list[Any] = dataclasses.field(default_factory=list)
  flops: float = 0.0
  bytes_accessed: float = 0.0
  param_leaves: tuple[int, ...] = ()
  param_bytes: int = 0
  out_bytes: int = 0
  opaque: tuple[str, ...] = ()

  def __repr__(self) -> str:
    return (
      f"Node({self.id}, {self.name!r}, eqns={len(self.eqns)}, flops={self.flops:.3g}, "
      f"params={self.param_bytes}B)"
    )


@dataclasses.dataclass(frozen=True)
class Edge:
  """Data flowing from node `src` to node `dst` (`src < dst`); `bytes` per traced batch."""

  src: int
  dst: int
  bytes: int
  vars: tuple[Any, ...] = ()


@dataclasses.dataclass(eq=False)
class OpGraph:
  """The coarse op graph of one worker's forward loss.

  Attributes:
    nodes: nodes in topological order.
    edges: edges between nodes (one per ordered pair), with the bytes that cross.
    closed_jaxpr: the traced forward loss `f(params, state, batch) -> loss`.
    input_kinds: per jaxpr invar, `(kind, index)` with kind in {param, state, batch}.
    param_paths, state_paths, batch_paths: key paths of the flattened inputs.
    param_treedef, state_treedef, batch_treedef: tree structures to rebuild the inputs.
    depth: module-path depth of a uniform cut, or None for the cut refined to `max_nodes`.
    param_split, shards: the leaves split by `jaxhybrid.graph.shard` (empty: none).
    batch_splits: the nodes split by rows of the micro-batch (`jaxhybrid.graph.batch_split`).
    state_writes: per jaxpr output after the loss (`jaxpr.outvars[1:]`), the index of the
      state leaf it is the new value of (BatchNorm running averages, RNG counters), when the
      traced function returns `(loss, new_state)`; the hybrid step carries them to the next.
    state_uncarried: paths of state leaves the loss writes that are not carried (a dtype
      that cannot be combined over micro-batches, e.g. a PRNG key, or a new value that is a
      constant or another input).
  """

  nodes: list[Node]
  edges: list[Edge]
  closed_jaxpr: Any
  input_kinds: tuple[tuple[str, int], ...]
  param_paths: tuple[str, ...]
  state_paths: tuple[str, ...]
  batch_paths: tuple[str, ...]
  param_treedef: Any
  state_treedef: Any
  batch_treedef: Any
  depth: int | None
  # Per graph parameter leaf, (user leaf, axis, start, stop) of the piece it is, axis -1 for a
  # whole leaf; () when no leaf is split (`jaxhybrid.graph.shard`).
  param_split: tuple[tuple[int, int, int, int], ...] = ()
  shards: tuple[Any, ...] = ()  # shard.LeafShard per split leaf
  batch_splits: tuple[Any, ...] = ()  # batch_split.NodeSplit per node split by rows
  state_writes: tuple[int, ...] = ()
  state_uncarried: tuple[str, ...] = ()

  # ---- derived views ------------------------------------------------------------------------
  @property
  def jaxpr(self) -> Any:
    return self.closed_jaxpr.jaxpr

  @property
  def param_avals(self) -> tuple[Any, ...]:
    return tuple(
      v.aval for v, (k, _) in zip(self.jaxpr.invars, self.input_kinds) if k == PARAM
    )

  @property
  def total_flops(self) -> float:
    return sum(n.flops for n in self.nodes)

  @property
  def total_param_bytes(self) -> int:
    return sum(aval_bytes(a) for a in self.param_avals)

  def producers(self) -> dict[Any, int]:
    """Maps each variable produced by a node to that node's id."""
    out = {}
    for n in self.nodes:
      for e in n.eqns:
        for v in e.outvars:
          out[v] = n.id
    return out

  def fingerprint(self) -> str:
    """A stable hash of the graph's structure and sizes (names, FLOPs, params, edges)."""
    h = hashlib.sha256()
    for n in self.nodes:
      h.update(f"{n.name}|{len(n.eqns)}|{n.flops:.6g}|{n.param_bytes}|{n.out_bytes};".encode())
    for e in self.edges:
      h.update(f"{e.src}>{e.dst}:{e.bytes};".encode())
    return h.hexdigest()[:16]

  def node_fingerprint(self, node: Node) -> str:
    """A hash of one node's computation: its primitives, shapes and parameters."""
    # The printed jaxpr names variables canonically (a, b, ...) and shows every primitive, its
    # wiring, shapes, parameters and nested jaxprs in full, so equal text = equal computation.
    return hashlib.sha256(str(self.node_jaxpr(node)).encode()).hexdigest()[:16]

  def node_jaxpr(self, node: Node) -> Any:
    """A closed jaxpr `node_inputs -> node_outputs` holding the node's equations."""
    debug = jex.core.DebugInfo(
      "jaxhybrid node", node.name, tuple(f"in{i}" for i in range(len(node.invars))),
      tuple(f"out{i}" for i in range(len(node.outvars))),
    )
    jaxpr = jex.core.Jaxpr(
      constvars=[], invars=list(node.invars), outvars=list(node.outvars), eqns=list(node.eqns),
      effects=frozenset().union(*(e.effects for e in node.eqns)), debug_info=debug,
    )
    return jex.core.ClosedJaxpr(jaxpr, [])

  def saved_bytes(self, node: Node) -> int:
    """Bytes the node keeps per micro-batch for its backward: outputs + residuals
    (`jaxhybrid.graph.residuals`)."""
    from jaxhybrid.graph import residuals

    return residuals.saved_bytes(self, node)

  def param_reads(self, node: Node) -> list[tuple[int, int, bool]]:
    """(parameter leaf index, bytes, looked up) of every parameter leaf the node reads, once each:
    looked up when every reader of the leaf in the node is a row gather (a table the program
    reads in place, `jaxhybrid.program.lookups`), else read whole (a matmul, a convolution, a
    loop)."""
    from jaxhybrid.graph import shard_rules

    kinds = dict(zip(self.jaxpr.invars, self.input_kinds))
    out = []
    for v in dict.fromkeys(node.invars):
      kind, idx = kinds.get(v, (None, -1))
      if kind != PARAM:
        continue
      eqns, _ = shard_rules.inline(node.eqns, {v})
      readers = [e for e in eqns if any(u is v for u in e.invars)]
      looked_up = bool(readers) and all(
        shard_rules.reader_axis(e, v)[0] == "lookup" for e in readers)
      out.append((int(idx), aval_bytes(v.aval), looked_up))
    return out

  def copied_param_bytes(self, node: Node) -> int:
    """Bytes of the node's parameter leaves a task reads whole (`param_reads`): all of them but
    the tables it only looks up by rows."""
    return sum(b for _, b, looked_up in self.param_reads(node) if not looked_up)

  def node_fn(self, node: Node) -> Callable[..., list[Any]]:
    """A function `(*inputs) -> [outputs]` replaying the node's equations."""
    return jex.core.jaxpr_as_fun(self.node_jaxpr(node))

  def summary(self, max_rows: int | None = None) -> str:
    """A readable node table: module path, FLOPs, bytes, parameters, output activations."""
    rows = [f"{'id':>4}  {'module path':<40} {'GFLOP':>10} {'MB r/w':>10} {'params MB':>10} {'out MB':>9}"]
    for n in self.nodes[: max_rows or len(self.nodes)]:
      rows.append(
        f"{n.id:>4}  {n.name[:40]:<40} {n.flops / 1e9:>10.3f} {n.bytes_accessed / 1e6:>10.2f} "
        f"{n.param_bytes / 1e6:>10.2f} {n.out_bytes / 1e6:>9.2f}"
        + ("  [opaque: " + ",".join(sorted(set(n.opaque))) + "]" if n.opaque else "")
      )
    if max_rows and len(self.nodes) > max_rows:
      rows.append(f"  ... {len(self.nodes) - max_rows} more nodes")
    rows.append(
      f"{len(self.nodes)} nodes, {len(self.edges)} edges, {self.total_flops / 1e9:.3f} GFLOP forward, "
      f"{self.total_param_bytes / 1e6:.2f} MB parameters, fingerprint {self.fingerprint()}"
    )
    return "\n".join(rows)


# ---- grouping ---------------------------------------------------------------------------------

def _path(eqn: Any, strip: str | None) -> list[str]:
  parts = [p for p in str(eqn.source_info.name_stack).split("/") if p]
  if strip is not None and parts and parts[0] == strip:
    parts = parts[1:]
  return parts


def _build(
  closed_jaxpr: Any, input_kinds, depth: int | None, max_nodes: int | None,
  strip: str | None = None,
) -> tuple[list[Node], list[Edge]]:
  jaxpr = closed_jaxpr.jaxpr
  # Nodes are cut around the loss alone: state writes (jaxpr.outvars[1:]) stay in the module
  # whose equations make them and do not change the cut.
  groups = coarsen.coarsen(
    jaxpr.eqns, [_path(e, strip) for e in jaxpr.eqns], jaxpr.outvars[:1], depth=depth,
    max_nodes=max_nodes,
  )
  seen: dict[str, int] = {}
  nodes = []
  for i, (k, eqns) in enumerate(groups):
    count = seen.get(k, 0)
    seen[k] = count + 1
    nodes.append(Node(id=i, name=k if count == 0 else f"{k}#{count}", eqns=eqns))
  _wire(nodes, jaxpr, input_kinds)
  return nodes, _edges(nodes)


def _wire(nodes: list[Node], jaxpr: Any, input_kinds) -> None:
  producer: dict[Any, int] = {}
  for n in nodes:
    for e in n.eqns:
      for v in e.outvars:
        producer[v] = n.id
  param_index = {
    v: idx for v, (kind, idx) in zip(jaxpr.invars, input_kinds) if kind == PARAM
  }
  consumers: dict[Any, set[int]] = {}
  for n in nodes:
    ins: list[Any] = []
    seen = set()
    for e in n.eqns:
      for v in e.invars:
        if isinstance(v, jex.core.Literal) or v in seen:
          continue
        if producer.get(v) == n.id:
          continue
        seen.add(v)
        ins.append(v)
        consumers.setdefault(v, set()).add(n.id)
    n.invars = ins
    leaves = sorted(param_index[v] for v in ins if v in param_index)
    n.param_leaves = tuple(leaves)
    n.param_bytes = sum(aval_bytes(v.aval) for v in ins if v in param_index)
    cost = EqnCost(0.0, 0.0)
    for e in n.eqns:
      cost = cost + eqn_cost(e)
    n.flops, n.bytes_accessed, n.opaque = cost.flops, cost.bytes_accessed, cost.opaque
    if cost.opaque:
      log.warning(
        "node %s holds primitives without a cost rule (%s): costed as one FLOP per output element",
        n.name, ", ".join(sorted(set(cost.opaque))),
      )
  out_set = {v for v in jaxpr.outvars if not isinstance(v, jex.core.Literal)}
  state_out = set(jaxpr.outvars[1:]) - {jaxpr.outvars[0]}
  for n in nodes:
    outs = []
    for e in n.eqns:
      for v in e.outvars:
        if isinstance(v, jex.core.DropVar):
          continue
        if v in out_set or any(c != n.id for c in consumers.get(v, ())):
          outs.append(v)
    n.outvars = outs
    # State writes are read once, at the end of the step, not sent on: not activation bytes.
    n.out_bytes = sum(aval_bytes(v.aval) for v in outs if v not in state_out)


def _edges(nodes: list[Node]) -> list[Edge]:
  producer = {}
  for n in nodes:
    for v in n.outvars:
      producer[v] = n.id
  acc: dict[tuple[int, int], list[Any]] = {}
  for n in nodes:
    for v in n.invars:
      p = producer.get(v)
      if p is not None:
        acc.setdefault((p, n.id), []).append(v)
  return [
    Edge(src=s, dst=d, bytes=sum(aval_bytes(v.aval) for v in vs), vars=tuple(vs))
    for (s, d), vs in sorted(acc.items())
  ]


# ---- tracing ----------------------------------------------------------------------------------

def _paths(tree: Any) -> tuple[tuple[str, ...], Any]:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return tuple(jax.tree_util.keystr(p) for p, _ in flat), treedef


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _check_coarsening(depth: int | None, max_nodes: int | None) -> None:
  if depth is not None and depth < 1:
    raise ValueError(
      f"depth={depth}: the module-path depth must be >= 1 (or None to cut to max_nodes)"
    )
  if max_nodes is not None and max_nodes < 1:
    raise ValueError(f"max_nodes={max_nodes}: use a node count >= 1")


def trace_function(
  fn: Callable[[Any, Any, Any], jax.Array],
  params: Any,
  state: Any,
  batch: Any,
  *,
  depth: int | None = None,
  max_nodes: int | None = DEFAULT_MAX_NODES,
  root_scope: str | None = None,
) -> OpGraph:
  """Traces a pure loss `fn(params, state, batch) -> scalar` to an OpGraph.

  Args:
    fn: the forward loss. `params` are trained; `state` (e.g. BatchNorm statistics) is read,
      and written when `fn` returns `(loss, new_state)` with `new_state` in the structure of
      `state`: the leaves it changes become the graph's `state_writes`.
    params, state, batch: pytrees of arrays or `jax.ShapeDtypeStruct` (abstract is enough).
    depth: if set, a uniform cut: this many module-path components name a node. None (the
      default): the module tree is refined from the top, splitting the costliest node that has
      submodules, while the node count stays within `max_nodes`.
    max_nodes: target and bound of the node count: adjacent nodes are merged until at most this
      many remain. None: no bound with `depth`; without it, `DEFAULT_MAX_NODES`.
    root_scope: a leading name-stack component to drop (linen's root module class name).

  Returns:
    The OpGraph.

  Raises:
    ValueError: if `depth` < 1, `max_nodes` < 1, or the loss is not a scalar.
  """
  _check_coarsening(depth, max_nodes)
  params, state, batch = _abstract(params), _abstract(state), _abstract(batch)
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(params, state, batch)
  p_paths, p_def = _paths(params)
  s_paths, s_def = _paths(state)
  b_paths, b_def = _paths(batch)
  closed, writes, uncarried = _state_outputs(closed, shapes, len(p_paths), s_paths, s_def)
  outs = closed.jaxpr.outvars
  if getattr(outs[0].aval, "shape", None) != ():
    raise ValueError(
      f"the loss must return one scalar, got {[getattr(v.aval, 'shape', None) for v in outs]}: "
      "return the mean loss only (or (loss, new_state))"
    )
  kinds = (
    [(PARAM, i) for i in range(len(p_paths))]
    + [(STATE, i) for i in range(len(s_paths))]
    + [(BATCH, i) for i in range(len(b_paths))]
  )
  if len(kinds) != len(closed.jaxpr.invars):
    raise RuntimeError("internal: jaxpr inputs do not match the flattened inputs")
  nodes, edges = _build(closed, tuple(kinds), depth, max_nodes, strip=root_scope)
  return OpGraph(
    nodes=nodes, edges=edges, closed_jaxpr=closed, input_kinds=tuple(kinds),
    param_paths=p_paths, state_paths=s_paths, batch_paths=b_paths,
    param_treedef=p_def, state_treedef=s_def, batch_treedef=b_def, depth=depth,
    state_writes=writes, state_uncarried=uncarried,
  )


def _state_outputs(
  closed: Any, shapes: Any, n_params: int, s_paths: tuple[str, ...], s_def: Any,
) -> tuple[Any, tuple[int, ...], tuple[str, ...]]:
  """The traced loss with outputs [loss, *written state leaves] and which state leaf each write
  is (see `trace_function`); a function returning the loss alone is returned as it is."""
  outs = closed.jaxpr.outvars
  if len(outs) == 1:
    return closed, (), ()
  ok = (isinstance(shapes, (tuple, list)) and len(shapes) == 2
        and jax.tree.structure(shapes[1]).num_leaves == len(s_paths)
        and len(outs) == 1 + len(s_paths))
  if not ok:
    raise ValueError(
      f"the loss returns {len(outs)} arrays: return the mean loss alone, or (loss, new_state) "
      f"with new_state in the structure of the state input ({len(s_paths)} leaves)"
    )
  made = {v for e in closed.jaxpr.eqns for v in e.outvars}
  invars = closed.jaxpr.invars
  writes, uncarried = [], []
  for j, v in enumerate(outs[1:]):
    if v is invars[n_params + j]:
      continue  # unchanged
    numeric = not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)
    if isinstance(v, jex.core.Var) and v in made and numeric:
      writes.append(j)
    else:
      uncarried.append(s_paths[j])
  new_outs = [outs[0]] + [outs[1 + j] for j in writes]
  dbg = closed.jaxpr.debug_info
  if dbg is not None:
    dbg = dbg._replace(result_paths=tuple(f"out{i}" for i in range(len(new_outs))))
  jaxpr = closed.jaxpr.replace(outvars=new_outs, debug_info=dbg)
  return jex.core.ClosedJaxpr(jaxpr, closed.consts), tuple(writes), tuple(uncarried)


def trace(
  model: Any,
  loss_fn: Callable[..., jax.Array],
  batch: Any,
  *,
  params: Any = None,
  depth: int | None = None,
  max_nodes: int | None = DEFAULT_MAX_NODES,
) -> OpGraph:
  """Traces the training loss of a Flax model (NNX or linen) to an OpGraph, abstractly.

  Args:
    model: an `nnx.Module` (build it abstractly with `nnx.eval_shape` for big models) or a
      linen `nn.Module`.
    loss_fn: NNX: `loss_fn(model, batch) -> scalar`. Linen: `loss_fn(params, batch) -> scalar`,
      where the function calls `model.apply({'params': params}, ...)` itself.
    batch: a pytree of arrays or `jax.ShapeDtypeStruct`.
    params: linen only: the parameter pytree (e.g. from `jax.eval_shape(model.init, ...)`,
      without the 'params' collection wrapper).
    depth, max_nodes: how finely to cut the module tree (see `trace_function`).

  Returns:
    The OpGraph.

  Raises:
    ValueError: for a model that is neither NNX nor linen, or linen without `params`.
  """
  if is_nnx_module(model):
    _, p, s, pure = nnx_pure_loss(model, loss_fn, with_state=True)
    return trace_function(pure, p, s, batch, depth=depth, max_nodes=max_nodes)
  if is_linen_module(model):
    if params is None:
      raise ValueError(
        "tracing a linen module needs params=...: pass jax.eval_shape(model.init, rng, x)['params']"
      )
    # Linen's name stacks start with the root module's class name; paths count below it.
    return trace_function(
      lambda p, s, b: loss_fn(p, b), params, {}, batch, depth=depth, max_nodes=max_nodes,
      root_scope=type(model).__name__,
    )
  raise ValueError(
    f"cannot trace {type(model).__name__}: pass a flax.nnx.Module or a flax.linen.Module"
  )
