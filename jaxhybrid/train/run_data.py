"""The training data of a run: step -> global batch, a deterministic function of (seed, step).

Synthetic and generated batches come from the model's spec; a data folder is read once into
batches that are cycled, reshuffled each epoch by (seed, epoch), so `--resume` sees the same
batches as an uninterrupted run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxhybrid import errors

DATA_KINDS = ("synthetic", "generated")  # or a path (see `make_batch_fn`)


def step_seed(seed: int, step: int) -> int:
  """A 32-bit seed that is a deterministic function of (run seed, step)."""
  return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint32)[0])


def _epoch_cycler(batches: list[Any], seed: int, post: Callable[[Any, int], Any]) -> Callable[[int], Any]:
  """Step -> batch over fixed batches, reshuffled each epoch by (seed, epoch)."""
  n = len(batches)

  def batch_fn(step: int) -> Any:
    epoch, i = divmod(step, n)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return post(batches[order[i]], step)

  return batch_fn


def make_batch_fn(spec: Any, data: str, seed: int, global_batch: int) -> Callable[[int], Any]:
  """Step -> global batch, a deterministic function of (seed, step).

  Args:
    spec: the model's `ModelSpec`.
    data: 'synthetic', 'generated', or a path: biglstm: a folder with vocab.txt and train.txt (or
      a train/ folder of shards); gnmt: a folder with train.src, train.tgt and vocab.txt;
      inception_v3: an ImageNet-style folder of class folders.
    seed: the run's seed.
    global_batch: examples per step.

  Raises:
    UsageError: an unknown data kind or an unreadable data folder.
  """
  if data == "synthetic":
    return lambda s: spec.synthetic_batch(step_seed(seed, s), global_batch)
  if data == "generated":
    return lambda s: spec.generated_task(step_seed(seed, s), global_batch)
  if not os.path.exists(data):
    raise errors.UsageError(
      f"--data={data!r} is neither {' nor '.join(DATA_KINDS)} nor an existing path: pass one of "
      "those or the data folder")
  from jaxhybrid.models import biglstm
  from jaxhybrid.models import data as data_lib

  cfg = spec.config
  try:
    if spec.name == "biglstm":
      vocab = data_lib.Vocabulary.from_file(os.path.join(data, "vocab.txt"), specials=data_lib.LM1B_SPECIALS)
      _check_vocab(len(vocab), cfg.vocab_size)
      text = os.path.join(data, "train") if os.path.isdir(os.path.join(data, "train")) else os.path.join(data, "train.txt")
      batches = list(data_lib.lm1b_batches(text, vocab, batch_size=global_batch, unroll=cfg.unroll))
      post = lambda b, s: biglstm.with_sampled_ids(cfg, b, step_seed(seed, s))  # noqa: E731
    elif spec.name == "gnmt":
      vocab = data_lib.Vocabulary.from_file(os.path.join(data, "vocab.txt"))
      _check_vocab(len(vocab), cfg.vocab_size)
      batches = list(data_lib.parallel_text_batches(
        os.path.join(data, "train.src"), os.path.join(data, "train.tgt"), vocab,
        batch_size=global_batch, max_source_length=cfg.max_source_length,
        max_target_length=cfg.max_target_length))
      post = lambda b, s: b  # noqa: E731
    else:
      batches = list(data_lib.image_folder_batches(data, image_size=cfg.image_size, batch_size=global_batch))
      post = lambda b, s: b  # noqa: E731
  except ValueError as e:
    raise errors.UsageError(f"--data={data!r}: {e}") from None
  if not batches:
    raise errors.UsageError(
      f"--data={data!r} holds less than one global batch of {global_batch}: add data or lower --batch")
  return _epoch_cycler(batches, seed, post)


def _check_vocab(have: int, model: int) -> None:
  if have > model:
    raise errors.UsageError(
      f"the data's vocabulary has {have} tokens but the model's vocab_size is {model}: "
      f"pass --set vocab_size={have}")
