"""Combinatorial lower bounds that hold for every placement (the honest side of a plan's gap).

Owns the makespan bounds of node schedules (`bounds`) and the one-machine bound on the lock-step
price, placement by placement (`placement_bound`). Bounds that solve a MILP live with the
solvers (`planner.solvers.relax`, `planner.solvers.lockstep_bound`): they build their model with
`solvers.milp`, which itself reads the bounds here.

May import: `planner.core`, `planner.pricing`.
"""

from jaxhybrid.planner.core.lazy import submodules

__getattr__ = submodules(__name__)
