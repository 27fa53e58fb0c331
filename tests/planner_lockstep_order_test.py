"""Lock-step task orders (planner/search/lockstep_order.py): valid for any placement, and the search's
polish uses them where they are cheaper than GPipe/1F1B/ZB-H1. No clock: evaluation limits."""

from __future__ import annotations

import itertools
import random

import pytest

from jaxhybrid.planner.pricing import price
from jaxhybrid.planner.search import fbw_search, lockstep_order
from jaxhybrid.planner.core import task_schedule as ts
from jaxhybrid.planner.core.problem import Problem


def _random_dag(seed: int, n: int = 6, devices: int = 3) -> Problem:
  rng = random.Random(seed)
  edges = [(s, d) for d in range(1, n) for s in range(d) if rng.random() < 0.4]
  return Problem.build([round(rng.uniform(0.5, 3.0), 2) for _ in range(n)], edges,
                       devices=devices, transfer_s=0.2, activation_bytes=[1] * n)


@pytest.mark.parametrize("seed", range(4))
def test_every_variant_is_a_schedule_the_lockstep_rule_can_run(seed):
  prob = _random_dag(seed)
  rng = random.Random(seed)
  for _ in range(5):
    assign = tuple(rng.randrange(prob.devices) for _ in range(prob.num_nodes))
    for k in (1, 3):
      got = lockstep_order.variants(prob, assign, k)
      assert len(got) == 2 * len(lockstep_order.VARIANTS)
      for name, sch in got:
        assert sch.kind == "custom" and sch.split == name.endswith("/split")
        ts.validate(sch, prob.num_nodes, prob.edges, assign)
        step = price.lockstep_price(prob, assign, sch).step_s
        assert price.async_makespan(prob, assign, sch) <= step * (1 + 1e-9)


def test_a_limit_keeps_at_most_that_many_microbatches_open():
  prob = Problem.build([1.0, 1.0, 1.0, 1.0], [(0, 1), (1, 2), (2, 3)], devices=2)
  sch = lockstep_order.lockstep_order(prob, (0, 0, 1, 1), 6, False, limit=2)
  ts.validate(sch, 4, prob.edges, (0, 0, 1, 1))
  assert max(sch.in_flight()) <= 2
  with pytest.raises(ValueError, match="priority"):
    lockstep_order.lockstep_order(prob, (0, 0, 1, 1), 2, False, priority="fastest")


# A chain whose first and last nodes share device 0 (a V placement), 4 micro-batches.
_V = Problem.build([2.5, 1.8, 1.0], [(0, 1), (1, 2)], devices=2, transfer_s=0.1)


def test_lockstep_orders_beat_the_stage_orders_on_a_v_placement():
  assign, k = (0, 1, 0), 4
  stage = min(price.lockstep_price(_V, assign, s).step_s
              for _, s in fbw_search.schedules_for(_V, assign, k))
  ours = min(price.lockstep_price(_V, assign, s).step_s
             for _, s in lockstep_order.variants(_V, assign, k))
  # Device 0 runs nodes 0 and 2 (forward + backward: 2.5 + 1.0 s) for each of 4 micro-batches:
  # no order beats 14 s; the lock-step orders beat the best stage order.
  assert 4 * (2.5 + 1.0) <= ours < stage, (ours, stage)


def test_the_search_polishes_its_placements_only_when_custom_orders_may_run():
  seeds = {"v": ((0, 1, 0), None)}
  got, _ = fbw_search.search(_V, 4, None, seeds, time_limit_s=300.0, evaluations=0)
  stage, _ = fbw_search.search(_V, 4, None, seeds, time_limit_s=300.0, evaluations=0,
                               kinds=ts.KINDS)
  assert got.step_s <= stage.step_s
  assert got.step_s == pytest.approx(price.lockstep_price(_V, got.assignment, got.schedule).step_s)
  # 2^3 placements: every one is priced with the stage orders, then the best are polished.
  best_stage = min(
    price.lockstep_price(_V, a, s).step_s
    for a in itertools.product(range(2), repeat=3) for _, s in fbw_search.schedules_for(_V, a, 4))
  assert stage.step_s == pytest.approx(best_stage)
  assert got.step_s < best_stage and got.found_by.startswith("polish/lockstep/")


def run_v_lstm(make_schedule):
  """Runs an LSTM stack in a V (the embedding and the output layer on device 0, the two LSTM
  layers on device 1), 2 micro-batches, with the schedule `make_schedule(problem, assignment)`
  returns (priced on made-up node times), checks it against the single-device reference and
  returns the program."""
  import optax
  import toy
  from flax import nnx
  from program_test import assert_matches_reference, build

  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  opt = optax.adam(1e-2)

  def v(node):
    return 1 if node.name.split("/")[0] in ("l0", "l1") else 0

  prog, p, s, pure = build(model, toy.lstm_loss, batch, "1x2", v, 2, opt)
  g, assign = prog.graph, tuple(prog.assignment)
  edges = sorted({(e.src, e.dst) for e in g.edges})
  prob = Problem.build([1.0 + (i % 3) for i in range(len(g.nodes))], edges, devices=2,
                       transfer_s=0.1)
  schedule = make_schedule(prob, assign)
  prog, p, s, pure = build(model, toy.lstm_loss, batch, "1x2", v, 2, opt, schedule=schedule)
  assert prog.schedule == schedule
  assert_matches_reference(prog, p, s, pure, batch, opt)
  return prog


@pytest.mark.parametrize("split", [False, True])
def test_the_program_runs_a_lockstep_order_and_matches_the_reference(split):
  # The order with a soft limit of 1 open micro-batch.
  run_v_lstm(lambda prob, assign: lockstep_order.lockstep_order(
    prob, assign, 2, split, limit=1, hard_limit=False))
