"""What a node keeps for its backward (`jaxhybrid.graph.residuals`, `OpGraph.saved_bytes`) and
the planner's per-micro-batch memory that reads it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxhybrid import graph

F32 = jnp.float32


class _Recurrence(nn.Module):
  """h_t = tanh(h_{t-1} W + x_t) over T steps: its backward needs every step's h."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.1), (x.shape[-1], x.shape[-1]))

    def step(h, xt):
      h = jnp.tanh(h @ w + xt)
      return h, None

    h, _ = jax.lax.scan(step, jnp.zeros_like(x[:, 0]), jnp.swapaxes(x, 0, 1))
    return h


class _RecurrentHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="head")(_Recurrence(name="rec")(x))


def test_saved_bytes_count_the_residuals_a_node_keeps_not_only_its_outputs():
  b, t, d = 4, 16, 32
  model = _RecurrentHead()
  x = jnp.ones((b, t, d), F32)
  params = model.init(jax.random.PRNGKey(0), x)
  g = graph.trace(model, lambda p, batch: jnp.mean(model.apply(p, batch["x"]) ** 2),
                  {"x": x}, params=params, depth=1)
  by = {n.name: n for n in g.nodes}
  rec, head = by["rec"], by["head"]
  assert rec.out_bytes == b * d * 4
  # The recurrence keeps every step's hidden state (T x B x D floats) besides its output.
  assert g.saved_bytes(rec) >= rec.out_bytes + t * b * d * 4 - b * d * 4
  # The head (dense layer and the squared-error loss) keeps the dense output (B x 4 floats) for
  # the square's derivative; its pullback also holds the dense input and weight, the node's
  # inputs, which are held already and not counted again.
  assert head.out_bytes == 4  # the loss
  assert g.saved_bytes(head) == head.out_bytes + b * 4 * 4
  # The planner's per-micro-batch memory reads it; 'outputs' is the old count.
  from jaxhybrid import costs as costs_lib
  from jaxhybrid import planner

  c = costs_lib.AnalyticCostModel("dgx1-v100")
  saved = planner.Problem.from_graph(g, c, planner.PlannerOptions(devices=2))
  outs = planner.Problem.from_graph(
    g, c, planner.PlannerOptions(devices=2, activation_model="outputs"))
  i = [n.name for n in g.nodes].index("rec")
  assert saved.activation_bytes[i] == g.saved_bytes(rec) > outs.activation_bytes[i] == rec.out_bytes
