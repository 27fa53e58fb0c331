"""How each node of the graph is replayed as tasks: its function, its `jax.vjp` pullback split
into what F saves (residuals) and what B gets back another way (arguments, outputs, broadcast
constants), and each task's compiled temporaries (for the memory model).

Used by the executor (`executor.run_groups`) and by `memory.report`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxhybrid import graph as graph_lib
from jaxhybrid.graph import convs
from jaxhybrid.graph.remat import remat_policy
from jaxhybrid.planner.core import dtypes
from jaxhybrid.program import lookups as lookups_lib
from jaxhybrid.program import tasks as tasks_lib


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def split_pullback(
  pullback: Any, args: Sequence[Any], outs: Sequence[Any] = ()
) -> tuple[Any, list, list]:
  """A pullback's leaves classified: (treedef, kinds, packed residuals).

  kinds[j] is ('arg', i) when leaf j IS argument i (re-read in the backward, never packed: for
  parameters this is what keeps the weights out of every micro-batch's residuals), ('out', i)
  when it IS the node's output i (`jnp.tanh`'s derivative keeps its output: the backward reads
  the activation instead of a second copy), ('res', r) for a new array (packed), or
  ('const', value) for a concrete constant.
  """
  leaves, treedef = jax.tree.flatten(pullback)
  kinds, packed = [], []
  for leaf in leaves:
    idx = next((i for i, a in enumerate(args) if leaf is a), None)
    out = next((i for i, o in enumerate(outs) if leaf is o), None)
    if idx is not None:
      kinds.append(("arg", idx))
    elif out is not None:
      kinds.append(("out", out))
    elif _is_tracer(leaf):
      kinds.append(("res", len(packed)))
      packed.append(leaf)
    else:
      kinds.append(("const", leaf))
  return treedef, kinds, packed


def _constant_fills(jaxpr: Any) -> dict[int, tuple[Any, tuple[int, ...], str]]:
  """Outputs of `jaxpr` that are a broadcast of a literal: position -> (value, shape, dtype).

  `jax.nn.relu`'s derivative keeps `broadcast_in_dim 0.0` as large as the activation among the
  pullback's arrays; the backward makes it again (`jnp.full`) instead of saving it. Only this
  form is recognised: an input-free value computed inside a loop (a scan's stacked constant)
  would cost the loop again.
  """
  made = {}
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "broadcast_in_dim" and len(eqn.invars) == 1
        and isinstance(eqn.invars[0], jex.core.Literal)):
      made[eqn.outvars[0]] = eqn.invars[0].val
  out = {}
  for j, v in enumerate(jaxpr.outvars):
    if isinstance(v, jex.core.Var) and v in made:
      out[j] = (np.asarray(made[v]).item(), tuple(v.aval.shape), np.dtype(v.aval.dtype).name)
  return out


def pullback_leaves(
  res: tasks_lib.Residuals, args: Sequence[Any], saved: Callable[[int], Any],
  out: Callable[[int], Any],
) -> list[Any]:
  """The pullback's leaves for a backward task: arguments, the node's outputs (`out(i)`), saved
  residuals (`saved(r)`), broadcast constants made again, constants (in `res.kinds` order)."""
  leaves = []
  for kind, i in res.kinds:
    if kind == "arg":
      leaves.append(args[i])
    elif kind == "out":
      leaves.append(out(i))
    elif kind == "res":
      leaves.append(saved(i))
    elif kind == "fresh":
      value, shape, dtype = res.fills[i]
      leaves.append(jnp.full(shape, value, dtype))
    else:
      leaves.append(res.consts[len(leaves)])
  return leaves


# Residual shapes per graph, shared by every NodeCalls of that graph: they depend on the node, its
# input shapes, branch_remat and the conv layout only, not on the placement or schedule, and an
# abstract `jax.vjp` probe costs ~0.1 s per node (the advisor prices 13 Inception-V3 plans of one
# graph: 68 of its 94 s were repeated probes). Entries go with the graph.
_RESIDUALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class NodeCalls:
  """How each node is replayed, differentiated and probed for its residuals."""

  graph: graph_lib.OpGraph
  canonical_convs: bool
  branch_remat: str  # 'none' | 'dots' | 'full'
  remat: frozenset[int]  # nodes whose F saves nothing
  # Parameter tables read only by row lookups get their gradients as rows (`lookups`).
  sparse_lookups: bool = True
  _fns: dict[int, Callable] = dataclasses.field(default_factory=dict)
  _lookups: dict[int, tuple[lookups_lib.Lookup, ...]] = dataclasses.field(default_factory=dict)
  _res: dict[int, tasks_lib.Residuals] = dataclasses.field(default_factory=dict)
  treedefs: dict[int, Any] = dataclasses.field(default_factory=dict)

  def lookups(self, nid: int) -> tuple[lookups_lib.Lookup, ...]:
    """The node's parameter-table row lookups replayed with row gradients (`lookups`): its
    function then takes one proxy per lookup after its inputs and returns the lookups' index
    arrays after its outputs."""
    if nid not in self._lookups:
      found: tuple[lookups_lib.Lookup, ...] = ()
      node = self.graph.nodes[nid]
      closed = self.graph.node_jaxpr(node)
      if self.sparse_lookups and not (self.canonical_convs and convs.has_convs(closed.jaxpr)):
        kinds = dict(zip(self.graph.jaxpr.invars, self.graph.input_kinds))
        params = [i for i, v in enumerate(node.invars)
                  if v in kinds and kinds[v][0] == graph_lib.PARAM]
        found = lookups_lib.find(closed, params)
      self._lookups[nid] = found
    return self._lookups[nid]

  def full_args(self, nid: int, args: Sequence[Any]) -> list[Any]:
    """The node's arguments followed by its lookups' zero proxies (what `fn(nid)` takes)."""
    return list(args) + lookups_lib.proxies(self.lookups(nid))

  def split_outs(self, nid: int, outs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """`fn(nid)`'s results -> (the node's outputs, its lookups' index arrays)."""
    n = len(self.graph.nodes[nid].outvars)
    return list(outs[:n]), list(outs[n:])

  def full_cts(self, nid: int, cts: Sequence[Any]) -> list[Any]:
    """Output cotangents for `fn(nid)`'s pullback: the node's, then none for the indices."""
    return list(cts) + [np.zeros(lk.ids_shape, jax.dtypes.float0) for lk in self.lookups(nid)]

  def fn(self, nid: int) -> Callable:
    if nid not in self._fns:
      closed = self.graph.node_jaxpr(self.graph.nodes[nid])
      use = self.canonical_convs and convs.has_convs(closed.jaxpr)
      found = self.lookups(nid)
      if found:
        f = lookups_lib.rows_fn(closed, found)
      else:
        f = convs.jaxpr_fn(closed) if use else jex.core.jaxpr_as_fun(closed)
      policy = remat_policy(self.branch_remat) if self.branch_remat == "dots" else None
      self._fns[nid] = jax.checkpoint(f, policy=policy) if policy is not None else f
    return self._fns[nid]

  def residuals(self, nid: int, consts: dict[Any, Any]) -> tasks_lib.Residuals:
    """What F(nid) saves, from an abstract trace of its `jax.vjp` (nothing is computed)."""
    if nid in self._res:
      return self._res[nid]
    shared = _RESIDUALS.setdefault(self.graph, {})
    key = (nid, self.branch_remat, self.canonical_convs)
    if key in shared:
      self._res[nid] = shared[key]
      return shared[key]
    node = self.graph.nodes[nid]
    info: dict[str, Any] = {}

    def probe(*free):
      it = iter(free)
      args = self.full_args(nid, [consts[v] if v in consts else next(it) for v in node.invars])
      outs, pb = jax.vjp(self.fn(nid), *args)
      outs, ids = self.split_outs(nid, outs)
      _, kinds, packed = split_pullback(pb, args, outs)
      info["kinds"] = kinds
      info["n_packed"] = len(packed)
      return packed + ids

    free = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in node.invars if v not in consts]
    closed = jax.make_jaxpr(probe)(*free)
    const = _constant_fills(closed.jaxpr)
    kinds, avals, stored, fills = [], [], {}, []
    for k, i in info["kinds"]:
      if k == "res" and i in const:  # a broadcast constant: made again in B, not saved
        kinds.append(("fresh", len(fills)))
        fills.append(const[i])
      elif k == "res":
        if i not in stored:
          stored[i] = len(stored)
          avals.append(closed.out_avals[i])
        kinds.append(("res", stored[i]))
      else:
        kinds.append((k, i if k != "const" else None))
    ids = []
    for j in range(len(self.lookups(nid))):  # the lookups' indices: saved after the residuals
      stored[info["n_packed"] + j] = len(stored)
      ids.append(len(avals))
      avals.append(closed.out_avals[info["n_packed"] + j])
    self._res[nid] = tasks_lib.Residuals(
      kinds=tuple(kinds),
      avals=tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in avals),
      consts=tuple(i if k == "const" else None for k, i in info["kinds"]),
      stored=tuple(stored), fills=tuple(fills), ids=tuple(ids),
    )
    shared[key] = self._res[nid]
    return self._res[nid]


# Compiled temporaries of each node's tasks (memory.report), by the node's computation (its
# fingerprint: primitives and shapes) and how it is replayed, not by graph or plan: the same
# layer traced again for another mesh or schedule is not compiled again.
_TASK_TEMP: dict[tuple, tuple[int, int]] = {}


def task_temp_bytes(calls: NodeCalls, nid: int, consts: dict[Any, Any]) -> tuple[int, int]:
  """XLA's compiled temporary bytes of node `nid`'s F task and of its B task, each compiled
  alone from abstract inputs (nothing allocated), as the program runs them: F = `jax.vjp` of
  the node returning its outputs and saved residuals; B = the pullback rebuilt from them and
  applied to the output cotangents (a rematerialised node's B runs its forward again). What a
  task needs beyond its inputs and outputs: on the CPU a convolution's backward alone can need
  several times its activation (layout copies, padding). W tasks are taken to need what B does.
  """
  node = calls.graph.nodes[nid]
  key = (calls.graph.node_fingerprint(node), tuple(v in consts for v in node.invars),
         calls.branch_remat, calls.canonical_convs, nid in calls.remat)
  shared = _TASK_TEMP
  if key in shared:
    return shared[key]
  fn = calls.fn(nid)
  free_vars = [v for v in node.invars if v not in consts]
  free = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in free_vars]

  def fill(xs):
    it = iter(xs)
    return [consts[v] if v in consts else next(it) for v in node.invars]

  def zero_cts():
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in node.outvars
            if dtypes.is_float(v.aval.dtype)]

  def cts_of(xs):
    it = iter(xs)
    return [next(it) if dtypes.is_float(v.aval.dtype)
            else np.zeros(v.aval.shape, jax.dtypes.float0) for v in node.outvars]

  def temp(f, *avals):
    return int(jax.jit(f).lower(*avals).compile().memory_analysis().temp_size_in_bytes)

  table_args = {lk.arg for lk in calls.lookups(nid)}

  def grads(in_cts):  # what the task returns: no zero table gradient for a looked-up table
    return [c for i, c in enumerate(in_cts) if i not in table_args]

  if nid in calls.remat:
    t_f = temp(lambda *xs: calls.split_outs(nid, fn(*calls.full_args(nid, fill(xs))))[0], *free)

    def b_remat(xs, cts):
      _, pb = jax.vjp(fn, *calls.full_args(nid, fill(xs)))
      return grads(pb(calls.full_cts(nid, cts_of(cts))))

    t_b = temp(b_remat, free, zero_cts())
  else:
    res = calls.residuals(nid, consts)
    info: dict[str, Any] = {}

    def f_task(*xs):
      args = calls.full_args(nid, fill(xs))
      outs, pb = jax.vjp(fn, *args)
      outs, ids = calls.split_outs(nid, outs)
      info["treedef"], _, packed = split_pullback(pb, args, outs)
      packed = packed + ids
      return outs, ([packed[j] for j in res.stored] if res.has_fresh else packed)

    t_f = temp(f_task, *free)

    def b_task(xs, saved, outs, cts):
      leaves = pullback_leaves(
        res, calls.full_args(nid, fill(xs)), saved.__getitem__, outs.__getitem__)
      pb = jax.tree.unflatten(info["treedef"], leaves)
      return grads(pb(calls.full_cts(nid, cts_of(cts))))

    saved = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res.avals]
    outs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in node.outvars]
    t_b = temp(b_task, free, saved, outs, zero_cts())
  shared[key] = (t_f, t_b)
  return shared[key]


def canonical_convs_for(mesh: Any, asked: bool | None) -> bool:
  """Whether nodes replay convolutions in the canonical layout: as asked, else on CPU meshes
  (`HybridProgram.build`'s `canonical_convs`)."""
  return mesh.devices.flat[0].platform == "cpu" if asked is None else bool(asked)


def planner_task_temp(*, canonical_convs: bool, branch_remat: str, remat: Sequence[str] = (),
                      sparse_lookups: bool = True) -> Callable[[Any, Any], tuple[int, int]]:
  """(graph, node) -> `task_temp_bytes` of the node as a program with these replay options would
  run it (`PlannerOptions.task_temp`): the planner is given them before there is a program."""
  made: dict[int, tuple[Any, NodeCalls, dict[Any, Any]]] = {}

  def temp(graph: Any, node: Any) -> tuple[int, int]:
    if id(graph) not in made:
      ids = {n.name: n.id for n in graph.nodes}
      nodes = (frozenset(range(len(graph.nodes))) if branch_remat == "full"
               else frozenset(ids[r] for r in remat if r in ids))
      calls = NodeCalls(graph=graph, canonical_convs=canonical_convs, branch_remat=branch_remat,
                        remat=nodes, sparse_lookups=sparse_lookups)
      made[id(graph)] = (graph, calls, dict(zip(graph.jaxpr.constvars, graph.closed_jaxpr.consts)))
    _, calls, consts = made[id(graph)]
    return task_temp_bytes(calls, node.id, consts)

  return temp
