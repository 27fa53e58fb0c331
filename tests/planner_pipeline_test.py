"""Tests of the pipelined (k > 1 micro-batch) planner: bounds, relaxation, search heuristics."""

from __future__ import annotations

import pytest
from planner_test import _brute_force, _inception_like, _place, _random_problem

from jaxhybrid import planner
from jaxhybrid.planner.lower_bounds import bounds
from jaxhybrid.planner.solvers import relax
from jaxhybrid.planner.search import heuristics as heur
from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.core.problem import Problem

# The relaxation solved to optimality (a node limit far above what these tiny models need, and a
# time limit far above what that takes): the results do not depend on the machine's load.
EXACT = dict(time_limit_s=300.0, max_nodes=100_000)


def _layer_stack() -> Problem:
  """Four equal layers in a chain (the optimum with 2 devices and 4 micro-batches is 9.05)."""
  return Problem.build([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)], devices=2, transfer_s=0.05)


def test_idle_bounds_count_all_ancestors_on_the_other_devices():
  # A chain 0 -> 1 -> 2 -> 3: a device whose first node is 3 waits for 0, 1 and 2 (6 s of work on
  # the one other device) and the link; the longest path alone would give the same here, so
  # also check a fork where the ancestors are independent.
  prob = Problem.build([1, 2, 3, 1], [(0, 3), (1, 3), (2, 3)], devices=2, transfer_s=0.5)
  r, q = bounds.idle_bounds(prob)
  assert r[3] == pytest.approx(6 + 0.5)  # 0, 1, 2 run serially on the other device
  assert r[:3] == [0.0, 0.0, 0.0] and q[3] == 0.0
  assert q[0] == pytest.approx(0.5 + 1)
  three = Problem.build([1, 2, 3, 1], [(0, 3), (1, 3), (2, 3)], devices=3, transfer_s=0.5)
  assert bounds.idle_bounds(three)[0][3] == pytest.approx(3 + 0.5)  # max(path 3.5, 6/2 + 0.5)


def test_energetic_bound_sees_a_pipeline_filling():
  # A chain on 4 devices, 4 micro-batches: the bound must count the devices idling while the
  # first micro-batch works its way down; the trivial work bound 4 * 4 / 4 = 4 does not.
  prob = Problem.build([1, 1, 1, 1], [(0, 1), (1, 2), (2, 3)], devices=4)
  assert bounds.energetic_bound(prob, 4) > 4.5
  # Optimal: one layer per device, 3 s to fill plus 4 micro-batches: 7 s.
  assert bounds.lower_bound(prob, 4) <= 7.0 + 1e-9
  assert _place(prob, microbatches=4).fused_makespan_s == pytest.approx(7.0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 2])
def test_bounds_never_exceed_the_brute_force_optimum(seed, k):
  prob = _random_problem(200 + seed, n=3 if k == 2 else 5)
  best = _brute_force(prob, k)
  assert bounds.lower_bound(prob, k) <= best + 1e-9
  if k > 1:
    assert relax.solve(prob, k, **EXACT).bound <= best + 1e-9
  plan = _place(prob, microbatches=k)
  assert plan.lower_bound_s <= best + 1e-9
  assert plan.fused_makespan_s == pytest.approx(best, rel=1e-7)


def test_relaxation_bound_and_placement_on_a_layer_stack():
  res = relax.solve(_layer_stack(), 4, **EXACT)
  assert res.optimal
  # Each device works 8 s; one waits 1.05 s for the first micro-batch, the other 1.05 s after
  # its last: the bound is the optimum.
  assert res.bound == pytest.approx(9.05)
  assert sorted(res.assignment) == [0, 0, 1, 1]


def test_relaxation_infeasible_caps_raise():
  # Every node fits a device and the total fits both, but no split does (6 + 6 > 10).
  prob = Problem.build([1, 1, 1], [(0, 1), (1, 2)], devices=2, memory_bytes=[6, 6, 6])
  assert relax.solve(prob, 2, caps=(10.0, 10.0)).bound == float("inf")
  with pytest.raises(planner.InfeasibleError):
    planner.place_problem(prob, planner.PlannerOptions(devices=2, microbatches=2,
                                                       memory_caps_bytes=10, time_limit_s=5))


def test_interleaved_cuts_the_order_into_round_robin_chunks():
  one = heur.interleaved(_layer_stack(), 4, None, max_rounds=1)
  assert one.assignment == (0, 0, 1, 1)  # one round: a contiguous 2-stage pipeline
  assert one.makespan == pytest.approx(10.05)
  # Two rounds alternate the layers; list scheduling it gives 10.15 (the MILP finds 9.05), so
  # the best over rounds stays the contiguous split.
  assert heur.interleaved(_layer_stack(), 4, None).makespan == pytest.approx(10.05)
  assert heur.interleaved(_layer_stack(), 4, (1.0, 1.0)) is not None  # no memory: always fits
  capped = Problem.build([1, 1], [(0, 1)], devices=2, memory_bytes=[5, 5])
  assert heur.interleaved(capped, 1, (4.0, 4.0)) is None


def test_local_search_is_reproducible_and_respects_fixed_nodes():
  prob = _inception_like(blocks=2, devices=2, seed=3)
  start = heur.evaluate(prob, [1] + [0] * (prob.num_nodes - 1), 2)  # node 0 fixed on 1
  runs = [heur.local_search(prob, 2, None, start, 60.0, seed=5, fixed={0: 1},
                            max_evaluations=300) for _ in range(2)]
  assert runs[0] == runs[1]
  assert runs[0].makespan < start.makespan
  assert runs[0].assignment[0] == 1
  tasks = sched.to_tasks(prob, runs[0].assignment, [list(r) for r in runs[0].starts])
  planner.validate_schedule(prob, runs[0].assignment, tasks, 2)


def test_pipelined_plan_reports_an_honest_gap():
  prob = _inception_like(blocks=3, devices=2, seed=1)
  plan = _place(prob, microbatches=4, gap=0.01, cpsat_deterministic_time=0.3, milp_max_nodes=100)
  assert "interleaved" in plan.heuristics and "local" in plan.heuristics
  assert plan.lower_bound_s >= bounds.lower_bound(prob, 4) - 1e-12
  assert plan.gap == pytest.approx((plan.fused_makespan_s - plan.lower_bound_s)
                                   / plan.fused_makespan_s)
  assert plan.status in ("optimal", "feasible")
  assert (plan.status == "optimal") == (plan.gap <= 0.01 + 1e-9)


def test_window_search_descends_to_the_best_list_scheduled_split():
  # The layer stack from the all-on-one-device start (16 s): windows of two layers (4 placements
  # each) reach the contiguous 2-stage split, the best placement under list scheduling (10.05 s).
  prob = _layer_stack()
  start = heur.evaluate(prob, [0, 0, 0, 0], 4)
  found = heur.window_search(prob, 4, None, start, 60.0, max_window_placements=4)
  assert found.makespan == pytest.approx(10.05)
  assert found.assignment in ((0, 0, 1, 1), (1, 1, 0, 0))
  tasks = sched.to_tasks(prob, found.assignment, [list(r) for r in found.starts])
  planner.validate_schedule(prob, found.assignment, tasks, 4)
  # Fixed nodes stay put, and the search never returns something worse than its start.
  pinned = heur.window_search(prob, 4, None, start, 60.0, fixed={0: 0, 1: 0, 2: 0, 3: 0})
  assert pinned == start
  prob8 = _inception_like(blocks=2, devices=2, seed=4)
  start8 = heur.evaluate(prob8, [0] * prob8.num_nodes, 2)
  found8 = heur.window_search(prob8, 2, (1e18, 1e18), start8, 60.0, max_window_placements=8)
  assert found8.makespan <= start8.makespan
