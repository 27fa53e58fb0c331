"""Small hand-written models shared by the tests (LSTM stack, tied weights, linen twin)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

VOCAB, DIM = 20, 8


class Cell(nnx.Module):
  """A plain LSTM layer: one scan over time."""

  def __init__(self, din: int, h: int, *, rngs: nnx.Rngs):
    self.wx = nnx.Linear(din, 4 * h, rngs=rngs)
    self.wh = nnx.Linear(h, 4 * h, use_bias=False, rngs=rngs)
    self.h = h

  def __call__(self, xs):  # [batch, time, din] -> [batch, time, h]
    b = xs.shape[0]

    def step(carry, x):
      h, c = carry
      i, f, g, o = jnp.split(self.wx(x) + self.wh(h), 4, -1)
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h = jax.nn.sigmoid(o) * jnp.tanh(c)
      return (h, c), h

    init = (jnp.zeros((b, self.h)), jnp.zeros((b, self.h)))
    _, hs = jax.lax.scan(step, init, jnp.swapaxes(xs, 0, 1))
    return jnp.swapaxes(hs, 0, 1)


class LSTMNet(nnx.Module):
  """embed -> lstm -> lstm -> (tied or untied) output."""

  def __init__(self, *, tied: bool = False, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.l0 = Cell(DIM, DIM, rngs=rngs)
    self.l1 = Cell(DIM, DIM, rngs=rngs)
    self.tied = tied
    if not tied:
      self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

  def __call__(self, x):
    h = self.l1(self.l0(self.embed(x)))
    return self.embed.attend(h) if self.tied else self.out(h)


def lstm_loss(m, batch):
  logits = m(batch["x"])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def lstm_batch(batch_size: int, time: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "x": rng.integers(0, VOCAB, (batch_size, time)).astype(np.int32),
    "y": rng.integers(0, VOCAB, (batch_size, time)).astype(np.int32),
  }


class Towers(nnx.Module):
  """Two independent MLP towers summed: the textbook 2-way MP case."""

  def __init__(self, width: int = 16, *, rngs: nnx.Rngs):
    self.a = MLP(width, rngs=rngs)
    self.b = MLP(width, rngs=rngs)

  def __call__(self, x):
    return self.a(x) + self.b(x)


class MLP(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(DIM, width, rngs=rngs)
    self.l2 = nnx.Linear(width, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


class LinenMLP(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="l2")(jax.nn.relu(nn.Dense(self.width, name="l1")(x)))


class LinenTowers(nn.Module):
  width: int = 16

  def setup(self):
    self.a = LinenMLP(self.width)
    self.b = LinenMLP(self.width)

  def __call__(self, x):
    return self.a(x) + self.b(x)


def mse_nnx(m, batch):
  return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)


def regression_batch(batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(batch_size, DIM)).astype(np.float32),
    "y": rng.normal(size=(batch_size, 4)).astype(np.float32),
  }


class Exchange(nnx.Module):
  """Four towers whose second layers read their neighbours' first layers: all-way transfers."""

  def __init__(self, width: int = 8, *, rngs: nnx.Rngs):
    self.first = nnx.List([nnx.Linear(DIM, width, rngs=rngs) for _ in range(4)])
    self.second = nnx.List([nnx.Linear(width, 4, rngs=rngs) for _ in range(4)])

  def __call__(self, x):
    h = [jax.nn.relu(f(x)) for f in self.first]
    return sum(s(h[i] * h[(i + 1) % 4] + h[(i + 2) % 4]) for i, s in enumerate(self.second))


class Chain(nnx.Module):
  """input -> `layers` equal tanh layers -> head: a uniform pipeline."""

  def __init__(self, width: int = 32, layers: int = 4, *, rngs: nnx.Rngs):
    self.inp = nnx.Linear(DIM, width, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])
    self.head = nnx.Linear(width, 4, rngs=rngs)

  def __call__(self, x):
    h = self.inp(x)
    for layer in self.layers:
      h = jnp.tanh(layer(h))
    return self.head(h)


def chain_stage(node, devices: int, layers: int = 4) -> int:
  """Chain layers split evenly over `devices`; the input on the first, the rest on the last."""
  parts = node.name.split("/")
  if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
    return int(parts[1]) * devices // layers
  return 0 if parts[0] == "inp" else devices - 1
