"""Task orders built group by group for the lock step, for any placement.

GPipe, 1F1B and ZB-H1 (task_schedule.generate) order each device's tasks as a pipeline of stages
would, from forward-time estimates; the lock-step price of a schedule is the sum over its groups
of the busiest device's work (price.lockstep_price). On a placement that is not a chain of
stages (e.g. the stem and the head of Inception-V3 on one device, the middle on the other) those
orders leave devices idle in many groups. `lockstep_order` builds the order one group at a time
with the problem's own task times:

  - a task may join the group on its device once every task it depends on has run, in an
    earlier group or earlier on the same device in this group (a value from another device
    crosses only between groups);
  - the group's length is set by the longest first task any device can run, and each device
    then adds ready tasks, best priority first, while they fit in that length (times 1 +
    `slack`); a device with a ready task always runs one;
  - priority 'microbatch': backward tasks first, then the earliest micro-batch, then the longest
    tail (the work that must follow the task); 'tail': the longest tail first;
  - `limit`: a device starts a new micro-batch's forwards only while fewer than `limit`
    micro-batches are open on it (their backward not done), as 1F1B bounds its residuals; only
    a group in which no device could run anything else lets one more open. With
    `hard_limit=False` a device that has nothing else ready opens one more at once (fewer idle
    groups, more residuals alive; the search checks the caps).

The program's own grouping (lockstep_rule) is derived from the returned order, and the order is
priced as any other; these are candidates for the search (fbw_search), not a model of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxhybrid.planner.lower_bounds import placement_bound
from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op, TaskSchedule

PRIORITIES = ("microbatch", "tail")
# The variants `variants` generates per schedule family: (priority, limit, slack, hard_limit).
VARIANTS = (("microbatch", None, 0.0, True), ("microbatch", None, 0.25, True),
            ("microbatch", 2, 0.0, True), ("microbatch", 2, 0.25, True),
            ("microbatch", 2, 0.0, False), ("microbatch", 2, 0.25, False),
            ("tail", 2, 0.25, False))


def lockstep_order(
  problem: Problem, assignment: Sequence[int], k: int, split: bool, *,
  priority: str = "microbatch", limit: int | None = None, slack: float = 0.0,
  hard_limit: bool = True,
) -> TaskSchedule:
  """The order of the module docstring, as a 'custom' TaskSchedule.

  Raises:
    ValueError: an unknown priority, or a limit or slack out of range.
  """
  if priority not in PRIORITIES:
    raise ValueError(f"priority={priority!r}: use one of {', '.join(PRIORITIES)}")
  if limit is not None and limit < 1:
    raise ValueError(f"limit={limit}: use None or at least 1")
  if slack < 0:
    raise ValueError(f"slack={slack}: use a number >= 0")
  n, M = problem.num_nodes, problem.devices
  kinds = ("F", "B", "W") if split else ("F", "B")
  one, _, tails = placement_bound.heads_and_tails(problem, split)
  tail = {(o.kind, o.node): q for o, q in zip(one, tails)}
  ops = [Op(t, i, c) for t in kinds for i in range(n) for c in range(k)]
  dur = {o: problem.task_s(o.kind, o.node, split) for o in ops}
  unmet: dict[Op, int] = {}
  users: dict[Op, list[Op]] = {o: [] for o in ops}
  for o in ops:
    deps = price_lib.fbw_dependencies(problem, o)
    unmet[o] = len(deps)
    for d, _, _ in deps:
      users[d].append(o)

  def key(o: Op) -> tuple:
    if priority == "tail":
      return (-tail[(o.kind, o.node)], o.microbatch, o.kind, o.node)
    return (o.kind == "F", o.microbatch, -tail[(o.kind, o.node)], o.kind, o.node)

  ready: list[set[Op]] = [set() for _ in range(M)]
  for o in ops:
    if not unmet[o]:
      ready[assignment[o.node]].add(o)
  on_device = [sum(1 for i in range(n) if assignment[i] == d) for d in range(M)]
  open_mb: list[set[int]] = [set() for _ in range(M)]
  b_left = [dict.fromkeys(range(k), on_device[d]) for d in range(M)]
  seq: list[list[Op]] = [[] for _ in range(M)]
  left = len(ops)

  def allowed(d: int) -> list[Op]:
    cands = sorted(ready[d], key=key)
    if limit is None or not strict:
      return cands
    ok = [o for o in cands
          if o.kind != "F" or o.microbatch in open_mb[d] or len(open_mb[d]) < limit]
    return ok if ok or hard_limit else cands

  strict = True
  while left:
    firsts = [allowed(d) for d in range(M)]
    if not any(firsts):  # every device waits for the limit: let the group open one more
      strict = False
      firsts = [allowed(d) for d in range(M)]
    length = max((dur[c[0]] for c in firsts if c), default=0.0) * (1 + slack) + 1e-15
    crossed: list[Op] = []  # done in this group: their users elsewhere wait for the next
    progress = False
    for d in range(M):
      used = 0.0
      while True:
        fit = [o for o in allowed(d) if used + dur[o] <= length]
        if not fit:
          if used or not allowed(d):
            break
          fit = allowed(d)[:1]
        o = fit[0]
        ready[d].discard(o)
        seq[d].append(o)
        used += dur[o]
        left -= 1
        progress = True
        if o.kind == "F":
          open_mb[d].add(o.microbatch)
        elif o.kind == "B":
          b_left[d][o.microbatch] -= 1
          if not b_left[d][o.microbatch]:
            open_mb[d].discard(o.microbatch)
        for u in users[o]:
          if assignment[u.node] == d:
            unmet[u] -= 1
            if not unmet[u]:
              ready[d].add(u)
          else:
            crossed.append(u)
    strict = True
    if not progress:
      raise RuntimeError("internal: lock-step ordering made no progress")
    for u in crossed:
      unmet[u] -= 1
      if not unmet[u]:
        ready[assignment[u.node]].add(u)
  return TaskSchedule(kind="custom", split=split, microbatches=k,
                      devices=tuple(tuple(s) for s in seq))


def variants(
  problem: Problem, assignment: Sequence[int], k: int, splits: Sequence[bool] = (False, True),
) -> list[tuple[str, TaskSchedule]]:
  """('lockstep/<priority>/<limit>[~ when soft]/<slack>[/split]', schedule) for each of
  VARIANTS and family."""
  out = []
  for split in splits:
    for priority, limit, slack, hard in VARIANTS:
      name = (f"lockstep/{priority}/{limit}{'' if hard else '~'}/{slack}"
              + ("/split" if split else ""))
      out.append((name, lockstep_order(problem, assignment, k, split, priority=priority,
                                       limit=limit, slack=slack, hard_limit=hard)))
  return out
