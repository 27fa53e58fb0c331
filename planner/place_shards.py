"""Shard or whole: plan a graph with split leaves and the same graph with every leaf whole, and
keep the better plan (`jaxhybrid.graph.shard` makes the split graph; `jaxhybrid.parallelize`
calls this)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from jaxhybrid.planner.core.options import InfeasibleError, PlannerOptions
from jaxhybrid.planner.output.plan import Plan

log = logging.getLogger(__name__)


def _step_price(plan: Plan) -> float:
  return plan.predicted_step_s


def _peak(plan: Plan) -> float:
  return max(plan.device_peak_bytes or plan.device_memory() or (0.0,))


def spreads(plan: Plan, graph: Any) -> bool:
  """Whether `plan` (of the split `graph`) puts the pieces of some split leaf, or of some node
  split by rows, on two devices."""
  where = dict(zip(plan.node_names, plan.assignment))
  pieces = [s.shard_nodes for s in graph.shards]
  pieces += [s.piece_nodes for s in getattr(graph, "batch_splits", ())]
  return any(len({where.get(n) for n in p}) > 1 for p in pieces)


def whole_on_split(whole: Plan, graph: Any) -> tuple[int, ...]:
  """The whole-leaf plan's assignment mapped onto the split `graph`: each piece, and its leaf's
  pre and post nodes ('<node>/...'), on the device of the node it was cut from (a seed for the
  split graph's search)."""
  where = dict(zip(whole.node_names, whole.assignment))
  return tuple(int(where[n.name] if n.name in where else where[n.name.rsplit("/", 1)[0]])
               for n in graph.nodes)


def keeps_sharded(sharded: Plan, whole: Plan, tolerance: float | None = None,
                  graph: Any = None, min_saving: float | None = None) -> bool:
  """Whether the sharded graph's plan is kept over the placement-only one: priced faster by more
  than `tolerance` (default `PlannerOptions.spread_tolerance`), or priced at most `tolerance`
  slower with a per-device peak at least `min_saving` (`PlannerOptions.shard_min_memory_saving`)
  below the placement-only plan's. A small price edge does not earn the split's extra groups and
  messages (GNMT small on 2 pinned cores: priced 0.5 % faster, ran 10 % slower). Given the split
  `graph`, a plan that keeps every leaf's pieces on one device (the whole plan plus the split's
  own nodes) is never kept: it divides no memory and runs the same work plus the pieces' tasks,
  so a price edge can only be the two graphs' profiles differing (the uniform chain's such plan
  priced 6 % faster and ran 35 % slower on 2 pinned cores)."""
  opts = PlannerOptions()
  tol = opts.spread_tolerance if tolerance is None else tolerance
  saving = opts.shard_min_memory_saving if min_saving is None else min_saving
  if graph is not None and not spreads(sharded, graph):
    return False
  if _step_price(sharded) < _step_price(whole) * (1 - tol):
    return True
  return (_step_price(sharded) <= _step_price(whole) * (1 + tol)
          and _peak(sharded) < _peak(whole) * (1 - saving))


# Assumption: the share of `time_limit_s` `place_shard_or_whole` gives each of its two solves (the
# graph with every leaf whole, then the split graph); `lower_memory`'s re-plans share what is
# left, so the whole call stays within the limit. (Half each, plus half for each of the three
# re-plans, planned paper GNMT on 1x4 in 53 s at a 30 s limit.)
SOLVE_SHARE = 0.3


def place_shard_or_whole(g: Any, g_whole: Any, costs: Any, devices: int, **opts: Any) -> tuple[Plan, bool]:
  """Plans the graph with shard options and the graph with every leaf whole (each in
  `SOLVE_SHARE` of the time limit, the rest left to `lower_memory`), and keeps the sharded plan
  (with its graph) as `keeps_sharded` says: faster by more
  than `spread_tolerance`, or at most that much slower with `shard_min_memory_saving` less memory
  per device. Sharding must earn its place: the
  larger problem's search can end above the placement-only optimum. A problem only the sharded
  graph fits is planned sharded. Returns (plan, whether it is the sharded graph's)."""
  from jaxhybrid import planner  # through the package, as callers (and tests) see `place`

  place = planner.place
  limit = opts.get("time_limit_s", PlannerOptions().time_limit_s)
  deadline = time.monotonic() + limit
  half = dict(opts, time_limit_s=limit * SOLVE_SHARE)
  try:
    whole = place(g_whole, costs, devices=devices, **half)
  except InfeasibleError:
    whole = None
  seeds = tuple(half.get("seed_assignments", ()))
  if whole is not None:  # the whole plan, mapped onto the sharded graph, seeds its search
    seeds += (whole_on_split(whole, g),)
  try:
    sharded = place(g, costs, devices=devices, **dict(half, seed_assignments=seeds))
  except InfeasibleError:
    if whole is None:
      raise
    return whole, False
  if whole is None:
    return sharded, True
  chosen = PlannerOptions().replace(
    **{k: v for k, v in opts.items() if k in ("spread_tolerance", "shard_min_memory_saving")})
  tol, saving = chosen.spread_tolerance, chosen.shard_min_memory_saving
  low = lower_memory(g, costs, devices, sharded, tol,
                     **dict(half, time_limit_s=max(0.0, deadline - time.monotonic())))
  if (keeps_sharded(sharded, whole, tol, graph=g, min_saving=saving)
      or keeps_sharded(low, whole, tol, graph=g, min_saving=saving)):
    return low, True
  log.info("shard options priced %.4g s, every leaf whole %.4g s: keeping every leaf whole",
           _step_price(sharded), _step_price(whole))
  return whole, False


# Assumption: a plan whose per-device peak is within this fraction of its balanced figure (every
# device's static bytes equal, the same live bytes) is not re-planned for memory.
BALANCED_WITHIN = 0.10
# Assumption: the capped re-plans `lower_memory` tries, each one solve: caps this share of the way
# from the plan's peak down to its balanced figure (the search is not monotone in the cap: on
# paper BigLSTM 1x8 a 7 GiB cap found a 4.4 GiB plan at the uncapped price, a 5.7 GiB cap one
# 8 % slower).
LOWER_MEMORY_STEPS = (0.25, 0.5, 0.75)
# Assumption: a re-plan of `lower_memory` given less than this (s) is not started (a solve that
# short finds at best its seed again).
MIN_REPLAN_S = 0.2


def balanced_peak(plan: Plan) -> float:
  """`plan`'s per-device peak with the static bytes (parameters, optimizer state, gradients)
  spread evenly over the devices: what the same live bytes would need on balanced rows."""
  static = plan.device_memory()
  return sum(static) / max(1, len(static)) + _peak(plan) - max(static, default=0.0)


# Assumption: two plans whose per-device peaks differ by less than this fraction hold the same
# memory for `lower_memory`, which then keeps the faster (paper BigLSTM 1x8: 4.981 GiB at 244.9
# ms and 4.989 GiB at 234.1 ms; the first kept by peak alone lost to the whole-leaf plan's
# 237.7 ms).
SAME_PEAK = 0.02


def _lower(a: Plan, b: Plan) -> bool:
  """Whether `a` holds less memory than `b` (`SAME_PEAK`), or as much and is priced faster."""
  if _peak(a) < _peak(b) * (1 - SAME_PEAK):
    return True
  return _peak(a) <= _peak(b) * (1 + SAME_PEAK) and _step_price(a) < _step_price(b)


def lower_memory(g: Any, costs: Any, devices: int, plan: Plan, tolerance: float,
                 **opts: Any) -> Plan:
  """`plan`, or a plan of the same graph with a lower per-device peak priced at most `tolerance`
  above it: memory for (nearly) free. Every device allocates the fullest device's rows; the
  search minimises time and keeps the first fastest placement, however full its rows, and one
  node moved at a time (`search.spread.balance`) can cost more than a different placement
  altogether (paper BigLSTM 1x8, 8 micro-batches: each move of one table piece priced 11-23 %
  slower, while the plan found under a 7 GiB cap priced the same as the 9.2 GiB one). So the
  graph is re-planned under caps between the plan's peak and its balanced figure
  (`balanced_peak`, LOWER_MEMORY_STEPS), keeping the lowest peak priced within the tolerance
  (of peaks within SAME_PEAK of each other, the faster plan). The re-plans share `time_limit_s`
  of `opts` (each what is left over the re-plans still to come); none starts with under
  `MIN_REPLAN_S` left.
  The kept plan reports the caps and bounds of the problem as asked (a bound proven under lower
  caps does not hold without them)."""
  if devices < 2 or tolerance <= 0 or not plan.device_peak_bytes:
    return plan
  from jaxhybrid import planner  # through the package, as callers (and tests) see `place`

  limit = _step_price(plan) * (1 + tolerance)
  best = plan
  peak, ideal = _peak(plan), balanced_peak(plan)
  if peak <= ideal * (1 + BALANCED_WITHIN):
    return plan
  deadline = time.monotonic() + opts.get("time_limit_s", PlannerOptions().time_limit_s)
  for i, share in enumerate(LOWER_MEMORY_STEPS):
    left = (deadline - time.monotonic()) / (len(LOWER_MEMORY_STEPS) - i)
    if left < MIN_REPLAN_S:
      log.info("memory: %.3g s left for each re-plan, under %g s: stopping", left, MIN_REPLAN_S)
      break
    cap = peak - share * (peak - ideal)
    caps = tuple(min(c, cap) for c in (plan.memory_caps_bytes or (cap,) * devices))
    try:
      got = planner.place(g, costs, devices=devices, **dict(
        opts, memory_caps_bytes=caps, time_limit_s=left,
        seed_assignments=tuple(opts.get("seed_assignments", ())) + (tuple(best.assignment),)))
    except InfeasibleError as e:
      log.info("memory: no plan under %.4g GiB per device (%s)", cap / 2**30, str(e)[:120])
      continue
    log.info("memory: under %.4g GiB per device a plan of %.4g GiB at %.4g s (limit %.4g s)",
             cap / 2**30, _peak(got) / 2**30, _step_price(got), limit)
    if _step_price(got) <= limit and _lower(got, best):
      best = got
  if best is plan:
    return plan
  gap_tol = opts.get("gap", PlannerOptions().gap)
  lower = min(best.lower_bound_s, plan.lower_bound_s)
  gap = max(0.0, (best.fused_makespan_s - lower) / best.fused_makespan_s) if best.fused_makespan_s else 0.0
  return dataclasses.replace(
    best, memory_caps_bytes=plan.memory_caps_bytes, lower_bound_s=lower, gap=gap,
    lockstep_bound_s=min(best.lockstep_bound_s, plan.lockstep_bound_s),
    status=best.status if best.status not in ("optimal", "feasible")
    else ("optimal" if gap <= gap_tol + 1e-9 else "feasible"))
