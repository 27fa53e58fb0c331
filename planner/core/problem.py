"""The planner's own view of a placement problem: numbers only, no graph library.

A `Problem` is what the MILP and the heuristics read: per-node compute time p_i and memory, edges
with their transfer time for every (source device, destination device) pair, and M. Tests build
problems by hand with `Problem.build`; `Problem.from_graph` reads a traced OpGraph and a cost model.

F/B/W tasks (planner.price, planner.fbw_milp): p_i splits into the forward F (`forward_s`), the
input cotangent B (`input_grad_s`) and the weight gradient W (the rest, or `weight_grad_task_s`
where a recurrence makes B + W exceed the backward); unsplit schedules run B + W as one task. Messages carry *values* (a node's outputs; an edge carries some of them) per
direction: activations forward, cotangents (float values only) backward. A value sent to a
device is sent once whatever the number of its readers there, as the program does.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Sequence

from jaxhybrid.planner.core import dtypes, graph_reads, pieces
from jaxhybrid.planner.core.graph_reads import DEFAULT_VALUE_DTYPE
from jaxhybrid.planner.core.options import PlannerOptions

# Share of a node's forward + backward time that is the forward, when a cost model gives only the
# sum (assumption: the backward costs twice the forward, the usual figure for matmul-dominated
# layers; Kaplan et al. 2020). The program's lock-step model (program.lockstep) uses the same.
FORWARD_SHARE = 1.0 / 3.0
# Share of the backward that is the input cotangent (B) when a schedule splits B and W and no
# split is given (assumption: a matmul's two backward products cost the same).
INPUT_GRAD_SHARE = 0.5
# Copies of a node's parameters a device holds while one of its tasks runs, beside its rows and
# residuals (`Problem.transient_bytes`): the leaves the task copies out of the packed row
# (`graph_reads.gradient_row_split`; program.memory: `param_copies`); the gradient window it
# returns is priced with its group (`price.group_peak_bytes`). Counted twice, the planner's
# figure ran 5-25 % above the compiled step at one micro-batch (bench_memory.json as of a91b852).
TASK_PARAM_COPIES = 1


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
  # Forward seconds per node per micro-batch; () = FORWARD_SHARE * compute_s.
  forward_s: tuple[float, ...] = ()
  # Input-cotangent (B of split schedules) seconds per node; () = INPUT_GRAD_SHARE of the
  # backward. The weight gradient W takes the rest: compute_s - forward_s - input_grad_s.
  input_grad_s: tuple[float, ...] = ()
  # How many one-way transfers `transfer_s` counts (PlannerOptions.transfer_directions for
  # `from_graph`; 1 for hand-built problems): one direction of edge e costs
  # transfer_s[e][a][b] / transfer_directions when no link model is given.
  transfer_directions: float = 1.0
  # Values: bytes and dtype name of each, and per edge the ids of the values it carries.
  # () = one value per edge of edge_bytes bytes and DEFAULT_VALUE_DTYPE.
  value_bytes: tuple[int, ...] = ()
  value_dtypes: tuple[str, ...] = ()
  edge_values: tuple[tuple[int, ...], ...] = ()
  # Link model per direction, MxM: a message of b bytes from a to b' takes
  # link_latency_s[a][b'] + b * link_s_per_byte[a][b'] (0 on the diagonal). () = no link model:
  # one direction of an edge costs transfer_s[e][a][b] / transfer_directions, and a message the
  # sum of its edges' times.
  link_latency_s: tuple[tuple[float, ...], ...] = ()
  link_s_per_byte: tuple[tuple[float, ...], ...] = ()
  # Memory of one device in bytes (the hardware's), the default memory cap; 0 = unknown.
  device_memory_bytes: int = 0
  # Parameter bytes per node (what its gradient task writes into the gradient row; the program
  # groups gradient tasks by it, lockstep_rule.GROUP_GRAD_BYTES); () = unknown.
  param_bytes: tuple[int, ...] = ()
  # W seconds per node in split schedules; () = compute_s - forward_s - input_grad_s (B and W
  # share the backward's work, as a matmul's two gradient products do). A recurrence's W
  # repeats the recurrent cotangent, so then B + W exceeds the backward (costs'
  # `weight_grad_time_s`; BigLSTM's LSTM measured 1.33x on one core).
  weight_grad_task_s: tuple[float, ...] = ()
  # Bytes every device holds beside its static bytes and residuals while the node with the most
  # copied leaves runs a task (TASK_PARAM_COPIES x those leaves' bytes: leaves in the packed row,
  # read whole; the SPMD program allocates the largest device's on every device); 0 = not
  # modelled. The solvers see the caps less this; `Plan.device_peak_bytes` includes it.
  transient_bytes: int = 0
  # Parameter leaves more than one node reads: (static bytes as `static_bytes` counts them,
  # reader nodes) each, left out of the readers' `static_bytes`. A device holds such a leaf
  # once: its readers' device, or every device when they are on several (the program
  # replicates it; `price.device_static_bytes`); the solvers see less (a relaxation). () = none.
  shared_static: tuple[tuple[int, tuple[int, ...]], ...] = ()
  # Bytes of the batch every model-axis device holds (its data replica's), and of the model state
  # the step carries (graph_reads.batch_bytes); 0 = not modelled.
  batch_bytes: int = 0
  # Per node, the parameter-gradient bytes its gradient task returns as windows of the row: its
  # parameter bytes less the tables it reads by row lookups (those return row gradients,
  # scattered into the row); () = param_bytes.
  window_bytes: tuple[int, ...] = ()
  # Per node, (F, B) bytes its task needs beyond inputs and outputs (W: B's); () = not counted.
  task_temp_bytes: tuple[tuple[int, int], ...] = ()
  # Seconds per group, per task (M > 1) beyond tasks and link (PlannerOptions.group_s, ...).
  group_s: float = 0.0
  task_fixed_s: float = 0.0

  def __post_init__(self):
    n = len(self.names)
    if not self.forward_s:
      object.__setattr__(self, "forward_s", tuple(FORWARD_SHARE * p for p in self.compute_s))
    if not self.input_grad_s:
      object.__setattr__(self, "input_grad_s", tuple(
        INPUT_GRAD_SHARE * (p - f) for p, f in zip(self.compute_s, self.forward_s)))
    if not self.edge_values:
      object.__setattr__(self, "value_bytes", tuple(int(b) for b in self.edge_bytes))
      object.__setattr__(self, "value_dtypes", (DEFAULT_VALUE_DTYPE,) * len(self.edges))
      object.__setattr__(self, "edge_values", tuple((e,) for e in range(len(self.edges))))
    for field in ("window_bytes", "param_bytes", "task_temp_bytes"):
      if getattr(self, field) and len(getattr(self, field)) != n:
        raise ValueError(f"Problem.{field} has {len(getattr(self, field))} entries for {n} nodes.")
    if self.weight_grad_task_s and (len(self.weight_grad_task_s) != n
                                    or any(w < 0 for w in self.weight_grad_task_s)):
      raise ValueError(f"Problem.weight_grad_task_s needs {n} times >= 0.")
    for field in ("forward_s", "input_grad_s"):
      if len(getattr(self, field)) != n:
        raise ValueError(f"Problem.{field} has {len(getattr(self, field))} entries for {n} nodes.")
    for i, (p, f, b) in enumerate(zip(self.compute_s, self.forward_s, self.input_grad_s)):
      if not (0 <= f <= p + 1e-15 and 0 <= b <= p - f + 1e-15):
        raise ValueError(
          f"node {i}: forward_s={f} and input_grad_s={b} must be >= 0 and sum to at most "
          f"compute_s={p}.")
    if any(not 0 <= r < n for _, readers in self.shared_static for r in readers):
      raise ValueError("Problem.shared_static names a reader that is not a node.")
    if len(self.edge_values) != len(self.edges):
      raise ValueError("Problem.edge_values needs one entry per edge.")
    if len(self.value_bytes) != len(self.value_dtypes):
      raise ValueError("Problem.value_bytes and value_dtypes need one entry per value.")
    for link in (self.link_latency_s, self.link_s_per_byte):
      if link and (len(link) != self.devices or any(len(r) != self.devices for r in link)):
        raise ValueError(f"link_latency_s and link_s_per_byte must be {self.devices}x{self.devices}.")
    if bool(self.link_latency_s) != bool(self.link_s_per_byte):
      raise ValueError("give both link_latency_s and link_s_per_byte, or neither.")
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
  def held_bytes(self) -> int:
    """Bytes every device holds whatever the placement: `transient_bytes` + `batch_bytes` (the
    solvers see the caps less this; `Plan.device_peak_bytes` includes it)."""
    return int(self.transient_bytes) + int(self.batch_bytes)

  @property
  def num_nodes(self) -> int:
    return len(self.names)

  def weight_grad_s(self, i: int) -> float:
    """W of node i: `weight_grad_task_s` if given, else the backward less the input cotangent."""
    if self.weight_grad_task_s:
      return self.weight_grad_task_s[i]
    return max(0.0, self.compute_s[i] - self.forward_s[i] - self.input_grad_s[i])

  def task_s(self, kind: str, i: int, split: bool) -> float:
    """Seconds of task `kind` ('F', 'B', 'W') of node i; unsplit, B is the whole backward."""
    if kind == "F":
      return self.forward_s[i]
    if kind == "B":
      return self.input_grad_s[i] if split else self.compute_s[i] - self.forward_s[i]
    if kind == "W" and split:
      return self.weight_grad_s(i)
    raise ValueError(f"task kind {kind!r} (split={split}) is not F, B or W")

  # Derived tables, once per problem (the lock-step pricer asks per task: ~66k dtype checks per
  # 10 s of search on Inception-V3 paper, M=4, k=4); cached_property writes the __dict__.
  @functools.cached_property
  def _float_values(self) -> tuple[bool, ...]:
    return tuple(dtypes.is_float(t) for t in self.value_dtypes)

  @functools.cached_property
  def _cotangent_edges(self) -> tuple[bool, ...]:
    floats = self._float_values
    return tuple(any(floats[v] for v in values) for values in self.edge_values)

  @functools.cached_property
  def _adjacency(self) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    succs: list[list[tuple[int, int]]] = [[] for _ in self.names]
    preds: list[list[tuple[int, int]]] = [[] for _ in self.names]
    for e, (s, d) in enumerate(self.edges):
      succs[s].append((d, e))
      preds[d].append((s, e))
    return tuple(map(tuple, succs)), tuple(map(tuple, preds))

  @functools.cached_property
  def grad_units(self) -> tuple[int, ...]:
    """Per node, its gradient unit for the lock-step group cap (`pieces.grad_units`)."""
    return tuple(pieces.grad_units(self.names))

  def is_float(self, value: int) -> bool:
    """Whether value has a cotangent (floating dtypes)."""
    return self._float_values[value]

  def has_cotangent(self, e: int) -> bool:
    """Whether edge e carries a float value (then its consumer's B sends a cotangent back)."""
    return self._cotangent_edges[e]

  def edge_value_bytes(self, e: int, backward: bool) -> int:
    """Bytes edge e carries one way: its values forward, their cotangents backward."""
    return sum(self.value_bytes[v] for v in self.edge_values[e]
               if not backward or self.is_float(v))

  def link_s(self, nbytes: float, a: int, b: int) -> float:
    """One message of `nbytes` from device a to b under the link model (needs one)."""
    if a == b:
      return 0.0
    return self.link_latency_s[a][b] + nbytes * self.link_s_per_byte[a][b]

  def direction_s(self, e: int, a: int, b: int, backward: bool) -> float:
    """Delay of one direction of edge e, the sender on device a and the receiver on b:
    forward (a holds the source) the activations, backward (a holds the destination) the
    cotangents; 0 when nothing crosses."""
    if a == b:
      return 0.0
    if backward and not self.has_cotangent(e):
      return 0.0
    nbytes = self.edge_value_bytes(e, backward)
    if self.link_latency_s:
      return self.link_s(nbytes, a, b)
    src, dst = (b, a) if backward else (a, b)
    if not self.transfer_directions:
      return 0.0
    return self.transfer_s[e][src][dst] / self.transfer_directions

  def subproblem(self, nodes: Sequence[int]) -> Problem:
    """The induced sub-problem on `nodes` (sorted), renumbered 0..len-1 (values renumbered)."""
    index = {v: r for r, v in enumerate(nodes)}
    keep = [e for e, (s, d) in enumerate(self.edges) if s in index and d in index]
    used = sorted({v for e in keep for v in self.edge_values[e]})
    vindex = {v: r for r, v in enumerate(used)}
    pick = lambda xs: tuple(xs[v] for v in nodes) if xs else ()  # noqa: E731
    return dataclasses.replace(
      self,
      names=tuple(self.names[v] for v in nodes),
      compute_s=tuple(self.compute_s[v] for v in nodes),
      static_bytes=tuple(self.static_bytes[v] for v in nodes),
      activation_bytes=tuple(self.activation_bytes[v] for v in nodes),
      edges=tuple((index[self.edges[e][0]], index[self.edges[e][1]]) for e in keep),
      edge_bytes=tuple(self.edge_bytes[e] for e in keep),
      transfer_s=tuple(self.transfer_s[e] for e in keep),
      forward_s=tuple(self.forward_s[v] for v in nodes),
      input_grad_s=tuple(self.input_grad_s[v] for v in nodes),
      param_bytes=pick(self.param_bytes), window_bytes=pick(self.window_bytes),
      weight_grad_task_s=pick(self.weight_grad_task_s), task_temp_bytes=pick(self.task_temp_bytes),
      value_bytes=tuple(self.value_bytes[v] for v in used),
      value_dtypes=tuple(self.value_dtypes[v] for v in used),
      edge_values=tuple(tuple(vindex[v] for v in self.edge_values[e]) for e in keep),
      shared_static=tuple(
        (b, tuple(index[r] for r in readers if r in index))
        for b, readers in self.shared_static if any(r in index for r in readers)),
    )

  def scaled_times(self, factor: float) -> Problem:
    """The same problem with every time (compute, transfer and link figures) multiplied by
    `factor`; bytes unchanged. Every makespan scales by `factor` with it, so a bound or
    schedule found on the scaled problem holds for this one divided by `factor`. The MILPs
    solve in such units (milp.time_unit): CBC's absolute tolerances are made for numbers near 1,
    and on a tiny model's step of ~3 ms it returned a relaxation bound above a valid
    schedule. A power of two keeps every product exact."""
    def scale(xs):
      return tuple(scale(x) for x in xs) if isinstance(xs, tuple) else xs * factor

    return dataclasses.replace(
      self,
      compute_s=scale(self.compute_s), forward_s=scale(self.forward_s),
      input_grad_s=scale(self.input_grad_s), weight_grad_task_s=scale(self.weight_grad_task_s),
      transfer_s=scale(self.transfer_s), link_latency_s=scale(self.link_latency_s),
      link_s_per_byte=scale(self.link_s_per_byte), group_s=scale(self.group_s),
      task_fixed_s=scale(self.task_fixed_s),
    )

  def memory_bytes(self, microbatches: int) -> tuple[float, ...]:
    """m_i: bytes node i needs on its device with `microbatches` micro-batches in flight."""
    return tuple(s + a * microbatches for s, a in zip(self.static_bytes, self.activation_bytes))

  def successors(self) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each node, its (successor, edge index) pairs (computed once; read-only)."""
    return self._adjacency[0]

  def predecessors(self) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each node, its (predecessor, edge index) pairs (computed once; read-only)."""
    return self._adjacency[1]

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
    forward_s: Sequence[float] | None = None,
    input_grad_s: Sequence[float] | None = None,
    device_memory_bytes: int = 0,
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
      forward_s: forward seconds per node (default FORWARD_SHARE * compute_s).
      input_grad_s: input-cotangent seconds per node (default half the backward).
      device_memory_bytes: the default memory cap per device (0 = none).

    With F/B/W tasks each direction of an edge costs its `transfer_s` (transfer_directions 1).

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
      forward_s=tuple(float(f) for f in forward_s) if forward_s is not None else (),
      input_grad_s=tuple(float(b) for b in input_grad_s) if input_grad_s is not None else (),
      device_memory_bytes=int(device_memory_bytes),
    )
    return dataclasses.replace(prob, fingerprint=prob.digest())

  @classmethod
  def from_graph(cls, graph: Any, costs: Any, options: PlannerOptions) -> Problem:
    """Reads a traced graph and a cost model.

    Memory per node (assumption, PlannerOptions): param_bytes * (1 + optimizer_state_factor +
    gradient_factor) held once (with one micro-batch, no gradient row for the leaves whose
    gradient is one window: `graph_reads.gradient_row_split`), plus per micro-batch in flight
    what the node keeps for its backward (`activation_model`: outputs + residuals, or outputs
    only) * activation_factor.
    A parameter leaf several nodes read is counted apart, once per device (`shared_static`).
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
    total = [float(costs.node_time_s(n)) for n in nodes]
    if hasattr(costs, "forward_time_s"):
      fwd = tuple(min(float(costs.forward_time_s(n)), t) for n, t in zip(nodes, total))
    else:
      fwd = tuple(FORWARD_SHARE * t for t in total)
    ig = wg = ()
    if {"zb", "custom"} & set(options.schedule_kinds) and hasattr(costs, "input_grad_time_s"):
      # Split schedules may be chosen: their B and W as the cost model prices them.
      ig = tuple(min(float(costs.input_grad_time_s(n)), t - f)
                 for n, t, f in zip(nodes, total, fwd))
      wg = tuple(float(costs.weight_grad_time_s(n)) for n in nodes)
    values = graph_reads.values(nodes, keys, merged)
    link = getattr(costs, "link", None)
    lat = spb = ()
    if link is not None:
      # The link is affine (costs.transfer_time_s: alpha + bytes / bandwidth): read it back.
      probe = float(1 << 20)
      lat = tuple(tuple(0.0 if a == b else float(costs.transfer_time_s(0, a, b))
                        for b in range(M)) for a in range(M))
      spb = tuple(tuple(0.0 if a == b else (float(costs.transfer_time_s(probe, a, b)) - lat[a][b])
                        / probe for b in range(M)) for a in range(M))
    hw = getattr(costs, "hardware", None) or link
    shared = graph_reads.shared_params(graph, nodes)
    copied, copies, single = graph_reads.gradient_row_split(graph, nodes, options.slot_min_bytes,
      options.single_window_gradients and options.microbatches == 1)
    own = [int(n.param_bytes) for n in nodes]
    for b, readers in shared:
      for r in readers:
        own[r] -= b
    return cls(
      names=tuple(str(n.name) for n in nodes),
      compute_s=tuple(total),
      static_bytes=tuple(int(round(b * weight - w * options.gradient_factor))
                         for b, w in zip(own, single)),
      shared_static=tuple((int(round(b * weight)), readers) for b, readers in shared),
      batch_bytes=graph_reads.batch_bytes(graph),
      activation_bytes=tuple(int(round(b * options.activation_factor))
                             for b in graph_reads.kept_bytes(graph, nodes, options.activation_model)),
      edges=tuple(keys),
      edge_bytes=tuple(merged[k] for k in keys),
      transfer_s=mats,
      devices=M,
      fingerprint=str(graph.fingerprint()),
      cost_source=str(getattr(costs, "source", "unknown")),
      hardware=str(getattr(costs, "hardware_name", "")),
      forward_s=fwd,
      input_grad_s=ig,
      weight_grad_task_s=wg,
      transfer_directions=float(options.transfer_directions),
      value_bytes=values[0],
      value_dtypes=values[1],
      edge_values=values[2],
      link_latency_s=lat,
      link_s_per_byte=spb,
      device_memory_bytes=int(getattr(hw, "memory_bytes", 0) or 0),
      param_bytes=tuple(int(n.param_bytes) for n in nodes),
      transient_bytes=TASK_PARAM_COPIES * max(copies, default=0),
      window_bytes=tuple(copied),
      task_temp_bytes=tuple(tuple(int(b) for b in options.task_temp(graph, n)) for n in nodes)
      if options.task_temp is not None else (),
      group_s=float(options.group_s), task_fixed_s=float(options.task_fixed_s),
    )
