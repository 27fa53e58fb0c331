"""The README's "use the planner on your own module" examples (experiments/examples/) run and match
the single-device reference."""

from __future__ import annotations

import os
import runpy

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                        "examples")


@pytest.mark.parametrize("name", ["own_nnx.py", "own_linen.py"])
def test_example_trains_like_single_device(name):
  module = runpy.run_path(os.path.join(EXAMPLES, name), run_name="example")
  hybrid, reference = module["main"]()
  assert len(hybrid) == 4 and all(np.isfinite(hybrid))
  np.testing.assert_allclose(hybrid, reference, rtol=1e-5)
  assert hybrid[-1] < hybrid[0]


def test_the_readme_points_at_the_examples():
  text = open(os.path.join(os.path.dirname(os.path.dirname(EXAMPLES)), "README.md")).read()
  for name in ("own_nnx.py", "own_linen.py", "--mesh=16x2", "--resume", "results.json"):
    assert name in text
