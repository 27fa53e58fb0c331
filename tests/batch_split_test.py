"""Batch split: a node's micro-batch divided by rows over the model devices
(`jaxhybrid.graph.batch_split`, its test in `batch_rules`)."""

from __future__ import annotations

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from flax import nnx
from program_test import assert_matches_reference

from jaxhybrid import graph as graph_lib
from jaxhybrid import mesh as mesh_lib
from jaxhybrid import models
from jaxhybrid import program as program_lib
from jaxhybrid.api import microbatch_spec
from jaxhybrid.graph import batch_split


def _run(g, leaves, state, batch):
  args = list(leaves) + jax.tree.leaves(state) + jax.tree.leaves(batch)
  return jex.core.jaxpr_as_fun(g.closed_jaxpr)(*args)[0]


def _traced(pure, p, s, batch, devices, micro=None):
  n = len(jax.tree.leaves(batch)[0])
  spec, per_example = microbatch_spec(batch, n, micro or n)
  g = graph_lib.trace_function(pure, p, s, spec)
  return g, batch_split.trace_small(pure, p, s, spec, per_example, devices), per_example


def _assert_same_loss_and_grads(g, g2, leaves, s, batch, rtol=1e-5):
  """Loss and gradients of the user's leaves equal through `g` and `g2` (whose leaves may be
  cut into slices: `shard.split_leaves`)."""
  from jaxhybrid.graph import shard

  l_want, want = jax.jit(jax.value_and_grad(lambda pl: _run(g, pl, s, batch)))(leaves)
  l_got, got = jax.jit(jax.value_and_grad(
    lambda pl: _run(g2, shard.split_leaves(g2, pl), s, batch)))(leaves)
  np.testing.assert_allclose(l_got, l_want, rtol=rtol)
  scale = max(float(jnp.max(jnp.abs(x))) for x in want)
  assert scale > 1e-3  # gradients that are all zero would agree trivially
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


class ConvBN(nnx.Module):
  """A convolution, BatchNorm (training statistics: mixes the examples), a dense head."""

  def __init__(self, *, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.bn(self.conv(x)))
    return self.head(jnp.mean(h, axis=(1, 2)))


def convbn_loss(m, b):
  return jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2)


def convbn_batch(n, seed=0):
  r = np.random.default_rng(seed)
  return {"x": jnp.asarray(r.normal(size=(n, 6, 6, 3)), jnp.float32),
          "y": jnp.asarray(r.normal(size=(n,)), jnp.float32)}


@pytest.mark.parametrize("devices", [2, 4])
def test_lstm_stack_split_by_rows_keeps_loss_and_gradients(devices):
  model, batch = toy.LSTMNet(rngs=nnx.Rngs(0)), toy.lstm_batch(8)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss)
  g, small, _ = _traced(pure, p, s, batch, devices)
  g2, report = batch_split.split_batch(g, small, devices)
  split = {x.node for x in report.splits}
  # The LSTM layers (a scan over time whose carry holds the examples) split; so does the head,
  # whose projection runs in the pieces and whose mean loss runs in the post node.
  assert {"l0", "l1"} <= split, report
  assert len(g2.nodes) == len(g.nodes) + devices * len(report.splits)
  for x in report.splits:
    assert x.bounds == tuple(d * 8 // devices for d in range(devices + 1))
    assert all(sum(1 for n in g2.nodes if n.name == name) == 1 for name in x.piece_nodes)
  _assert_same_loss_and_grads(g, g2, jax.tree.leaves(p), s, batch)


@pytest.mark.parametrize("params", ["replicated", "split"])
def test_batchnorm_stays_in_the_post_node_and_its_statistics_are_exact(params):
  model, batch = ConvBN(rngs=nnx.Rngs(0)), convbn_batch(8)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, convbn_loss, with_state=True)
  g = graph_lib.trace_function(pure, p, s, microbatch_spec(batch, 8, 8)[0], depth=1)
  small = batch_split.trace_small(pure, p, s, microbatch_spec(batch, 8, 8)[0], [True, True], 2)
  g2, report = batch_split.split_batch(g, small, 2, params=params)
  # (sliced: the convolution's kernel and bias, and BatchNorm's scale and offset its post node
  # reads, are each held in two slices)
  assert all(bool(x.split_params) == (params == "split") for x in report.splits)
  assert "conv" in {x.node for x in report.splits}
  bn = [n for n in g2.nodes if n.name.startswith("bn")]
  if any(x.node == "bn" for x in report.splits):  # only its row-wise prefix (a reshape) is cut
    post = next(n for n in bn if n.name == "bn")
    assert any(e.primitive.name in ("dot_general", "reduce_sum") for e in post.eqns)
  _assert_same_loss_and_grads(g, g2, jax.tree.leaves(p), s, batch)
  # The BatchNorm statistics (the state writes) are the full batch's.
  from jaxhybrid.graph import shard

  state_batch = jax.tree.leaves(s) + jax.tree.leaves(batch)
  want = jex.core.jaxpr_as_fun(g.closed_jaxpr)(*jax.tree.leaves(p), *state_batch)[1:]
  got = jex.core.jaxpr_as_fun(g2.closed_jaxpr)(
    *shard.split_leaves(g2, jax.tree.leaves(p)), *state_batch)[1:]
  assert len(want) == 2
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("fn,why", [
  (lambda p, b: jnp.sum(b["x"] - jnp.mean(b["x"], axis=0, keepdims=True)) * p["w"],
   "reduces over the examples"),
  (lambda p, b: jnp.sum(jnp.cumsum(b["x"] * p["w"], axis=0) ** 2), "accumulates along"),
  (lambda p, b: jnp.sum(jnp.sort(b["x"] * p["w"], axis=0)[:1]), "sorts along the examples"),
  (lambda p, b: jnp.sum((b["x"] * p["w"])[::-1][:2]), "reverses the examples"),
  (lambda p, b: jnp.sum(jnp.swapaxes(b["x"] * p["w"], 0, 1).reshape(-1)[:3]),
   "merges the examples behind another axis"),
  (lambda p, b: jnp.sum(b["x"] * p["w"] + jax.random.normal(jax.random.key(0), b["x"].shape)),
   "random"),
])
def test_equations_that_mix_examples_stay_whole_in_the_post_node(fn, why):
  x = jnp.arange(24.0).reshape(8, 3)

  def loss(p, s, b):
    del s
    return fn(p, b)

  p, b = {"w": jnp.full((), 1.5)}, {"x": x}
  g = graph_lib.trace_function(loss, p, {}, b, max_nodes=1)
  small = batch_split.trace_small(loss, p, {}, b, [True], 2)
  reasons = " ".join(batch_split.mixing(g, small, 2)[g.nodes[0].name])
  assert why in reasons, reasons
  g2, report = batch_split.split_batch(g, small, 2)
  if report.splits:  # the row-wise prefix runs in pieces, the rest whole: same loss
    np.testing.assert_allclose(_run(g2, [p["w"]], {}, b), _run(g, [p["w"]], {}, b), rtol=1e-6)
  else:
    assert "its first equations mix examples" in report.skipped[0][1]


def test_a_constant_that_depends_on_the_batch_size_is_left_to_the_post_node():
  # mean over rows is sum * (1/N): the literal 1/N differs at 1/M of the batch.
  def loss(p, s, b):
    del s
    h = jnp.tanh(b["x"] @ p["w"])
    return jnp.mean(h) + jnp.sum(jnp.full((b["x"].shape[0],), 1.0 / b["x"].shape[0]) * h[:, 0])

  p, b = {"w": jnp.ones((3, 4))}, {"x": jnp.arange(24.0).reshape(8, 3) / 24}
  g = graph_lib.trace_function(loss, p, {}, b, max_nodes=1)
  small = batch_split.trace_small(loss, p, {}, b, [True], 2)
  g2, report = batch_split.split_batch(g, small, 2)
  assert len(report.splits) == 1
  np.testing.assert_allclose(_run(g2, [p["w"]], {}, b), _run(g, [p["w"]], {}, b), rtol=1e-6)
  g_ = jax.grad(lambda w: _run(g, [w], {}, b))(p["w"])
  g2_ = jax.grad(lambda w: _run(g2, [w], {}, b))(p["w"])
  np.testing.assert_allclose(g2_, g_, rtol=1e-6)


def test_an_input_only_the_post_node_reads_is_not_sent_to_the_pieces():
  # z is added after the mean over the examples: only the post node reads it.
  def loss(p, s, b):
    del s
    h = jnp.tanh(b["x"] @ p["w"])
    return jnp.mean((h - jnp.mean(h, axis=0) + b["z"]) ** 2)

  r = np.random.default_rng(0)
  p = {"w": jnp.asarray(r.normal(size=(3, 4)), jnp.float32)}
  b = {"x": jnp.asarray(r.normal(size=(8, 3)), jnp.float32),
       "z": jnp.asarray(r.normal(size=(8, 4)), jnp.float32)}
  g = graph_lib.trace_function(loss, p, {}, b, max_nodes=1)
  small = batch_split.trace_small(loss, p, {}, b, [True, True], 2)
  g2, report = batch_split.split_batch(g, small, 2)
  (split,) = report.splits
  z = next(v for v, (kind, _) in zip(g.jaxpr.invars, g.input_kinds) if kind == graph_lib.BATCH
           and v.aval.shape == (8, 4))
  pieces = [n for n in g2.nodes if n.name in split.piece_nodes]
  assert pieces and not any(z in n.invars for n in pieces)
  assert z in next(n for n in g2.nodes if n.name == split.node).invars
  _assert_same_loss_and_grads(g, g2, [p["w"]], {}, b)


def test_bad_requests_are_one_line_errors():
  model, batch = toy.LSTMNet(rngs=nnx.Rngs(0)), toy.lstm_batch(6)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss)
  spec, per_example = microbatch_spec(batch, 6, 6)
  with pytest.raises(ValueError, match="does not split over 4 devices"):
    batch_split.trace_small(pure, p, s, spec, per_example, 4)
  g, small, _ = _traced(pure, p, s, batch, 2)
  with pytest.raises(ValueError, match="needs >= 2 devices"):
    batch_split.split_batch(g, small, 1)
  with pytest.raises(ValueError, match=r"no node named \['nope'\]"):
    batch_split.split_batch(g, small, 2, ["nope"])
  g2, _ = batch_split.split_batch(g, small, 2, ["l0"])
  with pytest.raises(ValueError, match="before any other split"):
    batch_split.split_batch(g2, small, 2)

  def loss(p, s, b):
    del s
    return jnp.sum(b["x"] - jnp.mean(b["x"], axis=0)) * p["w"]

  pw, bx = {"w": jnp.ones(())}, {"x": jnp.ones((4, 2))}
  gm = graph_lib.trace_function(loss, pw, {}, bx, max_nodes=1)
  sm = batch_split.trace_small(loss, pw, {}, bx, [True], 2)
  name = gm.nodes[0].name
  with pytest.raises(ValueError, match=f"cannot split the batch of node {name}: its first"):
    batch_split.split_batch(gm, sm, 2, [name])


# Inception-V3's case (44 s, two value-and-grad compiles of its whole graph) under the slow
# marker: the default run covers a convolution with BatchNorm split by rows (ConvBN above).
@pytest.mark.parametrize("name,params", [
  ("biglstm", "replicated"), ("gnmt", "replicated"),
  pytest.param("inception_v3", "replicated", marks=pytest.mark.slow), ("gnmt", "split"),
])
def test_tiny_paper_models_split_by_rows_keep_loss_and_gradients(name, params):
  # Inception-V3's BatchNorm with epsilon 1 (as program_models_test: the default's curvature
  # makes float32 rounding, not the split, the difference)
  spec = models.get(name, "tiny", **({"bn_epsilon": 1.0} if name == "inception_v3" else {}))
  model = spec.init(0)
  batch = spec.synthetic_batch(0, 4)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn, with_state=True)
  g, small, _ = _traced(pure, p, s, batch, 2)
  g2, report = batch_split.split_batch(g, small, 2, params=params)
  # Every node with row-wise work splits (BatchNorm and the mean loss run in post nodes).
  assert len(report.splits) >= len(g.nodes) // 2, report.skipped
  stored = sum(len(x.split_params) for x in report.splits)
  assert stored > 0 if params == "split" else stored == 0
  _assert_same_loss_and_grads(g, g2, jax.tree.leaves(p), s, batch)


def _pieces_spread(g, M):
  """Piece d (and parameter holder d) of every split node on device d; other nodes on device 0."""
  import re

  out = []
  for n in g.nodes:
    m = re.search(r"/(batch|params)(\d+)$", n.name)
    out.append(int(m.group(2)) % M if m else 0)
  return out


@pytest.mark.parametrize("mesh_spec,k,schedule,zero,params", [
  ("1x2", 2, "1f1b", 0, "replicated"), ("2x2", 1, "zb", 0, "replicated"),
  ("1x4", 1, "gpipe", 0, "replicated"),
  ("2x2", 2, "1f1b", 1, "replicated"),  # the optimizer state sharded over 'data' too
  ("1x4", 2, "gpipe", 0, "split"), ("2x2", 2, "1f1b", 1, "split"), ("2x2", 1, "zb", 0, "split"),
  # four replicas; gradients reduce-scattered over 'data' as they leave their groups (ZeRO 2)
  ("4x2", 1, "1f1b", 2, "split"), ("4x2", 2, "gpipe", 0, "replicated"),
])
def test_program_runs_split_nodes_on_every_device_exactly(mesh_spec, k, schedule, zero, params):
  model, batch = toy.LSTMNet(rngs=nnx.Rngs(1)), toy.lstm_batch(16, seed=2)
  opt = optax.adam(1e-2)
  m = mesh_lib.make(mesh_spec)
  M, data = m.shape["model"], m.shape["data"]
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss)
  g, small, per_example = _traced(pure, p, s, batch, M, micro=16 // (data * k))
  g, report = batch_split.split_batch(g, small, M, ["l0", "l1"], params=params)
  prog = program_lib.HybridProgram.build(
    g, m, opt, _pieces_spread(g, M), microbatches=k, state=s, per_example=per_example,
    schedule=schedule, zero=zero)
  if params == "replicated":
    # The layers' weights are read on every device: replicated, their gradients summed.
    assert prog.layout.shared
  else:
    # Nothing is replicated and no device stores every leaf: the layers' are in slices.
    assert not prog.layout.shared
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(p))
    assert max(prog.layout.bytes_per_device()) < total
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_a_plan_with_nodes_split_by_rows_round_trips_and_trains_exactly():
  """The plan records its splits (schema 5 and later); `parallelize(plan=...)` re-applies them to a fresh
  trace and trains as the single-device reference does."""
  import dataclasses

  from conftest import LIGHT_DETERMINISTIC_PLANNER

  from jaxhybrid import api
  from jaxhybrid import planner as planner_lib

  model, batch = toy.LSTMNet(rngs=nnx.Rngs(3)), toy.lstm_batch(16, seed=4)
  opt = optax.adam(1e-2)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss, with_state=True)
  g, small, _ = _traced(pure, p, s, batch, 2, micro=8)
  g2, report = batch_split.split_batch(g, small, 2, ["l0", "l1"])
  plan = planner_lib.place(g2, api.default_costs("cpu"), devices=2, microbatches=2,
                           **LIGHT_DETERMINISTIC_PLANNER)
  plan = dataclasses.replace(plan, assignment=tuple(_pieces_spread(g2, 2)), task_schedule="1f1b",
                             batch_splits=tuple(x.to_json() for x in report.splits))
  loaded = planner_lib.Plan.from_json(plan.to_json())
  assert loaded.schema_version == planner_lib.SCHEMA_VERSION and loaded.batch_splits == plan.batch_splits
  assert "node l0: batch split, rows over 2 devices (pieces on [0, 1])" in loaded.summary()
  # Older plans load with no node split.
  old = {k: v for k, v in plan.to_dict().items() if k != "batch_splits"} | {"schema_version": 4}
  assert planner_lib.Plan.from_dict(old).batch_splits == ()
  # A plan for other splits is a one-line error.
  with pytest.raises(ValueError, match="re-plan"):
    batch_split.apply(g, small, 2, [dict(report.splits[0].to_json(), bounds=[0, 3, 8])])
  hy = api.parallelize(model, toy.lstm_loss, opt, batch, mesh="1x2", microbatches=2, plan=loaded)
  assert [n.name for n in hy.graph.nodes] == [n.name for n in g2.nodes]
  _assert_trains_as_reference(hy, pure, p, s, batch, opt)


def _assert_trains_as_reference(hy, pure, p, s, batch, opt, steps=3):
  """`hy` trained `steps` steps: losses and parameters equal the single-device reference's."""
  state = hy.init()
  losses = []
  for _ in range(steps):
    state, metrics = hy.step(state, batch)
    losses.append(float(metrics["loss"]))
  ref = jax.jit(jax.value_and_grad(lambda p_, b_: pure(p_, s, b_)[0]))
  params, o = p, opt.init(p)
  for i in range(steps):
    loss, grads = ref(params, batch)
    np.testing.assert_allclose(losses[i], loss, rtol=1e-5)
    u, o = opt.update(grads, o, params)
    params = optax.apply_updates(params, u)
  for a, b in zip(hy.program.unpack(state.params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices", [2, 4])
def test_parameters_stored_in_slices_keep_loss_and_gradients(devices):
  """params='split': each split node's leaves are cut into M slices, one per holder node; the
  pieces gather them (FSDP inside the node) and the loss and gradients stay exact."""
  from jaxhybrid.graph import shard

  model, batch = toy.LSTMNet(rngs=nnx.Rngs(0)), toy.lstm_batch(8)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss)
  g, small, _ = _traced(pure, p, s, batch, devices)
  g2, report = batch_split.split_batch(g, small, devices, ["l0", "out"], params="split")
  leaves = jax.tree.leaves(p)
  by_name = {n.name: n for n in g2.nodes}
  for x in report.splits:
    assert x.split_params and len(x.param_nodes) == devices
    # Holder j owns slice j of every stored leaf, and no other node reads a parameter of it.
    for j, h in enumerate(x.param_nodes):
      held = [g2.param_paths[i] for i in by_name[h].param_leaves]
      assert len(held) == len(x.split_params)
      assert all(path.startswith(tuple(x.split_params)) for path in held)
    for name in x.piece_nodes + (x.node,):
      assert not set(by_name[name].param_leaves) & {
        i for h in x.param_nodes for i in by_name[h].param_leaves}
  # The slices tile each user leaf: cutting and joining gives the leaves back.
  back = shard.join_leaves(g2, shard.split_leaves(g2, leaves))
  assert all(np.array_equal(a, b) for a, b in zip(back, leaves))
  _assert_same_loss_and_grads(g, g2, leaves, s, batch)
  # A node whose parameters another node also reads keeps them replicated: here none is shared,
  # so every parameter of the split nodes is stored in slices.
  assert sum(len(x.split_params) for x in report.splits) == sum(
    1 for path in g.param_paths if path.startswith(("['l0']", "['out']")))


def test_a_split_with_parameters_in_slices_round_trips_through_the_plan():
  import dataclasses

  from jaxhybrid import planner as planner_lib

  model, batch = toy.LSTMNet(rngs=nnx.Rngs(3)), toy.lstm_batch(8, seed=4)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.lstm_loss, with_state=True)
  g, small, _ = _traced(pure, p, s, batch, 2)
  g2, report = batch_split.split_batch(g, small, 2, ["l1"], params="split")
  saved = [batch_split.NodeSplit.from_json(x.to_json()) for x in report.splits]
  assert saved == list(report.splits)
  again = batch_split.apply(g, small, 2, [x.to_json() for x in report.splits])
  assert [n.name for n in again.nodes] == [n.name for n in g2.nodes]
  assert again.param_paths == g2.param_paths and again.param_split == g2.param_split
  from conftest import LIGHT_DETERMINISTIC_PLANNER

  from jaxhybrid import api

  plan = planner_lib.place(g2, api.default_costs("cpu"), devices=2, microbatches=1,
                           **LIGHT_DETERMINISTIC_PLANNER)
  plan = dataclasses.replace(plan, assignment=tuple(_pieces_spread(g2, 2)), task_schedule="1f1b",
                             batch_splits=tuple(x.to_json() for x in report.splits))
  loaded = planner_lib.Plan.from_json(plan.to_json())
  assert loaded.batch_splits == plan.batch_splits
  assert "3 parameter leaves in 2 slices on devices [0, 1]" in loaded.summary()
  # The same split with the parameters replicated is another graph: a one-line error.
  with pytest.raises(ValueError, match="re-plan"):
    batch_split.apply(g, small, 2, [dataclasses.replace(report.splits[0], split_params=(
      report.splits[0].split_params[0],))])
  # `parallelize(plan=...)` cuts the user's leaves into the slices and trains exactly.
  opt = optax.adam(1e-2)
  hy = api.parallelize(model, toy.lstm_loss, opt, batch, mesh="1x2", microbatches=1, plan=loaded)
  assert hy.graph.param_paths == g2.param_paths
  _assert_trains_as_reference(hy, pure, p, s, batch, opt, steps=2)


def test_planner_options_take_the_batch_rule():
  from jaxhybrid import planner as planner_lib

  opts = planner_lib.PlannerOptions(shard_rules=("batch",), batch_split_min_fraction=0.2)
  assert opts.shard_rules == ("batch",)
  assert opts.batch_split_params == "replicated"
  with pytest.raises(ValueError, match="batch_split_params"):
    planner_lib.PlannerOptions(batch_split_params="sharded")
  with pytest.raises(ValueError, match="use some of lookup, column, batch"):
    planner_lib.PlannerOptions(shard_rules=("rows",))
  with pytest.raises(ValueError, match="batch_split_min_fraction"):
    planner_lib.PlannerOptions(batch_split_min_fraction=1.5)


def test_linen_modules_split_by_rows_keep_loss_and_gradients():
  model = toy.LinenTowers(width=16)
  batch = toy.regression_batch(8)
  params = model.init(jax.random.key(0), batch["x"])["params"]

  def loss(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  g = graph_lib.trace(model, loss, batch, params=params)
  small = batch_split.trace_small(lambda p_, s_, b_: loss(p_, b_), params, {}, batch,
                                  [True, True], 2)
  g2, report = batch_split.split_batch(g, small, 2)
  assert {"a/l1", "a/l2", "b/l1", "b/l2"} <= {x.node for x in report.splits}, report
  _assert_same_loss_and_grads(g, g2, jax.tree.leaves(params), {}, batch)
