"""Model registry: `get(name, size)` returns the module factory, loss and data of a model.

Example:
  spec = get("gnmt", "tiny")
  model = spec.make(nnx.Rngs(0))
  loss = spec.loss_fn(model, spec.synthetic_batch(0, 8))
  abstract = spec.abstract_model()        # no allocation (paper sizes)
  shapes = spec.batch_spec(128)           # {"src": ShapeDtypeStruct, ...}

Batch conventions: every batch leaf has the batch dimension first, except BigLSTM's
`sampled_ids` (int32 [num_sampled], the negative samples shared by the whole batch; its name is
`biglstm.SAMPLED_IDS`). A micro-batch therefore splits every leaf along axis 0 except
`sampled_ids`, which each micro-batch reuses. Every loss is a mean over examples (Inception's
BatchNorm batch statistics excepted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxhybrid.models import biglstm, gnmt, inception_v3, tasks

SIZES = ("tiny", "small", "paper")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
  """Everything needed to build, train and feed one model at one size."""

  # Registry name: "inception_v3" | "gnmt" | "biglstm".
  name: str
  # Preset: "tiny" | "small" | "paper".
  size: str
  # The model's frozen config dataclass (after overrides).
  config: Any
  # Builds (allocates) the model from random streams.
  make: Callable[[nnx.Rngs], nnx.Module]
  # Scalar mean training loss; a pure function of the model's state and the batch.
  loss_fn: Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]
  # batch_size -> abstract batch (jax.ShapeDtypeStruct leaves).
  batch_spec: Callable[[int], dict[str, jax.ShapeDtypeStruct]]
  # (seed, batch_size) -> random batch without structure (the default data; timing).
  synthetic_batch: Callable[[int, int], dict[str, np.ndarray]]
  # (seed, batch_size) -> batch of the model family's learnable generated task.
  generated_task: Callable[[int, int], dict[str, np.ndarray]]
  # Evaluation loss (BigLSTM: full softmax); the training loss for the other models.
  eval_loss_fn: Callable[[nnx.Module, dict[str, jax.Array]], jax.Array] | None = None

  def abstract_model(self) -> nnx.Module:
    """The model with `jax.ShapeDtypeStruct` leaves; allocates nothing."""
    return nnx.eval_shape(lambda: self.make(nnx.Rngs(0)))

  def init(self, seed: int = 0) -> nnx.Module:
    """Builds the model with all parameters initialised by ONE compiled program.

    Equivalent in distribution to `make(nnx.Rngs(seed))`, but much faster on CPU: eager `make`
    compiles one initializer per distinct parameter shape, and threefry random bits are slow to
    compile (Inception-V3 tiny: ~70 s eager vs a few seconds here). The keys use XLA's
    RngBitGenerator (`impl="rbg"`), so values differ from `make(nnx.Rngs(seed))` and may differ
    across backends.
    """
    graphdef = nnx.graphdef(self.abstract_model())
    state = jax.jit(lambda: nnx.state(self.make(nnx.Rngs(jax.random.key(seed, impl="rbg")))))()
    return nnx.merge(graphdef, state)

  def num_params(self) -> int:
    """Number of trainable (`nnx.Param`) values, computed abstractly."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(self.abstract_model(),
                                                                          nnx.Param)))


def _inception(cfg: inception_v3.InceptionV3Config, size: str) -> ModelSpec:
  task = tasks.ClassTemplateImages(image_size=cfg.image_size, num_classes=cfg.num_classes)
  return ModelSpec(
    name="inception_v3", size=size, config=cfg,
    make=lambda rngs: inception_v3.InceptionV3(cfg, rngs=rngs),
    loss_fn=inception_v3.loss_fn,
    batch_spec=lambda b: inception_v3.batch_spec(cfg, b),
    synthetic_batch=lambda seed, b: inception_v3.synthetic_batch(cfg, seed, b),
    generated_task=task,
    eval_loss_fn=inception_v3.loss_fn,
  )


def _gnmt(cfg: gnmt.GNMTConfig, size: str) -> ModelSpec:
  return ModelSpec(
    name="gnmt", size=size, config=cfg,
    make=lambda rngs: gnmt.GNMT(cfg, rngs=rngs),
    loss_fn=gnmt.loss_fn,
    batch_spec=lambda b: gnmt.batch_spec(cfg, b),
    synthetic_batch=lambda seed, b: gnmt.synthetic_batch(cfg, seed, b),
    generated_task=tasks.TokenMappingTranslation(config=cfg),
    eval_loss_fn=gnmt.loss_fn,
  )


def _biglstm(cfg: biglstm.BigLSTMConfig, size: str) -> ModelSpec:
  return ModelSpec(
    name="biglstm", size=size, config=cfg,
    make=lambda rngs: biglstm.BigLSTM(cfg, rngs=rngs),
    loss_fn=biglstm.loss_fn,
    batch_spec=lambda b: biglstm.batch_spec(cfg, b),
    synthetic_batch=lambda seed, b: biglstm.synthetic_batch(cfg, seed, b),
    generated_task=tasks.MarkovLanguage(config=cfg),
    eval_loss_fn=biglstm.eval_loss_fn,
  )


# name -> (config class, spec builder)
_MODELS: dict[str, tuple[type, Callable[[Any, str], ModelSpec]]] = {
  "inception_v3": (inception_v3.InceptionV3Config, _inception),
  "gnmt": (gnmt.GNMTConfig, _gnmt),
  "biglstm": (biglstm.BigLSTMConfig, _biglstm),
}


def names() -> tuple[str, ...]:
  """The registered model names."""
  return tuple(_MODELS)


def _coerce(field: str, current: Any, value: Any) -> Any:
  """Converts a string override (e.g. from a `--set key=value` flag) to the field's type."""
  if not isinstance(value, str) or isinstance(current, str):
    return value
  try:
    if isinstance(current, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(value)
      return value.lower() in ("true", "1")
    if isinstance(current, int):
      return int(value)
    if isinstance(current, float) or current is None:
      return None if value.lower() == "none" else float(value)
  except ValueError:
    raise ValueError(
      f"{field}={value!r}: does not parse as {type(current).__name__}; give a value of type "
      f"{type(current).__name__}"
    ) from None
  return value


def get(name: str, size: str = "tiny", **overrides: Any) -> ModelSpec:
  """Returns the spec of model `name` at preset `size`, with config fields overridden.

  Args:
    name: one of `names()`.
    size: one of `SIZES`.
    **overrides: config fields to replace (`dataclasses.replace`); string values are converted
      to the field's type (so `--set hidden_size=256` style flags can pass strings).

  Returns:
    The `ModelSpec`.

  Raises:
    ValueError: unknown name, size or config field, or an invalid config.
  """
  if name not in _MODELS:
    raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(names())}.")
  if size not in SIZES:
    raise ValueError(f"Unknown size {size!r}; valid sizes: {', '.join(SIZES)}.")
  config_cls, build = _MODELS[name]
  cfg = getattr(config_cls, size)()
  fields = {f.name for f in dataclasses.fields(cfg)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    key = unknown[0]
    raise ValueError(
      f"{key}={overrides[key]!r}: {config_cls.__name__} has no field {key!r}; valid fields: "
      f"{', '.join(sorted(fields))}"
    )
  if overrides:
    cfg = dataclasses.replace(
      cfg, **{k: _coerce(k, getattr(cfg, k), v) for k, v in overrides.items()})
  return build(cfg, size)
