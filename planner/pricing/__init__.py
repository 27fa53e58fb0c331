"""Prices of a (placement, task schedule) as the program runs it in lock step.

Owns the lock-step rule (`lockstep_rule`: slots, groups and what leaves a group how) and the
pure-number prices built on it (`price`: step time, memory over time).

May import: `planner.core`.
"""


def __getattr__(name: str):
  """Loads a module of this layer on first attribute access (`planner.core.problem`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
