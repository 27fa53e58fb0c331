"""Flax adapters for tracing: NNX models as pure loss functions, with module paths as name scopes.

NNX records no module paths in equations; `nnx_name_scopes` opens a `jax.named_scope` per
submodule method call while tracing, so `jaxhybrid.graph` can group equations by module as it
does for linen (whose name stack already carries them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax


def is_nnx_module(model: Any) -> bool:
  from flax import nnx

  return isinstance(model, nnx.Module)


def is_linen_module(model: Any) -> bool:
  from flax import linen as nn

  return isinstance(model, nn.Module)


def nnx_pure_loss(
  model: Any, loss_fn: Callable[[Any, Any], jax.Array], *, scopes: bool = True,
  with_state: bool = False,
):
  """Splits an NNX model into (graphdef, params, state) and a pure `f(params, state, batch)`.

  The returned function merges the model inside and, with `scopes`, runs every submodule call
  under a name scope of its attribute path, so equations carry module paths like linen's do.
  It returns the loss, or with `with_state` `(loss, new_state)`: the model's non-parameter
  state after the loss ran (BatchNorm running averages, RNG counters), in the structure of
  `state`, which `jaxhybrid.graph.trace_function` turns into the graph's state writes.
  """
  from flax import nnx

  graphdef, params, state = nnx.split(model, nnx.Param, ...)

  def pure(p, s, batch):
    # Fresh Variables at the current trace level: NNX refuses to mutate (e.g. BatchNorm's
    # statistics) a Variable created at another one.
    p, s = jax.tree.map(lambda x: x, (p, s))
    m = nnx.merge(graphdef, p, s)
    before = _state_values(m)
    if not scopes:
      out = loss_fn(m, batch)
    else:
      with nnx_name_scopes(m):
        out = loss_fn(m, batch)
    after = _state_values(m)
    pure.updated_state = sorted({
      (path, kind) for path, (kind, v) in after.items() if before.get(path, (kind, v))[1] is not v
    })
    if with_state:
      return out, nnx.split(m, nnx.Param, ...)[2]
    return out

  # What the last trace of the loss wrote into the model's non-parameter state (e.g. BatchNorm
  # running averages, dropout's RNG counter), as (path, Variable type name).
  pure.updated_state = []
  return graphdef, params, state, pure


def _state_values(model: Any) -> dict[str, tuple[str, Any]]:
  """path -> (Variable type name, value object) of every non-parameter Variable of `model`."""
  from flax import nnx

  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
    out["/".join(str(k) for k in path)] = (type(var).__name__, var.get_value() if hasattr(var, "get_value") else var.value)
  return out


class nnx_name_scopes:  # noqa: N801 (context manager used like a function)
  """While active, every method call of a submodule of `root` runs under its module path.

  NNX records no module paths in equations; this patches the public methods (`__call__` and
  any other, e.g. a tied embedding's `attend`) of the module classes in the tree (restored on
  exit) and resets the name stack to the module's full attribute path, so a submodule called
  from outside its parent still gets its own path. A method other than `__call__` gets the path
  `.../name.method`, as linen names it. A module calling its own methods stays in its scope.
  """

  def __init__(self, root: Any):
    self.root = root
    self._saved: list[tuple[type, str, Any]] = []

  def __enter__(self):
    from flax import nnx
    from jax._src import source_info_util

    paths: dict[int, tuple[str, ...]] = {}
    for path, mod in nnx.iter_modules(self.root):
      if path:
        paths[id(mod)] = tuple(str(p) for p in path)
    active: list[int] = []  # ids of the modules whose methods are running, innermost last
    classes = {type(m) for _, m in nnx.iter_modules(self.root)}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
      for name in _public_methods(cls, nnx.Module):
        orig = cls.__dict__.get(name)
        fn = getattr(orig if orig is not None else getattr(cls, name), "__wrapped__", None)
        fn = fn or (orig if orig is not None else getattr(cls, name))
        self._saved.append((cls, name, orig))
        setattr(cls, name, _scoped(fn, name, paths, active, source_info_util))
    return self

  def __exit__(self, *exc):
    for cls, name, orig in reversed(self._saved):
      if orig is None:
        delattr(cls, name)
      else:
        setattr(cls, name, orig)
    self._saved.clear()
    return False


def _public_methods(cls: type, base: type) -> list[str]:
  """`__call__` and the public plain methods of `cls` that `base` (nnx.Module) lacks."""
  names = []
  for name in dir(cls):
    if name != "__call__" and (name.startswith("_") or hasattr(base, name)):
      continue
    if name == "__call__" and not callable(getattr(cls, name, None)):
      continue
    attr = inspect.getattr_static(cls, name)
    if inspect.isfunction(attr):
      names.append(name)
  return names


def _scoped(fn, method: str, paths, active: list[int], source_info_util):
  def wrapper(self, *args, **kwargs):
    path = paths.get(id(self))
    if path is None or (active and active[-1] == id(self)):
      return fn(self, *args, **kwargs)  # outside the tree, or a method calling its own module
    if method != "__call__":
      path = path[:-1] + (f"{path[-1]}.{method}",)
    active.append(id(self))
    try:
      with source_info_util.reset_name_stack():
        with _nested_scopes(path):
          return fn(self, *args, **kwargs)
    finally:
      active.pop()

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
