"""Batch split: a node's micro-batch divided by rows over the model-axis devices.

A node placed whole leaves the other model devices idle while it runs. When its examples never
mix (`jaxhybrid.graph.batch_rules`: a convolution, a dense layer, an LSTM over time, an
attention block; not BatchNorm in training, not the mean loss), the node can run as M *batch
pieces* instead: piece d reads rows [lo_d, hi_d) of every input that carries examples, and the
whole of every input that does not (its parameters, a statistic made elsewhere), and runs the
node's own equations at 1/M of the micro-batch; the *post* node (the node's name) concatenates
the pieces' outputs back into the node's. The pieces' equations are the model's own, traced at
the smaller batch (`small`), so every shape parameter (a reshape, a broadcast, a scan's carry)
is right by construction.

Like a leaf split (`jaxhybrid.graph.shard`) this is a rewrite of the op graph, not a new kind of
node: the planner places each piece like any node (pieces on different devices share the work;
all on one device are the whole node plus a split's overhead), and the program runs it as it
runs any graph. By default the node's parameters are read by M nodes: placed on several
devices they are replicated there and their gradients summed over 'model', as a tied
embedding's are, so a batch split divides a node's compute and activations, not its parameters.
With `params='split'` they are stored in M slices held by M more nodes and gathered by the
pieces (`_store_split`).

Loss and gradients equal the unsplit graph's (`tests/batch_split_test.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax

from jaxhybrid.graph import batch_rules
from jaxhybrid.graph import shard as shard_lib
from jaxhybrid.graph import shard_rules as rules_lib
from jaxhybrid.graph.opgraph import PARAM, Node, OpGraph, _edges, _wire

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeSplit:
  """One node's micro-batch split into `len(bounds) - 1` row ranges (offsets of the rows)."""

  node: str
  bounds: tuple[int, ...]
  piece_nodes: tuple[str, ...]
  # With params='split': the node's parameter leaves stored in M slices (their paths), and the
  # M nodes that each hold one slice of every such leaf and send it to the pieces.
  split_params: tuple[str, ...] = ()
  param_nodes: tuple[str, ...] = ()

  def to_json(self) -> dict[str, Any]:
    out = {"node": self.node, "bounds": list(self.bounds), "piece_nodes": list(self.piece_nodes)}
    if self.split_params:
      out |= {"split_params": list(self.split_params), "param_nodes": list(self.param_nodes)}
    return out

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> NodeSplit:
    return cls(node=str(d["node"]), bounds=tuple(int(b) for b in d["bounds"]),
               piece_nodes=tuple(str(n) for n in d["piece_nodes"]),
               split_params=tuple(str(p) for p in d.get("split_params", ())),
               param_nodes=tuple(str(n) for n in d.get("param_nodes", ())))


@dataclasses.dataclass(frozen=True)
class BatchSplitReport:
  """What a batch split did: the nodes split and, per node examined but not split, why."""

  splits: tuple[NodeSplit, ...]
  skipped: tuple[tuple[str, str], ...]  # (node name, reason)


def _pairs(big: Any, small: Any) -> dict[Any, Any]:
  """Each variable of the top-level jaxpr traced at B -> the same variable traced at B / M."""
  out = dict(zip(list(big.constvars) + list(big.invars),
                 list(small.constvars) + list(small.invars)))
  for eb, es in zip(big.eqns, small.eqns):
    out.update(zip(eb.outvars, es.outvars))
  return out


def _splice(fn: Any, ins: Sequence[Any], outs: Sequence[Any] | None = None) -> tuple[list, list]:
  closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins])
  return rules_lib.splice(closed, list(ins), outs)


def split_node(g: OpGraph, small: Any, devices: int, name: str,
               axes: dict[Any, int | None]) -> tuple[list[Node], NodeSplit] | str:
  """The nodes that replace node `name` (M pieces and the post node), or why it cannot be split.

  `small`: the loss's jaxpr traced at 1/`devices` of the micro-batch; `axes`: every variable's
  batch axis and, under `_REASONS`, the equations that mix examples (`_check_top`). The pieces
  run the node's equations up to the first that mixes examples (and everything after that does
  not read one); the post node concatenates what the rest and later nodes read, then runs the
  rest: BatchNorm after a convolution, the mean loss after a projection."""
  node = next(n for n in g.nodes if n.name == name)
  index = {id(e): i for i, e in enumerate(g.jaxpr.eqns)}
  if any(id(e) not in index for e in node.eqns):
    return "its equations are not the traced loss's (split leaves first changed it)"
  reasons = axes.get(_REASONS, {})
  var = lambda v: isinstance(v, jex.core.Var)
  tainted: set[Any] = set()
  rest: list[Any] = []
  piece_src: list[Any] = []
  static: list[Any] = []
  for e in node.eqns:
    if id(e) in reasons or any(v in tainted for v in e.invars if var(v)):
      rest.append(e)
      tainted.update(e.outvars)
    elif all(axes.get(v) is None for v in list(e.invars) + list(e.outvars) if var(v)):
      static.append(e)  # holds no examples: run by every piece, and by the post node if read
    else:
      piece_src.append(e)
  if not piece_src:
    first = next((reasons[id(e)] for e in node.eqns if id(e) in reasons), "no examples")
    return f"its first equations mix examples ({first})"
  # What the post node reads: the rest's inputs, the node's outputs, and the inputs of the
  # static equations it reruns for those.
  needed = {v for e in rest for v in e.invars if var(v)} | set(node.outvars)
  post_static = []
  for e in reversed(static):
    if any(v in needed for v in e.outvars):
      post_static.insert(0, e)
      needed.update(v for v in e.invars if var(v))
  sent = [v for e in piece_src for v in e.outvars if v in needed]
  if any(axes.get(v) is None for v in sent):
    return "sends on a value without examples"
  if not any(axes.get(v) is not None for v in node.invars if var(v)):
    return "reads no value with examples"
  pair = _pairs(g.jaxpr, small.jaxpr)
  keep = {id(e) for e in static + piece_src}
  small_eqns = [small.jaxpr.eqns[index[id(e)]] for e in node.eqns if id(e) in keep]
  piece_eqns: list[list[Any]] = []
  partials: dict[Any, list[Any]] = {v: [] for v in sent}
  # The node's inputs the pieces' own equations read: one only the post node reads is not
  # sliced (nor sent to the pieces' devices).
  used = {v for es in small_eqns for v in es.invars if var(v)}
  for d in range(devices):
    sub: dict[Any, Any] = {}
    eqns: list[Any] = []
    for v in node.invars:
      a = axes.get(v)
      vs = pair[v]
      if vs not in used:
        continue
      if a is None:
        sub[vs] = v
        continue
      n = vs.aval.shape[a]
      body, (sl,) = _splice(lambda x, a=a, lo=d * n: lax.slice_in_dim(x, lo, lo + n, axis=a), [v])
      eqns.extend(body)
      sub[vs] = sl
    for es in small_eqns:
      outs = []
      for v in es.outvars:
        if isinstance(v, jex.core.DropVar):
          outs.append(v)
        else:
          sub[v] = nv = rules_lib.fresh(v)
          outs.append(nv)
      eqns.append(es.replace(
        invars=[sub.get(v, v) if var(v) else v for v in es.invars], outvars=outs))
    for v in sent:
      partials[v].append(sub[pair[v]])
    piece_eqns.append(eqns)
  post: list[Any] = []
  for v in sent:
    body, _ = _splice(lambda *ps, a=axes[v]: lax.concatenate(list(ps), a), partials[v], [v])
    post.extend(body)
  post.extend(post_static)
  post.extend(rest)
  base = f"{name}/batch"
  pieces = [Node(id=0, name=f"{base}{d}", eqns=piece_eqns[d]) for d in range(devices)]
  micro = _micro_rows(g, axes)
  bounds = tuple(d * micro // devices for d in range(devices + 1))
  return pieces + [Node(id=0, name=name, eqns=post)], NodeSplit(
    node=name, bounds=bounds, piece_nodes=tuple(p.name for p in pieces))


_Slices = dict[Any, tuple[int, tuple[int, ...], list[Any]]]  # leaf var -> (axis, bounds, slices)


def _store_split(g: OpGraph, made: list[Node], info: NodeSplit, devices: int
                 ) -> tuple[list[Node], _Slices, NodeSplit]:
  """Parameters stored in slices for one split node (`params='split'`): every floating-point
  parameter leaf only this node reads, with a dimension of at least `devices`, is cut along its
  longest one into M slices; node `<name>/params<j>` holds slice j of each and sends it on, and
  each piece (and the post node, if it reads the leaf) concatenates the M slices before its
  equations. The gradients of the slices flow back to their holders, where they are summed: an
  all-gather before the node and a reduce-scatter after it, made of the program's messages.
  Returns the holder nodes, the leaves split (var -> (axis, bounds, slice vars)) and the split's
  record."""
  node = next(n for n in g.nodes if n.name == info.node)
  var = lambda v: isinstance(v, jex.core.Var)
  others = {v for n in g.nodes if n is not node for e in n.eqns for v in e.invars if var(v)}
  others |= {v for v in g.jaxpr.outvars if var(v)}
  params = [v for v, (k, _) in zip(g.jaxpr.invars, g.input_kinds) if k == PARAM]
  leaves: _Slices = {}
  paths = []
  for v, path in zip(params, g.param_paths):
    shape = v.aval.shape
    fits = [a for a in range(len(shape)) if shape[a] >= devices]
    floating = jnp.issubdtype(v.aval.dtype, jnp.inexact)
    if v not in node.invars or v in others or not fits or not floating:
      continue
    axis = max(fits, key=lambda a: (shape[a], -a))
    bounds = rules_lib.split_bounds(shape[axis], devices)
    pieces = [jex.core.Var(v.aval.update(shape=tuple(
      hi - lo if a == axis else n for a, n in enumerate(shape))))
      for lo, hi in zip(bounds[:-1], bounds[1:])]
    leaves[v] = (axis, tuple(bounds), pieces)
    paths.append(path)
  if not leaves:
    return [], {}, info
  holders = [Node(id=0, name=f"{info.node}/params{j}", eqns=[]) for j in range(devices)]
  held: dict[Any, list[Any]] = {}
  for v, (axis, _, pieces) in leaves.items():
    for j, pv in enumerate(pieces):
      # (fresh outputs: make_jaxpr caches the trace of one function, variables included)
      body, (h,) = _splice(jnp.copy, [pv], [rules_lib.fresh(pv)])
      holders[j].eqns.extend(body)
      held.setdefault(v, []).append(h)
  for n in made:
    read = [v for v in leaves if any(x is v for e in n.eqns for x in e.invars)]
    if not read:
      continue
    front, sub = [], {}
    for v in read:
      body, (full,) = _splice(lambda *hs, a=leaves[v][0]: lax.concatenate(list(hs), a),
                              held[v], [rules_lib.fresh(v)])
      front.extend(body)
      sub[v] = full
    n.eqns = front + [e.replace(invars=[sub.get(x, x) if isinstance(x, jex.core.Var) else x
                                        for x in e.invars]) for e in n.eqns]
  return holders, leaves, dataclasses.replace(
    info, split_params=tuple(paths), param_nodes=tuple(h.name for h in holders))


def leaf_rule_nodes(g: OpGraph, devices: int, rules: Sequence[str],
                    min_fraction: float) -> dict[str, str]:
  """Nodes to leave out of a batch split (`split_batch`'s `skip`) because the leaf rules among
  `rules` split one of their parameter leaves (`shard.shard_leaves` on `g`): split by rows,
  every piece would read that leaf whole (a copy per device, or gathered per micro-batch), where
  the leaf split divides it (paper BigLSTM's vocabulary tables, 3.2 GB each: with both splits
  offered and the tables' nodes split by rows, a 1x8 plan under a 4 GiB cap compiled to 12.1 GiB
  per device; leaving those nodes to the leaf rules, 4.97 GiB)."""
  rules = tuple(r for r in rules if r != "batch")
  if not rules:
    return {}
  _, report = shard_lib.shard_leaves(g, devices, rules=rules, min_fraction=min_fraction)
  return {x.node: f"the leaf rules split its parameter {x.path} (batch pieces would read it whole)"
          for x in report.shards}


def _micro_rows(g: OpGraph, axes: dict[Any, int | None]) -> int:
  """The micro-batch's rows: the leading dimension of the first batch input with examples."""
  from jaxhybrid.graph.opgraph import BATCH

  for v, (k, _) in zip(g.jaxpr.invars, g.input_kinds):
    if k == BATCH and axes.get(v) is not None:
      return int(v.aval.shape[axes[v]])
  return 0


PARAMS = ("replicated", "split")


def split_batch(
  g: OpGraph, small: Any, devices: int, nodes: Sequence[str] | None = None, *,
  min_fraction: float = 0.0, params: str = "replicated", skip: dict[str, str] | None = None,
) -> tuple[OpGraph, BatchSplitReport]:
  """Splits nodes of `g` by rows of the micro-batch into `devices` pieces (module docstring).

  Args:
    g: a traced graph (no leaf split yet).
    small: the same loss traced at 1/`devices` of `g`'s micro-batch (a `ClosedJaxpr` or an
      `OpGraph`; `batch_split.trace_small` makes it).
    devices: the pieces per node (the model axis).
    nodes: the node names to split (each must qualify), or None: every node of at least
      `min_fraction` of the forward FLOPs that qualifies.
    params: how a split node's parameter leaves are stored. 'replicated': read whole by every
      piece (a copy on each device the pieces run on, the gradients summed over 'model');
      'split': in M slices held by M nodes `<node>/params<j>` (`_store_split`), so a spread
      node stores 1/M of its parameters, gradients and optimizer state per device and gathers
      the rest for each micro-batch (FSDP inside the node).
    skip: with `nodes=None`, nodes left whole whatever their FLOPs: name -> the reason the
      report gives.

  Returns:
    The rewritten graph and a report (a node not split and why, for `nodes=None`).

  Raises:
    ValueError: `devices` < 2, a graph with split leaves, an unknown node name, or a named node
      that cannot be split (the message says why).
  """
  if devices < 2:
    raise ValueError(f"a batch split needs >= 2 devices, got {devices}")
  if params not in PARAMS:
    raise ValueError(f"params={params!r}: use one of {list(PARAMS)}")
  if g.shards or g.batch_splits:
    raise ValueError("split the batch of the traced graph, before any other split")
  small = getattr(small, "closed_jaxpr", small)
  names = [n.name for n in g.nodes]
  if nodes is not None:
    unknown = [n for n in nodes if n not in names]
    if unknown:
      raise ValueError(f"no node named {unknown} (nodes: {names[:8]}...)")
  axes: dict[Any, int | None] = {}
  why_all = None
  try:
    axes[batch_rules.VARYING] = batch_rules.varying_consts(g.closed_jaxpr, small)
    _check_top(g.jaxpr, small.jaxpr, devices, axes)
  except batch_rules.NotRowwise as e:
    why_all = str(e)
  total = max(g.total_flops, 1.0)
  wanted = (list(nodes) if nodes is not None else
            [n.name for n in g.nodes if n.flops >= min_fraction * total])
  splits, skipped = [], []
  stored: _Slices = {}
  new_nodes: list[Node] = []
  for n in g.nodes:
    if n.name not in wanted:
      new_nodes.append(Node(id=0, name=n.name, eqns=list(n.eqns)))
      continue
    got = (skip or {}).get(n.name) if nodes is None else None
    got = got or why_all or split_node(g, small, devices, n.name, axes)
    if isinstance(got, str):
      if nodes is not None:
        raise ValueError(f"cannot split the batch of node {n.name}: {got}")
      log.info("node %s is not split by rows: %s", n.name, got)
      skipped.append((n.name, got))
      new_nodes.append(Node(id=0, name=n.name, eqns=list(n.eqns)))
      continue
    made, info = got
    if params == "split":
      holders, leaves, info = _store_split(g, made, info, devices)
      new_nodes.extend(holders)
      stored.update(leaves)
    new_nodes.extend(made)
    splits.append(info)
  if not splits:
    return g, BatchSplitReport((), tuple(skipped))
  for i, n in enumerate(new_nodes):
    n.id = i
  invars, kinds, paths, split = shard_lib.replace_params(g, stored)
  closed = shard_lib.loss_jaxpr(g, invars, g.jaxpr.outvars,
                                [e for n in new_nodes for e in n.eqns], "batch-split")
  _wire(new_nodes, closed.jaxpr, kinds)
  new = dataclasses.replace(g, nodes=new_nodes, edges=_edges(new_nodes), closed_jaxpr=closed,
                            input_kinds=kinds, param_paths=paths,
                            param_split=split if stored else g.param_split,
                            batch_splits=tuple(splits))
  return new, BatchSplitReport(tuple(splits), tuple(skipped))


# Per top-level equation, why it mixes examples (filled by _check_top; a node holding one is
# not split). Kept per call in the axes dict under this key.
_REASONS = "__reasons__"


def _check_top(big: Any, small: Any, m: int, axes: dict[Any, Any]) -> None:
  """`batch_rules.check_jaxpr`, recording each equation that mixes examples (by id, under
  `_REASONS`) instead of ending the check."""
  reasons: dict[int, str] = {}
  batch_rules.check_jaxpr(big, small, m, axes, reasons)
  axes[_REASONS] = reasons


def apply(g: OpGraph, small: Any, devices: int, splits: Sequence[NodeSplit | dict]) -> OpGraph:
  """The graph a plan with these node splits (`NodeSplit`s or their JSON, as `Plan.batch_splits`
  holds them) was made for.

  Raises:
    ValueError: a node this model does not split the same way (re-plan)."""
  if not splits:
    return g
  splits = [s if isinstance(s, NodeSplit) else NodeSplit.from_json(s) for s in splits]
  params = "split" if any(s.split_params for s in splits) else "replicated"
  got, _ = split_batch(g, small, devices, [s.node for s in splits], params=params)
  want = [(s.node, tuple(s.bounds), tuple(s.split_params)) for s in splits]
  have = [(s.node, tuple(s.bounds), tuple(s.split_params)) for s in got.batch_splits]
  if sorted(want) != sorted(have):
    raise ValueError(f"the plan splits the rows of {want} but this model splits {have} on "
                     f"{devices} devices: re-plan")
  return got


def mixing(g: OpGraph, small: Any, devices: int) -> dict[str, list[str]]:
  """Per node of `g`, the equations that mix examples (the reasons; empty: none), which a batch
  split leaves to the post node: why a node splits only in part, or not at all."""
  axes: dict[Any, Any] = {batch_rules.VARYING: batch_rules.varying_consts(
    g.closed_jaxpr, getattr(small, "closed_jaxpr", small))}
  _check_top(g.jaxpr, getattr(small, "closed_jaxpr", small).jaxpr, devices, axes)
  reasons = axes[_REASONS]
  return {n.name: [reasons[id(e)] for e in n.eqns if id(e) in reasons] for n in g.nodes}


def trace_small(fn: Any, params: Any, state: Any, batch: Any, per_example: Sequence[bool],
                devices: int) -> Any:
  """The loss `fn(params, state, batch)` traced with every per-example batch leaf cut to
  1/`devices` of its rows (the `small` of `split_batch`).

  Raises:
    ValueError: a per-example leaf whose rows `devices` does not divide.
  """
  leaves, treedef = jax.tree.flatten(batch)
  cut = []
  for x, pe in zip(leaves, per_example):
    shape = tuple(jax.numpy.shape(x))
    if pe:
      if shape[0] % devices:
        raise ValueError(f"a micro-batch of {shape[0]} rows does not split over {devices} "
                         "devices: use a micro-batch size divisible by the model axis")
      shape = (shape[0] // devices,) + shape[1:]
    cut.append(jax.ShapeDtypeStruct(shape, x.dtype))
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype), t)
  closed = jax.make_jaxpr(fn)(abstract(params), abstract(state), jax.tree.unflatten(treedef, cut))
  return closed
