"""The F/B/W task MILP (python-mip): placement and per-device task orders of small problems.

Tasks are F(i, c), B(i, c) and, split, W(i, c) for every node i and micro-batch c (task_schedule).
Variables (PAPER.md's DLPlacer, extended from fused tasks to F/B/W tasks):
  x[i, d] in {0, 1}   node i on device d; all tasks of i share it;
  s[t] >= 0           start of task t; dur[t] its seconds (Problem.task_s);
  y[e, a, b]          edge e's source on a and destination on b (a != b), when that costs;
  same[i, j]          nodes i and j on one device (>= x[i, d] + x[j, d] - 1);
  o[t, u]             t before u, for task pairs not ordered by precedence (big-M disjunction,
                      active when the two nodes share a device);
  alive[u, t]         residuals of F u alive when F t starts (memory over time);
  C                   makespan.
Constraints:
  - sum_d x[i, d] = 1;
  - precedence with one-way delays (price.fbw_dependencies): F(p, c) -> F(i, c) pays edge (p, i)'s
    activations a -> b; B(s, c) -> B(i, c) pays the cotangents of edge (i, s) back; F -> B -> W of
    one node on its device: s[u] >= s[t] + dur[t] + sum_{a != b} delay(e, a, b) y[e, a, b];
  - no two tasks overlap on a device;
  - memory (with caps): the longest device's static bytes (every device allocates rows that
    long) + at the start of every F(i, c) on any device d the residuals of every F(j, c') on d
    that ran at or before it and whose release task (B, or W when split) runs after it
    <= the smallest cap (price.peak_memory_bytes, the same rule: the program allocates the same
    on every device);
  - C >= s[t] + dur[t].
Objective: min C.

Why the optimum is a lower bound on the lock-step price (price.lockstep_price) of every
(placement, schedule) within the caps: run that schedule in lock step and start each task at its
group's start plus the time of the device's earlier tasks in the group. That is a solution of this
MILP: same placement and per-device order (so the same memory profile, within the caps), no overlap
on a device, and every cross-device input is read in a later group, which starts after the
producer's group ended and after all of that group's messages, one of which carries the input and
costs at least the edge's one-way delay here (a message is priced by its longest sender's bytes,
at least this edge's; with several dtypes each message pays the latency again). Tasks that only
depend without reading (B over an edge without float values) are not constrained here. So its
makespan, at most the lock-step price, is at least the MILP's optimum; and a solver's proven bound
is at most the optimum.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Sequence

import mip

from jaxhybrid.planner.solvers import child
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.solvers.milp import new_model, node_limit, proven_bound, time_unit
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule, validate

log = logging.getLogger(__name__)

# Most tasks the MILP is built for (the order binaries grow with the square of the task count).
MAX_TASKS = 64


@dataclasses.dataclass(frozen=True)
class FbwResult:
  """Result of the F/B/W MILP."""

  # 'optimal', 'feasible' (stopped with a gap), 'infeasible' or 'none' (no incumbent).
  status: str
  # Makespan of the best solution (inf without one) and the proven lower bound.
  makespan: float
  bound: float
  # The best placement and its per-device task order (kind 'custom'), or None.
  assignment: tuple[int, ...] | None
  schedule: TaskSchedule | None


def tasks_of(problem: Problem, k: int, split: bool) -> list[Op]:
  kinds = ("F", "B", "W") if split else ("F", "B")
  return [Op(t, i, c) for i in range(problem.num_nodes) for c in range(k) for t in kinds]


def _closure(tasks: Sequence[Op], deps: dict[Op, list]) -> dict[Op, set[Op]]:
  """Per task, every task that must precede it (transitively)."""
  before: dict[Op, set[Op]] = {}

  def visit(t: Op) -> set[Op]:
    if t not in before:
      acc: set[Op] = set()
      for u, _, _ in deps[t]:
        acc.add(u)
        acc |= visit(u)
      before[t] = acc
    return before[t]

  for t in tasks:
    visit(t)
  return before


def _no_solution(problem, k, **_) -> FbwResult:
  """The result of a solve whose solver process died (child.py): no incumbent, bound 0."""
  return FbwResult("none", math.inf, 0.0, None, None)


@child.isolated(_no_solution)
def solve(
  problem: Problem,
  k: int,
  *,
  split: bool,
  caps: Sequence[float] | None = None,
  time_limit_s: float = 60.0,
  max_nodes: int | None = None,
  threads: int = 1,
  seed: int = 0,
  gap: float = 0.0,
  solver: str = "cbc",
) -> FbwResult:
  """Solves the F/B/W MILP (see the module docstring).

  Args:
    problem: the problem (small: at most MAX_TASKS tasks).
    k: micro-batches.
    split: B and W as separate tasks (zero-bubble) or one B task.
    caps: per-device memory caps in bytes, or None.
    time_limit_s, max_nodes: solver limits (set max_nodes for results independent of the clock).
    threads, seed, gap, solver: solver settings.

  Returns:
    The result; `bound` is a valid lower bound whatever the status.

  Raises:
    ValueError: more than MAX_TASKS tasks.
  """
  tasks = tasks_of(problem, k, split)
  if len(tasks) > MAX_TASKS:
    raise ValueError(f"{len(tasks)} F/B/W tasks: the MILP is for at most {MAX_TASKS}.")
  original, unit = problem, time_unit(problem, k)  # solved in model units, not seconds
  problem = problem.scaled_times(unit)
  n, M = problem.num_nodes, problem.devices
  dur = {t: problem.task_s(t.kind, t.node, split) for t in tasks}
  deps = {t: price_lib.fbw_dependencies(problem, t) for t in tasks}
  before = _closure(tasks, deps)
  horizon = sum(dur.values()) + sum(
    max((problem.direction_s(e, a, b, back) for a in range(M) for b in range(M)), default=0.0)
    for t in tasks for _, e, back in deps[t] if e >= 0
  )
  horizon = max(horizon, 1e-9) * 1.01
  m = new_model(solver)
  m.verbose = 0
  m.threads = threads
  m.seed = seed
  m.max_mip_gap = gap
  # CBC's preprocessing crashed (SIGSEGV/SIGABRT in CglPreProcess::postProcess) on a 48-task
  # GNMT instance under a tight time limit; these models are small, so it stays off.
  m.preprocess = 0
  x = {(i, d): m.add_var(var_type=mip.BINARY) for i in range(n) for d in range(M)}
  s = {t: m.add_var(lb=0.0, ub=horizon) for t in tasks}
  C = m.add_var(lb=0.0, ub=horizon)
  for i in range(n):
    m += mip.xsum(x[i, d] for d in range(M)) == 1
  # Same device.
  same: dict[tuple[int, int], mip.LinExpr | float] = {}
  for i in range(n):
    same[i, i] = 1.0
    for j in range(i + 1, n):
      v = m.add_var(var_type=mip.BINARY)
      for d in range(M):
        m += v >= x[i, d] + x[j, d] - 1
      same[i, j] = same[j, i] = v
  # Precedence with delays.
  ycache: dict[tuple[int, int, int, int], mip.Var] = {}
  for t in tasks:
    for u, e, back in deps[t]:
      delay = mip.LinExpr()
      if e >= 0:
        for a in range(M):
          for b in range(M):
            w = problem.direction_s(e, a, b, back)
            if a == b or w <= 0:
              continue
            key = (u.node, t.node, a, b)
            if key not in ycache:
              ycache[key] = y = m.add_var(lb=0.0, ub=1.0)
              m += y >= x[u.node, a] + x[t.node, b] - 1
            delay += w * ycache[key]
      m += s[t] >= s[u] + dur[u] + delay
    m += C >= s[t] + dur[t]
  # Disjunctions for unordered pairs on one device.
  order: dict[tuple[Op, Op], mip.LinExpr | float] = {}  # (t, u) -> 1 when t runs before u
  for t, u in itertools.combinations(tasks, 2):
    if t in before[u]:
      order[t, u], order[u, t] = 1.0, 0.0
      continue
    if u in before[t]:
      order[t, u], order[u, t] = 0.0, 1.0
      continue
    o = m.add_var(var_type=mip.BINARY)
    order[t, u], order[u, t] = o, 1 - o
    sm = same[t.node, u.node]
    m += s[u] >= s[t] + dur[t] - horizon * (1 - o) - horizon * (1 - sm)
    m += s[t] >= s[u] + dur[u] - horizon * o - horizon * (1 - sm)
  # Memory over time.
  if caps is not None:
    total = sum(problem.static_bytes) + k * sum(problem.activation_bytes) + 1.0
    release = "W" if split else "B"
    fs = [t for t in tasks if t.kind == "F"]
    # Every device allocates the longest device's rows (row >= each device's static bytes) and
    # the largest device's residuals: the smallest cap binds every device.
    row = m.add_var(lb=0.0)
    cap = min(caps)
    m += row <= cap
    for d in range(M):
      m += row >= mip.xsum(problem.static_bytes[j] * x[j, d] for j in range(n))
    for t in fs:
      alive = []
      for u in fs:
        res = problem.activation_bytes[u.node]
        if res == 0:
          continue
        if u == t:
          alive.append(float(res))
          continue
        b_f = order[u, t]  # u at or before t
        r = Op(release, u.node, u.microbatch)
        a_r = order[t, r]  # the release after t
        if isinstance(b_f, float) and b_f == 0.0 or isinstance(a_r, float) and a_r == 0.0:
          continue
        a = m.add_var(lb=0.0, ub=1.0)
        m += a >= b_f + a_r - 1 - (1 - same[t.node, u.node])
        alive.append(res * a)
      for d in range(M):
        m += row + mip.xsum(alive) <= cap + total * (1 - x[t.node, d])
  m.objective = mip.minimize(C)
  status = m.optimize(max_seconds=time_limit_s, **node_limit(max_nodes))
  bound = proven_bound(m, 0.0) / unit
  if status == mip.OptimizationStatus.INFEASIBLE:
    return FbwResult("infeasible", float("inf"), float("inf"), None, None)
  if m.num_solutions == 0:
    return FbwResult("none", float("inf"), max(bound, 0.0), None, None)
  assign = tuple(max(range(M), key=lambda d: x[i, d].x) for i in range(n))
  rank = {t: r for r, t in enumerate(sorted(tasks, key=lambda t: len(before[t])))}
  per_dev: list[list[Op]] = [[] for _ in range(M)]
  for t in sorted(tasks, key=lambda t: (round(s[t].x, 9), rank[t])):
    per_dev[assign[t.node]].append(t)
  sched = TaskSchedule(kind="custom", split=split, microbatches=k,
                       devices=tuple(tuple(ops) for ops in per_dev))
  try:
    validate(sched, n, problem.edges, assign)
    makespan = price_lib.async_makespan(original, assign, sched)
  except ValueError as err:  # ties in start times resolved badly: keep the objective only
    log.warning("F/B/W MILP order not extractable: %s", err)
    sched, makespan = None, float(m.objective_value) / unit
  optimal = status == mip.OptimizationStatus.OPTIMAL
  return FbwResult("optimal" if optimal else "feasible", makespan, bound, assign, sched)
