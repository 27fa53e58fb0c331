"""experiments/bench/chain_model.py: the benchmarks' uniform chain and its overrides."""

from __future__ import annotations

import pytest
from conftest import experiment_module


def test_chain_spec_overrides_and_rejects_unknown_keys():
  cm = experiment_module("chain_model")
  spec = cm.spec(width="32", layers=3)  # --set values arrive as ints or strings
  assert (spec.width, spec.layers, spec.features) == (32, 3, 64)
  batch = spec.synthetic_batch(0, 5)
  assert batch["x"].shape == batch["y"].shape == (5, 64)
  assert cm.spec().width == 256  # the class defaults are untouched
  with pytest.raises(ValueError, match="takes width, layers, features"):
    cm.spec(depth=3)
