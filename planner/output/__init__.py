"""What the planner hands out: the Plan artifact and its pictures.

Owns `plan` (an immutable placement + schedule with provenance, JSON load/save and a text
summary) and `gantt` (a chart of a plan's schedule, matplotlib with the Agg backend).

May import: `planner.core`.
"""

from jaxhybrid.planner.core.lazy import submodules

__getattr__ = submodules(__name__)
