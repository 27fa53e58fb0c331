"""One LSTM layer as one module: a single `jax.lax.scan` over time.

GNMT and BigLSTM stack these layer by layer (never a fused multi-layer cell), so that each layer is
its own graph node and the planner can put consecutive layers on different devices.

The cell is the standard LSTM (Hochreiter & Schmidhuber 1997, with the forget gate of Gers et al.
2000), optionally with the output projection of Sak et al. 2014 ("LSTMP": the recurrent state is
`h W_proj`), as used by BigLSTM (Jozefowicz et al. 2016):

  z_t = x_t W_ih + r_{t-1} W_hh + b          # [batch, 4 * hidden], gate order (i, f, g, o)
  c_t = sigmoid(f + forget_bias) * c_{t-1} + sigmoid(i) * tanh(g)
  h_t = sigmoid(o) * tanh(c_t)
  r_t = h_t W_proj  (or h_t without projection)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def uniform_init(scale: float) -> nnx.Initializer:
  """Initializer drawing from U(-scale, scale) (the LSTM init of PyTorch, GNMT and lm_1b)."""

  def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    return jax.random.uniform(key, shape, dtype, -scale, scale)

  return init


class LSTM(nnx.Module):
  """A single (optionally projected, optionally reversed) LSTM layer over a whole sequence.

  The input transform `x W_ih + b` is one matmul over all time steps; only the recurrent part runs
  inside the `lax.scan`.
  """

  def __init__(
    self,
    in_features: int,
    hidden_size: int,
    *,
    proj_size: int | None = None,
    forget_bias: float = 0.0,
    reverse: bool = False,
    init_scale: float | None = None,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype = jnp.float32,
    rngs: nnx.Rngs,
  ):
    """Builds the layer.

    Args:
      in_features: size of each input vector.
      hidden_size: number of LSTM cells.
      proj_size: if set, the recurrent state and the output are `h W_proj` of this size (LSTMP).
      forget_bias: constant added to the forget-gate pre-activation (not a parameter).
      reverse: run from the last time step to the first (backward half of a bidirectional layer).
      init_scale: weights and bias are drawn from U(-init_scale, init_scale); default
        1/sqrt(hidden_size) (PyTorch's LSTM default).
      dtype: computation dtype.
      param_dtype: parameter storage dtype.
      rngs: random streams for initialisation.
    """
    if hidden_size <= 0 or in_features <= 0:
      raise ValueError(f"LSTM sizes must be positive, got in={in_features}, hidden={hidden_size}.")
    self.hidden_size = hidden_size
    self.proj_size = proj_size
    self.forget_bias = forget_bias
    self.reverse = reverse
    self.dtype = dtype
    scale = init_scale if init_scale is not None else hidden_size**-0.5
    init = uniform_init(scale)
    rec = proj_size or hidden_size
    self.w_ih = nnx.Param(init(rngs.params(), (in_features, 4 * hidden_size), param_dtype))
    self.w_hh = nnx.Param(init(rngs.params(), (rec, 4 * hidden_size), param_dtype))
    self.bias = nnx.Param(init(rngs.params(), (4 * hidden_size,), param_dtype))
    if proj_size is not None:
      self.w_proj = nnx.Param(init(rngs.params(), (hidden_size, proj_size), param_dtype))
    else:
      self.w_proj = None

  @property
  def out_features(self) -> int:
    return self.proj_size or self.hidden_size

  def __call__(self, x: jax.Array | Sequence[jax.Array], mask: jax.Array | Sequence[jax.Array] | None = None):
    """Runs the layer over a batch of sequences from a zero state.

    Args:
      x: inputs, [batch, time, in_features]; or a list of consecutive time chunks of them
        ([batch, time_c, in_features] each): then each chunk runs in its own named scope `t<c>`
        (its input transform and its part of the recurrence, the state carried over from the
        chunk before), so the chunks become their own graph nodes and a later layer's chunk c
        needs only this layer's chunk c (a wavefront across devices, as in PAPER.md).
      mask: optional [batch, time] with 1 for real tokens and 0 for padding (chunked like `x`
        when `x` is). At padded steps the state is held and the output is zero, so a reversed
        layer effectively starts at each sequence's last real token.

    Returns:
      Outputs, [batch, time, out_features]; a list of chunks for chunked inputs.
    """
    chunked = isinstance(x, (list, tuple))
    xs = list(x) if chunked else [x]
    if mask is None:
      masks = [None] * len(xs)
    else:
      masks = list(mask) if chunked else [mask]
      if len(masks) != len(xs):
        raise ValueError(f"{len(xs)} input chunks but {len(masks)} mask chunks: chunk both alike.")
    carry, outs = None, [None] * len(xs)
    for i in (reversed(range(len(xs))) if self.reverse else range(len(xs))):
      with jax.named_scope(f"t{i}") if chunked else contextlib.nullcontext():
        carry, outs[i] = self._run(xs[i], masks[i], carry)
    return outs if chunked else outs[0]

  def _run(self, x: jax.Array, mask: jax.Array | None, carry: tuple | None) -> tuple[tuple, jax.Array]:
    """The layer over `x` ([batch, time, in]) from `carry` (None: zeros); (final carry, outputs)."""
    dt = self.dtype
    batch = x.shape[0]
    w_hh = self.w_hh[...].astype(dt)
    w_proj = None if self.w_proj is None else self.w_proj[...].astype(dt)
    # [batch, time, 4 * hidden]: the input transform for all steps at once.
    xw = x.astype(dt) @ self.w_ih[...].astype(dt) + self.bias[...].astype(dt)
    xw = jnp.swapaxes(xw, 0, 1)  # [time, batch, 4 * hidden]
    if mask is None:
      m = jnp.ones(xw.shape[:2] + (1,), dt)
    else:
      m = jnp.swapaxes(mask, 0, 1)[..., None].astype(dt)  # [time, batch, 1]
    if carry is None:
      carry = (jnp.zeros((batch, self.hidden_size), dt), jnp.zeros((batch, self.out_features), dt))

    def step(carry, inputs):
      c, r = carry
      z_t, m_t = inputs
      z = z_t + r @ w_hh
      i, f, g, o = jnp.split(z, 4, axis=-1)
      c_new = jax.nn.sigmoid(f + self.forget_bias) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h_new = jax.nn.sigmoid(o) * jnp.tanh(c_new)
      r_new = h_new if w_proj is None else h_new @ w_proj
      c = m_t * c_new + (1 - m_t) * c
      r = m_t * r_new + (1 - m_t) * r
      return (c, r), r_new * m_t

    carry, ys = jax.lax.scan(step, carry, (xw, m), reverse=self.reverse)
    return carry, jnp.swapaxes(ys, 0, 1)  # [batch, time, out_features]


class BiLSTM(nnx.Module):
  """Bidirectional layer: a forward and a backward `LSTM`, outputs concatenated (GNMT encoder 0).

  The two directions are separate submodules (`forward`, `backward`), so a planner grouping at
  depth 2 can run them on different devices.
  """

  def __init__(
    self,
    in_features: int,
    hidden_size: int,
    *,
    forget_bias: float = 0.0,
    init_scale: float | None = None,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype = jnp.float32,
    rngs: nnx.Rngs,
  ):
    """Builds both directions; arguments as for `LSTM`."""
    kw = dict(
      forget_bias=forget_bias, init_scale=init_scale, dtype=dtype, param_dtype=param_dtype,
      rngs=rngs,
    )
    self.forward = LSTM(in_features, hidden_size, reverse=False, **kw)
    self.backward = LSTM(in_features, hidden_size, reverse=True, **kw)

  @property
  def out_features(self) -> int:
    return 2 * self.forward.out_features

  def __call__(self, x, mask=None):
    """[batch, time, in] -> [batch, time, 2 * hidden]; lists of time chunks chunk by chunk."""
    fwd, bwd = self.forward(x, mask), self.backward(x, mask)
    if isinstance(x, (list, tuple)):
      return [jnp.concatenate([f, b], axis=-1) for f, b in zip(fwd, bwd)]
    return jnp.concatenate([fwd, bwd], axis=-1)
