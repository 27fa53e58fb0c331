"""ZeRO over the data axis: optimizer state sharded over 'data', gradients reduce-scattered."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import toy
from flax import nnx
from program_test import assert_matches_reference, build, split_lstm

from jaxhybrid.mesh import DATA, MODEL
from jaxhybrid.train import optim


@pytest.mark.parametrize("mesh_spec,k", [("2x2", 2), ("4x2", 1), ("2x1", 2)])
@pytest.mark.parametrize("opt_name", ["adam", "adagrad"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_matches_reference(mesh_spec, k, opt_name, stage):
  opt = {"adam": optax.adam(1e-2), "adagrad": optax.adagrad(0.1)}[opt_name]
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  two = mesh_spec.endswith("x2")
  prog, p, s, pure = build(model, toy.lstm_loss, batch, mesh_spec, split_lstm if two else (lambda n: 0),
                           k, opt, zero=stage)
  W = prog.mesh.shape[DATA]
  # Every owned row splits evenly over the data replicas, and its optimizer state is sharded so.
  assert all(n % W == 0 for _, n in prog.layout.sizes)
  if stage == 2:  # and every leaf: each replica's share is 1/W of each leaf and window
    lay = prog.layout
    assert all(o % W == 0 for o, d in zip(lay.offset, lay.owner) if d >= 0)
    assert all(c % W == 0 for cs in prog.zero_cuts.values() for c in cs)
  ts = prog.init_state([np.asarray(x) for x in jax.tree.leaves(p)])
  rows = [x for x in jax.tree.leaves(ts.opt_state) if x.ndim == 2]
  assert rows and all(x.sharding.spec == jax.sharding.PartitionSpec(MODEL, DATA) for x in rows)
  assert all(x.addressable_shards[0].data.shape[1] == x.shape[1] // W for x in rows)
  assert_matches_reference(prog, p, s, pure, batch, opt)


@pytest.mark.parametrize("mesh_spec,stage", [("2x2", 1), ("2x2", 2), ("4x2", 2)])
def test_zero_rows_made_again_in_pieces_match_reference(monkeypatch, mesh_spec, stage):
  """Segments over 512 bytes all-gathered in pieces inside a loop and written into the old
  rows in place (what segments over zero.GATHER_CHUNK_BYTES get), the others at once."""
  from jaxhybrid.program import zero as zero_lib
  monkeypatch.setattr(zero_lib, "GATHER_CHUNK_BYTES", 512)
  opt = optax.adagrad(0.1)
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  prog, p, s, pure = build(model, toy.lstm_loss, batch, mesh_spec, split_lstm, 2, opt, zero=stage)
  segs = [b - a for cs in prog.zero_cuts.values() for a, b in zip(cs, cs[1:])]
  assert any(n * 4 > 512 for n in segs)  # some in pieces (the loop's last piece overlaps)
  if stage == 2:
    assert any(n * 4 <= 512 for n in segs)  # and some at once
  assert_matches_reference(prog, p, s, pure, batch, opt)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_shared_leaves_and_global_norm_clipping(stage):
  """A tied embedding (shared over 'model', all-reduced) beside sharded rows, and a global-norm
  clip that must see every replica's slice (a clip over one slice would scale differently)."""
  opt = optax.chain(optim.clip_by_global_norm(0.05), optax.adam(1e-2))
  model = toy.LSTMNet(tied=True, rngs=nnx.Rngs(1))
  batch = toy.lstm_batch(8, seed=3)
  prog, p, s, pure = build(model, toy.lstm_loss, batch, "2x2", split_lstm, 2, opt, zero=stage)
  assert prog.layout.shared
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_zero_stage_is_checked():
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"zero=3: use one of 0, 1, 2"):
    build(model, toy.lstm_loss, toy.lstm_batch(8), "2x2", split_lstm, 1, optax.adam(1e-2), zero=3)


def test_projection_exposes_the_all_gather_half_under_zero():
  """With the backward pass hiding the whole all-reduce, ZeRO's all-gather (after the update)
  stays exposed: half the ring all-reduce's time; without overlap both price the same."""
  from jaxhybrid import projection

  t_ar = 0.2
  hidden = projection.CommConfig(overlap=1.0)
  assert projection.framework.exposed_comm_s(t_ar, hidden) == 0.0
  assert projection.framework.exposed_comm_s(
    t_ar, projection.CommConfig(overlap=1.0, zero=1)) == pytest.approx(0.1)
  assert projection.framework.exposed_comm_s(t_ar, projection.CommConfig(zero=1)) == pytest.approx(
    projection.framework.exposed_comm_s(t_ar, projection.CommConfig()))
  # Stage 2: one reduce-scatter per micro-batch, each hidden like stage 1's, the all-gather not.
  assert projection.framework.exposed_comm_s(
    t_ar, projection.CommConfig(overlap=0.5, zero=2, reduce_scatters=4)) == pytest.approx(
      0.5 * 4 * 0.1 + 0.1)
  with pytest.raises(ValueError, match="zero=3"):
    projection.CommConfig(zero=3)


@pytest.mark.parametrize("W", [2, 4])
def test_ring_reduce_scatter_equals_psum_scatter(W):
  """The ppermute ring (zero.reduce_scatter on CPU) gives each replica the same sum of its row
  as lax.psum_scatter, for every replica."""
  from jax.sharding import PartitionSpec as P

  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import zero

  mesh = mesh_lib.make(f"{W}x1")
  x = np.random.default_rng(0).integers(-8, 8, (W, W, 6)).astype(np.float32)  # [replica, row, c]

  def run(ring):
    f = jax.shard_map(lambda v: zero.reduce_scatter(v[0], W, ring)[None], mesh=mesh,
                      in_specs=P(DATA), out_specs=P(DATA))
    return np.asarray(jax.jit(f)(x))

  want = x.sum(axis=0)  # replica r gets row r of the sum
  np.testing.assert_array_equal(run(True), want)
  np.testing.assert_array_equal(run(False), want)
  assert zero.ring_scatter(mesh)  # CPU devices take the ring
