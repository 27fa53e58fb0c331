"""The training loop: metrics rows, checkpoints, exact resume, and the stop on a NaN loss."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import optax
import pytest
import toy
from flax import nnx

from jaxhybrid import api, errors, train
from jaxhybrid.train import checkpoint

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def hybrid():
  model = toy.Towers(rngs=nnx.Rngs(0))
  return api.parallelize(model, toy.mse_nnx, optax.adam(1e-2), toy.regression_batch(GLOBAL_BATCH),
                         mesh="2x2", microbatches=2, planner="etf")


def batch_fn(step: int):
  return toy.regression_batch(GLOBAL_BATCH, seed=1000 + step)


def test_fit_writes_rows_and_checkpoints(hybrid, tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=2, max_to_keep=None)
  path = str(tmp_path / "metrics.jsonl")
  res = train.fit(hybrid.step, hybrid.init(), batch_fn, steps=5, checkpointer=ckpt,
                  metrics_path=path, progress=False)
  ckpt.close()
  rows = train.read_metrics(path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  assert all(np.isfinite(r["loss"]) and r["grad_sq_norm"] > 0 for r in rows)
  assert rows[-1]["loss"] < rows[0]["loss"]  # Adam on a fixed regression task
  assert ckpt.all_steps() == [2, 4, 5]  # every 2 steps and the end
  assert res.final_step == 5 and res.measured_step_s > 0


def test_resume_from_checkpoint_reproduces_losses_exactly(hybrid, tmp_path):
  full = train.fit(hybrid.step, hybrid.init(), batch_fn, steps=6, progress=False)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=3)
  path = str(tmp_path / "metrics.jsonl")
  train.fit(hybrid.step, hybrid.init(), batch_fn, steps=4, checkpointer=ckpt, metrics_path=path,
            progress=False)
  ckpt.close()
  # A new process would do this: open, restore the step-3 checkpoint, drop row 4, go on.
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=3)
  assert ckpt.all_steps() == [3, 4]
  state = ckpt.restore(3, like=hybrid.init())
  assert int(state.step) == 3
  train.truncate_metrics(path, 3)
  train.fit(hybrid.step, state, batch_fn, steps=6, start_step=3, checkpointer=ckpt,
            metrics_path=path, progress=False)
  ckpt.close()
  assert [r["loss"] for r in train.read_metrics(path)] == [r["loss"] for r in full.rows]


def test_checkpoint_round_trip_keeps_parameters(hybrid, tmp_path):
  state, _ = hybrid.step(hybrid.init(), batch_fn(0))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=0)
  assert not ckpt.maybe_save(1, state)  # every=0: only forced saves
  assert ckpt.maybe_save(1, state, force=True)
  ckpt.wait()
  restored = ckpt.restore(1, like=hybrid.init())
  ckpt.close()
  for a, b in zip(jax.tree.leaves(hybrid.params(state)), jax.tree.leaves(hybrid.params(restored))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(restored.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_of_another_plan_is_a_one_line_error_and_stays(hybrid, tmp_path):
  # Another placement of the same model: other parameter rows, so the checkpoint cannot fit.
  other = api.parallelize(toy.Towers(rngs=nnx.Rngs(0)), toy.mse_nnx, optax.adam(1e-2),
                          toy.regression_batch(GLOBAL_BATCH), mesh="2x2", microbatches=2,
                          planner="single")
  shapes = lambda s: [x.shape for x in jax.tree.leaves(s.params)]  # noqa: E731
  assert shapes(other.init()) != shapes(hybrid.init())
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=0)
  ckpt.maybe_save(1, hybrid.init(), force=True)
  ckpt.wait()
  with pytest.raises(errors.UsageError, match="does not fit this program's state") as e:
    ckpt.restore(1, like=other.init())
  assert "\n" not in str(e.value)
  # The checkpoint is intact: the plan it was made under still restores it.
  assert ckpt.all_steps() == [1]
  assert int(ckpt.restore(1, like=hybrid.init()).step) == 1
  ckpt.close()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(hybrid, tmp_path):
  def poisoned(step):
    b = batch_fn(step)
    if step == 2:  # the third step sees a NaN input
      b["x"] = np.full_like(b["x"], np.nan)
    return b

  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), every=2)
  path = str(tmp_path / "metrics.jsonl")
  with pytest.raises(errors.NonFiniteLossError, match="step 3.*last good checkpoint is step 2") as e:
    train.fit(hybrid.step, hybrid.init(), poisoned, steps=6, checkpointer=ckpt,
              metrics_path=path, progress=False)
  ckpt.close()
  assert e.value.step == 3 and e.value.last_checkpoint == 2
  assert "\n" not in str(e.value)
  assert ckpt.all_steps() == [2]
  assert [r["step"] for r in train.read_metrics(path)] == [1, 2]
  with open(path) as f:  # strict JSON: no NaN written
    for line in f:
      json.loads(line, parse_constant=lambda c: pytest.fail(f"non-finite {c} in metrics"))


def test_truncate_metrics(tmp_path):
  path = str(tmp_path / "m.jsonl")
  with open(path, "w") as f:
    for s in range(1, 6):
      f.write(json.dumps({"step": s, "loss": float(s)}) + "\n")
  train.truncate_metrics(path, 3)
  assert [r["step"] for r in train.read_metrics(path)] == [1, 2, 3]
  assert train.read_metrics(str(tmp_path / "missing.jsonl")) == []
  assert not os.path.exists(path + ".tmp")
