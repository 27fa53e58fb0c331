"""F/B/W tasks in the planner: the pure lock-step pricer against the program's, memory over time,
default caps, the plan's predicted step, and the F/B/W MILP against brute force.

Every solver here stops by a work limit (CBC nodes, annealing evaluations), never by the clock.
"""

from __future__ import annotations

import dataclasses

import functools
import itertools
import math

import pytest
import toy
from flax import nnx

from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid import planner
from jaxhybrid.api import microbatch_spec
from jaxhybrid.planner.pricing import lockstep_rule, price
from jaxhybrid.planner.search import fbw_search
from jaxhybrid.planner.solvers import fbw_milp
from jaxhybrid.planner.core import task_schedule as ts
from jaxhybrid.planner.core.problem import FORWARD_SHARE, Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule
from jaxhybrid.program import executor, lockstep

# Work limits only (the time limits are safety nets far above the work).
WORK = dict(time_limit_s=300.0, threads=1, gap=0.0, cpsat_deterministic_time=0.5,
            milp_max_nodes=500, search_evaluations=20, lockstep_evaluations=30)


class SumOnlyCosts(costs_lib.CostModel):
  """Node times without a forward/backward split (the FORWARD_SHARE path), a slowish link."""

  source = "test"
  hardware_name = "test"

  def __init__(self):
    self.link = costs_lib.Link(alpha_s=2e-5, bandwidth_bytes_s=2e8)

  def node_time_s(self, node):
    return 1e-4 * (1 + node.id % 3)


@functools.cache
def _chain_graph(k: int):
  model = toy.Chain(width=16, layers=4, rngs=nnx.Rngs(0))
  spec, _ = microbatch_spec(toy.regression_batch(8), 8, 8 // k)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.mse_nnx)
  return graph_lib.trace_function(pure, p, s, spec)


def test_gradient_rows_and_weight_copies_follow_the_programs_layout():
  """A leaf with a row of its own (`slot_min_bytes`) is read in place, and with one micro-batch
  its gradient is one window with no accumulator row; a leaf in the packed row is copied out by
  the tasks that read it. Under ZeRO, or with more micro-batches, every leaf has a row."""
  cm = SumOnlyCosts()
  base = {"devices": 2, "optimizer_state_factor": 2.0, "gradient_factor": 1.0}
  def problem(k, **kw):
    opts = planner.PlannerOptions(microbatches=k, **base, **kw)
    return Problem.from_graph(_chain_graph(k), cm, opts)

  assert min(params := [n.param_bytes for n in _chain_graph(1).nodes]) > 0
  packed = problem(1, slot_min_bytes=None)
  assert packed.static_bytes == tuple(4 * b for b in params)  # + state x 2 + gradient
  assert packed.transient_bytes == max(params)
  slots = problem(1, slot_min_bytes=0)
  assert slots.static_bytes == tuple(3 * b for b in params)  # no gradient row
  assert slots.transient_bytes == 0
  assert problem(1, slot_min_bytes=0, single_window_gradients=False).static_bytes == \
    packed.static_bytes
  assert problem(2, slot_min_bytes=0).static_bytes == packed.static_bytes
  with pytest.raises(ValueError, match="slot_min_bytes"):
    planner.PlannerOptions(slot_min_bytes=-1)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("devices", [2, 4])
def test_pricer_equals_the_programs_lockstep_price(k, devices):
  g = _chain_graph(k)
  n = len(g.nodes)
  for cm in (costs_lib.AnalyticCostModel("dgx1-v100"), SumOnlyCosts()):
    prob = Problem.from_graph(g, cm, planner.PlannerOptions(devices=devices, microbatches=k))
    stages = tuple(toy.chain_stage(node, devices) for node in g.nodes)
    for assign in (stages, tuple(i % devices for i in range(n))):
      for kind in ts.KINDS:
        sch = ts.generate(kind, n, prob.edges, assign, devices, k, forward_s=prob.forward_s)
        _, st, _ = executor.structure_for(g, assign, devices, k, sch)
        want = lockstep.program_step_s(g, st, assign, cm)
        got = price.lockstep_price(prob, assign, sch)
        assert (got.groups, got.transfers) == (want.groups, want.transfers)
        assert got.step_s == pytest.approx(want.step_s, rel=1e-6)
        assert got.compute_s == pytest.approx(want.compute_s, rel=1e-6)


def test_forward_share_is_one_constant():
  assert lockstep.FORWARD_SHARE is FORWARD_SHARE
  prob = Problem.build([3.0, 6.0], [(0, 1)], devices=2)
  assert prob.forward_s == pytest.approx((1.0, 2.0))
  assert prob.task_s("B", 1, False) == pytest.approx(4.0)
  assert prob.task_s("B", 1, True) == prob.task_s("W", 1, True) == pytest.approx(2.0)


def test_memory_over_time_by_hand_on_a_chain():
  # Two nodes on one device, static 100 + 10, residuals 5 and 7 per micro-batch, k = 2.
  prob = Problem.build([1, 1], [(0, 1)], devices=1, memory_bytes=[100, 10],
                       activation_bytes=[5, 7])
  F, B, W = (lambda i, c, t=t: Op(t, i, c) for t in "FBW")
  gpipe = TaskSchedule(kind="gpipe", split=False, microbatches=2, devices=((
    F(0, 0), F(1, 0), F(0, 1), F(1, 1), B(1, 0), B(0, 0), B(1, 1), B(0, 1)),))
  # After the four forwards all residuals are alive: 2 * (5 + 7) = 24.
  assert price.memory_profile(prob.activation_bytes, gpipe.devices[0], False) == [
    5, 12, 17, 24, 24, 17, 12, 5]
  assert price.peak_memory_bytes(prob, (0, 0), gpipe) == [110 + 24]
  one = TaskSchedule(kind="1f1b", split=False, microbatches=2, devices=((
    F(0, 0), F(1, 0), B(1, 0), B(0, 0), F(0, 1), F(1, 1), B(1, 1), B(0, 1)),))
  assert price.peak_memory_bytes(prob, (0, 0), one) == [110 + 12]
  # Split: the residuals live until W.
  zb = TaskSchedule(kind="zb", split=True, microbatches=1, devices=((
    F(0, 0), F(1, 0), B(1, 0), B(0, 0), W(0, 0), W(1, 0)),))
  assert price.memory_profile(prob.activation_bytes, zb.devices[0], True) == [
    5, 12, 12, 12, 12, 7]
  # The generated schedules agree with their task order.
  for kind in ts.KINDS:
    sch = ts.generate(kind, 2, prob.edges, (0, 0), 1, 2)
    prof = price.memory_profile(prob.activation_bytes, sch.devices[0], sch.split)
    assert max(prof) == (24 if kind == "gpipe" else max(prof))


def test_caps_default_to_the_device_memory_and_can_be_switched_off():
  g = _chain_graph(1)
  cm = costs_lib.AnalyticCostModel("dgx1-v100")
  opts = planner.PlannerOptions(devices=2)
  prob = Problem.from_graph(g, cm, opts)
  gib16 = costs_lib.hardware.get("dgx1-v100").memory_bytes
  assert prob.device_memory_bytes == gib16 == 16 * 2**30
  assert opts.caps(prob.device_memory_bytes) == (gib16, gib16)
  assert planner.PlannerOptions(devices=2, memory_caps_bytes=0).caps(gib16) is None
  assert planner.PlannerOptions(devices=2, memory_caps_bytes=None).caps(gib16) is None
  assert planner.PlannerOptions(devices=2, memory_caps_bytes=(5, 6)).caps(gib16) == (5, 6)
  assert opts.caps() is None  # unknown device memory: no cap
  plan = planner.place(g, cm, devices=2, **WORK)
  assert plan.memory_caps_bytes == (gib16, gib16)
  assert max(plan.device_peak_bytes) <= gib16


def test_group_buffers_of_a_hand_made_two_device_schedule():
  # Node 0 on device 0, node 1 on device 1, one micro-batch: groups [F0], [F1 B1], [B0] (F1
  # reads what another device made in the first group, B0 the cotangent B1 made). Residuals 5
  # and 3, the edge's value 40 bytes (activation forward, cotangent back).
  prob = Problem.build([3, 2], [(0, 1)], devices=2, memory_bytes=[10, 20],
                       activation_bytes=[5, 3], edge_bytes=[40])
  F, B = (lambda i, t=t: Op(t, i, 0) for t in "FB")
  sch = TaskSchedule(kind="custom", split=False, microbatches=1, devices=((F(0), B(0)),
                                                                         (F(1), B(1))))
  assert [[op for _, op in g] for g in price.groups_of(prob, (0, 1), sch)] == [
    [F(0)], [F(1), B(1)], [B(0)]]
  # After group 0 each device holds group 0's buffers as long as the longest device's part:
  # device 0 keeps F0's residual (5) until B0, device 1 received the activation (40) for F1
  # and B1; in group 1, both of them, the cotangent for B0 (40) and F1's residual made and
  # freed inside the branch (3); in group 2 the residual and the cotangent.
  assert price.group_peak_bytes(prob, (0, 1), sch) == [40, 40 + 40 + 3, 5 + 40]
  assert price.peak_memory_bytes(prob, (0, 1), sch) == [20 + 83, 20 + 83]
  # One device's residuals alone (the solvers' relaxation) would say 20 + 5.
  assert max(max(price.memory_profile(prob.activation_bytes, o, False)) for o in sch.devices) == 5
  # Gradient windows: the parameter bytes a group's gradient tasks return, per group.
  with_params = dataclasses.replace(prob, param_bytes=(7, 11))
  assert price.group_peak_bytes(with_params, (0, 1), sch) == [40, 83 + 11, 45 + 7]
  # A table read by row lookups returns row gradients, not a window (`window_bytes`).
  looked_up = dataclasses.replace(with_params, window_bytes=(0, 11))
  assert price.group_peak_bytes(looked_up, (0, 1), sch) == [40, 83 + 11, 45]


def test_a_leaf_several_nodes_read_is_held_once_per_device():
  # Three nodes, M = 3; a leaf of 6 static bytes read by nodes 0 and 2 (left out of their own).
  prob = dataclasses.replace(
    Problem.build([1, 1, 1], [(0, 1), (1, 2)], devices=3, memory_bytes=[1, 2, 4]),
    shared_static=((6, (0, 2)),))
  # Its readers on one device: held there once.
  assert price.device_static_bytes(prob, (0, 1, 0)) == [1 + 4 + 6, 2, 0]
  # On two devices: replicated on every device, the one with no reader too.
  assert price.device_static_bytes(prob, (0, 0, 1)) == [1 + 2 + 6, 4 + 6, 6]
  # A sub-problem keeps the readers it holds, renumbered.
  assert prob.subproblem([1, 2]).shared_static == ((6, (1,)),)
  with pytest.raises(ValueError, match="shared_static"):
    dataclasses.replace(prob, shared_static=((6, (0, 3)),))


@pytest.mark.parametrize("k", [1, 2])
def test_the_plans_predicted_step_is_the_price_of_its_schedule(k):
  g = _chain_graph(k)
  cm = SumOnlyCosts()
  opts = planner.PlannerOptions(devices=2, microbatches=k, **WORK)
  plan = planner.place(g, cm, options=opts, devices=2)
  prob = Problem.from_graph(g, cm, opts)
  assert isinstance(plan.task_schedule, TaskSchedule)
  ts.validate(plan.task_schedule, prob.num_nodes, prob.edges, plan.assignment)
  got = price.lockstep_price(prob, plan.assignment, plan.task_schedule).step_s
  assert plan.lockstep_step_s == pytest.approx(got, rel=1e-12)
  # ... and what the program's own lock-step model prices for the program the plan builds.
  assert lockstep.plan_step_s(g, plan, cm).step_s == pytest.approx(got, rel=1e-6)
  # The peak includes what a device holds while a task runs (the weights it copies out of the
  # packed row: this chain's leaves are all smaller than a slot row) and the batch.
  assert prob.transient_bytes == max(n.param_bytes for n in g.nodes) > 0
  assert prob.batch_bytes > 0 and prob.held_bytes == prob.transient_bytes + prob.batch_bytes
  assert plan.device_peak_bytes == pytest.approx(
    [b + prob.held_bytes
     for b in price.peak_memory_bytes(prob, plan.assignment, plan.task_schedule)])
  # Never worse than GPipe / 1F1B / ZB-H1 on the best contiguous split; the bound holds.
  assert set(plan.lockstep_baselines) == set(ts.KINDS)
  assert plan.lockstep_step_s <= min(plan.lockstep_baselines.values()) + 1e-15
  assert 0 < plan.lockstep_bound_s <= plan.lockstep_step_s
  assert plan.lockstep_speedup == pytest.approx(plan.single_device_s / plan.lockstep_step_s)
  again = planner.Plan.from_json(plan.to_json())
  assert again == plan
  # A plan written before the lock-step fields (schema 2 without them) still loads.
  old = plan.to_dict()
  assert old["schema_version"] == planner.SCHEMA_VERSION
  for key in ("lockstep_step_s", "lockstep_speedup", "lockstep_bound_s", "device_peak_bytes",
              "memory_caps_bytes", "lockstep_baselines", "lockstep_found_by"):
    old.pop(key)
  loaded = planner.Plan.from_dict(old)
  assert loaded.lockstep_step_s == 0.0 and loaded.assignment == plan.assignment


# ---- the F/B/W MILP against brute force ----------------------------------------------------


def _linear_extensions(tasks, before):
  """Every order of `tasks` that respects `before` (task -> tasks that must precede it)."""
  pre = {t: [u for u in before[t] if u in set(tasks)] for t in tasks}
  out, seq, done = [], [], set()

  def rec():
    if len(seq) == len(tasks):
      out.append(tuple(seq))
      return
    for t in tasks:
      if t not in done and all(u in done for u in pre[t]):
        done.add(t)
        seq.append(t)
        rec()
        seq.pop()
        done.discard(t)

  rec()
  return out


def _brute_force(prob, k, split, caps):
  """Optimum over placements x per-device task orders of the asynchronous makespan, within caps;
  and every (placement, schedule) pair within the caps (for the bound check)."""
  tasks = fbw_milp.tasks_of(prob, k, split)
  before = fbw_milp._closure(tasks, {t: price.fbw_dependencies(prob, t) for t in tasks})
  best = math.inf
  for assign in itertools.product(range(prob.devices), repeat=prob.num_nodes):
    # Every device allocates the longest device's rows (row padding).
    row = max(sum(b for b, a in zip(prob.static_bytes, assign) if a == d)
              for d in range(prob.devices))
    per_device = []
    for d in range(prob.devices):
      mine = [t for t in tasks if assign[t.node] == d]
      per_device.append([
        o for o in _linear_extensions(mine, before)
        if row + max(price.memory_profile(prob.activation_bytes, o, split), default=0)
        <= min(caps)
      ])
    for combo in itertools.product(*per_device):
      sch = TaskSchedule(kind="custom", split=split, microbatches=k, devices=combo)
      best = min(best, price.async_makespan(prob, assign, sch))
  return best


def _tiny(diamond: bool) -> Problem:
  if diamond:  # 0 -> {1, 2} -> 3 with unequal times and transfers
    return Problem.build([1.5, 3.0, 2.4, 1.2], [(0, 1), (0, 2), (1, 3), (2, 3)], devices=2,
                         transfer_s=[0.3, 0.2, 0.4, 0.1], memory_bytes=[4, 9, 8, 3],
                         activation_bytes=[2, 3, 3, 1])
  return Problem.build([3.0, 2.0, 4.0], [(0, 1), (1, 2)], devices=2, transfer_s=0.5,
                       memory_bytes=[10, 10, 10], activation_bytes=[5, 3, 4])


# (problem, k, split, caps): the caps are unequal and exclude placements (and, with k = 2,
# orders that keep too many residuals alive). Every device allocates the longest device's rows
# and the lock-step groups' buffers as long as the largest device's, so the smaller cap binds
# both (the chain's best split holds 20 bytes of rows on both devices, and 32 bytes with its
# groups' buffers at k = 1).
CASES = [
  ("chain", 1, False, (34, 32)),
  ("chain", 1, True, (34, 32)),
  ("chain", 2, False, (40, 37)),
  ("chain", 2, False, (1000, 1000)),
  ("diamond", 1, False, (20, 18)),
  ("diamond", 1, True, (20, 18)),
]


def test_fbw_milp_reports_caps_that_nothing_fits_as_infeasible():
  prob = _tiny(True)
  assert _brute_force(prob, 1, False, (20, 14)) == math.inf
  res = fbw_milp.solve(prob, 1, split=False, caps=(20, 14), max_nodes=20_000, time_limit_s=300)
  assert res.status == "infeasible" and res.schedule is None


@pytest.mark.parametrize("name,k,split,caps", CASES)
def test_fbw_milp_equals_brute_force_and_bounds_every_lockstep_schedule(name, k, split, caps):
  prob = _tiny(name == "diamond")
  want = _brute_force(prob, k, split, caps)
  res = fbw_milp.solve(prob, k, split=split, caps=caps, max_nodes=20_000, time_limit_s=300)
  assert res.status == "optimal"
  assert res.makespan == pytest.approx(want, rel=1e-7)
  assert res.bound <= want * (1 + 1e-7)
  assert fbw_search.simple_bound(prob, k) <= want * (1 + 1e-9)
  # The MILP's own order is a valid schedule within the caps with that makespan.
  ts.validate(res.schedule, prob.num_nodes, prob.edges, res.assignment)
  # ... within the caps as the MILP models memory (rows + one device's residuals), which is a
  # relaxation of the planner's rule (that adds the lock-step groups' buffers).
  relaxed = max(price.device_static_bytes(prob, res.assignment)) + max(
    max(price.memory_profile(prob.activation_bytes, o, split), default=0)
    for o in res.schedule.devices)
  assert relaxed <= min(caps)
  assert max(price.peak_memory_bytes(prob, res.assignment, res.schedule)) >= relaxed
  assert price.async_makespan(prob, res.assignment, res.schedule) == pytest.approx(want)
  # The bound is below the lock-step price of every schedule that fits.
  priced = 0
  for assign in itertools.product(range(prob.devices), repeat=prob.num_nodes):
    for kind in ts.KINDS:
      if (kind == "zb") != split:
        continue
      sch = ts.generate(kind, prob.num_nodes, prob.edges, assign, prob.devices, k)
      if price.fits(prob, assign, sch, caps):
        priced += 1
        step = price.lockstep_price(prob, assign, sch).step_s
        assert res.bound <= step * (1 + 1e-9)
        assert price.async_makespan(prob, assign, sch) <= step * (1 + 1e-9)
  assert priced > 0
  assert res.bound <= price.lockstep_price(prob, res.assignment, res.schedule).step_s + 1e-9


def test_place_uses_the_fbw_milp_bound_and_is_never_worse_than_the_baselines():
  prob = _tiny(True)
  opts = planner.PlannerOptions(devices=2, microbatches=1, memory_caps_bytes=(20, 19), **WORK)
  plan = planner.place_problem(prob, opts)
  got = price.lockstep_price(prob, plan.assignment, plan.task_schedule).step_s
  assert plan.lockstep_step_s == pytest.approx(got)
  assert plan.lockstep_step_s <= min(plan.lockstep_baselines.values()) + 1e-12
  assert plan.lockstep_bound_s <= plan.lockstep_step_s + 1e-9
  assert plan.lockstep_bound_s >= fbw_search.simple_bound(prob, 1)
  assert all(m <= c for m, c in zip(plan.device_peak_bytes, (20, 18)))


def test_infeasible_caps_say_how_many_bytes_are_missing_in_one_line():
  prob = _tiny(False)
  opts = planner.PlannerOptions(devices=2, microbatches=2, memory_caps_bytes=(12, 12), **WORK)
  with pytest.raises(planner.InfeasibleError) as err:
    planner.place_problem(prob, opts)
  msg = str(err.value)
  assert "\n" not in msg and "short" in msg and "memory_caps_bytes" in msg


def test_reprice_gives_the_lockstep_fields_of_another_schedule():
  prob = _tiny(False)
  opts = planner.PlannerOptions(devices=2, microbatches=2, memory_caps_bytes=None, **WORK)
  plan = planner.place_problem(prob, opts)
  gpipe = ts.generate("gpipe", prob.num_nodes, prob.edges, plan.assignment, 2, 2)
  again = planner.reprice(plan, prob, gpipe)
  assert again.task_schedule == gpipe
  assert again.lockstep_step_s == pytest.approx(
    price.lockstep_price(prob, plan.assignment, gpipe).step_s)
  assert again.device_peak_bytes == tuple(price.peak_memory_bytes(prob, plan.assignment, gpipe))
  assert again.lockstep_bound_s == plan.lockstep_bound_s <= again.lockstep_step_s + 1e-12


@pytest.mark.parametrize("split", [False, True])
def test_gradient_tasks_share_a_group_up_to_the_byte_cap(split):
  """A device's gradient tasks (B unsplit, W split) join one lock-step group while their nodes'
  parameter bytes stay within the cap; past it, or with unknown bytes, a new group starts."""
  edges = [(i, i + 1) for i in range(5)]
  assignment = [0, 0, 0, 1, 1, 1]
  kind = "zb" if split else "1f1b"
  sched = ts.generate(kind, 6, edges, assignment, 2, 4, forward_s=[1.0] * 6)
  reads = {}

  def grad_nodes_per_group(groups):
    out = []
    for g in groups:
      per: dict[int, set[int]] = {}
      for d, op in g:
        if op.kind == "W" or (op.kind == "B" and not split):
          per.setdefault(d, set()).add(op.node)
      out.append(per)
    return out

  small = [10] * 6
  _, merged = lockstep_rule.lockstep_groups(sched, edges, assignment, reads, grad_bytes=small,
                                 group_grad_bytes=30)
  _, alone = lockstep_rule.lockstep_groups(sched, edges, assignment, reads, grad_bytes=None)
  _, capped = lockstep_rule.lockstep_groups(sched, edges, assignment, reads, grad_bytes=small,
                                 group_grad_bytes=15)
  for groups, most in ((merged, 3), (alone, 1), (capped, 1)):
    per = grad_nodes_per_group(groups)
    assert all(len(nodes) <= most for p in per for nodes in p.values())
    # Every task is in exactly one group, in its device's order.
    for d in range(2):
      assert [op for g in groups for dd, op in g if dd == d] == list(sched.devices[d])
  assert max(len(n) for p in grad_nodes_per_group(merged) for n in p.values()) == 3
  assert len(merged) < len(alone)
  # A node larger than the cap still runs (alone in its group's gradient part).
  _, big = lockstep_rule.lockstep_groups(sched, edges, assignment, reads, grad_bytes=[100] * 6,
                              group_grad_bytes=15)
  assert all(len(n) == 1 for p in grad_nodes_per_group(big) for n in p.values())


def test_lockstep_annealing_stops_by_patience_and_repeats_itself(monkeypatch):
  """With a patience the lock-step annealing ends by counting moves, not by the clock: under a
  time limit far above the work, it stops, and two runs return the same plan."""
  from planner_test import _random_problem

  prob = _random_problem(4, n=12)  # 2^12 placements: annealed, not enumerated
  assert prob.devices ** prob.num_nodes > fbw_search.EXHAUSTIVE_PLACEMENTS
  priced = []
  real = fbw_search.best_schedule

  def counting(*args, **kwargs):
    priced.append(tuple(args[1]))
    return real(*args, **kwargs)

  monkeypatch.setattr(fbw_search, "best_schedule", counting)
  seeds = {"single": ((0,) * prob.num_nodes, None)}
  runs = []
  for _ in range(2):
    priced.clear()
    choice, _ = fbw_search.search(prob, 2, None, seeds, time_limit_s=600.0, seed=3,
                                  patience=40, evaluations=None)
    runs.append((choice.assignment, choice.step_s, len(priced)))
  assert runs[0] == runs[1]
  # It stopped by patience (the clock would have allowed far more) and improved on the seed.
  assert runs[0][2] < fbw_search.ANNEAL_COOL_MOVES + 40 * 50
  assert runs[0][1] < real(prob, (0,) * prob.num_nodes, 2, None)[2]


def test_contiguous_splits_priced_are_capped_and_rows_over_the_cap_skipped(monkeypatch):
  """The search prices the CONTIGUOUS_SPLITS most balanced contiguous splits (each schedule
  kind once), however many there are; a split whose fullest row alone is over a cap is skipped
  without generating its schedules."""
  n = fbw_search.CONTIGUOUS_SPLITS + 36  # M = 2: n contiguous splits
  prob = Problem.build([1.0 + (i % 3) for i in range(n)], [(i, i + 1) for i in range(n - 1)],
                       devices=2, transfer_s=0.01, memory_bytes=[10] * n,
                       activation_bytes=[1] * n)
  assert len(fbw_search.contiguous_splits(prob)) == n
  made = []
  real = ts.generate

  def counting(kind, *args, **kwargs):
    made.append(kind)
    return real(kind, *args, **kwargs)

  monkeypatch.setattr(ts, "generate", counting)
  # Deterministic (no clock): no annealing move, so the best split priced is the result.
  choice, baselines = fbw_search.search(prob, 2, None, {}, time_limit_s=600.0, evaluations=0,
                                        kinds=("1f1b",))
  assert made.count("1f1b") == fbw_search.CONTIGUOUS_SPLITS
  assert len(made) == 3 * fbw_search.CONTIGUOUS_SPLITS
  assert set(baselines) == set(ts.KINDS) and choice.found_by.startswith("contiguous")
  # Caps below the most balanced split's fullest row (half the parameters): nothing generated.
  made.clear()
  row = price.device_static_bytes(prob, fbw_search.contiguous_splits(prob)[0])
  caps = (max(row) - 1,) * 2
  assert min(max(price.device_static_bytes(prob, a))
             for a in fbw_search.contiguous_splits(prob)) == max(row)
  choice, baselines = fbw_search.search(prob, 2, caps, {}, time_limit_s=600.0, evaluations=0,
                                        kinds=("1f1b",))
  assert choice is None and baselines == {} and made == []


def test_a_node_without_parameters_never_splits_a_group_by_the_gradient_cap():
  """The gradient cap counts only tasks that write a parameter gradient: the backward of a node
  without parameters (a split leaf's pre node) joins the group of a large gradient,
  where a node with parameters starts a new one; explicit groups follow the same rule."""
  edges = [(0, 1), (1, 2)]
  assignment = [0, 0, 0]
  sched = ts.generate("1f1b", 3, edges, assignment, 1, 1, forward_s=[1.0] * 3)
  _, groups = lockstep_rule.lockstep_groups(sched, edges, assignment, {},
                                            grad_bytes=[50, 0, 100], group_grad_bytes=60)
  names = [[f"{op.kind}{op.node}" for _, op in g] for g in groups]
  assert names == [["F0", "F1", "F2", "B2", "B1"], ["B0"]]
  _, groups = lockstep_rule.lockstep_groups(sched, edges, assignment, {},
                                            grad_bytes=[50, 10, 100], group_grad_bytes=60)
  assert [[f"{op.kind}{op.node}" for _, op in g] for g in groups] == [
    ["F0", "F1", "F2", "B2"], ["B1", "B0"]]
  explicit = dataclasses.replace(sched, groups=((0, 0, 0, 0, 0, 1),))
  lockstep_rule.lockstep_groups(explicit, edges, assignment, {}, grad_bytes=[50, 0, 100],
                                group_grad_bytes=60)
  with pytest.raises(ValueError, match="gradient"):
    lockstep_rule.lockstep_groups(explicit, edges, assignment, {}, grad_bytes=[50, 10, 100],
                                  group_grad_bytes=60)
