"""Flax NNX models of the paper (Inception-V3, GNMT, BigLSTM), their configs and data.

`get(name, size)` returns a `ModelSpec` (factory, loss, batch spec, synthetic data, generated
task); the model modules, loaders (`data`) and generated tasks (`tasks`) are importable directly,
e.g. `from jaxhybrid.models import gnmt`.
"""

from jaxhybrid.models.registry import SIZES, ModelSpec, get, names

__all__ = ["SIZES", "ModelSpec", "get", "names"]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
