"""Pieces of split parameter leaves, by node name (`jaxhybrid.graph.shard` names them)."""

from __future__ import annotations

import re
from collections.abc import Sequence

# A piece of a split parameter leaf (`jaxhybrid.graph.shard`): '<node>/shard<d>' or
# '<node>/<key>.shard<d>'.
PIECE_NAME = re.compile(r"^(.*[/.])shard(\d+)$")


def grad_units(names: Sequence[str]) -> list[int]:
  """Per node, its gradient unit: the pieces of one split leaf share one (the smallest piece's
  id), every other node is its own. A device's pieces of one leaf write that leaf's gradient,
  which the whole leaf's node would write alone in one group: the group cap lets them share a
  group as it lets one node in (co-located in separate groups, paper BigLSTM's softmax pieces
  priced 42 % above the whole table's node)."""
  first: dict[str, int] = {}
  out = []
  for i, name in enumerate(names):
    m = PIECE_NAME.match(name)
    out.append(first.setdefault(m.group(1), i) if m else i)
  return out
