"""A lower bound on the step of every plan, placement by placement (the one-machine relaxation).

Fix a placement and a schedule family (F and B, or F, B and W split). In the asynchronous model
(price.async_makespan, which the lock-step price is never below) each device runs its tasks one at
a time. Relax every other device to unlimited capacity: a task tau of one micro-batch then cannot
start before its *head* r(tau), the longest chain of tasks it waits for (fbw_dependencies, no
transfer delays), and after it ends at least its *tail* q(tau), the longest chain that waits for
it, must still run. Heads and tails are the same for every micro-batch. For any set J of a
device's tasks the step is at least

    min_{J} r + sum_{J} p + min_{J} q,

and taking J = every copy (k micro-batches) of the task kinds tau with r(tau) >= r0 and
q(tau) >= q0 on the device, over all thresholds (r0, q0), gives the device's bound f_d(S) of the
set S of nodes it holds. A device whose nodes' static bytes plus their largest residual exceed its
cap cannot hold them: f_d(S) = inf.

The bound over all placements is min over partitions (S_0, ..., S_{M-1}) of the nodes of
max_d f_d(S_d). f_d grows with S, so the sets {S : f_d(S) <= v} are closed under subsets and a
partition within v exists iff they cover the nodes; that is counted exactly by inclusion-exclusion
over the zeta transforms of the M families (Bjorklund, Husfeldt and Koivisto's set-cover
counting), and v is found by bisection over the values f takes. Every subset is enumerated, so
this runs for problems of at most PLACEMENT_BOUND_MAX_NODES nodes.

What it misses (why it can stay below the best lock-step price): transfers, the groups' lock
step (a group lasts as long as its busiest device), and the interaction of micro-batches beyond
the one machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxhybrid.planner.pricing import price as price_lib
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.task_schedule import Op

# Problems with more nodes are not bounded this way (every one of the 2^n node sets is priced:
# 2^16 sets x ~1000 thresholds is ~0.5 s on one core).
PLACEMENT_BOUND_MAX_NODES = 16
# Threshold sets priced per numpy pass (memory: 2^n x this many float64).
_CHUNK = 64
# Relative slack taken off the bound for floating-point sums in a different order.
_SLACK = 1e-9


def heads_and_tails(problem: Problem, split: bool) -> tuple[list[Op], list[float], list[float]]:
  """The task kinds of one micro-batch, their head r and tail q (seconds; see the docstring)."""
  n = problem.num_nodes
  kinds = ("F", "B", "W") if split else ("F", "B")
  # A topological order of one micro-batch's tasks: F by node, B backwards, then W.
  ops = ([Op("F", i, 0) for i in range(n)] + [Op("B", i, 0) for i in reversed(range(n))]
         + ([Op("W", i, 0) for i in range(n)] if "W" in kinds else []))
  p = {op: problem.task_s(op.kind, op.node, split) for op in ops}
  deps = {op: [d for d, _, _ in price_lib.fbw_dependencies(problem, op)] for op in ops}
  users: dict[Op, list[Op]] = {op: [] for op in ops}
  for op in ops:
    for d in deps[op]:
      users[d].append(op)
  head: dict[Op, float] = {}
  for op in ops:
    head[op] = max((head[d] + p[d] for d in deps[op]), default=0.0)
  tail: dict[Op, float] = {}
  for op in reversed(ops):
    tail[op] = max((p[u] + tail[u] for u in users[op]), default=0.0)
  return ops, [head[o] for o in ops], [tail[o] for o in ops]


def _subset_bits(n: int) -> np.ndarray:
  """(2^n, n) 0/1 matrix: row s holds the bits of s (node i in set s iff bit i)."""
  s = np.arange(1 << n, dtype=np.int64)
  return ((s[:, None] >> np.arange(n)[None, :]) & 1).astype(np.float64)


def device_bounds(
  problem: Problem, k: int, split: bool, caps: Sequence[float] | None
) -> np.ndarray:
  """f_d(S) for every device d and node set S (bitmask): shape (M, 2^n); inf where S misses d's
  cap."""
  n, M = problem.num_nodes, problem.devices
  ops, head, tail = heads_and_tails(problem, split)
  p = np.array([problem.task_s(o.kind, o.node, split) for o in ops])
  node = np.array([o.node for o in ops])
  # Distinct threshold sets U(r0, q0), each with r0 = min head and q0 = min tail over it.
  h, q = np.asarray(head), np.asarray(tail)
  r0 = np.unique(h)[:, None, None]
  q0 = np.unique(q)[None, :, None]
  member = ((h[None, None, :] >= r0) & (q[None, None, :] >= q0)).reshape(-1, len(ops))
  member = np.unique(member[member.any(axis=1)], axis=0)  # (sets, task kinds)
  const = (np.where(member, h[None, :], np.inf).min(axis=1)
           + np.where(member, q[None, :], np.inf).min(axis=1))
  onehot = np.zeros((len(ops), n))
  onehot[np.arange(len(ops)), node] = 1.0
  weights = (member * (k * p)[None, :]) @ onehot  # (sets, nodes)
  present = (member.astype(np.float64) @ onehot > 0).astype(np.float64)
  weights, present = weights.T, present.T  # (nodes, sets)
  bits = _subset_bits(n)
  f = np.zeros(1 << n)
  for lo in range(0, const.size, _CHUNK):
    hi = min(const.size, lo + _CHUNK)
    load = bits @ weights[:, lo:hi]
    has = bits @ present[:, lo:hi]
    f = np.maximum(f, np.where(has > 0, const[None, lo:hi] + load, 0.0).max(axis=1))
  f *= 1.0 - _SLACK
  out = np.repeat(f[None, :], M, axis=0)
  if caps is not None:
    static = bits @ np.asarray(problem.static_bytes, np.float64)
    act = np.asarray(problem.activation_bytes, np.float64)
    # Largest residual of each set (a device that holds nodes runs one of their forwards).
    biggest = np.zeros(1 << n)
    for i in range(n):
      step = 1 << i
      view = biggest.reshape(-1, 2, step)
      view[:, 1, :] = np.maximum(view[:, 0, :], act[i])
    need = static + biggest
    for d in range(M):
      out[d, need > caps[d]] = math.inf
  return out


def _zeta(member: np.ndarray, n: int) -> np.ndarray:
  """z[U] = number of sets S subset of U with member[S] (sum over subsets)."""
  z = member.astype(np.int64).copy()
  for i in range(n):
    view = z.reshape(-1, 2, 1 << i)
    view[:, 1, :] += view[:, 0, :]
  return z


def _covers(f: np.ndarray, v: float, sign: np.ndarray) -> bool:
  """Whether sets S_d with f[d, S_d] <= v cover all nodes: the number of M-tuples of such sets
  whose union is every node, by inclusion-exclusion (exact integers), is positive."""
  n = int(sign.size).bit_length() - 1
  prod = sign.astype(object)
  for d in range(f.shape[0]):
    prod = prod * _zeta(f[d] <= v, n).astype(object)
  return int(np.sum(prod)) > 0


def placement_bound(
  problem: Problem, k: int, split: bool, caps: Sequence[float] | None = None
) -> float | None:
  """min over placements of max_d f_d (see the module docstring): a lower bound on the
  asynchronous makespan, hence on the lock-step price, of every plan of this family (split or
  not) within `caps`. inf when no placement fits; None when the problem has more than
  PLACEMENT_BOUND_MAX_NODES nodes."""
  n, M = problem.num_nodes, problem.devices
  if n == 0:
    return 0.0
  if n > PLACEMENT_BOUND_MAX_NODES:
    return None
  f = device_bounds(problem, k, split, caps)
  full = (1 << n) - 1
  if M == 1:
    return float(f[0, full])
  if M == 2:
    sets = np.arange(1 << n)
    return float(np.min(np.maximum(f[0, sets], f[1, full ^ sets])))
  sets = np.arange(1 << n)
  popcount = sum((sets >> i) & 1 for i in range(n))
  sign = np.where((n - popcount) % 2 == 0, 1, -1)  # (-1)^{|V \ U|}
  values = np.unique(f[np.isfinite(f)])
  if values.size == 0 or not _covers(f, values[-1], sign):
    return math.inf
  lo, hi = 0, values.size - 1  # the answer is values[hi]; values[lo - 1] is too small
  while lo < hi:
    mid = (lo + hi) // 2
    if _covers(f, values[mid], sign):
      hi = mid
    else:
      lo = mid + 1
  return float(values[hi])


def bound(problem: Problem, k: int, caps: Sequence[float] | None = None) -> float | None:
  """The smaller of the two families' placement bounds: a bound on every plan, split or not."""
  got = [placement_bound(problem, k, split, caps) for split in (False, True)]
  if any(g is None for g in got):
    return None
  return min(got)
