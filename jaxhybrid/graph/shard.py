"""Shard options: a large parameter leaf split into one piece per model-axis device.

A node is placed whole on one device, so its largest parameter caps memory and leaves the other
devices idle while it runs (paper BigLSTM: two 3.2 GB vocabulary tables, one node each). A *shard
rewrite* turns such a leaf into M pieces along one axis and the node that reads it into

- a *pre* node: the node's equations the leaf's readers depend on (absent when they read only
  graph inputs or other nodes' outputs);
- M *shard* nodes: shard d runs every reader of the leaf on piece d alone and yields a partial
  result;
- the *post* node (the node's name): combines the partials into the readers' outputs and runs the
  rest of the node.

The rewritten graph is an ordinary op graph: the planner places each shard node like any other
node, so ONE placement problem chooses between keeping a leaf whole (every shard on one device)
and sharding it (shards on different devices: each device stores and updates 1/M of the leaf and
runs 1/M of its readers' work; the partials travel to the post node as activations do). The
program, memory model and price need nothing new.

Rules (`RULES`), decided per reader equation from the jaxpr:

- ``lookup``: a `gather` of rows of the leaf (an embedding lookup, `jnp.take(table, ids, axis=0)`,
  the rows a sampled softmax reads). A leaf only looked up, by whole rows, is split along its
  axis 1 (the row's features): piece d holds features [lo_d, hi_d) of every row, shard d gathers
  them for every id and the post node concatenates the M slices, exactly. Each partial is 1/M of
  the lookup's output, so spreading the pieces moves the output once: paper BigLSTM's sampled
  softmax reads 8,512 rows of 1,024 floats per micro-batch, 33 MB that the row split below sent
  M times. A leaf also read by a `column` reader is split along its rows (axis 0): piece d holds
  rows [lo_d, hi_d); shard d gathers the ids in its range (others masked to zero) and the post
  node sums the M partials, exactly (one term is the row, the others are zeros). The gradient of
  a piece is the scatter-add of its own rows (or row slices).
- ``column``: a `dot_general` with the leaf as one operand, split along one of its free
  (non-contracting, non-batch) dimensions (a dense layer's output units, a vocabulary
  projection's words), or an ungrouped convolution with the leaf as its kernel, split along the
  kernel's output features. Shard d computes its slice of the output; the post node
  concatenates.

All readers of a leaf must sit in one node and agree on the split axis (a table both looked up
and used as the output projection, split along the vocabulary, qualifies). A leaf read any other
way is not offered (`ShardReport.skipped` says why).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax import lax

from jaxhybrid.graph import shard_rules as rules_lib
from jaxhybrid.graph.eqn_costs import aval_bytes
from jaxhybrid.graph.opgraph import PARAM, Node, OpGraph, _edges, _wire

log = logging.getLogger(__name__)

RULES = ("lookup", "column")
# Assumption (named here): a leaf is offered for sharding when it holds at least this fraction of
# the model's parameter bytes. Smaller leaves leave little memory to balance, and every offered
# leaf adds M + 1 nodes to the placement problem. Paper BigLSTM's two tables are 46 % each; GNMT's
# embeddings and softmax 11-16 %; no Inception-V3 leaf reaches it.
SHARD_MIN_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class LeafShard:
  """One user parameter leaf split into pieces along `axis` at `bounds` (M + 1 offsets)."""

  leaf: int  # index among the user's flat parameter leaves
  path: str
  rule: str  # 'lookup', 'column' or 'lookup+column'
  axis: int
  bounds: tuple[int, ...]
  node: str  # the node whose readers were rewritten
  shard_nodes: tuple[str, ...] = ()  # the M nodes that read the pieces, piece order

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {"bounds": list(self.bounds),
                                       "shard_nodes": list(self.shard_nodes)}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> LeafShard:
    return cls(leaf=int(d["leaf"]), path=str(d["path"]), rule=str(d["rule"]), axis=int(d["axis"]),
               bounds=tuple(int(b) for b in d["bounds"]), node=str(d["node"]),
               shard_nodes=tuple(str(n) for n in d.get("shard_nodes", ())))


@dataclasses.dataclass(frozen=True)
class ShardReport:
  """What a rewrite did: the leaves split and, per leaf not split, why."""

  shards: tuple[LeafShard, ...]
  skipped: tuple[tuple[str, str], ...]  # (leaf path, reason)


def _rewrite_leaf(g: OpGraph, leaf_var: Any, devices: int, rules: Sequence[str], path: str,
                  want_axis: int | None = None) -> tuple[OpGraph, LeafShard] | str:
  """The graph with one leaf split, or the reason it cannot be. `want_axis`: a lookup-only leaf
  split along its rows (0) rather than its features (a plan made before the feature split)."""
  owners = [n for n in g.nodes if any(v is leaf_var for e in n.eqns for v in e.invars)]
  if len(owners) != 1:
    return f"read by {len(owners)} nodes"
  node = owners[0]
  eqns, alias = rules_lib.inline(node.eqns, {leaf_var})
  readers = [i for i, e in enumerate(eqns) if any(v is leaf_var for v in e.invars)]
  kinds = []
  for i in readers:
    rule, axis, why = rules_lib.reader_axis(eqns[i], leaf_var)
    if rule is None:
      return why
    if rule not in rules:
      return f"rule {rule} not offered"
    kinds.append((rule, axis))
  axes = {a for r, a in kinds if r == "lookup"}
  if axes:
    axis = 0
    for (r, a), i in zip(kinds, readers):
      if r == "column" and 0 not in rules_lib.free_axes(eqns[i], leaf_var):
        return "looked up by rows and contracted over them"
    # Only looked up, by whole rows: split the row's features instead (each piece's partial is
    # its own 1/M of the output, not a full-size output of zeros and its rows).
    if (all(r == "lookup" for r, _ in kinds) and leaf_var.aval.ndim >= 2
        and leaf_var.aval.shape[1] >= devices
        and all(rules_lib.row_lookup_whole_rows(eqns[i], leaf_var) for i in readers)
        and want_axis != 0):
      axis = 1
  else:
    cand = None
    for i in readers:
      free = rules_lib.free_axes(eqns[i], leaf_var)
      cand = free if cand is None else cand & free
    if not cand:
      return "its readers share no free dimension"
    axis = max(cand, key=lambda j: (leaf_var.aval.shape[j], -j))
  size = leaf_var.aval.shape[axis]
  if size < devices:
    return f"dimension {axis} ({size}) is shorter than the {devices} devices"
  rule_name = "+".join(sorted({r for r, _ in kinds}))
  bounds = rules_lib.split_bounds(size, devices)
  reader_set = set(readers)

  # pre: the node's equations the readers depend on (besides the leaf).
  made = {}
  for i, e in enumerate(eqns):
    for v in e.outvars:
      made[v] = i
  pre: set[int] = set()
  stack = [v for i in readers for v in eqns[i].invars if isinstance(v, jex.core.Var)]
  while stack:
    v = stack.pop()
    i = made.get(v)
    if i is None or i in pre:
      continue
    if i in reader_set:
      return "a reader reads another reader's output"
    pre.add(i)
    stack.extend(u for u in eqns[i].invars if isinstance(u, jex.core.Var))

  pieces = []
  for d in range(devices):
    shape = list(leaf_var.aval.shape)
    shape[axis] = bounds[d + 1] - bounds[d]
    pieces.append(jex.core.Var(leaf_var.aval.update(shape=tuple(shape))))

  shard_eqns: list[list[Any]] = [[] for _ in range(devices)]
  combine: list[Any] = []
  for i in readers:
    e = eqns[i]
    partials = []
    for d in range(devices):
      lo, hi = bounds[d], bounds[d + 1]
      if e.primitive.name == "gather":
        fn = (rules_lib.lookup_columns(e, lo, hi) if axis == 1 else
              rules_lib.lookup_partial(e, lo, hi, size, first=(d == 0)))
        idx = e.invars[1]
        closed = jax.make_jaxpr(fn)(
          jax.ShapeDtypeStruct(pieces[d].aval.shape, pieces[d].aval.dtype),
          jax.ShapeDtypeStruct(idx.aval.shape, idx.aval.dtype))
        body, outs = rules_lib.splice(closed, [pieces[d], idx])
        shard_eqns[d].extend(body)
        partials.append(outs[0])
      else:
        out = e.outvars[0]
        dim = rules_lib.out_dim(e, leaf_var, axis)
        shape = list(out.aval.shape)
        shape[dim] = hi - lo
        pv = jex.core.Var(out.aval.update(shape=tuple(shape)))
        shard_eqns[d].append(e.replace(
          invars=[pieces[d] if v is leaf_var else v for v in e.invars], outvars=[pv]))
        partials.append(pv)
    out = e.outvars[0]
    avals = [jax.ShapeDtypeStruct(p.aval.shape, p.aval.dtype) for p in partials]
    if e.primitive.name == "gather" and axis == 1:
      dim = rules_lib.lookup_feature_dim(e)
      closed = jax.make_jaxpr(lambda *ps, dim=dim: lax.concatenate(list(ps), dim))(*avals)
    elif e.primitive.name == "gather":
      closed = jax.make_jaxpr(lambda *ps: rules_lib.sum_all(ps))(*avals)
    else:
      dim = rules_lib.out_dim(e, leaf_var, axis)
      closed = jax.make_jaxpr(lambda *ps, dim=dim: lax.concatenate(list(ps), dim))(*avals)
    body, _ = rules_lib.splice(closed, partials, [out])
    combine.extend(body)

  pre_eqns = [e for i, e in enumerate(eqns) if i in pre]
  post_eqns = combine + [e for i, e in enumerate(eqns) if i not in pre and i not in reader_set]
  base = f"{node.name}/shard"
  if any(n.name.startswith(base) for n in g.nodes):  # a second leaf of the same node
    keys = [k for k in path.replace('"', "'").split("'") if k.strip("[].") and k != ".value"]
    base = f"{node.name}/{keys[-1] if keys else path}.shard"
  new_nodes: list[Node] = []
  for n in g.nodes:
    if n is not node:
      new_nodes.append(Node(id=0, name=n.name, eqns=list(n.eqns)))
      continue
    if pre_eqns:
      new_nodes.append(Node(id=0, name=f"{n.name}/pre", eqns=pre_eqns))
    for d in range(devices):
      new_nodes.append(Node(id=0, name=f"{base}{d}", eqns=shard_eqns[d]))
    new_nodes.append(Node(id=0, name=n.name, eqns=post_eqns))
  if alias:  # later nodes read a jit's output that is now an inner value
    for n in new_nodes:
      n.eqns = [e.replace(invars=[alias.get(v, v) if isinstance(v, jex.core.Var) else v
                                  for v in e.invars]) for e in n.eqns]
  for i, n in enumerate(new_nodes):
    n.id = i

  invars, kinds_new, paths, split = replace_params(g, {leaf_var: (axis, bounds, pieces)})
  outvars = [alias.get(v, v) if isinstance(v, jex.core.Var) else v for v in g.jaxpr.outvars]
  closed = loss_jaxpr(g, invars, outvars, [e for n in new_nodes for e in n.eqns], "sharded")
  _wire(new_nodes, closed.jaxpr, tuple(kinds_new))
  j = [v for v, (k, _) in zip(g.jaxpr.invars, g.input_kinds) if k == PARAM].index(leaf_var)
  info = LeafShard(leaf=g.param_split[j][0] if g.param_split else j, path=path, rule=rule_name,
                   axis=axis, bounds=bounds, node=node.name, shard_nodes=tuple(f"{base}{d}" for d in range(devices)))
  new = dataclasses.replace(
    g, nodes=new_nodes, edges=_edges(new_nodes), closed_jaxpr=closed, input_kinds=tuple(kinds_new),
    param_paths=paths, param_split=split, shards=g.shards + (info,),
  )
  return new, info


def replace_params(g: OpGraph, splits: dict[Any, tuple[int, Sequence[int], Sequence[Any]]]
                   ) -> tuple[list[Any], tuple, tuple[str, ...], tuple]:
  """`g`'s loss inputs with each parameter leaf of `splits` (var -> (axis, bounds, piece vars))
  replaced by its pieces: the invars, input kinds, parameter paths and `param_split`."""
  old = list(g.param_split) if g.param_split else [
    (i, -1, 0, 0) for i in range(len(g.param_avals))]
  invars, kinds, paths, split = [], [], [], []
  q = 0  # the leaf's index among g's parameter leaves
  for v, (k, idx) in zip(g.jaxpr.invars, g.input_kinds):
    if k != PARAM:
      invars.append(v)
      kinds.append((k, idx))
      continue
    if v in splits:
      axis, bounds, pieces = splits[v]
      if old[q][1] >= 0:
        raise ValueError(f"parameter {g.param_paths[q]} is already a piece of a split leaf")
      for d, pv in enumerate(pieces):
        invars.append(pv)
        kinds.append((PARAM, len(split)))
        split.append((old[q][0], axis, bounds[d], bounds[d + 1]))
        paths.append(f"{g.param_paths[q]}[{bounds[d]}:{bounds[d + 1]}]")
    else:
      invars.append(v)
      kinds.append((PARAM, len(split)))
      split.append(old[q])
      paths.append(g.param_paths[q])
    q += 1
  return invars, tuple(kinds), tuple(paths), tuple(split)


def loss_jaxpr(g: OpGraph, invars: Sequence[Any], outvars: Sequence[Any], eqns: Sequence[Any],
               what: str) -> Any:
  """The rewritten loss: `g`'s constants with new inputs, outputs and equations (checked)."""
  debug = jex.core.DebugInfo(
    f"jaxhybrid {what} loss", "loss", tuple(f"in{i}" for i in range(len(invars))),
    tuple(f"out{i}" for i in range(len(outvars))),
  )
  jaxpr = jex.core.Jaxpr(
    constvars=list(g.jaxpr.constvars), invars=list(invars), outvars=list(outvars),
    eqns=list(eqns), effects=g.jaxpr.effects, debug_info=debug,
  )
  jex.core.check_jaxpr(jaxpr)
  return jex.core.ClosedJaxpr(jaxpr, list(g.closed_jaxpr.consts))


def shard_leaves(
  g: OpGraph,
  devices: int,
  *,
  rules: Sequence[str] = RULES,
  min_fraction: float = SHARD_MIN_FRACTION,
  leaves: Sequence[str] | None = None,
  axes: Sequence[int] | None = None,
) -> tuple[OpGraph, ShardReport]:
  """Offers shard options: every parameter leaf of at least `min_fraction` of the parameter
  bytes (or exactly the leaves whose paths are in `leaves`) that a rule applies to is split into
  `devices` pieces (module docstring). Returns the rewritten graph and a report; with
  `devices` < 2, no rule, or no leaf that qualifies, the graph is returned unchanged.

  `axes` (with `leaves`): the axis a plan split each of those leaves along; a lookup-only leaf
  given 0 keeps the row split plans saved before the feature split used.

  Raises:
    ValueError: an unknown rule, a bad fraction, or a leaf named in `leaves` that cannot be split.
  """
  unknown = [r for r in rules if r not in RULES]
  if unknown:
    raise ValueError(f"unknown shard rule(s) {unknown}: use any of {list(RULES)}")
  if not 0.0 <= min_fraction <= 1.0:
    raise ValueError(f"shard_min_fraction={min_fraction}: use a fraction in [0, 1]")
  if g.shards:
    raise ValueError("the graph is already sharded: offer shard options once, on the traced graph")
  if devices < 2 or not rules:
    return g, ShardReport((), ())
  param_vars = [v for v, (k, _) in zip(g.jaxpr.invars, g.input_kinds) if k == PARAM]
  total = max(sum(aval_bytes(v.aval) for v in param_vars), 1)
  if leaves is not None:
    want = list(leaves)
    missing = [p for p in want if p not in g.param_paths]
    if missing:
      raise ValueError(f"cannot shard {missing}: no such parameter leaf (leaves: "
                       f"{list(g.param_paths)[:8]}...)")
    order = [g.param_paths.index(p) for p in want]
  else:
    order = sorted(
      (i for i, v in enumerate(param_vars) if aval_bytes(v.aval) >= min_fraction * total),
      key=lambda i: -aval_bytes(param_vars[i].aval))
  shards, skipped = [], []
  paths = list(g.param_paths)
  for i in order:
    v, path = param_vars[i], paths[i]
    want = None
    if axes is not None and leaves is not None:
      want = int(axes[list(leaves).index(path)])
    got = _rewrite_leaf(g, v, devices, rules, path, want)
    if isinstance(got, str):
      if leaves is not None:
        raise ValueError(f"cannot shard parameter {path}: {got}")
      log.info("leaf %s is not offered for sharding: %s", path, got)
      skipped.append((path, got))
      continue
    g, info = got
    shards.append(info)
  return g, ShardReport(tuple(shards), tuple(skipped))


def apply(g: OpGraph, devices: int, shards: Sequence[LeafShard | dict]) -> OpGraph:
  """The graph a plan with these shards (`LeafShard`s or their JSON, as `Plan.shards` holds them)
  was made for: the same leaves split the same way."""
  if not shards:
    return g
  shards = [s if isinstance(s, LeafShard) else LeafShard.from_json(s) for s in shards]
  got, _ = shard_leaves(g, devices, leaves=[s.path for s in shards], axes=[s.axis for s in shards])
  want = [(s.path, s.axis, tuple(s.bounds)) for s in shards]
  have = [(s.path, s.axis, tuple(s.bounds)) for s in got.shards]
  if want != have:
    raise ValueError(
      f"the plan splits {want} but this model splits {have} on {devices} devices: re-plan")
  return got


def split_leaves(g: OpGraph, leaves: Sequence[Any]) -> list[Any]:
  """The graph's parameter leaves from the user's (pieces cut out of split leaves)."""
  if not g.param_split:
    return list(leaves)
  out = []
  for user, axis, lo, hi in g.param_split:
    x = leaves[user]
    if axis < 0:
      out.append(x)
    else:
      sl = [slice(None)] * np.ndim(x)
      sl[axis] = slice(lo, hi)
      out.append(x[tuple(sl)])
  return out


def join_leaves(g: OpGraph, leaves: Sequence[Any]) -> list[Any]:
  """The user's parameter leaves from the graph's (pieces concatenated back)."""
  if not g.param_split:
    return list(leaves)
  n_user = 1 + max(u for u, *_ in g.param_split)
  parts: list[list[tuple[int, Any]]] = [[] for _ in range(n_user)]
  axes = [-1] * n_user
  for (user, axis, lo, _), x in zip(g.param_split, leaves):
    parts[user].append((lo, x))
    axes[user] = axis
  out = []
  for user in range(n_user):
    if axes[user] < 0:
      out.append(parts[user][0][1])
    else:
      xs = [x for _, x in sorted(parts[user], key=lambda t: t[0])]
      out.append(np.concatenate([np.asarray(x) for x in xs], axis=axes[user]))
  return out


def sharded_bytes(g: OpGraph) -> int:
  """Bytes of the parameter leaves that were split."""
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize
             for a, (_, axis, _, _) in zip(g.param_avals, g.param_split or ()) if axis >= 0)
