"""The batch shapes a compiled hybrid step accepts, checked before JAX sees the batch.

A step is compiled for the sample batch: a batch of another size would fail deep inside JAX
("switch branches must have equal output types"); `check` says in one line what the step was
compiled for instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxhybrid import graph as graph_lib


def expected(
  graph: graph_lib.OpGraph, per_example: Sequence[bool], data: int, microbatches: int
) -> list[tuple[int, ...]]:
  """Per batch leaf, the global shape the step takes.

  Per-example leaves: data x micro-batches x the traced micro-batch size, then the traced
  trailing dimensions; shared leaves: their traced shape.
  """
  avals = [
    v.aval for v, (kind, _) in zip(graph.jaxpr.invars, graph.input_kinds)
    if kind == graph_lib.BATCH
  ]
  return [
    ((data * microbatches * a.shape[0],) + tuple(a.shape[1:])) if pe else tuple(a.shape)
    for a, pe in zip(avals, per_example)
  ]


def _fmt(pairs: Iterable[tuple[str, Sequence[int]]]) -> str:
  return ", ".join(f"{name}{list(shape)}" for name, shape in pairs)


def check(
  graph: graph_lib.OpGraph, per_example: Sequence[bool], data: int, microbatches: int,
  leaves: Sequence[Any],
) -> None:
  """Raises a one-line ValueError unless `leaves` have the shapes the step was compiled for.

  Raises:
    ValueError: "the step was compiled for global batch B with per-example leaves ...; got ...".
  """
  want = expected(graph, per_example, data, microbatches)
  got = [tuple(np.shape(x)) for x in leaves]
  if got == want:
    return
  names = [n or "batch" for n in graph.batch_paths]
  sizes = [w[0] for w, pe in zip(want, per_example) if pe]
  per_ex = _fmt((n, w) for n, w, pe in zip(names, want, per_example) if pe)
  shared = _fmt((n, w) for n, w, pe in zip(names, want, per_example) if not pe)
  raise ValueError(
    f"the step was compiled for global batch {sizes[0] if sizes else 0} with per-example "
    f"leaves {per_ex or '(none)'}" + (f" and shared leaves {shared}" if shared else "")
    + f"; got {_fmt(zip(names, got))}: pass batches shaped like the sample batch, or call "
    "parallelize again with a sample batch of the new size"
  )
