"""Tests for jaxhybrid.noise_scale and jaxhybrid.projection (stat_eff, steps_to_target)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhybrid import noise_scale
from jaxhybrid.projection import stat_eff, steps_to_target


def test_estimates_hand_computed():
  # |G|^2 = 4, tr(Sigma) = 8: E|G_b|^2 = 4 + 8/b -> 8 at b=2, 5 at b=8.
  g2, tr = noise_scale.noise_scale_estimates(8.0, 5.0, 2, 8)
  assert float(g2) == pytest.approx(4.0)
  assert float(tr) == pytest.approx(8.0)
  assert float(noise_scale.b_simple(g2, tr)) == pytest.approx(2.0)


def test_estimator_is_unbiased_on_synthetic_problem():
  # Per-sample gradients g_i = G + sigma z_i, z ~ N(0, I_d): |G|^2 = 5, tr(Sigma) = d sigma^2 = 80.
  rng = np.random.default_rng(0)
  d, sigma, workers, b, trials = 20, 2.0, 4, 8, 4000
  g_true = np.full(d, 0.5)
  z = rng.standard_normal((trials, workers, b, d))
  worker_grads = g_true + sigma * z.mean(axis=2)  # [trials, workers, d], batch b each
  small = np.mean(np.sum(worker_grads**2, axis=-1), axis=1)  # mean over workers of |g_w|^2
  big = np.sum(worker_grads.mean(axis=1) ** 2, axis=-1)  # |mean over workers|^2, batch W b
  g2, tr = noise_scale.noise_scale_estimates(small, big, b, workers * b)
  g2, tr = np.asarray(g2, np.float64), np.asarray(tr, np.float64)
  for est, truth in ((g2, 5.0), (tr, 80.0)):
    stderr = est.std() / math.sqrt(trials)
    assert abs(est.mean() - truth) < 4 * stderr
    assert est.mean() == pytest.approx(truth, rel=0.05)
  # Smoothed ratio of the averages recovers B_simple = 16 (a ratio of means, not a mean of ratios).
  state = noise_scale.init_noise_scale()
  update = jax.jit(functools.partial(noise_scale.update_noise_scale, decay=0.999))
  for a, c in zip(g2, tr):
    state = update(state, a, c)
  assert float(noise_scale.smoothed_noise_scale(state, 0.999)) == pytest.approx(16.0, rel=0.1)


def test_smoother_debiases_and_counts():
  state = noise_scale.init_noise_scale()
  assert math.isnan(float(noise_scale.smoothed_noise_scale(state)))
  for _ in range(3):
    state = noise_scale.update_noise_scale(state, 2.0, 50.0, decay=0.9)
  assert int(state.count) == 3
  assert float(state.g2) == pytest.approx(2.0 * (1 - 0.9**3))
  assert float(noise_scale.smoothed_noise_scale(state, 0.9)) == pytest.approx(25.0)


def test_data_axis_estimates_in_shard_map():
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(1)
  # Worker w's gradient is split in two shards along 'model' (disjoint parameters).
  grads = rng.standard_normal((4, 2, 3)).astype(np.float32)  # [worker, model shard, params]

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data", "model"), out_specs=P())
  def step(local):
    mean = jax.lax.pmean(local, "data")
    g2, tr = noise_scale.data_axis_estimates(
      {"w": local}, {"w": mean}, per_worker_batch=8, workers=4, model_axis="model"
    )
    return jnp.stack([g2, tr])

  got = np.asarray(jax.jit(step)(grads))
  small = np.mean(np.sum(grads**2, axis=(1, 2)))
  big = np.sum(grads.mean(axis=0) ** 2)
  want = noise_scale.noise_scale_estimates(small, big, 8, 32)
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5)
  with pytest.raises(ValueError, match="workers=1"):
    noise_scale.data_axis_estimates({}, {}, per_worker_batch=8, workers=1)


def test_tree_sq_norm():
  tree = {"a": jnp.ones((2, 3)), "b": [jnp.full((4,), 2.0)]}
  assert float(noise_scale.tree_sq_norm(tree)) == pytest.approx(6 + 16)
  assert float(noise_scale.tree_sq_norm({})) == 0.0


def test_se_curves():
  ns = stat_eff.NoiseScaleSE(b_noise=100.0)
  assert ns.se(400, 100) == pytest.approx(200 / 500)
  assert ns.se(100, 100) == 1.0
  assert stat_eff.PerfectScaling().se(1e6, 1) == 1.0
  m = stat_eff.MeasuredSE(points=((1000, 200), (100, 1000)))
  # Epochs = steps * B: 1e5 at B=100, 2e5 at B=1000 -> SE = 0.5.
  assert m.se(1000, 100) == pytest.approx(0.5)
  assert m.relative_epochs(math.sqrt(1e5)) == pytest.approx(math.sqrt(1000 * 200) * math.sqrt(1e5))
  e = stat_eff.MeasuredSE(points=((64, 10.0), (256, 20.0)), unit="epochs")
  assert e.se(256, 64) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="duplicate"):
    stat_eff.MeasuredSE(points=((64, 1), (64, 2)))
  with pytest.raises(ValueError, match="b_noise"):
    stat_eff.NoiseScaleSE(b_noise=0)


def test_se_from_csv(tmp_path):
  path = tmp_path / "se.csv"
  path.write_text("global_batch,steps\n100,1000\n1000,200\n")
  curve = stat_eff.se_from_csv(str(path))
  assert curve.unit == "steps" and curve.se(1000, 100) == pytest.approx(0.5)
  bad = tmp_path / "bad.csv"
  bad.write_text("batch,time\n1,2\n")
  with pytest.raises(ValueError, match="global_batch"):
    stat_eff.se_from_csv(str(bad))


def test_fit_s_min():
  # Points exactly on steps = 50 (1 + 100 / B).
  pts = [(b, 50 * (1 + 100 / b)) for b in (10, 100, 1000)]
  assert stat_eff.fit_s_min(pts, 100.0) == pytest.approx(50.0)
  with pytest.raises(ValueError):
    stat_eff.fit_s_min([], 100.0)


class _Linear(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    del rngs
    self.w = nnx.Param(jnp.zeros((4,)))


class _LinearSpec:
  """A linear-regression task in the models-spec interface: y = x . w* + noise."""

  w_star = np.array([1.0, -2.0, 0.5, 3.0], np.float32)

  def make(self, rngs):
    return _Linear(rngs)

  def loss_fn(self, model, batch):
    return jnp.mean((batch["x"] @ model.w[...] - batch["y"]) ** 2)

  def generated_task(self, seed, batch_size):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch_size, 4)).astype(np.float32)
    y = x @ self.w_star + 0.5 * rng.standard_normal(batch_size).astype(np.float32)
    return {"x": x, "y": y}


def test_steps_to_target_on_linear_regression():
  spec = _LinearSpec()
  config = steps_to_target.StepsToTargetConfig(
    target_loss=1.0, max_steps=400, eval_every=5, learning_rates=(0.05,), noise_chunks=4
  )
  lines = []
  results = steps_to_target.steps_to_target(
    spec, (4, 64), config, spec.generated_task(10**9, 512), progress=lines.append
  )
  assert [r.global_batch for r in results] == [4, 64] and len(lines) == 2
  assert all(r.steps is not None and r.final_loss <= 1.0 for r in results)
  assert results[1].steps <= results[0].steps
  assert results[1].b_simple > 0 and math.isfinite(results[1].b_simple)
  with pytest.raises(ValueError, match="learning_rates"):
    steps_to_target.StepsToTargetConfig(target_loss=1.0, learning_rates=())
