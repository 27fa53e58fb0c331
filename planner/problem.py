"""The planner's own view of a placement problem: numbers only, no graph library.

A `Problem` is what the MILP and the heuristics read: per-node compute time p_i and memory, edges
with their transfer time for every (source device, destination device) pair, and M. Tests build
problems by hand with `Problem.build`; `Problem.from_graph` reads a traced OpGraph and a cost model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Sequence

from jaxhybrid.planner.options import PlannerOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """A DAG to place on M devices (PAPER.md, "DLPlacer").

  Nodes are numbered in a topological order (every edge has src < dst).
  """

  # Module path of each node.
  names: tuple[str, ...]
  # p_i: forward + backward seconds of one micro-batch of node i on one device.
  compute_s: tuple[float, ...]
  # Bytes a node holds whatever the micro-batch count (parameters, gradients, optimizer state).
  static_bytes: tuple[int, ...]
  # Bytes a node keeps per micro-batch in flight (saved activations).
  activation_bytes: tuple[int, ...]
  # Edges (src, dst) with src < dst, at most one per pair.
  edges: tuple[tuple[int, int], ...]
  # Bytes each edge carries per micro-batch (for reports).
  edge_bytes: tuple[int, ...]
  # transfer_s[e][a][b]: delay of edge e per micro-batch when src is on device a and dst on b,
  # both directions of training included; 0 on the diagonal.
  transfer_s: tuple[tuple[tuple[float, ...], ...], ...]
  # M: devices on the model axis.
  devices: int
  # Provenance carried into the Plan.
  fingerprint: str = ""
  cost_source: str = "manual"
  hardware: str = ""

  def __post_init__(self):
    n = len(self.names)
    for field in ("compute_s", "static_bytes", "activation_bytes"):
      if len(getattr(self, field)) != n:
        raise ValueError(f"Problem.{field} has {len(getattr(self, field))} entries for {n} nodes.")
    if len(self.edge_bytes) != len(self.edges) or len(self.transfer_s) != len(self.edges):
      raise ValueError("Problem.edge_bytes and Problem.transfer_s need one entry per edge.")
    seen = set()
    for s, d in self.edges:
      if not 0 <= s < d < n:
        raise ValueError(f"Edge ({s}, {d}) is not forward in the topological order of {n} nodes.")
      if (s, d) in seen:
        raise ValueError(f"Edge ({s}, {d}) appears twice; merge it into one edge.")
      seen.add((s, d))
    for e, m in enumerate(self.transfer_s):
      if len(m) != self.devices or any(len(r) != self.devices for r in m):
        raise ValueError(f"transfer_s[{e}] must be {self.devices}x{self.devices}.")
    if any(p < 0 for p in self.compute_s):
      raise ValueError("compute_s holds a negative time.")

  @property
  def num_nodes(self) -> int:
    return len(self.names)

  def memory_bytes(self, microbatches: int) -> tuple[float, ...]:
    """m_i: bytes node i needs on its device with `microbatches` micro-batches in flight."""
    return tuple(s + a * microbatches for s, a in zip(self.static_bytes, self.activation_bytes))

  def successors(self) -> list[list[tuple[int, int]]]:
    """For each node, its (successor, edge index) pairs."""
    out: list[list[tuple[int, int]]] = [[] for _ in self.names]
    for e, (s, d) in enumerate(self.edges):
      out[s].append((d, e))
    return out

  def predecessors(self) -> list[list[tuple[int, int]]]:
    """For each node, its (predecessor, edge index) pairs."""
    out: list[list[tuple[int, int]]] = [[] for _ in self.names]
    for e, (s, d) in enumerate(self.edges):
      out[d].append((s, e))
    return out

  def digest(self) -> str:
    """A stable hash of the numbers (used as the fingerprint of hand-made problems)."""
    data = json.dumps(
      [self.compute_s, self.static_bytes, self.activation_bytes, self.edges, self.transfer_s]
    )
    return hashlib.sha256(data.encode()).hexdigest()[:16]

  @classmethod
  def build(
    cls,
    compute_s: Sequence[float],
    edges: Sequence[tuple[int, int]] = (),
    *,
    devices: int,
    transfer_s: Sequence[float] | float = 0.0,
    names: Sequence[str] | None = None,
    memory_bytes: Sequence[int] | None = None,
    activation_bytes: Sequence[int] | None = None,
    edge_bytes: Sequence[int] | None = None,
  ) -> Problem:
    """Builds a problem by hand, with the same transfer time between every pair of devices.

    Args:
      compute_s: p_i per node.
      edges: (src, dst) pairs with src < dst.
      devices: M.
      transfer_s: per-edge delay (one number for all edges, or one per edge) when the two ends
        are on different devices.
      names: node names; default "n0", "n1", ...
      memory_bytes: static bytes per node (default 0).
      activation_bytes: bytes per node per micro-batch (default 0).
      edge_bytes: bytes per edge (default 0; informational).

    Returns:
      The problem.
    """
    n, m = len(compute_s), len(edges)
    if isinstance(transfer_s, (int, float)):
      transfer_s = [float(transfer_s)] * m
    if len(transfer_s) != m:
      raise ValueError(f"transfer_s has {len(transfer_s)} entries for {m} edges.")
    mats = tuple(
      tuple(tuple(0.0 if a == b else float(t) for b in range(devices)) for a in range(devices))
      for t in transfer_s
    )
    prob = cls(
      names=tuple(names) if names is not None else tuple(f"n{i}" for i in range(n)),
      compute_s=tuple(float(p) for p in compute_s),
      static_bytes=tuple(int(b) for b in (memory_bytes or [0] * n)),
      activation_bytes=tuple(int(b) for b in (activation_bytes or [0] * n)),
      edges=tuple((int(s), int(d)) for s, d in edges),
      edge_bytes=tuple(int(b) for b in (edge_bytes or [0] * m)),
      transfer_s=mats,
      devices=devices,
    )
    return dataclasses.replace(prob, fingerprint=prob.digest())

  @classmethod
  def from_graph(cls, graph: Any, costs: Any, options: PlannerOptions) -> Problem:
    """Reads a traced graph and a cost model.

    Memory per node (assumption, PlannerOptions): param_bytes * (1 + optimizer_state_factor +
    gradient_factor) held once, plus out_bytes * activation_factor per micro-batch in flight.
    Parallel edges between the same two nodes are merged (bytes summed).

    Args:
      graph: has `nodes` (id, name, param_bytes, out_bytes, flops), `edges` (src, dst, bytes)
        and `fingerprint()`.
      costs: has `node_time_s(node)`, `transfer_time_s(nbytes, src, dst)`, `source` and
        `hardware_name`.
      options: planner options (devices, memory factors, transfer_directions).

    Returns:
      The problem.

    Raises:
      ValueError: nodes not numbered in topological order.
    """
    nodes = list(graph.nodes)
    for i, node in enumerate(nodes):
      if node.id != i:
        raise ValueError(f"graph.nodes[{i}].id == {node.id}; nodes must be numbered 0..n-1.")
    merged: dict[tuple[int, int], int] = {}
    for edge in graph.edges:
      if edge.src >= edge.dst:
        raise ValueError(f"Edge {edge.src}->{edge.dst} goes backwards; nodes must be topological.")
      key = (int(edge.src), int(edge.dst))
      merged[key] = merged.get(key, 0) + int(edge.bytes)
    keys = sorted(merged)
    M = options.devices
    mats = tuple(
      tuple(
        tuple(
          0.0
          if a == b
          else options.transfer_directions * float(costs.transfer_time_s(merged[k], a, b))
          for b in range(M)
        )
        for a in range(M)
      )
      for k in keys
    )
    weight = 1.0 + options.optimizer_state_factor + options.gradient_factor
    return cls(
      names=tuple(str(n.name) for n in nodes),
      compute_s=tuple(float(costs.node_time_s(n)) for n in nodes),
      static_bytes=tuple(int(round(n.param_bytes * weight)) for n in nodes),
      activation_bytes=tuple(int(round(n.out_bytes * options.activation_factor)) for n in nodes),
      edges=tuple(keys),
      edge_bytes=tuple(merged[k] for k in keys),
      transfer_s=mats,
      devices=M,
      fingerprint=str(graph.fingerprint()),
      cost_source=str(getattr(costs, "source", "unknown")),
      hardware=str(getattr(costs, "hardware_name", "")),
    )
