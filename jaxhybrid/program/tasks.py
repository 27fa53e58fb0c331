"""The static structure of a task-scheduled step: values, slots, groups, packed buffers, messages.

A `TaskSchedule` (jaxhybrid.planner.core.task_schedule) gives each model-axis device an ordered list of
F / B / W tasks. The SPMD program runs them in lock step:

- *values* flow between tasks: activations ('a', var, c) made by F(producer, c); cotangent
  contributions ('g', var, c, consumer) made by B(consumer, c) for each float input `var` of the
  consumer, summed by B(producer, c); residual leaves ('r', node, c, j) made by F(node, c) for
  its B and W (only the new arrays of the node's pullback: arguments are re-read);
- a task goes to the first *slot* after its device's previous task and after the slots of the
  tasks whose values it reads; consecutive slots merge into a *group* unless a task reads a
  value another device made in the group (a schedule with explicit `groups` names them
  instead, checked against the same rules). A group is one `lax.switch` on the model index;
- each group's conditional returns, per dtype, ONE flat packed buffer per device for its small
  values: first a region per message direction (shift), then the values the device keeps for
  itself (residuals included); every region is as long as the longest device's part, so the
  buffer is the union of what the devices need (the largest device's outputs), not the sum.
  Values of at least `lockstep_rule.LANE_MIN_BYTES` get *lanes* of their own instead (the j-th largest of every
  device shares lane j, as long as the longest): a value as long as its lane is returned as it
  is, with no copy;
- after the group, one `ppermute` per (shift, dtype) region and per message lane sends it to
  device + shift; the receiver reads its values at static offsets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxhybrid import graph as graph_lib
from jaxhybrid.planner.core import dtypes
from jaxhybrid.planner.pricing import lockstep_rule
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule

END = -1  # the "group" of the final read (the loss)


@dataclasses.dataclass(frozen=True)
class Loc:
  """Where a device reads a value: buffer id, static offset, shape and dtype."""

  buf: tuple  # ('out', group, lane) or ('recv', group, shift, lane)
  offset: int
  shape: tuple[int, ...]
  dtype: str

  @property
  def size(self) -> int:
    return int(math.prod(self.shape))


@dataclasses.dataclass(frozen=True)
class Residuals:
  """What F(node) saves for its backward: the pullback's leaves, classified.

  `kinds[j]` is ('arg', i) for the node's i-th argument (re-read in the backward), ('out', i)
  for its i-th output (the backward reads the activation), ('res', r)
  for the r-th packed residual, ('fresh', f) for a broadcast constant made again in B from
  `fills[f]` (value, shape, dtype) and never saved (`jax.nn.relu`'s derivative keeps zeros as
  large as the activation), or ('const', None) for a constant kept in `consts[j]`.
  """

  kinds: tuple[tuple[str, Any], ...]
  avals: tuple[Any, ...]  # of the packed residuals
  consts: tuple[Any, ...]  # per leaf: the constant, or None
  # Positions, among the pullback's arrays, of the packed (saved) residuals, in packing order;
  # () for residuals described without them (every array saved).
  stored: tuple[int, ...] = ()
  fills: tuple[tuple[Any, tuple[int, ...], str], ...] = ()
  # Per row lookup of the node (`program.lookups`), the packed residual holding its indices.
  ids: tuple[int, ...] = ()

  @property
  def has_fresh(self) -> bool:
    return any(k == "fresh" for k, _ in self.kinds)

  @property
  def arg_indices(self) -> tuple[int, ...]:
    return tuple(sorted({i for k, i in self.kinds if k == "arg"}))


@dataclasses.dataclass
class GroupLayout:
  """A group's tasks and the layout of its output buffers."""

  tasks: list[tuple[int, Op]]  # (device, op), per device in schedule order
  sizes: dict[str, int]  # lane (dtype name, or an own lane 'float32@1#0') -> length (elements)
  regions: dict[tuple[int, str], tuple[int, int]]  # (shift, lane) -> (start, length)
  # device -> [(key, dtype, offset, shape)] in write order (what its branch returns)
  writes: dict[int, list[tuple[Any, str, int, tuple[int, ...]]]]


@dataclasses.dataclass
class Structure:
  """Everything static about a task-scheduled step."""

  schedule: TaskSchedule
  groups: list[GroupLayout]
  locs: dict[tuple[Any, int], Loc]  # (value key, reading device) -> location
  reads: dict[tuple[int, Op], list[Any]]  # task -> value keys it reads (in a fixed order)
  makes: dict[tuple[int, Op], list[Any]]  # task -> value keys it makes
  avals: dict[Any, Any]  # value key -> aval
  ct_sources: dict[Any, list[Any]]  # ('a', var, c) -> its cotangent contribution keys
  loss_keys: list[Any]  # ('a', loss_var, c) per micro-batch
  loss_device: int
  devices: int

  def message_plan(self, g: int) -> list[tuple[int, str, int, int]]:
    """(shift, lane, start, length) of each message after group g (`lane_dtype` gives the dtype)."""
    return [(s, dt, a, n) for (s, dt), (a, n) in sorted(self.groups[g].regions.items())]

  def output_bytes(self, g: int) -> int:
    """Bytes of group g's conditional outputs per device (all lanes; gradients excluded)."""
    return sum(n * np.dtype(lane_dtype(b)).itemsize for b, n in self.groups[g].sizes.items())

  def fill_bytes_per_device(self, g: int) -> list[int]:
    """Per device, the bytes it writes to build group g's outputs: every lane it does not fill
    with exactly one value of the lane's length (values copied side by side, zeros)."""
    lay = self.groups[g]
    out = []
    for d in range(self.devices):
      mine: dict[str, list[int]] = {}
      for _, lane, _, shape in lay.writes.get(d, ()):
        mine.setdefault(lane, []).append(int(math.prod(shape)))
      out.append(sum(
        n * np.dtype(lane_dtype(lane)).itemsize for lane, n in lay.sizes.items()
        if mine.get(lane) != [n]
      ))
    return out

  def fill_bytes(self, g: int) -> int:
    """The most bytes one device writes to build group g's outputs (`fill_bytes_per_device`)."""
    return max(self.fill_bytes_per_device(g), default=0)


def lane_dtype(lane: str) -> str:
  """The dtype name of a lane ('float32' packed; 'float32@1#0', 'float32@k#0' or 'float32@loss#0'
  own lanes)."""
  return lane.split("@", 1)[0]


def split_lanes(
  by_src: dict[int, list[Any]], nbytes: dict[Any, int], min_bytes: int
) -> tuple[dict[int, list[Any]], list[dict[int, list[Any]]]]:
  """Per source device, its values split into the small ones (packed, in order) and lanes: the
  j-th largest large value of every source shares lane j (as long as the longest)."""
  small: dict[int, list[Any]] = {}
  big: dict[int, list[Any]] = {}
  for src, keys in by_src.items():
    large = [key for key in keys if nbytes[key] >= min_bytes]
    rest = [key for key in keys if nbytes[key] < min_bytes]
    if rest:
      small[src] = rest
    if large:
      big[src] = sorted(large, key=lambda key: -nbytes[key])
  lanes = [
    {src: [keys[j]] for src, keys in big.items() if j < len(keys)}
    for j in range(max((len(keys) for keys in big.values()), default=0))
  ]
  return small, lanes


def lifetime_lanes(
  by_dev: dict[int, list[Any]], life: dict[Any, int], size_of: Callable[[Any], int]
) -> dict[int, int]:
  """Lifetime (groups) -> packed lane index: the distinct lifetimes of every device's values,
  longest first, cut into contiguous intervals, one lane each, minimising the sum over lanes of
  (lane length: the largest device's values in the interval) x (groups the lane lives: the
  interval's longest lifetime + 1). Exact over interval partitions (dynamic programming)."""
  lives = sorted({life[key] for keys in by_dev.values() for key in keys}, reverse=True)
  n = len(lives)
  index = {t: i for i, t in enumerate(lives)}
  # per device, elements per lifetime index
  per = [[0] * n for _ in by_dev]
  for row, keys in zip(per, by_dev.values()):
    for key in keys:
      row[index[life[key]]] += size_of(key)

  def cost(i: int, j: int) -> int:  # one lane for lifetimes lives[i..j-1]
    return max(sum(row[i:j]) for row in per) * (lives[i] + 1)

  best = [0] + [None] * n  # best[j]: least cost of lifetimes lives[:j]
  cut = [0] * (n + 1)
  for j in range(1, n + 1):
    best[j], cut[j] = min((best[i] + cost(i, j), i) for i in range(j))
  lanes: dict[int, int] = {}
  j, bounds = n, []
  while j > 0:
    bounds.append((cut[j], j))
    j = cut[j]
  for lane, (i, j) in enumerate(reversed(bounds)):
    for t in lives[i:j]:
      lanes[t] = lane
  return lanes


def _is_float(aval: Any) -> bool:
  return dtypes.is_float(aval.dtype)


def build(
  graph: graph_lib.OpGraph,
  assignment: Sequence[int],
  schedule: TaskSchedule,
  residuals: Callable[[int], Residuals],
  remat: frozenset[int] = frozenset(),
  lane_min_bytes: int | None = None,
) -> Structure:
  """Values, slots, groups, buffer layouts and read locations of a validated task schedule.

  Args:
    graph: the op graph.
    assignment: node -> model-axis device.
    schedule: the per-device task order (validated by `task_schedule.validate`).
    residuals: node id -> what its F saves (`Residuals`); not called for `remat` nodes.
    remat: nodes whose F saves nothing (their B replays the forward from the arguments).
    lane_min_bytes: values of at least this many bytes get a lane of their own (default
      lockstep_rule.LANE_MIN_BYTES).
  """
  if lane_min_bytes is None:
    lane_min_bytes = lockstep_rule.LANE_MIN_BYTES
  devices = len(schedule.devices)
  node_out = {v: n.id for n in graph.nodes for v in n.outvars}
  loss_var = graph.jaxpr.outvars[0]
  k = schedule.microbatches
  # Which node inputs are activations (made by another node), per node, in order, deduplicated.
  acts = {
    n.id: list(dict.fromkeys(v for v in n.invars if v in node_out and node_out[v] != n.id))
    for n in graph.nodes
  }
  consumers: dict[Any, list[int]] = {}
  for n in graph.nodes:
    for v in acts[n.id]:
      consumers.setdefault(v, []).append(n.id)
  res = {n.id: residuals(n.id) for n in graph.nodes if n.id not in remat}
  avals: dict[Any, Any] = {}
  reads: dict[tuple[int, Op], list[Any]] = {}
  makes: dict[tuple[int, Op], list[Any]] = {}
  ct_sources: dict[Any, list[Any]] = {}
  for d, ops in enumerate(schedule.devices):
    for op in ops:
      n, c = graph.nodes[op.node], op.microbatch
      if op.kind == "F":
        reads[(d, op)] = [("a", v, c) for v in acts[n.id]]
        made = [("a", v, c) for v in n.outvars]
        for v in n.outvars:
          avals[("a", v, c)] = v.aval
        if n.id in res:
          for j, a in enumerate(res[n.id].avals):
            made.append(("r", n.id, c, j))
            avals[("r", n.id, c, j)] = a
        makes[(d, op)] = made
        continue
      need_args = (
        range(len(n.invars)) if n.id in remat else res[n.id].arg_indices
      )
      arg_vars = list(dict.fromkeys(
        n.invars[i] for i in need_args if i < len(n.invars) and n.invars[i] in acts[n.id]
      ))
      cts = []
      for v in n.outvars:
        if not _is_float(v.aval):
          continue
        srcs = [("g", v, c, s) for s in consumers.get(v, []) if _is_float(v.aval)]
        ct_sources[("a", v, c)] = srcs
        cts.extend(srcs)
      own = [] if n.id in remat else [("r", n.id, c, j) for j in range(len(res[n.id].avals))]
      # Outputs the pullback keeps (kind 'out'): read as the activation, not saved twice.
      outs = [] if n.id in remat else list(dict.fromkeys(
        ("a", n.outvars[j], c) for kind, j in res[n.id].kinds if kind == "out"))
      reads[(d, op)] = [("a", v, c) for v in arg_vars] + cts + own + outs
      if op.kind == "B":
        made = [("g", v, c, n.id) for v in acts[n.id] if _is_float(v.aval)]
        for key in made:
          avals[key] = key[1].aval
        makes[(d, op)] = made
      else:
        makes[(d, op)] = []
  maker_task = {key: op for (d, op), keys in makes.items() for key in keys}
  # Slots and groups: the planner's pure rule (lockstep_rule.lockstep_groups), fed with which
  # task makes each value a task reads.
  task_reads = {
    op: list(dict.fromkeys(maker_task[key] for key in keys if key in maker_task))
    for (d, op), keys in reads.items()
  }
  edges = [(e.src, e.dst) for e in graph.edges]
  _, grouped = lockstep_rule.lockstep_groups(
    schedule, edges, assignment, task_reads,
    grad_bytes=[int(n.param_bytes) for n in graph.nodes],
    grad_unit=lockstep_rule.grad_units([n.name for n in graph.nodes]),
  )
  group_of = {task: g for g, tasks in enumerate(grouped) for task in tasks}
  # Readers of each value: (group, device).
  readers: dict[Any, set[tuple[int, int]]] = {}
  for task, keys in reads.items():
    for key in keys:
      readers.setdefault(key, set()).add((group_of[task], task[0]))
  loss_keys = [("a", loss_var, c) for c in range(k)]
  loss_device = assignment[node_out[loss_var]] if loss_var in node_out else 0
  loss_set = set(loss_keys)
  for key in loss_keys:
    readers.setdefault(key, set()).add((END, loss_device))
  # ---- per group: outputs, regions, locations ----------------------------------------------------
  locs: dict[tuple[Any, int], Loc] = {}
  layouts = []
  nbytes = {
    key: int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize for key, a in avals.items()
  }
  for g, tasks in enumerate(grouped):
    out_keys: list[tuple[int, Any]] = []  # (maker device, key), in task order
    for d, op in tasks:
      for key in makes[(d, op)]:
        later = [(gg, r) for gg, r in readers.get(key, ()) if gg > g or gg == END]
        if later:
          out_keys.append((d, key))
    payload: dict[tuple[int, str], dict[int, list[Any]]] = {}
    kept: dict[str, dict[int, list[Any]]] = {}
    for d, key in out_keys:
      dt = np.dtype(avals[key].dtype).name
      dests = sorted({r for gg, r in readers[key] if (gg > g or gg == END) and r != d})
      for r in dests:
        payload.setdefault(((r - d) % devices, dt), {}).setdefault(d, []).append(key)
      if not dests:
        kept.setdefault(dt, {}).setdefault(d, []).append(key)
    sizes: dict[str, int] = {}
    regions: dict[tuple[int, str], tuple[int, int]] = {}
    writes: dict[int, list[tuple[Any, str, int, tuple[int, ...]]]] = {d: [] for d in range(devices)}
    size_of = lambda key: int(math.prod(avals[key].shape))  # noqa: E731
    # Lanes: small values of a dtype share the packed lane (regions, then kept values); each
    # large value gets a lane of its own (returned and sent as it is, not copied into a buffer).
    msg_lanes: list[tuple[int, str, dict[int, list[Any]]]] = []
    kept_lanes: list[tuple[str, dict[int, list[Any]]]] = []
    packed_payload: dict[tuple[int, str], dict[int, list[Any]]] = {}
    packed_kept: dict[tuple[str, int], dict[int, list[Any]]] = {}
    for (s, dt), by_src in sorted(payload.items()):
      small, big = split_lanes(by_src, nbytes, lane_min_bytes)
      if small:
        packed_payload[(s, dt)] = small
      msg_lanes += [(s, f"{dt}@{s}#{j}", lane) for j, lane in enumerate(big)]
    for dt, by_dev in sorted(kept.items()):
      # A micro-batch's loss gets a lane of its own: it is read at the end of the step, and in
      # the packed lane it would keep the whole group buffer alive until then (1F1B, uniform
      # chain, 1x4, 32 rows per micro-batch: temp grew 3.29 -> 5.49 MB from k=4 to k=16).
      for d, keys in list(by_dev.items()):
        for key in keys:
          if key in loss_set:
            kept_lanes.append((f"{dt}@loss#{key[2]}", {d: [key]}))
        by_dev[d] = [key for key in keys if key not in loss_set]
        if not by_dev[d]:
          del by_dev[d]
      if not by_dev:
        continue
      small, big = split_lanes(by_dev, nbytes, lane_min_bytes)
      # Small kept values share packed lanes by lifetime (groups until the last read): a
      # buffer lives as long as its longest-lived value, and the SPMD program allocates each lane
      # on every device as long as its longest device's part. `lifetime_lanes` splits the
      # lifetimes into intervals, one lane each, at the least bytes x groups: one lane for all
      # lifetimes kept a residual's neighbours alive for its whole lifetime, and lanes shared by
      # lifetime rank kept another device's short-lived values as long as device 0's residuals
      # (1F1B, uniform chain, 1x4, 32 rows per micro-batch: temp k=16 / k=4 1.17x, then 1.14x).
      life = {
        key: max(len(grouped) if gg == END else gg for gg, _ in readers[key]) - g
        for keys in small.values() for key in keys
      }
      lane_of = lifetime_lanes(small, life, size_of)
      for d, keys in small.items():
        for key in keys:
          packed_kept.setdefault((dt, lane_of[life[key]]), {}).setdefault(d, []).append(key)
      kept_lanes += [(f"{dt}@k#{j}", lane) for j, lane in enumerate(big)]
    for (s, dt), by_src in sorted(packed_payload.items()):
      start = sizes.get(dt, 0)
      length = max(sum(size_of(key) for key in keys) for keys in by_src.values())
      regions[(s, dt)] = (start, length)
      sizes[dt] = start + length
      for src, keys in by_src.items():
        off = 0
        for key in keys:
          shape = tuple(avals[key].shape)
          writes[src].append((key, dt, start + off, shape))
          locs.setdefault((key, src), Loc(("out", g, dt), start + off, shape, dt))
          locs[(key, (src + s) % devices)] = Loc(("recv", g, s, dt), off, shape, dt)
          off += size_of(key)
    for (dt, j), by_dev in sorted(packed_kept.items()):  # j: the lifetime interval
      lane = f"{dt}@kp#{j}"
      sizes[lane] = max(sum(size_of(key) for key in keys) for keys in by_dev.values())
      for d, keys in by_dev.items():
        off = 0
        for key in keys:
          shape = tuple(avals[key].shape)
          writes[d].append((key, lane, off, shape))
          locs[(key, d)] = Loc(("out", g, lane), off, shape, dt)
          off += size_of(key)
    for s, lane, by_src in msg_lanes:
      sizes[lane] = max(size_of(keys[0]) for keys in by_src.values())
      regions[(s, lane)] = (0, sizes[lane])
      for src, (key,) in by_src.items():
        shape, dt = tuple(avals[key].shape), lane_dtype(lane)
        writes[src].append((key, lane, 0, shape))
        locs.setdefault((key, src), Loc(("out", g, lane), 0, shape, dt))
        locs[(key, (src + s) % devices)] = Loc(("recv", g, s, lane), 0, shape, dt)
    for lane, by_dev in kept_lanes:
      sizes[lane] = max(size_of(keys[0]) for keys in by_dev.values())
      for d, (key,) in by_dev.items():
        shape = tuple(avals[key].shape)
        writes[d].append((key, lane, 0, shape))
        locs[(key, d)] = Loc(("out", g, lane), 0, shape, lane_dtype(lane))
    layouts.append(GroupLayout(tasks=tasks, sizes=sizes, regions=regions, writes=writes))
  return Structure(
    schedule=schedule, groups=layouts, locs=locs, reads=reads, makes=makes, avals=avals,
    ct_sources=ct_sources, loss_keys=loss_keys, loss_device=loss_device, devices=devices,
  )
