"""Tests of jaxhybrid.graph: tracing Flax losses to op graphs, their costs and their replay."""

from __future__ import annotations

import logging
import math

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jaxhybrid import graph
from jaxhybrid.graph import eqn_costs

F32 = jnp.float32


# ---- small models -----------------------------------------------------------------------------


class NnxMLP(nnx.Module):
  """Two dense layers; attribute names match the linen version's module names."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="l1")(x)
    return nn.Dense(4, name="l2")(jax.nn.relu(x))


def _mse(y):
  return jnp.mean(y**2)


def _nnx_graph(depth=1, max_nodes=None):
  model = nnx.eval_shape(lambda: NnxMLP(rngs=nnx.Rngs(0)))
  x = jax.ShapeDtypeStruct((32, 8), F32)
  return graph.trace(model, lambda m, b: _mse(m(b)), x, depth=depth, max_nodes=max_nodes)


def _linen_graph(depth=1):
  model = LinenMLP()
  x = jax.ShapeDtypeStruct((32, 8), F32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  return graph.trace(
    model, lambda p, b: _mse(model.apply({"params": p}, b)), x, params=params, depth=depth
  )


def _replay(g: graph.OpGraph, params, state, batch):
  """Evaluates the graph node by node (as the hybrid program does) and returns the loss."""
  leaves = {
    graph.PARAM: jax.tree.leaves(params),
    graph.STATE: jax.tree.leaves(state),
    graph.BATCH: jax.tree.leaves(batch),
  }
  env = {v: leaves[k][i] for v, (k, i) in zip(g.jaxpr.invars, g.input_kinds)}
  env.update(zip(g.jaxpr.constvars, g.closed_jaxpr.consts))
  for node in g.nodes:
    outs = g.node_fn(node)(*[env[v] for v in node.invars])
    env.update(zip(node.outvars, outs))
  out = g.jaxpr.outvars[0]  # the loss; the outputs after it are state writes
  return out.val if isinstance(out, jex.core.Literal) else env[out]


# ---- FLOPs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", [(3, 5, 7), (32, 8, 16), (1, 1024, 793)])
def test_matmul_flops_are_2mnk(m, k, n):
  g = graph.trace_function(
    lambda p, s, b: jnp.sum(b @ p), jax.ShapeDtypeStruct((k, n), F32), {},
    jax.ShapeDtypeStruct((m, k), F32),
  )
  (dot,) = [e for nd in g.nodes for e in nd.eqns if e.primitive.name == "dot_general"]
  assert eqn_costs.eqn_cost(dot).flops == 2 * m * n * k


def test_batched_and_transposed_dot_flops():
  # [b, m, k] x [b, n, k] -> [b, m, n]: 2 * b * m * n * k
  dn = (((2,), (2,)), ((0,), (0,)))
  assert eqn_costs.dot_general_flops((4, 3, 5), (4, 7, 5), dn) == 2 * 4 * 3 * 7 * 5


def test_conv_flops_exact():
  x = jax.ShapeDtypeStruct((2, 9, 9, 3), F32)  # NHWC
  w = jax.ShapeDtypeStruct((3, 3, 3, 8), F32)  # HWIO

  def loss(p, s, b):
    dn = ("NHWC", "HWIO", "NHWC")
    y = jax.lax.conv_general_dilated(b, p, (1, 1), "VALID", dimension_numbers=dn)
    return jnp.sum(y)

  g = graph.trace_function(loss, w, {}, x)
  (conv,) = [e for nd in g.nodes for e in nd.eqns if e.primitive.name == "conv_general_dilated"]
  # 2 x output elements (2*7*7*8) x kernel taps per output (3*3*3).
  assert eqn_costs.eqn_cost(conv).flops == 2 * (2 * 7 * 7 * 8) * (3 * 3 * 3)


# ---- NNX and linen ----------------------------------------------------------------------------


def test_linen_and_nnx_give_same_paths_and_flops():
  gn, gl = _nnx_graph(), _linen_graph()
  assert [n.name for n in gn.nodes] == [n.name for n in gl.nodes] == ["l1", "l2"]
  assert [n.flops for n in gn.nodes] == [n.flops for n in gl.nodes]
  assert [n.param_bytes for n in gn.nodes] == [n.param_bytes for n in gl.nodes]
  assert gn.nodes[0].flops >= 2 * 32 * 8 * 16
  assert gn.total_param_bytes == gl.total_param_bytes == (8 * 16 + 16 + 16 * 4 + 4) * 4


def test_node_fields_and_edges():
  g = _nnx_graph()
  l1, l2 = g.nodes
  assert l1.param_bytes == (8 * 16 + 16) * 4
  assert l2.param_bytes == (16 * 4 + 4) * 4
  assert len(l1.param_leaves) == 2 and len(l2.param_leaves) == 2
  assert not set(l1.param_leaves) & set(l2.param_leaves)
  # l1 sends its relu'd [32, 16] activation to l2; l2 outputs the loss scalar.
  assert l1.out_bytes == 32 * 16 * 4
  assert [(e.src, e.dst, e.bytes) for e in g.edges] == [(0, 1, 32 * 16 * 4)]
  assert l2.out_bytes == 4
  text = g.summary()
  assert "l1" in text and "l2" in text and "2 nodes, 1 edges" in text


def test_depth_and_max_nodes():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(8, 8, rngs=rngs)
      self.b = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(3)])

    def __call__(self, x):
      for blk in self.blocks:
        x = blk(x)
      return x

  model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
  x = jax.ShapeDtypeStruct((4, 8), F32)
  lossf = lambda m, b: _mse(m(b))  # noqa: E731
  g2 = graph.trace(model, lossf, x, depth=2)
  g3 = graph.trace(model, lossf, x, depth=3)
  assert [n.name for n in g2.nodes] == ["blocks/0", "blocks/1", "blocks/2"]
  assert [n.name for n in g3.nodes] == [f"blocks/{i}/{s}" for i in range(3) for s in "ab"]
  g_small = graph.trace(model, lossf, x, depth=3, max_nodes=2)
  assert len(g_small.nodes) == 2
  assert g_small.total_flops == g3.total_flops == g2.total_flops
  for g in (g2, g3, g_small):
    assert all(e.src < e.dst for e in g.edges)
  with pytest.raises(ValueError, match="depth"):
    graph.trace(model, lossf, x, depth=0)


# ---- nested jaxprs ----------------------------------------------------------------------------


def _scan_graph(length):
  def loss(p, s, b):
    def step(h, x_t):
      h = jnp.tanh(x_t @ p["w_x"] + h @ p["w_h"])
      return h, h

    _, hs = jax.lax.scan(step, jnp.zeros((4, 16), F32), b)
    return jnp.sum(hs)

  params = {"w_x": jax.ShapeDtypeStruct((8, 16), F32), "w_h": jax.ShapeDtypeStruct((16, 16), F32)}
  return graph.trace_function(loss, params, {}, jax.ShapeDtypeStruct((length, 4, 8), F32))


def test_scan_costs_length_times_body():
  g1, g7 = _scan_graph(1), _scan_graph(7)
  scan1, scan7 = (
    [e for n in g.nodes for e in n.eqns if e.primitive.name == "scan"][0] for g in (g1, g7)
  )
  c1, c7 = eqn_costs.eqn_cost(scan1), eqn_costs.eqn_cost(scan7)
  assert c7.flops == 7 * c1.flops
  assert c7.bytes_accessed == 7 * c1.bytes_accessed
  # The body holds two matmuls: 2*4*8*16 + 2*4*16*16 FLOPs per step, plus elementwise ops.
  assert c1.flops >= 2 * 4 * 8 * 16 + 2 * 4 * 16 * 16
  assert len(g7.nodes) == 1  # no module scope: the whole scan is one node


def test_nested_jaxprs_are_costed():
  m, k, n = 4, 8, 16
  mm = 2 * m * k * n

  @jax.custom_vjp
  def cvjp(x):
    return x * 2.0

  cvjp.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))

  @jax.jit
  def jitted(x, w):
    return x @ w

  def loss(p, s, b):
    with jax.named_scope("pjit"):
      y1 = jitted(b, p)
    with jax.named_scope("remat"):
      y2 = jax.checkpoint(lambda x, w: x @ w)(b, p)
    with jax.named_scope("cond"):
      y3 = jax.lax.cond(jnp.sum(b) > 0, lambda x, w: x @ w, lambda x, w: jnp.zeros((m, n)), b, p)
    with jax.named_scope("custom"):
      y4 = jax.nn.relu(cvjp(b @ p))
    return jnp.sum(y1 + y2 + y3 + y4)

  g = graph.trace_function(
    loss, jax.ShapeDtypeStruct((k, n), F32), {}, jax.ShapeDtypeStruct((m, k), F32)
  )
  names = [nd.name for nd in g.nodes]
  assert names[:4] == ["pjit", "remat", "cond", "custom"]
  for nd in g.nodes[:4]:
    assert mm <= nd.flops < mm + 10 * m * n, nd
    assert not nd.opaque
  # Nested primitives really are present at the top level of those nodes.
  prims = {nd.name: {e.primitive.name for e in nd.eqns} for nd in g.nodes}
  assert "jit" in prims["pjit"] or "pjit" in prims["pjit"]
  assert any(p.startswith("remat") or p == "checkpoint" for p in prims["remat"])
  assert "cond" in prims["cond"]
  assert {"custom_vjp_call", "custom_jvp_call"} <= prims["custom"]


def test_while_loop_counts_body_once_with_warning(caplog):
  def loss(p, s, b):
    return jnp.sum(jax.lax.fori_loop(0, jnp.int32(3) + s, lambda i, x: x @ p, b))

  with caplog.at_level(logging.WARNING):
    g = graph.trace_function(
      loss, jax.ShapeDtypeStruct((8, 8), F32), jax.ShapeDtypeStruct((), jnp.int32),
      jax.ShapeDtypeStruct((4, 8), F32),
    )
  assert "while" in caplog.text
  (node,) = g.nodes
  assert node.flops >= 2 * 4 * 8 * 8
  assert "while" in node.opaque


mystery_p = jex.core.Primitive("mystery_op")
mystery_p.def_impl(lambda x: x + 1.0)
mystery_p.def_abstract_eval(lambda x: x)


def test_unknown_primitive_is_opaque_with_warning(caplog):
  def loss(p, s, b):
    with jax.named_scope("strange"):
      y = mystery_p.bind(b @ p)
    return jnp.sum(y)

  with caplog.at_level(logging.WARNING):
    g = graph.trace_function(
      loss, jax.ShapeDtypeStruct((8, 4), F32), {}, jax.ShapeDtypeStruct((2, 8), F32)
    )
  assert "mystery_op" in caplog.text
  node = g.nodes[0]
  assert node.name == "strange"
  assert node.opaque == ("mystery_op",)
  (eqn,) = [e for e in node.eqns if e.primitive is mystery_p]
  assert eqn_costs.eqn_cost(eqn).flops == 2 * 4  # the fallback: one FLOP per output element
  assert eqn_costs.eqn_cost(eqn).opaque == ("mystery_op",)
  assert "opaque: mystery_op" in g.summary()


# ---- replay -----------------------------------------------------------------------------------


def test_replaying_nodes_reproduces_nnx_loss():
  model = NnxMLP(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (32, 8))
  lossf = lambda m, b: _mse(m(b))  # noqa: E731
  _, params, state, pure = graph.nnx_pure_loss(model, lossf)
  g = graph.trace(model, lossf, x, depth=1)
  np.testing.assert_allclose(_replay(g, params, state, x), lossf(model, x), rtol=1e-6)
  np.testing.assert_allclose(pure(params, state, x), lossf(model, x), rtol=1e-6)


def test_replaying_nodes_reproduces_linen_loss_with_scan_and_consts():
  model = LinenMLP()
  x = jax.random.normal(jax.random.key(1), (32, 8))
  params = model.init(jax.random.key(0), x)["params"]
  weights = np.linspace(0.0, 1.0, 4).astype(np.float32)  # a closed-over constant

  def lossf(p, b):
    y = model.apply({"params": p}, b)
    _, ys = jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), y)
    return jnp.mean(ys * weights)

  g = graph.trace(model, lossf, x, params=params, depth=1)
  np.testing.assert_allclose(_replay(g, params, {}, x), lossf(params, x), rtol=1e-6)


# ---- a BigLSTM-sized model traces abstractly --------------------------------------------------

VOCAB, EMBED, HIDDEN, STEPS, BATCH = 793_471, 1024, 8192, 20, 128  # PAPER.md's BigLSTM


class ProjLSTM(nnx.Module):
  """An LSTM layer with output projection (LSTMP), the recurrence in one `lax.scan`."""

  def __init__(self, d_in: int, hidden: int, proj: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.01)
    self.w_ih = nnx.Param(init(rngs.params(), (d_in, 4 * hidden)))
    self.w_hh = nnx.Param(init(rngs.params(), (proj, 4 * hidden)))
    self.w_proj = nnx.Param(init(rngs.params(), (hidden, proj)))
    self.hidden, self.proj = hidden, proj

  def __call__(self, x):  # x: [time, batch, d_in]
    xz = x @ self.w_ih[...]  # [time, batch, 4 * hidden]

    def step(carry, z_t):
      c, r = carry
      i, f, g, o = jnp.split(z_t + r @ self.w_hh[...], 4, axis=-1)
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      r = (jax.nn.sigmoid(o) * jnp.tanh(c)) @ self.w_proj[...]
      return (c, r), r

    b = x.shape[1]
    init = (jnp.zeros((b, self.hidden), x.dtype), jnp.zeros((b, self.proj), x.dtype))
    return jax.lax.scan(step, init, xz)[1]


class BigLSTMStandIn(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
    self.lstm0 = ProjLSTM(EMBED, HIDDEN, EMBED, rngs=rngs)
    self.lstm1 = ProjLSTM(EMBED, HIDDEN, EMBED, rngs=rngs)
    self.softmax = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):  # tokens: [time, batch]
    return self.softmax(self.lstm1(self.lstm0(self.embed(tokens))))


def _standin_loss(model, batch):
  logits = model(batch["inputs"])
  return jnp.mean(
    -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)
  )


def _live_bytes() -> int:
  """Bytes of the device arrays alive now (what the process allocated through JAX; unlike the
  peak RSS it does not depend on what ran before in the process)."""
  return sum(a.nbytes for a in jax.live_arrays())


def test_biglstm_sized_model_traces_abstractly():
  live_before = _live_bytes()
  model = nnx.eval_shape(lambda: BigLSTMStandIn(rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((STEPS, BATCH), jnp.int32)
  g = graph.trace(model, _standin_loss, {"inputs": tokens, "targets": tokens}, depth=1)
  n_params = sum(math.prod(a.shape) for a in g.param_avals)
  assert n_params > 1.7e9 and g.total_param_bytes > 7e9
  assert _live_bytes() - live_before < 1e8, "tracing allocated device arrays"
  names = [n.name for n in g.nodes]
  assert names == ["embed", "lstm0", "lstm1", "softmax"], names
  softmax = g.nodes[-1]
  assert softmax.flops >= 2 * STEPS * BATCH * EMBED * VOCAB
  assert softmax.param_bytes == VOCAB * EMBED * 4
  # Each recurrent scan: STEPS x (the recurrent and projection matmuls) at least.
  lstm = g.nodes[1]
  per_step = 2 * BATCH * EMBED * 4 * HIDDEN + 2 * BATCH * HIDDEN * EMBED
  assert lstm.flops >= 2 * STEPS * BATCH * EMBED * 4 * HIDDEN + STEPS * per_step
  assert [(e.src, e.dst) for e in g.edges] == [(0, 1), (1, 2), (2, 3)]
  assert g.edges[0].bytes == STEPS * BATCH * EMBED * 4


def test_models_biglstm_paper_traces_if_available():
  models = pytest.importorskip("jaxhybrid.models")
  if not hasattr(models, "get"):
    pytest.skip("jaxhybrid.models.get is not there yet")
  try:
    spec = models.get("biglstm", "paper")
  except (KeyError, ValueError) as e:
    pytest.skip(f"no paper-size biglstm: {e}")
  live_before = _live_bytes()
  g = graph.trace(spec.abstract_model(), spec.loss_fn, spec.batch_spec(4), depth=1)
  assert g.total_param_bytes > 6e9
  assert _live_bytes() - live_before < 1e8, "tracing allocated device arrays"


def test_node_fingerprints_identify_computations():
  a, b = _nnx_graph(), _nnx_graph()
  assert [a.node_fingerprint(n) for n in a.nodes] == [b.node_fingerprint(n) for n in b.nodes]
  assert a.node_fingerprint(a.nodes[0]) != a.node_fingerprint(a.nodes[1])

  def two(p, s, b):  # the same primitives and shapes, wired differently
    with jax.named_scope("u"):
      u = b * p + b
    with jax.named_scope("v"):
      v = u * p + p
    return jnp.sum(v)

  vec = jax.ShapeDtypeStruct((3,), F32)
  g = graph.trace_function(two, vec, {}, vec)
  assert g.node_fingerprint(g.nodes[0]) != g.node_fingerprint(g.nodes[1])


def test_graph_summary_command_runs():
  import pathlib
  import subprocess
  import sys

  script = pathlib.Path(__file__).parents[1] / "experiments" / "bench" / "graph_summary.py"
  out = subprocess.run(
    [sys.executable, str(script), "--model=biglstm", "--size=tiny", "--batch=4",
     "--hardware=dgx1-v100"],
    capture_output=True, text=True, timeout=300, check=True,
  ).stdout
  assert "module path" in out and "fwd+bwd ms" in out and "single-device step" in out


def _fill(tree, seed=0):
  """Concrete values for abstract leaves, made with numpy (initialising by XLA can be slow)."""
  rng = np.random.default_rng(seed)

  def leaf(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.split(jax.random.key(seed), math.prod(x.shape)).reshape(x.shape)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.asarray(rng.uniform(0.05, 0.15, x.shape).astype(x.dtype))  # > 0: variances
    return jnp.zeros(x.shape, x.dtype)

  return jax.tree.map(leaf, tree)


@pytest.mark.parametrize("name", ["biglstm", "gnmt", "inception_v3"])
def test_replaying_registry_models_reproduces_loss(name):
  models = pytest.importorskip("jaxhybrid.models")
  spec = models.get(name, "tiny")
  model = spec.abstract_model()
  batch = jax.tree.map(jnp.asarray, spec.synthetic_batch(0, 2))
  _, params, state, pure = graph.nnx_pure_loss(model, spec.loss_fn)
  params, state = _fill(params), _fill(state)
  g = graph.trace(model, spec.loss_fn, batch, depth=1)
  assert len(g.nodes) >= 3
  replayed = jax.jit(lambda p, s, b: _replay(g, p, s, b))(params, state, batch)
  np.testing.assert_allclose(replayed, jax.jit(pure)(params, state, batch), rtol=1e-5)


class _EmbedDense(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(100, 8, rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)


def test_copied_param_bytes_leave_out_tables_read_only_by_row_lookups():
  """`OpGraph.copied_param_bytes`: an embedding table read by a row gather is not copied by a
  task (the program reads it in place); a dense layer's kernel and bias are; the same table
  also multiplied (a tied projection) is copied."""
  m = _EmbedDense(nnx.Rngs(0))

  def untied(model, ids):
    return jnp.mean(model.out(model.emb(ids)) ** 2)

  def tied(model, ids):
    h = model.emb(ids)
    return jnp.mean((h @ model.emb.embedding[...].T) ** 2) + jnp.mean(model.out(h) ** 2)

  ids = jax.ShapeDtypeStruct((16,), jnp.int32)
  g = graph.trace(m, untied, ids, max_nodes=1)
  (node,) = g.nodes
  assert node.param_bytes == (100 * 8 + 8 * 4 + 4) * 4
  assert g.copied_param_bytes(node) == (8 * 4 + 4) * 4
  g = graph.trace(m, tied, ids, max_nodes=1)
  assert g.copied_param_bytes(g.nodes[0]) == (100 * 8 + 8 * 4 + 4) * 4
