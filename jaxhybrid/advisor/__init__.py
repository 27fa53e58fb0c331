"""Where hybrid parallelism wins, from our own plans: S_MP search and the advisor.

Owns the glue between the planner and the projection: `planned` traces a model at the
projection's size, plans every (M, k, planner) of a grid, prices each plan as the program runs
(lock step) and checks its memory, and keeps the best plan per M as an S_MP with its source;
`advise` scores every (data, model) split per device count by predicted time-to-accuracy and
recommends the fastest one that fits.

May import: `jaxhybrid.api` and everything below it (graph, costs, planner, program, mesh,
errors), `jaxhybrid.projection`, `jaxhybrid.models`; never `jaxhybrid.train`.
"""

from jaxhybrid.advisor.advise import (
  Advice,
  Option,
  advise,
  advise_model,
  advise_workload,
  format_advice,
  plot_advice,
)
from jaxhybrid.advisor.planned import (
  Candidate,
  SearchConfig,
  SMPSearch,
  device_memory_bytes,
  fits_memory,
  planned_s_mp,
  price_plan,
  search,
)

__all__ = [
  "Advice", "Candidate", "Option", "SMPSearch", "SearchConfig", "advise", "advise_model",
  "advise_workload", "device_memory_bytes", "fits_memory", "format_advice", "planned_s_mp",
  "plot_advice", "price_plan", "search",
]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
