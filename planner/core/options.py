"""Options of the placement planner and its typed errors."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

METHODS = ("milp", "etf", "dp", "interleaved", "single", "local")
OBJECTIVES = ("lockstep", "makespan")
# memory_caps_bytes sentinel: cap every device at the hardware's device memory (Problem.
# device_memory_bytes, from the cost model's hardware spec); no cap when it is unknown (0).
DEVICE_MEMORY = "device"
SOLVERS = ("cbc", "highs")


class InfeasibleError(ValueError):
  """No placement satisfies the per-device memory caps.

  The message says which node or which total does not fit and by how many bytes.
  """


def size_text(b: float) -> str:
  """Bytes for a message, in the unit that keeps them readable ('5.50 GiB', '110.00 MiB')."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(b) >= scale:
      return f"{b / scale:.2f} {unit}"
  return f"{b:.0f} bytes"


def describe_caps(caps) -> str:
  """Per-device memory caps for a message: '5.50 GiB per device', or each device's."""
  if not caps:
    return "no cap"
  if max(caps) - min(caps) <= 0.001 * max(caps):
    return f"{size_text(caps[0])} per device"
  return "(" + ", ".join(size_text(c) for c in caps) + ") per device"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerOptions:
  """How `place` searches for a placement.

  The MILP follows PAPER.md ("DLPlacer"); the knobs below that the paper does not pin down are
  assumptions, each documented where it is declared.
  """

  # M: number of devices on the model axis of one data-parallel worker.
  devices: int = 2
  # Called as progress(phase, incumbent_s, bound_s) after each phase of the solve with the best
  # step time found so far (inf: none yet) and the proven lower bound; None: no reports. A UI
  # (jaxhybrid.train.solve_progress) draws it; the planner knows nothing of terminals.
  progress: Callable[[str, float, float], None] | None = dataclasses.field(
    default=None, compare=False, repr=False)
  # k: micro-batches a worker's batch is split into (GPipe-style pipelining); all micro-batches
  # of a node run on the node's device, one after the other.
  microbatches: int = 1
  # Wall-clock budget of the whole search (heuristics + MILP), seconds; `place` returns within
  # it plus about 5 % (solvers overrun their limits a little, and the plan is built after).
  time_limit_s: float = 60.0
  # Solver threads; 1 keeps runs reproducible.
  threads: int = 1
  # Seed of the solver and of the randomised local search.
  seed: int = 0
  # Relative optimality gap at which the MILP may stop early.
  gap: float = 0.01
  # Per-device memory caps in bytes: one value for all devices (an int, or a float such as 16e9,
  # kept as its int), or one per device; DEVICE_MEMORY
  # ('device', the default) = the hardware's device memory when the cost model knows it; None or
  # 0 = no cap.
  memory_caps_bytes: int | tuple[int, ...] | str | None = DEVICE_MEMORY
  # MILP backend: 'cbc' (ships with python-mip) or 'highs' (`pip install 'jaxhybrid[highs]'`:
  # mip[highs], plus highsbox, which python-mip 2.0 loads HiGHS from on Linux).
  solver: str = "cbc"
  # Solver cut generation: -1 automatic, 0 off, 1..3 more aggressive. Off by default: on the
  # small disjunctive block models CBC's cuts cost more than they save (measured here: a 9-node
  # block on 2 devices in 0.5 s instead of 2.5 s).
  cuts: int = 0
  # 'milp' (DLPlacer), or one heuristic alone: 'etf', 'dp', 'interleaved', 'single', 'local'.
  method: str = "milp"
  # Assumption: times each cross-device edge is paid per micro-batch. The training step sends the
  # activation forward and its gradient backward, so the transfer time counts twice by default.
  transfer_directions: float = 2.0
  # Assumption: optimizer state bytes per parameter byte (Adam: 2 moments; AdaGrad/momentum: 1).
  optimizer_state_factor: float = 2.0
  # Assumption: gradient bytes per parameter byte (one gradient buffer of the parameters' size).
  gradient_factor: float = 1.0
  # Parameter leaves of this many bytes or more lie in a row of their own and are read in place
  # (the program's slot rows: `parallelize` passes jaxhybrid.program.structure.SLOT_MIN_BYTES);
  # smaller ones lie in the packed row and the tasks that read them whole copy them out. None:
  # every leaf in the packed row.
  slot_min_bytes: int | None = 1 << 20
  # With one micro-batch, a leaf with a row of its own read by one node gets its whole gradient
  # as one window, with no accumulator row (the program does so outside ZeRO: `parallelize`
  # passes False under ZeRO). False: every leaf has a gradient row (`gradient_factor`).
  single_window_gradients: bool = True
  # (graph, node) -> bytes the node's F task and its B task need beyond their inputs and outputs
  # while they run (XLA's temporaries; a W task is taken to need what B does). `parallelize`
  # passes the program's compiled figure when the model's memory nears the cap
  # (jaxhybrid.program.fit.planner_task_temp). None: not counted.
  task_temp: Any = None
  # Seconds each lock-step group costs on several devices beyond its tasks and its messages' link
  # time (the devices meeting; measured: jaxhybrid.program.group_cost). Added to the lock-step
  # price, as the program's price (program.lockstep.PassCosts.group_s) adds it. 0: not counted.
  group_s: float = 0.0
  # Seconds each task costs on several devices beyond its profiled time (its place in the
  # group's branch; measured with group_s), added to its device's time in each group.
  task_fixed_s: float = 0.0
  # What a node keeps per micro-batch in flight, from its forward to its backward: 'saved' =
  # its outputs plus the residuals its pullback holds, traced from the node's jaxpr
  # (`OpGraph.saved_bytes`; an LSTM layer keeps every step's gates, ~100x its output);
  # 'outputs' = its outputs only (also used for graphs that cannot trace their nodes).
  activation_model: str = "saved"
  # Assumption: a multiplier on those bytes (1: as counted).
  activation_factor: float = 1.0
  # Use the exact block decomposition at cut vertices (one micro-batch, no binding memory cap).
  decompose: bool = True
  # Most ordering binaries in one pipelined MILP; beyond it the orderings of task pairs that are
  # far apart in the warm start are fixed (a restricted search whose bound is not used for the gap).
  max_free_pairs: int = 4000
  # Share of the time limit given to the local-search heuristic with one micro-batch (a warm
  # start only: the decomposition is exact there).
  local_search_share: float = 0.1
  # Share of the time limit given to the local search with k > 1 micro-batches: a quick
  # annealing whose best schedule seeds the CP-SAT search.
  pipeline_search_share: float = 0.05
  # Share of the time limit given, with k > 1, to the window descent that follows the annealing
  # (heuristics.window_search: every placement of w consecutive nodes, M^w at most
  # max_window_placements); 0 skips it. Before the CP-SAT search existed it took 0.4 and found
  # most of the improvement on Inception-V3 (M = 2, k = 4, 60 s: gaps of 3.9-5.3 % against 4.2-4.8
  # % for annealing alone); CP-SAT now does that job better (see cpsat_share).
  window_search_share: float = 0.0
  # Most placements the window descent tries per window (sets the window length w).
  max_window_placements: int = 512
  # Independent annealing runs (seeds seed, seed + 1, ...) sharing that time when k > 1: single
  # runs vary by several percent on the paper's graphs, the best of a few much less.
  search_chains: int = 2
  # Share of the time limit, with k > 1, for the CP-SAT search (cpsat.py) that starts from the
  # annealing's best and warm-starts the MILP; 0 turns it off. Measured on Inception-V3 (M = 4,
  # k = 4, DGX-1 costs, 60 s, two threads): annealing then window descent reached 0.423-0.431 s;
  # with 40-45 s of CP-SAT from the annealing or a heuristic instead, 0.392-0.402 s in eight
  # runs.
  cpsat_share: float = 0.75
  # Share of the time limit, with k > 1, for the pipelined MILP that starts from the best
  # schedule so far. Every phase of `place` gets a positive part of the time left: the time left
  # split in proportion to the shares of the phases still to run (pipelined: prefix_share,
  # relaxation_share, pipeline_search_share, window_search_share, cpsat_share, milp_share), so a
  # phase that ends early passes its time on and no phase can get a negative budget.
  milp_share: float = 0.1
  # Share of the time limit for the placement relaxation that bounds the k > 1 makespan
  # (relax.py; it usually solves in well under a second).
  relaxation_share: float = 0.15
  # Most device assignments of the first nodes enumerated for the k > 1 lower bound
  # (bounds.prefix_bound; M^L <= this sets the prefix length L, 0 = off). About 1.6 ms each on
  # Inception-V3: 1024 (M = 4, the five stem nodes) raise its M = 4, k = 4 bound by 3.5 % in 1.6 s.
  prefix_assignments: int = 1024
  # Share of the time limit the prefix enumeration may take; past it the bound is not used.
  # (0.1 of a 20 s limit ran out on Inception-V3, M = 4, on a busy 2-core machine.)
  prefix_share: float = 0.15

  # Work limits, for results that do not depend on the machine's load (tests set them, with a
  # time limit far above what the work takes); None leaves that phase stopped by its time share.
  # Each CP-SAT run's deterministic time limit (CP-SAT's `max_deterministic_time`, in its own
  # work units). With threads=1 CP-SAT's search is then reproducible (its two subsolvers are
  # interleaved in one thread); with more threads its workers race each other.
  cpsat_deterministic_time: float | None = None
  # Branch-and-bound nodes of each CBC/HiGHS solve (the relaxation, each decomposition block and
  # the pipelined MILP), python-mip's `max_nodes`.
  milp_max_nodes: int | None = None
  # Placements each annealing run evaluates per (node, device) pair (heuristics.local_search);
  # None: 20 with one micro-batch, 5000 with k > 1, and the time share ends the run.
  search_evaluations: int | None = None
  # What the returned plan minimises. 'lockstep' (default): the lock-step price of the F/B/W
  # task schedule the program runs (planner.price), within the memory caps over time; the plan
  # carries that schedule (`task_schedule`) and its price (`lockstep_step_s`); the fused search
  # below (heuristics, annealing, CP-SAT, MILP) supplies its warm starts. 'makespan': the fused
  # forward+backward task makespan only (the DLPlacer model; plans as before F/B/W tasks).
  objective: str = "lockstep"
  # Share of the time limit for the lock-step search's annealing over placements (fbw_search).
  lockstep_search_share: float = 0.15
  # Placements that annealing prices (None: its time share alone stops it). Tests set it.
  lockstep_evaluations: int | None = None
  # Assumption: once cooled (fbw_search.ANNEAL_COOL_MOVES moves), the lock-step annealing stops
  # after this many moves in a row without a faster plan (None: only the time limit stops it).
  # Measured (30 s runs on the paper problems): between two improvements of the best
  # plan at most 163 placements were priced on GNMT, 129 on Inception-V3 after its first 633.
  lockstep_patience: int | None = 400
  # With the lock-step objective, the most seconds the warm-start phases before the lock-step
  # search (the fused annealing, relaxation, CP-SAT and MILP searches, whose placements only
  # seed it) and the F/B/W MILP take (None: their shares of the limit). Assumption: on the paper
  # models a 10 s limit (8.5 s of warm start) gave plans within 0-8.5 % of the 60 s ones.
  warm_start_max_s: float | None = 5.0
  # Task schedules the lock-step search may return: generated 'gpipe', '1f1b', 'zb' (also with
  # the fused search's forward order as priority), and 'custom' (the F/B/W MILP's own order).
  # The API passes the program's requested kind here, so that the plan is the schedule it runs.
  schedule_kinds: tuple[str, ...] = ("gpipe", "1f1b", "zb", "custom")
  # Share of the lock-step phase's time for the bound that pays for compute and transfers over
  # every placement (lockstep_bound.py), at most warm_start_max_s (its CBC runs also stop at
  # milp_max_nodes); 0 = skip it. Its best placements seed the lock-step search.
  lockstep_bound_share: float = 0.25
  # Problems with at most this many F/B/W tasks also run the F/B/W MILP (fbw_milp.py): its
  # optimum bounds the lock-step price from below and its order is a candidate; 0 = never.
  fbw_milp_max_tasks: int = 48
  # After the lock-step search, CP-SAT chooses the lock-step groups of the schedules of the
  # search's cheapest placements, the cheapest one also in its other family (split or not)
  # (lockstep_cpsat.py, place_lockstep.py; the plan then carries explicit groups), in
  # at most lockstep_groups_share of the lock-step phase's time and at most
  # lockstep_groups_max_s seconds (None: the share alone; 0: skip it); each run also stops when
  # it stalls (lockstep_cpsat.STALL_S) or, with cpsat_deterministic_time set, at that limit.
  # Needs 'custom' in schedule_kinds. Measured (paper sizes, DGX-1 costs, two threads):
  # Inception-V3 M=2 k=4 0.772 -> 0.697 s; BigLSTM M=2 k=4 0.8625 -> 0.751 s (its V placement).
  lockstep_groups_share: float = 0.25
  lockstep_groups_max_s: float | None = 20.0
  # Shard options (`jaxhybrid.graph.shard`, applied by `jaxhybrid.parallelize` before planning):
  # the rules that may split a large parameter leaf into one piece per model device ('lookup':
  # rows of a table read by gathers; 'column': a free dimension of a dense layer's weight); ()
  # keeps every leaf whole (the placement-only problem). Each split leaf's pieces are nodes the
  # placement puts anywhere: on one device the leaf is kept whole, on several it is sharded.
  # 'batch' (opt-in, not in the default): nodes holding at least batch_split_min_fraction of
  # the forward FLOPs are also offered split by rows of the micro-batch, one piece per device
  # (`jaxhybrid.graph.batch_split`).
  shard_rules: tuple[str, ...] = ("lookup", "column")
  # Assumption: a node is offered a batch split when it holds at least this fraction of the
  # forward FLOPs (each split adds M nodes to the problem; smaller nodes gain less than the
  # split's own slices, concatenation and messages cost).
  batch_split_min_fraction: float = 0.05
  # How a batch-split node's parameters are stored (`batch_split.split_batch`'s `params`):
  # 'replicated' (read whole by every piece, a copy on each device the pieces run on; no
  # parameter traffic in the step) or 'split' (M slices, one holder node per slice that the
  # planner places like any node: spread, each device stores 1/M of them and the pieces gather
  # the rest every micro-batch, FSDP inside the node).
  batch_split_params: str = "replicated"
  # Assumption: only leaves of at least this fraction of the parameter bytes are offered
  # (`shard.SHARD_MIN_FRACTION`; each adds M + 1 nodes to the problem).
  shard_min_fraction: float = 0.1
  # Assumption: the pieces of a split leaf are spread one per device (dividing its memory by M)
  # when that prices at most this fraction above the fastest plan found (search/spread.py), and
  # `parallelize` keeps a sharded plan over the placement-only one when it is priced faster by
  # more than this fraction, or at most this much slower and needs at least
  # shard_min_memory_saving less memory per device. 0: the fastest plan only.
  spread_tolerance: float = 0.02
  # Assumption: a sharded plan kept for its memory (priced within spread_tolerance of the
  # placement-only plan) needs at least this fraction less per device. Its extra groups and
  # messages are where the price misses most: on 2 pinned cores GNMT small's sharded plan
  # (30 groups, 75 messages; priced 0.5 % faster, 18 % more memory) ran 10 % slower than the
  # placement-only one (6 groups, 19 messages), BigLSTM small's (2.8 % less memory, priced
  # 0.5 % slower) 1.2 % slower; paper BigLSTM on 1x8 halves its memory at an equal price.
  shard_min_memory_saving: float = 0.10
  # Placements (node -> device) that seed the lock-step search besides the fused search's: the
  # plan is then never priced above the best of them (`parallelize` passes the placement-only
  # plan, mapped onto the sharded graph).
  seed_assignments: tuple[tuple[int, ...], ...] = ()

  @property
  def work_limited(self) -> bool:
    """Whether some phase is stopped by a work limit (then the prefix enumeration of
    bounds.prefix_bound is not stopped by the clock either)."""
    return (self.cpsat_deterministic_time is not None or self.milp_max_nodes is not None
            or self.search_evaluations is not None)

  def __post_init__(self):
    if not isinstance(self.devices, int) or self.devices < 1:
      raise ValueError(f"devices={self.devices!r}: use an integer >= 1.")
    if self.slot_min_bytes is not None and not (
        isinstance(self.slot_min_bytes, int) and self.slot_min_bytes >= 0):
      raise ValueError(f"slot_min_bytes={self.slot_min_bytes!r}: use bytes >= 0, or None.")
    if self.task_temp is not None and not callable(self.task_temp):
      raise ValueError(f"task_temp={self.task_temp!r}: use a function (graph, node) -> (F bytes, "
                       "B bytes), or None.")
    for name in ("group_s", "task_fixed_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name}={getattr(self, name)!r}: use seconds >= 0.")
    if not isinstance(self.microbatches, int) or self.microbatches < 1:
      raise ValueError(f"microbatches={self.microbatches!r}: use an integer >= 1.")
    if not self.time_limit_s > 0:
      raise ValueError(f"time_limit_s={self.time_limit_s!r}: use a positive number of seconds.")
    if self.threads < 1:
      raise ValueError(f"threads={self.threads!r}: use an integer >= 1.")
    if not 0 <= self.gap < 1:
      raise ValueError(f"gap={self.gap!r}: use a relative gap in [0, 1).")
    if self.solver not in SOLVERS:
      raise ValueError(f"solver={self.solver!r}: use one of {SOLVERS}.")
    bad_rules = set(self.shard_rules) - {"lookup", "column", "batch"}
    if bad_rules:
      raise ValueError(f"shard_rules={self.shard_rules!r}: use some of lookup, column, batch (or "
                       "() to keep every leaf and node whole).")
    if self.batch_split_params not in ("replicated", "split"):
      raise ValueError(f"batch_split_params={self.batch_split_params!r}: use 'replicated' or "
                       "'split'.")
    if not 0.0 <= self.batch_split_min_fraction <= 1.0:
      raise ValueError(f"batch_split_min_fraction={self.batch_split_min_fraction!r}: use a "
                       "fraction in [0, 1].")
    if self.activation_model not in ("saved", "outputs"):
      raise ValueError(f"activation_model={self.activation_model!r}: use 'saved' or 'outputs'.")
    if not 0.0 <= self.spread_tolerance < 1.0:
      raise ValueError(f"spread_tolerance={self.spread_tolerance!r}: use a fraction in [0, 1).")
    if not 0.0 <= self.shard_min_memory_saving < 1.0:
      raise ValueError(f"shard_min_memory_saving={self.shard_min_memory_saving!r}: use a fraction "
                       "in [0, 1).")
    if not 0.0 <= self.shard_min_fraction <= 1.0:
      raise ValueError(f"shard_min_fraction={self.shard_min_fraction!r}: use a fraction in [0, 1].")
    bad = set(self.schedule_kinds) - {"gpipe", "1f1b", "zb", "custom"}
    if bad or not self.schedule_kinds:
      raise ValueError(f"schedule_kinds={self.schedule_kinds!r}: use some of gpipe, 1f1b, zb, "
                       "custom.")
    if self.objective not in OBJECTIVES:
      raise ValueError(f"objective={self.objective!r}: use one of {OBJECTIVES}.")
    if self.method not in METHODS:
      raise ValueError(f"method={self.method!r}: use one of {METHODS}.")
    for name in ("local_search_share", "pipeline_search_share", "window_search_share",
                 "relaxation_share", "prefix_share", "cpsat_share", "milp_share",
                 "lockstep_search_share", "lockstep_bound_share", "lockstep_groups_share"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"{name}={getattr(self, name)!r}: use a share of the time in [0, 1].")
    if not isinstance(self.max_window_placements, int) or self.max_window_placements < 2:
      raise ValueError(
        f"max_window_placements={self.max_window_placements!r}: use an integer >= 2."
      )
    if not isinstance(self.prefix_assignments, int) or self.prefix_assignments < 0:
      raise ValueError(
        f"prefix_assignments={self.prefix_assignments!r}: use an integer >= 0 (0 turns it off)."
      )
    if not isinstance(self.search_chains, int) or self.search_chains < 1:
      raise ValueError(f"search_chains={self.search_chains!r}: use an integer >= 1.")
    for name in ("cpsat_deterministic_time", "milp_max_nodes", "search_evaluations",
                 "lockstep_evaluations", "lockstep_patience", "warm_start_max_s"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"{name}={value!r}: use a positive limit, or None for none.")
    if self.lockstep_groups_max_s is not None and not self.lockstep_groups_max_s >= 0:
      raise ValueError(f"lockstep_groups_max_s={self.lockstep_groups_max_s!r}: use seconds >= 0 "
                       "(0 skips the step), or None for its share of the time alone.")
    if self.transfer_directions < 0:
      raise ValueError(f"transfer_directions={self.transfer_directions!r}: use a value >= 0.")
    caps = self.memory_caps_bytes
    if isinstance(caps, float):  # 16e9 reads as bytes too
      if not (caps >= 0 and caps != float("inf")):
        raise ValueError(f"memory_caps_bytes={caps!r}: use a finite number of bytes >= 0.")
      object.__setattr__(self, "memory_caps_bytes", caps := int(caps))
    if isinstance(caps, str) and caps != DEVICE_MEMORY:
      raise ValueError(f"memory_caps_bytes={caps!r}: use bytes, {DEVICE_MEMORY!r} or None.")
    if caps is not None and not isinstance(caps, (int, str)):
      if len(caps) != self.devices:
        raise ValueError(
          f"memory_caps_bytes has {len(caps)} entries for devices={self.devices}: give one cap "
          "per device or a single int."
        )

  def caps(self, device_memory_bytes: int = 0) -> tuple[float, ...] | None:
    """Returns the memory cap of each device in bytes, or None when uncapped.

    Args:
      device_memory_bytes: the hardware's memory per device (Problem.device_memory_bytes), the
        caps under DEVICE_MEMORY; 0 = unknown (no cap).
    """
    caps = self.memory_caps_bytes
    if caps == DEVICE_MEMORY:
      caps = int(device_memory_bytes) or None
    if caps is None or (isinstance(caps, int) and caps == 0):
      return None
    if isinstance(caps, int):
      return (float(caps),) * self.devices
    return tuple(float(c) for c in caps)

  def replace(self, **overrides: object) -> PlannerOptions:
    """Returns a copy with `overrides` applied; unknown names raise ValueError."""
    known = {f.name for f in dataclasses.fields(self)}
    unknown = sorted(set(overrides) - known)
    if unknown:
      raise ValueError(f"Unknown planner options {unknown}; known: {sorted(known)}.")
    return dataclasses.replace(self, **overrides)


def as_options(options: PlannerOptions | None, overrides: Mapping[str, object]) -> PlannerOptions:
  """Returns `options` (or the defaults) with `overrides` applied."""
  return (options or PlannerOptions()).replace(**overrides)
