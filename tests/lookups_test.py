"""Parameter tables read by row lookups: found in the node's jaxpr, their gradients added as rows
(`jaxhybrid.program.lookups`), exact against the single-device reference, and smaller."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from program_test import assert_matches_reference, build

from jaxhybrid import graph as graph_lib
from jaxhybrid.program import gradients
from jaxhybrid.program import lookups as lookups_lib

V, D = 40, 8


def _find(fn, *avals):
  closed = jax.make_jaxpr(fn)(*avals)
  return lookups_lib.find(closed, [0])


def test_row_gathers_of_a_table_are_found():
  w = jax.ShapeDtypeStruct((V, D), jnp.float32)
  ids = jax.ShapeDtypeStruct((3, 5), jnp.int32)
  (lk,) = _find(lambda t, i: t[i], w, ids)
  assert (lk.arg, lk.table_shape, lk.rows, lk.row_elems, lk.out_shape) == (0, (V, D), 15, D, (3, 5, D))
  # jnp.take inside its own jit call, clip mode; two lookups of one table; a 1-D table (a bias).
  (lk,) = _find(lambda t, i: jnp.take(t, i, axis=0, mode="clip"), w, ids)
  assert lk.mode == "clip" and lk.elems == 15 * D
  assert len(_find(lambda t, i: t[i].sum() + t[i + 1].sum(), w, ids)) == 2
  (lk,) = _find(lambda b, i: b[i], jax.ShapeDtypeStruct((V,), jnp.float32), ids)
  assert lk.row_elems == 1 and lk.out_shape == (3, 5)


def test_tables_read_another_way_keep_their_dense_gradient():
  w = jax.ShapeDtypeStruct((V, D), jnp.float32)
  ids = jax.ShapeDtypeStruct((3,), jnp.int32)
  h = jax.ShapeDtypeStruct((2, D), jnp.float32)
  assert _find(lambda t, i, x: t[i].sum() + (x @ t.T).sum(), w, ids, h) == ()  # tied projection
  assert _find(lambda t, i: t.astype(jnp.bfloat16)[i], w, ids) == ()  # cast before the lookup
  assert _find(lambda t, i: t[:, i], w, ids) == ()  # columns, not rows
  assert _find(lambda t, i: t[i, 2:4], w, ids) == ()  # part of each row
  assert _find(lambda t, i: t, w, ids) == ()  # returned as it is


def test_flax_embeddings_are_lookups():
  ids = jnp.zeros((2, 3), jnp.int32)
  lin = nn.Embed(V, D)
  params = jax.eval_shape(lin.init, jax.random.key(0), ids)["params"]
  (lk,) = _find(lambda p, i: lin.apply({"params": p}, i), params, ids)
  assert lk.table_shape == (V, D)
  emb = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  (lk,) = _find(lambda t, i: jnp.take(t, i, axis=0), emb.embedding[...], ids)
  assert lk.rows == 6


class Table(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (V, D)))

  def __call__(self, ids):  # ids past the table are clamped (mode='clip')
    return jnp.take(self.w[...], ids, axis=0, mode="clip")


class Head(nnx.Module):
  """A sampled-softmax-like head: the target's row and the shared samples' rows of w and b."""

  def __init__(self, rngs):
    self.w = nnx.Param(0.1 * jax.random.normal(rngs.params(), (V, D)))
    self.b = nnx.Param(jnp.zeros((V,)))

  def __call__(self, h, y, s):
    w, b = self.w[...], self.b[...]
    true = jnp.sum(h * w[y], axis=-1) + b[y]
    samp = h @ w[s].T + b[s]
    logits = jnp.concatenate([true[..., None], samp], axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - true)


class Lookups(nnx.Module):
  def __init__(self, rngs):
    self.emb = Table(rngs)
    self.mid = nnx.Linear(D, D, rngs=rngs)
    self.head = Head(rngs)


def _loss(m, batch):
  return m.head(jnp.tanh(m.mid(m.emb(batch["x"]))), batch["y"], batch["s"])


def _batch(n, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, V + 5, (n, 3)).astype(np.int32)  # some past the table: clamped
  x[:, 0] = 7  # a row read many times
  return {"x": x, "y": rng.integers(0, V, (n, 3)).astype(np.int32),
          "s": rng.integers(0, V, (6,)).astype(np.int32)}


def _on_two(node):
  return 0 if node.name.startswith("emb") else 1


@pytest.mark.parametrize("mesh_spec,k,zero,schedule", [
  ("1x1", 1, 0, "1f1b"), ("1x2", 2, 0, "1f1b"), ("2x2", 2, 2, "gpipe"), ("2x2", 1, 1, "zb"),
  ("2x1", 2, 2, "1f1b"),
])
def test_row_gradients_match_reference(mesh_spec, k, zero, schedule):
  model = Lookups(nnx.Rngs(0))
  batch = _batch(8)
  opt = optax.adam(1e-2)
  assign = _on_two if mesh_spec.endswith("x2") else (lambda n: 0)
  prog, p, s, pure = build(model, _loss, batch, mesh_spec, assign, k, opt, zero=zero,
                           schedule=schedule)
  found = [lk for n in prog.graph.nodes for lk in prog.calls.lookups(n.id)]
  assert len(found) == 5  # the embedding, then w and b for the targets and for the samples
  # No window of any group carries a looked-up table's gradient.
  kinds = dict(zip(prog.graph.jaxpr.invars, prog.graph.input_kinds))
  tables = {kinds[n.invars[lk.arg]][1] for n in prog.graph.nodes for lk in prog.calls.lookups(n.id)}
  windows = gradients.gradient_windows(prog.structure, prog.graph, prog.layout,
                                       lookups=prog.calls.lookups)
  assert not tables & {i for ws in windows for w in ws or () for lv in w.leaves for i in lv}
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_row_gradients_shrink_the_compiled_step():
  """A 4 MiB table at 1x2 with two micro-batches: without row gradients each gradient task
  returns a table-sized window; with them the compiled step is smaller by at least half a
  table, and the memory model's window term knows it."""
  global V, D
  v0, d0 = V, D
  V, D = 4096, 256
  try:
    model = nnx.eval_shape(lambda: Lookups(nnx.Rngs(0)))
    spec = {"x": jax.ShapeDtypeStruct((16, 3), jnp.int32),
            "y": jax.ShapeDtypeStruct((16, 3), jnp.int32),
            "s": jax.ShapeDtypeStruct((6,), jnp.int32)}
    table = V * D * 4
    reports = {}
    for sparse in (True, False):
      from jaxhybrid import mesh as mesh_lib
      from jaxhybrid import program as program_lib
      from jaxhybrid.api import microbatch_spec
      mesh = mesh_lib.make("1x2")
      mb, per_example = microbatch_spec(spec, 16, 8)
      _, p, s, pure = graph_lib.nnx_pure_loss(model, _loss)
      g = graph_lib.trace_function(pure, p, s, mb)
      prog = program_lib.HybridProgram.build(
        g, mesh, optax.adam(1e-3), [_on_two(n) for n in g.nodes], microbatches=2,
        per_example=per_example, sparse_lookups=sparse)
      reports[sparse] = prog.memory()
    assert reports[True].compiled + table // 2 <= reports[False].compiled
    assert reports[True].window + table // 2 <= reports[False].window
  finally:
    V, D = v0, d0
