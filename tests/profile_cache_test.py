"""The profile cache keeps the dispatch time each cost model subtracts beside the node times."""

from __future__ import annotations

import json

import jax
import pytest
from costs_test import _mlp_graph  # tests/ (this folder)

from jaxhybrid import costs
from jaxhybrid.costs import cost_model


def test_dispatch_time_is_cached_with_the_profiles(tmp_path, monkeypatch):
  # Two cost models on one cache price alike: the second reads the first's dispatch time.
  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  fake = {n.name: (0.010 * (n.id + 1), 0.020 * (n.id + 1)) for n in g.nodes}
  monkeypatch.setattr(cost_model, "time_node_tasks", lambda graph, node, **kw: fake[node.name])
  dispatches = iter([0.001, 0.005])
  monkeypatch.setattr(cost_model, "dispatch_time_s", lambda **kw: next(dispatches))
  first, second = (costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=1, warmup=1,
                                           link=link, tasks=True) for _ in range(2))
  n = g.nodes[0]
  f, b = fake[n.name]
  assert first.node_time_s(n) == pytest.approx(f + b - 2 * 0.001)
  assert second.node_time_s(n) == pytest.approx(f + b - 2 * 0.001)
  assert next(dispatches) == 0.005  # measured once
  stored = json.loads(first.cache_path.read_text())
  assert stored["dispatch"][jax.__version__]["raw_s"] == 0.001
  assert all("raw_s" in e or "forward_raw_s" in e for e in stored["nodes"].values())
  other = tmp_path / "other"  # a cache without it measures its own
  third = costs.ProfiledCostModel(g, cache_dir=other, repeats=1, warmup=1, link=link, tasks=True)
  monkeypatch.setattr(cost_model, "dispatch_time_s", lambda **kw: 0.002)
  assert third.node_time_s(n) == pytest.approx(f + b - 2 * 0.002)
