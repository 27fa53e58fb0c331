"""Global-norm clipping that sees every model-axis device's parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from flax import nnx
from program_test import assert_matches_reference, build, split_lstm

from jaxhybrid.train import optim


def test_outside_the_program_it_is_optax_clipping():
  tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": [jnp.ones(4)]}
  np.testing.assert_allclose(optim.global_norm(tree), optax.tree.norm(tree), rtol=1e-6)
  ours, _ = optim.clip_by_global_norm(1.0).update(tree, optax.EmptyState())
  ref, _ = optax.clip_by_global_norm(1.0).update(tree, optax.EmptyState())
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert float(optax.tree.norm(ours)) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("mesh_spec,tied", [("1x2", False), ("2x2", True)])
def test_hybrid_program_clips_by_the_norm_of_all_devices(mesh_spec, tied):
  """Split over two devices (and with a shared tied embedding), training with active clipping
  equals single-device training with the same optimizer."""
  model = toy.LSTMNet(tied=tied, rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  _, p, s, pure = build(model, toy.lstm_loss, batch, mesh_spec, split_lstm, 2, optax.sgd(1.0))
  # Clip at a tenth of the first gradient's norm, so clipping is active in every step.
  max_norm = 0.1 * float(optax.tree.norm(jax.grad(pure)(p, s, batch)))
  opt = optax.chain(optim.clip_by_global_norm(max_norm), optax.sgd(1.0))
  prog, p, s, pure = build(model, toy.lstm_loss, batch, mesh_spec, split_lstm, 2, opt)
  assert len(set(prog.assignment)) == 2 and bool(prog.layout.shared) == tied
  assert_matches_reference(prog, p, s, pure, batch, opt)
  # And a per-device norm would not do: plain optax clipping inside the program differs.
  naive = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(1.0))
  prog2, *_ = build(model, toy.lstm_loss, batch, mesh_spec, split_lstm, 2, naive)
  with pytest.raises(AssertionError):
    assert_matches_reference(prog2, p, s, pure, batch, naive)


def test_bad_norm_raises():
  with pytest.raises(ValueError, match="positive"):
    optim.clip_by_global_norm(0.0)
