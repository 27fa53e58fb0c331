"""Prices of a (placement, task schedule) as the program runs it in lock step.

Owns the lock-step rule (`lockstep_rule`: slots, groups and what leaves a group how) and the
pure-number prices built on it (`price`: step time, memory over time).

May import: `planner.core`.
"""

from jaxhybrid.planner.core.lazy import submodules

__getattr__ = submodules(__name__)
