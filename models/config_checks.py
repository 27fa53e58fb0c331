"""Checks every model config runs before a model is built: types, sizes, ranges, dtype names.

Each config's `__post_init__` calls `check_fields`, so a bad `--set` value is reported by name
before anything is traced (the entry points turn the ValueError into one line, exit status 2).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

# Numeric dtypes a model may compute in or store parameters as.
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _allowed_types(hint: Any) -> tuple[type, ...]:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return tuple(t for t in typing.get_args(hint) if t is not type(None))
  return (hint,) if isinstance(hint, type) else ()


def check_fields(config: Any, *, non_negative: tuple[str, ...] = (),
                 unit_interval: tuple[str, ...] = (), positive: tuple[str, ...] = ()) -> None:
  """Raises ValueError naming the first bad field of a frozen config dataclass.

  Every int field must be >= 1 unless named in `non_negative` (then >= 0); fields named in
  `unit_interval` must lie in [0, 1); floats named in `positive` must be > 0; `dtype` and
  `param_dtype` must name a known dtype; floats must be finite; every value must have its
  annotated type (an int is accepted where a float is annotated; None only where the annotation
  allows it).
  """
  hints = typing.get_type_hints(type(config))
  for f in dataclasses.fields(config):
    value, hint = getattr(config, f.name), hints.get(f.name)
    allowed = _allowed_types(hint)
    optional = hint is not None and type(None) in typing.get_args(hint)
    if value is None:
      if not optional:
        raise ValueError(f"{f.name}=None: give a value of type {hint.__name__}")
      continue
    if allowed:
      ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
      if not ok and float in allowed and isinstance(value, int) and not isinstance(value, bool):
        ok = True
      if not ok:
        names = " or ".join(t.__name__ for t in allowed)
        raise ValueError(f"{f.name}={value!r}: must be of type {names}")
    if isinstance(value, bool):
      continue
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f"{f.name}={value}: must be a finite number")
    if isinstance(value, int) and float not in allowed:
      low = 0 if f.name in non_negative else 1
      if value < low:
        raise ValueError(f"{f.name}={value}: must be >= {low}")
    if f.name in unit_interval and not 0 <= value < 1:
      raise ValueError(f"{f.name}={value}: must be in [0, 1)")
    if f.name in positive and not value > 0:
      raise ValueError(f"{f.name}={value}: must be > 0")
    if f.name in ("dtype", "param_dtype"):
      if value not in DTYPES:
        raise ValueError(f"{f.name}={value!r}: use one of {', '.join(DTYPES)}")
