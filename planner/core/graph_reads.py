"""What `Problem.from_graph` reads from a graph beyond its nodes' fields, by duck typing (the
planner imports nothing of the graph layer): the values each edge carries, the bytes a node keeps
per micro-batch and the parameter bytes a gradient task copies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Dtype of the values of hand-built problems (one per edge).
DEFAULT_VALUE_DTYPE = "float32"

def copied_param_bytes(graph: Any, nodes: Sequence[Any]) -> list[int]:
  """Per node, its parameter bytes less the tables it reads only by row lookups
  (`OpGraph.copied_param_bytes`); a graph without that method: all of them."""
  per_node = getattr(graph, "copied_param_bytes", None)
  if per_node is None:
    return [int(n.param_bytes) for n in nodes]
  return [int(per_node(n)) for n in nodes]


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
        dt = np.dtype(v.aval.dtype)
        vbytes.append(int(np.prod(v.aval.shape, dtype=np.int64)) * dt.itemsize)
        vdtypes.append(dt.name)
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
