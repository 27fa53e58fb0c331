"""A lower bound on the lock-step price of every plan that pays for what crosses devices.

The lock-step price (price.lockstep_price) of a placement and task schedule is a sum of two
parts, compute_s + transfer_s, and this module bounds each for the same placement x, then
minimises their sum over placements with a MILP (python-mip):

  - compute_s >= the device bounds of placement_bound: for a set U of task kinds (one
    micro-batch's F, B and, split, W of each node) with heads r >= r0 and tails q >= q0,
    every device d that holds a node of U satisfies
        compute_s >= min_U r + k sum_{tau in U on d} p_tau + min_U q.
    The groups of a lock-step schedule run back to back form an asynchronous schedule of the
    same placement without transfer delays (a task's inputs from other devices come from
    earlier groups), so every bound on such schedules holds for compute_s. Here U runs over a
    grid of THRESHOLDS x THRESHOLDS quantiles of (r0, q0), each written with one indicator
    h[U, d] >= x[i, d] for the nodes i of U.
  - transfer_s >= the bytes device a sends, times the least per-byte time of a message (one
    collective permute by a shift, as slow as that shift's slowest link): every message a
    group sends is at least as long as each sender's part in it, and each value crosses in one
    message (a forward value at least once when its producer is on a and a consumer is not; a
    cotangent once per edge whose consumer is on a and producer is not), k times, once per
    micro-batch. Without a link model (hand-built problems) a message costs the sum of its
    edges' one-way times, so each crossing edge pays its cheapest one-way time from a. Also
    transfer_s >= the messages along one micro-batch's dependency chain (`_chain_cuts`).

Memory caps: a device holds its nodes' static bytes and at least one residual of one of them.
Devices the model cannot tell apart (equal caps and equal cheapest links) are opened in order
of first use. The result is the least over the schedule families a plan may use (F and B, as
GPipe and 1F1B; F, B and W split, as ZB-H1) of the solver's proven bound on each (valid whatever
stopped it), in seconds.

With one micro-batch the forwards of the segments between articulation nodes (`segments`) run
one after another, and their backwards in reverse, so compute_s is at least the sum over those
phases of each one's busiest device (`_segment_cuts`).

What it misses: the lock step within the compute part (a group lasts as long as its busiest
device), message latencies, and the order constraints between micro-batches beyond the heads
and tails of one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import mip
import numpy as np

from jaxhybrid.planner.solvers import child
from jaxhybrid.planner.solvers import milp
from jaxhybrid.planner.lower_bounds import placement_bound
from jaxhybrid.planner.core.problem import Problem

log = logging.getLogger(__name__)

# Quantiles of the heads (and of the tails) that make the threshold grid of the compute cuts.
THRESHOLDS = 8
# Most rows h[U, d] >= x[i, d] the threshold cuts may add (fewer thresholds on big problems:
# building a python-mip model costs ~10 us a row, and that time is not the solver's limit).
MAX_THRESHOLD_ROWS = 40_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class LockstepBound:
  """What `solve` returned."""

  # A lower bound on the lock-step price of every plan of either family, seconds.
  bound: float
  # The bound of each family: {'fb': ..., 'fbw': ...}.
  by_family: dict[str, float]
  # Whether every family's MILP was solved to optimality.
  optimal: bool
  solve_time_s: float
  # The best placement of each family's MILP (cheap compute + transfers: a seed for the
  # lock-step search), where it found one.
  placements: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def _threshold_sets(problem: Problem, split: bool) -> tuple[list, list[float], list[float]]:
  """(task kinds, sets U as sorted task-index tuples, the min head + min tail of each)."""
  ops, head, tail = placement_bound.heads_and_tails(problem, split)
  h, q = np.asarray(head), np.asarray(tail)
  rows_per_set = max(1, problem.num_nodes * problem.devices)
  count = max(2, min(THRESHOLDS, int(math.sqrt(MAX_THRESHOLD_ROWS / rows_per_set))))
  levels = np.linspace(0.0, 1.0, count)
  r0s = np.unique(np.quantile(h, levels, method="lower"))
  q0s = np.unique(np.quantile(q, levels, method="lower"))
  sets, consts = {}, {}
  for r0 in r0s:
    for q0 in q0s:
      member = tuple(int(t) for t in np.nonzero((h >= r0) & (q >= q0))[0])
      if member and member not in sets:
        sets[member] = True
        consts[member] = float(h[list(member)].min() + q[list(member)].min())
  members = list(sets)
  return ops, members, [consts[m] for m in members]


def _family(
  problem: Problem, k: int, split: bool, caps: Sequence[float] | None, *, time_limit_s: float,
  max_nodes: int | None, threads: int, seed: int, solver: str,
) -> tuple[float, bool, tuple[int, ...] | None]:
  """(the proven bound in the problem's units, solved to optimality, the best placement) for
  one family."""
  n, M = problem.num_nodes, problem.devices
  ops, members, consts = _threshold_sets(problem, split)
  p = [problem.task_s(o.kind, o.node, split) for o in ops]
  m, x = milp.placement_model(solver, n, M, threads=threads, seed=seed, gap=1e-6,
                              gap_abs=1e-9)
  C = m.add_var(lb=0.0)
  X = m.add_var(lb=0.0)
  for member, const in zip(members, consts):
    nodes = sorted({ops[t].node for t in member})
    load = [0.0] * n
    for t in member:
      load[ops[t].node] += k * p[t]
    for d in range(M):
      h = m.add_var(lb=0.0, ub=1.0)
      for i in nodes:
        m.add_constr(h >= x[i][d])
      m.add_constr(C >= const * h + mip.xsum(load[i] * x[i][d] for i in nodes if load[i]))
  if k == 1:
    _segment_cuts(m, problem, x, C, split)
  # Transfers: each device's sends at its cheapest rate.
  uses = [0] * len(problem.value_bytes)
  for values in problem.edge_values:
    for v in values:
      uses[v] += 1
  _chain_cuts(m, problem, x, X, uses)
  for a in range(M):
    terms = []
    if problem.link_latency_s:
      # Per byte: a message by shift s costs at least its length at the slowest link of s.
      rate = min(max(problem.link_s_per_byte[b][(b + sh) % M] for b in range(M))
                 for sh in range(1, M)) if M > 1 else 0.0
      sent: dict[int, object] = {}  # value -> "a sends it" indicator
      for e, (u, c) in enumerate(problem.edges):
        for v in problem.edge_values[e]:
          w = sent.get(v)
          if w is None:
            w = sent[v] = m.add_var(lb=0.0, ub=1.0)
            terms.append(k * rate * problem.value_bytes[v] * w)
          m.add_constr(w >= x[u][a] - x[c][a])
        if problem.has_cotangent(e):
          z = m.add_var(lb=0.0, ub=1.0)
          m.add_constr(z >= x[c][a] - x[u][a])
          terms.append(k * rate * problem.edge_value_bytes(e, True) * z)
    else:
      for e, (u, c) in enumerate(problem.edges):
        others = [b for b in range(M) if b != a]
        if not others:
          continue
        # A value on several edges crosses once per device (price._messages): those edges'
        # forward times are left out rather than counted twice.
        t_f = 0.0 if any(uses[v] > 1 for v in problem.edge_values[e]) else min(
          problem.direction_s(e, a, b, False) for b in others)
        t_b = min(problem.direction_s(e, a, b, True) for b in others)
        if t_f > 0:
          z = m.add_var(lb=0.0, ub=1.0)
          m.add_constr(z >= x[u][a] - x[c][a])
          terms.append(k * t_f * z)
        if t_b > 0:
          z = m.add_var(lb=0.0, ub=1.0)
          m.add_constr(z >= x[c][a] - x[u][a])
          terms.append(k * t_b * z)
    if terms:
      m.add_constr(X >= mip.xsum(terms))
  if caps is not None:
    for d in range(M):
      biggest = m.add_var(lb=0.0)
      for i in range(n):
        if problem.activation_bytes[i]:
          m.add_constr(biggest >= problem.activation_bytes[i] / caps[d] * x[i][d])
      m.add_constr(mip.xsum(problem.static_bytes[i] / caps[d] * x[i][d] for i in range(n))
                   + biggest <= 1.0)
  if _interchangeable(problem, caps):
    for i in range(n):
      for d in range(1, M):
        earlier = [x[j][d - 1] for j in range(i)]
        m.add_constr(x[i][d] <= mip.xsum(earlier) if earlier else x[i][d] == 0)
  m.objective = mip.minimize(C + X)
  status = m.optimize(max_seconds=max(0.1, time_limit_s), **milp.node_limit(max_nodes))
  if status == mip.OptimizationStatus.INFEASIBLE:
    return float("inf"), True, None
  placement = None
  if m.num_solutions:
    placement = tuple(max(range(M), key=lambda d: x[i][d].x) for i in range(n))
  return (max(0.0, milp.proven_bound(m, 0.0)), status == mip.OptimizationStatus.OPTIMAL,
          placement)


def segments(problem: Problem) -> list[list[int]]:
  """The nodes cut into segments at the articulation nodes (those every other node is an
  ancestor or a descendant of, e.g. the output of an Inception block): each articulation node is
  a segment of its own, and the nodes between two consecutive ones form one. With one
  micro-batch every schedule runs the segments' forwards one after the other, and their
  backwards in reverse."""
  n = problem.num_nodes
  anc = milp.ancestors(problem)
  desc = [0] * n
  for i in range(n):
    for j in range(n):
      if (anc[j] >> i) & 1:
        desc[i] |= 1 << j
  full = (1 << n) - 1
  cut = [i for i in range(n) if (anc[i] | desc[i] | (1 << i)) == full]
  out, run = [], []
  for i in range(n):  # topological: a segment's nodes lie between its two cuts
    if i in cut:
      if run:
        out.append(run)
      out.append([i])
      run = []
    else:
      run.append(i)
  if run:
    out.append(run)
  return out


def _segment_cuts(m: mip.Model, problem: Problem, x: list, C: object, split: bool) -> None:
  """k = 1: C >= the sum over segments of the forward phase of each, plus the backward period:
  the sum of the segments' backward (B) phases, every phase at least its busiest device's work
  in it; split, also at least each device's B and W work (every W follows its B, and every B
  follows the last forward when the last node is a segment of its own: the loss)."""
  M, n = problem.devices, problem.num_nodes
  segs = segments(problem)
  if not segs or segs[-1] != [n - 1]:
    return
  phases: dict[str, list] = {"F": [], "B": []}
  for seg in segs:
    for kind in ("F", "B"):
      t = [problem.task_s(kind, i, split) for i in seg]
      if len(seg) == 1 or not any(t):
        phases[kind].append(sum(t))
        continue
      phase = m.add_var(lb=max(t))
      for d in range(M):
        m.add_constr(phase >= mip.xsum(w * x[i][d] for w, i in zip(t, seg) if w))
      phases[kind].append(phase)
  back = m.add_var(lb=0.0)
  m.add_constr(back >= mip.xsum(phases["B"]))
  if split:
    for d in range(M):
      m.add_constr(back >= mip.xsum(
        (problem.task_s("B", i, True) + problem.task_s("W", i, True)) * x[i][d] for i in range(n)))
  m.add_constr(C >= mip.xsum(phases["F"]) + back)


def ring_message_s(problem: Problem, nbytes: float) -> float:
  """The least a message at least `nbytes` long costs in lock step under the link model: the
  program sends it as one collective permute by a shift s, which lasts as long as its slowest
  link (price.lockstep_price: max over devices a of link_s(length, a, a + s)), whatever the
  shift."""
  M = problem.devices
  return min(max(problem.link_s(nbytes, a, (a + s) % M) for a in range(M)) for s in range(1, M))


def _message_s(problem: Problem, e: int, backward: bool, uses: Sequence[int]) -> float:
  """The least time the message of one direction of edge e takes when it crosses: latency plus
  bytes at the cheapest link (link model), else the edge's cheapest one-way time; 0 for a
  forward value another edge also carries (it may have crossed with that edge's message)."""
  M = problem.devices
  pairs = [(a, b) for a in range(M) for b in range(M) if a != b]
  if backward and not problem.has_cotangent(e):
    return 0.0
  if problem.link_latency_s:
    return ring_message_s(problem, problem.edge_value_bytes(e, backward))
  if not backward and any(uses[v] > 1 for v in problem.edge_values[e]):
    return 0.0
  return min(problem.direction_s(e, a, b, backward) for a, b in pairs)


def _chain_cuts(m: mip.Model, problem: Problem, x: list, X: object, uses: Sequence[int]) -> None:
  """transfer_s >= the messages along one micro-batch's dependency chain: a message leaves after
  the group of its producer and its consumer runs in a later group, so the message of a task
  that depends on that consumer comes in a later group still, and the messages of a chain are
  summed. lf[i]: messages on the longest forward chain into i; lb[i]: on the cotangent chain
  from a sink back to i. When the last node (the loss) is reached from every node, every B
  follows its forward, so X >= lf[last] + lb[i]; else X >= each alone."""
  n, M = problem.num_nodes, problem.devices
  if M < 2 or not problem.edges:
    return
  lf = [m.add_var(lb=0.0) for _ in range(n)]
  lb = [m.add_var(lb=0.0) for _ in range(n)]
  for e, (u, c) in enumerate(problem.edges):
    t_f, t_b = _message_s(problem, e, False, uses), _message_s(problem, e, True, uses)
    if t_f <= 0 and t_b <= 0:
      m.add_constr(lf[c] >= lf[u])
      m.add_constr(lb[u] >= lb[c])
      continue
    y = m.add_var(lb=0.0, ub=1.0)  # 1 when the edge crosses devices
    for a in range(M):
      m.add_constr(y >= x[u][a] - x[c][a])
    m.add_constr(lf[c] >= lf[u] + t_f * y)
    m.add_constr(lb[u] >= lb[c] + t_b * y)
  succs = problem.successors()
  reach = {n - 1}
  for i in reversed(range(n - 1)):
    if any(j in reach for j, _ in succs[i]):
      reach.add(i)
  if len(reach) == n and not succs[n - 1]:
    for i in range(n):
      m.add_constr(X >= lf[n - 1] + lb[i])
  else:
    for i in range(n):
      m.add_constr(X >= lf[i])
      m.add_constr(X >= lb[i])


def _interchangeable(problem: Problem, caps: Sequence[float] | None) -> bool:
  """Whether the model treats every device alike: equal caps and equal cheapest links."""
  M = problem.devices
  if M < 2:
    return True
  if caps is not None and len(set(caps)) > 1:
    return False
  if problem.link_latency_s:
    rates = {min(problem.link_s_per_byte[a][b] for b in range(M) if b != a) for a in range(M)}
    return len(rates) <= 1
  for e in range(len(problem.edges)):
    for back in (False, True):
      cheapest = {min(problem.direction_s(e, a, b, back) for b in range(M) if b != a)
                  for a in range(M)}
      if len(cheapest) > 1:
        return False
  return True


def _no_solution(problem, k, caps=None, *, families=("fb", "fbw"), **_) -> LockstepBound:
  """The result of a solve whose solver process died (child.py): the trivial bound 0."""
  return LockstepBound(bound=0.0, by_family={f: 0.0 for f in families}, optimal=False,
                       solve_time_s=0.0)


@child.isolated(_no_solution)
def solve(
  problem: Problem, k: int, caps: Sequence[float] | None = None, *, time_limit_s: float = 10.0,
  max_nodes: int | None = None, threads: int = 1, seed: int = 0, solver: str = "cbc",
  families: Sequence[str] = ("fb", "fbw"),
) -> LockstepBound:
  """The bound of the module docstring, seconds; the families share `time_limit_s`.

  Args:
    problem: the problem (M >= 2 devices).
    k: micro-batches.
    caps: memory cap per device in bytes, or None.
    time_limit_s, max_nodes: solver limits (set max_nodes for results independent of the clock).
    threads, seed, solver: solver settings (PlannerOptions).
    families: the schedule families a plan may use ('fb': F and B, as GPipe and 1F1B; 'fbw':
      B and W split, as ZB-H1); the bound is the least over them.
  """
  t0 = time.monotonic()
  unit = milp.time_unit(problem, k)
  scaled = problem.scaled_times(unit)
  got, optimal, placements = {}, True, {}
  unknown = set(families) - {"fb", "fbw"}
  if unknown or not families:
    raise ValueError(f"families={tuple(families)!r}: use 'fb' and/or 'fbw'.")
  todo = [(name, name == "fbw") for name in ("fb", "fbw") if name in families]
  for i, (name, split) in enumerate(todo):
    left = time_limit_s - (time.monotonic() - t0)
    value, opt, placement = _family(scaled, k, split, caps, time_limit_s=left / (len(todo) - i),
                                    max_nodes=max_nodes, threads=threads, seed=seed, solver=solver)
    got[name] = value / unit
    optimal = optimal and opt
    if placement is not None:
      placements[name] = placement
  elapsed = time.monotonic() - t0
  log.debug("lock-step bound n=%d k=%d M=%d %s %.2fs", problem.num_nodes, k, problem.devices,
            got, elapsed)
  return LockstepBound(bound=min(got.values()), by_family=got, optimal=optimal,
                       solve_time_s=elapsed, placements=placements)
