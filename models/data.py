"""Loaders for real local data files in their usual formats (no downloads).

- `Vocabulary`: a simple word-level tokenizer (whitespace split + vocabulary lookup, unknown words
  map to the unknown token). It stands in for GNMT's BPE and LM1B's word vocabulary; swap in a
  subword tokenizer by producing the same id arrays.
- `lm1b_batches`: LM1B-style text (one sentence per line; a file or a folder of shard files) and a
  vocabulary file -> BigLSTM batches {"inputs", "targets"} [B, unroll] (add the shared negative
  samples with `biglstm.with_sampled_ids`).
- `parallel_text_batches`: WMT-style parallel text (two files, line i of one translates line i of
  the other) and a shared vocabulary file -> GNMT batches {"src", "tgt_in", "tgt_out"}.
- `image_folder_batches`: ImageNet-style class folders (`root/<class>/<image>.jpg|png`) ->
  Inception batches {"images" [B, S, S, 3] in [-1, 1], "labels"}.

Every loader checks its paths before returning its iterator: a missing or malformed path raises a
one-line `ValueError` naming the path and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from jaxhybrid.models import gnmt

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
GNMT_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0, 1, 2 match gnmt.PAD/BOS/EOS_ID
LM1B_SPECIALS = ("<S>", "</S>", "<UNK>")  # the special tokens of the LM1B vocabulary file


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """Word vocabulary and word-level tokenizer (ids are positions in `tokens`)."""

  # All tokens in id order.
  tokens: tuple[str, ...]
  # The token that unknown words map to (must be in `tokens`).
  unk: str

  def __post_init__(self):
    if len(set(self.tokens)) != len(self.tokens):
      raise ValueError("Vocabulary tokens must be unique; remove the duplicates.")
    if self.unk not in self.index:
      raise ValueError(f"Unknown-word token {self.unk!r} is not in the vocabulary; add it.")

  @functools.cached_property
  def index(self) -> dict[str, int]:
    return {t: i for i, t in enumerate(self.tokens)}

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def unk_id(self) -> int:
    return self.index[self.unk]

  def encode(self, text: str) -> list[int]:
    """Splits on whitespace and maps each word to its id (unknown words to `unk_id`)."""
    unk = self.unk_id
    return [self.index.get(w, unk) for w in text.split()]

  def decode(self, ids: Iterable[int]) -> str:
    return " ".join(self.tokens[int(i)] for i in ids)

  @classmethod
  def from_file(cls, path: str, *, specials: Sequence[str] = GNMT_SPECIALS,
                unk: str | None = None) -> Vocabulary:
    """Reads a vocabulary file: one token per line (further fields on a line, e.g. counts, ignored).

    The `specials` come first, in the given order (so their ids are fixed), followed by the file's
    tokens in file order without repeats of the specials.

    Args:
      path: the vocabulary file.
      specials: tokens placed at ids 0, 1, ...
      unk: the unknown-word token; default the last of `specials`.

    Returns:
      The vocabulary.

    Raises:
      ValueError: the file is missing, empty, or lists a token twice.
    """
    lines = _read_lines(path, "a vocabulary file with one token per line")
    words = [ln.split()[0] for ln in lines if ln.strip()]
    if not words:
      raise ValueError(f"Vocabulary file {path!r} is empty; expected one token per line.")
    seen: set[str] = set()
    for w in words:
      if w in seen:
        raise ValueError(f"Vocabulary file {path!r} lists {w!r} twice; expected unique tokens.")
      seen.add(w)
    tokens = tuple(specials) + tuple(w for w in words if w not in set(specials))
    return cls(tokens, unk if unk is not None else specials[-1])

  @classmethod
  def build(cls, lines: Iterable[str], *, max_size: int | None = None,
            specials: Sequence[str] = GNMT_SPECIALS, unk: str | None = None) -> Vocabulary:
    """Builds a vocabulary from text: specials, then words by decreasing count (ties by word)."""
    counts: dict[str, int] = {}
    for line in lines:
      for w in line.split():
        counts[w] = counts.get(w, 0) + 1
    words = sorted((w for w in counts if w not in set(specials)), key=lambda w: (-counts[w], w))
    if max_size is not None:
      words = words[:max(0, max_size - len(specials))]
    return cls(tuple(specials) + tuple(words), unk if unk is not None else specials[-1])

  def save(self, path: str) -> None:
    """Writes one token per line (readable by `from_file`)."""
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(self.tokens) + "\n")


def _read_lines(path: str, expected: str) -> list[str]:
  if not os.path.isfile(path):
    raise ValueError(f"{path!r} is not a file; expected {expected}.")
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().splitlines()
  except UnicodeDecodeError as e:
    raise ValueError(f"{path!r} is not UTF-8 text ({e.reason}); expected {expected}.") from None


def _text_files(path: str) -> list[str]:
  """A text file, or the sorted regular files of a folder (LM1B ships 99/100 shard files)."""
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if os.path.isfile(os.path.join(path, f)) and not f.startswith("."))
    if files:
      return files
  raise ValueError(
    f"{path!r} is not a text file or a folder of text files; expected one sentence per line."
  )


def lm1b_batches(text_path: str, vocab: Vocabulary | str, *, batch_size: int, unroll: int,
                 shuffle_seed: int | None = None) -> Iterator[dict[str, np.ndarray]]:
  """One epoch of language-model batches from LM1B-style text.

  Each sentence becomes `<S> w_1 ... w_n </S>`; the sentences (optionally shuffled) are
  concatenated into one token stream, cut into `batch_size` equal contiguous streams, and read
  `unroll` tokens at a time (targets are the inputs shifted by one), as in lm_1b's data reader.
  The remainder that does not fill a whole window is dropped.

  Args:
    text_path: a text file or a folder of text files, one sentence per line.
    vocab: a `Vocabulary` or the path of a vocabulary file (read with `LM1B_SPECIALS`).
    batch_size: number of parallel streams B.
    unroll: tokens per window T.
    shuffle_seed: shuffle the sentences with this seed (None keeps file order).

  Returns:
    Iterator of {"inputs": int32 [B, T], "targets": int32 [B, T]}.

  Raises:
    ValueError: a missing/malformed path, or too little text for one batch.
  """
  if isinstance(vocab, str):
    vocab = Vocabulary.from_file(vocab, specials=LM1B_SPECIALS)
  files = _text_files(text_path)
  bos, eos = vocab.index.get("<S>"), vocab.index.get("</S>")
  if bos is None or eos is None:
    raise ValueError("The LM1B vocabulary needs '<S>' and '</S>'; build it with LM1B_SPECIALS.")
  sentences = [ln for f in files for ln in _read_lines(f, "text, one sentence per line")
               if ln.strip()]
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(len(sentences))
    sentences = [sentences[i] for i in order]
  stream = np.asarray([t for s in sentences for t in [bos, *vocab.encode(s), eos]], np.int32)
  per_stream = len(stream) // batch_size
  windows = (per_stream - 1) // unroll
  if windows < 1:
    raise ValueError(
      f"{text_path!r} holds {len(stream)} tokens, too few for one batch of {batch_size} x "
      f"{unroll + 1}; expected more text or a smaller batch."
    )
  streams = stream[:per_stream * batch_size].reshape(batch_size, per_stream)

  def gen():
    for w in range(windows):
      chunk = streams[:, w * unroll:(w + 1) * unroll + 1]
      yield {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}

  return gen()


def parallel_text_batches(src_path: str, tgt_path: str, vocab: Vocabulary | str, *,
                          batch_size: int, max_source_length: int, max_target_length: int,
                          shuffle_seed: int | None = None) -> Iterator[dict[str, np.ndarray]]:
  """One epoch of translation batches from WMT-style parallel text (word-level tokenizer).

  Sentences longer than the batch lengths are truncated (source to `max_source_length` words,
  target to `max_target_length - 1` words plus EOS); empty pairs are skipped; the last partial
  batch is dropped.

  Args:
    src_path: source-language text, one sentence per line.
    tgt_path: target-language text, line-aligned with `src_path`.
    vocab: a shared `Vocabulary` or a vocabulary file path (read with `GNMT_SPECIALS`, so that
      ids 0/1/2 are padding/BOS/EOS as GNMT expects).
    batch_size: sentence pairs per batch.
    max_source_length: S, padded source length.
    max_target_length: T, padded target length (incl. BOS/EOS).
    shuffle_seed: shuffle the pairs with this seed (None keeps file order).

  Returns:
    Iterator of {"src": int32 [B, S], "tgt_in": int32 [B, T], "tgt_out": int32 [B, T]}.

  Raises:
    ValueError: a missing/malformed path, files of different line counts, or a vocabulary whose
      first ids are not GNMT's specials.
  """
  if isinstance(vocab, str):
    vocab = Vocabulary.from_file(vocab, specials=GNMT_SPECIALS)
  if vocab.tokens[:3] != GNMT_SPECIALS[:3]:
    raise ValueError(
      f"Vocabulary starts with {vocab.tokens[:3]}; GNMT expects {GNMT_SPECIALS[:3]} at ids 0-2."
    )
  src_lines = _read_lines(src_path, "source text, one sentence per line")
  tgt_lines = _read_lines(tgt_path, "target text, one sentence per line")
  if len(src_lines) != len(tgt_lines):
    raise ValueError(
      f"{src_path!r} has {len(src_lines)} lines but {tgt_path!r} has {len(tgt_lines)}; expected "
      "line-aligned parallel text."
    )
  pairs = [(vocab.encode(s)[:max_source_length], vocab.encode(t)[:max_target_length - 1])
           for s, t in zip(src_lines, tgt_lines) if s.strip() and t.strip()]
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(len(pairs))
    pairs = [pairs[i] for i in order]

  def gen():
    for start in range(0, len(pairs) - batch_size + 1, batch_size):
      chunk = pairs[start:start + batch_size]
      src = np.zeros((batch_size, max_source_length), np.int32)
      words = np.zeros((batch_size, max_target_length), np.int32)
      lengths = np.zeros((batch_size,), np.int32)
      for i, (s, t) in enumerate(chunk):
        src[i, :len(s)] = s
        words[i, :len(t)] = t
        lengths[i] = len(t)
      tgt_in, tgt_out = gnmt.make_target(words, lengths, max_target_length)
      yield {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}

  return gen()


def list_image_folder(root: str) -> tuple[tuple[str, ...], list[tuple[str, int]]]:
  """Finds `root/<class>/<image>` files.

  Returns:
    (class names in label order (sorted), [(image path, label)] sorted by path).

  Raises:
    ValueError: root is not a folder, has no class folders, or no images.
  """
  expected = "a folder with one sub-folder per class holding .jpg/.jpeg/.png images"
  if not os.path.isdir(root):
    raise ValueError(f"{root!r} is not a folder; expected {expected}.")
  classes = tuple(sorted(d for d in os.listdir(root)
                         if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")))
  if not classes:
    raise ValueError(f"{root!r} has no class sub-folders; expected {expected}.")
  items = []
  for label, c in enumerate(classes):
    d = os.path.join(root, c)
    items += [(os.path.join(d, f), label) for f in sorted(os.listdir(d))
              if f.lower().endswith(IMAGE_EXTENSIONS)]
  if not items:
    raise ValueError(f"{root!r} has class folders but no images; expected {expected}.")
  return classes, items


def load_image(path: str, image_size: int) -> np.ndarray:
  """Decodes an image, resizes its shorter side to `image_size`, centre-crops a square.

  Returns:
    float32 [image_size, image_size, 3] scaled to [-1, 1] (Inception's preprocessing).

  Raises:
    ValueError: the file cannot be decoded by Pillow.
  """
  from PIL import Image, UnidentifiedImageError  # optional dependency, only for real images

  try:
    with Image.open(path) as im:
      im = im.convert("RGB")
      w, h = im.size
      scale = image_size / min(w, h)
      nw, nh = max(image_size, round(w * scale)), max(image_size, round(h * scale))
      im = im.resize((nw, nh), Image.BILINEAR)
      left, top = (nw - image_size) // 2, (nh - image_size) // 2
      im = im.crop((left, top, left + image_size, top + image_size))
      arr = np.asarray(im, dtype=np.float32)
  except (UnidentifiedImageError, OSError) as e:
    raise ValueError(f"{path!r} could not be decoded ({type(e).__name__}); expected a JPEG or "
                     "PNG image.") from None
  return arr / 127.5 - 1.0


def image_folder_batches(root: str, *, image_size: int, batch_size: int,
                         shuffle_seed: int | None = None) -> Iterator[dict[str, np.ndarray]]:
  """One epoch of image batches from ImageNet-style class folders (labels = sorted class index).

  Args:
    root: folder with one sub-folder per class.
    image_size: S, the square output size.
    batch_size: images per batch; the last partial batch is dropped.
    shuffle_seed: shuffle the images with this seed (None keeps path order).

  Returns:
    Iterator of {"images": float32 [B, S, S, 3], "labels": int32 [B]}.

  Raises:
    ValueError: a missing/malformed folder (at call time) or an undecodable image (when reached).
  """
  _, items = list_image_folder(root)
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(len(items))
    items = [items[i] for i in order]

  def gen():
    for start in range(0, len(items) - batch_size + 1, batch_size):
      chunk = items[start:start + batch_size]
      yield {
        "images": np.stack([load_image(p, image_size) for p, _ in chunk]),
        "labels": np.asarray([label for _, label in chunk], np.int32),
      }

  return gen()
