"""The DLPlacer MILP (PAPER.md) for one problem, with k micro-batches sharing one placement.

Notation (PAPER.md -> code):
  x[i, d]   op i on device d                                  -> `x[i][d]` (binary)
  t_i       start time of op i; here one per micro-batch c    -> `t[i][c]`
  z_ij (alpha + s_ij / BW)  delay of edge (i, j)              -> `delay[e]` (>= the pair's delay)
  o_ij      order of two ops not ordered by precedence        -> `o[(u, v)]` (binary, u before v)
  C         makespan                                          -> `C`
Strengthening, all valid for schedules no longer than the warm start `upper_bound`:
  - orderings implied by precedence (node ancestry and micro-batch order) get no binary;
  - each t has bounds head_i + c p_i <= t[i][c] <= UB - tail_i - (k - c) p_i, and each big-M is
    the smallest valid one, M_uv = ub(t_u) + p_u - lb(t_v);
  - the same-device indicator y_ij >= x[i, d] + x[j, d] - 1 is shared by all micro-batch pairs;
  - load cuts C >= k sum_i p_i x[i, d]; C >= a known lower bound;
  - interchangeable devices are used in order of first use (symmetry breaking);
  - the warm start is the best heuristic schedule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Mapping, Sequence

import mip

from jaxhybrid.planner.lower_bounds import bounds
from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.search.heuristics import Candidate, retimed
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.solvers import child

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MilpResult:
  """What one MILP solve returned."""

  # 'optimal', 'feasible' (stopped by time or gap), 'none' (no incumbent) or 'infeasible'.
  status: str
  # Best placement and schedule found (None when status is 'none' or 'infeasible').
  candidate: Candidate | None
  # The solver's lower bound on the makespan (not clamped to the candidate's: a bound above it is
  # a bug the caller reports); global only when `restricted` is False, else it holds only for
  # the schedules that keep the fixed orderings.
  bound: float
  # Whether some orderings were fixed from the warm start (see PlannerOptions.max_free_pairs).
  restricted: bool
  solve_time_s: float


def ancestors(problem: Problem) -> list[int]:
  """Bitsets: bit j of result[i] is set when j is a proper ancestor of i."""
  anc = [0] * problem.num_nodes
  for j, (s, d) in sorted(((d, (s, d)) for s, d in problem.edges)):
    anc[d] |= anc[s] | (1 << s)
  return anc


def _canonical(warm: Candidate, free: Sequence[int], inter: Sequence[int]) -> Candidate:
  """Relabels interchangeable devices of `warm` in order of first use by the free nodes, so that
  the warm start satisfies the symmetry-breaking constraints."""
  if len(inter) < 2:
    return warm
  order = []
  for i in free:
    d = warm.assignment[i]
    if d in inter and d not in order:
      order.append(d)
  order += [d for d in inter if d not in order]
  perm = {old: new for old, new in zip(order, inter)}
  return dataclasses.replace(warm, assignment=tuple(perm.get(d, d) for d in warm.assignment))


def _first_last(warm: Candidate, M: int) -> list[tuple[int, int]]:
  """(first node, last node) of each device in the warm start (-1 when unused)."""
  out = []
  for d in range(M):
    on = [(s, i) for i, row in enumerate(warm.starts) if warm.assignment[i] == d for s in row]
    out.append((min(on)[1], max(on)[1]) if on else (-1, -1))
  return out


def _unordered_pairs(problem: Problem, k: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
  """Task pairs that precedence does not order: ((i, c), (j, c')) with i < j."""
  anc = ancestors(problem)
  out = []
  n = problem.num_nodes
  for j in range(n):
    for i in range(j):
      if (anc[j] >> i) & 1:  # i -> j: (i, c) precedes (j, c') iff c <= c'
        out.extend(((i, c), (j, c2)) for c in range(k) for c2 in range(c))
      else:
        out.extend(((i, c), (j, c2)) for c in range(k) for c2 in range(k))
  return out


def new_model(solver: str) -> mip.Model:
  """An empty minimisation model on `solver` ('cbc' or 'highs').

  Raises:
    ValueError: 'highs' was asked for and python-mip cannot load HiGHS.
  """
  if solver == "cbc":
    return mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
  try:
    return mip.Model(sense=mip.MINIMIZE, solver_name="HiGHS")
  except (FileNotFoundError, OSError, ImportError) as err:
    raise ValueError(
      f"solver='highs' but python-mip cannot load HiGHS ({type(err).__name__}); install it with "
      "`pip install 'jaxhybrid[highs]'` (mip[highs] and highsbox) or use solver='cbc'."
    ) from err


def _no_solution(problem, k, *, lower_bound=0.0, **_) -> MilpResult:
  """The result of a solve whose solver process died (child.py): no incumbent."""
  return MilpResult(status="none", candidate=None, bound=lower_bound, restricted=False,
                    solve_time_s=0.0)


@child.isolated(_no_solution)
def solve(
  problem: Problem,
  k: int,
  *,
  warm: Candidate,
  fixed: Mapping[int, int] | None = None,
  caps: Sequence[float] | None = None,
  interchangeable: Sequence[int] = (),
  lower_bound: float = 0.0,
  time_limit_s: float = 10.0,
  threads: int = 1,
  seed: int = 0,
  gap: float = 0.01,
  solver: str = "cbc",
  max_free_pairs: int = 4000,
  cuts: int = 0,
  max_nodes: int | None = None,
) -> MilpResult:
  """Minimises the makespan of `problem` with k micro-batches.

  Args:
    problem: the problem.
    k: micro-batches.
    warm: a valid schedule (respecting `fixed` and `caps`); its makespan bounds the search.
    fixed: node -> device for nodes whose device is given.
    caps: memory cap per device, or None.
    interchangeable: devices that may be relabelled freely (symmetry breaking among them).
    lower_bound: a known lower bound on the makespan.
    time_limit_s: solver time limit.
    threads, seed, gap, solver: solver settings (PlannerOptions).
    max_free_pairs: most ordering binaries; the rest are fixed from `warm`.
    cuts: solver cut generation (-1 automatic, 0 off).
    max_nodes: most branch-and-bound nodes (None: the time limit alone stops the solver).

  Returns:
    The result; its candidate is never worse than `warm`.
  """
  t_begin = time.monotonic()
  fixed = dict(fixed or {})
  warm = _canonical(warm, [i for i in range(problem.num_nodes) if i not in fixed],
                    list(interchangeable))
  # The model is solved in units of 1/unit seconds (time_unit); results are turned back.
  original, original_warm, unit = problem, warm, time_unit(problem, k)
  problem, lower_bound = problem.scaled_times(unit), lower_bound * unit
  warm = dataclasses.replace(warm, makespan=warm.makespan * unit,
                             starts=tuple(tuple(v * unit for v in row) for row in warm.starts))
  n, M, p = problem.num_nodes, problem.devices, problem.compute_s
  T = problem.transfer_s
  head, tail = sched.heads_tails(problem)
  ub = warm.makespan * (1 + 1e-9) + 1e-12
  succs = problem.successors()

  m = new_model(solver)
  m.verbose = 0
  m.threads = threads
  m.seed = seed
  m.max_mip_gap = gap
  m.max_mip_gap_abs = 1e-9
  m.cuts = cuts

  # x[i][d]: a 0/1 variable or a constant for fixed nodes.
  x: list[list[object]] = []
  for i in range(n):
    if i in fixed:
      x.append([1.0 if d == fixed[i] else 0.0 for d in range(M)])
    else:
      row = [m.add_var(var_type=mip.BINARY, name=f"x_{i}_{d}") for d in range(M)]
      m.add_constr(mip.xsum(row) == 1)
      x.append(row)
  free = [i for i in range(n) if i not in fixed]

  def lb_t(i, c):
    return head[i] + c * p[i]

  def ub_t(i, c):
    return max(lb_t(i, c), ub - tail[i] - (k - c) * p[i])

  t = [
    [m.add_var(lb=lb_t(i, c), ub=ub_t(i, c), name=f"t_{i}_{c}") for c in range(k)]
    for i in range(n)
  ]
  C = m.add_var(lb=max(lower_bound, 0.0), ub=ub, name="C")
  m.objective = mip.minimize(C)

  # Edge delays.
  delay: list[object] = []
  for e, (s, d) in enumerate(problem.edges):
    if s in fixed and d in fixed:
      delay.append(T[e][fixed[s]][fixed[d]])
      continue
    tmax = max(max(r) for r in T[e])
    if tmax <= 0:
      delay.append(0.0)
      continue
    v = m.add_var(lb=0.0, ub=tmax, name=f"delay_{e}")
    for a in range(M):  # if s on a: delay >= sum_b T[a][b] x[d, b]
      rhs = mip.xsum(T[e][a][b] * x[d][b] for b in range(M) if T[e][a][b])
      m.add_constr(v >= rhs - max(T[e][a]) * (1 - x[s][a]))
    for b in range(M):  # if d on b: delay >= sum_a T[a][b] x[s, a]
      col = [T[e][a][b] for a in range(M)]
      rhs = mip.xsum(col[a] * x[s][a] for a in range(M) if col[a])
      m.add_constr(v >= rhs - max(col) * (1 - x[d][b]))
    delay.append(v)

  # Precedence (with transfer delays) and micro-batch order.
  for e, (s, d) in enumerate(problem.edges):
    for c in range(k):
      m.add_constr(t[d][c] >= t[s][c] + p[s] + delay[e])
  for i in range(n):
    for c in range(k - 1):
      m.add_constr(t[i][c + 1] >= t[i][c] + p[i])
    if not succs[i]:
      m.add_constr(C >= t[i][k - 1] + p[i])

  # Load cuts and memory caps.
  mem = problem.memory_bytes(k)
  for d in range(M):
    m.add_constr(C >= k * mip.xsum(p[i] * x[i][d] for i in range(n)))
    if caps is not None:
      m.add_constr(mip.xsum(mem[i] * x[i][d] for i in range(n)) <= caps[d])

  # Fill cuts (k > 1): C >= k * load_d + idle before d's first node + idle after its last; the
  # binaries f/g pick a node of d as "first"/"last", and minimisation picks the smallest idles,
  # which is valid because the true first/last node's idles are at least as large.
  fill_start: list[tuple[object, float]] = []
  if k > 1 and M > 1:
    r_idle, q_idle = bounds.idle_bounds(problem)
    first_last = _first_last(warm, M)
    for d in range(M):
      f = [m.add_var(var_type=mip.BINARY, name=f"first_{i}_{d}") for i in range(n)]
      g = [m.add_var(var_type=mip.BINARY, name=f"last_{i}_{d}") for i in range(n)]
      for i in range(n):
        m.add_constr(f[i] <= x[i][d])
        m.add_constr(g[i] <= x[i][d])
      m.add_constr(mip.xsum(f) <= 1)
      m.add_constr(mip.xsum(g) <= 1)
      for j in range(n):
        if isinstance(x[j][d], mip.Var) or x[j][d]:
          m.add_constr(mip.xsum(f) >= x[j][d])
          m.add_constr(mip.xsum(g) >= x[j][d])
      m.add_constr(C >= k * mip.xsum(p[i] * x[i][d] for i in range(n))
                   + mip.xsum(r_idle[i] * f[i] for i in range(n))
                   + mip.xsum(q_idle[i] * g[i] for i in range(n)))
      first, last = first_last[d]
      fill_start.extend((f[i], 1.0 if i == first else 0.0) for i in range(n))
      fill_start.extend((g[i], 1.0 if i == last else 0.0) for i in range(n))

  # Symmetry: interchangeable devices are opened in order of first use by the free nodes.
  inter = list(interchangeable)
  for r, i in enumerate(free):
    for q in range(1, len(inter)):
      earlier = [x[j][inter[q - 1]] for j in free[:r]]
      m.add_constr(x[i][inter[q]] <= mip.xsum(earlier) if earlier else x[i][inter[q]] == 0)

  # No overlap on a device: disjunctions for task pairs that precedence leaves unordered.
  wt = warm.starts
  pairs = _unordered_pairs(problem, k)
  restricted = len(pairs) > max_free_pairs
  if restricted:
    pairs.sort(key=lambda uv: abs(wt[uv[0][0]][uv[0][1]] - wt[uv[1][0]][uv[1][1]]))
  y: dict[tuple[int, int], object] = {}
  o_start: list[tuple[object, float]] = []
  for idx, ((i, c), (j, c2)) in enumerate(pairs):
    if idx % 1024 == 1023 and time.monotonic() - t_begin > time_limit_s:
      # Building alone used the limit (Inception-V3 M=2 k=4: ~27k task pairs took 3.4 s on a
      # 0.7 s limit): no solve, no incumbent, no bound beyond the one given.
      log.info("pipelined MILP not solved: building it took over its %.2fs limit", time_limit_s)
      return MilpResult(status="none", candidate=None, bound=max(lower_bound, 0.0) / unit,
                        restricted=restricted, solve_time_s=time.monotonic() - t_begin)
    if i in fixed and j in fixed:
      if fixed[i] != fixed[j]:
        continue
      same = 1.0
    else:
      same = y.get((i, j))
      if same is None:
        same = y[(i, j)] = m.add_var(var_type=mip.BINARY, name=f"y_{i}_{j}")
        for d in range(M):
          m.add_constr(same >= x[i][d] + x[j][d] - 1)
    big_uv = ub_t(i, c) + p[i] - lb_t(j, c2)  # slack needed when (j, c2) goes first
    big_vu = ub_t(j, c2) + p[j] - lb_t(i, c)
    warm_first = wt[i][c] <= wt[j][c2]
    if idx >= max_free_pairs:  # restricted: keep the warm start's order
      o = 1.0 if warm_first else 0.0
    elif big_uv <= 0:
      o = 1.0
    elif big_vu <= 0:
      o = 0.0
    else:
      o = m.add_var(var_type=mip.BINARY, name=f"o_{i}_{c}_{j}_{c2}")
      o_start.append((o, 1.0 if warm_first else 0.0))
    if big_uv > 0:
      m.add_constr(t[j][c2] >= t[i][c] + p[i] - big_uv * (2 - o - same))
    if big_vu > 0:
      m.add_constr(t[i][c] >= t[j][c2] + p[j] - big_vu * (1 + o - same))

  # Warm start from the heuristic.
  start = [(C, warm.makespan)]
  wa = warm.assignment
  for i in free:
    start.extend((x[i][d], 1.0 if wa[i] == d else 0.0) for d in range(M))
  for i in range(n):
    start.extend((t[i][c], wt[i][c]) for c in range(k))
  for e, (s, d) in enumerate(problem.edges):
    if isinstance(delay[e], mip.Var):
      start.append((delay[e], T[e][wa[s]][wa[d]]))
  for (i, j), v in y.items():
    start.append((v, 1.0 if wa[i] == wa[j] else 0.0))
  start.extend(o_start)
  start.extend(fill_start)
  m.start = start

  remaining = max(0.1, time_limit_s - (time.monotonic() - t_begin))
  status = m.optimize(max_seconds=remaining, **node_limit(max_nodes))
  elapsed = time.monotonic() - t_begin
  bound = max(proven_bound(m, lower_bound), lower_bound) / unit
  if status == mip.OptimizationStatus.INFEASIBLE:
    return MilpResult(status="infeasible", candidate=None, bound=bound, restricted=restricted,
                      solve_time_s=elapsed)
  if m.num_solutions == 0:
    return MilpResult(status="none", candidate=None, bound=bound, restricted=restricted,
                      solve_time_s=elapsed)
  assign = [
    fixed[i] if i in fixed else max(range(M), key=lambda d: x[i][d].x) for i in range(n)
  ]
  cand = retimed(original, assign, [[t[i][c].x / unit for c in range(k)] for i in range(n)])
  if cand.makespan > original_warm.makespan:
    cand = original_warm
  optimal = status == mip.OptimizationStatus.OPTIMAL and not restricted
  if optimal:
    bound = max(bound, cand.makespan * (1 - gap))
  log.debug("milp n=%d k=%d pairs=%d status=%s obj=%.6g bound=%.6g %.2fs", n, k, len(pairs),
            status.name, cand.makespan, bound, elapsed)
  return MilpResult(
    status="optimal" if optimal and cand.makespan <= bound * (1 + 1e-9) + 1e-12 else "feasible",
    candidate=cand, bound=bound, restricted=restricted, solve_time_s=elapsed,
  )


def proven_bound(m: mip.Model, default: float) -> float:
  """The solver's lower bound on the objective, or `default` when it has none: CBC stopped
  before its root relaxation was solved reports None or its infinity (1.8e308; seen with a 0.1 s
  limit on Inception-V3's relaxation), which proves nothing."""
  b = m.objective_bound
  if b is None or not math.isfinite(b) or abs(b) >= 1e300:
    return default
  return float(b)


def placement_model(
  solver: str, n: int, M: int, *, threads: int, seed: int, gap: float, gap_abs: float
) -> tuple[mip.Model, list[list[mip.Var]]]:
  """A quiet model on `solver` with the given settings and x[i][d], binary, each node on one
  device (the start of the placement-only models: relax.py, lockstep_bound.py)."""
  m = new_model(solver)
  m.verbose = 0
  m.threads = threads
  m.seed = seed
  m.max_mip_gap = gap
  m.max_mip_gap_abs = gap_abs
  x = [[m.add_var(var_type=mip.BINARY) for _ in range(M)] for _ in range(n)]
  for i in range(n):
    m.add_constr(mip.xsum(x[i]) == 1)
  return m, x


# Model units: the MILPs solve problems whose one-device step (k micro-batches) is about this
# many units (Problem.scaled_times), not seconds.
MODEL_STEP_UNITS = 1000.0


def time_unit(problem: Problem, k: int) -> float:
  """Model units per second for `problem` at k micro-batches: the power of two that brings its
  one-device step nearest MODEL_STEP_UNITS (1 when it has no work)."""
  work = k * sum(problem.compute_s)
  if not work > 0 or not math.isfinite(work):
    return 1.0
  return 2.0 ** round(math.log2(MODEL_STEP_UNITS / work))


def node_limit(max_nodes: int | None) -> dict[str, int]:
  """python-mip's `optimize` keyword for a node limit, or none."""
  return {} if max_nodes is None else {"max_nodes": int(max_nodes)}
