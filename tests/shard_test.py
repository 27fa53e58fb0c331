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
