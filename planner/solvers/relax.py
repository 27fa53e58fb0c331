"""A placement-only relaxation of the pipelined MILP: a lower bound for k micro-batches.

With k micro-batches the exact MILP (milp.py) has k start times per node and a disjunction per
pair of tasks, and CBC rarely closes its gap within a minute on the paper's graphs. This model
keeps only the placement x[i, d] and what every schedule of that placement must satisfy:

  C >= S_d + k sum_i p_i x[i, d] + E_d            for every device d,

where S_d, the idle time of d before its first task, is at least r_i of the node i of d with the
least r (bounds.idle_bounds), and E_d likewise with q. Everything else of the schedule is
dropped, so its optimum (or the solver's bound on it) is a lower bound on the makespan of the
exact problem. S_d is written with the usual "first facility" telescoping (e.g. Cornuejols,
Nemhauser and Wolsey, "The uncapacitated facility location problem", 1990): with the nodes
sorted by r, r_(0) = 0 and w[m, d] >= u_d - sum_{rank(j) < m} x[j, d] >= 0 (u_d: d is used),

  S_d = sum_m (r_(m) - r_(m-1)) w[m, d],

which at integer x is r of d's first-ranked node. Two more families of cuts count precedence
within a device: for every node i and device d,

  C >= head_i x[i, d] + k sum_{j in {i} + desc(i)} p_j x[j, d] + E_d,
  C >= S_d + k sum_{j in {i} + anc(i)} p_j x[j, d] + tail_i x[i, d],

since with i on d, every task of i and of its descendants on d starts after (i, 0), which cannot
start before head_i, and every task of i and of its ancestors on d ends before (i, k - 1) ends,
after which at least tail_i remains (with i elsewhere both reduce to load cuts). For the
`start_cuts` nodes with the smallest heads (where the pipeline fills), head_i is replaced by t_i,

  t_i >= t_j + p_j + fastest(j, i) (x[i, d] - x[j, d])   for every edge (j, i) and device d,
  C >= t_i + k sum_{j in {i} + desc(i)} p_j x[j, d] + E_d - U_i (1 - x[i, d]),

t_i >= head_i: the least start of (i, 0) when every edge that crosses devices pays its fastest link
(a longest path; the start of (i, 0) in any schedule of the placement satisfies these), and U_i the
same path with the slowest links, an upper bound on the least t_i. Memory caps apply
as in the MILP; devices are interchangeable here (r and q use each edge's fastest link), so with
equal caps they are opened in order of first use.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import mip

from jaxhybrid.planner.solvers import child
from jaxhybrid.planner.lower_bounds import bounds as bounds_lib
from jaxhybrid.planner.solvers import milp
from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.core.problem import Problem

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelaxResult:
  """What the relaxation returned."""

  # A lower bound on the makespan of every placement and schedule (the solver's proven bound).
  bound: float
  # The relaxation's best placement (a good load split; schedule it before use), or None.
  assignment: tuple[int, ...] | None
  # Whether the relaxation itself was solved to optimality.
  optimal: bool
  solve_time_s: float


def _telescoped(m: mip.Model, x_col: Sequence[object], u: object, keys: Sequence[float]):
  """sum_m (key_(m) - key_(m-1)) w_m with w_m >= u - sum_{rank < m} x: min key of the nodes in
  x_col (0 when none is)."""
  order = sorted(range(len(keys)), key=lambda i: keys[i])
  terms, before, prev = [], [], 0.0
  for i in order:
    step = keys[i] - prev
    if step > 0:
      w = m.add_var(lb=0.0)
      m.add_constr(w >= u - mip.xsum(before) if before else w >= u)
      terms.append(step * w)
    before.append(x_col[i])
    prev = keys[i]
  return mip.xsum(terms) if terms else 0.0


def _no_solution(problem, k, *, lower_bound=0.0, **_) -> RelaxResult:
  """The result of a solve whose solver process died (child.py): the known bound only."""
  return RelaxResult(bound=lower_bound, assignment=None, optimal=False, solve_time_s=0.0)


@child.isolated(_no_solution)
def solve(
  problem: Problem,
  k: int,
  *,
  caps: Sequence[float] | None = None,
  lower_bound: float = 0.0,
  time_limit_s: float = 5.0,
  threads: int = 1,
  seed: int = 0,
  solver: str = "cbc",
  ordered: bool = True,
  start_cuts: int = 6,
  max_nodes: int | None = None,
) -> RelaxResult:
  """Solves the relaxation (see the module docstring).

  Args:
    problem: the problem.
    k: micro-batches.
    caps: memory cap per device, or None.
    lower_bound: a known lower bound (the result is at least this).
    time_limit_s: solver time limit.
    threads, seed, solver: solver settings (PlannerOptions).
    ordered: add the precedence cuts (the second and third families in the module docstring).
    start_cuts: nodes (smallest heads first) that get the start-time cuts (big-M rows, slow to
      close): on Inception-V3 (M = 2, k = 4, one thread) 6 solve in ~1 s and raise
      the bound 0.6 %, 12 take ~8 s for another 0.2 %.
    max_nodes: most branch-and-bound nodes (None: the time limit alone stops the solver).

  Returns:
    The bound and the relaxation's placement.
  """
  t0 = time.monotonic()
  unit = milp.time_unit(problem, k)  # the model is solved in these units, not seconds
  problem, lower_bound = problem.scaled_times(unit), lower_bound * unit
  n, M, p = problem.num_nodes, problem.devices, problem.compute_s
  r, q = bounds_lib.idle_bounds(problem)
  head, tail = sched.heads_tails(problem)
  preds = problem.predecessors()
  anc = milp.ancestors(problem)
  before = [[j for j in range(n) if j == i or (anc[i] >> j) & 1] for i in range(n)]
  after = [[j for j in range(n) if j == i or (anc[j] >> i) & 1] for i in range(n)]
  m, x = milp.placement_model(solver, n, M, threads=threads, seed=seed, gap=1e-6,
                              gap_abs=1e-12)
  C = m.add_var(lb=max(lower_bound, 0.0))
  mem = problem.memory_bytes(k)
  # t[i]: a lower bound on the start of (i, 0) given the placement (links paid where an edge
  # crosses devices); big[i] bounds its least value (every edge paying its slowest link).
  t, big, early = [], [], set()
  if ordered and M > 1:
    early = set(sorted(range(n), key=lambda i: (head[i], i))[:start_cuts])
    fastest = [bounds_lib._fastest(problem, e) for e in range(len(problem.edges))]
    slowest = [max(max(row) for row in problem.transfer_s[e]) for e in range(len(problem.edges))]
    for i in range(n):
      big.append(max((big[j] + p[j] + slowest[e] for j, e in preds[i]), default=0.0))
      t.append(m.add_var(lb=head[i], ub=max(head[i], big[i])))
      for j, e in preds[i]:
        for d in range(M):
          m.add_constr(t[i] >= t[j] + p[j] + fastest[e] * (x[i][d] - x[j][d]))
  for d in range(M):
    col = [x[i][d] for i in range(n)]
    u = m.add_var(lb=0.0, ub=1.0)
    for i in range(n):
      m.add_constr(u >= x[i][d])
    load = mip.xsum(k * p[i] * x[i][d] for i in range(n))
    start, end = _telescoped(m, col, u, r), _telescoped(m, col, u, q)
    m.add_constr(C >= load + start + end)
    if ordered:  # the work of d that must follow (i, 0), and the work that must precede (i, k-1)
      for i in range(n):
        rest = k * mip.xsum(p[j] * x[j][d] for j in after[i]) + end
        m.add_constr(C >= head[i] * x[i][d] + rest)
        if i in early:
          m.add_constr(C >= t[i] + rest - big[i] * (1 - x[i][d]))
        m.add_constr(
          C >= start + k * mip.xsum(p[j] * x[j][d] for j in before[i]) + tail[i] * x[i][d]
        )
    if caps is not None:
      m.add_constr(mip.xsum(mem[i] * x[i][d] for i in range(n)) <= caps[d])
  if caps is None or len(set(caps)) == 1:
    for i in range(n):
      for d in range(1, M):
        earlier = [x[j][d - 1] for j in range(i)]
        m.add_constr(x[i][d] <= mip.xsum(earlier) if earlier else x[i][d] == 0)
  m.objective = mip.minimize(C)
  status = m.optimize(max_seconds=max(0.1, time_limit_s - (time.monotonic() - t0)),
                      **milp.node_limit(max_nodes))
  elapsed = time.monotonic() - t0
  if status == mip.OptimizationStatus.INFEASIBLE:
    return RelaxResult(bound=float("inf"), assignment=None, optimal=True, solve_time_s=elapsed)
  bound = max(lower_bound, milp.proven_bound(m, 0.0)) / unit
  assignment = None
  if m.num_solutions:
    assignment = tuple(max(range(M), key=lambda d: x[i][d].x) for i in range(n))
  optimal = status == mip.OptimizationStatus.OPTIMAL
  log.debug("relaxation n=%d k=%d M=%d status=%s bound=%.6g s %.2fs", n, k, M, status.name, bound,
            elapsed)
  return RelaxResult(bound=bound, assignment=assignment, optimal=optimal, solve_time_s=elapsed)
