"""Coarsening: top-level jaxpr equations grouped into the nodes of the op graph.

Every top-level equation carries a module path (linen's name stack; for NNX the scopes that
`flax_adapters.nnx_name_scopes` opens). A *cut* of the tree of module paths decides the units:
the set `split` holds the scopes that are expanded into their children (the root always is).
An equation belongs to the first prefix of its path that is not split (its *unit*); an equation
whose whole path is split sits directly in a split scope between module calls: it is *glue*
(an activation between two layers, the concat after two towers, the loss after the model).

A *run* is a maximal contiguous sequence (in trace order) of equations of the same unit, or one
glue equation (neighbouring glue equations may be unrelated: the sum of one tower's output and
the input of the next). Runs of units stay apart; glue runs then join a neighbour only where
that adds no dependency the model does not have:

1. a glue run whose inputs come from one group only (besides the loss's inputs and glue computed
   from them alone) joins that group, its producer (an activation after a layer joins the
   layer; the loss joins the head);
2. otherwise, a glue run whose outputs all go to one group joins that consumer (a concat of two
   towers joins the head that reads it);
3. otherwise it stays a small node of its own (a concat read by several branches).

Both joins keep the group graph acyclic: a cycle through the merged group would have been a
cycle before. So two module calls that do not read each other's outputs stay independent,
whatever glue the user wrote between them.

How fine the cut is: with `depth`, every scope shorter than `depth` components is split (a
uniform cut). Without it, the cut is refined from the top towards a target node count
(`max_nodes`): the costliest unit (forward FLOPs) that has sub-scopes is split, as long as the
node count stays within the target. So a list of layers (`nnx.List`, linen `nn.Sequential`,
children `layers_0..7`) becomes one node per layer whenever the target allows it.

A unit that is called several times in a row, each call reading the previous one (a loop over a
list of layers that the cut keeps whole), stays one node. Finally, adjacent nodes (in
topological order, which keeps the graph acyclic) are merged until at
most `max_nodes` remain.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import jax.extend as jex

from jaxhybrid.graph.eqn_costs import eqn_cost

ROOT = "<root>"  # name of glue outside any module scope (e.g. the loss reduction)

# Default target node count: Inception-V3's 11 mixed blocks cut into their branches plus the
# stem give 40-50 nodes, which the MILP places in seconds at k = 1; beyond ~64 nodes the
# pipelined (k > 1) searches slow down noticeably.
DEFAULT_MAX_NODES = 48

Path = tuple[str, ...]


def _unit_of(path: Path, split: set[Path]) -> tuple[bool, Path]:
  """(is_glue, key): the unit an equation at `path` belongs to, or the split scope it glues."""
  for i in range(1, len(path) + 1):
    if path[:i] not in split:
      return False, path[:i]
  return True, path


def _key_name(key: Path) -> str:
  return "/".join(key) or ROOT


class _Groups:
  """Runs of equations and the groups (future nodes) they are merged into."""

  def __init__(self, eqns: Sequence[Any], paths: Sequence[Path], split: set[Path]):
    self.runs: list[list[int]] = []  # equation indices per run
    self.keys: list[tuple[bool, Path]] = []
    for i, p in enumerate(paths):
      k = _unit_of(p, split)
      if self.keys and self.keys[-1] == k and not k[0]:
        self.runs[-1].append(i)
      else:
        self.runs.append([i])
        self.keys.append(k)
    producer: dict[Any, int] = {}
    for r, idx in enumerate(self.runs):
      for i in idx:
        for v in eqns[i].outvars:
          producer[v] = r
    self.reads: list[set[int]] = []  # runs each run reads from
    self.readers: list[set[int]] = [set() for _ in self.runs]
    for r, idx in enumerate(self.runs):
      src = set()
      for i in idx:
        for v in eqns[i].invars:
          if not isinstance(v, jex.core.Literal) and producer.get(v, r) != r:
            src.add(producer[v])
      self.reads.append(src)
      for s in src:
        self.readers[s].add(r)
    self.group = list(range(len(self.runs)))  # run -> representative run of its group
    self.members: dict[int, list[int]] = {r: [r] for r in range(len(self.runs))}

  def find(self, r: int) -> int:
    while self.group[r] != r:
      r = self.group[r]
    return r

  def join(self, a: int, into: int) -> None:
    a, into = self.find(a), self.find(into)
    if a == into:
      return
    self.group[a] = into
    self.members[into] += self.members.pop(a)

  def _neighbours(self, rep: int, table: list[set[int]]) -> set[int]:
    out = set()
    for r in self.members[rep]:
      out |= {self.find(s) for s in table[r]}
    out.discard(rep)
    return out

  def resolve_glue(self, has_output: Sequence[bool]) -> None:
    """Joins glue runs to their single producer group, else to their single consumer group."""
    glue = [r for r, (g, _) in enumerate(self.keys) if g]
    # Glue computed from the loss's inputs alone (e.g. label indices) goes with its consumer and
    # does not count as a producer of the glue that reads it.
    free: set[int] = set()
    for r in glue:
      if all(s in free for s in self.reads[r]):
        free.add(r)
    for r in glue:  # in trace order: a chain of glue follows its producer
      if r in free:
        continue
      rep = self.find(r)
      src = self._neighbours(rep, self.reads)
      src = {g for g in src if not all(m in free for m in self.members[g])}
      if len(src) == 1:
        self.join(rep, src.pop())
    for r in reversed(glue):  # in reverse: a chain of glue follows its consumer
      rep = self.find(r)
      if any(not self.keys[m][0] for m in self.members[rep]):
        continue  # already part of a module's node
      if any(has_output[m] for m in self.members[rep]):
        continue  # computes the loss itself
      dst = self._neighbours(rep, self.readers)
      if len(dst) == 1:
        self.join(rep, dst.pop())

  def ordered(self) -> list[list[int]]:
    """Groups in a topological order (earliest first equation first), as sorted run lists."""
    reps = sorted(self.members, key=lambda g: min(self.members[g]))
    preds = {g: self._neighbours(g, self.reads) for g in reps}
    succs: dict[int, set[int]] = {g: set() for g in reps}
    for g, ps in preds.items():
      for p in ps:
        succs[p].add(g)
    indeg = {g: len(preds[g]) for g in reps}
    ready = [(min(self.members[g]), g) for g in reps if indeg[g] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
      _, g = heapq.heappop(ready)
      order.append(g)
      for s in succs[g]:
        indeg[s] -= 1
        if indeg[s] == 0:
          heapq.heappush(ready, (min(self.members[s]), s))
    if len(order) != len(reps):
      raise RuntimeError("internal: coarsening produced a cyclic node graph")
    return [sorted(self.members[g]) for g in order]

  def name(self, runs: Sequence[int]) -> str:
    for r in runs:
      if not self.keys[r][0]:
        return _key_name(self.keys[r][1])
    return _key_name(self.keys[runs[0]][1])


def _groups(eqns, paths, split, has_output_eqn) -> tuple[_Groups, list[list[int]]]:
  gr = _Groups(eqns, paths, split)
  has_output = [any(has_output_eqn[i] for i in idx) for idx in gr.runs]
  gr.resolve_glue(has_output)
  return gr, gr.ordered()


def _flops(eqn: Any) -> float:
  return eqn_cost(eqn).flops


def _refine(eqns, paths, max_nodes: int, has_output_eqn) -> set[Path]:
  """The split set reached by splitting the costliest unit while the node count fits."""
  split: set[Path] = {()}
  flops = [_flops(e) for e in eqns]
  blocked: set[Path] = set()
  while True:
    under: dict[Path, float] = {}  # cost of each current unit that has sub-scopes
    for p, f in zip(paths, flops):
      glue, key = _unit_of(p, split)
      if not glue and len(p) > len(key) and key not in blocked:
        under[key] = under.get(key, 0.0) + f
    if not under:
      return split
    for key in sorted(under, key=lambda k: (len(k), -under[k], k)):
      trial = split | {key}
      if len(_groups(eqns, paths, trial, has_output_eqn)[1]) <= max_nodes:
        split = trial
        break
      blocked.add(key)
    else:
      return split


def coarsen(
  eqns: Sequence[Any],
  paths: Sequence[Path],
  outvars: Sequence[Any],
  *,
  depth: int | None,
  max_nodes: int | None,
) -> list[tuple[str, list[Any]]]:
  """Groups top-level equations into named nodes (see the module docstring).

  Args:
    eqns: the top-level equations in trace order.
    paths: each equation's module path (name-stack components).
    outvars: the traced function's outputs (the loss).
    depth: uniform cut at this many path components; None refines towards `max_nodes`.
    max_nodes: target and bound of the node count; None with `depth`: no bound.

  Returns:
    (name, equations in trace order) per node, in a topological order. Names may repeat (a
    module called twice); the caller makes them unique.
  """
  out_set = {v for v in outvars if not isinstance(v, jex.core.Literal)}
  has_output_eqn = [any(v in out_set for v in e.outvars) for e in eqns]
  paths = [tuple(p) for p in paths]
  if depth is not None:
    # Split every scope shorter than `depth` that has equations in a sub-scope.
    split = {p[:i] for p in paths for i in range(min(len(p) - 1, depth - 1) + 1)}
    split.add(())
  else:
    split = _refine(eqns, paths, max_nodes or DEFAULT_MAX_NODES, has_output_eqn)
  gr, order = _groups(eqns, paths, split, has_output_eqn)
  # A node's equations replay in trace order (a subsequence of a topological order).
  nodes = [
    (gr.name(runs), [eqns[i] for i in sorted(i for r in runs for i in gr.runs[r])])
    for runs in order
  ]
  nodes = _merge_repeats(nodes)
  if max_nodes is not None and max_nodes >= 1:
    nodes = merge_adjacent(nodes, max_nodes)
  return nodes


def _reads(later: Sequence[Any], earlier: Sequence[Any]) -> bool:
  made = {v for e in earlier for v in e.outvars}
  return any(
    not isinstance(v, jex.core.Literal) and v in made for e in later for v in e.invars
  )


def _merge_repeats(nodes: list[tuple[str, list[Any]]]) -> list[tuple[str, list[Any]]]:
  """Merges a node into its predecessor in the order when both have the same unit and it reads
  it: one module called in a loop with glue between the calls (`for l in layers: x = f(l(x))`
  at a cut above `layers`) stays one node, as its unit says."""
  out: list[tuple[str, list[Any]]] = []
  for name, eqns in nodes:
    if out and out[-1][0] == name and _reads(eqns, out[-1][1]):
      out[-1] = (name, out[-1][1] + eqns)
    else:
      out.append((name, eqns))
  return out


def merge_adjacent(
  nodes: list[tuple[str, list[Any]]], max_nodes: int
) -> list[tuple[str, list[Any]]]:
  """Merges nodes adjacent in topological order until at most `max_nodes` remain.

  Merging two neighbours of a topological order keeps the graph acyclic. Pairs where the later
  node reads the earlier one's output are merged first (that loses no parallelism), cheapest
  pair first; then the cheapest adjacent pair of any kind.
  """
  nodes = [(k, list(e)) for k, e in nodes]
  ends = [(k, k) for k, _ in nodes]  # (first, last) original name of each merged node
  cost = [sum(_flops(e) for e in eqns) + 1.0 for _, eqns in nodes]
  made = [{v for e in eqns for v in e.outvars} for _, eqns in nodes]

  def reads(i: int) -> bool:  # does node i + 1 read node i?
    return any(
      not isinstance(v, jex.core.Literal) and v in made[i] for e in nodes[i + 1][1]
      for v in e.invars
    )

  while len(nodes) > max_nodes:
    best = min(
      range(len(nodes) - 1), key=lambda i: (0 if reads(i) else 1, cost[i] + cost[i + 1], i)
    )
    first, last = ends[best][0], ends[best + 1][1]
    name = first if first == last else _common_prefix(first, last)
    eqns = nodes[best][1] + nodes[best + 1][1]
    nodes[best : best + 2] = [(name, eqns)]
    ends[best : best + 2] = [(first, last)]
    cost[best : best + 2] = [cost[best] + cost[best + 1]]
    made[best : best + 2] = [made[best] | made[best + 1]]
  return nodes


def _common_prefix(a: str, b: str) -> str:
  pa, pb = a.split("/"), b.split("/")
  common = []
  for x, y in zip(pa, pb):
    if x != y:
      break
    common.append(x)
  rest_a = pa[len(common)] if len(pa) > len(common) else ""
  rest_b = pb[len(common)] if len(pb) > len(common) else ""
  return "/".join(common) + ("/" if common else "") + f"{{{rest_a}..{rest_b}}}"
