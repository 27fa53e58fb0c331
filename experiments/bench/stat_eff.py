r"""Measured statistical efficiency: steps to a target loss versus global batch; the noise scale.

Trains a small model on its generated task to a target loss at several global batch sizes (plain
single-device jax.jit + optax: the DP global-batch run in exact arithmetic), with the best of a few
Adam learning rates per batch, and measures the gradient noise scale B_simple in the same runs
(McCandlish et al. 2018). Writes the measured (B, steps) points, the curve the noise scale predicts,
steps(B) = S_min (1 + B_noise / B) with S_min fitted to the points, a CSV that
experiments/project.py accepts as `--se_csv`, and a PNG.

  python experiments/bench/stat_eff.py                       # biglstm tiny, B = 8, 32, 128 (~1-2 min)
  python experiments/bench/stat_eff.py --model=gnmt --batches=8,16,32,64,128,256 --max_steps=1000

Expect steps to fall with B, close to 1/B below the noise scale and flattening above it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics

from absl import app, flags

from jaxhybrid import models
from jaxhybrid.projection import stat_eff, steps_to_target

_MODEL = flags.DEFINE_enum("model", "biglstm", models.names(), "Model of the generated task.")
_SIZE = flags.DEFINE_enum("size", "tiny", models.SIZES, "Model preset.")
_BATCHES = flags.DEFINE_list("batches", ["8", "32", "128"], "Global batch sizes B.")
_LRS = flags.DEFINE_list("learning_rates", ["1e-3", "3e-3", "1e-2"], "Adam LRs; best counts.")
_TARGET = flags.DEFINE_float("target_loss", None, "Eval loss to reach (default: see fraction).")
_FRACTION = flags.DEFINE_float(
  "target_fraction", 0.7, "Without --target_loss: target = this x the initial eval loss."
)
_MAX_STEPS = flags.DEFINE_integer("max_steps", 1000, "Steps before a run counts as not reached.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 5, "Steps between evaluations.")
_EVAL_BATCH = flags.DEFINE_integer("eval_batch", 512, "Samples in the fixed eval batch.")
_CHUNKS = flags.DEFINE_integer("noise_chunks", 4, "Chunks per batch for the noise scale.")
_SEED = flags.DEFINE_integer("seed", 0, "Init and data seed.")
_OUT = flags.DEFINE_string("out_dir", "results/stat_eff", "Output directory.")

_EVAL_SEED = 2**31 - 1  # data seed of the eval batch, far from the training seeds


def _plot(path: str, points, predicted, b_noise: float, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 4))
  ax.plot([b for b, _ in points], [s for _, s in points], "o", label="measured")
  ax.plot([b for b, _ in predicted], [s for _, s in predicted], "-",
          label=f"S_min (1 + B_noise/B), B_noise={b_noise:.0f}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("global batch B")
  ax.set_ylabel("steps to target")
  ax.set_title(title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  import jax
  from flax import nnx

  spec = models.get(_MODEL.value, _SIZE.value)
  eval_batch = spec.generated_task(_EVAL_SEED, _EVAL_BATCH.value)
  target = _TARGET.value
  if target is None:
    model = spec.make(nnx.Rngs(_SEED.value))
    initial = float(jax.jit(spec.eval_loss_fn or spec.loss_fn)(model, eval_batch))
    target = _FRACTION.value * initial
    logging.info("initial eval loss %.4f -> target %.4f", initial, target)
  config = steps_to_target.StepsToTargetConfig(
    target_loss=target,
    max_steps=_MAX_STEPS.value,
    eval_every=_EVAL_EVERY.value,
    learning_rates=tuple(float(x) for x in _LRS.value),
    noise_chunks=_CHUNKS.value,
    seed=_SEED.value,
  )
  batches = [int(b) for b in _BATCHES.value]
  results = steps_to_target.steps_to_target(spec, batches, config, eval_batch)

  points = [(r.global_batch, r.steps) for r in results if r.steps is not None]
  noise = [r.b_simple for r in results if math.isfinite(r.b_simple) and r.b_simple > 0]
  b_noise = statistics.median(noise) if noise else float("nan")
  predicted = []
  s_min = float("nan")
  if points and math.isfinite(b_noise):
    s_min = stat_eff.fit_s_min(points, b_noise)
    lo, hi = min(batches), max(batches)
    grid = [lo * (hi / lo) ** (i / 40) for i in range(41)] if hi > lo else [lo]
    predicted = [(b, s_min * (1 + b_noise / b)) for b in grid]

  os.makedirs(_OUT.value, exist_ok=True)
  stem = os.path.join(_OUT.value, f"{_MODEL.value}_{_SIZE.value}")
  out = {
    "model": _MODEL.value,
    "size": _SIZE.value,
    "target_loss": target,
    "config": {k: v for k, v in vars(config).items()},
    "runs": [vars(r) for r in results],
    "measured_points": points,
    "b_noise_measured": b_noise,
    "s_min_fitted": s_min,
    "predicted_curve": predicted,
    "assumptions": {
      "optimizer": "Adam, best of the learning rates per batch (McCandlish et al.'s model "
      "assumes a tuned LR per batch)",
      "b_noise": "median of the smoothed B_simple of the best run at each batch",
      "target": f"eval loss <= {target:.4f} on a fixed generated batch of {_EVAL_BATCH.value}",
    },
  }
  with open(stem + ".json", "w") as f:
    json.dump(out, f, indent=2)
  with open(stem + ".csv", "w") as f:
    f.write("global_batch,steps\n" + "".join(f"{b},{s}\n" for b, s in points))
  if predicted:
    _plot(stem + ".png", points, predicted, b_noise, f"{_MODEL.value} ({_SIZE.value})")
  logging.info("%8s %8s %10s %8s", "B", "steps", "B_simple", "lr")
  for r in results:
    logging.info("%8d %8s %10.1f %8g", r.global_batch, r.steps, r.b_simple, r.learning_rate)
  logging.info("B_noise (median B_simple) = %.1f, fitted S_min = %.1f", b_noise, s_min)
  for b, s in points:
    logging.info("B=%d measured %d steps, predicted %.1f", b, s, s_min * (1 + b_noise / b))
  logging.info("wrote %s.{json,csv,png}", stem)


if __name__ == "__main__":
  app.run(main)
