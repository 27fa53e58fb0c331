"""Lower bounds on the makespan that hold for every placement (the honest side of `Plan.gap`).

Notation as in schedule.py: p_i the time of one task of node i, k micro-batches, M devices, W the
sum of p_i; head_i / tail_i the longest compute-only paths before i starts and after i ends. Every
bound here ignores transfers except through `fastest`, the cheapest delay of an edge between two
distinct devices, which any edge crossing devices pays (`_earliest` weighs it against what
sharing a device costs: the micro-batch copies of both ends queue on that device).
`prefix_bound` enumerates the devices of the first nodes, where the placement then fixes the link
delays exactly (PAPER.md, "DLPlacer": the delay of an edge depends on its ends' devices).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Mapping, Sequence

from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.core.problem import Problem

log = logging.getLogger(__name__)


def _fastest(problem: Problem, e: int) -> float:
  """The least delay of edge e between two distinct devices."""
  return min(
    (v for a, row in enumerate(problem.transfer_s[e]) for b, v in enumerate(row) if a != b),
    default=0.0,
  )


def _closure_work(problem: Problem) -> tuple[list[float], list[float]]:
  """Per node: the summed p of its proper ancestors and of its proper descendants."""
  n, p = problem.num_nodes, problem.compute_s
  anc = [0] * n
  for s, d in sorted(problem.edges, key=lambda e: e[1]):
    anc[d] |= anc[s] | (1 << s)
  desc = [0] * n
  for s, d in sorted(problem.edges, key=lambda e: -e[0]):
    desc[s] |= desc[d] | (1 << d)

  def work(bits: int) -> float:
    total = 0.0
    while bits:
      low = bits & -bits
      total += p[low.bit_length() - 1]
      bits ^= low
    return total

  return [work(a) for a in anc], [work(d) for d in desc]


def idle_bounds(problem: Problem) -> tuple[list[float], list[float]]:
  """Per node i: (r_i, q_i), the least idle time of a device before i when i is its first node
  and after i when i is its last.

  When i is the first node of device d, micro-batch 0 of every ancestor of i runs before (i, 0)
  on the other devices, and the data of i's last predecessor crosses a link. So r_i is at least
  - the longest path to a predecessor j plus p_j plus the fastest link of edge (j, i); and
  - the ancestors' work spread over the M - 1 other devices, sum_{a anc i} p_a / (M - 1), plus
    the fastest link of i's cheapest incoming edge (the predecessor that ends last is one of i's
    predecessors, and every ancestor ends before some predecessor does).
  q_i is the mirror image for i last on d: micro-batch k - 1 of every descendant runs after it
  elsewhere. Sources have r_i = 0 and sinks q_i = 0.
  """
  p, n, M = problem.compute_s, problem.num_nodes, problem.devices
  head, tail = sched.heads_tails(problem)
  preds, succs = problem.predecessors(), problem.successors()
  anc_work, desc_work = _closure_work(problem)
  spread = max(1, M - 1)
  r, q = [0.0] * n, [0.0] * n
  for i in range(n):
    if preds[i]:
      links = [_fastest(problem, e) for _, e in preds[i]]
      path = max(head[j] + p[j] + t for (j, _), t in zip(preds[i], links))
      r[i] = max(path, anc_work[i] / spread + min(links)) if M > 1 else path
    if succs[i]:
      links = [_fastest(problem, e) for _, e in succs[i]]
      path = max(t + p[j] + tail[j] for (j, _), t in zip(succs[i], links))
      q[i] = max(path, desc_work[i] / spread + min(links)) if M > 1 else path
  return r, q


def _earliest(
  problem: Problem, k: int, reverse: bool, fixed: Mapping[int, int] | None = None
) -> list[list[float]]:
  """Earliest start of each task (i, c) from time 0, or (reverse) the least time from the end of
  (i, c) to the makespan. Micro-batches of a node run in order.

  For each edge (j, i) either its ends share a device or the data crosses a link. Sharing a device
  d, the tasks (j, 0..c) and (i, 0..c-1) all run on d before (i, c) starts, and none starts before
  est(j, 0); crossing, (i, c) waits for (j, c) and the edge's fastest link. So

    est(i, c) >= max(est(j, c) + p_j,
                     min(est(j, c) + p_j + fastest(j, i), est(j, 0) + (c + 1) p_j + c p_i))

  for every predecessor j. Reversed, the same holds with successors and micro-batches counted from
  the last. When both ends of an edge are in `fixed` (node -> device), the minimum is replaced by
  the branch that placement takes: the sharing term, or the link between the two given devices.
  Moreover, with G the fixed ancestors of a fixed node i on i's device, every (j, c') with j in G
  and c' <= c precedes (i, c) on that device, as do (i, 0..c-1), and none starts before est(j, 0):

    est(i, c) >= min_{j in G} est(j, 0) + (c + 1) sum_{j in G} p_j + c p_i

  (reversed: the fixed descendants).
  """
  n, p = problem.num_nodes, problem.compute_s
  fixed = fixed or {}
  nbrs = problem.successors() if reverse else problem.predecessors()
  group: dict[int, list[int]] = {}  # fixed node -> its fixed ancestors (descendants) on its device
  if fixed:
    anc = [0] * n
    for s, d in sorted(problem.edges, key=lambda e: e[1]):
      anc[d] |= anc[s] | (1 << s)
    for i, d in fixed.items():
      group[i] = [j for j, dj in fixed.items() if dj == d and j != i
                  and ((anc[j] >> i) & 1 if reverse else (anc[i] >> j) & 1)]
  links = [_fastest(problem, e) if problem.devices > 1 else float("inf")
           for e in range(len(problem.edges))]
  order = range(n - 1, -1, -1) if reverse else range(n)
  est = [[0.0] * k for _ in range(n)]  # est[i][r]: r counts micro-batches in execution order
  for i in order:
    for r in range(k):
      v = est[i][r - 1] + p[i] if r else 0.0
      for j, e in nbrs[i]:
        after = est[j][r] + p[j]  # compute-only
        share = est[j][0] + (r + 1) * p[j] + r * p[i]
        if i in fixed and j in fixed:
          a, b = (fixed[i], fixed[j]) if reverse else (fixed[j], fixed[i])
          v = max(v, after, share if a == b else after + problem.transfer_s[e][a][b])
        else:
          v = max(v, after, min(after + links[e], share))
      g = group.get(i)
      if g:
        v = max(v, min(est[j][0] for j in g) + (r + 1) * sum(p[j] for j in g) + r * p[i])
      est[i][r] = v
  if reverse:  # back to micro-batch numbering: the last micro-batch is the first from the end
    est = [row[::-1] for row in est]
  return est


def _idle_curve(
  problem: Problem, est: Sequence[Sequence[float]]
) -> tuple[list[float], list[float]]:
  """Breakpoints t and the least total idle of the M devices within the first (or, reversed,
  the last) t seconds of any schedule.

  Within a window of length t, task (i, c) can do at most min(p_i, max(0, t - est(i, c))) of its
  work (`est`: `_earliest`, forward for the first t seconds, reversed for the last); the M t
  device-seconds not so covered are idle. Idle time only accumulates, so the curve is the running
  maximum.
  """
  p, M = problem.compute_s, problem.devices
  events: dict[float, float] = {}  # slope changes of the work curve
  for i, row in enumerate(est):
    if p[i] <= 0:
      continue
    for e in row:
      events[e] = events.get(e, 0.0) + 1.0
      events[e + p[i]] = events.get(e + p[i], 0.0) - 1.0
  times, idle = [0.0], [0.0]
  work, slope, last = 0.0, 0.0, 0.0
  for t in sorted(events):
    work += slope * (t - last)
    slope += events[t]
    last = t
    times.append(t)
    idle.append(max(idle[-1], M * t - work))
  return times, idle


def energetic_bound(
  problem: Problem,
  microbatches: int,
  start: float = 0.0,
  fixed: Mapping[int, int] | None = None,
) -> float:
  """A bound from the idle time forced at the start and at the end of any schedule.

  With makespan C, M C = k W + total idle. For windows [0, a] and [C - b, C] with a + b <= C the
  idle inside them is at least I_start(a) + I_end(b) (`_idle_curve`), so
  C >= g(C) = max_{a + b <= C} (k W + I_start(a) + I_end(b)) / M. g is nondecreasing, so
  iterating C <- g(C) from a valid bound `start` only ever yields valid bounds (if C* >= C then
  C* >= g(C*) >= g(C)). An "energetic reasoning" bound in the sense of scheduling theory
  (Baptiste, Le Pape and Nuijten, "Constraint-Based Scheduling", 2001, ch. 3), specialised here.

  Args:
    problem: the problem.
    microbatches: k.
    start: a known valid lower bound to iterate from.
    fixed: node -> device; the bound then holds for the placements that agree with it.

  Returns:
    The bound (at least `start`).
  """
  k, M = microbatches, problem.devices
  total = k * sum(problem.compute_s)
  ts, i_start = _idle_curve(problem, _earliest(problem, k, False, fixed))
  te, i_end = _idle_curve(problem, _earliest(problem, k, True, fixed))
  bound = max(start, total / M)
  for _ in range(100):
    best = 0.0
    for a, ia in zip(ts, i_start):
      if a > bound:
        break
      b = bisect.bisect_right(te, bound - a) - 1
      best = max(best, (total + ia + i_end[b]) / M)
    if best <= bound * (1 + 1e-12):
      break
    bound = best
  return bound


def work_bound(
  problem: Problem, microbatches: int, r: Sequence[float], q: Sequence[float]
) -> float:
  """min over the number m of used devices of (k W + the m smallest r + the m smallest q) / m:
  the first tasks of the m used devices are distinct nodes, each idling its device r_i before it
  (`idle_bounds`), and likewise after the last tasks."""
  n, M = problem.num_nodes, problem.devices
  r, q = sorted(r), sorted(q)
  total = microbatches * sum(problem.compute_s)
  return min((total + sum(r[:m]) + sum(q[:m])) / m for m in range(1, min(M, n) + 1))


def lower_bound(problem: Problem, microbatches: int) -> float:
  """A lower bound on the makespan of any placement on M devices, k = `microbatches`.

  The largest of:
  - max_i head_i + k p_i + tail_i: the critical path for one micro-batch, and the k serial runs of
    node i between its longest head and tail;
  - max_{i, c} est(i, c) + p_i + est'(i, c), the same path through each task with the link-or-share
    earliest starts of `_earliest` (est' reversed);
  - `work_bound` with the idle times of `idle_bounds`;
  - `energetic_bound`, iterated from the two above.
  """
  k, p, n = microbatches, problem.compute_s, problem.num_nodes
  if not n:
    return 0.0
  head, tail = sched.heads_tails(problem)
  r, q = idle_bounds(problem)
  simple = max(work_bound(problem, k, r, q), max(head[i] + k * p[i] + tail[i] for i in range(n)))
  est, est_rev = _earliest(problem, k, reverse=False), _earliest(problem, k, reverse=True)
  simple = max(simple, max(est[i][c] + p[i] + est_rev[i][c] for i in range(n) for c in range(k)))
  return energetic_bound(problem, k, simple)


def prefix_length(problem: Problem, max_assignments: int) -> int:
  """The most leading nodes whose M^L device assignments number at most `max_assignments`."""
  M, n = problem.devices, problem.num_nodes
  if M < 2 or max_assignments < M:
    return 0
  length = 0
  while length < n and M ** (length + 1) <= max_assignments:
    length += 1
  return length


def _fixed_bound(problem: Problem, k: int, fixed: Mapping[int, int], anc: Sequence[int]) -> float:
  """A lower bound valid for the placements that agree with `fixed` (any set of nodes).

  The largest of: the path through each task with the placement-aware earliest starts
  (`_earliest` with `fixed`); for two fixed nodes u and w on one device d with w = u or w a
  descendant of u, est(u, 0) + k sum p_j + est'(w, k - 1) over the fixed nodes j of d that are
  descendants of u and ancestors of w (all k tasks of each such j run on d after (u, 0) starts
  and before (w, k - 1) ends); and `energetic_bound` iterated from these.
  """
  n, p = problem.num_nodes, problem.compute_s
  est, est_rev = _earliest(problem, k, False, fixed), _earliest(problem, k, True, fixed)
  bound = max(est[i][c] + p[i] + est_rev[i][c] for i in range(n) for c in range(k))
  for u, du in fixed.items():
    for w, dw in fixed.items():
      if dw != du or not (w == u or (anc[w] >> u) & 1):
        continue
      work = sum(
        p[j] for j, dj in fixed.items()
        if dj == du and (j == u or (anc[j] >> u) & 1) and (j == w or (anc[w] >> j) & 1)
      )
      bound = max(bound, est[u][0] + k * work + est_rev[w][k - 1])
  return energetic_bound(problem, k, bound, fixed)


def fixed_bound(problem: Problem, k: int, fixed: Mapping[int, int]) -> float:
  """A lower bound valid for every placement that agrees with `fixed` (node -> device): the
  largest of `lower_bound` (valid for every placement) and `_fixed_bound`."""
  anc = [0] * problem.num_nodes
  for s, d in sorted(problem.edges, key=lambda e: e[1]):
    anc[d] |= anc[s] | (1 << s)
  base = lower_bound(problem, k)
  return max(base, _fixed_bound(problem, k, fixed, anc)) if fixed else base


def prefix_bound(
  problem: Problem,
  microbatches: int,
  start: float = 0.0,
  max_assignments: int = 1024,
  time_limit_s: float | None = None,
) -> float:
  """A lower bound from enumerating the devices of the first L nodes (M^L <= max_assignments).

  Every placement puts the nodes 0..L-1 (a topological prefix: their predecessors are among them)
  on some devices; for each of the M^L assignments `_fixed_bound` is valid for the placements
  that extend it, so the least of them is valid for every placement. Knowing the prefix's devices
  turns the link-or-share choices of `_earliest` on the prefix's edges into facts and serialises
  the prefix nodes that share a device, which is where a pipeline fills: on Inception-V3
  (M = 4, k = 4, DGX-1 costs) the stem's five nodes raise the bound from 0.3589 s to 0.3716 s in
  about 1.6 s. Measured there, longer prefixes (6, 7 nodes) and a best-first branch and bound on
  the same per-assignment bound (20 s: 0.3725 s) add little: the bound of a placement rises
  mostly once the late blocks' devices are known. The enumeration stops early once an
  assignment's bound is at most `start` (it can then not raise it), and gives up, returning
  `start`, when `time_limit_s` runs out (the least over part of the assignments proves nothing).

  Args:
    problem: the problem.
    microbatches: k.
    start: a known valid lower bound (returned when the enumeration cannot beat it).
    max_assignments: most prefix assignments evaluated (sets L); below M nothing is enumerated.
    time_limit_s: wall-clock budget of the enumeration, or None for no limit.

  Returns:
    The bound (at least `start`).
  """
  k, M = microbatches, problem.devices
  length = prefix_length(problem, max_assignments)
  if length == 0 or k < 1:
    return start
  anc = [0] * problem.num_nodes
  for s, d in sorted(problem.edges, key=lambda e: e[1]):
    anc[d] |= anc[s] | (1 << s)
  t0 = time.monotonic()
  least = float("inf")
  for combo in itertools.product(range(M), repeat=length):
    if time_limit_s is not None and time.monotonic() - t0 > time_limit_s:
      log.info("prefix bound: %d nodes, out of time after %.1fs; not used", length, time_limit_s)
      return start
    least = min(least, _fixed_bound(problem, k, dict(enumerate(combo)), anc))
    if least <= start:
      return start
  log.debug("prefix bound: %d nodes, %.6g (from %.6g) in %.2fs", length, least, start,
            time.monotonic() - t0)
  return max(start, least)


# A lower bound above the makespan by less than this (relative, absolute) is the solvers'
# tolerance (CP-SAT's integer times; CBC's feasibility tolerance on the relaxation's big-M rows:
# measured 4e-4 relative on paper BigLSTM M=2 k=4, the relaxation's bound 0.1944861 s against a
# valid 0.1944091 s schedule), not an error; it is logged as a warning and the makespan is used.
_BOUND_RTOL = 1e-3
_BOUND_ATOL = 1e-12


def audited_bound(proven: Mapping[str, float], makespan: float) -> float:
  """The largest of the `proven` lower bounds that a schedule of length `makespan` does not
  refute.

  A lower bound above the makespan of a schedule that exists is wrong: it is logged at ERROR
  level, with the bound's name in the log record's `planner_bound_error` attribute (tests count
  those records), and left out. Within _BOUND_RTOL of the makespan the excess is the solvers'
  rounding, and the makespan is returned.

  Args:
    proven: name of the bound (e.g. 'relaxation', 'cpsat') -> its value in seconds.
    makespan: the makespan of the returned schedule.

  Returns:
    The bound, at most `makespan`.
  """
  valid = []
  for name, value in proven.items():
    if value > makespan * (1 + _BOUND_RTOL) + _BOUND_ATOL:
      log.error("The %s lower bound %.9g is above a schedule of makespan %.9g: a planner bug; "
                "the bound is not used.", name, value, makespan,
                extra={"planner_bound_error": name})
    else:
      if value > makespan:  # rounding (often equal to 9 digits): not worth a user's warning
        log.info("The %s lower bound %.9g is above the schedule's makespan %.9g by the "
                 "solvers' tolerance; using the makespan.", name, value, makespan)
      valid.append(min(value, makespan))
  return max(valid, default=0.0)
