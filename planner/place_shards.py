"""Shard or whole: plan a graph with split leaves and the same graph with every leaf whole, and
keep the better plan (`jaxhybrid.graph.shard` makes the split graph; `jaxhybrid.parallelize`
calls this)."""

from __future__ import annotations

import logging
from typing import Any

from jaxhybrid.planner.core.options import InfeasibleError, PlannerOptions
from jaxhybrid.planner.output.plan import Plan

log = logging.getLogger(__name__)


def _step_price(plan: Plan) -> float:
  return plan.predicted_step_s


def _peak(plan: Plan) -> float:
  return max(plan.device_peak_bytes or plan.device_memory() or (0.0,))


def spreads(plan: Plan, graph: Any) -> bool:
  """Whether `plan` (of the split `graph`) puts the pieces of some split leaf on two devices."""
  where = dict(zip(plan.node_names, plan.assignment))
  return any(len({where.get(n) for n in s.shard_nodes}) > 1 for s in graph.shards)


def whole_on_split(whole: Plan, graph: Any) -> tuple[int, ...]:
  """The whole-leaf plan's assignment mapped onto the split `graph`: each piece, and its leaf's
  pre and post nodes ('<node>/...'), on the device of the node it was cut from (a seed for the
  split graph's search)."""
  where = dict(zip(whole.node_names, whole.assignment))
  return tuple(int(where[n.name] if n.name in where else where[n.name.rsplit("/", 1)[0]])
               for n in graph.nodes)


def keeps_sharded(sharded: Plan, whole: Plan, tolerance: float | None = None,
                  graph: Any = None) -> bool:
  """Whether the sharded graph's plan is kept over the placement-only one: priced faster, or at
  most `tolerance` (default `PlannerOptions.spread_tolerance`) slower with a smaller peak. Given
  the split `graph`, a plan that keeps every leaf's pieces on one device (the whole plan plus the
  split's own nodes) is kept only when priced faster by more than the tolerance: BigLSTM small
  on 2 pinned cores, priced 0.1 % faster than its whole-leaf twin, measured 1.010x and 0.981x
  its step in two runs (noise), so the simpler program is kept."""
  tol = PlannerOptions().spread_tolerance if tolerance is None else tolerance
  if graph is not None and not spreads(sharded, graph):
    return _step_price(sharded) < _step_price(whole) * (1 - tol)
  return (_step_price(sharded) < _step_price(whole)
          or (_step_price(sharded) <= _step_price(whole) * (1 + tol)
              and _peak(sharded) < _peak(whole)))


def place_shard_or_whole(g: Any, g_whole: Any, costs: Any, devices: int, **opts: Any) -> tuple[Plan, bool]:
  """Plans the graph with shard options and the graph with every leaf whole, each in half the
  time limit, and keeps the sharded plan (with its graph) when it is faster, or at most
  `spread_tolerance` slower with less memory per device. Sharding must earn its place: the
  larger problem's search can end above the placement-only optimum. A problem only the sharded
  graph fits is planned sharded. Returns (plan, whether it is the sharded graph's)."""
  from jaxhybrid import planner  # through the package, as callers (and tests) see `place`

  place = planner.place
  limit = opts.get("time_limit_s", PlannerOptions().time_limit_s)
  half = dict(opts, time_limit_s=limit / 2)
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
  tol = PlannerOptions().replace(
    **{k: v for k, v in opts.items() if k == "spread_tolerance"}).spread_tolerance
  if keeps_sharded(sharded, whole, tol, graph=g):
    return sharded, True
  log.info("shard options priced %.4g s, every leaf whole %.4g s: keeping every leaf whole",
           _step_price(sharded), _step_price(whole))
  return whole, False
