"""S_MP(M) as a recorded estimate: the value, where it comes from, and which plan gave it.

Every model-parallel speedup the projection uses is an `SMPEstimate`. Its `source` says where
the number comes from ('planner: ...' for our own plans priced as the program runs,
'paper: ...' for a figure of Pal et al. 2019, 'user: ...' for a value given by hand), so a
projection can always be traced back to its inputs. The planner search itself lives outside
this package (`jaxhybrid.advisor.planned`): the projection does not import the planner.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SOURCE_KINDS = ("planner", "paper", "user")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SMPEstimate:
  """One model-parallel speedup S_MP(M) with its provenance.

  S_MP(M) = T_1 / T_M: one device's step on the per-worker batch b over the step of a worker of
  M devices on the same batch (PAPER.md, "Hybrid step").
  """

  m: int  # M: devices per worker
  s_mp: float  # S_MP(M)
  source: str  # 'planner: ...', 'paper: ...' or 'user: ...' (see SOURCE_KINDS)
  microbatches: int | None = None  # k of the plan that gave S_MP (planner only)
  planner: str = ""  # method of that plan ('milp', 'dp', ...) and what found it
  predicted_step_s: float | None = None  # T_M: the plan priced as the program runs (lock step)
  single_device_s: float | None = None  # T_1: one device, batch b, priced the same way
  memory_bytes_per_device: float | None = None  # largest device's bytes under that plan
  fits: bool | None = None  # whether that fits the device memory (None: not checked)
  hardware: str = ""  # hardware of the cost model the plan was priced on

  def __post_init__(self):
    if self.m < 1 or not (self.s_mp > 0 and math.isfinite(self.s_mp)):
      raise ValueError(f"SMPEstimate(m={self.m}, s_mp={self.s_mp}): need M >= 1 and S_MP > 0.")
    if self.source.split(":")[0] not in SOURCE_KINDS:
      raise ValueError(
        f"SMPEstimate source {self.source!r} must start with one of "
        f"{', '.join(k + ':' for k in SOURCE_KINDS)} (say where the number comes from)."
      )

  @property
  def kind(self) -> str:
    """'planner', 'paper' or 'user'."""
    return self.source.split(":")[0]

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def user_s_mp(m: int, value: float, how: str = "given by the user") -> SMPEstimate:
  """An S_MP the user typed (a flag, a measurement, a plan file)."""
  return SMPEstimate(m=m, s_mp=value, source=f"user: {how}")
