"""Flax adapters for tracing: NNX models as pure loss functions, with module paths as name scopes.

NNX records no module paths in equations; `nnx_name_scopes` opens a `jax.named_scope` per
submodule call while tracing, so `jaxhybrid.graph` can group equations by module as it does for
linen (whose name stack already carries them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax


def is_nnx_module(model: Any) -> bool:
  from flax import nnx

  return isinstance(model, nnx.Module)


def is_linen_module(model: Any) -> bool:
  from flax import linen as nn

  return isinstance(model, nn.Module)


def nnx_pure_loss(model: Any, loss_fn: Callable[[Any, Any], jax.Array], *, scopes: bool = True):
  """Splits an NNX model into (graphdef, params, state) and a pure `f(params, state, batch)`.

  The returned function merges the model inside and, with `scopes`, runs every submodule call
  under a name scope of its attribute path, so equations carry module paths like linen's do.
  """
  from flax import nnx

  graphdef, params, state = nnx.split(model, nnx.Param, ...)

  def pure(p, s, batch):
    # Fresh Variables at the current trace level: NNX refuses to mutate (e.g. BatchNorm's
    # statistics) a Variable created at another one.
    p, s = jax.tree.map(lambda x: x, (p, s))
    m = nnx.merge(graphdef, p, s)
    if not scopes:
      return loss_fn(m, batch)
    with nnx_name_scopes(m):
      return loss_fn(m, batch)

  return graphdef, params, state, pure


class nnx_name_scopes:  # noqa: N801 (context manager used like a function)
  """While active, every call of a submodule of `root` runs under `jax.named_scope(path)`.

  NNX records no module paths in equations; this patches `__call__` of the module classes in
  the tree (restored on exit) and resets the name stack to the module's full attribute path, so
  a submodule called from outside its parent still gets its own path.
  """

  def __init__(self, root: Any):
    self.root = root
    self._saved: dict[type, Any] = {}

  def __enter__(self):
    from flax import nnx
    from jax._src import source_info_util

    paths: dict[int, tuple[str, ...]] = {}
    for path, mod in nnx.iter_modules(self.root):
      if path:
        paths[id(mod)] = tuple(str(p) for p in path)
    classes = {type(m) for _, m in nnx.iter_modules(self.root)}
    for cls in classes:
      orig = cls.__dict__.get("__call__")
      if orig is None:
        # Inherited __call__: patch on this class and remove on exit.
        orig_inherited = cls.__call__
        self._saved[cls] = None
        cls.__call__ = _scoped(orig_inherited, paths, source_info_util)
      else:
        self._saved[cls] = orig
        cls.__call__ = _scoped(orig, paths, source_info_util)
    return self

  def __exit__(self, *exc):
    for cls, orig in self._saved.items():
      if orig is None:
        del cls.__call__
      else:
        cls.__call__ = orig
    self._saved.clear()
    return False


def _scoped(fn, paths, source_info_util):
  def wrapper(self, *args, **kwargs):
    path = paths.get(id(self))
    if path is None:
      return fn(self, *args, **kwargs)
    with source_info_util.reset_name_stack():
      with _nested_scopes(path):
        return fn(self, *args, **kwargs)

  wrapper.__wrapped__ = fn
  return wrapper


class _nested_scopes:  # noqa: N801
  def __init__(self, parts: Sequence[str]):
    self.ctxs = [jax.named_scope(p) for p in parts]

  def __enter__(self):
    for c in self.ctxs:
      c.__enter__()

  def __exit__(self, *exc):
    for c in reversed(self.ctxs):
      c.__exit__(*exc)
    return False
