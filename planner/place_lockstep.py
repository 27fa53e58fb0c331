"""The lock-step phase of `place` (objective='lockstep'): bounds, the F/B/W MILP, the transfers
bound, and the search over (placement, task schedule) that the returned plan runs."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

from jaxhybrid.planner.lower_bounds import placement_bound
from jaxhybrid.planner.search import fbw_search, lockstep_order, spread
from jaxhybrid.planner.solvers import fbw_milp, lockstep_bound, lockstep_cpsat
from jaxhybrid.planner.search import heuristics as heur
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.lower_bounds.bounds import audited_bound
from jaxhybrid.planner.core.clock import MIN_PHASE_S, Clock
from jaxhybrid.planner.core import options as options_lib
from jaxhybrid.planner.core.options import InfeasibleError, PlannerOptions
from jaxhybrid.planner.core.problem import Problem

# What to do when the memory caps cannot be met (the end of every InfeasibleError on memory).
REMEDY = ("raise memory_caps_bytes (None or 0: no cap), use more devices, fewer micro-batches, "
          "or a smaller batch or model.")


def lockstep(
  problem: Problem,
  opts: PlannerOptions,
  caps: tuple[float, ...] | None,
  found: Mapping[str, heur.Candidate],
  best: heur.Candidate,
  clock: Clock,
) -> dict[str, Any]:
  """The lock-step search (fbw_search) from the fused searches' placements and orders.

  With `opts.method` naming a heuristic only that heuristic's placement is kept (its best
  schedule is chosen); else every placement found seeds the search, and problems with at most
  `fbw_milp_max_tasks` tasks also run the F/B/W MILP (fbw_milp) for a bound and a candidate.

  Returns:
    {'choice': fbw_search.Choice, 'baselines': {...}, 'bound': seconds}.

  Raises:
    InfeasibleError: no schedule of any candidate fits the caps (the message says by how many
      bytes the closest one missed).
  """
  k = opts.microbatches

  def order(c: heur.Candidate) -> list[tuple[int, int]]:
    return sorted(((i, m) for i in range(problem.num_nodes) for m in range(k)),
                  key=lambda t: (c.starts[t[0]][t[1]], t))

  bound = fbw_search.simple_bound(problem, k)
  if opts.method != "milp":
    got = fbw_search.best_schedule(problem, best.assignment, k, caps, order(best),
                                   kinds=opts.schedule_kinds)
    if got is None:
      raise InfeasibleError(short_message(problem, [best.assignment], k, caps))
    name, schedule, step, mem = got
    choice = fbw_search.Choice(tuple(best.assignment), schedule, step, tuple(mem),
                               f"{opts.method}/{name}")
    choice = spread.spread(problem, k, caps, choice, opts.spread_tolerance, opts.schedule_kinds)
    return {"choice": choice, "baselines": {}, "bound": bound}
  extra = []
  budget = clock.rest()
  t_end = time.monotonic() + budget
  proven = {"precedence": bound}
  by_placement = placement_bound.bound(problem, k, caps)  # None: too many nodes to enumerate
  if by_placement is not None and by_placement < float("inf"):
    proven["placement"] = by_placement
  optima = []  # the F/B/W MILP's bound per family (unsplit, split)
  for split in (False, True):
    tasks = problem.num_nodes * k * (3 if split else 2)
    if "custom" not in opts.schedule_kinds:
      break  # its order could not be returned; the simple bound stands
    if not 0 < tasks <= opts.fbw_milp_max_tasks or problem.devices < 2:
      break
    limit = min(budget / 4, opts.warm_start_max_s / 2 if opts.warm_start_max_s else math.inf)
    res = fbw_milp.solve(
      problem, k, split=split, caps=caps, time_limit_s=max(MIN_PHASE_S, limit),
      max_nodes=opts.milp_max_nodes, threads=opts.threads, seed=opts.seed, solver=opts.solver,
    )
    optima.append(res.bound)
    if res.schedule is not None:
      extra.append((f"fbw_milp_{'zb' if split else 'fb'}", res.assignment, res.schedule))
  if len(optima) == 2:
    # The plan's schedule is split or not: the smaller optimum bounds both families.
    proven["fbw_milp"] = min(optima)
  # Compute and transfers of every placement (lockstep_bound): its best placements seed too.
  paying = None
  if problem.devices > 1 and opts.lockstep_bound_share > 0:
    kinds = set(opts.schedule_kinds)
    families = tuple(f for f, have in (("fb", kinds & {"gpipe", "1f1b", "custom"}),
                                       ("fbw", kinds & {"zb", "custom"})) if have)
    limit = min(budget * opts.lockstep_bound_share,
                opts.warm_start_max_s if opts.warm_start_max_s else math.inf)
    paying = lockstep_bound.solve(
      problem, k, caps, time_limit_s=max(MIN_PHASE_S, limit),
      max_nodes=opts.milp_max_nodes, threads=opts.threads, seed=opts.seed, solver=opts.solver,
      families=families)
    proven["transfers"] = paying.bound
  bound = max(proven.values())
  # The caller's placements first, then the fused search's, the shortest fused makespan first
  # (priced in this order while time is left).
  seeds = {}
  for i, a in enumerate(opts.seed_assignments):
    if len(a) != problem.num_nodes or not all(0 <= int(d) < problem.devices for d in a):
      raise ValueError(f"seed_assignments[{i}] places {len(a)} nodes on devices "
                       f"{sorted(set(a))}: the problem has {problem.num_nodes} nodes on "
                       f"{problem.devices} devices")
    seeds[f"given_{i}"] = (tuple(int(d) for d in a), None)
  seeds.update({name: (c.assignment, order(c))
                for name, c in sorted(found.items(), key=lambda kv: (kv[1].makespan, kv[0]))})
  if paying is not None:
    seeds.update({f"transfers_{family}": (a, None) for family, a in paying.placements.items()})
  seeds.update(spread.spread_seeds(problem, seeds))
  # Time kept for choosing the groups (lockstep_cpsat) after the search.
  grouping = (problem.devices > 1 and "custom" in opts.schedule_kinds
              and opts.lockstep_groups_max_s != 0 and opts.lockstep_groups_share > 0)
  kept = 0.0
  if grouping:
    kept = min(opts.lockstep_groups_share * max(0.0, t_end - time.monotonic()),
               opts.lockstep_groups_max_s if opts.lockstep_groups_max_s else math.inf)
  ranked: list[fbw_search.Choice] = []
  choice, baselines = fbw_search.search(
    problem, k, caps, seeds, time_limit_s=max(MIN_PHASE_S, t_end - kept - time.monotonic()),
    evaluations=opts.lockstep_evaluations, seed=opts.seed, extra=extra,
    kinds=opts.schedule_kinds, target=bound * (1 + opts.gap), patience=opts.lockstep_patience,
    ranked=ranked,
  )
  if choice is None:
    raise InfeasibleError(short_message(
      problem, [c.assignment for c in found.values()], k, caps))
  if grouping and choice.step_s > bound * (1 + opts.gap):
    end = min(t_end, time.monotonic() + (opts.lockstep_groups_max_s or math.inf))
    # The cheapest placement's schedule, the same placement's best of the other family (split
    # or not: W tasks that may go into any later group can fill a pipeline's bubbles), then the
    # other ranked placements.
    other = other_family(problem, ranked[0], k, caps) if ranked else None
    for cand in ranked[:1] + ([other] if other else []) + ranked[1:]:
      if choice.step_s <= bound * (1 + opts.gap):
        break
      # Cheapest placement first, each given all the time left: a run ends sooner when it stalls
      # (lockstep_cpsat.STALL_S) or is proven optimal.
      got = grouped(problem, opts, caps, cand, max(MIN_PHASE_S, end - time.monotonic()))
      if got.step_s < choice.step_s - 1e-15:
        choice = got
  choice = spread.spread(problem, k, caps, choice, opts.spread_tolerance, opts.schedule_kinds)
  choice = spread.balance(problem, k, caps, choice, opts.spread_tolerance, opts.schedule_kinds)
  return {"choice": choice, "baselines": baselines, "bound": audited_bound(proven, choice.step_s)}


def other_family(
  problem: Problem, choice: fbw_search.Choice, k: int, caps: tuple[float, ...] | None,
) -> fbw_search.Choice | None:
  """The cheapest schedule of `choice`'s placement in the other family (split if it is not, and
  the reverse) among the generated and lock-step orders, within the caps; None if none fits."""
  split = not choice.schedule.split
  cands = [(n, s) for n, s in (fbw_search.schedules_for(problem, choice.assignment, k)
                               + lockstep_order.variants(problem, choice.assignment, k, (split,)))
           if s.split == split]
  got = fbw_search.best_schedule(problem, choice.assignment, k, caps, extra=cands, kinds=())
  if got is None:
    return None
  name, schedule, step, mem = got
  return fbw_search.Choice(choice.assignment, schedule, step, tuple(mem),
                           f"{choice.found_by.split('/')[0]}/{name}")


def grouped(
  problem: Problem, opts: PlannerOptions, caps: tuple[float, ...] | None,
  choice: fbw_search.Choice, time_limit_s: float,
) -> fbw_search.Choice:
  """`choice` with the lock-step groups CP-SAT chose for its placement (lockstep_cpsat), when
  they are cheaper and fit; else `choice` itself."""
  got = lockstep_cpsat.improve(
    problem, choice.assignment, choice.schedule, caps, time_limit_s=time_limit_s,
    threads=opts.threads, seed=opts.seed, deterministic_time=opts.cpsat_deterministic_time)
  if got is None:
    return choice
  schedule, step = got
  peak = tuple(price_lib.peak_memory_bytes(problem, choice.assignment, schedule))
  return fbw_search.Choice(choice.assignment, schedule, step, peak,
                           f"{choice.found_by}+groups")


# Contiguous splits `short_message` prices for its figure.
SHORT_MESSAGE_SPLITS = 64


def short_message(
  problem: Problem, placements: list[tuple[int, ...]], k: int, caps: tuple[float, ...] | None
) -> str:
  """One line: by how many bytes the closest placement's best schedule misses the caps (over
  `placements` and the SHORT_MESSAGE_SPLITS most balanced contiguous splits: on 8 devices there
  are tens of thousands)."""
  short = float("inf")
  tried = placements + fbw_search.contiguous_splits(problem)[:SHORT_MESSAGE_SPLITS]
  for assign in tried:
    for _, schedule in fbw_search.schedules_for(problem, assign, k):
      mem = price_lib.peak_memory_bytes(problem, assign, schedule)
      short = min(short, max(m - c for m, c in zip(mem, caps or mem)))
  # The figure is the planner's memory model over the placements priced here, not a bound: a
  # placement not among them, or the compiled program, can come closer (`program.fit`).
  return (f"No placement and task schedule fits the memory caps of "
          f"{options_lib.describe_caps(caps)} with {k} micro-batch(es): of the {len(tried)} "
          f"placements priced for this message, the closest needs {options_lib.size_text(short)} "
          "more "
          f"on its fullest device by the planner's memory model; {REMEDY}")
