"""The time budget of `place`: what is kept back from the limit, and its split between phases."""

from __future__ import annotations

import math
import time

# Seconds kept back from the time limit, at most (and at most _RESERVE_SHARE of it): CBC overruns
# its limit by up to ~1 s on the paper's graphs, and the plan is built after it returns.
_CLEANUP_S = 1.5
_RESERVE_SHARE = 0.03
# Least seconds a phase is given, even when the others have used up the time.
MIN_PHASE_S = 0.05
class Clock:
  """The time left of `place` and its split between the phases still to run."""

  def __init__(self, limit_s: float, reserve_share: float = 0.0, warm_max_s: float | None = None):
    self._t0 = time.monotonic()
    # The phases end by the limit less a reserve for the solvers' overrun and building the plan;
    # `share` splits the time before the last phase's kept seconds, ending by `_warm_end`.
    self._deadline = self._t0 + limit_s - min(_CLEANUP_S, _RESERVE_SHARE * limit_s)
    self._kept = reserve_share * (self._deadline - self._t0)
    self._warm_end = self._t0 + warm_max_s if warm_max_s is not None else math.inf

  def elapsed(self) -> float:
    return time.monotonic() - self._t0

  def share(self, phase: str, phases: dict[str, float]) -> float:
    """Seconds for `phase`: the time left split in proportion to the weights of `phase` and of
    the phases after it in `phases` (which loses `phase` and those before it). Positive."""
    names = list(phases)
    rest = names[names.index(phase):]
    weight, total = phases[phase], sum(phases[n] for n in rest)
    for n in names[:names.index(phase) + 1]:
      del phases[n]
    end = min(self._deadline - self._kept, self._warm_end)
    left = max(0.0, end - time.monotonic())
    return max(MIN_PHASE_S, left * weight / total if total > 0 else left)

  def rest(self) -> float:
    """Seconds for the last phase: all that is left, the kept share included. Positive."""
    self._kept = 0.0
    return max(MIN_PHASE_S, self._deadline - time.monotonic())
