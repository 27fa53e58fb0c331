"""Lock-step groups chosen by CP-SAT for a fixed placement: a schedule with explicit groups.

The lock-step price of a schedule is the sum over its groups of the busiest device's tasks plus
the groups' messages (price.py). A schedule given as per-device orders gets its groups from the
program's rule (each task as early as it can run, lockstep_rule.lockstep_groups), which pairs a
device's long task with another's short one wherever the orders happen to meet. Here the groups
themselves are the decision (TaskSchedule.groups; the program runs them as given):

  group g_t in 0..G-1 per task t (one-hot b[t][j]);
  g_t >= g_u for a dependency u on the same device, g_t >= g_u + 1 across devices (a value
    crosses only between groups);
  L_j >= sum of device d's task times in group j, for every d;
  S_j >= sum of the message times of device d's tasks in group j, for every d (each task's
    message priced alone at its link: the model's approximation of price.py's messages, which
    pack small values and take the slowest sender per lane);
  per device and group: the gradient tasks of one node, or of several whose parameter bytes fit
    lockstep_rule.GROUP_GRAD_BYTES (the rule's cap, which explicit groups must also keep);
  with memory caps: static bytes + the residuals of every F in a group <= j whose release task
    (B, or W when split) is in a group >= j, within the cap for every device and group (an upper
    bound on the peak inside the group);
  minimise sum_j (L_j + S_j).

G is the warm start's group count plus EXTRA_GROUPS_SHARE of it (at least EXTRA_GROUPS_MIN).
Within a group a device runs its tasks in a topological order of the task graph. The solution is
priced exactly (price.lockstep_price, peak_memory_bytes) and returned only if it is cheaper than
the warm start and fits; the warm start's own groups are CP-SAT's hint, given for every variable
so that the search starts from that schedule. CP-SAT runs in a child process
(lockstep_cpsat_worker.py) as in cpsat.py, without presolve; with a deterministic time limit,
fixed seed and one thread its result does not depend on the machine's load, and without one it
stops after STALL_S seconds without a better solution.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from jaxhybrid.planner.pricing import lockstep_rule
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule

log = logging.getLogger(__name__)

# Groups beyond the warm start's: a share of its count, and at least this many (assumption,
# named here: more room lets the solver separate long and short tasks; each group adds one
# indicator per task).
EXTRA_GROUPS_SHARE = 0.25
EXTRA_GROUPS_MIN = 4
# Integer units: the warm start's price is this many units (rounding is the model's only loss:
# every solution is re-priced with the real times).
_UNITS = 1_000_000
# Memory in units of the largest cap over this many (residuals rounded up, room down: the
# model is safe).
_MEMORY_UNITS = 1_000_000
# Re-solves of a result the CP-SAT model fits but the planner's memory rule does not (`improve`).
FIT_RETRIES = 2
# Tasks x groups beyond which the model is not built (its size and build time grow with it).
MAX_CELLS = 400_000
# Seconds kept back for the child process to start and import OR-Tools, and the grace after the
# limit before it is killed.
_STARTUP_S = 0.7
_GRACE_S = 10.0
# Without a deterministic limit, a CP-SAT run stops once this many seconds pass without a better
# solution (assumption, named here: with a complete hint its improvements on the paper models
# came at most ~2 s apart once past the first second).
STALL_S = 3.0
# Fewest seconds of solving worth starting a child process for.
_MIN_SOLVE_S = 0.3


def _task_order(ops: Sequence[Op], deps: Sequence[tuple[int, int, int]]) -> dict[int, int]:
  """A topological position for every task (ties: list order)."""
  indeg = [0] * len(ops)
  users: list[list[int]] = [[] for _ in ops]
  for u, t, _ in deps:
    indeg[t] += 1
    users[u].append(t)
  ready = [t for t in range(len(ops)) if not indeg[t]]
  heapq.heapify(ready)
  pos: dict[int, int] = {}
  while ready:
    t = heapq.heappop(ready)
    pos[t] = len(pos)
    for v in users[t]:
      indeg[v] -= 1
      if not indeg[v]:
        heapq.heappush(ready, v)
  return pos


def _sent_bytes(problem: Problem, assignment: Sequence[int], op: Op) -> float:
  """Bytes task `op` sends to other devices (each value once per receiving device)."""
  d = assignment[op.node]
  total = 0.0
  if op.kind == "F":
    targets: dict[int, set[int]] = {}
    for s, e in problem.successors()[op.node]:
      if assignment[s] != d:
        for v in problem.edge_values[e]:
          targets.setdefault(v, set()).add(assignment[s])
    total = sum(problem.value_bytes[v] * len(b) for v, b in targets.items())
  elif op.kind == "B":
    for p, e in problem.predecessors()[op.node]:
      if assignment[p] != d:
        total += sum(problem.value_bytes[v] for v in problem.edge_values[e]
                     if problem.is_float(v))
  return total


def _message_s(problem: Problem, assignment: Sequence[int], op: Op) -> float:
  """The model's price of what `op` sends: its bytes over its slowest outgoing link."""
  nbytes = _sent_bytes(problem, assignment, op)
  if not nbytes:
    return 0.0
  d, M = assignment[op.node], problem.devices
  if problem.link_latency_s:
    return max(problem.link_s(nbytes, d, b) for b in range(M) if b != d)
  edges = problem.successors()[op.node] if op.kind == "F" else problem.predecessors()[op.node]
  return sum(max(problem.direction_s(e, d, assignment[o], op.kind == "B"), 0.0)
             for o, e in edges if assignment[o] != d)


def improve(
  problem: Problem,
  assignment: Sequence[int],
  warm: TaskSchedule,
  caps: Sequence[float] | None,
  *,
  time_limit_s: float,
  threads: int = 1,
  seed: int = 0,
  deterministic_time: float | None = None,
  stall_s: float | None = STALL_S,
) -> tuple[TaskSchedule, float] | None:
  """A schedule with explicit groups for `assignment`, cheaper in lock step than `warm` and
  within `caps`, and its price; None when CP-SAT found none (or the model is too large, or the
  child process failed: logged). Without `deterministic_time`, the run also stops after
  `stall_s` seconds without a better solution (None: never).

  The model caps rows and one device's residuals, a relaxation of the planner's memory rule
  (price.peak_memory_bytes adds the groups' buffers as the program lays them out). A result over
  the caps by that rule is solved again with the model's caps lowered by the excess, up to
  FIT_RETRIES times (each run with the time left, or the same deterministic time).
  """
  t0 = time.monotonic()
  model_caps = caps
  for _ in range(FIT_RETRIES + 1):
    left = time_limit_s - (time.monotonic() - t0)
    got = _improve(problem, assignment, warm, model_caps, time_limit_s=left, threads=threads,
                   seed=seed, deterministic_time=deterministic_time, stall_s=stall_s)
    if got is None:
      return None
    if caps is None:
      return got
    over = max(price_lib.peak_memory_bytes(problem, assignment, got[0])) - min(caps)
    if over <= 0:  # price.fits: every device's peak within the smallest cap
      return got
    model_caps = tuple(c - over for c in model_caps)
  return None


def _improve(
  problem: Problem,
  assignment: Sequence[int],
  warm: TaskSchedule,
  caps: Sequence[float] | None,
  *,
  time_limit_s: float,
  threads: int,
  seed: int,
  deterministic_time: float | None,
  stall_s: float | None,
) -> tuple[TaskSchedule, float] | None:
  """One CP-SAT run of `improve` with `caps` in its model; the result is not checked against
  the planner's memory rule."""
  t0 = time.monotonic()
  if time_limit_s < _STARTUP_S + _MIN_SOLVE_S:
    return None  # not worth starting OR-Tools
  k, split, M = warm.microbatches, warm.split, problem.devices
  kinds = ("F", "B", "W") if split else ("F", "B")
  ops = [Op(t, i, c) for t in kinds for i in range(problem.num_nodes) for c in range(k)]
  index = {o: j for j, o in enumerate(ops)}
  try:
    warm_price = price_lib.lockstep_price(problem, assignment, warm).step_s
    warm_groups = price_lib.groups_of(problem, assignment, warm)
  except ValueError:
    return None
  G = len(warm_groups) + max(EXTRA_GROUPS_MIN, math.ceil(EXTRA_GROUPS_SHARE * len(warm_groups)))
  if len(ops) * G > MAX_CELLS or warm_price <= 0:
    return None
  scale = _UNITS / warm_price

  def units(seconds: float) -> int:
    return round(seconds * scale)

  dev = [assignment[o.node] for o in ops]
  reads = price_lib.task_reads(problem, warm)
  deps = set()
  for o in ops:
    for u, _, _ in price_lib.fbw_dependencies(problem, o):
      deps.add((index[u], index[o], int(dev[index[u]] != dev[index[o]])))
    for u in reads.get(o, ()):
      deps.add((index[u], index[o], int(dev[index[u]] != dev[index[o]])))
    if o.kind == "B":
      # The lock-step rule orders B(n) after B(s) for every successor s, also over an edge that
      # carries no cotangent (integer ids), and in a later group when s is on another device.
      for s_, _ in problem.successors()[o.node]:
        u = index[Op("B", s_, o.microbatch)]
        deps.add((u, index[o], int(dev[u] != dev[index[o]])))
  deps = sorted(deps)
  hint = [0] * len(ops)
  for j, group in enumerate(warm_groups):
    for _, o in group:
      hint[index[o]] = j
  params = problem.param_bytes or None
  grad_task = [lockstep_rule.writes_grads(o, split, params) for o in ops]
  # Per gradient task, its unit (the pieces of one split leaf share one) and the bytes the
  # unit's nodes on its device write (an upper bound on what a group holds of that unit).
  gunit = problem.grad_units
  unit_bytes: dict[tuple[int, int], int] = {}
  for i, d in enumerate(assignment):
    unit_bytes[(gunit[i], d)] = unit_bytes.get((gunit[i], d), 0) + (int(params[i]) if params else 0)
  grad = [(unit_bytes[(gunit[o.node], assignment[o.node])] if params
           else lockstep_rule.GROUP_GRAD_BYTES + 1) if gt else -1
          for o, gt in zip(ops, grad_task)]
  memory = None
  finite = [c for c in caps or () if math.isfinite(c)]
  if finite:
    # Every device allocates the longest device's rows and the largest device's residuals
    # (price.peak_memory_bytes): the smallest cap binds every device.
    static = [max(price_lib.device_static_bytes(problem, assignment))] * M
    caps = [min(caps)] * M
    if any(s > c for s, c in zip(static, caps)):
      return None
    unit = max(max(finite) / _MEMORY_UNITS, 1e-300)
    release = {(o.node, o.microbatch): index[o] for o in ops
               if price_lib.residual_release(o, split)}
    residual = [math.ceil(problem.activation_bytes[o.node] / unit) if o.kind == "F" else 0
                for o in ops]
    room: list[int | None] = []
    for d in range(M):
      r = math.floor((caps[d] - static[d]) / unit) if math.isfinite(caps[d]) else None
      # A device whose residuals all fit at once needs no memory rows (null room).
      if r is not None and sum(x for x, t in zip(residual, dev) if t == d) <= r:
        r = None
      room.append(r)
    if any(r is not None for r in room):
      memory = {"residual": residual, "room": room,
                "release": [release.get((o.node, o.microbatch), -1) if o.kind == "F" else -1
                            for o in ops]}
  data = dict(
    devices=M, groups=G, dur=[units(problem.task_s(o.kind, o.node, split)) for o in ops],
    dev=dev, deps=deps, send=[units(_message_s(problem, assignment, o)) for o in ops],
    grad=grad, grad_node=[gunit[o.node] for o in ops], grad_cap=lockstep_rule.GROUP_GRAD_BYTES,
    memory=memory, hint=hint, stall_s=stall_s, log=log.isEnabledFor(logging.DEBUG),
    threads=threads, seed=seed, deterministic_time=deterministic_time,
    time_limit_s=max(0.1, time_limit_s - (time.monotonic() - t0) - _STARTUP_S),
  )
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lockstep_cpsat_worker.py")
  try:
    proc = subprocess.run(
      [sys.executable, worker], input=json.dumps(data), capture_output=True, text=True,
      timeout=data["time_limit_s"] + _STARTUP_S + _GRACE_S, check=True)
    out = json.loads(proc.stdout)
  except (subprocess.SubprocessError, OSError, ValueError) as err:
    detail = (getattr(err, "stderr", "") or "").strip()
    log.warning("The lock-step CP-SAT search failed (%s%s); keeping the warm start.",
                type(err).__name__, f": {detail.splitlines()[-1]}" if detail else "")
    return None
  if proc.stderr.strip() and log.isEnabledFor(logging.DEBUG):
    log.debug("lock-step CP-SAT progress:\n%s", proc.stderr.strip()[-4000:])
  if out.get("group") is None:
    return None
  group = out["group"]
  pos = _task_order(ops, deps)
  seqs: list[list[Op]] = [[] for _ in range(M)]
  gs: list[list[int]] = [[] for _ in range(M)]
  for t in sorted(range(len(ops)), key=lambda t: (group[t], pos[t])):
    seqs[dev[t]].append(ops[t])
    gs[dev[t]].append(group[t])
  sched = TaskSchedule(kind="custom", split=split, microbatches=k,
                       devices=tuple(tuple(s) for s in seqs), groups=tuple(tuple(g) for g in gs))
  try:
    p = price_lib.lockstep_price(problem, assignment, sched).step_s
  except ValueError as err:  # the model and the rule disagree: a bug, never a plan
    log.warning("internal: CP-SAT's lock-step groups break a rule (%s); keeping the warm start",
                err)
    return None
  log.debug("lock-step CP-SAT %s: %.6g -> %.6g (model %.6g, %d groups, %.1fs)", out["status"],
            warm_price, p, out["objective"] / scale, G, time.monotonic() - t0)
  if p >= warm_price - 1e-15:
    return None
  return sched, p
