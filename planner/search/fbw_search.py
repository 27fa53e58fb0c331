"""Search for the (placement, task schedule) the program runs fastest in lock step, within memory.

Objective: `price.lockstep_price(...).step_s` of the TaskSchedule the program executes, subject to
`price.peak_memory_bytes <= caps` per device. Candidates:
  - placements: every placement the fused search found (heuristics, annealing, CP-SAT, MILP: the
    warm starts), the CONTIGUOUS_SPLITS most compute-balanced contiguous splits of the
    topological order (for M > 2 among the balanced split and its neighbours), and, for small
    problems, the F/B/W MILP's own;
  - schedules per placement: 'gpipe', '1f1b' and 'zb' generated with the problem's forward
    times, each also with the forward order of the fused search's start times ('custom' order
    from the solver, when it is a valid schedule), and the F/B/W MILP's per-device order;
  - then simulated annealing over placements (move one node to another device) whose objective
    is the best lock-step price over the generated schedules;
  - last, when 'custom' schedules may run, the group-by-group orders of lockstep_order for the
    best placements and the transfers bound's seeds (`POLISH_PLACEMENTS`).
The GPipe / 1F1B / ZB-H1 prices of the best contiguous split priced are the baselines; the result is never
worse than any of them (they are candidates).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence

from jaxhybrid.planner.search import lockstep_order
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.core import task_schedule as ts
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import TaskSchedule

log = logging.getLogger(__name__)

# Contiguous splits tried for M > 2: each boundary of the compute-balanced split moved by up to
# this many nodes (all combinations).
SPLIT_SHIFT = 2
# Contiguous splits priced, the most compute-balanced first, and at most this share of the
# search's time when the clock limits it: on paper BigLSTM 1x8 with its tables split (22 nodes)
# there are 5^7 splits of near-equal balance, each priced in ~25 ms for three schedules, and
# pricing them in turn took all 30 s of the search (no annealing move was made; its plan priced
# 249.8 ms). With the cap the whole-leaf graph's annealing runs and found 221.7 ms (237.7 ms, the
# best contiguous split, before).
CONTIGUOUS_SPLITS = 64
CONTIGUOUS_SHARE = 0.25
# Problems with at most this many placements (M^n) are searched exhaustively instead of annealed.
EXHAUSTIVE_PLACEMENTS = 512
# After the annealing, this many of the cheapest placements it priced (besides the best) also get
# the lock-step orders of lockstep_order (schedule 'custom'), in the last POLISH_SHARE of the
# search's time (assumption: each costs ~0.4 s on Inception-V3 paper, M=2, k=4, where they
# found a 6 % faster plan).
POLISH_PLACEMENTS = 3
POLISH_SHARE = 0.1
# Placements whose best choices `search` ranks for the caller (the groups step of place).
RANKED = 3
# Annealing: start temperature as a share of the start price, and its geometric cooling per move.
ANNEAL_T0 = 0.02
ANNEAL_COOLING = 0.995
# Moves after which the temperature is 1 % of the start one (the annealing is then a descent):
# the patience rule of `search` applies only after them.
ANNEAL_COOL_MOVES = math.ceil(math.log(0.01) / math.log(ANNEAL_COOLING))


@dataclasses.dataclass(frozen=True)
class Choice:
  """A placement, its schedule and their lock-step price."""

  assignment: tuple[int, ...]
  schedule: TaskSchedule
  step_s: float
  peak_bytes: tuple[float, ...]
  # Where the placement came from and which schedule, e.g. 'cpsat/1f1b'.
  found_by: str


def schedules_for(
  problem: Problem, assignment: Sequence[int], k: int,
  order: Sequence[tuple[int, int]] | None = None, kinds: Sequence[str] = ts.KINDS,
) -> list[tuple[str, TaskSchedule]]:
  """GPipe, 1F1B and ZB-H1 (those in `kinds`) of a placement, and the same with forward
  priority `order` (named '<kind>+order'; the schedule keeps its kind)."""
  out = []
  for kind in ts.KINDS:
    if kind not in kinds:
      continue
    out.append((kind, ts.generate(kind, problem.num_nodes, problem.edges, assignment,
                                  problem.devices, k, forward_s=problem.forward_s)))
    if order:
      sch = ts.generate(kind, problem.num_nodes, problem.edges, assignment, problem.devices, k,
                        forward_s=problem.forward_s, order=order)
      out.append((kind + "+order", sch))
  return out


def best_schedule(
  problem: Problem, assignment: Sequence[int], k: int, caps: Sequence[float] | None,
  order: Sequence[tuple[int, int]] | None = None,
  extra: Sequence[tuple[str, TaskSchedule]] = (),
  kinds: Sequence[str] = ts.KINDS,
) -> tuple[str, TaskSchedule, float, list[float]] | None:
  """The cheapest schedule of `assignment` within `caps`: (name, schedule, price, peak bytes)."""
  best = None
  for name, sch in list(schedules_for(problem, assignment, k, order, kinds)) + list(extra):
    mem = price_lib.peak_memory_bytes(problem, assignment, sch)
    if caps is not None and any(m > c for m, c in zip(mem, caps)):
      continue
    try:
      p = price_lib.lockstep_price(problem, assignment, sch).step_s
    except ValueError:
      continue
    if best is None or p < best[2]:
      best = (name, sch, p, mem)
  return best


def contiguous_splits(problem: Problem) -> list[tuple[int, ...]]:
  """Placements that cut the topological order into at most M consecutive stages, the most
  compute-balanced first."""
  n, M = problem.num_nodes, problem.devices
  if n == 0:
    return [()]
  if M == 1:
    return [(0,) * n]
  total = sum(problem.compute_s) or 1.0

  def imbalance(assign: tuple[int, ...]) -> float:
    load = [0.0] * M
    for i, d in enumerate(assign):
      load[d] += problem.compute_s[i]
    return max(load)

  if M == 2:
    splits = [tuple(0 if i < c else 1 for i in range(n)) for c in range(1, n + 1)]
    return sorted(splits, key=lambda a: (imbalance(a), a))
  acc, cuts = 0.0, []
  for i, p in enumerate(problem.compute_s):
    acc += p
    while len(cuts) < M - 1 and acc >= total * (len(cuts) + 1) / M:
      cuts.append(i + 1)
  while len(cuts) < M - 1:
    cuts.append(n)
  out = set()
  for delta in itertools.product(range(-SPLIT_SHIFT, SPLIT_SHIFT + 1), repeat=M - 1):
    c = sorted(min(n, max(0, a + b)) for a, b in zip(cuts, delta))
    out.add(tuple(sum(i >= x for x in c) for i in range(n)))
  return sorted(out, key=lambda a: (imbalance(a), a))


def search(
  problem: Problem,
  k: int,
  caps: Sequence[float] | None,
  seeds: Mapping[str, tuple[Sequence[int], Sequence[tuple[int, int]] | None]],
  *,
  time_limit_s: float,
  evaluations: int | None = None,
  seed: int = 0,
  extra: Sequence[tuple[str, Sequence[int], TaskSchedule]] = (),
  kinds: Sequence[str] = ts.KINDS + ("custom",),
  target: float = 0.0,
  patience: int | None = None,
  ranked: list[Choice] | None = None,
) -> tuple[Choice | None, dict[str, float]]:
  """The best (placement, schedule) in lock step within `caps`, and the baselines.

  Args:
    problem: the problem.
    k: micro-batches.
    caps: per-device memory caps (bytes) or None.
    seeds: name -> (placement, forward order or None) from the other searches.
    time_limit_s: wall-clock budget of the annealing (the candidates are always evaluated).
    evaluations: most placements the annealing prices (None: the time limit alone); set it for
      results that do not depend on the machine's load.
    seed: the annealing's random seed.
    extra: (name, placement, schedule) candidates priced as given (e.g. the F/B/W MILP's);
      used only when 'custom' is in `kinds`.
    kinds: the schedules the result may use ('gpipe', '1f1b', 'zb', 'custom'); the baselines
      are priced for all three generated kinds.
    target: stop once a plan is this fast (e.g. a lower bound times 1 + gap).
    patience: once the annealing has cooled (ANNEAL_COOL_MOVES moves), stop after this many
      moves in a row that found no faster plan (None: never); counted in moves, so where it
      stops does not depend on the machine.
    ranked: if a list is given, filled with the best choice of each of the RANKED cheapest
      placements priced, cheapest first (the result among them).

  With at most EXHAUSTIVE_PLACEMENTS placements every placement is priced (no annealing).

  Returns:
    (choice or None when nothing fits the caps, baselines: 'gpipe'/'1f1b'/'zb' -> lock-step price
    on the best contiguous split of each (absent when no split fits)).
  """
  t_end = time.monotonic() + time_limit_s
  best: Choice | None = None
  baselines: dict[str, float] = {}

  seen: dict[tuple[int, ...], float] = {}
  top: dict[tuple[int, ...], Choice] = {}  # the RANKED cheapest placements' best choices

  def keep(c: Choice) -> None:
    old = top.get(c.assignment)
    if old is not None and old.step_s <= c.step_s:
      return
    top[c.assignment] = c
    if len(top) > RANKED:
      del top[max(top, key=lambda a: (top[a].step_s, a))]

  def consider(name: str, assign: Sequence[int], order=None, more=(), stage=True) -> float:
    """Prices `assign`'s schedules: the stage orders of `kinds` (unless `stage` is False: they
    were priced already) and `more`; keeps the best."""
    nonlocal best
    key = tuple(assign)
    if order is None and not more and key in seen:
      return seen[key]
    got = best_schedule(problem, assign, k, caps, order, more, kinds if stage else ())
    if order is None and not more:
      seen[key] = got[2] if got is not None else math.inf
    if got is None:
      return math.inf
    kind, sch, p, mem = got
    choice = Choice(tuple(assign), sch, p, tuple(mem), f"{name}/{kind}")
    keep(choice)
    if best is None or p < best.step_s - 1e-15:
      best = choice
    return p

  def out_of_time() -> bool:
    return evaluations is None and time.monotonic() > t_end

  for name, assign, sch in extra if "custom" in kinds else ():
    if price_lib.fits(problem, assign, sch, caps):
      consider(name, assign, more=[("custom", sch)])
  for name, (assign, order) in seeds.items():
    if out_of_time() and best is not None:
      break
    consider(name, assign, order)
  # Contiguous splits: the CONTIGUOUS_SPLITS most compute-balanced; with the clock as the only
  # limit, those priced in CONTIGUOUS_SHARE of the time (none may fit the caps: no baselines).
  splits_end = time.monotonic() + CONTIGUOUS_SHARE * max(0.0, t_end - time.monotonic())
  for assign in contiguous_splits(problem)[:CONTIGUOUS_SPLITS]:
    if evaluations is None and time.monotonic() > splits_end:
      break
    if caps is not None and max(price_lib.device_static_bytes(problem, assign)) > min(caps):
      continue  # every device holds the fullest row: no schedule fits
    for kind in ts.KINDS:
      sch = ts.generate(kind, problem.num_nodes, problem.edges, assign, problem.devices, k,
                        forward_s=problem.forward_s)
      if not price_lib.fits(problem, assign, sch, caps):
        continue
      p = price_lib.lockstep_price(problem, assign, sch).step_s
      baselines[kind] = min(baselines.get(kind, math.inf), p)
      if kind in kinds:
        choice = Choice(tuple(assign), sch, p, tuple(price_lib.peak_memory_bytes(
          problem, assign, sch)), f"contiguous/{kind}")
        keep(choice)
        if best is None or p < best.step_s - 1e-15:
          best = choice

  def finish(result: tuple[Choice | None, dict[str, float]]):
    if ranked is not None:
      ranked[:] = sorted(top.values(), key=lambda c: (c.step_s, c.assignment))
      if result[0] is not None and result[0] not in ranked:
        ranked.insert(0, result[0])
    return result

  if best is None or problem.devices < 2 or problem.num_nodes < 2:
    return finish((best, baselines))
  polish = "custom" in kinds

  def polished() -> tuple[Choice | None, dict[str, float]]:
    """Lock-step orders (lockstep_order) of the POLISH_PLACEMENTS cheapest placements priced
    and of the seeds from the transfers bound, best first, while time is left."""
    places = [a for a, p in sorted(seen.items(), key=lambda kv: (kv[1], kv[0])) if p < math.inf]
    places = [best.assignment] + places[:POLISH_PLACEMENTS] + [
      tuple(a) for name, (a, _) in seeds.items() if name.startswith("transfers_")]
    done = set()
    for assign in places:
      if tuple(assign) in done or (out_of_time() and done):
        continue
      done.add(tuple(assign))
      consider("polish", assign, more=lockstep_order.variants(problem, assign, k),
               stage=tuple(assign) not in seen)
    return best, baselines

  if problem.devices ** problem.num_nodes <= EXHAUSTIVE_PLACEMENTS:
    for assign in itertools.product(range(problem.devices), repeat=problem.num_nodes):
      consider("exhaustive", assign)
    return finish(polished() if polish else (best, baselines))
  # Annealing over placements from the best so far (leaving POLISH_SHARE of the time).
  anneal_end = t_end - (POLISH_SHARE * time_limit_s if polish else 0.0)
  rng = random.Random(seed)
  cur_assign, cur = list(best.assignment), best.step_s
  temp = ANNEAL_T0 * cur
  count = last_gain = 0
  while (time.monotonic() < anneal_end and (evaluations is None or count < evaluations)
         and best.step_s > target):
    if (patience is not None and count >= ANNEAL_COOL_MOVES
        and count - max(last_gain, ANNEAL_COOL_MOVES) >= patience):
      log.debug("lock-step annealing stopped: no gain in %d moves", patience)
      break
    count += 1
    before = best.step_s
    i = rng.randrange(problem.num_nodes)
    d = rng.randrange(problem.devices - 1)
    d = d if d < cur_assign[i] else d + 1
    cand = list(cur_assign)
    cand[i] = d
    p = consider("annealing", cand)
    if p < cur or (p < math.inf and rng.random() < math.exp(-(p - cur) / max(temp, 1e-300))):
      cur_assign, cur = cand, p
    if best.step_s < before:
      last_gain = count
    temp *= ANNEAL_COOLING
  log.debug("lock-step annealing: %d placements priced, best %.6g (%s)", count,
            best.step_s, best.found_by)
  return finish(polished() if polish else (best, baselines))


def simple_bound(problem: Problem, k: int) -> float:
  """A lower bound on the lock-step price of any plan, split or not, from the task precedences
  alone (no transfer delays, any placement). With LF(s) the longest path of forward times ending
  at sink s (its F included), LB(s) the longest path of input-cotangent times starting at s back
  to a source, F = k sum forward_s and R = k sum (compute_s - forward_s) (B and W):
    - total work over the M devices: (F + R) / M;
    - one micro-batch's chain: LF(s) + LB(s) for every sink s (B(s, c) waits for F(s, c));
  and, where one sink t is reached from every node (the loss):
    - no B or W before the first F(t, c) ends (every B(i, c) waits for B(t, c)): LF(t) + R / M;
    - every F ends by the end of the last F(t, c), and LB(t) follows it: F / M + LB(t);
    - with k = 1 all the backward work follows every forward: max(F / M, LF(t)) +
      max(R / M, LB(t)).
  The lock-step price is at least the asynchronous makespan (fbw_milp's docstring), which
  satisfies all of these.
  """
  n, M = problem.num_nodes, problem.devices
  if n == 0:
    return 0.0
  preds, succs = problem.predecessors(), problem.successors()
  lf = [0.0] * n
  for i in range(n):  # nodes are topological
    lf[i] = problem.forward_s[i] + max((lf[p] for p, _ in preds[i]), default=0.0)
  lb = [0.0] * n  # longest input-cotangent path from i back to a source
  for i in range(n):
    lb[i] = problem.input_grad_s[i] + max((lb[p] for p, _ in preds[i]), default=0.0)
  fwd = k * sum(problem.forward_s)
  rest = k * sum(c - f for c, f in zip(problem.compute_s, problem.forward_s))
  sinks = [i for i in range(n) if not succs[i]]
  bound = max([(fwd + rest) / M] + [lf[s] + lb[s] for s in sinks])
  if len(sinks) == 1:
    t = sinks[0]
    reach = {t}
    for i in reversed(range(n)):
      if any(s in reach for s, _ in succs[i]):
        reach.add(i)
    if len(reach) == n:
      bound = max(bound, lf[t] + rest / M, fwd / M + lb[t])
      if k == 1:
        bound = max(bound, max(fwd / M, lf[t]) + max(rest / M, lb[t]))
  return bound
