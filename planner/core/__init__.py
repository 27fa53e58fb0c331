"""The planner's problem and its schedules: the numbers every other layer of the planner reads.

Owns the placement problem (`problem`: per-node compute, memory and edge bytes, no graph
library; `graph_reads`: what it reads from a graph by duck typing), the planner's options and typed errors (`options`), the dtypes that carry gradients
(`dtypes`), node schedules with their independent checker (`schedule`), F/B/W task schedules
(`task_schedule`), the pieces of split parameter leaves by node name (`pieces`), the time
budget of a search (`clock`) and the lazy sub-module access every layer package uses (`lazy`).

May import: nothing of jaxhybrid (numpy and ml_dtypes only). Every other planner layer imports it.
"""

from jaxhybrid.planner.core.lazy import submodules

__getattr__ = submodules(__name__)
