"""Which dtypes carry gradients: every floating-point dtype, numpy's and ml_dtypes' alike.

`np.issubdtype(dtype, np.inexact)` is False for bfloat16 and the float8 types (ml_dtypes defines
them outside numpy's hierarchy), so a bf16 activation looked like an integer: it got no cotangent
and its pullback failed on the first step. Importing ml_dtypes also registers their names, so
`np.dtype("bfloat16")` works for dtypes stored as strings (Problem.value_dtypes).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def is_float(dtype: Any) -> bool:
  """Whether `dtype` (a dtype or its name) is floating point (complex included)."""
  dt = np.dtype(dtype)
  if np.issubdtype(dt, np.inexact):
    return True
  try:
    ml_dtypes.finfo(dt)
  except ValueError:
    return False
  return True
