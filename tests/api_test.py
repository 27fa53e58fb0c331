"""parallelize on user-style models: the graph keeps their parallelism, the API its promises.

The models are written here as a new user would write them (not the paper's models). Plans are
made with analytic DGX-1 V100 costs and exact planners (k = 1: the MILP's block decomposition is
exact; pipelines: the pipeline DP), so the asserted speedups are optima, not search luck.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DETERMINISTIC_PLANNER
from flax import linen as nn
from flax import nnx

from jaxhybrid import api
from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid.costs import hardware

V100 = costs_lib.AnalyticCostModel(hardware.get("dgx1-v100"))


class MLP(nnx.Module):
  """d -> 4d -> d, the usual transformer feed-forward block."""

  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


class TwoTowers(nnx.Module):
  """head(concat([left(h), right(h)])): the concat is glue at the top level."""

  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.left = MLP(d, rngs=rngs)
    self.right = MLP(d, rngs=rngs)
    self.head = nnx.Linear(2 * d, 1, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(x)
    return self.head(jnp.concatenate([self.left(h), self.right(h)], axis=-1))


class Body(nnx.Module):
  def __init__(self, d: int, layers: int, *, rngs: nnx.Rngs):
    self.layers = nnx.List([MLP(d, rngs=rngs) for _ in range(layers)])

  def __call__(self, x):
    for layer in self.layers:
      x = x + layer(x)  # residual glue between the list's layers
    return x


class Deep(nnx.Module):
  """An 8-layer nnx.List under `body`, then a head."""

  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.body = Body(d, 8, rngs=rngs)
    self.head = nnx.Linear(d, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.body(x))


class TiedLM(nnx.Module):
  """Embedding, a hidden layer, and the embedding's `attend` as the output layer."""

  def __init__(self, vocab: int, d: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.hidden = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(jnp.tanh(self.hidden(self.embed(tokens))))


def mse(model, batch):
  return jnp.mean((model(batch["x"])[..., 0] - batch["y"]) ** 2)


def lm_loss(model, batch):
  logits = model(batch["x"])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def regression_batch(n: int, d: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "x": rng.normal(size=(n, d)).astype(np.float32),
    "y": rng.normal(size=(n,)).astype(np.float32),
  }


def token_batch(n: int, t: int, vocab: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(1)
  return {
    "x": rng.integers(0, vocab, (n, t)).astype(np.int32),
    "y": rng.integers(0, vocab, (n, t)).astype(np.int32),
  }


def _node(g, name):
  return next(n for n in g.nodes if n.name == name)


def _reaches(g, src: int, dst: int) -> bool:
  succ: dict[int, list[int]] = {}
  for e in g.edges:
    succ.setdefault(e.src, []).append(e.dst)
  todo, seen = [src], set()
  while todo:
    n = todo.pop()
    if n == dst:
      return True
    if n not in seen:
      seen.add(n)
      todo.extend(succ.get(n, []))
  return False


# ---- the graph keeps the model's parallelism ---------------------------------------------------


def test_concat_glue_adds_no_edge_between_towers():
  model = nnx.eval_shape(lambda: TwoTowers(16, rngs=nnx.Rngs(0)))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), regression_batch(8, 16))
  towers = ["left/up", "left/down", "right/up", "right/down"]
  for kw, names in (
    ({}, towers), ({"depth": 1}, ["left", "right"]), ({"depth": 2}, towers),
    ({"depth": 3}, towers),  # a module without sub-scopes (head) is a node at any depth
  ):
    g = graph_lib.trace(model, mse, batch, **kw)
    # tanh(x) feeds both towers: a small node of its own.
    assert [n.name for n in g.nodes] == ["<root>", *names, "head"]
    left = [n.id for n in g.nodes if n.name.split("/")[0] == "left"]
    right = [n.id for n in g.nodes if n.name.split("/")[0] == "right"]
    head = _node(g, "head")
    assert left and right
    for a in left:
      for b in right:
        assert not _reaches(g, a, b) and not _reaches(g, b, a)
    assert _reaches(g, left[-1], head.id) and _reaches(g, right[-1], head.id)
    # The concat joins its consumer (the head); the loss joins its producer (the head).
    prims = [e.primitive.name for e in head.eqns]
    assert "concatenate" in prims and "reduce_sum" in prims


def test_two_towers_plan_on_two_devices_at_one_microbatch():
  model = TwoTowers(512, rngs=nnx.Rngs(0))
  hy = api.parallelize(
    model, mse, optax.sgd(0.1), regression_batch(256, 512), mesh="1x2", microbatches=1,
    costs=V100, planner="milp", planner_options=DETERMINISTIC_PLANNER,
  )
  g, plan = hy.graph, hy.plan
  assert plan.status == "optimal"  # k = 1: the block decomposition is exact
  side = {n.name.split("/")[0]: plan.assignment[n.id] for n in g.nodes}
  assert side["left"] != side["right"]
  left = {plan.assignment[n.id] for n in g.nodes if n.name.startswith("left")}
  right = {plan.assignment[n.id] for n in g.nodes if n.name.startswith("right")}
  assert len(left) == len(right) == 1 and left != right
  assert plan.predicted_speedup > 1.3
  assert hy.check is not None and not hy.check.fell_back and hy.check.speedup > 1.3


def test_layer_list_is_one_node_per_layer_and_pipelines():
  model = Deep(256, rngs=nnx.Rngs(0))
  hy = api.parallelize(
    model, mse, optax.sgd(0.1), regression_batch(512, 256), mesh="1x4", microbatches=4,
    costs=V100, planner="dp",
  )
  # Every layer has its own node(s) (the target may cut a layer further, never join two).
  body = [n.name.split("/") for n in hy.graph.nodes if n.name.startswith("body/")]
  assert all(p[:2] == ["body", "layers"] and len(p) >= 3 for p in body)
  assert [p[2] for p in body] == sorted((p[2] for p in body), key=int)
  assert {p[2] for p in body} == {str(i) for i in range(8)}
  assert len(set(hy.plan.assignment)) == 4
  assert hy.plan.predicted_speedup > 1.5
  assert hy.check is not None and not hy.check.fell_back and hy.check.speedup > 1.5


def test_max_nodes_bounds_the_refined_graph():
  model = nnx.eval_shape(lambda: Deep(16, rngs=nnx.Rngs(0)))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), regression_batch(8, 16))
  full = graph_lib.trace(model, mse, batch)
  for target in (1, 3, 5, 9):
    g = graph_lib.trace(model, mse, batch, max_nodes=target)
    assert len(g.nodes) <= target
    assert all(e.src < e.dst for e in g.edges)
    assert g.total_flops == pytest.approx(full.total_flops)


def test_linen_sequential_and_attend_get_their_own_nodes():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1, name="head")(nn.Sequential([nn.Dense(8) for _ in range(4)])(x))

  class Tied(nn.Module):
    def setup(self):
      self.embed = nn.Embed(20, 8)
      self.hidden = nn.Dense(8)

    def __call__(self, tokens):
      return self.embed.attend(jnp.tanh(self.hidden(self.embed(tokens))))

  for model, x, names in (
    (Net(), jnp.ones((4, 8)), [f"Sequential_0/Dense_{i}" for i in range(4)] + ["head"]),
    (Tied(), jnp.ones((4, 3), jnp.int32), ["embed", "hidden", "embed.attend"]),
  ):
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    loss = lambda p, b, model=model: jnp.mean(model.apply({"params": p}, b))  # noqa: E731
    g = graph_lib.trace(model, loss, x, params=params)
    assert [n.name for n in g.nodes] == names


def test_tied_embedding_attend_owns_a_node_and_matches_reference():
  vocab, d, k = 24, 8, 2
  model = TiedLM(vocab, d, rngs=nnx.Rngs(0))
  batch = token_batch(8, 3, vocab)
  g = graph_lib.trace(model, lm_loss, jax.tree.map(jnp.asarray, batch))
  names = [n.name for n in g.nodes]
  assert "embed" in names and "embed.attend" in names
  emb, att = _node(g, "embed"), _node(g, "embed.attend")
  assert set(emb.param_leaves) & set(att.param_leaves)  # the shared table
  # Place the two uses on different devices with a hand-made plan (every node on device 0,
  # the attend on device 1) and check loss and parameters against plain JAX after 3 steps.
  first = api.parallelize(
    model, lm_loss, optax.adam(1e-2), batch, mesh="2x2", microbatches=k, costs=V100,
    planner="single",
  )
  assignment = tuple(1 if n.name == "embed.attend" else 0 for n in first.graph.nodes)
  # (a new assignment needs a new task schedule: drop the recorded one, the program generates it)
  plan = dataclasses.replace(first.plan, assignment=assignment, task_schedule="")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # a 2-node split of a toy model may price below one device
    hy = api.parallelize(
      model, lm_loss, optax.adam(1e-2), batch, mesh="2x2", microbatches=k, costs=V100,
      plan=plan,
    )
  assert hy.plan.assignment[_node(hy.graph, "embed").id] == 0
  assert hy.plan.assignment[_node(hy.graph, "embed.attend").id] == 1
  state = hy.init()
  losses = []
  for _ in range(3):
    state, metrics = hy.step(state, batch)
    losses.append(float(metrics["loss"]))
  opt = optax.adam(1e-2)
  _, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(jnp.asarray, params)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)

  def ref_loss(p, b):
    return lm_loss(nnx.merge(graphdef, p, rest), b)

  opt_state, ref = opt.init(params), []
  for _ in range(3):
    loss, grads = jax.value_and_grad(ref_loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    ref.append(float(loss))
  np.testing.assert_allclose(losses, ref, rtol=1e-5)
  got = jax.tree.leaves(hy.params(state))
  for a, b in zip(got, jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- a plan slower than one device is not handed back silently --------------------------------


def _chain_graph_and_bad_plan():
  model = Deep(8, rngs=nnx.Rngs(0))
  batch = regression_batch(4096, 8)  # large activations, tiny layers: transfers dominate
  single = api.parallelize(
    model, mse, optax.sgd(0.1), batch, mesh="1x2", microbatches=1, costs=V100, planner="single",
  )
  alternating = tuple(i % 2 for i in range(len(single.graph.nodes)))
  return model, batch, single, dataclasses.replace(single.plan, assignment=alternating, task_schedule="")


def test_slower_plan_falls_back_to_one_device_with_a_warning():
  _, _, single, bad = _chain_graph_and_bad_plan()
  with pytest.warns(UserWarning, match=r"slower than one device") as record:
    plan, check = api._check_plan(single.graph, bad, V100, 2, 1, {}, fall_back=True)
  assert "\n" not in str(record[0].message)
  assert set(plan.assignment) == {0}
  assert check.fell_back and check.plan_step_s > check.single_step_s > 0
  assert check.planned is bad


def test_given_slower_plan_is_kept_with_a_warning():
  model, batch, _, bad = _chain_graph_and_bad_plan()
  with pytest.warns(UserWarning, match=r"keeping the given plan"):
    hy = api.parallelize(
      model, mse, optax.sgd(0.1), batch, mesh="1x2", microbatches=1, costs=V100, plan=bad,
    )
  assert hy.plan.assignment == bad.assignment
  assert not hy.check.fell_back and hy.check.speedup < 1


# ---- one-line errors -------------------------------------------------------------------------


def _one_line(excinfo) -> str:
  text = str(excinfo.value)
  assert "\n" not in text, text
  return text


@pytest.fixture(scope="module")
def small_hybrid():
  model = TwoTowers(8, rngs=nnx.Rngs(0))
  batch = regression_batch(8, 8)
  return model, batch, api.parallelize(
    model, mse, optax.sgd(0.1), batch, mesh="2x2", microbatches=2, costs=V100, planner="dp",
  )


def test_params_with_an_nnx_model_raises(small_hybrid):
  model, batch, _ = small_hybrid
  with pytest.raises(ValueError, match="params= is for linen") as e:
    api.parallelize(model, mse, optax.sgd(0.1), batch, mesh="1x2", params={"w": 1.0})
  _one_line(e)


def test_init_with_a_seed_raises(small_hybrid):
  _, _, hy = small_hybrid
  with pytest.raises(ValueError, match=r"init\(seed=3\)") as e:
    hy.init(3)
  _one_line(e)


@pytest.mark.parametrize("rows,width", [(16, 8), (12, 8), (8, 9)])
def test_batch_of_another_shape_is_one_line(small_hybrid, rows, width):
  _, _, hy = small_hybrid
  bad = regression_batch(rows, width)
  if rows != 8:
    bad["y"] = bad["y"][:rows]
  with pytest.raises(ValueError, match=r"compiled for global batch 8 with per-example leaves") as e:
    hy.step(hy.init(), bad)
  text = _one_line(e)
  assert f"got ['x'][{rows}, {width}]" in text


def test_step_donates_the_state(small_hybrid):
  _, batch, hy = small_hybrid
  state = hy.init()
  new, _ = hy.step(state, batch)
  assert int(new.step) == 1
  assert any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
  # Reusing it is one line (XLA itself would abort the process on the deleted buffers).
  with pytest.raises(ValueError, match="donated to an earlier step") as e:
    hy.step(state, batch)
  _one_line(e)
  new, _ = hy.step(new, batch)
  assert int(new.step) == 2


def test_batch_missing_a_leaf_names_the_leaves_the_loss_reads(small_hybrid):
  _, batch, hy = small_hybrid
  with pytest.raises(ValueError, match=r"reads 2 \(\['x'\], \['y'\]\)") as e:
    hy.step(hy.init(), {"x": batch["x"]})
  _one_line(e)


def test_plan_carries_the_one_device_reference_of_the_whole_batch(tmp_path):
  model = TwoTowers(8, rngs=nnx.Rngs(0))
  batch = regression_batch(8, 8)
  hy = api.parallelize(model, mse, optax.sgd(0.1), batch, mesh="1x2", microbatches=2, costs=V100,
                       planner="dp")
  # The reference is one device on the whole batch in ONE pass, not the k micro-batches.
  _, p, s, pure = graph_lib.nnx_pure_loss(model, mse)
  g_whole = graph_lib.trace_function(pure, p, s, api.microbatch_spec(batch, 8, 8)[0])
  plan = hy.plan
  assert plan.reference_source == "node sum"
  assert plan.reference_step_s == pytest.approx(V100.step_time_s(g_whole), rel=1e-12)
  assert plan.reference_step_s < plan.single_device_s  # k passes pay the per-op costs k times
  assert plan.reference_speedup == pytest.approx(plan.reference_step_s / plan.lockstep_step_s)
  assert "over one device's plain step (" in plan.summary() and "node sum)" in plan.summary()
  # One prediction and one speedup, the price the planner minimised; the fused model's makespan
  # is labelled as the search's warm start.
  text = plan.summary()
  assert text.count("predicted") == 1 and text.count("speedup") == 1, text
  assert f"predicted step {plan.lockstep_step_s * 1e3:.3f} ms" in text
  again = type(plan).from_json(plan.to_json())
  assert (again.reference_step_s, again.reference_source) == (plan.reference_step_s, "node sum")
  # A plan slower than the plain step but faster than one device running its micro-batches
  # (the fall-back's comparison) says both, and what could beat the plain step.
  slow = dataclasses.replace(plan, reference_step_s=0.5 * plan.lockstep_step_s)
  text = slow.summary()
  assert "speedup 0.500x over one device's plain step" in text
  assert (f"{slow.lockstep_speedup:.3f}x over one device running the same 2 micro-batches "
          f"({slow.single_device_s * 1e3:.3f} ms)") in text
  assert text.count("predicted") == 1 and text.count("speedup") == 1, text
  fast = dataclasses.replace(plan, reference_step_s=2.0 * plan.lockstep_step_s)
  assert "slower than the plain step" not in fast.summary()
  # A cost model that times the traced loss whole is asked for that (cached: the same figure).
  g_micro = graph_lib.trace_function(pure, p, s, api.microbatch_spec(batch, 8, 4)[0])
  cm = costs_lib.ProfiledCostModel(g_micro, cache_dir=tmp_path, repeats=1, warmup=1)
  hy = api.parallelize(model, mse, optax.sgd(0.1), batch, mesh="1x2", microbatches=2, costs=cm,
                       planner="dp")
  assert hy.plan.reference_source == "whole-step profile"
  assert hy.plan.reference_step_s == cm.whole_step_time_s(g_whole) >= 0.0



def test_planner_counts_the_optimizers_own_state():
  """`parallelize` tells the planner its optimizer's state bytes per parameter byte."""
  from jaxhybrid.api import optimizer_state_factor

  g = graph_lib.trace_function(
    lambda p, s, b: jnp.sum(jnp.tanh(b["x"] @ p["w"]) * p["v"]),
    {"w": jnp.zeros((4, 3)), "v": jnp.zeros((3,), jnp.bfloat16)}, {}, {"x": jnp.zeros((2, 4))})
  assert optimizer_state_factor(optax.adam(1e-3), g) == pytest.approx(2.0, abs=0.1)  # + a count
  assert optimizer_state_factor(optax.adagrad(0.1), g) == pytest.approx(1.0)
  assert optimizer_state_factor(optax.sgd(0.1), g) == 0.0
