"""Flax NNX models of the paper (Inception-V3, GNMT, BigLSTM), their configs and data.

`get(name, size)` returns a `ModelSpec` (factory, loss, batch spec, synthetic data, generated
task); the model modules, loaders (`data`) and generated tasks (`tasks`) are importable directly,
e.g. `from jaxhybrid.models import gnmt`.
"""

from jaxhybrid.models.registry import SIZES, ModelSpec, get, names

__all__ = ["SIZES", "ModelSpec", "get", "names"]
