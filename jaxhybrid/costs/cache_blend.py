"""Node times from a warm or a cache-flushed profile, whichever the model's own step matches.

A node timed back to back finds its data in the core's caches (the previous run left it there);
timed after a cache-sized write (`ProfiledCostModel(flush_bytes=...)`) it reads everything from
memory. Inside a training step a task sees something in between, and where depends on the model:
a step whose data fits in the caches keeps it there from task to task, one whose data does not
reads it from memory. Neither profile alone prices every model (bench_mp on this project's 2-core
VM, one pinned core per device): back-to-back profiles under-priced Inception-V3 small's plans by
33.5 % (mean step error), cache-flushed ones over-priced the uniform chain's by 15.3 %.

`CacheBlendedCostModel` tells the two apart with the model's own step: it times the whole forward
+ backward of its graph back to back (one compiled function, as a training loop runs it step
after step) and compares it with the sum of the warm node times. No slower than that sum (within
`WARM_MARGIN`): the step keeps its data cached, `cold_share` = 0, every node time (F, B, W and
F + B) is the warm one; slower: it reads from memory, `cold_share` = 1, the flushed times.
`cold_share` may also be given, any value in [0, 1] pricing `warm + cold_share * (cold - warm)`.
Measured on one pinned core of this project's VM (the micro-batch graphs bench_mp plans; node
sums warm / cold and the whole step; idle, then with the other core running the model's step as
bench_mp profiles):

  chain (1,024 rows)       idle 17.7 / 20.2 ms, whole 17.4;  loaded 18.0 / 22.1, whole 17.4  -> 0
  GNMT small (16 rows)     idle 115 / 125 ms, whole 142;     loaded 120 / 127, whole 140     -> 1
  BigLSTM small (64 rows)  idle 339 / 294 ms, whole 375;     loaded 332 / 338, whole 336     -> 1, 0
                                                            (another run 257 / 274, 297  -> 1)
  Inception-V3 small (16)  idle 61.4 / 80.6 ms, whole 90.3;  loaded 61.8 / 95.2, whole 82.8  -> 1

Why a test and not the interpolation `(whole - warm) / (cold - warm)`: XLA fuses across nodes in
the whole step, which the program (one conditional branch per node) does not, so the whole step
sits below the program's unfused tasks. Loaded, Inception-V3's whole step sat 0.63 of the way
from warm to cold; priced at that share its three plans came out 10-14 % faster than they ran,
priced cold 0.7-2.1 % off. The fusion makes a whole step above the warm sum a sure sign of cache
misses, one at or below it a sign of none. BigLSTM's two sums lie within 2-13 % of each other and
either side of its step; its plans' prices barely depend on the choice (loaded, 3 % apart).

Assumptions (named, not pinned down by measurement in general): `WARM_MARGIN`; one share per
graph (a plan that gives each device a smaller part of the model keeps more of it cached, so a
one-device step's test errs towards pricing a plan's devices cold).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxhybrid import graph as graph_lib
from jaxhybrid.costs.cost_model import CostModel, ProfiledCostModel


# `fit_cold_share`: the whole step may take this much more than the warm node sum and still count
# as warm (assumption: the spread of one profiled time between runs on this project's VM, where
# one function's median moved 2-10 % from one profile to the next: the chain's whole step 17.4
# and 17.7 ms, Inception-V3's 81 and 90 ms).
WARM_MARGIN = 0.05


def fit_cold_share(warm_s: float, whole_s: float, margin: float = WARM_MARGIN) -> float:
  """0.0 when the whole step (`whole_s`) is no slower than the warm node sum (`warm_s`) by more
  than `margin` (a fraction), else 1.0 (module docstring)."""
  if margin < 0:
    raise ValueError(f"margin={margin} must be >= 0.")
  return 0.0 if whole_s <= warm_s * (1.0 + margin) else 1.0


def share_from_program(warm_s: float, cold_s: float, program_s: float) -> float:
  """The cold share at which a priced program takes `program_s`, measured: `warm_s` and `cold_s`
  are its price with every task warm (share 0) and cold (share 1), all else equal. Linear
  interpolation clipped to [0, 1]; 0 when the two prices are equal (nothing to tell apart).

  The anchor for this is the model's own hybrid program on one device at the plan's micro-batch
  count (bench_mp's `--profile_blend_anchor=program`): it runs the tasks the plans run, each as
  its own conditional branch, so unlike the whole step (`fit_cold_share`) no cross-node fusion
  pulls it below the unfused tasks' time and the interpolation is meaningful.
  """
  if cold_s == warm_s:
    return 0.0
  return min(1.0, max(0.0, (program_s - warm_s) / (cold_s - warm_s)))


@dataclasses.dataclass(frozen=True)
class BlendFit:
  """The figures a `CacheBlendedCostModel` fitted its share from (seconds; dispatch subtracted).

  `anchor`: what set the share: 'whole' (the whole step, `fit_cold_share`), 'program' (a
  measured one-device program, `share_from_program`; its step in `program_s`, its price all warm
  and all cold in `program_warm_s` / `program_cold_s`) or a caller's fixed rule ('cold').
  """

  warm_sum_s: float
  cold_sum_s: float
  whole_s: float
  cold_share: float
  anchor: str = "whole"
  program_s: float | None = None
  program_warm_s: float | None = None
  program_cold_s: float | None = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class CacheBlendedCostModel(CostModel):
  """Profiled node times blended from a back-to-back and a cache-flushed profile (module doc).

  Build with `cache_blended(graph, ...)`, or from two `ProfiledCostModel`s of one graph, the first
  back to back (`flush_bytes=0`), the second flushed. The share is fitted on first use (it times
  every node in both profiles and the whole step; all cached on disk like any profile), unless
  `cold_share` is given. Transfers and all-reduces are the cold model's (its link).
  """

  source = "profiled"

  def __init__(self, warm: ProfiledCostModel, cold: ProfiledCostModel, *,
               cold_share: float | None = None):
    """Builds the blend (measures nothing until a time is asked for).

    Args:
      warm: the back-to-back profile (`flush_bytes=0`).
      cold: the cache-flushed profile of the same graph, same options otherwise.
      cold_share: a fixed share in [0, 1] instead of the fitted one.

    Raises:
      ValueError: the two models are not of one graph, `warm` flushes, `cold` does not, their
        task options differ, or `cold_share` is outside [0, 1].
    """
    if warm.graph is not cold.graph:
      raise ValueError("warm and cold must profile the same OpGraph object.")
    if warm.flush_bytes != 0 or cold.flush_bytes <= 0:
      raise ValueError(
        f"warm.flush_bytes={warm.flush_bytes}, cold.flush_bytes={cold.flush_bytes}: the warm "
        "profile runs back to back (0) and the cold one flushes (> 0).")
    if (warm.tasks, warm.branch_remat) != (cold.tasks, cold.branch_remat):
      raise ValueError("warm and cold must time the same tasks (tasks=, branch_remat= equal).")
    if cold_share is not None and not 0.0 <= cold_share <= 1.0:
      raise ValueError(f"cold_share={cold_share} must be in [0, 1].")
    self.warm, self.cold = warm, cold
    self.graph = cold.graph
    self.link = cold.link
    self.hardware_name = cold.hardware_name
    self.cache_path = cold.cache_path
    self.tasks = cold.tasks
    self._fixed = cold_share
    self._fit: BlendFit | None = None
    if self.tasks:  # attributes only here: callers test hasattr(costs, "forward_time_s")
      self.forward_time_s = lambda node: self._mix(warm.forward_time_s(node),
                                                   cold.forward_time_s(node))
      self.input_grad_time_s = lambda node: self._mix(warm.input_grad_time_s(node),
                                                      cold.input_grad_time_s(node))
      self.weight_grad_time_s = lambda node: self._mix(warm.weight_grad_time_s(node),
                                                       cold.weight_grad_time_s(node))

  @property
  def fit(self) -> BlendFit:
    """The share and what it was fitted from (profiles every node twice on first use)."""
    if self._fit is None:
      w = sum(self.warm.profile_all())
      c = sum(self.cold.profile_all())
      whole = self.warm.whole_step_time_s()
      share = fit_cold_share(w, whole) if self._fixed is None else self._fixed
      self._fit = BlendFit(warm_sum_s=w, cold_sum_s=c, whole_s=whole, cold_share=share)
    return self._fit

  def at_share(self, share: float, anchor: str, **record: float) -> CacheBlendedCostModel:
    """A blend of the same two profiles at `share`; its `fit` records `anchor` (what set the
    share) and `record` (BlendFit's program fields) beside this model's sums."""
    out = CacheBlendedCostModel(self.warm, self.cold, cold_share=share)
    out._fit = dataclasses.replace(self.fit, cold_share=share, anchor=anchor, **record)
    return out

  def anchored(self, program_s: float, warm_s: float, cold_s: float) -> CacheBlendedCostModel:
    """A blend of the same two profiles whose share is fitted to a measured program
    (`share_from_program(warm_s, cold_s, program_s)`; `warm_s` / `cold_s`: that program priced
    with shares 0 and 1); its `fit` records the anchor beside this model's sums."""
    return self.at_share(share_from_program(warm_s, cold_s, program_s), "program",
                         program_s=program_s, program_warm_s=warm_s, program_cold_s=cold_s)

  @property
  def cold_share(self) -> float:
    return self._fixed if self._fixed is not None else self.fit.cold_share

  def _mix(self, warm_s: float, cold_s: float) -> float:
    return warm_s + self.cold_share * (cold_s - warm_s)

  def node_time_s(self, node: graph_lib.Node) -> float:
    return self._mix(self.warm.node_time_s(node), self.cold.node_time_s(node))

  def whole_step_time_s(self, graph: graph_lib.OpGraph | None = None) -> float:
    """The whole forward + backward, back to back (the warm model's; see its method)."""
    return self.warm.whole_step_time_s(graph)

  def profile_all(self) -> list[float]:
    """Times (or reads) every node in both profiles and fits the share; blended times in order."""
    return [self.node_time_s(n) for n in self.graph.nodes]

  @property
  def measured(self) -> int:
    """Timings this instance actually made (both profiles)."""
    return self.warm.measured + self.cold.measured


def cache_blended(graph: graph_lib.OpGraph, *, flush_bytes: int | str = "auto",
                  cold_share: float | None = None, **kwargs: Any) -> CacheBlendedCostModel:
  """A `CacheBlendedCostModel` of `graph`: two `ProfiledCostModel(graph, **kwargs)`, one back to
  back and one flushing `flush_bytes` ('auto': the host's cache size, see ProfiledCostModel).

  Raises:
    ValueError: `flush_bytes` resolves to 0 (nothing to blend: use `ProfiledCostModel`), or as
      `ProfiledCostModel` and `CacheBlendedCostModel` do.
  """
  cold = ProfiledCostModel(graph, flush_bytes=flush_bytes, **kwargs)
  if cold.flush_bytes <= 0:
    raise ValueError(
      f"flush_bytes={flush_bytes!r} flushes nothing on this backend ({cold.backend}): the two "
      "profiles would be one; use ProfiledCostModel instead.")
  warm = ProfiledCostModel(graph, flush_bytes=0, **kwargs)
  return CacheBlendedCostModel(warm, cold, cold_share=cold_share)
