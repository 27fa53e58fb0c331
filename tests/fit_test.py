"""The program's memory held to the planner's cap: re-plans under lower caps (`program.fit`)."""

import dataclasses

import pytest

from jaxhybrid.planner.core.options import InfeasibleError
from jaxhybrid.program import fit

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class FakePlan:
  memory_caps_bytes: tuple[float, ...]
  device_peak_bytes: tuple[float, ...]
  name: str = "first"
  assignment: tuple[int, ...] = (0, 1)


def test_a_program_within_its_cap_is_kept_without_re_planning():
  plan = FakePlan((100 * MiB, 100 * MiB), (90 * MiB, 10 * MiB))
  replan = lambda caps: pytest.fail("re-planned a program that fits")  # noqa: E731
  got, prog, checks = fit.refit(plan, "prog", replan, measure=lambda p: 99 * MiB)
  assert (got, prog) == (plan, "prog")
  assert len(checks) == 1 and checks[0].fits and checks[0].program_bytes == 99 * MiB


def test_far_below_the_cap_nothing_is_measured_and_uncapped_plans_are_not_checked():
  measure = lambda p: pytest.fail("measured a program far below its cap")  # noqa: E731
  low = FakePlan((100 * MiB,) * 2, (10 * MiB, 20 * MiB))
  assert fit.refit(low, "prog", None, measure=measure) == (low, "prog", [])
  uncapped = FakePlan((), (10 * MiB, 20 * MiB))
  assert fit.refit(uncapped, "prog", None, measure=measure) == (uncapped, "prog", [])


def test_a_program_above_the_cap_is_re_planned_under_caps_lowered_by_its_excess():
  plan = FakePlan((100 * MiB, 100 * MiB), (95 * MiB, 60 * MiB))
  asked = []

  def replan(caps):
    asked.append(caps)
    return FakePlan(caps, (80 * MiB, 80 * MiB), name="second"), "prog2"

  sizes = {"prog": 120 * MiB, "prog2": 98 * MiB}
  got, prog, checks = fit.refit(plan, "prog", replan, measure=sizes.__getitem__)
  assert got.name == "second" and prog == "prog2"
  excess = 20 * MiB * fit.FIT_MARGIN
  assert asked == [(100 * MiB - excess,) * 2]
  assert [c.fits for c in checks] == [False, True]


def test_a_program_that_stays_above_the_cap_is_a_one_line_infeasible_error():
  plan = FakePlan((100 * MiB,) * 2, (95 * MiB, 60 * MiB))
  replan = lambda caps: (FakePlan(caps, (caps[0] * 0.9,) * 2), "prog")  # noqa: E731
  with pytest.raises(InfeasibleError, match=r"needs 110.00 MiB per device, over the cap of "
                     r"100.00 MiB, after 3 re-plan\(s\)") as e:
    fit.refit(plan, "prog", replan, measure=lambda p: 110 * MiB)
  assert "\n" not in str(e.value)
  # The planner finding nothing under the lowered caps says so, with both figures.
  def none_fits(caps):
    raise InfeasibleError("node 'x' needs 99 MiB")

  with pytest.raises(InfeasibleError, match=r"needs 110.00 MiB .* no plan fits .*node 'x'"):
    fit.refit(plan, "prog", none_fits, measure=lambda p: 110 * MiB)


def test_after_a_re_plan_the_caps_fall_by_the_excess_over_the_bytes_saved_per_byte_of_cap():
  plan = FakePlan((100 * MiB,) * 2, (95 * MiB, 60 * MiB))
  asked = []

  def replan(caps):
    asked.append(caps[0])
    return FakePlan(caps, (caps[0] * 0.9,) * 2), caps[0]

  # The program saves half a byte per byte of planner cap: 100 -> 120, 90 -> 115 MiB.
  size = lambda prog: int(120 * MiB - (100 * MiB - (prog if prog != "prog" else 100 * MiB)) / 2)  # noqa: E731
  _, _, checks = fit.refit(plan, "prog", replan, measure=size)
  first = 20 * MiB * fit.FIT_MARGIN
  assert asked[0] == pytest.approx(100 * MiB - first)
  second = checks[1].program_bytes - 100 * MiB
  assert asked[1] == pytest.approx(asked[0] - second / 0.5 * fit.FIT_MARGIN)
  assert checks[-1].fits and len(checks) == 3


def test_a_re_plan_without_caps_of_its_own_is_still_held_to_the_first_plans_cap():
  """The one-device fall-back is planned without caps: the cap asked for still applies."""
  plan = FakePlan((100 * MiB,) * 2, (95 * MiB, 60 * MiB))
  one = FakePlan((), (), name="one device", assignment=(0, 0))
  sizes = {"prog": 120 * MiB, "one": 150 * MiB}
  with pytest.raises(InfeasibleError, match=r"needs 150.00 MiB"):
    fit.refit(plan, "prog", lambda caps: (one, "one"), measure=sizes.__getitem__)
  assert fit.needs_check(one, (100 * MiB,) * 2) and not fit.needs_check(one)


def test_caps_lowered_too_far_for_any_plan_are_raised_half_way_back():
  plan = FakePlan((100 * MiB,) * 2, (95 * MiB, 60 * MiB))
  asked = []

  def replan(caps):
    asked.append(caps[0])
    if caps[0] < 85 * MiB:
      raise InfeasibleError("nothing fits")
    return FakePlan(caps, (caps[0] * 0.9,) * 2), "fits"

  sizes = {"prog": 120 * MiB, "fits": 99 * MiB}
  got, prog, checks = fit.refit(plan, "prog", replan, measure=sizes.__getitem__)
  first = 100 * MiB - 20 * MiB * fit.FIT_MARGIN
  assert asked == [pytest.approx(first), pytest.approx((first + 100 * MiB) / 2)]
  assert prog == "fits" and checks[-1].fits


def test_a_prediction_just_above_the_cap_is_settled_by_the_compiled_figure():
  plan = FakePlan((100 * MiB, 100 * MiB), (95 * MiB, 60 * MiB))
  no_replan = lambda caps: pytest.fail("re-planned a program that compiles within its cap")  # noqa: E731
  got, prog, checks = fit.refit(plan, "prog", no_replan, measure=lambda p: 105 * MiB,
                                compiled=lambda p: 97 * MiB)
  assert (got, prog) == (plan, "prog")
  assert checks[0].fits and checks[0].compiled and checks[0].program_bytes == 97 * MiB
  # Far above the cap (beyond the prediction's error band) nothing is compiled: re-planned.
  seen = []
  replan = lambda caps: (seen.append(caps) or FakePlan(caps, (50 * MiB, 50 * MiB), "second"),  # noqa: E731
                         "prog2")
  never = lambda p: pytest.fail("compiled a program far above its cap")  # noqa: E731
  sizes = {"prog": 130 * MiB, "prog2": 90 * MiB}
  got, prog, checks = fit.refit(plan, "prog", replan, measure=sizes.__getitem__, compiled=never)
  assert prog == "prog2" and len(seen) == 1 and not checks[0].compiled
  # Compiled and still above: the compiled figure is the excess re-planned for.
  seen.clear()
  sizes = {"prog": 105 * MiB, "prog2": 90 * MiB}
  got, prog, checks = fit.refit(plan, "prog", replan, measure=sizes.__getitem__,
                                compiled=lambda p: 104 * MiB)
  assert prog == "prog2" and checks[0].compiled and checks[0].program_bytes == 104 * MiB
  assert min(seen[0]) == pytest.approx(100 * MiB - 4 * MiB * fit.FIT_MARGIN)


@pytest.mark.parametrize("cap_bytes,fits", [(2**30, True), (2**10, False)])
def test_when_the_capped_search_finds_nothing_an_uncapped_plan_that_compiles_within_the_cap_is_used(
    monkeypatch, cap_bytes, fits):
  import optax
  import toy
  from conftest import LIGHT_DETERMINISTIC_PLANNER
  from flax import nnx

  from jaxhybrid import api
  from jaxhybrid import planner as planner_lib

  real = planner_lib.place

  def place(g, costs, **kw):  # a search that finds nothing under any cap
    if kw.get("memory_caps_bytes") is not None:
      raise InfeasibleError("no placement fits the memory caps (the test's search)")
    return real(g, costs, **kw)

  monkeypatch.setattr(planner_lib, "place", place)
  run = lambda: api.parallelize(
    toy.Towers(rngs=nnx.Rngs(0)), toy.mse_nnx, optax.sgd(0.1), toy.regression_batch(8),
    mesh="1x2", microbatches=1, hardware="cpu",
    planner_options={**LIGHT_DETERMINISTIC_PLANNER, "shard_rules": (),
                     "memory_caps_bytes": cap_bytes})
  if not fits:  # the uncapped plan's program does not fit either: the planner's own error
    with pytest.raises(InfeasibleError, match="the test's search"):
      run()
    return
  hy = run()
  assert hy.plan.memory_caps_bytes == (cap_bytes, cap_bytes)
  assert fit.compiled_bytes(hy.program) <= cap_bytes


def test_a_plan_made_under_the_hardwares_memory_is_tried_before_one_with_no_cap(monkeypatch,
                                                                               caplog):
  """The search finds nothing under the user's cap but does under the hardware's memory: that
  plan is kept when its program compiles within the user's cap, and no uncapped plan is made."""
  import optax
  import toy
  from conftest import LIGHT_DETERMINISTIC_PLANNER
  from flax import nnx

  from jaxhybrid import api
  from jaxhybrid import planner as planner_lib

  real, asked = planner_lib.place, []
  hardware = 16 * 2**30  # dgx1-v100

  def place(g, costs, **kw):
    cap = kw.get("memory_caps_bytes")
    asked.append(cap)
    if cap is not None and (cap[0] if isinstance(cap, tuple) else cap) < hardware:
      raise InfeasibleError("no placement fits the memory caps (the test's search)")
    return real(g, costs, **kw)

  monkeypatch.setattr(planner_lib, "place", place)
  hy = api.parallelize(
    toy.Towers(rngs=nnx.Rngs(0)), toy.mse_nnx, optax.sgd(0.1), toy.regression_batch(8),
    mesh="1x2", microbatches=1, hardware="dgx1-v100",
    planner_options={**LIGHT_DETERMINISTIC_PLANNER, "shard_rules": (),
                     "memory_caps_bytes": 2**30})
  assert asked[:2] == [2**30, hardware]
  assert "the plan made under the hardware's 16.00 GiB compiles to" in caplog.text
  assert hy.plan.memory_caps_bytes == (2**30, 2**30)
  assert fit.compiled_bytes(hy.program) <= 2**30


def test_the_dry_run_table_says_when_its_plan_was_made_without_the_cap():
  import types

  from jaxhybrid.train import dry_run

  GiB = 2**30
  report = types.SimpleNamespace(compiled=int(4.2 * GiB), predicted=int(4.4 * GiB))
  table = dry_run._plan_memory  # noqa: SLF001
  kept = types.SimpleNamespace(device_peak_bytes=(5.0 * GiB,) * 2,
                               memory_caps_bytes=(4.5 * GiB,) * 2)
  lines = table(kept, report)["lines"]
  assert "found no plan under the cap" in lines[0] and len(lines) == 4
  within = types.SimpleNamespace(device_peak_bytes=(4.0 * GiB,) * 2,
                                 memory_caps_bytes=(4.5 * GiB,) * 2)
  assert not any("found no plan" in x for x in table(within, report)["lines"])


def test_the_planner_is_given_the_programs_task_temporaries_when_memory_may_bind():
  """`planner_task_temp`: 'auto' gives the planner each node's compiled task temporaries only
  when the model's static bytes reach TASK_TEMP_FRACTION of the cap; 'program' always, 'none'
  never; the figures are the program's own (`node_calls.task_temp_bytes`)."""
  import toy
  from flax import nnx

  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid import planner
  from jaxhybrid.api import default_costs
  from jaxhybrid.planner.core.problem import Problem
  from jaxhybrid.program import node_calls

  model = toy.Chain(width=16, layers=3, rngs=nnx.Rngs(0))
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.mse_nnx)
  g = graph_lib.trace_function(pure, p, s, toy.regression_batch(8))
  costs, mesh = default_costs(), mesh_lib.make("1x1")
  need = g.total_param_bytes * (2.0 + 1.0)  # parameters, gradient, one optimizer state
  resolve = lambda opts: fit.planner_task_temp(opts, g, costs, 1.0, {}, (), mesh)  # noqa: E731
  assert resolve({"memory_caps_bytes": (need / fit.TASK_TEMP_FRACTION * 1.01,)})["task_temp"] \
    is None
  assert resolve(None)["task_temp"] is None  # the hardware's cap: far above a toy model
  assert resolve({"task_temp": "none"})["task_temp"] is None
  mine = lambda graph, node: (1, 2)  # noqa: E731
  assert resolve({"task_temp": mine})["task_temp"] is mine
  with pytest.raises(ValueError, match="task_temp='sometimes'"):
    resolve({"task_temp": "sometimes"})
  for opts in ({"memory_caps_bytes": (need / fit.TASK_TEMP_FRACTION * 0.99,)},
               {"task_temp": "program"}):
    temp = resolve(opts)["task_temp"]
    prob = Problem.from_graph(g, costs, planner.PlannerOptions(devices=2, task_temp=temp))
    calls = node_calls.NodeCalls(graph=g, canonical_convs=True, branch_remat="none",
                                 remat=frozenset())
    consts = dict(zip(g.jaxpr.constvars, g.closed_jaxpr.consts))
    assert prob.task_temp_bytes == tuple(
      node_calls.task_temp_bytes(calls, n.id, consts) for n in g.nodes)
    assert len(prob.task_temp_bytes) == len(g.nodes) > 1
    assert max(map(max, prob.task_temp_bytes)) > 0


def test_re_plans_share_what_is_left_of_the_time_limit_and_each_gets_at_least_its_floor():
  # A fake clock moved only by the (fake) re-plans, each using its whole time limit.
  now = [0.0]
  given = []

  def replan(caps, time_limit_s):
    given.append(time_limit_s)
    now[0] += time_limit_s
    return FakePlan(caps, (caps[0] * 0.9,) * 2), "prog"

  plan = FakePlan((100 * MiB,) * 2, (95 * MiB, 60 * MiB))
  # 12 s of a 30 s limit left after the first plan: three re-plans share them, 4 s each.
  with pytest.raises(InfeasibleError):
    fit.refit(plan, "prog", replan, measure=lambda p: 110 * MiB, deadline=(30.0, 12.0),
              clock=lambda: now[0])
  assert given == pytest.approx([4.0, 4.0, 4.0])
  assert now[0] == pytest.approx(12.0)
  # The first plan used the whole limit: each re-plan gets the floor share of it.
  now[0], given[:] = 30.0, []
  with pytest.raises(InfeasibleError):
    fit.refit(plan, "prog", replan, measure=lambda p: 110 * MiB, deadline=(30.0, 30.0),
              clock=lambda: now[0])
  assert given == pytest.approx([30.0 * fit.REFIT_MIN_SHARE] * fit.FIT_ATTEMPTS)
