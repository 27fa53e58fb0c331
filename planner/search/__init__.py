"""Heuristic searches: placements and task orders found without a proof of optimality.

Owns the placement heuristics (`heuristics`: m-ETF, pipeline DP, interleaved, local search;
the solvers' warm starts and fallbacks), lock-step task orders for any placement
(`lockstep_order`) and the search over (placement, task schedule) by lock-step price
(`fbw_search`).

May import: `planner.core`, `planner.pricing`, `planner.lower_bounds`.
"""

from jaxhybrid.planner.core.lazy import submodules

__getattr__ = submodules(__name__)
