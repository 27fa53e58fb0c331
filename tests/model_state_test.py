"""Model state the loss writes (BatchNorm running averages, RNG counters) carried step to step.

The hybrid step averages a floating-point write over its micro-batches and data replicas (as
data-parallel training averages BatchNorm statistics) and takes any other write from the last
micro-batch; the references below run the NNX model itself on each (replica, micro-batch) chunk.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxhybrid import api
from jaxhybrid import costs as costs_lib
from jaxhybrid import graph as graph_lib
from jaxhybrid.costs import hardware
from jaxhybrid.train import checkpoint

V100 = costs_lib.AnalyticCostModel(hardware.get("dgx1-v100"))
D, ROWS = 8, 16


class NormNet(nnx.Module):
  """Linear, BatchNorm, ReLU, Linear, BatchNorm, Dropout, Linear."""

  def __init__(self, *, rngs: nnx.Rngs, rate: float = 0.0):
    self.a = nnx.Linear(D, 2 * D, rngs=rngs)
    self.bn_a = nnx.BatchNorm(2 * D, rngs=rngs)
    self.b = nnx.Linear(2 * D, D, rngs=rngs)
    self.bn_b = nnx.BatchNorm(D, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.out = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.bn_a(self.a(x)))
    return self.out(self.drop(self.bn_b(self.b(h))))


def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batch(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  # Off-centre, wide inputs: the running averages move far from their initial 0 / 1.
  return {"x": (3 * rng.normal(size=(ROWS, D)) + 2).astype(np.float32),
          "y": rng.normal(size=(ROWS, D)).astype(np.float32)}


def reference_stats(model: NormNet, batch, chunks: int):
  """The BatchNorm statistics after one step: each chunk of rows runs the model from the same
  state, and the chunks' new statistics are averaged."""
  rows = ROWS // chunks
  news = []
  for i in range(chunks):
    m = nnx.clone(model)
    mse(m, {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()})
    news.append(nnx.state(m, nnx.BatchStat))
  return jax.tree.map(lambda *xs: sum(xs) / chunks, *news)


def assert_stats_close(got, want):
  assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)) > 0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def stats_of(hy, ts):
  return nnx.filter_state(hy.model_state(ts), nnx.BatchStat)


def plain(x):
  """An array numpy can compare (a PRNG key as its data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def on_device(tree):
  return jax.tree.map(jnp.asarray, tree)


@pytest.mark.parametrize("mesh,k", [("1x1", 1), ("1x2", 2), ("2x2", 2)])
def test_batchnorm_statistics_are_the_mean_over_microbatches_and_replicas(mesh, k):
  model = NormNet(rngs=nnx.Rngs(0))
  batch = make_batch(0)
  hy = api.parallelize(model, mse, optax.sgd(0.05), batch, mesh=mesh, microbatches=k,
                       costs=V100, planner="dp" if mesh != "1x1" else "single")
  if mesh != "1x1":
    assert len(set(hy.plan.assignment)) == 2  # the BatchNorms' nodes are not all on one device
  assert len(hy.graph.state_writes) == 4 and not hy.graph.state_uncarried
  ts = hy.init()
  before = jax.tree.map(np.asarray, stats_of(hy, ts))
  ts, _ = hy.step(ts, batch)
  data = int(mesh.split("x")[0])
  want = reference_stats(model, batch, data * k)
  got = stats_of(hy, ts)
  assert_stats_close(got, want)
  moved = [float(np.max(np.abs(np.asarray(a) - b))) for a, b in
           zip(jax.tree.leaves(got), jax.tree.leaves(before))]
  assert min(moved) > 1e-2, moved  # every statistic moved: the check above is not 0 == 0

  # The next step starts from the carried statistics.
  batch2 = make_batch(1)
  carried = nnx.clone(model)
  nnx.update(carried, on_device(hy.params(ts)), on_device(hy.model_state(ts)))
  ts, _ = hy.step(ts, batch2)
  assert_stats_close(stats_of(hy, ts), reference_stats(carried, batch2, data * k))


def test_a_counter_advances_once_per_step_and_no_warning():
  model = NormNet(rngs=nnx.Rngs(0), rate=0.3)
  batch = make_batch(0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every write is carried: nothing to warn about
    hy = api.parallelize(model, mse, optax.sgd(0.05), batch, mesh="1x2", microbatches=2,
                         costs=V100, planner="dp")
  paths = [hy.graph.state_paths[j] for j in hy.graph.state_writes]
  assert any("count" in p for p in paths), paths
  ts = hy.init()
  count0 = int(np.asarray(hy.model_state(ts)["drop"]["rngs"]["count"].get_value()))
  for _ in range(2):
    ts, m = hy.step(ts, batch)
    assert np.isfinite(float(m["loss"]))
  count = int(np.asarray(hy.model_state(ts)["drop"]["rngs"]["count"].get_value()))
  assert count == count0 + 2


class Carried(nnx.Variable):
  """A non-parameter variable."""


class KeyWriter(nnx.Module):
  """Writes a PRNG key into its state: a write the step cannot average, so it is not carried."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)
    self.key = Carried(jax.random.key(0))

  def __call__(self, x):
    self.key.set_value(jax.random.split(self.key.get_value())[0])
    return self.lin(x)


def test_a_write_that_cannot_be_carried_is_named_in_one_warning():
  batch = make_batch(0)
  with pytest.warns(UserWarning, match="does not carry to the next step") as rec:
    hy = api.parallelize(KeyWriter(rngs=nnx.Rngs(0)), mse, optax.sgd(0.1), batch, mesh="1x1",
                         costs=V100, planner="single")
  msgs = [str(w.message) for w in rec if "does not carry" in str(w.message)]
  assert len(msgs) == 1 and "\n" not in msgs[0] and "key" in msgs[0]
  assert hy.graph.state_writes == ()
  assert len(hy.graph.state_uncarried) == 1 and "key" in hy.graph.state_uncarried[0]
  ts, m = hy.step(hy.init(), batch)  # the step still runs, reading the initial key
  assert np.isfinite(float(m["loss"]))


def test_trace_function_keeps_only_the_leaves_the_loss_changes():
  params = {"w": jnp.ones((3,))}
  state = {"a": jnp.zeros((3,)), "b": jnp.ones((3,)), "n": jnp.zeros((), jnp.int32)}
  batch = {"x": jnp.ones((4, 3))}

  def loss(p, s, b):
    y = b["x"] @ p["w"]
    return jnp.mean(y ** 2), {"a": s["a"] + jnp.mean(b["x"], 0), "b": s["b"], "n": s["n"] + 1}

  g = graph_lib.trace_function(loss, params, state, batch)
  assert [g.state_paths[j] for j in g.state_writes] == ["['a']", "['n']"]
  assert len(g.jaxpr.outvars) == 3 and g.jaxpr.outvars[0].aval.shape == ()
  # A second output that is not the state's structure is a one-line error.
  with pytest.raises(ValueError, match="new_state in the structure of the state input"):
    graph_lib.trace_function(lambda p, s, b: (loss(p, s, b)[0], {"a": s["a"]}), params, state,
                             batch)


def test_checkpoint_keeps_the_model_state(tmp_path):
  model = NormNet(rngs=nnx.Rngs(0))
  batch = make_batch(0)
  hy = api.parallelize(model, mse, optax.sgd(0.05), batch, mesh="1x2", microbatches=2,
                       costs=V100, planner="dp")
  ts, _ = hy.step(hy.init(), batch)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=0)
  ckpt.save(1, ts)
  ckpt.wait()
  restored = ckpt.restore(1, like=hy.init())
  ckpt.close()
  assert len(restored.model_state) == len(ts.model_state) > 0
  for a, b in zip(jax.tree.leaves(hy.model_state(ts)), jax.tree.leaves(hy.model_state(restored))):
    np.testing.assert_array_equal(plain(a), plain(b))
  fresh = jax.tree.leaves(stats_of(hy, hy.init()))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(stats_of(hy, restored)), fresh))


def test_memory_report_lowers_with_the_carried_state():
  hy = api.parallelize(NormNet(rngs=nnx.Rngs(0)), mse, optax.sgd(0.05), make_batch(0),
                       mesh="1x2", microbatches=2, costs=V100, planner="dp")
  rep = hy.memory()
  assert rep.compiled_arguments > 0 and rep.compiled_temp is not None


def test_a_checkpoint_without_model_state_resumes_from_the_initial_state(tmp_path):
  hy = api.parallelize(NormNet(rngs=nnx.Rngs(0)), mse, optax.sgd(0.05), make_batch(0),
                       mesh="1x2", microbatches=2, costs=V100, planner="dp")
  ts, _ = hy.step(hy.init(), make_batch(0))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=0)
  ckpt.save(1, ts._replace(model_state=()))  # as saved before model state was carried
  ckpt.wait()
  restored = ckpt.restore(1, like=hy.init())
  ckpt.close()
  for a, b in zip(jax.tree.leaves(hy.params(ts)), jax.tree.leaves(hy.params(restored))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(stats_of(hy, restored)), jax.tree.leaves(stats_of(hy, hy.init()))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  restored, m = hy.step(restored, make_batch(1))  # and it trains on
  assert np.isfinite(float(m["loss"]))


def test_memory_counts_the_carried_state_in_the_report_and_the_planner():
  with_drop = NormNet(rngs=nnx.Rngs(0), rate=0.3)
  hy = api.parallelize(with_drop, mse, optax.sgd(0.05), make_batch(0), mesh="1x2",
                       microbatches=2, costs=V100, planner="dp")
  state_bytes = sum(x.size * x.dtype.itemsize for x in hy.program.state_leaves)
  assert state_bytes == (2 * 2 * D + 2 * D) * 4 + 4 + 8  # 4 BatchNorm vectors, count, key
  rep = hy.memory(compile=False)
  assert rep.model_state == state_bytes
  assert "model state (carried)" in rep.table()
  from jaxhybrid import planner
  from jaxhybrid.planner.core import graph_reads
  batch = sum(v.aval.size * v.aval.dtype.itemsize for v, (k, _) in
              zip(hy.graph.jaxpr.invars, hy.graph.input_kinds) if k == graph_lib.BATCH)
  assert graph_reads.batch_bytes(hy.graph) == batch + state_bytes
  assert planner.Problem.from_graph(hy.graph, V100, planner.PlannerOptions(devices=2)).held_bytes \
    >= batch + state_bytes
