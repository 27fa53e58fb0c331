"""The transfer-aware lock-step bound (planner/solvers/lockstep_bound.py) against brute force: it is never
above the lock-step price of any (placement, task order) that fits, on small problems with and
without a link model, unequal caps and micro-batches. The solver stops by a node limit."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from jaxhybrid import planner
from jaxhybrid.planner.lower_bounds import placement_bound
from jaxhybrid.planner.pricing import lockstep_rule, price
from jaxhybrid.planner.search import fbw_search
from jaxhybrid.planner.solvers import child, lockstep_bound
from jaxhybrid.planner.core import task_schedule as ts
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule

LIMITS = dict(time_limit_s=300.0, max_nodes=20_000)


def _extensions(ops: list[Op], deps: dict[Op, list[Op]]):
  """Every order of `ops` in which each op follows those of its `deps` that are in `ops`."""
  mine = set(ops)
  need = {op: [d for d in deps[op] if d in mine] for op in ops}

  def rec(done: list[Op], left: set[Op]):
    if not left:
      yield tuple(done)
      return
    for op in sorted(left):
      if all(d in done for d in need[op]):
        done.append(op)
        yield from rec(done, left - {op})
        done.pop()

  yield from rec([], mine)


def _lockstep_optimum(prob: Problem, k: int, split: bool, caps) -> float:
  """The least lock-step price over every placement and every per-device task order that
  runs and fits `caps` (exhaustive)."""
  n, M = prob.num_nodes, prob.devices
  kinds = ("F", "B", "W") if split else ("F", "B")
  ops = [Op(t, i, c) for t in kinds for i in range(n) for c in range(k)]
  deps = {op: [d for d, _, _ in price.fbw_dependencies(prob, op)] for op in ops}
  best = math.inf
  for assign in itertools.product(range(M), repeat=n):
    per = [[op for op in ops if assign[op.node] == d] for d in range(M)]
    for orders in itertools.product(*(list(_extensions(p, deps)) for p in per)):
      sch = TaskSchedule(kind="custom", split=split, microbatches=k, devices=tuple(orders))
      try:
        ts.validate(sch, n, prob.edges, assign)
      except ValueError:
        continue  # the device orders wait on each other
      if price.fits(prob, assign, sch, caps):
        best = min(best, price.lockstep_price(prob, assign, sch).step_s)
  return best


def _chain(link: bool) -> Problem:
  prob = Problem.build([3.0, 2.0, 4.0], [(0, 1), (1, 2)], devices=2, transfer_s=0.5,
                       memory_bytes=[10, 10, 10], activation_bytes=[5, 3, 4], edge_bytes=[40, 25])
  return _with_link(prob) if link else prob


def _diamond(link: bool) -> Problem:
  prob = Problem.build([1.5, 3.0, 2.4, 1.2], [(0, 1), (0, 2), (1, 3), (2, 3)], devices=2,
                       transfer_s=[0.3, 0.2, 0.4, 0.1], memory_bytes=[4, 9, 8, 3],
                       activation_bytes=[2, 3, 3, 1], edge_bytes=[30, 20, 10, 50])
  return _with_link(prob) if link else prob


def _pieces(link: bool) -> Problem:
  """A leaf split in two pieces (`jaxhybrid.graph.shard` names: pre, shard0/1, post) whose
  gradients are each above the lock-step group cap: the group rule lets co-located pieces share
  a group (one gradient unit), which the bound must not undercut."""
  big = _BIG
  prob = Problem.build([0.2, 1.0, 1.0, 0.3, 2.5], [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)],
                       devices=2, transfer_s=[0.1, 0.1, 0.2, 0.2, 0.3],
                       names=["emb/pre", "emb/shard0", "emb/shard1", "emb", "head"],
                       memory_bytes=[0, 10, 10, 0, 4], activation_bytes=[1, 2, 2, 2, 1],
                       edge_bytes=[5, 5, 20, 20, 10])
  prob = dataclasses.replace(prob, param_bytes=(0, big, big, 0, 10))
  return _with_link(prob) if link else prob


def _with_link(prob: Problem) -> Problem:
  """The same problem with a link model: 0.05 s a message, 0.01 s a byte (0.02 from device 1)."""
  return dataclasses.replace(prob, link_latency_s=((0.0, 0.05), (0.05, 0.0)),
                             link_s_per_byte=((0.0, 0.01), (0.02, 0.0)))


_BIG = 2 * lockstep_rule.GROUP_GRAD_BYTES  # a piece's gradient in `_pieces`

# (problem, link model, k, split, caps). The caps exclude placements and orders by the
# planner's rule (rows + the lock-step groups' buffers, edge bytes and gradient windows
# included); the chain's and the diamond's also exclude the unconstrained optimum.
CASES = [
  ("chain", False, 1, False, None),
  ("chain", False, 2, False, (110, 102)),
  ("chain", True, 2, False, None),
  ("chain", True, 1, True, None),
  ("diamond", False, 1, False, (140, 136)),
  ("diamond", True, 1, False, None),
  ("diamond", True, 1, True, (100, 92)),
  ("pieces", False, 1, False, (2 * _BIG + 100, _BIG + 60)),
  ("pieces", True, 1, False, None),
]


@pytest.mark.parametrize("name,link,k,split,caps", CASES)
def test_the_bound_is_never_above_the_best_lockstep_schedule(name, link, k, split, caps):
  prob = {"diamond": _diamond, "chain": _chain, "pieces": _pieces}[name](link)
  want = _lockstep_optimum(prob, k, split, caps)
  assert math.isfinite(want)
  got = lockstep_bound.solve(prob, k, caps, **LIMITS)
  assert got.optimal
  assert got.by_family["fbw" if split else "fb"] <= want * (1 + 1e-9)
  assert got.bound <= want * (1 + 1e-9)
  # Not vacuous: on these problems, whose every split pays a link, it is above the bounds the
  # planner had without it (precedence; the one-machine bound over every placement).
  assert got.bound > max(fbw_search.simple_bound(prob, k), placement_bound.bound(prob, k, caps))


def test_transfers_raise_the_bound_above_the_precedence_bound():
  # Two equal nodes and an expensive edge: splitting halves the compute but pays the bytes
  # twice (activation and cotangent), so the best plan keeps one device, and the bound knows it.
  prob = _with_link(Problem.build([4.0, 4.0], [(0, 1)], devices=2, edge_bytes=[1000]))
  got = lockstep_bound.solve(prob, 1, None, **LIMITS)
  assert got.bound == pytest.approx(8.0, rel=1e-6)
  assert fbw_search.simple_bound(prob, 1) < 8.0 - 1e-6
  assert _lockstep_optimum(prob, 1, False, None) == pytest.approx(8.0)


def test_infeasible_caps_give_an_infinite_bound():
  prob = _chain(False)
  # Each node needs 10 static bytes plus a residual: 12 per device holds one node, 2 devices
  # cannot hold three.
  assert lockstep_bound.solve(prob, 1, (12, 12), **LIMITS).bound == math.inf


def test_segments_cut_at_the_nodes_every_path_passes():
  # 0 -> {1, 2} -> 3 -> 4: nodes 0, 3 and 4 are on every path.
  prob = Problem.build([1.0] * 5, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)], devices=2)
  assert lockstep_bound.segments(prob) == [[0], [1, 2], [3], [4]]


def test_place_reports_the_lockstep_bound_it_proved():
  prob = _diamond(True)
  opts = planner.PlannerOptions(devices=2, microbatches=1, time_limit_s=300.0, threads=1,
                                gap=0.0, cpsat_deterministic_time=0.5, milp_max_nodes=500,
                                search_evaluations=20, lockstep_evaluations=30,
                                warm_start_max_s=None)  # the bound stops by its node limit only
  plan = planner.place_problem(prob, opts)
  ours = lockstep_bound.solve(prob, 1, opts.caps(prob.device_memory_bytes), max_nodes=500,
                              time_limit_s=300.0).bound
  assert plan.lockstep_bound_s >= ours * (1 - 1e-9)
  assert plan.lockstep_bound_s <= plan.lockstep_step_s * (1 + 1e-9)


def test_messages_along_one_chain_add_up(monkeypatch):
  # Two heavy towers between a light source and a light loss, one micro-batch: splitting the
  # towers sends at least two messages one after the other (the input out and the output back
  # may share one; the cotangents come later), each at its shift's slowest link (1.05 s here).
  # Counting each device's bytes alone sees one message's bytes.
  prob = _with_link(Problem.build([1.0, 10.0, 10.0, 1.0], [(0, 1), (0, 2), (1, 3), (2, 3)],
                                  devices=2, edge_bytes=[50, 50, 50, 50]))
  want = _lockstep_optimum(prob, 1, False, None)
  got = lockstep_bound.solve(prob, 1, None, families=("fb",), **LIMITS)
  assert got.by_family["fb"] <= want * (1 + 1e-9)
  monkeypatch.setattr(lockstep_bound, "_chain_cuts", lambda *args: None)
  monkeypatch.setenv(child.INLINE_ENV, "1")  # the patch lives in this process
  per_device = lockstep_bound.solve(prob, 1, None, families=("fb",), **LIMITS)
  assert got.bound > per_device.bound + 0.05
