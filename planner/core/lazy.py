"""Lazy sub-module access for the planner's packages: `jaxhybrid.planner.core.problem` resolves
after `import jaxhybrid.planner.core` without importing every module of the layer up front."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType


def submodules(package: str) -> Callable[[str], ModuleType]:
  """A module-level `__getattr__` for `package` that imports `package.<name>` on first access."""

  def __getattr__(name: str) -> ModuleType:
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
      return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  return __getattr__
