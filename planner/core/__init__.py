"""The planner's problem and its schedules: the numbers every other layer of the planner reads.

Owns the placement problem (`problem`: per-node compute, memory and edge bytes, no graph
library), the planner's options and typed errors (`options`), the dtypes that carry gradients
(`dtypes`), node schedules with their independent checker (`schedule`), F/B/W task schedules
(`task_schedule`) and the time budget of a search (`clock`).

May import: nothing of jaxhybrid (numpy and ml_dtypes only). Every other planner layer imports it.
"""


def __getattr__(name: str):
  """Loads a module of this layer on first attribute access (`planner.core.problem`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
