"""What `Problem.from_graph` reads from a graph beyond its nodes' fields, by duck typing (the
planner imports nothing of the graph layer): the values each edge carries, the bytes a node keeps
per micro-batch, the parameter bytes a gradient task copies, the parameter leaves several nodes
read and the batch's bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Dtype of the values of hand-built problems (one per edge).
DEFAULT_VALUE_DTYPE = "float32"

def gradient_row_split(
  graph: Any, nodes: Sequence[Any], slot_min_bytes: int | None, one_window: bool,
) -> tuple[list[int], list[int], list[int]]:
  """Per node, (parameter bytes its gradient task returns as windows: all but the tables it
  reads by row lookups, bytes its tasks copy out of the device's rows, bytes whose gradient
  needs no accumulator row), as the program lays the parameters out (`program.structure`):

  - a leaf of `slot_min_bytes` or more has a row of its own and is read in place; a smaller one
    lies in the packed row and a task reading it whole copies it out (`program.memory.
    param_copies`); a looked-up table or a leaf several nodes read is never copied;
  - with `one_window` (one micro-batch, no ZeRO), a leaf with a row of its own, read whole by
    one node that is not part of a batch split, gets its whole gradient as ONE window of the
    step: that window is the gradient, with no accumulator row (`program.gradients.
    single_window_rows`).

  A graph that does not say which leaves its nodes read: every parameter byte a window and a
  copy, and none without a row."""
  reads_of = getattr(graph, "param_reads", None)
  if reads_of is None:
    every = [int(n.param_bytes) for n in nodes]
    return every, list(every), [0] * len(nodes)
  reads = [reads_of(n) for n in nodes]
  readers: dict[int, int] = {}
  for r in reads:
    for leaf, _, _ in r:
      readers[leaf] = readers.get(leaf, 0) + 1
  split = {name for s in getattr(graph, "batch_splits", ()) or ()
           for name in (s.node, *s.piece_nodes, *s.param_nodes)}
  slot = float("inf") if slot_min_bytes is None else slot_min_bytes
  windows, copies, single = [], [], []
  for n, r in zip(nodes, reads):
    windows.append(sum(b for _, b, looked_up in r if not looked_up))
    c = w = 0
    for leaf, b, looked_up in r:
      if looked_up or readers[leaf] > 1:
        continue
      if b < slot:
        c += b
      elif one_window and n.name not in split:
        w += b
    copies.append(c)
    single.append(w)
  return windows, copies, single


def values(
  nodes: Sequence[Any], keys: Sequence[tuple[int, int]], merged: dict[tuple[int, int], int]
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[tuple[int, ...], ...]]:
  """(value bytes, value dtypes, per edge its value ids) from the nodes' outvars and invars
  (the variables that cross an edge); an edge whose variables are unknown gets one float32
  value of its bytes."""
  ids: dict[Any, int] = {}
  vbytes: list[int] = []
  vdtypes: list[str] = []
  per_edge = []
  for s, d in keys:
    outs = list(getattr(nodes[s], "outvars", ()) or ())
    ins = set(id(v) for v in (getattr(nodes[d], "invars", ()) or ()))
    crossing = [v for v in outs if id(v) in ins and hasattr(getattr(v, "aval", None), "dtype")]
    if not crossing:
      ids[("edge", s, d)] = len(vbytes)
      vbytes.append(merged[(s, d)])
      vdtypes.append(DEFAULT_VALUE_DTYPE)
      per_edge.append((ids[("edge", s, d)],))
      continue
    row = []
    for v in crossing:
      if id(v) not in ids:
        ids[id(v)] = len(vbytes)
        vbytes.append(_nbytes(v.aval))
        vdtypes.append(np.dtype(v.aval.dtype).name)
      row.append(ids[id(v)])
    per_edge.append(tuple(row))
  return tuple(vbytes), tuple(vdtypes), tuple(per_edge)


def kept_bytes(graph: Any, nodes: Sequence[Any], model: str) -> list[int]:
  """Per node, the bytes it keeps per micro-batch: `graph.saved_bytes(node)` under 'saved' when
  the graph has it, else the node's outputs."""
  saved = getattr(graph, "saved_bytes", None)
  if model == "saved" and saved is not None:
    return [int(saved(n)) for n in nodes]
  return [int(n.out_bytes) for n in nodes]


def _inputs_of(graph: Any, kind: str) -> dict[Any, Any] | None:
  """The graph's jaxpr inputs of `kind` ('param', 'batch', ...) -> their avals; None for a graph
  that does not say (no `jaxpr` or `input_kinds`)."""
  jaxpr = getattr(graph, "jaxpr", None)
  kinds = getattr(graph, "input_kinds", None)
  if jaxpr is None or kinds is None:
    return None
  return {v: v.aval for v, (k, _) in zip(jaxpr.invars, kinds) if k == kind}


def _nbytes(aval: Any) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize  # (PRNG keys have one)


def shared_params(graph: Any, nodes: Sequence[Any]) -> list[tuple[int, tuple[int, ...]]]:
  """(bytes, reader node ids) of every parameter leaf more than one node reads. Each reader's
  `param_bytes` counts the leaf; the program keeps it once per device: on its readers' device,
  or replicated on every model-axis device when they are on several (`program.structure`: a
  shared leaf). () for a graph that does not say which leaves its nodes read."""
  params = _inputs_of(graph, "param")
  if params is None:
    return []
  readers: dict[Any, list[int]] = {}
  for n in nodes:
    for v in dict.fromkeys(getattr(n, "invars", ()) or ()):
      if v in params:
        readers.setdefault(v, []).append(int(n.id))
  return [(_nbytes(params[v]), tuple(r)) for v, r in readers.items() if len(r) > 1]


def batch_bytes(graph: Any) -> int:
  """Bytes of the step's batch inputs (every model-axis device holds the whole batch of its data
  replica) and of the model state the step carries when the loss writes some (every state leaf,
  replicated: `OpGraph.state_writes`); 0 for a graph that does not say."""
  batch = _inputs_of(graph, "batch")
  out = sum(_nbytes(a) for a in batch.values()) if batch else 0
  if getattr(graph, "state_writes", ()):
    out += sum(_nbytes(a) for a in (_inputs_of(graph, "state") or {}).values())
  return out
