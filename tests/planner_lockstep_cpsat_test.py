"""Explicit lock-step groups (TaskSchedule.groups) and the CP-SAT that chooses them
(planner/solvers/lockstep_cpsat.py). No clock: CP-SAT runs on a deterministic time limit, one thread,
a fixed seed; the assertions are invariants and brute-force optima."""

from __future__ import annotations

import dataclasses
import random

import pytest

from jaxhybrid.planner import PlannerOptions
from jaxhybrid.planner.search import fbw_search, lockstep_order
from jaxhybrid.planner.solvers import lockstep_cpsat
from jaxhybrid.planner import place_problem
from jaxhybrid.planner.pricing import lockstep_rule, price
from jaxhybrid.planner.core import task_schedule as ts
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule

_DET = 1.0  # CP-SAT deterministic time of each run here


def _with_groups(schedule: TaskSchedule, group_of: dict[Op, int]) -> TaskSchedule:
  return TaskSchedule(kind="custom", split=schedule.split, microbatches=schedule.microbatches,
                      devices=schedule.devices,
                      groups=tuple(tuple(group_of[o] for o in ops) for ops in schedule.devices))


def _slots_as_groups(prob: Problem, assign, schedule: TaskSchedule) -> TaskSchedule:
  """The schedule with each of the rule's slots made a group of its own (always valid)."""
  slots, _ = lockstep_rule.lockstep_groups(
    schedule, prob.edges, assign, price.task_reads(prob, schedule),
    grad_bytes=prob.param_bytes or None)
  return _with_groups(schedule, {o: j for j, slot in enumerate(slots) for _, o in slot})


def test_groups_are_checked_and_survive_json():
  ops = ((Op("F", 0, 0), Op("B", 0, 0)),)
  with pytest.raises(ValueError, match="non-decreasing"):
    TaskSchedule(kind="custom", split=False, microbatches=1, devices=ops, groups=((1, 0),))
  with pytest.raises(ValueError, match="group indices"):
    TaskSchedule(kind="custom", split=False, microbatches=1, devices=ops, groups=((0,),))
  sch = TaskSchedule(kind="custom", split=False, microbatches=1, devices=ops, groups=((0, 3),))
  assert TaskSchedule.from_dict(sch.to_dict()) == sch
  plain = TaskSchedule(kind="custom", split=False, microbatches=1, devices=ops)
  assert "groups" not in plain.to_dict() and TaskSchedule.from_dict(plain.to_dict()) == plain


def test_explicit_groups_keep_the_rules_of_the_lock_step():
  # Chain 0 -> 1 on two devices, one micro-batch: F(1) reads F(0)'s value from device 0.
  prob = Problem.build([3.0, 3.0], [(0, 1)], devices=2, transfer_s=0.5)
  assign = (0, 1)
  order = ts.generate("1f1b", 2, prob.edges, assign, 2, 1)
  same = {Op("F", 0, 0): 0, Op("F", 1, 0): 0, Op("B", 1, 0): 1, Op("B", 0, 0): 2}
  with pytest.raises(ValueError, match="arrives only after its group"):
    price.lockstep_price(prob, assign, _with_groups(order, same))
  ok = {Op("F", 0, 0): 0, Op("F", 1, 0): 1, Op("B", 1, 0): 1, Op("B", 0, 0): 3}
  got = price.lockstep_price(prob, assign, _with_groups(order, ok))
  derived = price.lockstep_price(prob, assign, order)
  # The same three groups as the rule derives (the empty group 2 is dropped): same price.
  assert got.groups == derived.groups == 3
  assert got.step_s == pytest.approx(derived.step_s)


def test_explicit_groups_keep_the_gradient_cap():
  # Two nodes on one device whose gradients together exceed the cap may not share a group.
  big = lockstep_rule.GROUP_GRAD_BYTES
  prob = Problem.build([1.0, 1.0, 1.0], [(0, 1), (1, 2)], devices=2,
                       memory_bytes=[big, big, 0])
  prob = dataclasses.replace(prob, param_bytes=(big, big, 0))
  assign = (0, 0, 1)
  order = ts.generate("gpipe", 3, prob.edges, assign, 2, 1)
  slots = _slots_as_groups(prob, assign, order)
  group_of = {o: g for ops, gs in zip(slots.devices, slots.groups) for o, g in zip(ops, gs)}
  group_of[Op("B", 0, 0)] = group_of[Op("B", 1, 0)]
  with pytest.raises(ValueError, match="gradient"):
    price.lockstep_price(prob, assign, _with_groups(order, group_of))


def _brute_force(prob: Problem, assign, k: int, split: bool) -> float:
  """The cheapest lock-step price over every grouping, for free messages: a shortest path over
  the sets of tasks done, each step one group (per device, any set of its tasks whose
  dependencies are done before, or in the set on the same device; gradient tasks of one node,
  or of several within the cap) costing its busiest device's work."""
  import heapq
  import itertools

  kinds = ("F", "B", "W") if split else ("F", "B")
  ops = [Op(t, i, c) for t in kinds for i in range(prob.num_nodes) for c in range(k)]
  deps = {o: [u for u, _, _ in price.fbw_dependencies(prob, o)] for o in ops}
  dur = {o: prob.task_s(o.kind, o.node, split) for o in ops}
  grads = prob.param_bytes or None

  def grad_ok(subset) -> bool:
    nodes = {o.node for o in subset if lockstep_rule.is_grad_task(o, split)}
    return len(nodes) < 2 or not lockstep_rule.too_many_grads(
      nodes, grads, lockstep_rule.GROUP_GRAD_BYTES)

  def options(d: int, done: frozenset) -> list[tuple]:
    avail = [o for o in ops if assign[o.node] == d and o not in done and all(
      u in done or assign[u.node] == d for u in deps[o])]
    out = []
    for r in range(len(avail) + 1):
      for subset in itertools.combinations(avail, r):
        chosen = set(subset)
        if all(u in done or u in chosen for o in subset for u in deps[o]) and grad_ok(subset):
          out.append(subset)
    return out

  start = frozenset()
  dist = {start: 0.0}
  heap = [(0.0, 0, start)]
  tie = itertools.count(1)
  while heap:
    cost, _, done = heapq.heappop(heap)
    if cost > dist[done]:
      continue
    if len(done) == len(ops):
      return cost
    for combo in itertools.product(*(options(d, done) for d in range(prob.devices))):
      new = done.union(*combo)
      if new == done:
        continue
      c = cost + max(sum(dur[o] for o in sub) for sub in combo)
      if c < dist.get(new, float("inf")) - 1e-12:
        dist[new] = c
        heapq.heappush(heap, (c, next(tie), new))
  return float("inf")


@pytest.mark.parametrize("seed", range(3))
def test_cpsat_groups_reach_the_brute_force_optimum(seed):
  # Free messages (the model's objective is then the lock-step price itself), two nodes per
  # device or fewer, two micro-batches: every grouping enumerated.
  rng = random.Random(seed)
  n = 3
  edges = [(0, 1), (1, 2)] + ([(0, 2)] if seed % 2 else [])
  prob = Problem.build([round(rng.uniform(1.0, 4.0), 1) for _ in range(n)], edges, devices=2)
  assign = (0, 1, 0) if seed != 1 else (0, 0, 1)
  k = 2
  warm = ts.generate("gpipe", n, prob.edges, assign, 2, k)
  warm_price = price.lockstep_price(prob, assign, warm).step_s
  got = lockstep_cpsat.improve(prob, assign, warm, None, time_limit_s=600,
                               deterministic_time=_DET)
  step = warm_price if got is None else got[1]
  if got is not None:
    ts.validate(got[0], n, prob.edges, assign)
    assert got[1] < warm_price
    assert price.lockstep_price(prob, assign, got[0]).step_s == pytest.approx(got[1])
  assert step == pytest.approx(_brute_force(prob, assign, k, False))


def test_cpsat_groups_respect_memory_caps():
  # A 4-node chain on two devices with 4 micro-batches; residuals large enough that GPipe's
  # all-forwards-first would not fit (900 bytes with its groups' buffers; the CP-SAT model's
  # relaxed rule admits regroupings over the cap, which are solved again under lower caps):
  # every result fits and is never worse than the warm start.
  prob = Problem.build([2.0, 1.0, 1.0, 2.0], [(0, 1), (1, 2), (2, 3)], devices=2,
                       activation_bytes=[100] * 4, transfer_s=0.1)
  assign = (0, 1, 0, 1)
  k = 4
  caps = (600.0, 600.0)
  warm = lockstep_order.lockstep_order(prob, assign, k, False, limit=2)
  assert price.fits(prob, assign, warm, caps)
  assert not price.fits(prob, assign, ts.generate("gpipe", 4, prob.edges, assign, 2, k), caps)
  warm_price = price.lockstep_price(prob, assign, warm).step_s
  got = lockstep_cpsat.improve(prob, assign, warm, caps, time_limit_s=600,
                               deterministic_time=3 * _DET)
  assert got is not None  # the interleaved V has idle groups that regrouping removes
  sch, step = got
  ts.validate(sch, prob.num_nodes, prob.edges, assign)
  assert step < warm_price
  assert price.fits(prob, assign, sch, caps)
  assert max(price.peak_memory_bytes(prob, assign, sch)) <= 600.0


def test_place_returns_explicit_groups_that_beat_every_order():
  # A V placement on an LSTM-like 4-node chain (embedding, two layers, output), 4 micro-batches:
  # the groups step finds a schedule cheaper than every generated and lock-step order of the
  # plan's placement, and the plan carries it.
  prob = Problem.build([0.1, 6.0, 6.0, 1.0], [(0, 1), (1, 2), (2, 3)], devices=2,
                       transfer_s=0.05, activation_bytes=[1] * 4)
  opts = PlannerOptions(devices=2, microbatches=4, time_limit_s=600, milp_max_nodes=200,
                        cpsat_deterministic_time=_DET, lockstep_evaluations=200,
                        search_evaluations=5, lockstep_groups_max_s=None,
                        warm_start_max_s=None, seed=0)
  plan = place_problem(prob, opts)
  sch = plan.task_schedule
  ts.validate(sch, prob.num_nodes, prob.edges, plan.assignment)
  step = price.lockstep_price(prob, plan.assignment, sch).step_s
  assert plan.lockstep_step_s == pytest.approx(step)
  assert plan.lockstep_bound_s <= step + 1e-9
  every = fbw_search.best_schedule(prob, plan.assignment, 4, None,
                                   extra=lockstep_order.variants(prob, plan.assignment, 4))
  # Without the step this problem's plan is dp/zb on (0, 0, 1, 1) at 32.35 (14.6 % over the
  # bound); with it the V placement's groups price 28.92.
  assert plan.lockstep_found_by.endswith("+groups") and sch.groups is not None
  assert step < every[2] - 1e-9


@pytest.mark.parametrize("split", [False, True])
def test_the_program_runs_explicit_groups_and_matches_the_reference(split):
  # The LSTM stack in a V of planner_lockstep_order_test, its lock-step order with each of the
  # rule's slots made a group of its own: more groups than the rule derives, run as given.
  from planner_lockstep_order_test import run_v_lstm

  def explicit(prob, assign):
    order = lockstep_order.lockstep_order(prob, assign, 2, split, limit=1, hard_limit=False)
    sch = _slots_as_groups(prob, assign, order)
    assert (price.lockstep_price(prob, assign, sch).groups
            > price.lockstep_price(prob, assign, order).groups)
    return sch

  prog = run_v_lstm(explicit)
  # The groups the program ran are the schedule's, task for task (not the ones the rule derives).
  sch = prog.schedule
  given: dict[int, set] = {}
  for d, (ops, gs) in enumerate(zip(sch.devices, sch.groups)):
    for op, g in zip(ops, gs):
      given.setdefault(g, set()).add((d, op))
  ran = [set(lay.tasks) for lay in prog.structure.groups]
  assert ran == [given[g] for g in sorted(given)], (len(ran), len(given))


def test_the_brute_force_of_a_two_node_chain_is_its_serial_time():
  # F(0), F(1), B(1), B(0) must each wait for the one before (across devices, a group later).
  prob = Problem.build([1.0, 2.0], [(0, 1)], devices=2)
  assert _brute_force(prob, (0, 1), 1, False) == pytest.approx(3.0)
  # On one device the four tasks may share one group: the same total.
  assert _brute_force(prob, (0, 0), 1, False) == pytest.approx(3.0)


@pytest.mark.parametrize("split", [False, True])
def test_other_family_is_the_same_placement_split_the_other_way(split):
  from jaxhybrid.planner import place_lockstep

  prob = Problem.build([1.0, 2.0, 2.0, 1.0], [(0, 1), (1, 2), (2, 3)], devices=2,
                       transfer_s=0.1, activation_bytes=[1] * 4)
  assign = (0, 0, 1, 1)
  sch = ts.generate("zb" if split else "1f1b", 4, prob.edges, assign, 2, 3)
  step = price.lockstep_price(prob, assign, sch).step_s
  choice = fbw_search.Choice(assign, sch, step, tuple(price.peak_memory_bytes(prob, assign, sch)),
                             "test/x")
  other = place_lockstep.other_family(prob, choice, 3, None)
  assert other is not None and other.assignment == assign
  assert other.schedule.split is (not split)
  ts.validate(other.schedule, 4, prob.edges, assign)
  assert other.step_s == pytest.approx(price.lockstep_price(prob, assign, other.schedule).step_s)
  # The cheapest of that family among the generated and lock-step orders.
  every = [s for _, s in fbw_search.schedules_for(prob, assign, 3)
           + lockstep_order.variants(prob, assign, 3) if s.split is (not split)]
  assert other.step_s <= min(price.lockstep_price(prob, assign, s).step_s for s in every) + 1e-12
  # Caps no schedule of that family meets: none.
  assert place_lockstep.other_family(prob, choice, 3, (0.5, 0.5)) is None
