"""`--set key=value` overrides of a model config, parsed (run.py, advise.py)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from jaxhybrid import errors


def parse_overrides(items: Sequence[str]) -> tuple[tuple[str, Any], ...]:
  """`["hidden_size=256", "dtype=bfloat16"]` -> (("hidden_size", 256), ("dtype", "bfloat16")).

  Values are parsed with `ast.literal_eval`, falling back to the raw string.

  Raises:
    UsageError: an item without '='.
  """
  out = []
  for item in items or ():
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
      raise errors.UsageError(f"--set {item!r} is not key=value: write e.g. --set hidden_size=256")
    try:
      value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
      value = raw.strip()
    out.append((key.strip(), value))
  return tuple(out)
