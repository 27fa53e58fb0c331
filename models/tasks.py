"""Small generated tasks with real, learnable structure, one per model family.

They exist so that steps-to-target versus batch size (statistical efficiency, the E(B) of the
projection) can be measured on a CPU without any download. Each task is a frozen dataclass whose
fixed structure (transition table, token mapping, class templates) depends only on `task_seed`;
calling it with `(seed, batch_size)` draws a fresh batch of examples from that structure, so
batches with different seeds are i.i.d. samples of one task.

- `MarkovLanguage` (BigLSTM): a first-order Markov chain over the vocabulary; every word has
  `branching` successors with Zipf-weighted probabilities. The best achievable loss is the chain's
  entropy rate (`entropy_rate`), far below log(vocab_size).
- `TokenMappingTranslation` (GNMT): target = a fixed permutation of the source words, optionally in
  reverse order; deterministic, so the achievable loss is the label-smoothing floor.
- `ClassTemplateImages` (Inception-V3): each class is a fixed low-resolution random template,
  upsampled to the image size; an image is its class template plus Gaussian noise.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxhybrid.models import biglstm, gnmt


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarkovLanguage:
  """First-order Markov chain language for the BigLSTM family."""

  # The model's config (vocabulary, unroll, number of sampled negatives).
  config: biglstm.BigLSTMConfig
  # Successors per word; the per-step entropy is at most log(branching).
  branching: int = 4
  # Seed of the fixed transition table.
  task_seed: int = 1234

  def __post_init__(self):
    if not 1 <= self.branching <= self.config.vocab_size:
      raise ValueError(f"branching={self.branching} must be in [1, {self.config.vocab_size}].")

  @functools.cached_property
  def successors(self) -> np.ndarray:
    """int32 [vocab, branching]: the possible next words of each word (log-uniform, Zipf-like)."""
    rng = np.random.default_rng(self.task_seed)
    v = self.config.vocab_size
    return biglstm.sample_candidates(rng, v * self.branching, v).reshape(v, self.branching)

  @property
  def successor_probs(self) -> np.ndarray:
    """float64 [branching]: P(j-th successor) proportional to 1/(j+1)."""
    p = 1.0 / np.arange(1, self.branching + 1)
    return p / p.sum()

  @property
  def entropy_rate(self) -> float:
    """Upper bound on the chain's entropy in nats/token (exact when successors are distinct)."""
    p = self.successor_probs
    return float(-(p * np.log(p)).sum())

  def __call__(self, seed: int, batch_size: int) -> dict[str, np.ndarray]:
    """Draws `batch_size` windows of unroll + 1 tokens; returns inputs, targets, sampled_ids."""
    rng = np.random.default_rng(seed)
    t = self.config.unroll
    table = self.successors
    cum = np.cumsum(self.successor_probs)
    tokens = np.empty((batch_size, t + 1), np.int32)
    tokens[:, 0] = biglstm.sample_candidates(rng, batch_size, self.config.vocab_size)
    for i in range(t):
      j = np.minimum(np.searchsorted(cum, rng.random(batch_size)), self.branching - 1)
      tokens[:, i + 1] = table[tokens[:, i], j]
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return biglstm.with_sampled_ids(self.config, batch, seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenMappingTranslation:
  """Deterministic word-to-word translation for the GNMT family."""

  # The model's config (vocabulary, source/target lengths).
  config: gnmt.GNMTConfig
  # Emit the mapped words in reverse order (harder: needs non-monotonic attention).
  reverse: bool = False
  # Shortest source sentence (words); the longest is min(max_source_length, max_target_length-1).
  min_length: int = 2
  # Seed of the fixed word permutation.
  task_seed: int = 1234

  @property
  def max_length(self) -> int:
    return min(self.config.max_source_length, self.config.max_target_length - 1)

  def __post_init__(self):
    if not 1 <= self.min_length <= self.max_length:
      raise ValueError(f"min_length={self.min_length} must be in [1, {self.max_length}].")

  @functools.cached_property
  def mapping(self) -> np.ndarray:
    """int32 [vocab]: target word of each source word (identity on the special ids)."""
    rng = np.random.default_rng(self.task_seed)
    words = np.arange(gnmt.NUM_SPECIAL, self.config.vocab_size, dtype=np.int32)
    return np.concatenate([np.arange(gnmt.NUM_SPECIAL, dtype=np.int32), rng.permutation(words)])

  def __call__(self, seed: int, batch_size: int) -> dict[str, np.ndarray]:
    """Draws sentence pairs; returns src, tgt_in, tgt_out (padded with 0)."""
    rng = np.random.default_rng(seed)
    cfg = self.config
    lengths = rng.integers(self.min_length, self.max_length + 1, batch_size)
    src = np.zeros((batch_size, cfg.max_source_length), np.int32)
    tgt = np.zeros((batch_size, self.max_length), np.int32)
    for i, n in enumerate(lengths):
      words = rng.integers(gnmt.NUM_SPECIAL, cfg.vocab_size, n, dtype=np.int32)
      src[i, :n] = words
      mapped = self.mapping[words]
      tgt[i, :n] = mapped[::-1] if self.reverse else mapped
    tgt_in, tgt_out = gnmt.make_target(tgt, lengths, cfg.max_target_length)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassTemplateImages:
  """Class templates plus noise for the Inception-V3 family."""

  # Square image size in pixels.
  image_size: int
  # Number of classes.
  num_classes: int
  # Templates are grid x grid x 3 standard-normal values, upsampled (nearest) to the image size.
  grid: int = 8
  # Standard deviation of the per-pixel Gaussian noise (templates have unit variance).
  noise_std: float = 1.0
  # Seed of the fixed templates.
  task_seed: int = 1234

  def __post_init__(self):
    if self.grid < 1 or self.grid > self.image_size or self.noise_std < 0:
      raise ValueError(
        f"grid={self.grid} must be in [1, image_size={self.image_size}] and noise_std="
        f"{self.noise_std} >= 0."
      )

  @functools.cached_property
  def templates(self) -> np.ndarray:
    """float32 [classes, grid, grid, 3]."""
    rng = np.random.default_rng(self.task_seed)
    return rng.standard_normal((self.num_classes, self.grid, self.grid, 3), dtype=np.float32)

  def __call__(self, seed: int, batch_size: int) -> dict[str, np.ndarray]:
    """Draws labelled images: images float32 [B, S, S, 3], labels int32 [B]."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, self.num_classes, batch_size, dtype=np.int32)
    reps = -(-self.image_size // self.grid)  # ceil
    t = self.templates[labels].repeat(reps, axis=1).repeat(reps, axis=2)
    t = t[:, :self.image_size, :self.image_size]
    noise = rng.standard_normal(t.shape, dtype=np.float32)
    return {"images": t + np.float32(self.noise_std) * noise, "labels": labels}
