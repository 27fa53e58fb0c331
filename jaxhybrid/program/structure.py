"""Parameter ownership of a hybrid program, and a plan's forward start order.

Every leaf read by nodes of one device is owned by that device and lives in one of its rows
(`ParamLayout`); a leaf read on several devices is shared. The task schedule's lock-step structure
(slots, groups, buffers, messages) is in `jaxhybrid.program.tasks`.

Rows: per dtype, one flat *packed* row holds a device's small leaves side by side; large leaves
get *slot rows* of their own: the j-th largest large leaf of every device shares slot row j, as
long as the longest of them. A leaf that fills its slot row is read as the row itself, so a
task's matmul reads the weights in place; a leaf sliced out of a packed row is first copied
(XLA materialises the slice), once per task that reads it, which costs a step k copies of the
device's parameters per micro-batch pass on one CPU core.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxhybrid import graph as graph_lib

# Owned leaves of at least this many bytes get a slot row of their own; None makes none. A leaf
# sliced out of the packed row is copied before use: at 1 MiB Inception-V3 small's 284 small
# leaves all shared the packed row and its 1x1 step compiled to 1.163x plain jit's bytes; at 64
# KiB (22 rows) 1.032x, at 128 KiB 1.090x, at 4 KiB 1.001x (87 rows). The one-core 1x1 step at
# 64 KiB against 1 MiB, same process, alternating rounds: Inception-V3 small 1.008-1.027x, GNMT
# small 1.015-1.019x, BigLSTM small 1.005x (the same rows: the noise). Kept at 1 MiB for now:
# at 64 KiB the memory model under-predicts a held-out 6 x 256 relu stack (one group, 1x2) by
# 15.1 % against 11.0 % at 1 MiB (its window term drops by the concatenation copy, XLA's
# temporaries by less). `bench_memory.py --slot_min_bytes=65536` measures the 64 KiB rows. On by default
# since the step keeps XLA from fusing the last gradient addition into the optimizer (hybrid.py):
# before, the rows cut from one flat buffer cost paper BigLSTM (AdaGrad, 1x2) 1.3 GiB more per
# device; now 0.04 GiB (15.03 GiB compiled), while a weight sliced out of a packed row is copied
# by XLA, and the CPU scheduler made those copies at the start of a group's branch, all at once
# (uniform chain 1x2 k=4: 388 -> 341 MB per device; GNMT-small 1x2 1F1B k=4: 121 -> 117 MB).
SLOT_MIN_BYTES: int | None = 1 << 20
# Slot rows pad each slot to its longest leaf; a slot is made only while the rows of a dtype stay
# within this fraction above one flat row padded to the largest device (assumption, named here:
# 5 % more parameter, gradient and optimizer bytes per device for reading weights in place).
SLOT_EXTRA_FRACTION = 0.05


def planner_options(zero: int = 0) -> dict[str, Any]:
  """The planner options that say how the program lays parameters and gradients out: its slot
  rows (SLOT_MIN_BYTES) and, outside ZeRO, gradients with no accumulator row at one micro-batch
  (`PlannerOptions.single_window_gradients`; gradients.single_window_rows)."""
  return {"slot_min_bytes": SLOT_MIN_BYTES, "single_window_gradients": not zero}


def row_dtype(row: str) -> str:
  """The dtype name of a row key ('float32' for the packed row, 'float32#2' for a slot row)."""
  return row.split("#", 1)[0]


def rows_by_dtype(sizes) -> dict[str, list[str]]:
  """Row keys grouped by dtype, each group in `ParamLayout.sizes` order (the order the rows of a
  dtype lie side by side in the flat gradient buffer)."""
  out: dict[str, list[str]] = {}
  for key, _ in sizes:
    out.setdefault(row_dtype(key), []).append(key)
  return out


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Where each flat parameter leaf lives.

  Attributes:
    owner: per leaf, the model-axis device that owns it, or -1 for a shared (replicated) leaf.
    offset: per owned leaf, its offset in its row (0 in a slot row).
    sizes: per row key, the row length per device (max over devices, >= 1). Keys: the dtype
      name for the packed row, '<dtype>#<j>' for slot row j.
    shared: indices of shared leaves, in order.
    shapes, dtypes: per leaf.
    row_of: per leaf, its row key ('' for shared leaves).
  """

  owner: tuple[int, ...]
  offset: tuple[int, ...]
  sizes: tuple[tuple[str, int], ...]
  shared: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  devices: int
  row_of: tuple[str, ...] = ()
  # Every owned leaf's extent in its row is a multiple of this (zeros after the leaf).
  leaf_multiple: int = 1

  def __post_init__(self):
    if not self.row_of:  # one packed row per dtype
      object.__setattr__(self, "row_of", tuple(
        "" if o < 0 else dt for o, dt in zip(self.owner, self.dtypes)))

  def read_in_place(self, idx: int) -> bool:
    """Whether owned leaf `idx` fills its row, so a task reads the row itself; any other owned
    leaf is a slice of its row, which XLA copies before a matmul, convolution or loop reads it."""
    length = dict(self.sizes)[self.row_of[idx]]
    return self.offset[idx] == 0 and math.prod(self.shapes[idx]) == length

  def row_bytes(self) -> int:
    """Bytes of one device's rows (owned leaves and padding)."""
    return sum(n * np.dtype(row_dtype(r)).itemsize for r, n in self.sizes)

  def bytes_per_device(self) -> list[int]:
    """Parameter bytes each model-axis device owns (excluding shared and padding)."""
    out = [0] * self.devices
    for i, d in enumerate(self.owner):
      if d >= 0:
        out[d] += math.prod(self.shapes[i]) * np.dtype(self.dtypes[i]).itemsize
    return out


def param_layout(
  graph: graph_lib.OpGraph, assignment: Sequence[int], devices: int,
  *, slot_min_bytes: int | None = None, slot_extra_fraction: float | None = None,
  row_multiple: int = 1, leaf_multiple: int = 1,
) -> ParamLayout:
  """Assigns every parameter leaf to the device of the nodes that read it (or shares it), and
  to a row of that device (module docstring; defaults SLOT_MIN_BYTES, SLOT_EXTRA_FRACTION).
  Every row's length is rounded up to a multiple of `row_multiple` (the data width when the
  optimizer state is sharded over 'data': each data replica then holds an equal slice), and
  every owned leaf's extent to a multiple of `leaf_multiple` (ZeRO stage 2: each replica then
  holds an equal share of every leaf; see jaxhybrid.program.zero)."""
  if row_multiple < 1 or leaf_multiple < 1:
    raise ValueError(f"row_multiple={row_multiple}, leaf_multiple={leaf_multiple}: use 1 or more")
  min_bytes = SLOT_MIN_BYTES if slot_min_bytes is None else slot_min_bytes
  if min_bytes is None:
    min_bytes = float("inf")
  extra = SLOT_EXTRA_FRACTION if slot_extra_fraction is None else slot_extra_fraction
  avals = graph.param_avals
  users: list[set[int]] = [set() for _ in avals]
  for node in graph.nodes:
    for leaf in node.param_leaves:
      users[leaf].add(int(assignment[node.id]))
  # Extents: each leaf's elements rounded up to a multiple of leaf_multiple (zeros after it).
  n_of = [-(-int(math.prod(a.shape)) // leaf_multiple) * leaf_multiple for a in avals]
  dts = [np.dtype(a.dtype).name for a in avals]
  owner: list[int] = []
  shared = []
  for i in range(len(avals)):
    if len(users[i]) > 1:
      owner.append(-1)
      shared.append(i)
    else:
      owner.append(next(iter(users[i])) if users[i] else 0)  # unused: device 0 (zero gradient)
  offset = [0] * len(avals)
  row_of = [""] * len(avals)
  sizes: list[tuple[str, int]] = []
  for dt in sorted(set(dts)):
    item = np.dtype(dt).itemsize
    mine = {d: [i for i in range(len(avals)) if owner[i] == d and dts[i] == dt] for d in range(devices)}
    packed = {d: sum(n_of[i] for i in mine[d]) for d in range(devices)}
    flat = max(packed.values(), default=0)
    big = {
      d: sorted((i for i in mine[d] if n_of[i] * item >= min_bytes), key=lambda i: (-n_of[i], i))
      for d in range(devices)
    }
    slots: list[int] = []
    for j in range(max((len(b) for b in big.values()), default=0)):
      have = {d: b[j] for d, b in big.items() if j < len(b)}
      length = max(n_of[i] for i in have.values())
      left = {d: packed[d] - (n_of[have[d]] if d in have else 0) for d in packed}
      if sum(slots) + length + max(left.values()) > flat * (1.0 + extra):
        continue
      key = f"{dt}#{len(slots)}"
      slots.append(length)
      packed = left
      for i in have.values():
        row_of[i] = key
    for d in range(devices):
      pos = 0
      for i in mine[d]:
        if not row_of[i]:
          row_of[i], offset[i] = dt, pos
          pos += n_of[i]
    up = lambda n: -(-n // row_multiple) * row_multiple  # noqa: E731
    sizes.append((dt, up(max([1] + list(packed.values())))))
    sizes.extend((f"{dt}#{j}", up(n)) for j, n in enumerate(slots))
  return ParamLayout(
    owner=tuple(owner), offset=tuple(offset), sizes=tuple(sizes), shared=tuple(shared),
    shapes=tuple(tuple(a.shape) for a in avals), dtypes=tuple(dts), devices=devices,
    row_of=tuple(row_of), leaf_multiple=int(leaf_multiple),
  )


def plan_order(schedule: Sequence[Any]) -> list[tuple[int, int]]:
  """(node, micro-batch) in the order a plan's schedule starts them (ties: node, micro-batch)."""
  return [(t.node, t.microbatch) for t in sorted(schedule, key=lambda t: (t.start_s, t.node, t.microbatch))]


# Kept for the build option's default (v1 programs sent transfers above this size on their own;
# v2 programs pack every transfer of a group into one message per (shift, dtype)).
DEFAULT_PACK_MAX_BYTES = 1 << 20


class TrainState(NamedTuple):
  """Parameters and optimizer state of the hybrid program (owned rows + shared leaves), and the
  model's non-parameter state when the loss writes some (`OpGraph.state_writes`: every state
  leaf, replicated, in the order of `OpGraph.state_paths`; empty otherwise)."""

  params: dict[str, Any]  # {'owned': {dtype: [model, size]}, 'shared': [leaves]}
  opt_state: Any
  step: jax.Array
  model_state: tuple[Any, ...] = ()
