"""Tests of the models and the registry: parameter counts, shapes, one optimizer step, structure."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxhybrid import models
from jaxhybrid.models import biglstm, gnmt, inception_v3

# Reference parameter counts (see each config's docstring).
TORCHVISION_INCEPTION_V3 = 27_161_264  # torchvision inception_v3 num_params (with aux head)
TORCHVISION_INCEPTION_AUX = 3_326_696  # its AuxLogits: 1x1 conv 128, 5x5 conv 768, fc 768->1000
KERAS_INCEPTION_V3_TRAINABLE = 23_817_352  # keras.applications.InceptionV3 (no BN scale)
MLPERF_GNMT = 160_671_297  # NVIDIA GNMT v2 / MLPerf GNMT, 4+4 layers, vocabulary 32,320
JOZEFOWICZ_BIG_LSTM = 1.8e9  # Jozefowicz et al. 2016, Table 1 (two significant digits)


@functools.cache
def _abstract(name: str, size: str, **overrides) -> nnx.Module:
  """Abstract model, built once per test run (paper sizes only ever abstractly)."""
  return models.get(name, size, **overrides).abstract_model()


def _param_count(module: nnx.Module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _paths(module: nnx.Module) -> set[str]:
  return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(module))}


def test_registry_lists_and_rejects():
  assert models.names() == ("inception_v3", "gnmt", "biglstm")
  assert models.SIZES == ("tiny", "small", "paper")
  with pytest.raises(ValueError, match="valid names: inception_v3, gnmt, biglstm"):
    models.get("resnet")
  with pytest.raises(ValueError, match="valid sizes: tiny, small, paper"):
    models.get("gnmt", "huge")
  with pytest.raises(ValueError, match="hidden_size"):
    models.get("gnmt", "tiny", hiden_size=3)
  with pytest.raises(ValueError, match="does not parse as int"):
    models.get("gnmt", "tiny", hidden_size="big")


def test_registry_overrides_coerce_strings():
  spec = models.get("gnmt", "tiny", hidden_size="16", share_embedding="false",
                    label_smoothing="0.2")
  assert spec.config.hidden_size == 16 and spec.config.share_embedding is False
  assert spec.config.label_smoothing == 0.2
  assert spec.name == "gnmt" and spec.size == "tiny"
  assert models.get("biglstm", "tiny", init_scale="0.1").config.init_scale == 0.1


def test_inception_paper_param_count():
  abstract = _abstract("inception_v3", "paper")
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))
  n = _param_count(abstract)
  assert n == TORCHVISION_INCEPTION_V3 - TORCHVISION_INCEPTION_AUX
  assert abs(n / KERAS_INCEPTION_V3_TRAINABLE - 1) < 0.01
  with_aux = _param_count(_abstract("inception_v3", "paper", aux_head=True))
  assert with_aux == TORCHVISION_INCEPTION_V3


def test_gnmt_paper_param_count():
  n = models.get("gnmt", "paper").num_params()
  assert abs(n / MLPERF_GNMT - 1) < 0.01
  # The only difference: PyTorch LSTMs have two bias vectors (9 layer-directions x 4 x 1024).
  assert MLPERF_GNMT - n == 9 * 4 * 1024
  eight = models.get("gnmt", "paper", num_encoder_layers=8, num_decoder_layers=8)
  paths = _paths(eight.abstract_model())
  assert "encoder_7.w_ih" in paths and "decoder_7.w_ih" in paths
  # Each extra layer pair: encoder LSTM 1024->1024, decoder LSTM 2048->1024.
  per_pair = (4 * 1024 * 2048 + 4096) + (4 * 1024 * 3072 + 4096)
  assert eight.num_params() == n + 4 * per_pair


def test_biglstm_paper_param_count():
  cfg = biglstm.BigLSTMConfig.paper()
  v, e, h, p = cfg.vocab_size, cfg.embed_size, cfg.hidden_size, cfg.proj_size
  analytic = v * e + 2 * (4 * h * (e + p) + 4 * h + h * p) + v * p + v
  n = models.get("biglstm", "paper").num_params()
  assert n == analytic == 1_776_882_559
  assert round(n / 1e8) / 10 == JOZEFOWICZ_BIG_LSTM / 1e9  # 1.8B as the paper rounds it


def test_placement_units_are_submodules():
  inc = _paths(_abstract("inception_v3", "tiny"))
  for path in ("stem.conv_1a_3x3.conv.kernel", "mixed_5b.branch_1x1.layers.0.conv.kernel",
               "mixed_5b.branch_5x5.layers.1.bn.scale", "mixed_5b.branch_pool.layers.0.bn.mean",
               "mixed_6a.branch_3x3.layers.0.conv.kernel",
               "mixed_6e.branch_7x7dbl.layers.4.conv.kernel",
               "mixed_7c.branch_3x3dbl.split.1.conv.kernel", "classifier.fc.kernel"):
    assert path in inc, path
  blocks = {p.split(".")[0] for p in inc}
  assert blocks == {"stem", "classifier", *inception_v3.BLOCK_NAMES}
  assert len(inception_v3.BLOCK_NAMES) == 11  # 3 A + reduction + 4 B + reduction + 2 C
  g = {p.split(".")[0] for p in _paths(_abstract("gnmt", "tiny"))}
  assert g == {"embed", "attention", "classifier", *(f"encoder_{i}" for i in range(4)),
               *(f"decoder_{i}" for i in range(4))}
  b = {p.split(".")[0] for p in _paths(_abstract("biglstm", "tiny"))}
  assert b == {"embed", "lstm_0", "lstm_1", "softmax"}


def test_only_params_and_batch_stats():
  for name in models.names():
    state = nnx.state(_abstract(name, "tiny"))
    kinds = {type(v) for _, v in nnx.to_flat_state(state)}
    allowed = {nnx.Param, nnx.BatchStat} if name == "inception_v3" else {nnx.Param}
    assert kinds <= allowed, (name, kinds)


def test_dtypes_are_respected():
  spec = models.get("gnmt", "tiny", param_dtype="bfloat16", dtype="bfloat16")
  model = spec.abstract_model()
  dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  logits = jax.eval_shape(lambda m, b: m(b["src"], b["tgt_in"]), model, spec.batch_spec(2))
  assert logits.dtype == jnp.bfloat16


@pytest.mark.parametrize("size", ["tiny", "paper"])
def test_forward_shapes(size):
  for name in models.names():
    spec = models.get(name, size)
    cfg, model, batch = spec.config, _abstract(name, size), spec.batch_spec(2)
    if name == "inception_v3":
      out = jax.eval_shape(lambda m, b: m(b["images"]), model, batch)
      assert out.shape == (2, cfg.num_classes)
    elif name == "gnmt":
      out = jax.eval_shape(lambda m, b: m(b["src"], b["tgt_in"]), model, batch)
      assert out.shape == (2, cfg.max_target_length, cfg.vocab_size)
    else:
      out = jax.eval_shape(lambda m, b: m(b["inputs"]), model, batch)
      assert out.shape == (2, cfg.unroll, cfg.proj_size)
    loss = jax.eval_shape(spec.loss_fn, model, batch)
    assert loss.shape == () and loss.dtype == jnp.float32


@pytest.mark.parametrize("name", ["inception_v3", "gnmt", "biglstm"])
def test_batches_match_batch_spec(name):
  spec = models.get(name, "tiny")
  want = {k: (v.shape, v.dtype) for k, v in spec.batch_spec(4).items()}
  for fn in (spec.synthetic_batch, spec.generated_task):
    got = {k: (v.shape, v.dtype) for k, v in fn(0, 4).items()}
    assert got == want
  if name == "biglstm":
    assert want[biglstm.SAMPLED_IDS] == ((spec.config.num_sampled,), jnp.int32)


def _train_step(spec: models.ModelSpec, model: nnx.Module):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(1e-2)

  def loss(params, rest, batch):
    m = nnx.merge(graphdef, params, rest, copy=True)
    return spec.loss_fn(m, batch), nnx.state(m, nnx.Not(nnx.Param))

  # Backend optimisation level 0 compiles Inception's train step ~40 % faster; values unchanged.
  @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
  def step(params, rest, opt_state, batch):
    (value, rest), grads = jax.value_and_grad(loss, has_aux=True)(params, rest, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state, value

  return step, (params, rest, tx.init(params))


@pytest.mark.parametrize("name", [pytest.param("inception_v3", marks=pytest.mark.slow), "gnmt", "biglstm"])
def test_one_optimizer_step_lowers_loss(name):  # (Inception-V3's train step compiles for 20-26 s)
  spec = models.get(name, "tiny")
  model = spec.init(0)
  step, (params, rest, opt_state) = _train_step(spec, model)
  batch = spec.generated_task(0, 8)
  params, rest1, opt_state, loss0 = step(params, rest, opt_state, batch)
  _, _, _, loss1 = step(params, rest1, opt_state, batch)  # loss after one update
  assert np.isfinite(float(loss0)) and float(loss1) < float(loss0)
  if name == "inception_v3":  # training mode: the running statistics moved
    before = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    after = jax.tree.leaves(rest1)
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
  else:  # a fresh model starts near the uniform-prediction loss
    vocab = spec.config.vocab_size
    assert float(loss0) < 2 * math.log(vocab)


@pytest.mark.parametrize("name", ["gnmt", "biglstm"])
def test_loss_is_mean_over_examples(name):
  spec = models.get(name, "tiny")
  graphdef, state = nnx.split(spec.init(1))
  loss = jax.jit(lambda s, b: spec.loss_fn(nnx.merge(graphdef, s, copy=True), b))
  batch = spec.generated_task(3, 8)
  halves = [{k: (v if k == biglstm.SAMPLED_IDS else v[i * 4:(i + 1) * 4])
             for k, v in batch.items()} for i in range(2)]
  full = float(loss(state, batch))
  assert full == pytest.approx(np.mean([float(loss(state, h)) for h in halves]), rel=1e-5)


def test_biglstm_sampled_softmax():
  cfg = biglstm.BigLSTMConfig.tiny()
  rng = np.random.default_rng(0)
  ids = biglstm.sample_candidates(rng, 200_000, cfg.vocab_size)
  freq = np.bincount(ids, minlength=cfg.vocab_size) / ids.size
  np.testing.assert_allclose(freq[:5], biglstm.log_uniform_prob(np.arange(5), cfg.vocab_size),
                             rtol=0.05)
  assert biglstm.log_uniform_prob(np.arange(cfg.vocab_size), cfg.vocab_size).sum() == (
    pytest.approx(1.0, rel=1e-5))
  model = biglstm.BigLSTM(cfg, rngs=nnx.Rngs(0))
  h = jnp.asarray(rng.standard_normal((2, 3, cfg.proj_size)), jnp.float32)
  targets = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  # Every sample an accidental hit of its position's target: only the true class remains.
  same = model.softmax(h[:1, :1, :], targets[:1, :1], jnp.asarray([1, 1], jnp.int32))
  np.testing.assert_allclose(same, 0.0, atol=1e-5)
  # Full softmax equals -log softmax of the explicit logits.
  logits = h @ model.softmax.kernel[...].T + model.softmax.bias[...]
  want = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(model.softmax(h, targets), want, rtol=1e-5)


def test_gnmt_attention_ignores_padding():
  cfg = gnmt.GNMTConfig.tiny()
  att = gnmt.BahdanauAttention(4, 4, 8, init_scale=0.5, dtype=jnp.float32,
                               param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((1, 3, 4)), jnp.float32)
  mask = jnp.asarray([[1.0, 1.0, 0.0]])
  changed = keys.at[0, 2].set(100.0)
  np.testing.assert_allclose(att(q, keys, mask), att(q, changed, mask), rtol=1e-6)
  assert cfg.num_encoder_layers == 4  # tiny keeps the 4+4 structure (bidirectional, residuals)


@pytest.mark.parametrize("reverse", [False, True])
def test_lstm_time_chunks_equal_the_whole_sequence(reverse):
  """A layer fed consecutive time chunks carries its state across them: same outputs, same
  gradients as one scan over the whole sequence (masked steps included)."""
  from jaxhybrid.models.lstm import LSTM

  layer = LSTM(6, 8, proj_size=5, reverse=reverse, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 12, 6))
  mask = jnp.ones((3, 12)).at[1, 9:].set(0.0).at[2, :2].set(0.0)
  whole = layer(x, mask)
  chunks = layer(jnp.split(x, 3, axis=1), jnp.split(mask, 3, axis=1))
  assert len(chunks) == 3
  np.testing.assert_allclose(jnp.concatenate(chunks, axis=1), whole, rtol=1e-6, atol=1e-6)

  graphdef, params = nnx.split(layer)

  @functools.partial(jax.jit, static_argnums=1)
  def grads(p, chunked):
    def loss(p):
      m = nnx.merge(graphdef, p)
      out = m(jnp.split(x, 4, axis=1)) if chunked else [m(x)]
      return jnp.sum(jnp.concatenate(out, axis=1) ** 2)

    return jax.grad(loss)(p)

  g_whole, g_chunk = grads(params, False), grads(params, True)
  for a, b in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunk)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="mask chunks"):
    layer(jnp.split(x, 3, axis=1), jnp.split(mask, 2, axis=1))


def _chunked_graph(name, chunks, batch_size):
  """(node names, edges by name) of the tiny model in `chunks` time chunks, after checking that
  its loss equals the unchunked model's."""
  from jaxhybrid import graph

  spec, one = models.get(name, "tiny", time_chunks=chunks), models.get(name, "tiny")
  batch = spec.synthetic_batch(0, batch_size)
  assert float(spec.loss_fn(spec.make(nnx.Rngs(0)), batch)) == pytest.approx(
    float(one.loss_fn(one.make(nnx.Rngs(0)), batch)), rel=1e-6)
  g = graph.trace(nnx.eval_shape(lambda: spec.make(nnx.Rngs(0))), spec.loss_fn,
                  jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch))
  names = [n.name for n in g.nodes]
  return names, {(names[e.src], names[e.dst]) for e in g.edges}


def test_biglstm_time_chunks_are_graph_nodes_in_a_wavefront():
  names, edges = _chunked_graph("biglstm", 4, 2)
  assert names == ["embed"] + [f"lstm_{i}/t{c}" for i in range(2) for c in range(4)] + ["softmax"]
  for c in range(4):
    # Layer 1's chunk c reads layer 0's chunk c and its own chunk c - 1, nothing later.
    reads = {a for a, b in edges if b == f"lstm_1/t{c}"}
    assert reads == {f"lstm_0/t{c}"} | ({f"lstm_1/t{c - 1}"} if c else set())
  with pytest.raises(ValueError, match="divide unroll"):
    models.get("biglstm", "tiny", time_chunks=3)


def test_gnmt_time_chunks_keep_the_loss_and_pipeline_the_decoder():
  names, edges = _chunked_graph("gnmt", 2, 3)
  for layer in ("encoder_1", "decoder_0", "decoder_1", "attention"):
    assert f"{layer}/t0" in names and f"{layer}/t1" in names
  # Decoder layer 1's first chunk needs the first chunks only (and the whole encoder through
  # the attention's keys), so it can run while layer 0 works on the second chunk.
  reads = {a for a, b in edges if b == "decoder_1/t0"}
  assert reads == {"decoder_0/t0", "attention/t0"}
  assert ("attention/keys", "attention/t1") in edges
  with pytest.raises(ValueError, match="divide max_source_length"):
    models.get("gnmt", "tiny", time_chunks=3)


@pytest.mark.parametrize("stride", [1, 2])
def test_inception_max_pool_matches_reduce_window_values_and_gradients(stride):
  # Random values with ReLU zeros and a block of positive ties: the running select must give
  # each window's gradient to its first maximum, as the gradient of reduce_window max does.
  x = jax.nn.relu(jax.random.normal(jax.random.key(0), (2, 10, 9, 3)))
  x = x.at[:, 2:6, 1:5, :].set(0.5)
  ours = functools.partial(inception_v3.max_pool_3x3, stride=stride)
  ref = lambda x: nnx.max_pool(x, (3, 3), strides=(stride, stride), padding="VALID")
  y, vjp = jax.vjp(ours, x)
  y_ref, vjp_ref = jax.vjp(ref, x)
  assert y.shape == y_ref.shape and bool(jnp.all(y == y_ref))
  ct = jax.random.normal(jax.random.key(1), y.shape)
  np.testing.assert_allclose(vjp(ct)[0], vjp_ref(ct)[0], rtol=0, atol=1e-6)
