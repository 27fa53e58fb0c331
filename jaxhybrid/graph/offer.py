"""Split options offered to the planner: a graph's large nodes split by rows (`batch_split`, when
the batch rule is offered and the micro-batch divides), then its large parameter leaves split into
one piece per model-axis device (`shard`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from jaxhybrid.graph import batch_split as batch_lib
from jaxhybrid.graph import shard as shard_lib
from jaxhybrid.graph.opgraph import OpGraph

log = logging.getLogger("jaxhybrid")


def offer_splits(
  g: OpGraph, devices: int, micro: int, small_trace: Callable[[], Any], *,
  shard_rules: Sequence[str], shard_min_fraction: float, batch_split_min_fraction: float,
  batch_split_params: str,
) -> tuple[OpGraph, tuple[tuple[str, str], ...]]:
  """Returns (the graph with every split offered, the leaves not split with why).

  `micro`: rows per micro-batch; `small_trace()`: the loss traced at 1/`devices` of them (for
  the splits by rows)."""
  if "batch" in shard_rules:  # nodes split by rows first: leaves are split in them
    if micro % devices:
      log.info("no batch split: a micro-batch of %d rows does not split over %d devices",
               micro, devices)
    else:
      g, _ = batch_lib.split_batch(
        g, small_trace(), devices, min_fraction=batch_split_min_fraction,
        params=batch_split_params,
        skip=batch_lib.leaf_rule_nodes(g, devices, shard_rules, shard_min_fraction))
  g, report = shard_lib.shard_leaves(g, devices, rules=tuple(r for r in shard_rules if r != "batch"),
                                     min_fraction=shard_min_fraction)
  pieces = {name for x in g.batch_splits for name in x.piece_nodes}
  holders = {name for x in g.batch_splits for name in x.param_nodes}

  def read_by(names: set[str]) -> set[str]:
    return {g.param_paths[j] for n in g.nodes if n.name in names for j in n.param_leaves}

  why_not = {path: "read whole by the row pieces of its node (batch split)"
             for path in read_by(pieces)}
  why_not |= {path: "a slice of a leaf its node's batch split stores split"
              for path in read_by(holders)}
  return g, tuple((path, why_not.get(path, why)) for path, why in report.skipped)
