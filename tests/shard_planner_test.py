"""Shard options in the planner: which plan is kept (split or whole), spreading a split leaf's
pieces, balancing the rows and re-planning a sharded plan for memory, on hand-made problems."""

from __future__ import annotations

import dataclasses

import optax
import pytest
from flax import nnx
from shard_test import TableNet, _table_batch, table_loss


def test_a_sharded_plan_must_be_faster_by_the_tolerance_or_save_enough_memory():
  """A sharded plan is kept when priced faster than the whole plan by more than
  spread_tolerance, or within it with a peak at least shard_min_memory_saving lower. Pieces of
  every leaf on one device are the whole plan plus the split's own nodes: only speed keeps such
  a plan."""
  import types

  from jaxhybrid import planner

  tol = 0.02
  g = types.SimpleNamespace(shards=(types.SimpleNamespace(shard_nodes=("t/shard0", "t/shard1")),))
  names = ("t/pre", "t/shard0", "t/shard1", "t", "head")

  def plan(step_s, assignment, peak):
    return types.SimpleNamespace(predicted_step_s=step_s, node_names=names,
                                 assignment=assignment, device_peak_bytes=(peak, peak))

  whole = types.SimpleNamespace(predicted_step_s=1.0, node_names=("t", "head"),
                                assignment=(0, 1), device_peak_bytes=(10, 10))
  together, apart = (0, 0, 0, 0, 1), (0, 0, 1, 0, 1)
  assert planner.place_shards.spreads(plan(1, apart, 1), g)
  assert not planner.place_shards.spreads(plan(1, together, 1), g)
  # Pieces kept together divide nothing: never kept, whatever the price says.
  assert not planner.keeps_sharded(plan(0.999, together, 5), whole, tol, graph=g)
  assert not planner.keeps_sharded(plan(0.5, together, 5), whole, tol, graph=g)
  # A price edge within the tolerance does not keep a plan that needs more memory.
  assert not planner.keeps_sharded(plan(0.999, apart, 20), whole, tol, graph=g)
  assert planner.keeps_sharded(plan(0.97, apart, 20), whole, tol, graph=g)
  assert planner.keeps_sharded(plan(1.01, apart, 5), whole, tol, graph=g)  # half the memory
  assert not planner.keeps_sharded(plan(1.01, apart, 20), whole, tol, graph=g)
  assert not planner.keeps_sharded(plan(1.03, apart, 5), whole, tol, graph=g)
  # 5 % less memory is below the default 10 % saving, above a 4 % one.
  assert planner.PlannerOptions().shard_min_memory_saving == 0.10
  assert not planner.keeps_sharded(plan(1.01, apart, 9.5), whole, tol, graph=g)
  assert not planner.keeps_sharded(plan(0.999, apart, 9.5), whole, tol, graph=g)
  assert planner.keeps_sharded(plan(1.01, apart, 9.5), whole, tol, graph=g, min_saving=0.04)
  # Without the graph, the spread is not known: the general rule.
  assert planner.keeps_sharded(plan(0.999, together, 5), whole, tol)
  assert not planner.keeps_sharded(plan(0.999, together, 9.5), whole, tol)
  with pytest.raises(ValueError, match="shard_min_memory_saving"):
    planner.PlannerOptions(shard_min_memory_saving=1.0)


def _piece_problem(piece_s=1e-3, transfer_s=1e-4):
  """emb/pre -> emb/shard0, emb/shard1 -> emb (post) -> head; 100 bytes of memory per piece."""
  from jaxhybrid.planner.core.problem import Problem

  names = ["emb/pre", "emb/shard0", "emb/shard1", "emb", "head"]
  return Problem.build(
    [1e-4, piece_s, piece_s, 1e-4, 5e-3], [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)], devices=2,
    transfer_s=transfer_s, names=names, memory_bytes=[0, 100, 100, 0, 10])


def test_spread_puts_pieces_on_different_devices_when_the_price_allows():
  from jaxhybrid.planner.search import fbw_search, spread

  prob = _piece_problem()
  assert spread.piece_groups(prob.names, 2) == [(1, 2)]
  whole = (0, 0, 0, 0, 1)
  name, sch, step, mem = fbw_search.best_schedule(prob, whole, 2, None)
  choice = fbw_search.Choice(whole, sch, step, tuple(mem), "test")
  got = spread.spread(prob, 2, None, choice, tolerance=0.5, kinds=("1f1b",))
  assert {got.assignment[1], got.assignment[2]} == {0, 1}
  assert max(got.peak_bytes) < max(choice.peak_bytes)
  assert got.step_s <= choice.step_s * 1.5 and got.found_by == "test+spread"
  # Transfers that make spreading cost more than the tolerance: the choice stays.
  costly = _piece_problem(piece_s=1e-5, transfer_s=1e-2)
  name, sch, step, mem = fbw_search.best_schedule(costly, whole, 2, None)
  choice = fbw_search.Choice(whole, sch, step, tuple(mem), "test")
  assert spread.spread(costly, 2, None, choice, tolerance=0.02, kinds=("1f1b",)) == choice


def _two_tables_problem(devices=4, transfer_s=1e-4):
  """Two split leaves a and b of 200 bytes each (one piece per device) read by a chain: a/pre,
  a's pieces, a (post), then the same for b."""
  from jaxhybrid.planner.core.problem import Problem

  M = devices
  names, times, mem, edges = [], [], [], []
  for leaf in ("a", "b"):
    pre = len(names)
    if pre:
      edges.append((pre - 1, pre))
    names += [f"{leaf}/pre"] + [f"{leaf}/shard{d}" for d in range(M)] + [leaf]
    times += [1e-4] + [1e-3] * M + [1e-4]
    mem += [0] + [200 // M] * M + [0]
    edges += [(pre, pre + 1 + d) for d in range(M)] + [(pre + 1 + d, pre + 1 + M) for d in range(M)]
  return Problem.build(times, edges, devices=M, transfer_s=transfer_s, names=names,
                       memory_bytes=mem)


def test_every_device_is_priced_with_the_longest_row():
  from jaxhybrid.planner.core import task_schedule as ts
  from jaxhybrid.planner.pricing import price

  prob = _two_tables_problem()
  apart = (0,) * 6 + (1,) * 6  # a whole on device 0, b whole on device 1: rows of 200
  sch = ts.generate("1f1b", prob.num_nodes, prob.edges, apart, 4, 1)
  assert price.peak_memory_bytes(prob, apart, sch) == [200.0] * 4
  together = (0,) * 11 + (1,)  # devices 1-3 own nothing and still allocate 400
  sch = ts.generate("1f1b", prob.num_nodes, prob.edges, together, 4, 1)
  assert price.peak_memory_bytes(prob, together, sch) == [400.0] * 4
  assert not price.fits(prob, together, sch, (400.0, 400.0, 400.0, 399.0))


def test_spread_spreads_every_leaf_at_once_when_one_at_a_time_cannot_lower_the_peak():
  from jaxhybrid.planner.search import fbw_search, spread

  prob = _two_tables_problem()
  groups = spread.piece_groups(prob.names, 4)
  assert groups == [(1, 2, 3, 4), (7, 8, 9, 10)]
  apart = (0,) * 6 + (1,) * 6
  # Spreading a alone puts a piece beside b: device 1 owns 250 bytes, more than 200.
  for r in range(4):
    one = spread.spread_all(apart, groups[:1], 4, r)
    assert max(fbw_search.best_schedule(prob, one, 1, None)[3]) == 250
  name, sch, step, mem = fbw_search.best_schedule(prob, apart, 1, None)
  choice = fbw_search.Choice(apart, sch, step, tuple(mem), "test")
  got = spread.spread(prob, 1, None, choice, tolerance=0.5, kinds=("1f1b",))
  for g in groups:
    assert sorted(got.assignment[n] for n in g) == [0, 1, 2, 3]
  assert max(got.peak_bytes) == 100 and got.found_by == "test+spread"
  assert got.step_s <= step * 1.5


def test_spread_seeds_give_the_search_every_seed_with_its_leaves_spread():
  from jaxhybrid.planner.search import spread

  prob = _two_tables_problem(devices=2)
  seeds = {"apart": ((0, 0, 0, 0, 1, 1, 1, 1), None), "even": ((0, 0, 1, 0, 1, 0, 1, 1), [])}
  # An already spread seed adds nothing; a whole-leaf one comes back with piece d on device d.
  assert spread.spread_seeds(prob, seeds) == {"apart+spread": ((0, 0, 1, 0, 1, 0, 1, 1), None)}
  assert spread.spread_seeds(_piece_problem(), {"x": ((1, 1, 1, 1, 0), None)}) == {
    "x+spread": ((1, 0, 1, 1, 0), None)}


def test_a_seed_placement_of_the_wrong_size_is_refused():
  from conftest import LIGHT_DETERMINISTIC_PLANNER

  from jaxhybrid import planner

  prob = _piece_problem()
  opts = planner.PlannerOptions(devices=2, microbatches=2, seed_assignments=((0, 1),),
                                **LIGHT_DETERMINISTIC_PLANNER)
  with pytest.raises(ValueError, match=r"seed_assignments\[0\] places 2 nodes"):
    planner.place_problem(prob, opts)
  ok = dataclasses.replace(opts, seed_assignments=((0, 0, 0, 0, 1),))
  assert planner.place_problem(prob, ok).lockstep_step_s > 0

def test_co_located_pieces_of_a_leaf_share_a_lockstep_group_as_the_whole_leaf_would():
  """Two pieces above the group's gradient cap on one device: as one leaf's gradient they may
  leave one group together (the unit rule, which also holds the post node that keeps the cut
  node's name); two unrelated nodes of that size may not."""
  from jaxhybrid.planner.pricing import lockstep_rule, price
  from jaxhybrid.planner.search import fbw_search

  big = 2 * lockstep_rule.GROUP_GRAD_BYTES
  prob = dataclasses.replace(_piece_problem(), param_bytes=(0, big, big, 0, 10))
  assert lockstep_rule.grad_units(prob.names) == [0, 1, 1, 1, 4]
  whole = (0, 0, 0, 0, 1)
  _, sch, _, _ = fbw_search.best_schedule(prob, whole, 2, None, kinds=("1f1b",))

  def group_of(groups, node, c):
    return next(j for j, g in enumerate(groups) for _, op in g
                if lockstep_rule.is_grad_task(op, sch.split) and (op.node, op.microbatch) == (node, c))

  reads = price.task_reads(prob, sch)
  for units, together in ((prob.grad_units, True), (None, False)):
    _, groups = lockstep_rule.lockstep_groups(sch, prob.edges, whole, reads,
                                              grad_bytes=prob.param_bytes, grad_unit=units)
    for c in range(2):
      assert (group_of(groups, 1, c) == group_of(groups, 2, c)) == together


def test_the_nodes_cut_from_one_node_are_one_gradient_unit():
  """Pieces of every split leaf of one node and the post node that keeps its name share the
  first piece's unit; the pre node (no parameters) and other nodes are their own, also when a
  name only starts like the cut node's."""
  from jaxhybrid.planner.pricing import lockstep_rule

  names = ["enc/l0/pre", "enc/l0/kernel.shard0", "enc/l0/kernel.shard1", "enc/l0/bias.shard0",
           "enc/l0/bias.shard1", "enc/l0", "enc/l0b", "emb/shard0", "emb/shard1", "emb", "head"]
  assert lockstep_rule.grad_units(names) == [0, 1, 1, 1, 1, 1, 6, 7, 7, 7, 10]
  assert lockstep_rule.grad_units(["a", "b"]) == [0, 1]


def _balance_problem(transfer_s=1e-6, names=("a", "b", "c", "t/shard0", "t/shard1", "t/shard2")):
  """a and b (1 ms each, 100 bytes) and c (1 us, 100 bytes, fed by a) on three devices, beside a
  leaf split in three pieces (1 us, no bytes of their own; the pass balances problems with split
  leaves)."""
  from jaxhybrid.planner.core.problem import Problem

  return Problem.build([1e-3, 1e-3, 1e-6, 1e-6, 1e-6, 1e-6], [(0, 2)], devices=3,
                       transfer_s=transfer_s, names=list(names),
                       memory_bytes=[100, 100, 100, 0, 0, 0])


def test_balance_moves_a_node_off_the_fullest_device_when_the_price_allows():
  from jaxhybrid.planner.search import fbw_search, spread

  prob = _balance_problem()
  start = (0, 1, 0, 0, 1, 2)  # device 0 holds a and c: every device allocates its 200-byte row
  name, sch, step, mem = fbw_search.best_schedule(prob, start, 1, None, kinds=("1f1b",))
  assert max(mem) == 200
  choice = fbw_search.Choice(start, sch, step, tuple(mem), "test")
  got = spread.balance(prob, 1, None, choice, tolerance=0.02, kinds=("1f1b",))
  assert got.assignment == (0, 1, 2, 0, 1, 2)  # c to the device that owns nothing
  assert max(got.peak_bytes) == 100 and got.found_by == "test+balance"
  assert got.step_s <= step * 1.02
  # c's input costs more than the tolerance to move: the choice stays as it was.
  costly = _balance_problem(transfer_s=1e-3)
  name, sch, step, mem = fbw_search.best_schedule(costly, start, 1, None, kinds=("1f1b",))
  choice = fbw_search.Choice(start, sch, step, tuple(mem), "test")
  assert spread.balance(costly, 1, None, choice, tolerance=0.02, kinds=("1f1b",)) == choice
  # No evaluations allowed: nothing is priced, nothing moves.
  assert spread.balance(prob, 1, None, choice, 0.5, ("1f1b",), evaluations=0) == choice
  # Whole nodes only (no split leaf): the search's placement is kept.
  whole = _balance_problem(names=("a", "b", "c", "d", "e", "f"))
  name, sch, step, mem = fbw_search.best_schedule(whole, start, 1, None, kinds=("1f1b",))
  choice = fbw_search.Choice(start, sch, step, tuple(mem), "test")
  assert spread.balance(whole, 1, None, choice, tolerance=0.5, kinds=("1f1b",)) == choice


@dataclasses.dataclass(frozen=True)
class _PricedPlan:
  """The fields `place_shards.lower_memory` reads and writes of a Plan."""

  predicted_step_s: float
  assignment: tuple
  device_peak_bytes: tuple
  node_memory_bytes: tuple = (10.0, 10.0)
  memory_caps_bytes: tuple = (100.0, 100.0)
  lower_bound_s: float = 0.5
  lockstep_bound_s: float = 0.9
  fused_makespan_s: float = 1.0
  gap: float = 0.0
  status: str = "optimal"
  node_names: tuple = ("a", "b")

  def device_memory(self):
    mem = [0.0, 0.0]
    for i, d in enumerate(self.assignment):
      mem[d] += self.node_memory_bytes[i]
    return mem


def test_lower_memory_keeps_the_lowest_peak_priced_within_the_tolerance(monkeypatch):
  from jaxhybrid import planner

  # Both nodes' 10 static bytes on device 0, 5 live bytes: peak 25, balanced 15.
  plan = _PricedPlan(1.0, (0, 0), (25.0, 25.0))
  assert planner.place_shards.balanced_peak(plan) == 15.0
  asked = []

  def place(g, costs, devices, memory_caps_bytes, **opts):
    cap = memory_caps_bytes[0]
    asked.append(cap)
    if cap >= 22:  # a balanced plan, 1 % slower: within the tolerance
      return _PricedPlan(1.01, (0, 1), (15.0, 15.0), lockstep_bound_s=0.95, lower_bound_s=0.6)
    if cap >= 19:
      raise planner.InfeasibleError("nothing fits")
    return _PricedPlan(1.05, (0, 1), (14.0, 14.0))  # lower, but 5 % slower: not kept

  monkeypatch.setattr(planner, "place", place)
  got = planner.place_shards.lower_memory(None, None, 2, plan, 0.02)
  assert asked == [22.5, 20.0, 17.5]  # a quarter, half, three quarters of the way to 15
  assert got.assignment == (0, 1) and got.device_peak_bytes == (15.0, 15.0)
  assert got.predicted_step_s <= plan.predicted_step_s * 1.02
  # The caps and bounds of the problem as asked: a bound proven under lower caps does not hold.
  assert got.memory_caps_bytes == plan.memory_caps_bytes
  assert got.lockstep_bound_s == 0.9 and got.lower_bound_s == 0.5
  assert got.gap == pytest.approx(0.5)
  # No tolerance, or rows already balanced: nothing is re-planned.
  asked.clear()
  assert planner.place_shards.lower_memory(None, None, 2, plan, 0.0) is plan
  balanced = _PricedPlan(1.0, (0, 1), (15.0, 15.0))
  assert planner.place_shards.lower_memory(None, None, 2, balanced, 0.02) is balanced
  assert asked == []


def test_a_placement_asked_for_by_name_is_not_balanced():
  """The balance pass follows the MILP search only: planner='single' stays on one device."""
  from conftest import LIGHT_DETERMINISTIC_PLANNER as DETERMINISTIC_PLANNER

  from jaxhybrid import api

  model, batch = TableNet(rngs=nnx.Rngs(0)), _table_batch()
  hy = api.parallelize(model, table_loss, optax.adam(1e-2), batch, mesh="1x2", microbatches=2,
                       planner="single", planner_options=DETERMINISTIC_PLANNER)
  assert len(set(hy.plan.assignment)) == 1 and "balance" not in hy.plan.lockstep_found_by


def test_lower_memory_keeps_the_faster_of_plans_with_the_same_peak(monkeypatch):
  from jaxhybrid import planner

  plan = _PricedPlan(1.0, (0, 0), (25.0, 25.0))
  # Under the first cap a 15.0-byte plan 1 % slower, then a 15.1-byte one 2 % faster (the same
  # memory within SAME_PEAK), then a 14.9-byte one 1.5 % slower.
  found = iter([_PricedPlan(1.01, (0, 1), (15.0, 15.0)), _PricedPlan(0.98, (1, 0), (15.1, 15.1)),
                _PricedPlan(1.015, (0, 1), (14.9, 14.9))])
  monkeypatch.setattr(planner, "place", lambda *a, **kw: next(found))
  got = planner.place_shards.lower_memory(None, None, 2, plan, 0.02)
  assert 14.9 / 15.1 > 1 - planner.place_shards.SAME_PEAK
  assert got.assignment == (1, 0) and got.predicted_step_s == 0.98


def test_shard_or_whole_plans_within_its_time_limit(monkeypatch):
  """The two solves and the memory re-plans together take at most `time_limit_s`, each solve
  using all of the limit it is given (a clock that only its solves move)."""
  import types

  from jaxhybrid import planner

  now, limits = [100.0], []

  def place(g, costs, devices, time_limit_s, **opts):
    limits.append(time_limit_s)
    now[0] += time_limit_s
    # Every plan holds both nodes' static bytes on device 0: unbalanced, so re-planned for memory.
    return _PricedPlan(1.0, (0, 0), (25.0, 25.0))

  monkeypatch.setattr(planner, "place", place)
  monkeypatch.setattr(planner.place_shards, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
  g = types.SimpleNamespace(nodes=[types.SimpleNamespace(name=n) for n in "ab"], shards=[],
                            batch_splits=())
  plan, sharded = planner.place_shard_or_whole(g, g, None, 2, time_limit_s=30.0)
  assert len(limits) == 2 + len(planner.place_shards.LOWER_MEMORY_STEPS), limits
  assert all(x > 0 for x in limits) and now[0] - 100.0 == pytest.approx(30.0), limits
  assert not sharded and plan.assignment == (0, 0)
