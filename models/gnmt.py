"""GNMT (Wu et al. 2016) as in NVIDIA's "GNMT v2" (DeepLearningExamples / MLPerf), in Flax NNX.

Encoder: shared embedding -> `encoder_0` bidirectional LSTM -> `encoder_1` LSTM -> `encoder_2..`
LSTMs with residual connections (from the third layer on). Decoder: `decoder_0` LSTM over the
target embeddings; `attention` (normalised Bahdanau) computed for all steps at once with
`decoder_0`'s outputs as queries and the encoder outputs as keys/values (GNMT v2: attention fed
from the first decoder layer, no input feeding); `decoder_1..` LSTMs whose input is
[previous output, context], residual from the third layer on; `classifier` over the shared
vocabulary. Each layer is one `lax.scan` and its own submodule, so the planner can put layers on
different devices (wavefront / pipeline).

Token conventions: 0 = padding, 1 = begin-of-sentence, 2 = end-of-sentence, other ids are words.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.models import config_checks, losses
from jaxhybrid.models.lstm import LSTM, BiLSTM, uniform_init

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3  # ids below this are never words


@dataclasses.dataclass(frozen=True, kw_only=True)
class GNMTConfig:
  """GNMT v2 hyperparameters.

  Reference parameter count (paper preset, 4+4 layers, vocabulary 32,320): 160,671,297, the number
  printed by NVIDIA's PyTorch GNMT v2 / MLPerf GNMT reference. The difference to ours is that
  PyTorch LSTMs carry two bias vectors (b_ih and b_hh) where we have one: 9 LSTM
  layer-directions x 4,096 = 36,864 fewer parameters (0.023 %), i.e. 160,634,433.

  Usage: `jaxhybrid.models.get("gnmt", "paper")`; 8+8 layers:
  `get("gnmt", "paper", num_encoder_layers=8, num_decoder_layers=8)`.
  """

  # Shared source/target vocabulary (NVIDIA: 32,000 BPE merges + specials, padded to 32,320).
  vocab_size: int = 32320
  # LSTM units per layer and direction; also the embedding and attention size.
  hidden_size: int = 1024
  # Encoder layers; the first is bidirectional (4 in GNMT v2, 8 in Wu et al. 2016).
  num_encoder_layers: int = 4
  # Decoder layers; the first feeds the attention.
  num_decoder_layers: int = 4
  # Index of the first layer with a residual connection (2 = "from the third layer").
  residual_start: int = 2
  # One embedding table for source and target (GNMT v2 shares it).
  share_embedding: bool = True
  # Label-smoothing mass of the training loss (GNMT v2: 0.1).
  label_smoothing: float = 0.1
  # Source sequence length of a batch (GNMT v2 trains with max length 50).
  max_source_length: int = 50
  # Target sequence length of a batch (positions incl. BOS/EOS).
  max_target_length: int = 50
  # All weights are drawn from U(-init_scale, init_scale) (GNMT v2's init_weight = 0.1).
  init_scale: float = 0.1
  # Constant added to the forget-gate pre-activation (GNMT v2: 0, PyTorch LSTM).
  forget_bias: float = 0.0
  # Computation dtype name.
  dtype: str = "float32"
  # Parameter storage dtype name.
  param_dtype: str = "float32"
  # Consecutive time chunks each LSTM layer (and the attention's queries) runs as its own graph
  # node (1 = whole sequences). The math is unchanged (state carried from chunk to chunk); with
  # chunks a planner can overlap consecutive layers over time without micro-batches (PAPER.md's
  # wavefront). The bidirectional first encoder layer's backward direction ends at chunk 0, so
  # the encoder's layer 1 waits for it; the decoder needs the whole encoder (attention). Must
  # divide both sequence lengths.
  time_chunks: int = 1

  def __post_init__(self):
    config_checks.check_fields(
      self, non_negative=("residual_start",), unit_interval=("label_smoothing",),
      positive=("init_scale",))
    if (self.time_chunks < 1 or self.max_source_length % self.time_chunks
        or self.max_target_length % self.time_chunks):
      raise ValueError(
        f"time_chunks={self.time_chunks} must be >= 1 and divide max_source_length="
        f"{self.max_source_length} and max_target_length={self.max_target_length}: pick a divisor."
      )
    if self.num_encoder_layers < 2 or self.num_decoder_layers < 2:
      raise ValueError(
        f"GNMT needs >= 2 encoder and decoder layers, got {self.num_encoder_layers}+"
        f"{self.num_decoder_layers}."
      )
    if self.vocab_size <= NUM_SPECIAL:
      raise ValueError(f"vocab_size={self.vocab_size} must exceed the {NUM_SPECIAL} special ids.")
    if self.max_source_length < 1 or self.max_target_length < 2:
      raise ValueError(
        f"max_source_length={self.max_source_length} must be >= 1 and max_target_length="
        f"{self.max_target_length} >= 2."
      )

  @classmethod
  def paper(cls) -> GNMTConfig:
    """GNMT v2: 4+4 layers of 1024 units, 32,320-token shared vocabulary (160.6M parameters)."""
    return cls()

  @classmethod
  def small(cls) -> GNMTConfig:
    """CPU demo size: 4+4 layers of 256 units, vocabulary 4,000, length 20 (~0.4 s/step, B=32)."""
    return cls(vocab_size=4000, hidden_size=256, max_source_length=20, max_target_length=20)

  @classmethod
  def tiny(cls) -> GNMTConfig:
    """Test size: 4+4 layers of 32 units, vocabulary 64, length 8."""
    return cls(vocab_size=64, hidden_size=32, max_source_length=8, max_target_length=8)


class BahdanauAttention(nnx.Module):
  """Normalised Bahdanau (additive) attention, GNMT v2 style.

  score(q, k) = g * (v / ||v||) . tanh(q W_q + k W_k + b)    (Bahdanau et al. 2015, with the
  weight normalisation of Salimans & Kingma 2016 as in GNMT v2; g is initialised to 1/sqrt(units)).
  The context is the softmax-weighted sum of the (unprojected) keys.
  """

  def __init__(self, query_size: int, key_size: int, num_units: int, *, init_scale: float,
               dtype, param_dtype, rngs: nnx.Rngs):
    init = uniform_init(init_scale)
    self.dtype = dtype
    self.w_query = nnx.Param(init(rngs.params(), (query_size, num_units), param_dtype))
    self.w_key = nnx.Param(init(rngs.params(), (key_size, num_units), param_dtype))
    self.v = nnx.Param(init(rngs.params(), (num_units,), param_dtype))
    self.g = nnx.Param(jnp.full((), num_units**-0.5, param_dtype))
    self.b = nnx.Param(jnp.zeros((num_units,), param_dtype))

  def __call__(self, queries, keys: jax.Array, key_mask: jax.Array):
    """Context vectors for all query steps.

    Args:
      queries: [batch, t_q, query_size] (outputs of the first decoder layer), or a list of time
        chunks of them: then the keys are projected once (scope `keys`) and each chunk's
        contexts computed in its own scope `t<c>` (its own graph node).
      keys: [batch, t_k, key_size] (encoder outputs; also the values).
      key_mask: [batch, t_k], 1 for real source tokens.

    Returns:
      [batch, t_q, key_size] contexts (a list of chunks for chunked queries).
    """
    dt = self.dtype
    if not isinstance(queries, (list, tuple)):
      return self._contexts(queries, keys.astype(dt) @ self.w_key[...].astype(dt), keys, key_mask)
    with jax.named_scope("keys"):
      k = keys.astype(dt) @ self.w_key[...].astype(dt)
    out = []
    for c, q in enumerate(queries):
      with jax.named_scope(f"t{c}"):
        out.append(self._contexts(q, k, keys, key_mask))
    return out

  def _contexts(self, queries: jax.Array, k: jax.Array, keys: jax.Array, key_mask: jax.Array) -> jax.Array:
    """Contexts of `queries` given the projected keys `k` ([batch, t_k, units])."""
    dt = self.dtype
    q = queries.astype(dt) @ self.w_query[...].astype(dt)  # [batch, t_q, units]
    v = self.v[...].astype(dt)
    v = self.g[...].astype(dt) * v / jnp.linalg.norm(v)
    hidden = jnp.tanh(q[:, :, None, :] + k[:, None, :, :] + self.b[...].astype(dt))
    scores = hidden @ v  # [batch, t_q, t_k]
    scores = jnp.where(key_mask[:, None, :] > 0, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dt)
    return weights @ keys.astype(dt)  # [batch, t_q, key_size]


def _add(a, b):
  """a + b, chunk by chunk for lists of time chunks."""
  return [x + y for x, y in zip(a, b)] if isinstance(a, list) else a + b


def _concat_features(a, b):
  """[a, b] along the feature axis, chunk by chunk for lists of time chunks."""
  if isinstance(a, list):
    return [jnp.concatenate([x, y], axis=-1) for x, y in zip(a, b)]
  return jnp.concatenate([a, b], axis=-1)


class GNMT(nnx.Module):
  """Encoder-decoder; `__call__(src, tgt_in) -> logits [batch, t_tgt, vocab]` (teacher forcing)."""

  def __init__(self, config: GNMTConfig, *, dtype=None, param_dtype=None, rngs: nnx.Rngs):
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
    h, v = config.hidden_size, config.vocab_size
    init = uniform_init(config.init_scale)
    kw = dict(dtype=dt, param_dtype=pdt, rngs=rngs)
    lstm_kw = dict(forget_bias=config.forget_bias, init_scale=config.init_scale, **kw)
    self.embed = nnx.Embed(v, h, embedding_init=init, **kw)
    self.tgt_embed = None if config.share_embedding else nnx.Embed(v, h, embedding_init=init, **kw)
    self.encoder_0 = BiLSTM(h, h, **lstm_kw)
    self.encoder_1 = LSTM(2 * h, h, **lstm_kw)
    for i in range(2, config.num_encoder_layers):
      setattr(self, f"encoder_{i}", LSTM(h, h, **lstm_kw))
    self.decoder_0 = LSTM(h, h, **lstm_kw)
    self.attention = BahdanauAttention(h, h, h, init_scale=config.init_scale, **kw)
    for i in range(1, config.num_decoder_layers):
      setattr(self, f"decoder_{i}", LSTM(2 * h, h, **lstm_kw))
    self.classifier = nnx.Linear(h, v, kernel_init=init, bias_init=init, **kw)

  def _split(self, x: jax.Array):
    """`x` [batch, time, ...] as a list of `time_chunks` chunks (unchanged if 1)."""
    n = self.config.time_chunks
    return jnp.split(x, n, axis=1) if n > 1 else x

  def _join(self, x) -> jax.Array:
    return jnp.concatenate(x, axis=1) if isinstance(x, list) else x

  def encode(self, src: jax.Array) -> jax.Array:
    """[batch, t_src] int -> encoder outputs [batch, t_src, hidden]."""
    mask = self._split((src != PAD_ID).astype(jnp.float32))
    x = self.encoder_0(self._split(self.embed(src)), mask)
    x = self.encoder_1(x, mask)
    for i in range(2, self.config.num_encoder_layers):
      y = getattr(self, f"encoder_{i}")(x, mask)
      x = _add(y, x) if i >= self.config.residual_start else y
    return self._join(x)

  def decode(self, enc: jax.Array, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
    """Teacher-forced decoder: returns logits [batch, t_tgt, vocab]."""
    embed = self.tgt_embed if self.tgt_embed is not None else self.embed
    x = self.decoder_0(self._split(embed(tgt_in)))  # [batch, t_tgt, hidden] (or its chunks)
    context = self.attention(x, enc, (src != PAD_ID).astype(jnp.float32))
    for i in range(1, self.config.num_decoder_layers):
      y = getattr(self, f"decoder_{i}")(_concat_features(x, context))
      x = _add(y, x) if i >= self.config.residual_start else y
    return self.classifier(self._join(x))

  def __call__(self, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
    return self.decode(self.encode(src), src, tgt_in)


def loss_fn(model: GNMT, batch: dict[str, jax.Array]) -> jax.Array:
  """Label-smoothed cross-entropy, summed over each sentence's target tokens, mean over sentences.

  Per example: sum over non-padding target positions / max_target_length (a fixed constant, so the
  loss is a plain mean over examples and the mean over equal micro-batches equals the full-batch
  loss; GNMT v2 likewise sums over tokens and divides by the number of sentences).

  Args:
    model: the network.
    batch: {"src": int32 [B, S], "tgt_in": int32 [B, T], "tgt_out": int32 [B, T]}.

  Returns:
    Scalar mean loss.
  """
  logits = model(batch["src"], batch["tgt_in"])
  tok = losses.smoothed_cross_entropy(logits, batch["tgt_out"], model.config.label_smoothing)
  mask = (batch["tgt_out"] != PAD_ID).astype(tok.dtype)
  return jnp.mean(jnp.sum(tok * mask, axis=1) / batch["tgt_out"].shape[1])


def batch_spec(config: GNMTConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
  """Abstract batch: src [B, S], tgt_in [B, T], tgt_out [B, T], all int32."""
  s, t = config.max_source_length, config.max_target_length
  return {
    "src": jax.ShapeDtypeStruct((batch_size, s), jnp.int32),
    "tgt_in": jax.ShapeDtypeStruct((batch_size, t), jnp.int32),
    "tgt_out": jax.ShapeDtypeStruct((batch_size, t), jnp.int32),
  }


def make_target(words: np.ndarray, lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, ...]:
  """Builds (tgt_in, tgt_out) = ([BOS] + words, words + [EOS]), padded/truncated to max_len.

  Args:
    words: int [B, L] target word ids (padding beyond each length is ignored).
    lengths: int [B] number of words per sentence.
    max_len: T, the target length of the batch.

  Returns:
    (tgt_in, tgt_out), each int32 [B, max_len].
  """
  b = words.shape[0]
  tgt_in = np.zeros((b, max_len), np.int32)
  tgt_out = np.zeros((b, max_len), np.int32)
  for i in range(b):
    n = min(int(lengths[i]), max_len - 1)
    tgt_in[i, 0] = BOS_ID
    tgt_in[i, 1:n + 1] = words[i, :n]
    tgt_out[i, :n] = words[i, :n]
    tgt_out[i, n] = EOS_ID
  return tgt_in, tgt_out


def synthetic_batch(config: GNMTConfig, seed: int, batch_size: int) -> dict[str, np.ndarray]:
  """Uniform random words filling every position (worst-case length; for timing)."""
  rng = np.random.default_rng(seed)
  s, t = config.max_source_length, config.max_target_length
  src = rng.integers(NUM_SPECIAL, config.vocab_size, (batch_size, s), dtype=np.int32)
  words = rng.integers(NUM_SPECIAL, config.vocab_size, (batch_size, t), dtype=np.int32)
  tgt_in, tgt_out = make_target(words, np.full((batch_size,), t - 1), t)
  return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}
