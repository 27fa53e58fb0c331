"""Shard options: a large leaf split into one piece per model device (`jaxhybrid.graph.shard`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from program_test import assert_matches_reference

from jaxhybrid import graph as graph_lib
from jaxhybrid import mesh as mesh_lib
from jaxhybrid import program as program_lib
from jaxhybrid.api import microbatch_spec
from jaxhybrid.graph import shard


class VocabNet(nnx.Module):
  """An embedding lookup, a hidden dense layer and a vocabulary projection."""

  def __init__(self, vocab=50, width=16, *, rngs):
    self.emb = nnx.Embed(vocab, width, rngs=rngs)
    self.mid = nnx.Linear(width, width, rngs=rngs)
    self.out = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, ids):
    return self.out(jnp.tanh(self.mid(self.emb(ids))))


def vocab_loss(m, b):
  logp = jax.nn.log_softmax(m(b["x"]))
  return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], -1))


def vocab_batch(n, vocab=50, seq=4, seed=0):
  r = np.random.default_rng(seed)
  return {"x": jnp.asarray(r.integers(0, vocab, (n, seq)), jnp.int32),
          "y": jnp.asarray(r.integers(0, vocab, (n, seq)), jnp.int32)}


def _run(g, leaves, state, batch):
  args = list(leaves) + jax.tree.leaves(state) + jax.tree.leaves(batch)
  return jex.core.jaxpr_as_fun(g.closed_jaxpr)(*args)[0]


def test_rewrite_keeps_loss_and_gradients():
  model, batch = VocabNet(rngs=nnx.Rngs(0)), vocab_batch(4)
  g = graph_lib.trace(model, vocab_loss, batch)
  g3, report = shard.shard_leaves(g, 3)
  rules = {s.path.split("'")[1]: (s.rule, s.axis) for s in report.shards}
  # The embedding is only looked up, by whole rows: split along its features (axis 1).
  assert rules == {"emb": ("lookup", 1), "out": ("column", 1), "mid": ("column", 1)}
  # Every piece is read by exactly one node, and the three pieces of a leaf by three nodes.
  readers = [[n.id for n in g3.nodes if j in n.param_leaves] for j in range(len(g3.param_avals))]
  assert all(len(r) == 1 for r in readers)
  _, p, s, _ = graph_lib.nnx_pure_loss(model, vocab_loss)
  leaves = jax.tree.leaves(p)
  pieces = shard.split_leaves(g3, leaves)
  assert len(pieces) == len(leaves) + 3 * 2
  np.testing.assert_allclose(_run(g3, pieces, s, batch), _run(g, leaves, s, batch), rtol=1e-6)
  want = jax.grad(lambda pl: _run(g, pl, s, batch))(leaves)
  got = shard.join_leaves(g3, jax.grad(lambda pl: _run(g3, pl, s, batch))(pieces))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tied", [False, True])
def test_ids_outside_the_table_read_what_the_whole_table_reads(tied):
  """jnp.take fills ids past the table with NaN; indexing clamps them: the pieces do the same,
  split along the row's features (looked up only) or along the rows (also a projection)."""
  table = jnp.arange(40.0).reshape(10, 4)

  def loss(p, s, b):
    del s
    a = jnp.take(p["t"], b["i"], axis=0)
    c = p["t"][b["j"]]
    out = jnp.sum(jnp.where(jnp.isnan(a), 7.0, a)) + jnp.sum(c * c)
    return out + jnp.sum(jnp.einsum("bd,vd->bv", b["h"], p["t"])) if tied else out

  b = {"i": jnp.array([0, 3, 9, 10, 12], jnp.int32), "j": jnp.array([1, 9, 11, 20], jnp.int32),
       "h": jnp.ones((2, 4))}
  g = graph_lib.trace_function(loss, {"t": table}, {}, b)
  g2, report = shard.shard_leaves(g, 3)
  want = ("column+lookup", 0) if tied else ("lookup", 1)
  assert [(s.rule, s.axis) for s in report.shards] == [want]
  pieces = shard.split_leaves(g2, [table])
  assert pieces[0].shape == ((3, 4) if tied else (10, 1))
  if not tied:  # a plan saved with the row split brings it back
    rows = dataclasses.replace(report.shards[0], axis=0, bounds=(0, 3, 6, 10))
    g_rows = shard.apply(g, 3, [rows.to_json()])
    assert [s.axis for s in g_rows.shards] == [0]
    np.testing.assert_array_equal(_run(g_rows, shard.split_leaves(g_rows, [table]), {}, b),
                                  _run(g, [table], {}, b))
  np.testing.assert_array_equal(_run(g2, pieces, {}, b), _run(g, [table], {}, b))
  # Gradients with ids inside the table (indexing promises in-bounds ids: past the table its
  # gradient is undefined, and the row split's clamp sends it to the last row).
  b = dict(b, i=jnp.array([0, 3, 9, 3, 5], jnp.int32), j=jnp.array([1, 9, 2, 2], jnp.int32))
  grad = jax.grad(lambda pl: _run(g2, pl, {}, b))(pieces)
  np.testing.assert_allclose(shard.join_leaves(g2, grad)[0],
                             jax.grad(lambda t: _run(g, [t], {}, b))(table), rtol=1e-6)


def test_leaves_no_rule_applies_to_are_skipped_with_a_reason():
  def loss(p, s, b):
    del s
    return jnp.sum(jnp.take(p["e"], b["i"], axis=0)) + jnp.sum(p["w"] ** 2) * jnp.mean(b["x"])

  params = {"e": jnp.ones((20, 4)), "w": jnp.ones((20, 4))}
  b = {"i": jnp.array([1, 2], jnp.int32), "x": jnp.ones((2,))}
  g = graph_lib.trace_function(loss, params, {}, b)
  g2, report = shard.shard_leaves(g, 2)
  assert [s.path for s in report.shards] == ["['e']"]
  assert report.skipped == (("['w']", "read by integer_pow"),)
  with pytest.raises(ValueError, match=r"cannot shard parameter \['w'\]: read by integer_pow"):
    shard.shard_leaves(g, 2, leaves=["['w']"])
  with pytest.raises(ValueError, match="unknown shard rule"):
    shard.shard_leaves(g, 2, rules=("rows",))
  assert shard.shard_leaves(g, 2, rules=())[0] is g
  assert shard.shard_leaves(g, 1)[0] is g


def _spread(g, M):
  """Shard d on device d; every other node on device 0, except the vocabulary head on M - 1."""
  out = []
  for n in g.nodes:
    if "/shard" in n.name:
      out.append(int(n.name.rsplit("shard", 1)[1]) % M)
    else:
      out.append(M - 1 if n.name.startswith("out") else 0)
  return out


@pytest.mark.parametrize("mesh_spec,k,schedule,zero,opt_name", [
  ("1x2", 1, "1f1b", 0, "adam"), ("2x2", 2, "zb", 0, "adam"), ("1x4", 2, "gpipe", 0, "adam"),
  ("4x2", 1, "1f1b", 0, "adam"),
  # ZeRO over 'data' with split leaves (pieces placed on every model device)
  ("2x2", 2, "1f1b", 1, "adagrad"), ("2x2", 1, "zb", 2, "adam"), ("4x2", 1, "gpipe", 2, "adagrad"),
])
def test_program_with_sharded_leaves_matches_reference(mesh_spec, k, schedule, zero, opt_name):
  model, batch = VocabNet(rngs=nnx.Rngs(1)), vocab_batch(16, seed=2)
  opt = {"adam": optax.adam(1e-2), "adagrad": optax.adagrad(0.1)}[opt_name]
  m = mesh_lib.make(mesh_spec)
  M, data = m.shape["model"], m.shape["data"]
  spec, per_example = microbatch_spec(batch, 16, 16 // (data * k))
  _, p, s, pure = graph_lib.nnx_pure_loss(model, vocab_loss)
  g, report = shard.shard_leaves(graph_lib.trace_function(pure, p, s, spec), M)
  assert len(report.shards) == 3
  prog = program_lib.HybridProgram.build(
    g, m, opt, _spread(g, M), microbatches=k, state=s, per_example=per_example, schedule=schedule,
    zero=zero)
  # Each device owns one piece of the embedding: 1/M of it, not the whole table.
  emb = next(x for x in report.shards if x.rule == "lookup")
  per_dev = prog.layout.bytes_per_device()
  split = shard.sharded_bytes(g)
  assert split == (50 * 16 + 16 * 16 + 16 * 50) * 4
  whole = g.total_param_bytes - split  # the biases
  # One row of imbalance per leaf; under ZeRO each leaf padded to a multiple of the data width.
  pad = 3 * 16 * 4 + (8 * 4 * data if zero else 0)
  assert max(per_dev) <= split / M + whole + pad, per_dev
  assert emb.axis == 1 and emb.bounds == tuple((d * 16) // M for d in range(M + 1))
  assert_matches_reference(prog, p, s, pure, batch, opt)


class TableNet(nnx.Module):
  """A big embedding table and a small head: the table alone is most of the parameters."""

  def __init__(self, vocab=4096, width=64, *, rngs):
    self.emb = nnx.Embed(vocab, width, rngs=rngs)
    self.head = nnx.Linear(width, 8, rngs=rngs)

  def __call__(self, ids):
    return self.head(jnp.tanh(self.emb(ids)))


def table_loss(m, b):
  return jnp.mean((m(b["x"]) - 1.0) ** 2)


def _table_batch(n=8, seed=0):
  return {"x": jnp.asarray(np.random.default_rng(seed).integers(0, 4096, (n, 4)), jnp.int32)}


def test_a_table_no_device_can_hold_is_sharded_and_trains_exactly():
  """Planner memory per device = parameters x (1 + gradient + Adam's 2 moments) = 4 MiB for the
  1 MiB table: under a 3.5 MiB cap it fits on no device whole, so the plan must shard it; the
  program it builds (rows, buffers) is predicted within the cap."""
  from conftest import DETERMINISTIC_PLANNER

  from jaxhybrid import api
  from jaxhybrid import planner

  model, batch = TableNet(rngs=nnx.Rngs(0)), _table_batch()
  opt = optax.adam(1e-2)
  cap = int(3.5 * 2**20)
  opts = dict(DETERMINISTIC_PLANNER, memory_caps_bytes=cap)
  with pytest.raises(planner.InfeasibleError):
    api.parallelize(model, table_loss, opt, batch, mesh="1x2",
                    planner_options=dict(opts, shard_rules=()))
  hy = api.parallelize(model, table_loss, opt, batch, mesh="1x2", planner_options=opts)
  assert [s["path"] for s in hy.plan.shards] == ["['emb']['embedding'].value"]
  assert sorted(hy.plan.shard_devices()[0]) == [0, 1]
  assert "sharded over 2 devices" in hy.plan.summary()
  assert max(hy.program.layout.bytes_per_device()) < 4096 * 64 * 4 * 0.6
  assert hy.program.memory(compile=False).predicted <= cap
  # The plan round-trips through JSON and brings its split back onto a fresh trace.
  again = planner.Plan.from_json(hy.plan.to_json())
  assert again.shards == hy.plan.shards and again.schema_version == planner.SCHEMA_VERSION
  hy2 = api.parallelize(model, table_loss, opt, batch, mesh="1x2", plan=again)
  assert hy2.program.assignment == hy.program.assignment
  _, p, s, pure = graph_lib.nnx_pure_loss(model, table_loss)
  assert_matches_reference(hy2.program, p, s, pure, batch, opt)
  # The same plan with two data replicas under ZeRO: the table's pieces and their optimizer
  # state (stage 1), and their gradients too (stage 2), split over 'data', and still exact.
  # (A global batch twice as large: the same micro-batch per data replica, the plan's graph.)
  batch2 = _table_batch(16, seed=1)
  for stage in (1, 2):
    hy3 = api.parallelize(model, table_loss, opt, batch2, mesh="2x2", plan=again,
                          program_options={"zero": stage})
    assert hy3.program.zero == stage
    assert hy3.program.layout.shapes == hy2.program.layout.shapes
    assert_matches_reference(hy3.program, p, s, pure, batch2, opt)
  # A version-2 plan (no `shards`) loads with every leaf whole.
  old = hy.plan.to_dict()
  old["schema_version"] = 2
  del old["shards"]
  assert planner.Plan.from_dict(old).shards == ()
  # Before schema 4 `predicted_step_s` held the fused makespan: it loads as `fused_makespan_s`,
  # and the prediction is the lock-step price.
  for key in ("fused_makespan_s", "fused_speedup"):
    del old[key]
  old["predicted_step_s"], old["predicted_speedup"] = 0.5, 1.25
  loaded = planner.Plan.from_dict(old)
  assert (loaded.fused_makespan_s, loaded.fused_speedup) == (0.5, 1.25)
  assert loaded.predicted_step_s == hy.plan.lockstep_step_s > 0
  assert again.predicted_step_s == hy.plan.predicted_step_s == hy.plan.lockstep_step_s
  # Leaves no rule could split are named in the plan with the reason, and survive JSON.
  why = dataclasses.replace(hy.plan, shard_skipped=(("['w']", "read by 2 nodes"),))
  assert "leaf ['w']: kept whole, no shard rule applies (read by 2 nodes)" in why.summary()
  assert planner.Plan.from_json(why.to_json()).shard_skipped == why.shard_skipped


def test_shard_options_never_price_above_the_placement_only_plan():
  """With room for the table, the kept plan prices at most spread_tolerance above the
  placement-only plan."""
  from conftest import LIGHT_DETERMINISTIC_PLANNER as DETERMINISTIC_PLANNER

  from jaxhybrid import planner

  from jaxhybrid import api

  model, batch = TableNet(rngs=nnx.Rngs(0)), _table_batch()
  opt = optax.adam(1e-2)
  whole = api.parallelize(model, table_loss, opt, batch, mesh="1x2", microbatches=2,
                          planner_options=dict(DETERMINISTIC_PLANNER, shard_rules=(),
                                               time_limit_s=300.0))
  either = api.parallelize(model, table_loss, opt, batch, mesh="1x2", microbatches=2,
                           planner_options=DETERMINISTIC_PLANNER)
  assert whole.plan.shards == ()
  tol = planner.PlannerOptions().spread_tolerance
  assert either.plan.lockstep_step_s <= whole.plan.lockstep_step_s * (1 + tol) + 1e-15


def test_a_split_kept_on_one_device_must_be_faster_by_the_tolerance():
  """Pieces of every leaf on one device are the whole plan plus the split's own nodes: such a
  plan is kept only when priced faster than the whole plan by more than spread_tolerance; a
  plan that spreads a leaf keeps the faster-or-within-tolerance-and-smaller rule."""
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
  assert not planner.keeps_sharded(plan(0.999, together, 5), whole, tol, graph=g)
  assert planner.keeps_sharded(plan(0.97, together, 5), whole, tol, graph=g)
  assert planner.keeps_sharded(plan(0.999, apart, 20), whole, tol, graph=g)
  assert planner.keeps_sharded(plan(1.01, apart, 5), whole, tol, graph=g)  # less memory
  assert not planner.keeps_sharded(plan(1.01, apart, 20), whole, tol, graph=g)
  assert not planner.keeps_sharded(plan(1.03, apart, 5), whole, tol, graph=g)
  # Without the graph, the spread is not known: the general rule.
  assert planner.keeps_sharded(plan(0.999, together, 5), whole, tol)


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


class ConvNet(nnx.Module):
  def __init__(self, *, rngs):
    self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(8, 6, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(6, 1, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.c2(jax.nn.relu(self.c1(x))))
    return self.head(jnp.mean(h, axis=(1, 2)))


def conv_loss(m, b):
  return jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2)


def test_convolution_kernels_split_on_output_features_match_reference():
  r = np.random.default_rng(0)
  batch = {"x": jnp.asarray(r.normal(size=(8, 8, 8, 3)), jnp.float32),
           "y": jnp.asarray(r.normal(size=(8,)), jnp.float32)}
  model, opt = ConvNet(rngs=nnx.Rngs(0)), optax.adam(1e-2)
  m = mesh_lib.make("1x2")
  spec, per_example = microbatch_spec(batch, 8, 4)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, conv_loss)
  g, report = shard.shard_leaves(graph_lib.trace_function(pure, p, s, spec), 2, min_fraction=0.2)
  got = {x.path.split("'")[1]: (x.rule, x.axis) for x in report.shards}
  assert got == {"c1": ("column", 3), "c2": ("column", 3)}  # HWIO kernels: O is axis 3
  prog = program_lib.HybridProgram.build(
    g, m, opt, [int(n.name.endswith("shard1")) for n in g.nodes], microbatches=2, state=s,
    per_example=per_example)
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_co_located_pieces_of_a_leaf_share_a_lockstep_group_as_the_whole_leaf_would():
  """Two pieces above the group's gradient cap on one device: as one leaf's gradient they may
  leave one group together (the unit rule); two unrelated nodes of that size may not."""
  from jaxhybrid.planner.pricing import lockstep_rule, price
  from jaxhybrid.planner.search import fbw_search

  big = 2 * lockstep_rule.GROUP_GRAD_BYTES
  prob = dataclasses.replace(_piece_problem(), param_bytes=(0, big, big, 0, 10))
  assert lockstep_rule.grad_units(prob.names) == [0, 1, 1, 3, 4]
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
