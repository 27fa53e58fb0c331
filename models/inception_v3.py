"""Inception-V3 (Szegedy et al. 2016, "Rethinking the Inception Architecture") in Flax NNX.

Layout (Table 1 of the paper; block internals as in TF-slim/torchvision, whose names we keep):
stem (5 conv layers, 2 max-pools) -> 3 Inception-A (`mixed_5b..5d`, 35x35) -> reduction
(`mixed_6a`) -> 4 Inception-B with factorised 7x7 (`mixed_6b..6e`, 17x17) -> reduction
(`mixed_7a`) -> 2 Inception-C (`mixed_7b..7c`, 8x8) -> global average pool -> `classifier`.
Every conv is conv (no bias) + BatchNorm + ReLU. Images are NHWC.

Every parallel branch of a block is its own submodule (`mixed_5b.branch_1x1`,
`mixed_5b.branch_5x5`, ...): at module depth 2 the branches are the placement units, so a planner
can run them concurrently on different devices.

Deviations, each a documented choice: the paper's dropout before the classifier is omitted (the
training loss must be a deterministic function of parameters and batch); the auxiliary head is off
by default (`aux_head=True` adds it, as torchvision's `aux_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.models import config_checks, losses

_PAPER_IMAGE_SIZE = 299  # Szegedy et al. 2016, Table 1.
_MIN_IMAGE_SIZE = 75  # smallest input for which every VALID conv/pool keeps >= 1 pixel.


@dataclasses.dataclass(frozen=True, kw_only=True)
class InceptionV3Config:
  """Inception-V3 hyperparameters.

  Reference parameter count (paper preset): torchvision's `inception_v3` (the same architecture,
  conv without bias + BatchNorm with scale and bias) has 27,161,264 parameters with its auxiliary
  head (torchvision weight metadata `num_params`), i.e. 23,834,568 without it (its aux head is
  3,326,696). Keras' `InceptionV3` (no BatchNorm scale) has 23,817,352 trainable parameters. This
  implementation counts exactly 23,834,568 `nnx.Param` values with `aux_head=False` and
  27,161,264 with `aux_head=True` (tests/models_test.py).

  Usage: `jaxhybrid.models.get("inception_v3", "paper")` or `InceptionV3Config.tiny()`.
  """

  # Square input resolution in pixels (299 in the paper; >= 75).
  image_size: int = _PAPER_IMAGE_SIZE
  # Number of output classes (ImageNet-1k).
  num_classes: int = 1000
  # Every conv's channel count is round(paper channels * width_multiplier), at least min_channels.
  width_multiplier: float = 1.0
  # Lower bound on scaled channel counts (keeps tiny models from collapsing to 0-1 channels).
  min_channels: int = 1
  # Add the auxiliary classifier on the 17x17 grid (torchvision's `aux_logits`).
  aux_head: bool = False
  # Weight of the auxiliary loss when aux_head is on (0.4 as in TF-slim / torchvision training).
  aux_weight: float = 0.4
  # Label-smoothing mass (Szegedy et al. 2016, Sec. 7: epsilon = 0.1).
  label_smoothing: float = 0.1
  # BatchNorm running-average momentum (flax convention; 0.9997 is TF-slim's inception decay).
  bn_momentum: float = 0.9997
  # BatchNorm epsilon (0.001 in TF-slim and torchvision).
  bn_epsilon: float = 1e-3
  # Computation dtype name (e.g. "float32", "bfloat16").
  dtype: str = "float32"
  # Parameter storage dtype name.
  param_dtype: str = "float32"

  def __post_init__(self):
    config_checks.check_fields(
      self, unit_interval=("label_smoothing", "bn_momentum"), positive=("bn_epsilon",))
    if self.image_size < _MIN_IMAGE_SIZE:
      raise ValueError(
        f"image_size={self.image_size} is too small for Inception-V3; use >= {_MIN_IMAGE_SIZE}."
      )
    if self.num_classes < 2:
      raise ValueError(f"num_classes={self.num_classes} must be >= 2.")
    if self.width_multiplier <= 0 or self.min_channels < 1:
      raise ValueError(
        f"width_multiplier={self.width_multiplier} must be > 0 and min_channels="
        f"{self.min_channels} >= 1."
      )

  @classmethod
  def paper(cls) -> InceptionV3Config:
    """The paper's size: 299x299, 1000 classes, full widths (23.8M parameters)."""
    return cls()

  @classmethod
  def small(cls) -> InceptionV3Config:
    """CPU demo size: 107x107, quarter widths, 100 classes (~0.3 s/step at B=32, 1 core)."""
    return cls(image_size=107, num_classes=100, width_multiplier=0.25, min_channels=4,
               bn_momentum=0.9)

  @classmethod
  def tiny(cls) -> InceptionV3Config:
    """Test size: 75x75, 1/16 widths (>= 4 channels), 10 classes; full block structure."""
    return cls(image_size=75, num_classes=10, width_multiplier=1 / 16, min_channels=4,
               bn_momentum=0.9)

  def channels(self, paper_channels: int) -> int:
    """Scaled channel count of a conv that has `paper_channels` in the paper."""
    return max(self.min_channels, int(round(paper_channels * self.width_multiplier)))


@dataclasses.dataclass(frozen=True)
class _Conv:
  """One conv of a branch: paper output channels, kernel, stride, padding."""

  out: int
  kernel: int | tuple[int, int]
  stride: int = 1
  padding: str = "SAME"


class BatchNorm(nnx.Module):
  """Batch normalisation (Ioffe & Szegedy 2015) over NHWC activations, per channel.

  Training mode (`use_running_average=False`, the default) normalises with the batch's statistics
  and updates the running averages (`nnx.BatchStat`); `model.eval()` switches to the running
  averages. Same math and variable kinds as `nnx.BatchNorm` (scale/bias are `nnx.Param`,
  mean/var are `nnx.BatchStat`); it exists because `nnx.BatchNorm`'s in-place statistics update
  (`var[...] = x`) costs quadratic time when traced in flax 0.12.8 / jax 0.10.2 (each update asks
  the tracer for `.sharding`, whose error message walks the whole jaxpr so far), which made
  tracing Inception-V3 take seconds. Here the update replaces the whole value.
  """

  def __init__(self, num_features: int, *, momentum: float, epsilon: float, dtype,
               param_dtype, rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init
    self.momentum = momentum
    self.epsilon = epsilon
    self.dtype = dtype
    self.use_running_average = False
    self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype))
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
    self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.use_running_average:
      mean, var = self.mean.get_value(), self.var.get_value()
    else:
      xf = x.astype(jnp.float32).reshape(-1, x.shape[-1])  # [batch * height * width, channels]
      # Means as matrix products with a ones vector: same values as jnp.mean, but XLA:CPU compiles
      # dots much faster than reductions (Inception has 94 BatchNorms; 4x shorter compile).
      w = jnp.full((xf.shape[0],), 1.0 / xf.shape[0], jnp.float32)
      mean = w @ xf
      # Two-pass variance E[(x - E[x])^2]: the one-pass E[x^2] - E[x]^2 cancels catastrophically
      # in float32 for low-variance channels, which made runs differ by reduction order alone.
      var = w @ jnp.square(xf - mean)
      m = self.momentum
      self.mean.set_value(m * self.mean.get_value() + (1 - m) * jax.lax.stop_gradient(mean))
      self.var.set_value(m * self.var.get_value() + (1 - m) * jax.lax.stop_gradient(var))
    mul = jax.lax.rsqrt(var + self.epsilon) * self.scale[...].astype(jnp.float32)
    y = (x.astype(jnp.float32) - mean) * mul + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


def _window_slices(x: jax.Array, stride: int):
  """The nine strided slices of a 3x3 VALID window over NHWC `x`, in window order, each with
  the padding that puts it back at its place in `x` (for the gradient)."""
  n, h, w, c = x.shape
  oh, ow = (h - 3) // stride + 1, (w - 3) // stride + 1
  for i in range(3):
    for j in range(3):
      hi, wj = i + stride * (oh - 1) + 1, j + stride * (ow - 1) + 1
      window = jax.lax.slice(x, (0, i, j, 0), (n, hi, wj, c), (1, stride, stride, 1))
      pad = ((0, 0, 0), (i, h - hi, stride - 1), (j, w - wj, stride - 1), (0, 0, 0))
      yield window, pad


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def max_pool_3x3(x: jax.Array, stride: int) -> jax.Array:
  """3x3 VALID max-pool of NHWC `x`: the same values and gradients as `nnx.max_pool`.

  The forward is a running maximum over the nine strided slices of the window offsets; the
  gradient goes whole to the first maximum in window order, as XLA's select-and-scatter (the
  gradient of `reduce_window` max) gives it, found again in the backward from the input and the
  output: selects and padded adds, which fuse. Two measured reasons, on one CPU core:
  select-and-scatter is slow (at [16, 51, 51, 32] its backward took 14.6 ms against 1.6 ms as
  selects); and differentiating the running maximum itself (`jnp.where` per slice) makes the
  forward keep eight comparison masks, which XLA computed inside the hybrid program's branches
  with the running maximum recomputed for each (Inception-V3 small's stem pooling nodes ran 2x
  and 6x their profiled forward there).
  """
  out = None
  for window, _ in _window_slices(x, stride):
    out = window if out is None else jnp.maximum(out, window)
  return out


def _max_pool_fwd(x: jax.Array, stride: int):
  out = max_pool_3x3(x, stride)
  return out, (x, out)


def _max_pool_bwd(stride: int, res, g: jax.Array):
  x, out = res
  taken = jnp.zeros(out.shape, bool)
  dx = jnp.zeros_like(x)
  for window, pad in _window_slices(x, stride):
    first = (window == out) & ~taken  # this offset holds the window's first maximum
    taken = taken | first
    dx = dx + jax.lax.pad(jnp.where(first, g, jnp.zeros_like(g)), jnp.zeros((), g.dtype), pad)
  return (dx,)


max_pool_3x3.defvjp(_max_pool_fwd, _max_pool_bwd)


class ConvBN(nnx.Module):
  """Conv (no bias) -> BatchNorm (batch statistics in training) -> ReLU."""

  def __init__(self, in_ch: int, out_ch: int, kernel: int | tuple[int, int], *, stride: int = 1,
               padding: str = "SAME", cfg: InceptionV3Config, dtype, param_dtype, rngs: nnx.Rngs):
    kernel = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
    self.out_features = out_ch
    self.conv = nnx.Conv(in_ch, out_ch, kernel, strides=stride, padding=padding, use_bias=False,
                         dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.bn = BatchNorm(out_ch, momentum=cfg.bn_momentum, epsilon=cfg.bn_epsilon, dtype=dtype,
                        param_dtype=param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jax.nn.relu(self.bn(self.conv(x)))


class Branch(nnx.Module):
  """One parallel branch of an Inception block.

  An optional pool first, then a chain of ConvBN, then optionally two parallel ConvBN whose outputs
  are concatenated (the 1x3 / 3x1 split of the 8x8 Inception-C block, Fig. 7 of the paper).
  """

  def __init__(self, in_ch: int, convs: Sequence[_Conv], *, pool: str | None = None,
               pool_stride: int = 1, split: Sequence[_Conv] = (), cfg: InceptionV3Config, dtype,
               param_dtype, rngs: nnx.Rngs):
    self.pool = pool
    self.pool_stride = pool_stride
    kw = dict(cfg=cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    layers = []
    ch = in_ch
    for c in convs:
      layers.append(ConvBN(ch, cfg.channels(c.out), c.kernel, stride=c.stride, padding=c.padding,
                           **kw))
      ch = layers[-1].out_features
    self.layers = nnx.List(layers)
    self.split = nnx.List(
      [ConvBN(ch, cfg.channels(c.out), c.kernel, stride=c.stride, padding=c.padding, **kw)
       for c in split])
    self.out_features = sum(s.out_features for s in self.split) if split else ch

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.pool == "avg":  # 3x3, stride 1, SAME; padding counted as zeros (as TF-slim/torchvision)
      x = nnx.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME")
    elif self.pool == "max":  # 3x3 stride 2 VALID (grid reduction)
      x = max_pool_3x3(x, self.pool_stride)
    for layer in self.layers:
      x = layer(x)
    if len(self.split):
      x = jnp.concatenate([s(x) for s in self.split], axis=-1)
    return x


# Block recipes: branch name -> (convs, pool, split). Channels are the paper's (Fig. 5-7, Table 1;
# internal widths as in TF-slim's inception_v3).
def _block_a(pool_features: int) -> dict:
  return {
    "branch_1x1": ([_Conv(64, 1)], None, ()),
    "branch_5x5": ([_Conv(48, 1), _Conv(64, 5)], None, ()),
    "branch_3x3dbl": ([_Conv(64, 1), _Conv(96, 3), _Conv(96, 3)], None, ()),
    "branch_pool": ([_Conv(pool_features, 1)], "avg", ()),
  }


def _reduction_a() -> dict:
  return {
    "branch_3x3": ([_Conv(384, 3, 2, "VALID")], None, ()),
    "branch_3x3dbl": ([_Conv(64, 1), _Conv(96, 3), _Conv(96, 3, 2, "VALID")], None, ()),
    "branch_pool": ([], "max", ()),
  }


def _block_b(c7: int) -> dict:
  return {
    "branch_1x1": ([_Conv(192, 1)], None, ()),
    "branch_7x7": ([_Conv(c7, 1), _Conv(c7, (1, 7)), _Conv(192, (7, 1))], None, ()),
    "branch_7x7dbl": ([_Conv(c7, 1), _Conv(c7, (7, 1)), _Conv(c7, (1, 7)), _Conv(c7, (7, 1)),
                       _Conv(192, (1, 7))], None, ()),
    "branch_pool": ([_Conv(192, 1)], "avg", ()),
  }


def _reduction_b() -> dict:
  return {
    "branch_3x3": ([_Conv(192, 1), _Conv(320, 3, 2, "VALID")], None, ()),
    "branch_7x7x3": ([_Conv(192, 1), _Conv(192, (1, 7)), _Conv(192, (7, 1)),
                      _Conv(192, 3, 2, "VALID")], None, ()),
    "branch_pool": ([], "max", ()),
  }


def _block_c() -> dict:
  split = (_Conv(384, (1, 3)), _Conv(384, (3, 1)))
  return {
    "branch_1x1": ([_Conv(320, 1)], None, ()),
    "branch_3x3": ([_Conv(384, 1)], None, split),
    "branch_3x3dbl": ([_Conv(448, 1), _Conv(384, 3)], None, split),
    "branch_pool": ([_Conv(192, 1)], "avg", ()),
  }


# (attribute name, recipe) in network order.
_BLOCKS = (
  ("mixed_5b", _block_a(32)),
  ("mixed_5c", _block_a(64)),
  ("mixed_5d", _block_a(64)),
  ("mixed_6a", _reduction_a()),
  ("mixed_6b", _block_b(128)),
  ("mixed_6c", _block_b(160)),
  ("mixed_6d", _block_b(160)),
  ("mixed_6e", _block_b(192)),
  ("mixed_7a", _reduction_b()),
  ("mixed_7b", _block_c()),
  ("mixed_7c", _block_c()),
)
BLOCK_NAMES = tuple(name for name, _ in _BLOCKS)


class InceptionBlock(nnx.Module):
  """Parallel branches (each an attribute submodule) concatenated along channels."""

  def __init__(self, in_ch: int, recipe: dict, **kw):
    self.branch_names = tuple(recipe)
    for name, (convs, pool, split) in recipe.items():
      setattr(self, name, Branch(in_ch, convs, pool=pool, pool_stride=2, split=split, **kw))
    # A pool-only branch passes its input channels through.
    self.out_features = sum(getattr(self, n).out_features for n in self.branch_names)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.concatenate([getattr(self, n)(x) for n in self.branch_names], axis=-1)


class Stem(nnx.Module):
  """The five stem convs and two max-pools (299x299x3 -> 35x35x192)."""

  def __init__(self, *, cfg: InceptionV3Config, **kw):
    ch = cfg.channels
    self.conv_1a_3x3 = ConvBN(3, ch(32), 3, stride=2, padding="VALID", cfg=cfg, **kw)
    self.conv_2a_3x3 = ConvBN(ch(32), ch(32), 3, padding="VALID", cfg=cfg, **kw)
    self.conv_2b_3x3 = ConvBN(ch(32), ch(64), 3, padding="SAME", cfg=cfg, **kw)
    self.conv_3b_1x1 = ConvBN(ch(64), ch(80), 1, padding="VALID", cfg=cfg, **kw)
    self.conv_4a_3x3 = ConvBN(ch(80), ch(192), 3, padding="VALID", cfg=cfg, **kw)
    self.out_features = ch(192)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.conv_2b_3x3(self.conv_2a_3x3(self.conv_1a_3x3(x)))
    x = max_pool_3x3(x, 2)
    x = self.conv_4a_3x3(self.conv_3b_1x1(x))
    return max_pool_3x3(x, 2)


class AuxHead(nnx.Module):
  """Auxiliary classifier on the 17x17 grid (avg-pool 5/3, 1x1 conv 128, 5x5 conv 768, linear)."""

  def __init__(self, in_ch: int, *, cfg: InceptionV3Config, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(cfg=cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.conv_0 = ConvBN(in_ch, cfg.channels(128), 1, **kw)
    self.conv_1 = ConvBN(cfg.channels(128), cfg.channels(768), 5, padding="VALID", **kw)
    self.fc = nnx.Linear(cfg.channels(768), cfg.num_classes, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    window = min(5, x.shape[1])
    x = nnx.avg_pool(x, (window, window), strides=(3, 3), padding="VALID")
    x = self.conv_0(x)
    if x.shape[1] < 5:  # small inputs: pad so the 5x5 VALID conv keeps one pixel
      pad = 5 - x.shape[1]
      x = jnp.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (pad // 2, pad - pad // 2), (0, 0)))
    x = self.conv_1(x)
    return self.fc(jnp.mean(x, axis=(1, 2)))


class Classifier(nnx.Module):
  """Global average pool -> linear layer to class logits."""

  def __init__(self, in_ch: int, num_classes: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.fc = nnx.Linear(in_ch, num_classes, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc(jnp.mean(x, axis=(1, 2)))  # [batch, classes]


class InceptionV3(nnx.Module):
  """Inception-V3 classifier; `__call__(images [B, H, W, 3]) -> logits [B, num_classes]`.

  Built in training mode (BatchNorm uses batch statistics and updates its running averages);
  `model.eval()` switches to the running averages.
  """

  def __init__(self, config: InceptionV3Config, *, dtype=None, param_dtype=None,
               rngs: nnx.Rngs):
    """Builds the network.

    Args:
      config: the hyperparameters.
      dtype: computation dtype; default `config.dtype`.
      param_dtype: parameter dtype; default `config.param_dtype`.
      rngs: random streams for initialisation.
    """
    self.config = config
    kw = dict(dtype=jnp.dtype(dtype or config.dtype),
              param_dtype=jnp.dtype(param_dtype or config.param_dtype), rngs=rngs)
    self.stem = Stem(cfg=config, **kw)
    ch = self.stem.out_features
    for name, recipe in _BLOCKS:
      block = InceptionBlock(ch, recipe, cfg=config, **kw)
      setattr(self, name, block)
      ch = block.out_features
      if name == "mixed_6e":
        self.aux = AuxHead(ch, cfg=config, **kw) if config.aux_head else None
    self.classifier = Classifier(ch, config.num_classes, **kw)

  def logits_and_aux(self, images: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Returns (logits, aux logits or None), each [batch, num_classes]."""
    x = self.stem(images)
    aux = None
    for name in BLOCK_NAMES:
      x = getattr(self, name)(x)
      if name == "mixed_6e" and self.aux is not None:
        aux = self.aux(x)
    return self.classifier(x), aux

  def __call__(self, images: jax.Array) -> jax.Array:
    return self.logits_and_aux(images)[0]


def loss_fn(model: InceptionV3, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean label-smoothed cross-entropy (+ aux_weight * aux loss when the aux head is on).

  Args:
    model: the network (training mode: BatchNorm uses the batch's statistics).
    batch: {"images": float [B, H, W, 3], "labels": int32 [B]}.

  Returns:
    Scalar mean loss over the batch.
  """
  cfg = model.config
  logits, aux = model.logits_and_aux(batch["images"])
  loss = losses.smoothed_cross_entropy(logits, batch["labels"], cfg.label_smoothing).mean()
  if aux is not None:
    aux_loss = losses.smoothed_cross_entropy(aux, batch["labels"], cfg.label_smoothing).mean()
    loss = loss + cfg.aux_weight * aux_loss
  return loss


def batch_spec(config: InceptionV3Config, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
  """Abstract training batch: images [B, S, S, 3] float32 (cast by the model), labels [B] int32."""
  s = config.image_size
  return {
    "images": jax.ShapeDtypeStruct((batch_size, s, s, 3), jnp.float32),
    "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
  }


def synthetic_batch(config: InceptionV3Config, seed: int, batch_size: int) -> dict[str, np.ndarray]:
  """Random N(0, 1) images and uniform labels (no structure; for timing)."""
  rng = np.random.default_rng(seed)
  s = config.image_size
  return {
    "images": rng.standard_normal((batch_size, s, s, 3), dtype=np.float32),
    "labels": rng.integers(0, config.num_classes, (batch_size,), dtype=np.int32),
  }
