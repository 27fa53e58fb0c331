"""Exact solvers and the bounds they prove: MILP (python-mip) and CP-SAT (OR-Tools) models.

Owns the pipelined DLPlacer MILP (`milp`) and the F/B/W task MILP (`fbw_milp`), the CP-SAT
searches (`cpsat`, `lockstep_cpsat`) with their child processes (`cpsat_worker`,
`lockstep_cpsat_worker`, run as plain scripts that import nothing of jaxhybrid), the exact
decomposition at cut vertices (`decompose`, solved segment by segment with `milp`), and the two
bounds that are MILP relaxations built on `milp`'s model (`relax`, `lockstep_bound`). The
MILP solves run in one long-lived child process (`child`), so a crash inside CBC cannot end the
caller's job.

May import: `planner.core`, `planner.pricing`, `planner.lower_bounds`, `planner.search`.
"""

from jaxhybrid.planner.core.lazy import submodules

__getattr__ = submodules(__name__)
