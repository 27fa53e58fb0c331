"""Validity of the k > 1 lower bounds (bounds.py) against brute-force optima on tiny graphs."""

from __future__ import annotations

import random

import pytest

from jaxhybrid.planner import bounds
from jaxhybrid.planner import relax
from jaxhybrid.planner.problem import Problem
from planner_test import _brute_force


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
  assert relax.solve(prob, k).bound <= best + 1e-9


def test_precedence_cuts_raise_the_relaxation_to_the_optimum():
  # Seed 316: four nodes, heavy links. The first/last idle cuts alone prove 8.305; counting the
  # work a device must do after (i, 0) or before (i, k - 1) proves the brute-force optimum.
  prob = _chain_heavy_links(316, 4, 2)
  best = _brute_force(prob, 2)
  assert relax.solve(prob, 2, ordered=False).bound == pytest.approx(8.305, abs=1e-3)
  assert relax.solve(prob, 2).bound == pytest.approx(best, rel=1e-6)
  assert best == pytest.approx(8.706, abs=1e-3)


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
