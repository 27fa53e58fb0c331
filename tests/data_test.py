"""Tests of the real-file loaders and the generated tasks (small files written by the tests)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from PIL import Image

from jaxhybrid.models import biglstm, data, gnmt, tasks


def _write(path, text: str) -> str:
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return str(path)


def _one_line_error(excinfo, *needles: str) -> None:
  msg = str(excinfo.value)
  assert "\n" not in msg
  for n in needles:
    assert n in msg, (n, msg)


def test_vocabulary_from_file_and_tokenizer(tmp_path):
  path = _write(tmp_path / "vocab.txt", "the 10\ncat 5\n<unk> 1\nsat 3\n")
  vocab = data.Vocabulary.from_file(path)
  assert vocab.tokens == ("<pad>", "<s>", "</s>", "<unk>", "the", "cat", "sat")
  assert vocab.encode("the cat  sat on") == [4, 5, 6, 3]
  assert vocab.decode([4, 5]) == "the cat"
  built = data.Vocabulary.build(["b a b", "c b a"], max_size=6)
  assert built.tokens == ("<pad>", "<s>", "</s>", "<unk>", "b", "a")
  built.save(str(tmp_path / "saved.txt"))
  assert data.Vocabulary.from_file(str(tmp_path / "saved.txt")) == built


def test_vocabulary_errors(tmp_path):
  missing = str(tmp_path / "nope.txt")
  with pytest.raises(ValueError) as e:
    data.Vocabulary.from_file(missing)
  _one_line_error(e, missing, "one token per line")
  dup = _write(tmp_path / "dup.txt", "a\nb\na\n")
  with pytest.raises(ValueError) as e:
    data.Vocabulary.from_file(dup)
  _one_line_error(e, dup, "'a' twice")
  empty = _write(tmp_path / "empty.txt", "\n\n")
  with pytest.raises(ValueError) as e:
    data.Vocabulary.from_file(empty)
  _one_line_error(e, empty, "empty")
  binary = tmp_path / "bin.txt"
  binary.write_bytes(b"\xff\xfe\x00abc")
  with pytest.raises(ValueError) as e:
    data.Vocabulary.from_file(str(binary))
  _one_line_error(e, str(binary), "UTF-8")


def test_lm1b_batches(tmp_path):
  vocab_path = _write(tmp_path / "vocab.txt", "<S>\n</S>\n<UNK>\nthe\ncat\nsat\n")
  shards = tmp_path / "train"
  shards.mkdir()
  _write(shards / "news.en-00001", "the cat sat\nthe dog sat\n" * 10)
  _write(shards / "news.en-00002", "cat sat\n" * 10)
  batches = list(data.lm1b_batches(str(shards), vocab_path, batch_size=2, unroll=5))
  vocab = data.Vocabulary.from_file(vocab_path, specials=data.LM1B_SPECIALS)
  # 20 sentences of 5 tokens + 10 of 4 = 140 tokens -> 2 streams of 70 -> 13 windows of 5.
  assert len(batches) == 13
  for b in batches:
    assert b["inputs"].shape == b["targets"].shape == (2, 5)
    assert b["inputs"].dtype == np.int32
  stream0 = np.concatenate([b["inputs"][0] for b in batches])
  np.testing.assert_array_equal(batches[0]["targets"][:, :-1], batches[0]["inputs"][:, 1:])
  np.testing.assert_array_equal(batches[1]["inputs"][:, 0], batches[0]["targets"][:, -1])
  assert vocab.decode(stream0[:10]) == "<S> the cat sat </S> <S> the <UNK> sat </S>"


def test_lm1b_errors(tmp_path):
  vocab_path = _write(tmp_path / "vocab.txt", "<S>\n</S>\n<UNK>\nthe\n")
  missing = str(tmp_path / "missing")
  with pytest.raises(ValueError) as e:
    data.lm1b_batches(missing, vocab_path, batch_size=2, unroll=4)
  _one_line_error(e, missing, "one sentence per line")
  short = _write(tmp_path / "short.txt", "the\n")
  with pytest.raises(ValueError) as e:
    data.lm1b_batches(short, vocab_path, batch_size=2, unroll=4)
  _one_line_error(e, short, "too few")


def test_parallel_text_batches(tmp_path):
  vocab_path = _write(tmp_path / "vocab.bpe", "a\nb\nc\nx\ny\nz\n")
  src = _write(tmp_path / "train.en", "a b c\na\n\nc c c c c c\n")
  tgt = _write(tmp_path / "train.de", "x y z\nx\ny\nz z z z z z\n")
  batches = list(data.parallel_text_batches(src, tgt, vocab_path, batch_size=3,
                                            max_source_length=4, max_target_length=5))
  assert len(batches) == 1  # the empty-source pair is skipped
  b = batches[0]
  assert b["src"].shape == (3, 4) and b["tgt_in"].shape == b["tgt_out"].shape == (3, 5)
  vocab = data.Vocabulary.from_file(vocab_path)
  a, c, x, y, z = (vocab.index[w] for w in "acxyz")
  np.testing.assert_array_equal(b["src"][0], [a, vocab.index["b"], c, 0])
  np.testing.assert_array_equal(b["tgt_in"][0], [gnmt.BOS_ID, x, y, z, 0])
  np.testing.assert_array_equal(b["tgt_out"][0], [x, y, z, gnmt.EOS_ID, 0])
  np.testing.assert_array_equal(b["src"][2], [c] * 4)  # truncated
  np.testing.assert_array_equal(b["tgt_out"][2], [z, z, z, z, gnmt.EOS_ID])


def test_parallel_text_errors(tmp_path):
  vocab_path = _write(tmp_path / "vocab.txt", "a\n")
  src = _write(tmp_path / "s.txt", "a\na\n")
  tgt = _write(tmp_path / "t.txt", "a\n")
  with pytest.raises(ValueError) as e:
    data.parallel_text_batches(src, tgt, vocab_path, batch_size=1, max_source_length=2,
                               max_target_length=3)
  _one_line_error(e, src, tgt, "line-aligned")
  missing = str(tmp_path / "none.de")
  with pytest.raises(ValueError) as e:
    data.parallel_text_batches(src, missing, vocab_path, batch_size=1, max_source_length=2,
                               max_target_length=3)
  _one_line_error(e, missing, "target text")


def _image_folder(root) -> str:
  colours = {"cat": (255, 0, 0), "dog": (0, 0, 255)}
  for name, rgb in colours.items():
    os.makedirs(root / name)
    Image.new("RGB", (40, 30), rgb).save(root / name / "a.png")
    Image.new("RGB", (30, 50), rgb).save(root / name / "b.JPEG", quality=95)
  _write(root / "dog" / "notes.txt", "not an image")
  return str(root)


def test_image_folder_batches(tmp_path):
  root = _image_folder(tmp_path / "imagenet")
  classes, items = data.list_image_folder(root)
  assert classes == ("cat", "dog") and len(items) == 4
  batches = list(data.image_folder_batches(root, image_size=16, batch_size=2))
  assert len(batches) == 2
  images = np.concatenate([b["images"] for b in batches])
  labels = np.concatenate([b["labels"] for b in batches])
  assert images.shape == (4, 16, 16, 3) and images.dtype == np.float32
  np.testing.assert_array_equal(labels, [0, 0, 1, 1])
  np.testing.assert_allclose(images[0].mean((0, 1)), [1.0, -1.0, -1.0], atol=0.02)
  np.testing.assert_allclose(images[3].mean((0, 1)), [-1.0, -1.0, 1.0], atol=0.05)
  shuffled = np.concatenate([b["labels"] for b in data.image_folder_batches(
    root, image_size=8, batch_size=1, shuffle_seed=3)])
  assert sorted(shuffled) == [0, 0, 1, 1]


def test_image_folder_errors(tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(ValueError) as e:
    data.image_folder_batches(missing, image_size=8, batch_size=1)
  _one_line_error(e, missing, "one sub-folder per class")
  flat = tmp_path / "flat"
  flat.mkdir()
  Image.new("RGB", (8, 8)).save(flat / "x.png")
  with pytest.raises(ValueError) as e:
    data.image_folder_batches(str(flat), image_size=8, batch_size=1)
  _one_line_error(e, str(flat), "no class sub-folders")
  bad = tmp_path / "bad"
  (bad / "cls").mkdir(parents=True)
  _write(bad / "cls" / "broken.jpg", "not a jpeg")
  it = data.image_folder_batches(str(bad), image_size=8, batch_size=1)
  with pytest.raises(ValueError) as e:
    next(it)
  _one_line_error(e, str(bad / "cls" / "broken.jpg"), "JPEG or PNG")


def test_markov_language_structure():
  cfg = biglstm.BigLSTMConfig.tiny()
  task = tasks.MarkovLanguage(config=cfg, branching=3)
  b = task(0, 16)
  assert b["inputs"].shape == (16, cfg.unroll)
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  # Every transition is one of the word's successors.
  for prev, nxt in zip(b["inputs"].ravel(), b["targets"].ravel()):
    assert nxt in task.successors[prev]
  assert task.entropy_rate < math.log(3) < math.log(cfg.vocab_size)
  np.testing.assert_array_equal(task(0, 16)["inputs"], b["inputs"])
  assert not np.array_equal(task(1, 16)["inputs"], b["inputs"])
  assert b[biglstm.SAMPLED_IDS].shape == (cfg.num_sampled,)


def test_token_mapping_translation_structure():
  cfg = gnmt.GNMTConfig.tiny()
  for reverse in (False, True):
    task = tasks.TokenMappingTranslation(config=cfg, reverse=reverse)
    b = task(5, 32)
    for src, tin, tout in zip(b["src"], b["tgt_in"], b["tgt_out"]):
      words = src[src != gnmt.PAD_ID]
      mapped = task.mapping[words]
      want = mapped[::-1] if reverse else mapped
      n = len(words)
      assert 2 <= n <= min(cfg.max_source_length, cfg.max_target_length - 1)
      np.testing.assert_array_equal(tout[:n], want)
      assert tout[n] == gnmt.EOS_ID and tin[0] == gnmt.BOS_ID
      np.testing.assert_array_equal(tin[1:n + 1], want)
  assert sorted(task.mapping) == list(range(cfg.vocab_size))  # a permutation


def test_class_template_images_are_separable():
  task = tasks.ClassTemplateImages(image_size=33, num_classes=10, grid=4, noise_std=1.0)
  b = task(0, 64)
  assert b["images"].shape == (64, 33, 33, 3) and b["labels"].shape == (64,)
  # The nearest class template recovers the label: real, learnable structure.
  reps = -(-33 // 4)
  t = task.templates.repeat(reps, 1).repeat(reps, 2)[:, :33, :33]
  dist = ((b["images"][:, None] - t[None]) ** 2).sum(axis=(2, 3, 4))
  assert (dist.argmin(1) == b["labels"]).mean() > 0.95
  with pytest.raises(ValueError, match="grid=0"):
    tasks.ClassTemplateImages(image_size=8, num_classes=2, grid=0)
