"""Step 5 of the flow: training with a compiled program, and the main job behind run.py.

Owns the loop (`loop`: steps, metrics JSONL, noise scale, checkpoints, one-line errors), the run
of `experiments/run.py` (`runner`: config, build, predict, train, report; `validation`: its
input checks before anything is traced), the run's data
(`run_data`), its report and loss plot (`run_report`), orbax checkpoints (`checkpoint`) and
optimizer helpers that see the model axis (`optim`).

May import: `jaxhybrid.api` and everything below it, `jaxhybrid.projection`, `jaxhybrid.models`.
"""

from jaxhybrid.train.loop import NoiseScaleOptions, TrainResult, fit, read_metrics, truncate_metrics

__all__ = ["NoiseScaleOptions", "TrainResult", "fit", "read_metrics", "truncate_metrics"]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
