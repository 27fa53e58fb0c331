"""The per-group cost: its fit, its measurement on a simulated mesh, and the planner's and the
program's prices adding it. No assertion on a measured time."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from conftest import LIGHT_DETERMINISTIC_PLANNER

from jaxhybrid import costs as costs_lib
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import generate
from jaxhybrid.planner.pricing import price
from jaxhybrid.program import group_cost, lockstep


def test_fit_recovers_a_line_and_never_makes_groups_faster():
  pts = [(g, g - 1, 0.002 + 0.0009 * g + p, p) for g, p in ((6, 0.01), (15, 0.03), (40, 0.02))]
  slope, intercept = group_cost.fit(pts)
  assert slope == pytest.approx(0.0009) and intercept == pytest.approx(0.002)
  falling = [(g, 0, 1.0 - 0.01 * g, 0.0) for g in (2, 5, 9)]
  assert group_cost.fit(falling)[0] == 0.0
  with pytest.raises(ValueError, match="two distinct group counts"):
    group_cost.fit([(4, 3, 1.0, 0.5), (4, 3, 1.1, 0.5)])


def test_measure_times_one_program_per_placement_and_prices_each():
  from jaxhybrid import mesh as mesh_lib

  link = costs_lib.Link(alpha_s=1e-4, bandwidth_bytes_s=1e9)
  got = group_cost.measure(mesh_lib.make("1x2"), link, blocks=(2, 0), steps=1, warmup=1)
  (g2, m2, t2, p2), (gn, mn, tn, pn) = got.points
  # Alternating every node makes more groups and messages than two stages; each priced as its
  # messages at the link (tasks cost 0 in ZeroTaskCosts).
  assert 1 < g2 < gn and 0 < m2 < mn
  assert p2 == pytest.approx(m2 * 1e-4, rel=0.5) and pn > p2
  assert t2 > 0 and tn > 0 and got.group_s >= 0
  assert got.to_json()["points"][1] == [gn, mn, tn, pn]
  with pytest.raises(ValueError, match="1x2"):
    group_cost.measure(mesh_lib.make("2x1"), link)


def _chain(devices: int, group_s: float) -> Problem:
  prob = Problem.build([1.0, 2.0, 1.5, 1.0], [(0, 1), (1, 2), (2, 3)], devices=devices,
                       transfer_s=0.1)
  return dataclasses.replace(prob, group_s=group_s)


def test_the_lockstep_price_adds_each_group_on_several_devices_only():
  assign, k = (0, 0, 1, 1), 3
  sch = generate("1f1b", 4, [(0, 1), (1, 2), (2, 3)], assign, 2, k)
  base = price.lockstep_price(_chain(2, 0.0), assign, sch)
  with_groups = price.lockstep_price(_chain(2, 0.25), assign, sch)
  assert with_groups.groups == base.groups > 1
  assert with_groups.step_s == pytest.approx(base.step_s + 0.25 * base.groups)
  one = generate("1f1b", 4, [(0, 1), (1, 2), (2, 3)], (0,) * 4, 1, k)
  assert (price.lockstep_price(_chain(1, 0.25), (0,) * 4, one).step_s
          == price.lockstep_price(_chain(1, 0.0), (0,) * 4, one).step_s)


def test_a_costly_group_makes_the_planner_prefer_fewer_groups():
  from jaxhybrid import planner

  def best(group_s):
    prob = _chain(2, group_s)
    plan = planner.place_problem(prob, planner.PlannerOptions(
      devices=2, microbatches=2, **LIGHT_DETERMINISTIC_PLANNER))
    return plan, prob

  cheap, _ = best(0.0)
  costly, prob = best(5.0)
  # Priced with the costly groups, the plan is no dearer than any placement's 1F1B.
  assert costly.lockstep_step_s <= min(
    price.lockstep_price(prob, a, generate("1f1b", 4, prob.edges, a, 2, 2)).step_s
    for a in itertools.product(range(2), repeat=4)) * (1 + 1e-9)
  # (Here 6 groups against 8: the search's lock-step orders merge groups.)
  assert len(price.groups_of(prob, costly.assignment, costly.task_schedule)) < len(
    price.groups_of(prob, cheap.assignment, cheap.task_schedule))


def test_the_program_price_adds_each_group_on_several_devices_only():
  import lockstep_test

  g = lockstep_test._towers(2)
  link = costs_lib.Link(alpha_s=1e-4, bandwidth_bytes_s=1e9)
  cm = lockstep_test.FixedCosts(0.01, link)
  two = [0 if n.name.startswith("a") else 1 for n in g.nodes]
  for assign in (two, [0] * len(g.nodes)):
    st = lockstep_test._structure(g, assign, 2)
    zero = lockstep.PassCosts(update_s_per_byte=0.0, add_s_per_byte=0.0)
    base = lockstep.program_step_s(g, st, assign, cm, zero)
    t = lockstep.program_step_s(g, st, assign, cm, dataclasses.replace(zero, group_s=0.003))
    want = 0.003 * len(st.groups) if st.devices > 1 else 0.0
    assert math.isclose(t.group_sync_s, want) and math.isclose(t.step_s, base.step_s + want)
