"""What the planner hands out: the Plan artifact and its pictures.

Owns `plan` (an immutable placement + schedule with provenance, JSON load/save and a text
summary) and `gantt` (a chart of a plan's schedule, matplotlib with the Agg backend).

May import: `planner.core`.
"""


def __getattr__(name: str):
  """Loads a module of this layer on first attribute access (`planner.core.problem`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
