"""Validity of the k > 1 lower bounds (bounds.py) against brute-force optima on tiny graphs."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from planner_pipeline_test import EXACT
from planner_test import _brute_force

from jaxhybrid.planner.lower_bounds import bounds
from jaxhybrid.planner.solvers import milp, relax
from jaxhybrid.planner.core.options import PlannerOptions
from jaxhybrid.planner.place import place_problem
from jaxhybrid.planner.core.problem import Problem


def _chain_heavy_links(seed: int, n: int, devices: int) -> Problem:
  """A random DAG whose links often cost more than its nodes (where sharing a device pays)."""
  rng = random.Random(seed)
  edges = [(s, d) for d in range(n) for s in range(d) if d == s + 1 or rng.random() < 0.3]
  return Problem.build(
    [round(rng.uniform(0.2, 2.0), 3) for _ in range(n)], edges, devices=devices,
    transfer_s=[round(rng.uniform(0.0, 3.0), 3) for _ in edges],
  )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n, k, devices", [(3, 2, 2), (4, 2, 2), (3, 2, 3)])
def test_bounds_never_exceed_the_brute_force_optimum(seed, n, k, devices):
  prob = _chain_heavy_links(300 + seed, n, devices)
  best = _brute_force(prob, k)
  assert bounds.lower_bound(prob, k) <= best + 1e-9
  assert relax.solve(prob, k, **EXACT).bound <= best + 1e-9


def test_precedence_cuts_raise_the_relaxation_to_the_optimum():
  # Seed 316: four nodes, heavy links. The first/last idle cuts alone prove less than the
  # brute-force optimum; counting the work a device must do after (i, 0) or before (i, k - 1)
  # proves the optimum itself.
  prob = _chain_heavy_links(316, 4, 2)
  best = _brute_force(prob, 2)
  assert relax.solve(prob, 2, ordered=False, **EXACT).bound < best - 1e-3
  assert relax.solve(prob, 2, **EXACT).bound == pytest.approx(best, rel=1e-6)


def test_earliest_starts_see_links_or_serialisation():
  # A chain 0 -> 1 with a 5 s link: (1, 1) either waits for the link (1 + 1 + 5) or shares the
  # device with node 0, behind (0, 0), (0, 1) and (1, 0) (3 s); the compute-only bound says 2.
  prob = Problem.build([1, 1], [(0, 1)], devices=2, transfer_s=5.0)
  est = bounds._earliest(prob, 2, reverse=False)
  assert est[1] == [pytest.approx(1.0), pytest.approx(3.0)]
  # With a free link, node 1 may run on the other device as soon as (0, c) ends.
  free = Problem.build([1, 1], [(0, 1)], devices=2, transfer_s=0.0)
  assert bounds._earliest(free, 2, reverse=False)[1] == [pytest.approx(1.0), pytest.approx(2.0)]
  # Reversed: the least time from the end of (0, c) to the makespan, mirror image.
  assert bounds._earliest(prob, 2, reverse=True)[0] == [pytest.approx(3.0), pytest.approx(1.0)]


def _optimum_any_links(prob: Problem, k: int) -> float:
  """Brute-force optimum without assuming interchangeable devices: every placement, every task
  order, each order scheduled as early as possible."""
  n, p, T = prob.num_nodes, prob.compute_s, prob.transfer_s
  preds = prob.predecessors()
  tasks = [(i, c) for i in range(n) for c in range(k)]
  best = float("inf")
  for assign in itertools.product(range(prob.devices), repeat=n):
    for order in itertools.permutations(tasks):
      end, free = {}, [0.0] * prob.devices
      for i, c in order:
        if any((j, c) not in end for j, _ in preds[i]) or (c and (i, c - 1) not in end):
          break
        t = max([free[assign[i]]] + [end[(j, c)] + T[e][assign[j]][assign[i]] for j, e in preds[i]]
                + ([end[(i, c - 1)]] if c else []))
        end[(i, c)] = free[assign[i]] = t + p[i]
      else:
        best = min(best, max(end.values()))
  return best


def _uneven_links(seed: int, n: int, devices: int) -> Problem:
  """`_chain_heavy_links` with a different delay for each ordered pair of devices."""
  rng = random.Random(seed)
  prob = _chain_heavy_links(seed, n, devices)
  mats = tuple(
    tuple(tuple(0.0 if a == b else round(rng.uniform(0.0, 3.0), 3) for b in range(devices))
          for a in range(devices))
    for _ in prob.edges
  )
  return dataclasses.replace(prob, transfer_s=mats)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n, k, devices", [(3, 2, 2), (4, 2, 2), (3, 2, 3)])
def test_prefix_bound_never_exceeds_the_optimum_with_uneven_links(seed, n, k, devices):
  prob = _uneven_links(400 + seed, n, devices)
  best = _optimum_any_links(prob, k)
  for length in range(1, n + 1):  # prefixes of every length, the whole graph included
    assert bounds.prefix_bound(prob, k, 0.0, max_assignments=devices**length) <= best + 1e-9


def test_prefix_bound_proves_the_optimum_where_the_unfixed_bound_does_not():
  # Seed 300: with the devices of all four nodes enumerated, every link-or-share choice is known.
  prob = _chain_heavy_links(300, 4, 2)
  best = _brute_force(prob, 2)
  lower = bounds.lower_bound(prob, 2)
  assert lower < best - 1e-3
  assert bounds.prefix_bound(prob, 2, lower, max_assignments=16) == pytest.approx(best, abs=1e-9)
  # Too few assignments to enumerate even one node: the start bound comes back unchanged.
  assert bounds.prefix_length(prob, 1) == 0
  assert bounds.prefix_bound(prob, 2, lower, max_assignments=1) == lower


def test_prefix_bound_gives_up_without_time_and_options_are_checked():
  prob = _chain_heavy_links(300, 4, 2)
  lower = bounds.lower_bound(prob, 2)
  # Out of time before the first assignment: a partial enumeration proves nothing.
  assert bounds.prefix_bound(prob, 2, lower, max_assignments=16, time_limit_s=-1.0) == lower
  with pytest.raises(ValueError, match="prefix_assignments"):
    PlannerOptions(prefix_assignments=-1)
  with pytest.raises(ValueError, match="prefix_share"):
    PlannerOptions(prefix_share=1.5)


def test_place_uses_the_prefix_bound_for_pipelines(monkeypatch):
  # The prefix bound proves the heuristics' schedule optimal, so the MILP is never called.
  def no_milp(*args, **kwargs):
    raise AssertionError("the MILP should have been skipped")

  monkeypatch.setattr(milp, "solve", no_milp)
  prob = _chain_heavy_links(300, 4, 2)
  opts = PlannerOptions(objective="makespan", devices=2, microbatches=2, time_limit_s=300.0, prefix_assignments=16,
                        milp_max_nodes=20_000, search_evaluations=50, cpsat_deterministic_time=5.0)
  plan = place_problem(prob, opts)
  assert plan.lower_bound_s == pytest.approx(_brute_force(prob, 2), abs=1e-9)
  assert plan.fused_makespan_s == pytest.approx(plan.lower_bound_s, abs=1e-9)
  assert plan.status == "optimal"
