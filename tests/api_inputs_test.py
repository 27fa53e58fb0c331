"""`parallelize`'s bad inputs are one-line ValueErrors that say what to do; the interleaved
planner works through it like the others."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import toy
from flax import nnx

import jaxhybrid


def _model():
  return toy.Chain(width=16, layers=4, rngs=nnx.Rngs(0))


def _one_line_error(fn, match: str) -> str:
  with pytest.raises(ValueError, match=match) as e:
    fn()
  assert len(str(e.value).splitlines()) == 1, str(e.value)
  return str(e.value)


def test_a_batch_the_mesh_does_not_divide():
  _one_line_error(
    lambda: jaxhybrid.parallelize(_model(), toy.mse_nnx, optax.sgd(0.1), toy.regression_batch(10),
                                  mesh="4x2", microbatches=2, planner="etf"),
    "global batch 10 is not divisible by data \\(4\\) x micro-batches \\(2\\): use a batch that "
    "is a multiple of 8")


def test_a_loss_that_is_not_a_scalar():
  _one_line_error(
    lambda: jaxhybrid.parallelize(_model(), lambda m, b: (m(b["x"]) - b["y"]) ** 2, optax.sgd(0.1),
                                  toy.regression_batch(8), mesh="1x2", microbatches=2,
                                  planner="etf"),
    "the loss must return one scalar")


def test_a_saved_plan_for_another_model_axis(tmp_path):
  hy = jaxhybrid.parallelize(_model(), toy.mse_nnx, optax.sgd(0.1), toy.regression_batch(8),
                             mesh="1x2", microbatches=2, planner="etf")
  hy.plan.save(tmp_path / "plan.json")
  plan = jaxhybrid.planner.Plan.load(tmp_path / "plan.json")
  _one_line_error(
    lambda: jaxhybrid.parallelize(_model(), toy.mse_nnx, optax.sgd(0.1), toy.regression_batch(8),
                                  mesh="1x4", microbatches=2, plan=plan),
    "for 2 model-axis devices but the mesh has 4")


def test_the_interleaved_planner_through_parallelize_trains():
  model = _model()
  batch = toy.regression_batch(8)
  hy = jaxhybrid.parallelize(model, toy.mse_nnx, optax.sgd(0.1), batch, mesh="1x2",
                             microbatches=2, planner="interleaved")
  assert hy.plan.method == "interleaved" and set(hy.plan.assignment) <= {0, 1}
  state = hy.init()
  losses = []
  for _ in range(3):
    state, metrics = hy.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert jax.tree.structure(hy.params(state)) is not None
