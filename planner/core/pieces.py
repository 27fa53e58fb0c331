"""Pieces of split parameter leaves, by node name (`jaxhybrid.graph.shard` names them)."""

from __future__ import annotations

import re
from collections.abc import Sequence

# A piece of a split parameter leaf (`jaxhybrid.graph.shard`): '<node>/shard<d>' or
# '<node>/<key>.shard<d>'.
PIECE_NAME = re.compile(r"^(.*[/.])shard(\d+)$")


def grad_units(names: Sequence[str]) -> list[int]:
  """Per node, its gradient unit: the nodes cut from one node share one (the first piece's
  id): the pieces of each of its split leaves, and the node that keeps its name (the leaf's
  post node, with the node's other parameters); every other node is its own. Together they
  write the gradients the whole node would write alone in one group: the group cap lets them
  share a group as it lets one node in (co-located in separate groups, paper BigLSTM's softmax
  pieces priced 42 % above the whole table's node; its post node, with the softmax bias, kept
  apart from the pieces, 264.6 ms against 221.7 ms for the whole plan, k=8 on 1x8)."""
  cut_from = [m.group(1).rsplit("/", 1)[0] if (m := PIECE_NAME.match(name)) else None
              for name in names]
  first: dict[str, int] = {}
  for i, node in enumerate(cut_from):
    if node is not None:
      first.setdefault(node, i)
  return [first[node] if node is not None else first.get(name, i)
          for i, (name, node) in enumerate(zip(names, cut_from))]
