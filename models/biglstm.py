"""BigLSTM ("BIG LSTM", Jozefowicz et al. 2016, "Exploring the Limits of Language Modeling").

`embed` (vocabulary x 1024) -> `lstm_0`, `lstm_1` (8192 cells each, projected to 1024, Sak et al.
2014) -> `softmax` over the 793,471-word LM1B vocabulary. Training uses sampled softmax with 8192
negative samples (Jean et al. 2015); evaluation uses the full softmax. Each LSTM layer is one
`lax.scan` over the unroll and its own submodule (the planner puts one layer per device).

Sampled softmax and purity: the negative class ids are NOT drawn inside the loss. They are part of
the batch, `batch["sampled_ids"]`: int32 [num_sampled], shared by every example of the batch
(the only batch leaf without a leading batch dimension), drawn by `sample_candidates` from the
log-uniform (Zipf) distribution of TF's `log_uniform_candidate_sampler`, which assumes ids are
sorted by decreasing frequency (true for the LM1B vocabulary). Every batch function of this module
adds them; `with_sampled_ids` adds them to a batch from a loader.

Assumption (documented): each unroll window starts from a zero LSTM state (lm_1b carries the state
across windows); this keeps the loss a pure function of parameters and batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.models import config_checks
from jaxhybrid.models.lstm import LSTM, uniform_init

SAMPLED_IDS = "sampled_ids"  # the batch key of the shared negative samples


@dataclasses.dataclass(frozen=True, kw_only=True)
class BigLSTMConfig:
  """BigLSTM hyperparameters.

  Reference parameter count (paper preset): Jozefowicz et al. 2016, Table 1, "2-Layer
  LSTM-8192-1024 (BIG LSTM)": 1.8B (given to two significant digits only). The architecture as
  published counts exactly V*E + 2*(4H(E+P) + 4H + HP) + V*P + V = 1,776,882,559 with V = 793,471,
  E = P = 1,024, H = 8,192 (embedding 812.5M, LSTMs 151.1M, softmax 813.3M); this implementation
  has exactly that many `nnx.Param` values, which rounds to the paper's 1.8B (1.3 % below the
  rounded figure, i.e. within its rounding interval [1.75B, 1.85B)).

  Usage: `jaxhybrid.models.get("biglstm", "paper")`.
  """

  # Word vocabulary of LM1B (Chelba et al. 2013), ids sorted by decreasing frequency.
  vocab_size: int = 793471
  # Input embedding size.
  embed_size: int = 1024
  # LSTM cells per layer.
  hidden_size: int = 8192
  # Projection (recurrent state and output) size per layer.
  proj_size: int = 1024
  # Number of stacked LSTM layers.
  num_layers: int = 2
  # Negative samples per training batch for sampled softmax (0 = full softmax in training).
  num_sampled: int = 8192
  # Truncated-BPTT length: tokens per example.
  unroll: int = 20
  # Constant added to the forget-gate pre-activation (lm_1b / TF LSTMCell default 1.0).
  forget_bias: float = 1.0
  # LSTM weights drawn from U(-init_scale, init_scale); None = 1/sqrt(hidden_size).
  init_scale: float | None = None
  # Computation dtype name.
  dtype: str = "float32"
  # Parameter storage dtype name.
  param_dtype: str = "float32"
  # Consecutive time chunks each LSTM layer runs as its own graph node (1 = the whole unroll in
  # one node). The math is unchanged (the state is carried from chunk to chunk); with chunks a
  # planner can run layer l on chunk c while layer l + 1 runs chunk c - 1 (PAPER.md's wavefront)
  # without splitting the batch into micro-batches. Must divide `unroll`.
  time_chunks: int = 1

  def __post_init__(self):
    config_checks.check_fields(
      self, non_negative=("num_sampled",), positive=("init_scale",))
    if self.num_layers < 1 or self.unroll < 1:
      raise ValueError(f"num_layers={self.num_layers} and unroll={self.unroll} must be >= 1.")
    if self.time_chunks < 1 or self.unroll % self.time_chunks:
      raise ValueError(
        f"time_chunks={self.time_chunks} must be >= 1 and divide unroll={self.unroll}: pick a divisor."
      )
    if not 0 <= self.num_sampled < self.vocab_size:
      raise ValueError(
        f"num_sampled={self.num_sampled} must be in [0, vocab_size={self.vocab_size})."
      )

  @classmethod
  def paper(cls) -> BigLSTMConfig:
    """BIG LSTM: 2 x LSTM-8192-1024, vocabulary 793,471, 8192 samples, unroll 20 (1.78B params)."""
    return cls()

  @classmethod
  def small(cls) -> BigLSTMConfig:
    """CPU demo size: vocabulary 10,000, 2 x LSTM-1024-256, 512 samples (~0.35 s/step, B=32)."""
    return cls(vocab_size=10000, embed_size=256, hidden_size=1024, proj_size=256, num_sampled=512)

  @classmethod
  def tiny(cls) -> BigLSTMConfig:
    """Test size: vocabulary 500, 2 x LSTM-64-32, 16 samples, unroll 8."""
    return cls(vocab_size=500, embed_size=32, hidden_size=64, proj_size=32, num_sampled=16,
               unroll=8)


def log_uniform_prob(ids: jax.Array | np.ndarray, vocab_size: int):
  """P(k) = (log(k + 2) - log(k + 1)) / log(V + 1), the log-uniform (Zipf) candidate distribution.

  Source: TensorFlow's `log_uniform_candidate_sampler` documentation. Works on numpy or jax arrays.
  """
  xp = jnp if isinstance(ids, jax.Array) else np
  k = ids.astype(xp.float32)
  return (xp.log1p(1.0 / (k + 1.0))) / math.log(vocab_size + 1.0)


def sample_candidates(rng: np.random.Generator, num_sampled: int, vocab_size: int) -> np.ndarray:
  """Draws `num_sampled` ids with replacement from the log-uniform distribution.

  Inverse CDF of `log_uniform_prob`: k = floor(exp(u * log(V + 1))) - 1, u ~ U[0, 1).

  Returns:
    int32 [num_sampled].
  """
  u = rng.random(num_sampled)
  ids = np.floor(np.exp(u * math.log(vocab_size + 1.0))).astype(np.int64) - 1
  return np.clip(ids, 0, vocab_size - 1).astype(np.int32)


class Softmax(nnx.Module):
  """Output layer: logits = h W^T + b over the vocabulary; sampled or full cross-entropy."""

  def __init__(self, in_features: int, vocab_size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.vocab_size = vocab_size
    init = uniform_init(in_features**-0.5)
    self.kernel = nnx.Param(init(rngs.params(), (vocab_size, in_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((vocab_size,), param_dtype))

  def __call__(self, h: jax.Array, targets: jax.Array,
               sampled_ids: jax.Array | None = None) -> jax.Array:
    """Per-position loss.

    Sampled softmax (Jean et al. 2015; TF `sampled_softmax_loss` with `remove_accidental_hits`):
    logits of the true class and of the shared samples are corrected by -log(expected count),
    expected count = num_sampled * P(k) (sampling with replacement); samples equal to the target
    are masked out; the loss is the cross-entropy of the true class among [true, samples].

    Args:
      h: [batch, time, in_features].
      targets: int [batch, time].
      sampled_ids: int32 [num_sampled] or None for the full softmax.

    Returns:
      float32 [batch, time] loss.
    """
    dt = self.dtype
    h = h.astype(dt)
    w = self.kernel[...].astype(dt)
    b = self.bias[...].astype(dt)
    if sampled_ids is None:
      logits = (h @ w.T + b).astype(jnp.float32)  # [batch, time, vocab]
      logp = jax.nn.log_softmax(logits, axis=-1)
      return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    s = sampled_ids.shape[0]
    true_logit = jnp.sum(h * w[targets], axis=-1) + b[targets]  # [batch, time]
    log_q_true = jnp.log(s * log_uniform_prob(targets, self.vocab_size))
    true_logit = true_logit.astype(jnp.float32) - log_q_true
    samp = (h @ w[sampled_ids].T + b[sampled_ids]).astype(jnp.float32)  # [batch, time, samples]
    samp = samp - jnp.log(s * log_uniform_prob(sampled_ids, self.vocab_size))
    hit = targets[..., None] == sampled_ids  # accidental hits
    samp = jnp.where(hit, -1e30, samp)
    logits = jnp.concatenate([true_logit[..., None], samp], axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - true_logit


class BigLSTM(nnx.Module):
  """LSTM language model; `__call__(inputs [B, T]) -> hidden states [B, T, proj_size]`."""

  def __init__(self, config: BigLSTMConfig, *, dtype=None, param_dtype=None, rngs: nnx.Rngs):
    """Builds the network.

    Args:
      config: the hyperparameters.
      dtype: computation dtype; default `config.dtype`.
      param_dtype: parameter dtype; default `config.param_dtype`.
      rngs: random streams for initialisation.
    """
    self.config = config
    dt = jnp.dtype(dtype or config.dtype)
    pdt = jnp.dtype(param_dtype or config.param_dtype)
    kw = dict(dtype=dt, param_dtype=pdt, rngs=rngs)
    self.embed = nnx.Embed(config.vocab_size, config.embed_size,
                           embedding_init=uniform_init(config.embed_size**-0.5), **kw)
    size = config.embed_size
    for i in range(config.num_layers):
      layer = LSTM(size, config.hidden_size, proj_size=config.proj_size,
                   forget_bias=config.forget_bias, init_scale=config.init_scale, **kw)
      setattr(self, f"lstm_{i}", layer)
      size = layer.out_features
    self.softmax = Softmax(size, config.vocab_size, **kw)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    x = self.embed(inputs)
    chunks = self.config.time_chunks
    if chunks > 1:  # layers pass lists of time chunks (see BigLSTMConfig.time_chunks)
      x = jnp.split(x, chunks, axis=1)
    for i in range(self.config.num_layers):
      x = getattr(self, f"lstm_{i}")(x)
    return jnp.concatenate(x, axis=1) if chunks > 1 else x

  def logits(self, inputs: jax.Array) -> jax.Array:
    """Full-vocabulary logits [batch, time, vocab] (evaluation / generation)."""
    h = self(inputs).astype(self.softmax.dtype)
    return h @ self.softmax.kernel[...].astype(h.dtype).T + self.softmax.bias[...].astype(h.dtype)


def loss_fn(model: BigLSTM, batch: dict[str, jax.Array]) -> jax.Array:
  """Training loss: mean per-token sampled-softmax loss (full softmax if no `sampled_ids`).

  Args:
    model: the network.
    batch: {"inputs": int32 [B, T], "targets": int32 [B, T], "sampled_ids": int32 [S]}.

  Returns:
    Scalar mean over examples and positions.
  """
  h = model(batch["inputs"])
  return jnp.mean(model.softmax(h, batch["targets"], batch.get(SAMPLED_IDS)))


def eval_loss_fn(model: BigLSTM, batch: dict[str, jax.Array]) -> jax.Array:
  """Evaluation loss: mean full-softmax cross-entropy (log perplexity); ignores `sampled_ids`."""
  h = model(batch["inputs"])
  return jnp.mean(model.softmax(h, batch["targets"], None))


def batch_spec(config: BigLSTMConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
  """Abstract batch: inputs/targets [B, unroll] int32, plus sampled_ids [num_sampled] int32."""
  spec = {
    "inputs": jax.ShapeDtypeStruct((batch_size, config.unroll), jnp.int32),
    "targets": jax.ShapeDtypeStruct((batch_size, config.unroll), jnp.int32),
  }
  if config.num_sampled:
    spec[SAMPLED_IDS] = jax.ShapeDtypeStruct((config.num_sampled,), jnp.int32)
  return spec


def with_sampled_ids(config: BigLSTMConfig, batch: dict[str, np.ndarray],
                     seed: int) -> dict[str, np.ndarray]:
  """Returns `batch` plus freshly drawn `sampled_ids` (if the config samples)."""
  out = dict(batch)
  if config.num_sampled:
    rng = np.random.default_rng([seed, 0x5A3])  # separate stream from the token data
    out[SAMPLED_IDS] = sample_candidates(rng, config.num_sampled, config.vocab_size)
  return out


def synthetic_batch(config: BigLSTMConfig, seed: int, batch_size: int) -> dict[str, np.ndarray]:
  """Uniform random tokens (no structure; for timing) with sampled ids."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (batch_size, config.unroll + 1), dtype=np.int32)
  return with_sampled_ids(config, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, seed)
