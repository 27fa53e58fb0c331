"""The Plan: an immutable placement + schedule with its provenance, JSON and a text summary."""

from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any, Mapping

from jaxhybrid.planner.core.schedule import Task, Transfer
from jaxhybrid.planner.core.task_schedule import TaskSchedule

# 2: adds `task_schedule` (the F/B/W tasks the program runs). Version-1 plans still load; their
# program runs GPipe (all forwards, then all backwards), which is what version-1 programs ran.
# Version 2 also carries, optionally, the lock-step fields (`lockstep_step_s`, `lockstep_speedup`,
# `lockstep_bound_s`, `device_peak_bytes`, `memory_caps_bytes`, `lockstep_baselines`,
# `lockstep_found_by`): additive, with defaults, so version-2 plans written before them load with
# them empty (0.0 = not priced) and the version number stays (programs and tests key on it).
# The same holds for `task_schedule.groups` (explicit lock-step groups, lockstep_cpsat): absent,
# the program derives the groups from the orders; present, it runs them, and `lockstep_step_s`
# prices them (a reader that ignores them would price and run the derived groups instead).
# 3: adds `shards` (parameter leaves split into one piece per model device, each piece a node of
# its own; `jaxhybrid.graph.shard`). Version-1 and -2 plans load with no leaf split.
# 4: one predicted step. `predicted_step_s` / `predicted_speedup` are the price of the lock-step
# schedule the program runs (`lockstep_step_s`, `lockstep_speedup`) whenever the plan is priced
# in lock step; the fused task model's makespan, which earlier versions stored under those names,
# is `fused_makespan_s` / `fused_speedup` (the search's warm start, not what runs). Older plans
# load with their `predicted_*` figures moved to the `fused_*` fields.
# 5: adds `batch_splits` (nodes split by rows of the micro-batch, one piece per model device;
# `jaxhybrid.graph.batch_split`). Older plans load with no node split.
# 6: a batch split's entry may carry `split_params` and `param_nodes` (the node's parameters
# stored in M slices held by M nodes; `split_batch(params='split')`), which version-5 readers
# would drop. Older plans load with every split node's parameters replicated.
SCHEMA_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """Where each node runs and when, as predicted by the planner."""

  # Version of the JSON layout; bumped on incompatible changes.
  schema_version: int = SCHEMA_VERSION
  # Module path of each node (node id = index).
  node_names: tuple[str, ...]
  # Device on the model axis of each node.
  assignment: tuple[int, ...]
  # Every (node, micro-batch) task, sorted by start time.
  schedule: tuple[Task, ...]
  # Cross-device edges of the schedule (activation forward + gradient backward).
  transfers: tuple[Transfer, ...] = ()
  # M and k.
  devices: int
  microbatches: int
  # p_i (forward + backward, one micro-batch) and m_i (bytes on the device) per node.
  node_compute_s: tuple[float, ...]
  node_memory_bytes: tuple[float, ...]
  # The fused task model's schedule: its makespan C (the planner's asynchronous schedule, the
  # lock-step search's warm start; not what the program runs), one device's step time
  # (k sum_i p_i), their ratio. The prediction is `predicted_step_s` (below).
  fused_makespan_s: float
  single_device_s: float
  fused_speedup: float
  # A proven lower bound on the makespan of any placement.
  lower_bound_s: float
  # How the plan was found: method ('milp', 'etf', ...), solver, status ('optimal': gap within
  # the tolerance; 'feasible': stopped by the time limit with a larger gap; 'heuristic': a
  # heuristic's plan, asked for or returned because the MILP had no incumbent), the relative gap
  # (C - lower_bound_s) / C, and the wall-clock time of the search.
  method: str
  solver: str
  status: str
  gap: float
  solve_time_s: float
  # Makespan of each heuristic (name -> seconds; absent when it could not respect memory caps).
  heuristics: Mapping[str, float] = dataclasses.field(default_factory=dict)
  # Which search produced the returned schedule: 'milp' for the block decomposition (one
  # micro-batch) or a pipelined MILP that improved on its warm start's makespan, else the name in
  # `heuristics` of the schedule returned (e.g. 'cpsat' when the MILP could not beat it); '' in
  # plans written before this field existed.
  found_by: str = ""
  # The task schedule the program runs: a TaskSchedule (per device its F/B/W tasks in order), or
  # the name of a generator ('gpipe', '1f1b', 'zb') applied to this placement when the program
  # is built; '' = the program's default.
  task_schedule: TaskSchedule | str = ""
  # Provenance of the inputs.
  graph_fingerprint: str = ""
  cost_source: str = ""
  hardware: str = ""
  # ---- The program's step (optional in schema 2): the price of the F/B/W `task_schedule` the
  # program runs, in lock step (`predicted_step_s`). ----
  # Lock-step price of `task_schedule` on `assignment` (planner.price.lockstep_price: groups'
  # busiest devices + messages; no per-byte optimizer/fill passes); 0.0 = not priced.
  lockstep_step_s: float = 0.0
  # single_device_s / lockstep_step_s; 0.0 = not priced.
  lockstep_speedup: float = 0.0
  # A proven lower bound on the lock-step price of any plan within the memory caps (the F/B/W
  # MILP's for small problems, else fbw_search.simple_bound); 0.0 = none.
  lockstep_bound_s: float = 0.0
  # Planner memory per device (price.peak_memory_bytes: the longest device's static bytes, as
  # every device allocates rows that long, + the lock-step groups' buffers and windows at their
  # peak, + Problem.held_bytes), bytes; () = not computed.
  device_peak_bytes: tuple[float, ...] = ()
  # The caps the plan was made under (bytes per device); () = none.
  memory_caps_bytes: tuple[float, ...] = ()
  # Lock-step prices of 'gpipe', '1f1b' and 'zb' on the best contiguous split within the caps.
  lockstep_baselines: Mapping[str, float] = dataclasses.field(default_factory=dict)
  # Which search found (assignment, task_schedule) and with which schedule, e.g. 'cpsat/1f1b'.
  lockstep_found_by: str = ""
  # ---- The one-device reference (optional in schema 2; set by jaxhybrid.parallelize). ----
  # One device running the worker's whole batch in one pass (k = 1), forward + backward, as a
  # plain `jax.jit` step runs it: what a speedup over one device is measured against.
  # `single_device_s` above is k micro-batches run one after another, node by node, which a
  # user would not run. 0.0 = not priced.
  reference_step_s: float = 0.0
  # How: 'whole-step profile' (the traced loss timed as one compiled function, XLA fusing
  # across nodes: costs.ProfiledCostModel.whole_step_time_s) or 'node sum' (the cost model's
  # nodes of the whole-batch graph, e.g. analytic costs).
  reference_source: str = ""
  # ---- Split leaves (schema 3): per leaf, `jaxhybrid.graph.shard.LeafShard.to_json()`; the
  # graph the plan places is the traced graph with these leaves split (`shard.apply`).
  shards: tuple[Mapping[str, Any], ...] = ()
  # Leaves large enough to be offered (`shard_min_fraction`) that no rule could split, with the
  # reason, as (path, reason) pairs (schema 4, optional: () when none or not recorded).
  shard_skipped: tuple[tuple[str, str], ...] = ()
  # ---- Nodes split by rows (schema 5): per node, `jaxhybrid.graph.batch_split.NodeSplit
  # .to_json()`; applied to the traced graph before the leaves are split (`batch_split.apply`).
  batch_splits: tuple[Mapping[str, Any], ...] = ()

  @property
  def predicted_step_s(self) -> float:
    """The plan's predicted step: the lock-step price of the schedule the program runs (what the
    planner minimised); for a plan not priced in lock step (objective 'fused'), the fused
    schedule's makespan, which is then what the planner minimised."""
    return self.lockstep_step_s or self.fused_makespan_s

  @property
  def predicted_speedup(self) -> float:
    """single_device_s / predicted_step_s (k micro-batches run node by node on one device; see
    `reference_speedup` for the speedup over a plain one-device step)."""
    return self.lockstep_speedup if self.lockstep_step_s else self.fused_speedup

  @property
  def reference_speedup(self) -> float:
    """reference_step_s / lockstep_step_s: the plan's predicted speedup over one device's plain
    step (0.0 when either is not priced)."""
    if not (self.reference_step_s and self.lockstep_step_s):
      return 0.0
    return self.reference_step_s / self.lockstep_step_s

  def __post_init__(self):
    object.__setattr__(self, "heuristics", types.MappingProxyType(dict(self.heuristics)))
    object.__setattr__(self, "lockstep_baselines",
                       types.MappingProxyType(dict(self.lockstep_baselines)))

  def device_loads(self) -> list[float]:
    """Seconds of compute per device (all micro-batches)."""
    load = [0.0] * self.devices
    for t in self.schedule:
      load[t.device] += t.end_s - t.start_s
    return load

  def device_memory(self) -> list[float]:
    """Bytes held per device."""
    mem = [0.0] * self.devices
    for i, d in enumerate(self.assignment):
      mem[d] += self.node_memory_bytes[i]
    return mem

  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["schedule"] = [dataclasses.asdict(t) for t in self.schedule]
    out["transfers"] = [dataclasses.asdict(t) for t in self.transfers]
    out["heuristics"] = dict(self.heuristics)
    out["lockstep_baselines"] = dict(self.lockstep_baselines)
    out["device_peak_bytes"] = list(self.device_peak_bytes)
    out["memory_caps_bytes"] = list(self.memory_caps_bytes)
    out["shards"] = [dict(x) for x in self.shards]
    out["batch_splits"] = [dict(x) for x in self.batch_splits]
    out["shard_skipped"] = [list(x) for x in self.shard_skipped]
    # Derived (read-only): written for readers of the JSON, ignored when loading version 4.
    out["predicted_step_s"] = self.predicted_step_s
    out["predicted_speedup"] = self.predicted_speedup
    ts = self.task_schedule
    out["task_schedule"] = ts.to_dict() if isinstance(ts, TaskSchedule) else ts
    for key in ("node_names", "assignment", "node_compute_s", "node_memory_bytes"):
      out[key] = list(out[key])
    return out

  def to_json(self) -> str:
    """JSON text; `Plan.from_json` restores an equal Plan."""
    return json.dumps(self.to_dict(), indent=1)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Plan:
    """Inverse of `to_dict`.

    Raises:
      ValueError: unknown schema version or malformed fields.
    """
    version = data.get("schema_version")
    if version not in READABLE_VERSIONS:
      raise ValueError(
        f"Plan schema_version {version!r}; this planner reads {', '.join(map(str, READABLE_VERSIONS))}."
      )
    kw = dict(data)
    kw["schema_version"] = SCHEMA_VERSION
    if version < 4:  # the fused figures had the prediction's names
      kw.setdefault("fused_makespan_s", kw.get("predicted_step_s"))
      kw.setdefault("fused_speedup", kw.get("predicted_speedup"))
    kw.pop("predicted_step_s", None)
    kw.pop("predicted_speedup", None)
    ts = data.get("task_schedule", "gpipe" if version == 1 else "")
    kw["task_schedule"] = TaskSchedule.from_dict(ts) if isinstance(ts, dict) else str(ts)
    try:
      kw["schedule"] = tuple(Task(**t) for t in data["schedule"])
      kw["transfers"] = tuple(Transfer(**t) for t in data.get("transfers", ()))
      for key in ("node_names", "assignment", "node_compute_s", "node_memory_bytes"):
        kw[key] = tuple(data[key])
      for key in ("device_peak_bytes", "memory_caps_bytes"):
        kw[key] = tuple(data.get(key, ()))
      kw["shards"] = tuple(dict(x) for x in data.get("shards", ()))
      kw["shard_skipped"] = tuple((str(p), str(r)) for p, r in data.get("shard_skipped", ()))
      kw["batch_splits"] = tuple(dict(x) for x in data.get("batch_splits", ()))
      return cls(**kw)
    except (KeyError, TypeError) as err:
      raise ValueError(f"Malformed plan: {err}") from err

  @classmethod
  def from_json(cls, text: str) -> Plan:
    """Parses `to_json` output."""
    return cls.from_dict(json.loads(text))

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes the JSON to `path`."""
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> Plan:
    """Reads a plan written by `save`.

    Raises:
      ValueError: the file is not a valid plan (the message names the file).
    """
    with open(path) as f:
      text = f.read()
    try:
      return cls.from_json(text)
    except (ValueError, AttributeError) as err:
      raise ValueError(f"{os.fspath(path)} is not a valid plan: {err}") from err

  def shard_devices(self) -> list[list[int]]:
    """Per split leaf, the device of each of its pieces (all equal: the leaf is kept whole on
    that device; different: it is sharded)."""
    where = dict(zip(self.node_names, self.assignment))
    return [[int(where[n]) for n in s.get("shard_nodes", ()) if n in where] for s in self.shards]

  def _shard_lines(self) -> list[str]:
    out = []
    for s, devs in zip(self.shards, self.shard_devices()):
      spread = len(set(devs))
      how = (f"kept whole on device {devs[0]}" if spread == 1 else
             f"sharded over {spread} devices (pieces on {devs})")
      out.append(f"  leaf {s['path']}: {s['rule']} split on axis {s['axis']}, {how}")
    out += [f"  leaf {path}: kept whole, no shard rule applies ({why})"
            for path, why in self.shard_skipped]
    where = dict(zip(self.node_names, self.assignment))
    for s in self.batch_splits:
      devs = [int(where[n]) for n in s.get("piece_nodes", ()) if n in where]
      how = (f"all rows on device {devs[0]}" if len(set(devs)) == 1 else
             f"rows over {len(set(devs))} devices (pieces on {devs})")
      held = [int(where[n]) for n in s.get("param_nodes", ()) if n in where]
      if held:
        how += (f", {len(s['split_params'])} parameter leaves in {len(held)} slices on devices "
                f"{held}")
      out.append(f"  node {s['node']}: batch split, {how}")
    return out

  def _schedule_name(self) -> str:
    ts = self.task_schedule
    return ts.kind if isinstance(ts, TaskSchedule) else str(ts)

  def summary(self) -> str:
    """Node -> device table, per-device load and memory, and the solver's report."""
    lines = [
      f"Plan: {len(self.node_names)} nodes on {self.devices} devices, "
      f"{self.microbatches} micro-batch(es); method={self.method} solver={self.solver} "
      f"status={self.status} gap={self.gap:.2%} time={self.solve_time_s:.2f}s"
      + (f" found_by={self.found_by}" if self.found_by else "")
      + (f" schedule={self._schedule_name()}" if self.task_schedule else ""),
    ]
    if self.lockstep_step_s:
      # One prediction: the price of the lock-step schedule the program runs (what the planner
      # minimised). The fused task model only seeds the search and is labelled as such.
      if self.reference_speedup:
        vs = (f"speedup {self.reference_speedup:.3f}x over one device's plain step "
              f"({self.reference_step_s * 1e3:.3f} ms, {self.reference_source})")
        if self.reference_speedup < 1 and self.microbatches > 1:
          # The fall-back to one device compares with one device running the same micro-batches
          # (the same program on one device); say so, and what would beat the plain step.
          vs += (f" [slower than the plain step; {self.lockstep_speedup:.3f}x over one device "
                 f"running the same {self.microbatches} micro-batches "
                 f"({self.single_device_s * 1e3:.3f} ms): fewer micro-batches or a data-parallel "
                 "mesh may run faster]")
      else:
        vs = (f"speedup {self.lockstep_speedup:.3f}x over one device "
              f"({self.single_device_s * 1e3:.3f} ms, node sum)")
      lines += [
        f"  predicted step {self.lockstep_step_s * 1e3:.3f} ms (the program's lock-step "
        f"schedule, found by {self.lockstep_found_by}), {vs}; lower bound "
        f"{self.lockstep_bound_s * 1e3:.3f} ms",
        "  lock-step baselines on the best contiguous split: "
        + ", ".join(f"{k}={v * 1e3:.3f} ms" for k, v in self.lockstep_baselines.items()),
        f"  fused task model (the search's warm start, not what runs): makespan "
        f"{self.fused_makespan_s * 1e3:.3f} ms, its bound {self.lower_bound_s * 1e3:.3f} ms; "
        "heuristics: " + ", ".join(f"{k}={v * 1e3:.3f} ms" for k, v in self.heuristics.items()),
      ]
    else:
      lines += [
        f"  predicted step {self.fused_makespan_s * 1e3:.3f} ms (fused task model), one device "
        f"{self.single_device_s * 1e3:.3f} ms, MP speedup {self.fused_speedup:.3f}x, "
        f"lower bound {self.lower_bound_s * 1e3:.3f} ms",
        "  heuristics: " + ", ".join(f"{k}={v * 1e3:.3f} ms" for k, v in self.heuristics.items()),
      ]
    lines += [
      f"  costs: {self.cost_source} {self.hardware}; graph {self.graph_fingerprint}",
    ]
    lines += self._shard_lines()
    width = max((len(n) for n in self.node_names), default=4)
    for i, name in enumerate(self.node_names):
      lines.append(
        f"  {name:<{width}} -> {self.assignment[i]}   "
        f"{self.node_compute_s[i] * 1e3:9.3f} ms  {self.node_memory_bytes[i] / 2**20:10.1f} MiB"
      )
    for d, (load, mem) in enumerate(zip(self.device_loads(), self.device_memory())):
      busy = load / self.fused_makespan_s if self.fused_makespan_s else 0.0
      peak = (f", peak over the schedule {self.device_peak_bytes[d] / 2**20:.1f} MiB"
              if d < len(self.device_peak_bytes) else "")
      cap = (f" (cap {self.memory_caps_bytes[d] / 2**20:.1f} MiB)"
             if d < len(self.memory_caps_bytes) else "")
      lines.append(
        f"  device {d}: load {load * 1e3:.3f} ms ({busy:.0%} busy), memory {mem / 2**20:.1f} MiB"
        + peak + cap
      )
    return "\n".join(lines)
