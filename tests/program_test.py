"""The hybrid program against the single-device reference (loss and parameters after 3 steps)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import toy
from flax import nnx

from jaxhybrid import graph as graph_lib
from jaxhybrid import mesh as mesh_lib
from jaxhybrid import program as program_lib
from jaxhybrid.api import microbatch_spec

STEPS = 3


def reference_run(pure, params, state, batch, opt, steps=STEPS):
  """Plain single-device training: jax.grad of the loss on the whole global batch."""
  os_ = opt.init(params)
  losses = []
  step = jax.jit(lambda p, o, b: _ref_step(pure, opt, p, o, state, b))
  for _ in range(steps):
    params, os_, loss = step(params, os_, batch)
    losses.append(float(loss))
  return losses, [np.asarray(x) for x in jax.tree.leaves(params)]


def _ref_step(pure, opt, p, o, state, b):
  loss, g = jax.value_and_grad(pure)(p, state, b)
  u, o = opt.update(g, o, p)
  return optax.apply_updates(p, u), o, loss


def build(model, loss, batch, mesh_spec, assign_fn, k, opt, **options):
  m = mesh_lib.make(mesh_spec)
  data = m.shape["data"]
  B = len(batch["x"])
  spec, per_example = microbatch_spec(batch, B, B // (data * k))
  _, p, s, pure = graph_lib.nnx_pure_loss(model, loss)
  g = graph_lib.trace_function(pure, p, s, spec)
  assign = [assign_fn(n) for n in g.nodes]
  prog = program_lib.HybridProgram.build(
    g, m, opt, assign, microbatches=k, state=s, per_example=per_example, **options
  )
  return prog, p, s, pure


def run_program(prog, params, batch, steps=STEPS):
  ts = prog.init_state(jax.tree.leaves(params))
  losses = []
  for _ in range(steps):
    ts, metrics = prog.step(ts, batch)
    losses.append(float(metrics["loss"]))
  return losses, prog.unpack(ts.params), ts


def assert_matches_reference(prog, params, state, pure, batch, opt):
  """Losses and parameters after STEPS steps equal plain single-device training (rtol 1e-5), and
  training changed the parameters by more than that tolerance (a program and a reference that
  both skipped the update would otherwise agree)."""
  before = [np.array(x) for x in jax.tree.leaves(params)]
  losses, leaves, _ = run_program(prog, params, batch)
  ref_losses, ref_leaves = reference_run(pure, params, state, batch, opt)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(leaves, ref_leaves):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  moved = max(float(np.max(np.abs(np.asarray(a) - b0))) for a, b0 in zip(leaves, before))
  assert moved > 1e-4, f"the parameters moved by at most {moved:.1e}: nothing was trained"


def split_lstm(node):
  """embed, l0 on device 0; l1, out on device 1."""
  return 0 if node.name.split("/")[0] in ("embed", "l0") else 1


@pytest.mark.parametrize(
  "mesh_spec,k",
  [("1x1", 1), ("2x1", 1), ("1x2", 1), ("1x2", 2), ("2x2", 2), ("4x2", 2)],
)
def test_lstm_stack_matches_reference(mesh_spec, k):
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  opt = optax.adam(1e-2)
  M = mesh_lib.parse(mesh_spec).model
  prog, p, s, pure = build(model, toy.lstm_loss, batch, mesh_spec, split_lstm if M == 2 else (lambda n: 0), k, opt)
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_shared_parameters_are_summed_over_model_axis():
  """Tied embedding read on device 0 (lookup) and device 1 (output projection)."""
  model = toy.LSTMNet(tied=True, rngs=nnx.Rngs(1))
  batch = toy.lstm_batch(8, seed=3)
  opt = optax.sgd(0.5)
  prog, p, s, pure = build(model, toy.lstm_loss, batch, "2x2", split_lstm, 2, opt)
  assert prog.layout.shared, "the tied embedding should be shared across devices"
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_independent_towers_two_way():
  model = toy.Towers(rngs=nnx.Rngs(2))
  batch = toy.regression_batch(8)
  opt = optax.adam(1e-2)
  prog, p, s, pure = build(model, toy.mse_nnx, batch, "2x2", lambda n: 0 if n.name.startswith("a") else 1, 1, opt)
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_one_program_holds_allreduce_and_collective_permute():
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(8)
  prog, p, _, _ = build(model, toy.lstm_loss, batch, "2x2", split_lstm, 2, optax.adam(1e-2))
  ts = prog.init_state(jax.tree.leaves(p))
  hlo = prog.lower(ts, batch).compile().as_text()
  assert "all-reduce" in hlo
  assert "collective-permute" in hlo


def test_parameters_are_owned_not_replicated():
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(8)
  prog, p, _, _ = build(model, toy.lstm_loss, batch, "1x2", split_lstm, 1, optax.adam(1e-2))
  ts = prog.init_state(jax.tree.leaves(p))
  owned_bytes = prog.layout.bytes_per_device()
  total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(p))
  assert sum(owned_bytes) == total and not prog.layout.shared
  assert all(0 < b < total for b in owned_bytes)
  (row,) = ts.params["owned"].values()
  shards = row.addressable_shards
  assert len(shards) == 2
  for sh in shards:
    d = sh.index[0].start
    assert sh.data.shape == (1, row.shape[1])
    # the device holds its own parameters (padding to the longest row is zero)
    assert np.count_nonzero(np.asarray(sh.data)) <= owned_bytes[d] // 4
  assert row.shape[1] * 4 == max(owned_bytes)
  # Adam's moments follow the parameters: same sharding.
  mu = ts.opt_state[0].mu["owned"]["float32"]
  assert mu.sharding.spec == row.sharding.spec


def _group_of(prog):
  return {(d, op): gi for gi, lay in enumerate(prog.structure.groups) for d, op in lay.tasks}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_groups_respect_dependencies_and_devices(schedule):
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(8)
  prog, _, _, _ = build(
    model, toy.lstm_loss, batch, "1x2", split_lstm, 4, optax.sgd(0.1), schedule=schedule
  )
  where = {op: gi for (d, op), gi in _group_of(prog).items() if d == prog.assignment[op.node]}
  kinds = ("F", "B", "W") if schedule == "zb" else ("F", "B")
  assert len(where) == len(prog.graph.nodes) * 4 * len(kinds)
  F = lambda n, c: where[("F", n, c)]  # noqa: E731
  B = lambda n, c: where[("B", n, c)]  # noqa: E731
  for e in prog.graph.edges:
    cross = prog.assignment[e.src] != prog.assignment[e.dst]
    for c in range(4):
      # forward: producer no later than consumer (strictly earlier across devices)
      assert F(e.src, c) + cross <= F(e.dst, c)
      # backward: the consumer's cotangent reaches the producer's backward
      assert B(e.dst, c) + cross <= B(e.src, c)
  for n in range(len(prog.graph.nodes)):
    for c in range(4):
      assert F(n, c) <= B(n, c)
      if schedule == "zb":
        assert B(n, c) <= where[("W", n, c)]
  # pipelining: both devices work in one group at least once
  assert any(len({d for d, _ in lay.tasks}) == 2 for lay in prog.structure.groups)


def test_bad_assignments_and_batches_raise():
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(8)
  m = mesh_lib.make("2x2")
  spec, pe = microbatch_spec(batch, 8, 4)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss)
  g = graph_lib.trace_function(pure, p, s, spec)
  with pytest.raises(ValueError, match="re-plan"):
    program_lib.HybridProgram.build(g, m, optax.sgd(0.1), [0], state=s)
  with pytest.raises(ValueError, match="model=3"):
    program_lib.HybridProgram.build(g, m, optax.sgd(0.1), [2] * len(g.nodes), state=s)
  with pytest.raises(ValueError, match="branch_remat='some'"):
    program_lib.HybridProgram.build(g, m, optax.sgd(0.1), [0] * len(g.nodes), state=s, branch_remat="some")
  prog = program_lib.HybridProgram.build(
    g, m, optax.sgd(0.1), [0] * len(g.nodes), microbatches=2, state=s, per_example=pe
  )
  with pytest.raises(ValueError, match="not divisible"):
    prog.shard_batch(toy.lstm_batch(6))


def test_noise_scale_inputs_are_worker_and_global_gradient_norms():
  """worker_grad_sq_norm = mean over workers of |g_w|^2, grad_sq_norm = |mean_w g_w|^2."""
  model = toy.Towers(rngs=nnx.Rngs(2))
  batch = toy.regression_batch(8, seed=5)
  prog, p, s, pure = build(model, toy.mse_nnx, batch, "2x2", lambda n: 0 if n.name.startswith("a") else 1, 1, optax.sgd(0.0))
  ts = prog.init_state(jax.tree.leaves(p))
  _, metrics = prog.step(ts, batch)
  halves = [jax.tree.map(lambda x: x[i * 4 : (i + 1) * 4], batch) for i in range(2)]
  gw = [jax.tree.leaves(jax.grad(pure)(p, s, h)) for h in halves]
  sq = lambda leaves: sum(float(np.sum(np.square(x))) for x in leaves)  # noqa: E731
  np.testing.assert_allclose(float(metrics["worker_grad_sq_norm"]), (sq(gw[0]) + sq(gw[1])) / 2, rtol=1e-5)
  mean = [(a + b) / 2 for a, b in zip(*gw)]
  np.testing.assert_allclose(float(metrics["grad_sq_norm"]), sq(mean), rtol=1e-5)
  assert np.isfinite(float(metrics["noise_trace_sigma"]))


def _exchange_tower(node):
  # 'first/i', 'second/i'; the loss (the sum of the towers) is its own node: tower 0's device.
  return int(node.name.split("/")[1]) if "/" in node.name else 0


@pytest.mark.parametrize("mesh_spec,k", [("1x2", 2), ("2x4", 1)])
def test_exchanges_match_reference_with_one_permute_per_direction(mesh_spec, k):
  """Neighbouring towers exchange activations: several tensors, both ways, several shifts."""
  model = toy.Exchange(rngs=nnx.Rngs(4))
  batch = toy.regression_batch(16, seed=2)
  opt = optax.adam(1e-2)
  M = mesh_lib.parse(mesh_spec).model
  prog, p, s, pure = build(model, toy.mse_nnx, batch, mesh_spec, lambda n: _exchange_tower(n) % M, k, opt)
  st = prog.structure
  messages = [m for g in range(len(st.groups)) for m in st.message_plan(g)]
  # Each group sends at most one message per (shift, dtype), forward values and cotangents alike.
  for g in range(len(st.groups)):
    plan = st.message_plan(g)
    assert len({(s_, dt) for s_, dt, _, _ in plan}) == len(plan)
  if M == 4:
    assert len({m[0] for m in messages}) >= 2
  assert_matches_reference(prog, p, s, pure, batch, opt)
  ts = prog.init_state(jax.tree.leaves(p))
  assert prog.lower(ts, batch).as_text().count("collective_permute") == len(messages)


def cond_output_bytes(prog, params, batch):
  """Per `cond` of the traced step, in order: bytes of all its outputs."""
  ts = prog.init_state(jax.tree.leaves(params))
  closed = jax.make_jaxpr(prog.step_fn())(ts, prog.shard_batch(batch))
  found = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "cond":
        found.append(sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in e.outvars))
      for p in e.params.values():
        for q in p if isinstance(p, (list, tuple)) else [p]:
          if hasattr(q, "eqns"):
            walk(q)
          elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
            walk(q.jaxpr)

  walk(closed.jaxpr)
  return found


def _conditional_output_bytes(prog, params, batch):
  """Bytes the step's conditionals return, all of them together."""
  return sum(cond_output_bytes(prog, params, batch))


@pytest.mark.parametrize("policy", ["dots", "full"])
def test_branch_remat_matches_reference_and_saves_less(policy):
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  opt = optax.adam(1e-2)
  prog, p, s, pure = build(model, toy.lstm_loss, batch, "2x2", split_lstm, 2, opt)
  remat, _, _, _ = build(model, toy.lstm_loss, batch, "2x2", split_lstm, 2, opt, branch_remat=policy)
  assert_matches_reference(remat, p, s, pure, batch, opt)
  assert _conditional_output_bytes(remat, p, batch) < _conditional_output_bytes(prog, p, batch)
