"""Cost models: the time of each op-graph node (forward + backward) and of moving its tensors.

Two sources of node times, one interface (`CostModel`):

- `AnalyticCostModel`: a roofline on a `hardware.Hardware` spec. The forward of a node takes
  `max(FLOPs / (peak_flops * efficiency), bytes / (mem_bandwidth * memory_efficiency))` plus a
  launch overhead per kernel; the backward is assumed to cost `backward_factor` times the forward
  (2x is the usual count for dense layers: one matmul for the input gradient and one for the
  weight gradient; Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1).
- `ProfiledCostModel`: compiles and times each node's forward + backward (`jax.vjp`) on the
  current backend, with random inputs of the node's shapes; times are cached on disk as JSON
  keyed by the node's fingerprint, the backend and the device kind. With `tasks=True` it times
  the F and B tasks apart (as the task-scheduled program runs them), so the forward share is
  measured, not assumed.

Transfers and all-reduces use the alpha-beta model of PAPER.md: a message of n bytes between two
devices takes `alpha + n / bandwidth`; a ring all-reduce of P bytes over W workers takes
`2 (W - 1) alpha + 2 (W - 1) / W * P / bandwidth` (Patarasuk & Yuan 2009; Thakur et al. 2005).
The links come from a `Hardware` spec or from `calibrate.calibrate_link` (a `Link`); the link
models and these formulas live in `jaxhybrid.costs.links`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax

from jaxhybrid import graph as graph_lib
from jaxhybrid.costs import hardware as hardware_lib
from jaxhybrid.costs.hardware import CACHE_ENV, DEFAULT_CACHE_DIR
from jaxhybrid.costs.links import (
  Interconnect,
  ring_allreduce_time_s,
  ring_bottleneck,
  transfer_time_s,
)
from jaxhybrid.costs.timing import (  # noqa: F401  (re-exported; tests patch them here)
  _is_float,
  _node_case,
  _random_input,
  cache_flush_bytes,
  dispatch_time_s,
  median_time_s,
  time_graph,
  time_node,
  time_node_split,
  time_node_tasks,
)
from jaxhybrid.graph import remat

log = logging.getLogger(__name__)

# Measured costs are cached under hardware.DEFAULT_CACHE_DIR (or $CACHE_ENV) with the CPU spec.
_CACHE_SCHEMA = 1


# ---- the interface ---------------------------------------------------------------------------


class CostModel:
  """Times of graph nodes and transfers on one kind of device (the planner's input).

  Attributes:
    source: 'analytic' or 'profiled'.
    hardware_name: the hardware the times are for (a `hardware` registry name or a device kind).
    link: the interconnect used by `transfer_time_s` and `allreduce_time_s`.
  """

  source: str = ""
  hardware_name: str = ""
  link: Interconnect

  def node_time_s(self, node: graph_lib.Node) -> float:
    """Forward + backward time of one node on one device, seconds."""
    raise NotImplementedError

  def transfer_time_s(self, nbytes: float, src: int, dst: int) -> float:
    """Time to move `nbytes` from device `src` to `dst` (0 when `src == dst`)."""
    return transfer_time_s(self.link, nbytes, src, dst)

  def step_time_s(self, graph: graph_lib.OpGraph) -> float:
    """Single-device step time: the sum of the node times (no overlap on one device)."""
    return sum(self.node_time_s(n) for n in graph.nodes)

  def allreduce_time_s(self, nbytes: float, workers: int) -> float:
    """Ring all-reduce of `nbytes` gradient bytes over `workers` (PAPER.md's T_ar(W))."""
    if workers == 1:
      return 0.0
    alpha, bw = ring_bottleneck(self.link, workers)
    return ring_allreduce_time_s(nbytes, workers, alpha, bw)


# ---- analytic --------------------------------------------------------------------------------

_KERNEL_PRIMS = frozenset({"dot_general", "conv_general_dilated"})


def kernel_count(eqns: Sequence[Any]) -> float:
  """Kernels one forward pass of `eqns` launches (for the per-op overhead).

  Assumption: each matmul or convolution is its own kernel and the remaining (elementwise,
  reduction, data movement) equations of one jaxpr level fuse into one kernel, as XLA's fusion
  mostly does; a scan launches its body `length` times; a while loop's body is counted once.
  """
  count, other = 0.0, False
  for e in eqns:
    name = e.primitive.name
    if name in _KERNEL_PRIMS:
      count += 1
    elif name == "scan":
      count += e.params["length"] * kernel_count(_sub(e.params["jaxpr"]).eqns)
    elif name == "cond":
      count += max(kernel_count(_sub(b).eqns) for b in e.params["branches"])
    elif subs := list(jax.extend.core.jaxprs_in_params(e.params)):
      count += sum(kernel_count(_sub(s).eqns) for s in subs)
    else:
      other = True
  return count + (1.0 if other else 0.0)


def _sub(j: Any) -> Any:
  return j.jaxpr if hasattr(j, "jaxpr") and not hasattr(j, "eqns") else j


class AnalyticCostModel(CostModel):
  """Roofline node times on a hardware spec (no measurement).

  Per node: `(1 + backward_factor) * (max(F / (peak * efficiency), B / (bw * memory_efficiency))
  + kernels * op_overhead_s)`, with F and B the node's forward FLOPs and bytes.
  """

  source = "analytic"

  def __init__(
    self,
    hardware: hardware_lib.Hardware | str,
    *,
    backward_factor: float = 2.0,
    memory_efficiency: float = 1.0,
    link: Interconnect | None = None,
  ):
    """Builds the model.

    Args:
      hardware: a spec or its registry name ('dgx1-v100', 'cpu', ...).
      backward_factor: backward FLOPs, bytes and kernels as a multiple of the forward's
        (assumption; 2.0: gradients w.r.t. inputs and weights each cost about one forward).
      memory_efficiency: achieved fraction of the memory bandwidth (assumption; 1.0 by default,
        the hardware's `efficiency` applies to FLOP/s only).
      link: interconnect for transfers; default: the hardware's own links.

    Raises:
      ValueError: for a negative `backward_factor` or a `memory_efficiency` outside (0, 1].
    """
    if isinstance(hardware, str):
      hardware = hardware_lib.get(hardware)
    if backward_factor < 0:
      raise ValueError(f"backward_factor={backward_factor} must be >= 0 (2.0 is the usual value).")
    if not 0 < memory_efficiency <= 1:
      raise ValueError(f"memory_efficiency={memory_efficiency} must be in (0, 1].")
    self.hardware = hardware
    self.hardware_name = hardware.name
    self.backward_factor = backward_factor
    self.memory_efficiency = memory_efficiency
    self.link = link if link is not None else hardware

  def forward_time_s(self, node: graph_lib.Node) -> float:
    """Roofline time of the node's forward pass alone."""
    hw = self.hardware
    compute = node.flops / (hw.peak_flops * hw.efficiency)
    memory = node.bytes_accessed / (hw.mem_bandwidth * self.memory_efficiency)
    return max(compute, memory) + kernel_count(node.eqns) * hw.op_overhead_s

  def node_time_s(self, node: graph_lib.Node) -> float:
    return (1.0 + self.backward_factor) * self.forward_time_s(node)

  def input_grad_time_s(self, node: graph_lib.Node) -> float:
    """B of a split schedule: half the backward (the input-cotangent product of each matmul)."""
    return 0.5 * self.backward_factor * self.forward_time_s(node)

  def weight_grad_time_s(self, node: graph_lib.Node) -> float:
    """W of a split schedule: the other half, or RECURRENT_W_SHARE of the backward for a node
    with a loop (its weight gradient needs the recurrent cotangent of every step)."""
    share = RECURRENT_W_SHARE if has_loop(node.eqns) else 0.5
    return share * self.backward_factor * self.forward_time_s(node)


# Share of a recurrent node's backward that its W task (weight gradients alone) costs
# (assumption, from the structure of an LSTM step's backward: four matmuls of about one size,
# the recurrent cotangent, the input cotangent and the two weight gradients; W needs three of
# them, B two). Measured on one core (costs.time_node_split, small presets), (B + W) / backward:
# BigLSTM's LSTM layers 1.23-1.33, GNMT's 1.05-1.44, 1.24 over GNMT's nodes.
RECURRENT_W_SHARE = 0.75


def has_loop(eqns: Sequence[Any]) -> bool:
  """Whether the equations hold a scan or while loop (at any depth)."""
  for e in eqns:
    if e.primitive.name in ("scan", "while"):
      return True
    if any(has_loop(_sub(j).eqns) for j in jax.extend.core.jaxprs_in_params(e.params)):
      return True
  return False


# ---- profiled --------------------------------------------------------------------------------


def _device_key() -> tuple[str, str]:
  dev = jax.devices()[0]
  return jax.default_backend(), dev.device_kind


def _safe(name: str) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class ProfiledCostModel(CostModel):
  """Node times measured on the current backend, cached on disk.

  The cache is one JSON file per (backend, device kind) in `cache_dir`, mapping a node's
  `OpGraph.node_fingerprint` to its measured forward + backward seconds with provenance. A node
  is measured at most once per cache (the first `node_time_s` call); later calls and later
  processes read the cache. `measured` counts the nodes this instance actually timed.
  """

  source = "profiled"

  def __init__(
    self,
    graph: graph_lib.OpGraph,
    *,
    cache_dir: str | os.PathLike | None = None,
    repeats: int = 5,
    warmup: int = 2,
    warmup_s: float = 0.0,
    link: Interconnect | None = None,
    subtract_dispatch: bool = True,
    branch_remat: str = "none",
    tasks: bool = False,
    flush_bytes: int | str = 0,
    min_time_s: float = 0.0,
  ):
    """Builds the model (measures nothing until a node time is asked for).

    Args:
      graph: the graph whose nodes will be timed (`node_time_s` takes its nodes).
      cache_dir: directory of the JSON cache; default `$JAXHYBRID_PROFILE_CACHE` or
        `~/.cache/jaxhybrid/profiles`.
      repeats: timed runs per node; the median is kept.
      warmup: untimed runs first (the first one compiles).
      warmup_s: keep making untimed runs until they have taken this long (assumption, per timed
        function; 0: `warmup` runs only). On this project's one-core CPU VM a 65 ms node's first
        timed runs after 2 warm-up runs were 10-50 % above its steady time for about a second
        (five processes: first median-of-5 70-99 ms, then 55-68 ms); bench_mp uses 1 s.
      link: interconnect for transfers, e.g. `calibrate.calibrate_link(...)` or a Hardware;
        default: the measured `hardware.get('cpu')` on CPU, else a `Link` must be given.
      subtract_dispatch: subtract the time of a jitted no-op from each node time (assumption:
        inside one compiled step the nodes pay no per-call dispatch).
      branch_remat: time nodes rematerialised under this `HybridProgram.build` policy name
        (cached apart from the plain times).
      tasks: time each node's F and B tasks apart, as the task-scheduled hybrid program runs
        them (`time_node_tasks`; cached apart): `node_time_s` is then F + B and the model has
        `forward_time_s` (the measured F), which the planner and `program.lockstep` use instead
        of the assumed forward share, and `input_grad_time_s` / `weight_grad_time_s`, the B and
        W of split (zero-bubble) schedules (`time_node_split`, timed on first use). Default
        False: forward and backward compiled together, as one device's plain step runs them.
      flush_bytes: before every timed run, write a buffer of this many bytes (untimed), so each
        run starts with the node's data out of the core's caches, as a task inside the program
        does after other tasks (assumption, measured on this project's one-core CPU processes:
        a 256-wide tanh layer's F + B at 1,024 rows took 2.4 ms back to back and 3.1 ms after
        writing 64 MiB, 1.3x; at 512 wide 1.08x). 0 (default): back to back, as before.
        'auto': on the CPU backend `cache_flush_bytes()` (1.5x the host's largest cache;
        bench_mp's default), elsewhere 0 (a device's own caches are not sized here). Cached
        apart from the back-to-back times.
      min_time_s: after `repeats` timed runs, keep timing a function until its timed runs add
        up to this many seconds (`timing.median_time_s`; assumption). Five runs of a 3 ms node
        span 15 ms, a moment of whatever the other core runs: on this project's 2-core VM, with
        a second process running the model's step, the uniform chain's layer (one profile for
        all eight layers) was 2.85 ms in one bench_mp run and 2.35 ms in the next, and the
        plan's predicted step moved with it. 0 (default): exactly `repeats` runs. Cached apart.

    Raises:
      ValueError: for `repeats` < 1 or `warmup` < 1, or no link on a non-CPU backend.
    """
    self.backend, self.device_kind = _device_key()
    if flush_bytes == "auto":
      flush_bytes = cache_flush_bytes() if self.backend == "cpu" else 0
    elif isinstance(flush_bytes, str):
      raise ValueError(f"flush_bytes={flush_bytes!r}: give a byte count >= 0 or 'auto'.")
    if repeats < 1 or warmup < 1 or warmup_s < 0 or flush_bytes < 0 or min_time_s < 0:
      raise ValueError(
        f"repeats={repeats}, warmup={warmup}, warmup_s={warmup_s}, flush_bytes={flush_bytes}, "
        f"min_time_s={min_time_s}: repeats and warmup must be >= 1 (warm-up compiles the node), "
        "warmup_s, flush_bytes and min_time_s >= 0."
      )
    self.graph = graph
    self.repeats, self.warmup, self.warmup_s = repeats, warmup, float(warmup_s)
    self.flush_bytes = int(flush_bytes)
    self.min_time_s = float(min_time_s)
    self.subtract_dispatch = subtract_dispatch
    remat.remat_policy(branch_remat)  # validates the name
    self.branch_remat = branch_remat
    self.tasks = bool(tasks)
    if self.tasks:  # attributes only here: callers test hasattr(costs, "forward_time_s")
      self.forward_time_s = self._forward_time_s
      self.input_grad_time_s = lambda node: self._split(node)[0]
      self.weight_grad_time_s = lambda node: self._split(node)[1]
    self.hardware_name = self.device_kind
    if link is None:
      if self.backend != "cpu":
        raise ValueError(
          f"no link model for backend {self.backend!r}: pass link=calibrate.calibrate_link(...) "
          "or link=hardware.get(...)."
        )
      link = hardware_lib.get("cpu")
    self.link = link
    root = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV, DEFAULT_CACHE_DIR)
    self.cache_dir = pathlib.Path(root).expanduser()
    self.cache_path = self.cache_dir / f"{_safe(self.backend)}-{_safe(self.device_kind)}.json"
    self._times: dict[str, tuple[float, ...]] = {}  # fingerprint -> (F + B, F) or split (B, W)
    self._dispatch: float | None = None
    self.measured = 0

  def _read(self) -> dict[str, Any]:
    """The cache file's contents ({} if missing, unreadable or of another schema)."""
    try:
      data = json.loads(self.cache_path.read_text())
    except FileNotFoundError:
      return {}
    except (OSError, json.JSONDecodeError) as e:
      log.warning("ignoring unreadable profile cache %s: %s", self.cache_path, e)
      return {}
    return data if data.get("schema") == _CACHE_SCHEMA else {}

  def _load(self) -> dict[str, Any]:
    return self._read().get("nodes", {})

  def _store(self, fingerprint: str, entry: dict[str, Any], section: str = "nodes") -> None:
    """Adds `entry` under `fingerprint` to the cache's `section` ('nodes', or 'dispatch': the
    dispatch time per JAX version)."""
    self.cache_dir.mkdir(parents=True, exist_ok=True)
    old = self._read()
    data = {
      "schema": _CACHE_SCHEMA, "backend": self.backend, "device_kind": self.device_kind,
      "nodes": old.get("nodes", {}),
    }
    if old.get("dispatch"):
      data["dispatch"] = old["dispatch"]
    data.setdefault(section, {})[fingerprint] = entry
    fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, self.cache_path)  # atomic: concurrent readers see the old or the new file

  def _measured(self, node: graph_lib.Node) -> tuple[float, float]:
    """(F + B, F) seconds of `node`, dispatch subtracted (F is the measured F only with `tasks`)."""
    fp = self.graph.node_fingerprint(node)
    if self.branch_remat != "none":
      fp += f"|remat={self.branch_remat}"
    if self.tasks:
      fp += "|tasks"
    fp += self._timing_key()
    if fp in self._times:
      return self._times[fp]
    entry = self._load().get(fp)
    if entry is None:
      policy = remat.remat_policy(self.branch_remat)
      entry = {
        "name": node.name, "repeats": self.repeats, "warmup_s": self.warmup_s,
        "jax": jax.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
      }
      if self.tasks:
        f, b = time_node_tasks(self.graph, node, policy=policy, **self._timing())
        entry.update(raw_s=f + b, forward_raw_s=f, backward_raw_s=b)
      else:
        entry["raw_s"] = time_node(self.graph, node, policy=policy, **self._timing())
      self.measured += 1
      self._store(fp, entry)
      log.info("profiled node %s: %.3g ms", node.name, entry["raw_s"] * 1e3)
    if self.tasks:
      # Two calls (F and B), each paying the dispatch that a compiled step does not.
      parts = [entry["forward_raw_s"], entry["backward_raw_s"]]
    else:
      parts = [entry["raw_s"]]
    parts = self._less_dispatch(parts)
    self._times[fp] = (sum(parts), parts[0])
    return self._times[fp]

  def _split(self, node: graph_lib.Node) -> tuple[float, ...]:
    """(B, W) seconds of `node` in a split schedule (`time_node_split`), dispatch subtracted."""
    fp = self.graph.node_fingerprint(node) + "|split"
    if self.branch_remat != "none":
      fp += f"|remat={self.branch_remat}"
    fp += self._timing_key()
    if fp in self._times:
      return self._times[fp]
    entry = self._load().get(fp)
    if entry is None:
      b, w = time_node_split(self.graph, node, policy=remat.remat_policy(self.branch_remat),
                             **self._timing())
      entry = {"name": node.name, "repeats": self.repeats, "warmup_s": self.warmup_s,
               "jax": jax.__version__,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "input_grad_raw_s": b, "weight_grad_raw_s": w}
      self.measured += 1
      self._store(fp, entry)
    self._times[fp] = tuple(self._less_dispatch(
      [entry["input_grad_raw_s"], entry["weight_grad_raw_s"]]))
    return self._times[fp]

  def _timing_key(self) -> str:
    """The cache key's suffix for timing options that change a measured time."""
    key = f"|flush={self.flush_bytes}" if self.flush_bytes else ""
    return key + (f"|min_time={self.min_time_s:g}" if self.min_time_s else "")

  def _timing(self) -> dict[str, Any]:
    """The keyword arguments of every `timing` call (how many runs, warm-up, flushing)."""
    return {"warmup": self.warmup, "repeats": self.repeats, "warmup_s": self.warmup_s,
            "flush_bytes": self.flush_bytes, "min_time_s": self.min_time_s}

  def _less_dispatch(self, parts: list[float]) -> list[float]:
    """Each separately timed call less the dispatch a compiled step does not pay (if asked).

    The dispatch time is cached beside the node times (the file's 'dispatch' section, one entry
    per JAX version), so every cost model reading the same cache prices the same: measured
    afresh by each process, it moved bench_mp's re-priced steps by 0.3-0.6 % with no node timed
    again.
    """
    if not self.subtract_dispatch:
      return parts
    if self._dispatch is None:
      entry = self._read().get("dispatch", {}).get(jax.__version__)
      if entry is None:
        entry = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "raw_s": dispatch_time_s()}
        self._store(jax.__version__, entry, section="dispatch")
      self._dispatch = float(entry["raw_s"])
    return [max(t - self._dispatch, 0.0) for t in parts]

  def node_time_s(self, node: graph_lib.Node) -> float:
    return self._measured(node)[0]

  def _forward_time_s(self, node: graph_lib.Node) -> float:
    """The measured F task of `node` (only with `tasks=True`; see __init__)."""
    return self._measured(node)[1]

  def whole_step_time_s(self, graph: graph_lib.OpGraph | None = None) -> float:
    """`graph`'s (default: this model's graph) forward + backward timed whole, seconds.

    One compiled function of the entire traced loss (`timing.time_graph`), as one device's plain
    `jax.jit` step computes it before the optimizer update; cached like the node times (key: a
    hash of the whole jaxpr), one dispatch subtracted if asked. The reference for speedups over
    one device: `step_time_s` (the sum of the node times) misses what XLA fuses across nodes.
    """
    graph = self.graph if graph is None else graph
    fp = hashlib.sha256(str(graph.closed_jaxpr).encode()).hexdigest()[:16] + "|whole" + self._timing_key()
    if fp not in self._times:
      entry = self._load().get(fp)
      if entry is None:
        raw = time_graph(graph, **self._timing())
        entry = {"name": "<whole step>", "repeats": self.repeats, "warmup_s": self.warmup_s,
                 "jax": jax.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "raw_s": raw}
        self.measured += 1
        self._store(fp, entry)
        log.info("profiled the whole step: %.3g ms", raw * 1e3)
      self._times[fp] = tuple(self._less_dispatch([entry["raw_s"]]))
    return self._times[fp][0]

  def profile_all(self) -> list[float]:
    """Times (or reads from the cache) every node of the graph; returns the times in node order."""
    return [self.node_time_s(n) for n in self.graph.nodes]
