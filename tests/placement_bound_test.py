"""The one-machine bound over every placement (planner/lower_bounds/placement_bound.py) against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
from planner_fbw_test import CASES, WORK, _brute_force, _tiny

from jaxhybrid import planner
from jaxhybrid.planner.pricing import price
from jaxhybrid.planner.search import fbw_search
from jaxhybrid.planner.lower_bounds import placement_bound as pb
from jaxhybrid.planner.core import task_schedule as ts
from jaxhybrid.planner.core.problem import Problem


def _random_dag(seed: int, n: int, devices: int) -> Problem:
  rng = random.Random(seed)
  edges = sorted({(rng.randrange(j), j) for j in range(1, n) for _ in range(rng.randint(1, 2))})
  compute = [rng.uniform(0.5, 3.0) for _ in range(n)]
  return Problem.build(
    compute, edges, devices=devices, transfer_s=[rng.uniform(0.0, 0.4) for _ in edges],
    memory_bytes=[rng.randint(2, 10) for _ in range(n)],
    activation_bytes=[rng.randint(1, 4) for _ in range(n)],
    forward_s=[c * rng.uniform(0.2, 0.5) for c in compute],
  )


@pytest.mark.parametrize("name,k,split,caps", CASES)
def test_bound_is_below_the_best_asynchronous_plan(name, k, split, caps):
  prob = _tiny(name == "diamond")
  want = _brute_force(prob, k, split, caps)
  got = pb.placement_bound(prob, k, split, caps)
  assert got <= want * (1 + 1e-9)
  # Never below the precedence bound's one-device parts it refines: a device holding every
  # node's k micro-batches works k * sum(p) whatever the caps, so the M=1 case is exact.
  one = Problem.build(list(prob.compute_s), list(prob.edges), devices=1,
                      forward_s=list(prob.forward_s))
  assert pb.placement_bound(one, k, split) == pytest.approx(k * sum(prob.compute_s), rel=1e-8)


@pytest.mark.parametrize("seed,devices,k,split", [
  (0, 2, 1, False), (1, 2, 2, False), (2, 3, 1, False), (3, 3, 1, True), (4, 2, 1, True),
  (5, 3, 2, False),
])
def test_bound_is_below_brute_force_on_random_dags_with_unequal_caps(seed, devices, k, split):
  n = 3 if k == 2 else 4
  prob = _random_dag(seed, n, devices)
  total = sum(prob.static_bytes) + max(prob.activation_bytes) * k
  caps = tuple(total * s for s in (0.75, 0.6, 0.65)[:devices])
  want = _brute_force(prob, k, split, caps)
  got = pb.placement_bound(prob, k, split, caps)
  if want == float("inf"):
    return  # nothing fits: any bound holds (the case list below has feasible ones)
  assert got <= want * (1 + 1e-9)
  # ... and below the lock-step price of every generated schedule that fits.
  for assign in itertools.product(range(devices), repeat=n):
    for kind in ts.KINDS:
      if (kind == "zb") != split:
        continue
      sch = ts.generate(kind, n, prob.edges, assign, devices, k, forward_s=prob.forward_s)
      if price.fits(prob, assign, sch, caps):
        assert got <= price.lockstep_price(prob, assign, sch).step_s * (1 + 1e-9)


def test_the_random_cases_include_feasible_ones():
  feasible = 0
  for seed, devices, k, split in [(0, 2, 1, False), (2, 3, 1, False), (5, 3, 2, False)]:
    n = 3 if k == 2 else 4
    prob = _random_dag(seed, n, devices)
    total = sum(prob.static_bytes) + max(prob.activation_bytes) * k
    caps = tuple(total * s for s in (0.75, 0.6, 0.65)[:devices])
    feasible += _brute_force(prob, k, split, caps) < float("inf")
  assert feasible >= 2


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_the_set_cover_search_equals_enumerating_placements(devices):
  """min over placements of max_d f_d(S_d), by the bisection with exact cover counting, equals
  the same minimum over all M^n placements; with unequal caps, and inf when nothing fits."""
  prob = _random_dag(11, 6, devices)
  n = prob.num_nodes
  for caps in [None, tuple(sum(prob.static_bytes) * s for s in (0.5, 0.35, 0.3, 0.25)[:devices]),
               (1.0,) * devices]:
    for split in (False, True):
      f = pb.device_bounds(prob, 2, split, caps)
      want = min(
        max(f[d, sum(1 << i for i in range(n) if a[i] == d)] for d in range(devices))
        for a in itertools.product(range(devices), repeat=n))
      assert pb.placement_bound(prob, 2, split, caps) == want


def test_two_equal_stages_give_the_pipeline_makespan():
  """Two equal nodes in a chain, F = 1, B = 2, k micro-batches: no plan beats (k + 1) * 3 (1F1B
  on two devices reaches it), and the bound finds it: device 1 waits F for its first input and
  device 0 runs the last B after it."""
  prob = Problem.build([3.0, 3.0], [(0, 1)], devices=2, forward_s=[1.0, 1.0])
  for k in (1, 2, 4):
    got = pb.placement_bound(prob, k, split=False)
    assert got == pytest.approx((k + 1) * 3.0, rel=1e-8)
    sch = ts.generate("1f1b", 2, prob.edges, (0, 1), 2, k, forward_s=prob.forward_s)
    assert price.async_makespan(prob, (0, 1), sch) == pytest.approx(got, rel=1e-8)
    assert got > fbw_search.simple_bound(prob, k)


def test_too_many_nodes_are_not_enumerated():
  n = pb.PLACEMENT_BOUND_MAX_NODES + 1
  prob = Problem.build([1.0] * n, [(i, i + 1) for i in range(n - 1)], devices=2)
  assert pb.placement_bound(prob, 1, False) is None
  assert pb.bound(prob, 1) is None


def test_place_reports_the_placement_bound_and_it_holds():
  prob = _random_dag(7, 6, 2)
  opts = planner.PlannerOptions(devices=2, microbatches=2, memory_caps_bytes=None, **WORK)
  plan = planner.place_problem(prob, opts)
  assert plan.lockstep_bound_s >= pb.bound(prob, 2) * (1 - 1e-9)
  assert plan.lockstep_bound_s <= plan.lockstep_step_s * (1 + 1e-9)
