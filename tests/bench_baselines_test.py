"""experiments/bench/bench_baselines.py: the load process's handshake with bench_mp's profiling process."""

from __future__ import annotations

import threading

import pytest
from conftest import experiment_module


@pytest.fixture(scope="module")
def bb():
  return experiment_module("bench_baselines")


def test_load_runs_until_told_to_stop_and_says_so(tmp_path, bb):
  steps = []

  def step(carry, batch):
    steps.append(batch)
    return carry + 1, None

  t = threading.Thread(target=bb.run_load, args=(step, 0, "b", tmp_path, "m", 600.0))
  t.start()
  bb.wait_for(tmp_path / bb.LOAD_RUNNING.format("m"), 60)  # after the first (compiling) step
  assert steps and t.is_alive() and not (tmp_path / bb.LOAD_STOPPED.format("m")).exists()
  (tmp_path / bb.LOAD_STOP.format("m")).touch()
  bb.wait_for(tmp_path / bb.LOAD_STOPPED.format("m"), 60)
  t.join(60)
  assert not t.is_alive() and set(steps) == {"b"}


def test_load_says_it_stopped_when_its_step_fails(tmp_path, bb):
  def step(carry, batch):
    raise RuntimeError("out of memory")

  with pytest.raises(RuntimeError, match="out of memory"):
    bb.run_load(step, 0, None, tmp_path, "m", 600.0)
  assert (tmp_path / bb.LOAD_STOPPED.format("m")).exists()  # the profiling process stops waiting
  assert not (tmp_path / bb.LOAD_RUNNING.format("m")).exists()
  # ... and the profiling process, waiting for the load to run, fails at once instead of waiting.
  with pytest.raises(RuntimeError, match="stopped"):
    bb.wait_for(tmp_path / bb.LOAD_RUNNING.format("m"), 600, fail_if=tmp_path / bb.LOAD_STOPPED.format("m"))


def test_wait_for_names_the_missing_file(tmp_path, bb):
  with pytest.raises(TimeoutError, match="never"):
    bb.wait_for(tmp_path / "never", 0.0)


def test_fsdp_step_shards_every_divisible_leaf_and_trains(bb):
  """The FSDP baseline on 2 simulated devices runs (a positive, finite median step) on a model with a leaf
  whose dimensions do not divide by 2 (3 and 6x3: v splits on its 6 rows, the bias stays whole)."""
  import math

  import jax
  import jax.numpy as jnp
  import optax

  from jaxhybrid import mesh as mesh_lib

  def pure(p, s, b):
    del s
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] + p["c"] - b["y"]) ** 2)

  p = {"w": jnp.ones((8, 6)) * 0.1, "v": jnp.ones((6, 3)) * 0.1, "c": jnp.zeros((3,))}
  b = {"x": jnp.ones((4, 8)), "y": jnp.zeros((4, 3))}
  t = bb.fsdp_step_s(pure, optax.adam(1e-3), (p, {}), b, mesh_lib.make("2x1"), steps=2, warmup=1)
  assert math.isfinite(t) and t > 0 and len(jax.devices()) >= 2  # a step ran; its time is not judged


def test_bucketed_fsdp_step_equals_the_plain_step(bb):
  """FSDP with one flat buffer on 2 simulated devices: after two Adam steps on the same batch
  the loss and the parameters (unflattened from the shards, the padding cut off) equal the
  plain one-device step's. 9x7 + 7x3 + 3 = 87 elements: an odd total, so the buffer is padded."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.flatten_util import ravel_pytree

  from jaxhybrid import mesh as mesh_lib

  def pure(p, s, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] + p["c"] * s["scale"] - b["y"]) ** 2)

  key = jax.random.PRNGKey(0)
  p = {"w": jax.random.normal(key, (9, 7)) * 0.3, "v": jnp.ones((7, 3)) * 0.1, "c": jnp.ones((3,))}
  s = {"scale": jnp.float32(0.5)}
  b = {"x": jax.random.normal(jax.random.PRNGKey(1), (4, 9)), "y": jnp.ones((4, 3))}
  opt = optax.adam(1e-2)
  size = ravel_pytree(p)[0].shape[0]
  assert size % 2 == 1
  step, carry, bt = bb.bucketed_fsdp_step(pure, opt, mesh_lib.make("2x1"), p, s, b)
  assert bt["x"].sharding.spec[0] == ("data", "model")
  ref = (p, opt.init(p), s)
  plain = jax.jit(bb.plain_step(pure, opt))
  for _ in range(2):
    carry, loss = step(carry, bt)
    ref, ref_loss = plain(ref, b)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  got = ravel_pytree(p)[1](np.asarray(carry[0])[:size])
  for name in p:
    np.testing.assert_allclose(got[name], ref[0][name], rtol=1e-5, atol=1e-6)
  assert not np.allclose(got["w"], p["w"])  # the steps moved the parameters
