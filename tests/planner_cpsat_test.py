"""Tests of the CP-SAT search of pipelined placements (planner/solvers/cpsat.py, cpsat_worker.py)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess

import pytest
from planner_bounds_test import _chain_heavy_links, _optimum_any_links, _uneven_links
from planner_test import _brute_force, _inception_like, _random_problem

from jaxhybrid import planner
from jaxhybrid.planner.solvers import cpsat
from jaxhybrid.planner.search import heuristics as heur
from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.core.problem import Problem

# One thread (two subsolvers interleaved: reproducible) stopped by CP-SAT's deterministic time,
# with a wall-clock limit far above what that takes.
DETERMINISTIC = dict(time_limit_s=300.0, threads=1, deterministic_time=5.0)


def _check(prob: Problem, cand: heur.Candidate, k: int, caps=None) -> None:
  tasks = sched.to_tasks(prob, cand.assignment, [list(r) for r in cand.starts])
  planner.validate_schedule(prob, cand.assignment, tasks, k, caps)
  assert cand.makespan == pytest.approx(sched.makespan(prob, [list(r) for r in cand.starts]))


@pytest.mark.parametrize("seed", range(3))
def test_cpsat_equals_brute_force_two_microbatches(seed):
  prob = _random_problem(200 + seed, n=3)
  warm = heur.single(prob, 2, None)
  got = cpsat.solve(prob, 2, warm=warm, **DETERMINISTIC)
  want = _brute_force(prob, 2)
  _check(prob, got.candidate, 2)
  assert got.status == "OPTIMAL"
  assert got.candidate.makespan == pytest.approx(want, rel=1e-6)
  # The bound holds for the real (unrounded) times, and is tight up to the rounding.
  assert got.bound <= want + 1e-12
  assert got.bound == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("links", ["uneven", "path"])
def test_cpsat_equals_brute_force_with_device_dependent_links(seed, links):
  # 'uneven': a different delay per ordered device pair (no symmetry, the first node may go
  # anywhere); 'path': devices 0-1-2 in a line, delay x |a - b| (the reversal is a symmetry, so
  # the first node is restricted to devices 0 and 1).
  if links == "uneven":
    prob = _uneven_links(500 + seed, 3, 3)
  else:
    base = _chain_heavy_links(500 + seed, 3, 3)
    prob = dataclasses.replace(base, transfer_s=tuple(
      tuple(tuple(max(row[1]) * abs(a - b) for b in range(3)) for a in range(3))
      for row in base.transfer_s))
    assert cpsat._device_orbits(cpsat._symmetries(prob), 3) == [0, 1]
  warm = heur.interleaved(prob, 2, None)
  got = cpsat.solve(prob, 2, warm=warm, **DETERMINISTIC)
  want = _optimum_any_links(prob, 2)
  _check(prob, got.candidate, 2)
  assert got.candidate.makespan == pytest.approx(want, rel=1e-6)
  assert got.bound <= want + 1e-12


def test_cpsat_improves_a_pipeline_and_respects_memory_caps():
  base = _inception_like(blocks=2, devices=2, seed=3)
  prob = dataclasses.replace(base, static_bytes=(10,) * base.num_nodes)
  caps = (90.0, 90.0)  # at most 9 of the 15 nodes per device
  warm = heur.interleaved(prob, 4, caps)
  got = cpsat.solve(prob, 4, warm=warm, caps=caps, **{**DETERMINISTIC, "deterministic_time": 0.3})
  _check(prob, got.candidate, 4, caps)
  assert got.status in ("OPTIMAL", "FEASIBLE")
  assert got.candidate.makespan < warm.makespan
  assert got.bound <= got.candidate.makespan + 1e-12
  assert max(sched.device_memory(prob, got.candidate.assignment, 4)) <= 90.0


def test_symmetric_relabelling_keeps_the_schedule():
  # Four devices linked as a path 0-1-2-3 (cheap neighbours): the only symmetries are the
  # identity and the reversal, so the first node may sit on 0 or 1.
  base = _inception_like(blocks=1, devices=4, seed=5)
  far = [[[0.0 if a == b else 0.1 * abs(a - b) for b in range(4)] for a in range(4)]
         for _ in base.edges]
  prob = dataclasses.replace(base, transfer_s=tuple(tuple(map(tuple, t)) for t in far))
  group = cpsat._symmetries(prob)
  assert sorted(group) == [(0, 1, 2, 3), (3, 2, 1, 0)]
  reps = cpsat._device_orbits(group, 4)
  assert reps == [0, 1]
  warm = heur.evaluate(prob, [3] + [2] * (prob.num_nodes - 1), 2)
  moved = cpsat._relabel(warm, group, reps)
  assert moved.assignment == (0,) + (1,) * (prob.num_nodes - 1)
  assert heur.evaluate(prob, moved.assignment, 2).makespan == pytest.approx(warm.makespan)


def test_a_failing_child_process_keeps_the_warm_start(monkeypatch, caplog):
  prob = _inception_like(blocks=1, devices=2)
  warm = heur.interleaved(prob, 2, None)

  def broken(*args, **kwargs):
    raise subprocess.CalledProcessError(1, args[0], output="", stderr="Traceback\nImportError: x")

  monkeypatch.setattr(cpsat.subprocess, "run", broken)
  with caplog.at_level(logging.WARNING):
    got = cpsat.solve(prob, 2, warm=warm, lower_bound=0.5, time_limit_s=1.0)
  assert got.candidate == warm and got.bound == 0.5 and got.status == "ERROR"
  assert "ImportError: x" in caplog.text


def test_place_runs_the_cpsat_search_before_the_milp():
  prob = _inception_like(blocks=3, devices=2, seed=1)
  opts = dict(objective="makespan", devices=2, microbatches=4, time_limit_s=300.0, threads=1, gap=0.0,
              cpsat_deterministic_time=0.3, milp_max_nodes=50, search_evaluations=20)
  plan = planner.place_problem(prob, planner.PlannerOptions(**opts))
  assert "cpsat" in plan.heuristics
  assert plan.fused_makespan_s <= plan.heuristics["cpsat"] + 1e-12
  if plan.found_by == "milp":
    assert plan.fused_makespan_s < min(plan.heuristics.values())
  else:
    assert plan.heuristics[plan.found_by] == plan.fused_makespan_s
  assert plan.lower_bound_s <= plan.fused_makespan_s + 1e-12
  planner.validate_schedule(prob, plan.assignment, plan.schedule, 4)
  off = planner.place_problem(prob, planner.PlannerOptions(**opts, cpsat_share=0.0))
  assert "cpsat" not in off.heuristics
