"""Parameter ownership of a hybrid program, and a plan's forward start order.

Every leaf read by nodes of one device is owned by that device and lives in its row of a flat
per-dtype buffer (`ParamLayout`); a leaf read on several devices is shared. The task schedule's
lock-step structure (slots, groups, buffers, messages) is in `jaxhybrid.program.tasks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxhybrid import graph as graph_lib


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """Where each flat parameter leaf lives.

  Attributes:
    owner: per leaf, the model-axis device that owns it, or -1 for a shared (replicated) leaf.
    offset: per owned leaf, its offset in the owner's flat buffer of its dtype.
    sizes: per dtype name, the flat buffer length per device (max over devices, >= 1).
    shared: indices of shared leaves, in order.
    shapes, dtypes: per leaf.
  """

  owner: tuple[int, ...]
  offset: tuple[int, ...]
  sizes: tuple[tuple[str, int], ...]
  shared: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  devices: int

  def bytes_per_device(self) -> list[int]:
    """Parameter bytes each model-axis device owns (excluding shared and padding)."""
    out = [0] * self.devices
    for i, d in enumerate(self.owner):
      if d >= 0:
        out[d] += math.prod(self.shapes[i]) * np.dtype(self.dtypes[i]).itemsize
    return out


def param_layout(graph: graph_lib.OpGraph, assignment: Sequence[int], devices: int) -> ParamLayout:
  """Assigns every parameter leaf to the device of the nodes that read it (or shares it)."""
  avals = graph.param_avals
  users: list[set[int]] = [set() for _ in avals]
  for node in graph.nodes:
    for leaf in node.param_leaves:
      users[leaf].add(int(assignment[node.id]))
  owner, offset = [], []
  fill: dict[tuple[int, str], int] = {}
  shared = []
  for i, aval in enumerate(avals):
    dt = np.dtype(aval.dtype).name
    if len(users[i]) > 1:
      owner.append(-1)
      offset.append(0)
      shared.append(i)
      continue
    d = next(iter(users[i])) if users[i] else 0  # unused leaves: device 0 (zero gradient)
    pos = fill.get((d, dt), 0)
    owner.append(d)
    offset.append(pos)
    fill[(d, dt)] = pos + int(math.prod(aval.shape))
  dtypes = sorted({np.dtype(a.dtype).name for a in avals})
  sizes = tuple((dt, max([1] + [fill.get((d, dt), 0) for d in range(devices)])) for dt in dtypes)
  return ParamLayout(
    owner=tuple(owner), offset=tuple(offset), sizes=sizes, shared=tuple(shared),
    shapes=tuple(tuple(a.shape) for a in avals), dtypes=tuple(np.dtype(a.dtype).name for a in avals),
    devices=devices,
  )


def plan_order(schedule: Sequence[Any]) -> list[tuple[int, int]]:
  """(node, micro-batch) in the order a plan's schedule starts them (ties: node, micro-batch)."""
  return [(t.node, t.microbatch) for t in sorted(schedule, key=lambda t: (t.start_s, t.node, t.microbatch))]


# Kept for the build option's default (v1 programs sent transfers above this size on their own;
# v2 programs pack every transfer of a group into one message per (shift, dtype)).
DEFAULT_PACK_MAX_BYTES = 1 << 20


class TrainState(NamedTuple):
  """Parameters and optimizer state of the hybrid program (owned rows + shared leaves)."""

  params: dict[str, Any]  # {'owned': {dtype: [model, size]}, 'shared': [leaves]}
  opt_state: Any
  step: jax.Array
