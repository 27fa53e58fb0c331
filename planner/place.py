"""`place`: heuristics, then the DLPlacer MILP, then a Plan.

One micro-batch: the exact decomposition at cut vertices (decompose.py). k > 1 micro-batches
overlap across those cuts, so the whole graph is planned at once:
  1. lower bound: bounds.lower_bound (critical path, per-device fill/drain, energetic reasoning),
     raised by enumerating the devices of the first nodes (bounds.prefix_bound) and by the
     placement relaxation (relax.py);
  2. upper bound: the heuristics, then simulated annealing from the best of them and of the
     relaxation's placement (`search_chains` runs), optionally the window descent
     (heuristics.window_search), then the CP-SAT search (cpsat.py) from the best schedule so far,
     each stopping once within `gap` of the bound;
  3. the pipelined MILP (milp.py), warm-started from that schedule and given the bound, with the
     time left; skipped when the bound already proves the warm start within `gap`.
`Plan.lower_bound_s` is the largest of these proven bounds (CP-SAT's included; the MILP's own
bound counts only when no orderings were fixed, see PlannerOptions.max_free_pairs), and
`Plan.gap` is (makespan - lower_bound_s) / makespan.

With objective='lockstep' (the default) the searches above only supply warm starts: the returned
placement and F/B/W task schedule (`Plan.task_schedule`, what the program runs) minimise the
lock-step price (planner.price) within the memory caps over time (fbw_search.py; for small
problems also the F/B/W MILP, fbw_milp.py). `Plan.lockstep_bound_s` is the largest of the
precedence bound (fbw_search.simple_bound), the one-machine bound over every placement
(placement_bound.py, problems of at most 16 nodes), the F/B/W MILP's optimum and the bound
that pays for compute and transfers of every placement ('transfers', lockstep_bound.py, for the
schedule families `schedule_kinds` allows; its best placements also seed the search). The
fused fields (`schedule`, `fused_makespan_s`, `lower_bound_s`, `gap`) then describe the fused
schedule of the returned placement.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxhybrid.planner.lower_bounds import bounds as bounds_lib
from jaxhybrid.planner.solvers import cpsat, decompose, milp, relax
from jaxhybrid.planner.search import heuristics as heur
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.core import schedule as sched
from jaxhybrid.planner.lower_bounds.bounds import audited_bound
from jaxhybrid.planner.core.clock import Clock as _Clock
from jaxhybrid.planner.core import options as options_lib
from jaxhybrid.planner.core.options import InfeasibleError, PlannerOptions, as_options
from jaxhybrid.planner.place_lockstep import REMEDY as _REMEDY
from jaxhybrid.planner.place_lockstep import lockstep as _lockstep
from jaxhybrid.planner.output.plan import Plan
from jaxhybrid.planner.core.problem import Problem

log = logging.getLogger(__name__)

# Placements the k = 1 local search evaluates per (node, device) pair: it only warm-starts the
# exact decomposition, so a short anneal suffices.
_K1_EVALUATIONS = 20
# The same with k > 1: high enough that the time share, not this cap, ends each annealing run on
# the paper's graphs (the default cap, 200, stopped Inception-V3 runs after a third of their time).
_PIPELINE_EVALUATIONS = 5000


def place(
  graph: Any,
  costs: Any,
  *,
  devices: int,
  options: PlannerOptions | None = None,
  **option_overrides: Any,
) -> Plan:
  """Places a traced graph on the `devices` of the model axis.

  Args:
    graph: an OpGraph (nodes with id, name, param_bytes, out_bytes; edges with src, dst, bytes;
      fingerprint()).
    costs: a cost model (node_time_s, transfer_time_s, source, hardware_name).
    devices: M.
    options: planner options; `devices` and `option_overrides` replace its fields.
    **option_overrides: PlannerOptions fields, e.g. microbatches=4, time_limit_s=10.

  Returns:
    The plan.

  Raises:
    InfeasibleError: no placement fits the memory caps.
    ValueError: bad options.
  """
  opts = as_options(options, {"devices": devices, **option_overrides})
  return place_problem(Problem.from_graph(graph, costs, opts), opts)


def _held(problem: Problem) -> str:
  b = problem.held_bytes
  if not b:
    return ""
  return (f" after the {options_lib.size_text(b)} every device holds (batch, a gradient task's "
          "copies)")


def _check_memory(problem: Problem, k: int, caps: tuple[float, ...] | None) -> None:
  """Raises InfeasibleError when memory cannot fit whatever the placement (k micro-batches'
  residuals alive per node; k = 0: the F/B/W model, one micro-batch per node, static in total)."""
  if caps is None:
    return
  mem = problem.memory_bytes(max(k, 1))
  biggest = max(range(problem.num_nodes), key=lambda i: mem[i], default=None)
  if biggest is not None and mem[biggest] > max(caps):
    raise InfeasibleError(
      f"Node {problem.names[biggest]!r} needs {options_lib.size_text(mem[biggest])} with "
      f"{max(k, 1)} "
      f"micro-batch(es) alive; "
      f"the largest device cap is {options_lib.size_text(max(caps))}{_held(problem)} "
      f"({options_lib.size_text(mem[biggest] - max(caps))} short): "
      f"{_REMEDY}"
    )
  if k == 0:  # F/B/W: residuals need not all be alive at once; the static bytes must fit
    mem = tuple(float(b) for b in problem.static_bytes)
  if sum(mem) > sum(caps):
    raise InfeasibleError(
      f"The graph needs {options_lib.size_text(sum(mem))} "
      f"({f'{k} micro-batch(es) alive' if k else 'static'}); the {problem.devices} "
      f"devices hold {options_lib.size_text(sum(caps))}{_held(problem)} "
      f"({options_lib.size_text(sum(mem) - sum(caps))} short): "
      f"{_REMEDY}"
    )


def place_problem(problem: Problem, options: PlannerOptions | None = None) -> Plan:
  """Places a hand-made or pre-built problem.

  Args:
    problem: the problem (its `devices` must equal options.devices).
    options: planner options (default: PlannerOptions(devices=problem.devices)).

  Returns:
    The plan: the MILP's best schedule (never worse than any heuristic), or, with
    `options.method` naming a heuristic, that heuristic's.

  Raises:
    InfeasibleError: memory caps cannot be met (the message says by how much).
    ValueError: options.devices differs from problem.devices.
  """
  opts = options or PlannerOptions(devices=problem.devices)
  # The lock-step search keeps its share; warm starts split the rest, ending by warm_start_max_s.
  lock_share = opts.lockstep_search_share if opts.objective == "lockstep" else 0.0
  clock = _Clock(opts.time_limit_s, reserve_share=lock_share,
                 warm_max_s=opts.warm_start_max_s if lock_share else None)
  if opts.devices != problem.devices:
    raise ValueError(
      f"options.devices={opts.devices} but the problem was built for {problem.devices}; "
      "build the problem with the same options."
    )
  k, given_caps = opts.microbatches, opts.caps(problem.device_memory_bytes)
  # The solvers fit rows and residuals under the caps less what every device holds whatever the
  # placement (Problem.held_bytes: the batch, a gradient task's copies); the plan reports the
  # caps as given.
  lock_caps = None if given_caps is None else tuple(
    c - problem.held_bytes for c in given_caps)
  if opts.method == "milp" and opts.solver == "highs":
    milp.new_model(opts.solver)  # fails now, not after the heuristics, if HiGHS is missing
  # With the lock-step objective the caps bind the F/B/W schedule's memory over time (fewer
  # residuals alive than the fused model's k per node): the fused searches, warm starts only,
  # run uncapped, and a node needs its static bytes and one micro-batch's residuals at least.
  lockstep = opts.objective == "lockstep" and opts.method == "milp"
  caps = None if lockstep else lock_caps
  _check_memory(problem, 0 if lockstep else k, lock_caps)
  # The MILP with k > 1 micro-batches on several devices: bounds and searches for pipelines.
  pipelined = opts.method == "milp" and k > 1 and problem.devices > 1
  binding = caps is not None and sum(problem.memory_bytes(k)) > min(caps)
  decomposed = opts.method == "milp" and k == 1 and not binding and opts.decompose
  # Phases still to run, with their weights in the split of the time left (_Clock.share).
  # (Phases that do not run here weigh 0.)
  phases = {
    "prefix": opts.prefix_share if pipelined else 0.0,
    "relaxation": opts.relaxation_share if pipelined else 0.0,
    "annealing": opts.local_search_share if k == 1 else opts.pipeline_search_share,
    "window": opts.window_search_share if k > 1 else 0.0,
    "cpsat": opts.cpsat_share if pipelined else 0.0,
    "milp": opts.milp_share if pipelined else 1.0 - opts.local_search_share,
  }
  proven = {"analytic": bounds_lib.lower_bound(problem, k)}  # name -> a proven lower bound
  lower = proven["analytic"]
  if pipelined:
    proven["prefix"] = lower = bounds_lib.prefix_bound(
      problem, k, lower, opts.prefix_assignments,
      None if opts.work_limited else clock.share("prefix", phases),
    )

  report = opts.progress or (lambda phase, incumbent_s, bound_s: None)
  report("bounds", float("inf"), lower)
  # Heuristics (baselines, warm start, fallback).
  found: dict[str, heur.Candidate] = {}
  for name, fn in (("single", heur.single), ("etf", heur.etf), ("dp", heur.contiguous_dp),
                   ("interleaved", heur.interleaved)):
    if opts.method in ("milp", "local", name):
      cand = fn(problem, k, caps)
      if cand is not None:
        found[name] = cand
  # k > 1 with the MILP: the placement relaxation raises the bound and seeds the local search.
  seeds = list(found.values())
  if pipelined:
    relaxation = relax.solve(
      problem, k, caps=caps, lower_bound=lower, time_limit_s=clock.share("relaxation", phases),
      threads=opts.threads, seed=opts.seed, solver=opts.solver, max_nodes=opts.milp_max_nodes,
    )
    if relaxation.bound == float("inf"):
      raise InfeasibleError(
        f"No placement fits the memory caps of {options_lib.describe_caps(caps)} with {k} "
        "micro-batches; "
        "raise the caps or use fewer micro-batches."
      )
    proven["relaxation"] = relaxation.bound
    lower = max(lower, relaxation.bound)
    if relaxation.assignment is not None:
      seeds.append(heur.evaluate(problem, relaxation.assignment, k))
  if opts.method in ("milp", "local") and seeds:
    target = lower * (1 + opts.gap) if opts.method == "milp" else 0.0
    found["local"] = local = _anneal(problem, opts, caps, clock, phases, seeds[:len(found)],
                                     seeds, target)
    report("search", local.makespan, lower)
    if pipelined and opts.cpsat_share > 0 and local.makespan > target:
      found_cp = cpsat.solve(
        problem, k, warm=local, caps=caps, lower_bound=lower,
        time_limit_s=clock.share("cpsat", phases), threads=opts.threads, seed=opts.seed,
        gap=opts.gap, deterministic_time=opts.cpsat_deterministic_time,
      )
      proven["cpsat"] = found_cp.bound
      lower = max(lower, found_cp.bound)
      found["cpsat"] = found_cp.candidate
      report("cpsat", min(local.makespan, found_cp.candidate.makespan), lower)
  if not found:
    raise InfeasibleError(
      "No heuristic found a placement within the memory caps of "
      f"{options_lib.describe_caps(caps)}; the MILP is not attempted without a warm start. "
      f"Needs: {options_lib.size_text(sum(problem.memory_bytes(k)))} in total."
    )
  heuristics = {name: c.makespan for name, c in found.items()}
  best_name = min(found, key=lambda n: found[n].makespan)
  best = found[best_name]

  method, solver, status = opts.method, "none", "heuristic"
  found_by = best_name
  if opts.method != "milp":
    best = found[opts.method]
    found_by = opts.method
  else:
    solver = opts.solver
    if decomposed:
      dec = decompose.solve(
        problem, time_limit_s=clock.share("milp", phases), threads=opts.threads, seed=opts.seed,
        gap=opts.gap, solver=opts.solver, cuts=opts.cuts, max_nodes=opts.milp_max_nodes,
        evaluations=opts.search_evaluations, max_free_pairs=opts.max_free_pairs,
      )
      proven["decomposition"] = dec.bound
      lower = max(lower, dec.bound)
      if dec.candidate.makespan <= best.makespan:
        best, found_by = dec.candidate, "milp"
      status = "optimal" if dec.all_optimal else "feasible"
    elif best.makespan <= lower * (1 + opts.gap):
      # The bound already proves the warm start optimal within the tolerance: the MILP could
      # only confirm it.
      status = "optimal"
      log.info("warm start %.6g within gap %.3g of the bound %.6g; MILP skipped", best.makespan,
               opts.gap, lower)
    else:
      sym, _ = decompose.symmetry_group(problem)
      equal_caps = caps is None or len(set(caps)) == 1
      limit = clock.share("milp", phases)
      result = milp.solve(
        problem, k, warm=best, caps=caps,
        interchangeable=range(problem.devices) if sym and equal_caps else (),
        lower_bound=lower, time_limit_s=limit, threads=opts.threads, seed=opts.seed,
        gap=opts.gap, solver=opts.solver, max_free_pairs=opts.max_free_pairs, cuts=opts.cuts,
        max_nodes=opts.milp_max_nodes,
      )
      if result.candidate is None:
        log.warning("The MILP found no incumbent (%s) in %.1fs; returning the best heuristic "
                    "(%s).", result.status, limit, best_name)
        status = "heuristic"
      else:
        if result.candidate.makespan < best.makespan:
          found_by = "milp"
        best = result.candidate
        status = result.status
        if not result.restricted:  # a restricted MILP's bound holds for its orderings only
          proven["milp"] = result.bound
  report(opts.method, best.makespan, max([lower, *proven.values()]))
  lock = None
  if opts.objective == "lockstep":
    lock = _lockstep(problem, opts, lock_caps, found, best, clock)
    if lock["choice"].assignment != tuple(best.assignment):
      best = heur.evaluate(problem, lock["choice"].assignment, k)
      found_by = "lockstep"  # the fused schedule of the lock-step search's placement
  makespan = best.makespan
  bound = audited_bound(proven, makespan)
  gap = (makespan - bound) / makespan if makespan > 0 else 0.0
  report("done", lock["choice"].step_s if lock else makespan, lock["bound"] if lock else bound)
  # 'optimal' means optimal within the gap tolerance, as solvers report it.
  if status in ("optimal", "feasible"):
    status = "optimal" if gap <= opts.gap + 1e-9 else "feasible"
  single_s = k * sum(problem.compute_s)
  extra: dict[str, Any] = {"memory_caps_bytes": tuple(given_caps or ())}
  if lock is not None:
    choice = lock["choice"]
    extra.update(
      task_schedule=choice.schedule,
      lockstep_step_s=choice.step_s,
      lockstep_speedup=single_s / choice.step_s if choice.step_s > 0 else 1.0,
      lockstep_bound_s=lock["bound"],
      device_peak_bytes=tuple(b + problem.held_bytes for b in choice.peak_bytes),
      lockstep_baselines=lock["baselines"],
      lockstep_found_by=choice.found_by,
    )
  return Plan(
    node_names=problem.names,
    assignment=best.assignment,
    schedule=sched.to_tasks(problem, best.assignment, [list(r) for r in best.starts]),
    transfers=sched.to_transfers(problem, best.assignment, [list(r) for r in best.starts]),
    devices=problem.devices,
    microbatches=k,
    node_compute_s=problem.compute_s,
    node_memory_bytes=problem.memory_bytes(k),
    fused_makespan_s=makespan,
    single_device_s=single_s,
    fused_speedup=single_s / makespan if makespan > 0 else 1.0,
    lower_bound_s=bound,
    method=method,
    solver=solver,
    status=status,
    gap=gap,
    solve_time_s=clock.elapsed(),
    heuristics=heuristics,
    found_by=found_by,
    graph_fingerprint=problem.fingerprint,
    cost_source=problem.cost_source,
    hardware=problem.hardware,
    **extra,
  )


def _anneal(
  problem: Problem,
  opts: PlannerOptions,
  caps: tuple[float, ...] | None,
  clock: _Clock,
  phases: dict[str, float],
  heuristics: list[heur.Candidate],
  seeds: list[heur.Candidate],
  target: float,
) -> heur.Candidate:
  """Simulated annealing (`search_chains` runs with k > 1), then, with k > 1 and a window share,
  the window descent: the `local` candidate.

  The first run starts from the best of `heuristics` (a plain annealing of the problem, which the
  plan is therefore never worse than), the others from the best of `seeds` (the heuristics and
  the relaxation's placement), with seeds opts.seed, opts.seed + 1, ...
  """
  k = opts.microbatches
  chains = 1 if k == 1 else opts.search_chains
  per_pair = opts.search_evaluations or (_K1_EVALUATIONS if k == 1 else _PIPELINE_EVALUATIONS)
  budget = clock.share("annealing", phases)
  plain = min(heuristics or seeds, key=lambda c: c.makespan)
  local = best_seed = min(seeds, key=lambda c: c.makespan)
  for chain in range(chains):  # independent annealing runs
    cand = heur.local_search(
      problem, k, caps, best_seed if chain else plain, budget / chains, seed=opts.seed + chain,
      target=target,
      max_evaluations=per_pair * problem.num_nodes * problem.devices,
    )
    local = cand if cand.makespan < local.makespan else local
    if local.makespan <= target:
      break
  if k > 1 and local.makespan > target and opts.window_search_share > 0:
    local = heur.window_search(
      problem, k, caps, local, clock.share("window", phases),
      max_window_placements=opts.max_window_placements, target=target,
    )
  return local


def reprice(plan: Plan, problem: Problem, schedule: Any) -> Plan:
  """`plan` with its lock-step fields (`task_schedule`, `lockstep_step_s`, `lockstep_speedup`,
  `device_peak_bytes`) for another task schedule of its placement, e.g. the one a program was
  asked to run; the bound and the baselines stay (they do not depend on the schedule).

  Args:
    plan: a plan for `problem`.
    problem: the problem the plan was made for.
    schedule: a TaskSchedule of plan.assignment.
  """
  step = price_lib.lockstep_price(problem, plan.assignment, schedule).step_s
  return dataclasses.replace(
    plan, task_schedule=schedule, lockstep_step_s=step,
    lockstep_speedup=plan.single_device_s / step if step > 0 else 1.0,
    device_peak_bytes=tuple(b + problem.held_bytes
                            for b in price_lib.peak_memory_bytes(problem, plan.assignment, schedule)),
  )
