"""Bytes a task-scheduled step keeps per group, from its static structure (`tasks.Structure`):
the group and message buffers alive after each group (`live_bytes`) and, inside a group's
branch, the values it makes and reads itself plus the running task's own temporaries
(`in_group_bytes`). `jaxhybrid.program.memory` adds them to the prediction."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxhybrid.planner.core.task_schedule import Op
from jaxhybrid.program.tasks import Structure, lane_dtype


def in_group_bytes(
  structure: Structure, task_temp: Callable[[Op], int] | None = None,
  copies: Callable[[int, Op], dict[Any, int]] | None = None,
  waits: Callable[[int, Op], dict[Any, int]] | None = None,
) -> list[int]:
  """Per group, the largest device's peak bytes of values its branch makes and reads itself,
  plus the running task's own temporaries.

  A value that no later group reads never leaves the group's conditional (it is not in the
  group buffers `live_bytes` counts): an activation passed to the device's next task, the
  residuals of an F whose B runs in the same group. It lives inside the branch from the task
  that makes it to the last task of the group that reads it. With every node of a step in one
  group (one device, one micro-batch) this is the step's whole activation and residual memory.
  `task_temp(op)`: what the task needs beyond its inputs and outputs while it runs (e.g.
  `node_calls.task_temp_bytes`, compiled); None counts nothing.
  `copies(d, op)`: {key: bytes} of values the task on device d materialises from its inputs
  outside the group's buffers (a parameter leaf sliced out of its row; `memory.param_copies`).
  The branch makes one copy per key, alive from the first of the device's tasks in the group
  that reads it to the last.
  `waits(d, op)`: {key: bytes} of gradients the task makes that wait for one sum at the end of
  the group (`loop_read_leaves`); the device's first task of a key makes the gradient the
  window holds, each later one a buffer alive from its task to the group's end.
  """
  nbytes = {
    key: int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize for key, a in structure.avals.items()
  }
  out = []
  for g, lay in enumerate(structure.groups):
    peak = 0
    for d in range(structure.devices):
      ops = [op for dd, op in lay.tasks if dd == d]
      last: dict[Any, int] = {}
      for i, op in enumerate(ops):
        for key in structure.reads.get((d, op), ()):
          last[key] = i
      spans = []
      for i, op in enumerate(ops):
        for key in structure.makes.get((d, op), ()):
          loc = structure.locs.get((key, d))
          if loc is not None and loc.buf[:2] == ("out", g):
            continue  # leaves the group: a group buffer (live_bytes)
          spans.append((i, max(i, last.get(key, i)), nbytes.get(key, 0)))
      if waits is not None:
        seen: set[Any] = set()
        for i, op in enumerate(ops):
          for key, b in waits(d, op).items():
            if key in seen:
              spans.append((i, len(ops) - 1, b))
            seen.add(key)
      if copies is not None:
        span: dict[Any, list[int]] = {}
        for i, op in enumerate(ops):
          for key, b in copies(d, op).items():
            span.setdefault(key, [i, i, b])[1] = i
        spans.extend(tuple(x) for x in span.values())
      for t, op in enumerate(ops):
        own = task_temp(op) if task_temp is not None else 0
        peak = max(peak, own + sum(b for a, z, b in spans if a <= t <= z))
    out.append(peak)
  return out


def live_bytes(structure: Structure) -> list[int]:
  """Bytes of group and message buffers alive after each group (every device holds the same).

  A group's output buffer lives from its group to the last group that reads from it (the end
  for the loss); a message buffer likewise. This is the program's activation + residual memory
  over the step, as the lock-step SPMD program allocates it.
  """
  last: dict[tuple, int] = {}
  n = len(structure.groups)
  # Last reading group per buffer: from each read's location.
  group_of_task = {}
  for g, lay in enumerate(structure.groups):
    for d, op in lay.tasks:
      group_of_task[(d, op)] = g
  for (d, op), keys in structure.reads.items():
    g = group_of_task[(d, op)]
    for key in keys:
      loc = structure.locs.get((key, d))
      if loc is not None:
        last[loc.buf] = max(last.get(loc.buf, -1), g)
  for key in structure.loss_keys:
    loc = structure.locs.get((key, structure.loss_device))
    if loc is not None:
      last[loc.buf] = n
  size: dict[tuple, int] = {}
  born: dict[tuple, int] = {}
  for g, lay in enumerate(structure.groups):
    for dt, length in lay.sizes.items():
      size[("out", g, dt)] = length * np.dtype(lane_dtype(dt)).itemsize
      born[("out", g, dt)] = g
    for (s, dt), (_, length) in lay.regions.items():
      size[("recv", g, s, dt)] = length * np.dtype(lane_dtype(dt)).itemsize
      born[("recv", g, s, dt)] = g
  out = []
  for g in range(n):
    out.append(sum(b for buf, b in size.items() if born[buf] <= g <= last.get(buf, born[buf])))
  return out


# Primitives whose outputs XLA cannot fuse an addition into (a loop's results are its own
# buffers): a gradient made by one is a buffer of its own until the sum that reads it.
LOOP_PRIMITIVES = ("scan", "while")


def loop_read_leaves(graph: Any) -> dict[int, set[int]]:
  """Per node (id), the parameter leaves (indices) its equations read into a loop.

  A device's gradient tasks within one group have no data dependence between them, so XLA
  orders them freely and sums a leaf's gradients in one fused pass after the last of them. A
  gradient a loop makes (a scanned layer stack, an RNN over time: the loop's own result
  buffer) waits there whole; one a matmul makes is added into the sum as it is made (XLA fuses
  the addition into the matmul's output). Measured on one model device at 4 micro-batches:
  BigLSTM small's compiled step held all 16 gradients of its four 256 x 4096 LSTM weights (4 MB
  each), a scanned stack of six 512 x 512 layers 6 MB more per extra micro-batch, a plain stack
  of the same layers none (`in_group_bytes`' `waits`; `memory.report` counts them on one model
  device only)."""
  from jaxhybrid import graph as graph_lib

  kinds = dict(zip(graph.jaxpr.invars, graph.input_kinds))
  out: dict[int, set[int]] = {}
  for node in graph.nodes:
    leaves = _loop_read_leaves(node, {v: kinds[v][1] for v in node.invars
                                      if v in kinds and kinds[v][0] == graph_lib.PARAM})
    if leaves:
      out[node.id] = leaves
  return out


def _loop_read_leaves(node: Any, params: dict[Any, int]) -> set[int]:
  """Parameter leaves (indices) that reach a loop in `node`'s equations, directly or through
  other equations (a transpose, a cast)."""
  import jax.extend as jex

  reach: dict[Any, set[int]] = {v: {i} for v, i in params.items()}
  out: set[int] = set()
  for eqn in node.eqns:
    got: set[int] = set()
    for v in eqn.invars:
      if isinstance(v, jex.core.Var):
        got |= reach.get(v, set())
    if not got:
      continue
    if _has_loop(eqn):
      out |= got
    for v in eqn.outvars:
      reach[v] = got
  return out


def _has_loop(eqn: Any) -> bool:
  from jaxhybrid.graph import batch_rules

  if eqn.primitive.name in LOOP_PRIMITIVES:
    return True
  return any(_has_loop(e) for _, j in batch_rules.nested_jaxprs(eqn.params)
             for e in getattr(j, "jaxpr", j).eqns)
