"""Tests of jaxhybrid.costs.cache_blend: node times between a warm and a flushed profile."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
import toy
from flax import nnx

from jaxhybrid import costs, graph
from jaxhybrid.costs import cache_blend, cost_model

F32 = jnp.float32
LINK = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
FLUSH = 1 << 20


def _graph():
  model = nnx.eval_shape(lambda: toy.MLP(64, rngs=nnx.Rngs(0)))
  batch = jax.ShapeDtypeStruct((32, toy.DIM), F32)
  return graph.trace(model, lambda m, x: jnp.mean(m(x) ** 2), batch, depth=1)


def _fake_timers(monkeypatch, whole_s: float):
  """Deterministic timers: (F, B) per node, 1.5x when flushed; the whole step takes `whole_s`."""
  calls = []

  def tasks(graph_, node, **kw):
    calls.append((node.name, kw["flush_bytes"]))
    scale = 1.5 if kw["flush_bytes"] else 1.0
    return 0.001 * (node.id + 1) * scale, 0.003 * (node.id + 1) * scale

  def split(graph_, node, **kw):
    scale = 1.5 if kw["flush_bytes"] else 1.0
    return 0.001 * scale, 0.002 * scale

  monkeypatch.setattr(cost_model, "time_node_tasks", tasks)
  monkeypatch.setattr(cost_model, "time_node_split", split)
  monkeypatch.setattr(cost_model, "time_graph", lambda graph_, **kw: whole_s)
  return calls


def test_fit_cold_share_tests_the_whole_step_against_the_warm_sum():
  assert cache_blend.fit_cold_share(1.0, 0.8) == 0.0  # fused below the warm sum: warm
  margin = cache_blend.WARM_MARGIN
  assert cache_blend.fit_cold_share(1.0, 1.0 + 0.9 * margin) == 0.0  # within the margin
  assert cache_blend.fit_cold_share(1.0, 1.0 + 1.1 * margin) == 1.0
  assert cache_blend.fit_cold_share(1.0, 1.2, margin=0.25) == 0.0
  assert cache_blend.fit_cold_share(1.0, 1.01, margin=0.0) == 1.0
  with pytest.raises(ValueError, match="margin=-0.1 must be >= 0"):
    cache_blend.fit_cold_share(1.0, 1.0, margin=-0.1)


@pytest.mark.parametrize("whole_s, expected", [(0.010, 0.0), (0.0125, 0.0), (0.015, 1.0)])
def test_blended_times_sit_at_the_fitted_share(tmp_path, monkeypatch, whole_s, expected):
  # Node sums (F + B, dispatch not subtracted): warm (1 + 3) + (2 + 6) = 12 ms, flushed 18 ms.
  calls = _fake_timers(monkeypatch, whole_s)
  g = _graph()
  cm = costs.cache_blended(g, flush_bytes=FLUSH, cache_dir=tmp_path, repeats=1, warmup=1, link=LINK,
                           subtract_dispatch=False, tasks=True)
  assert cm.cold_share == pytest.approx(expected)
  fit = cm.fit
  assert (fit.warm_sum_s, fit.cold_sum_s, fit.whole_s) == pytest.approx((0.012, 0.018, whole_s))
  for n in g.nodes:
    w = 0.004 * (n.id + 1)
    assert cm.node_time_s(n) == pytest.approx(w + expected * 0.5 * w)
    assert cm.forward_time_s(n) == pytest.approx(0.001 * (n.id + 1) * (1 + 0.5 * expected))
    assert cm.input_grad_time_s(n) == pytest.approx(0.001 * (1 + 0.5 * expected))
    assert cm.weight_grad_time_s(n) == pytest.approx(0.002 * (1 + 0.5 * expected))
  assert sorted(calls) == sorted((n.name, f) for n in g.nodes for f in (0, FLUSH))  # each once
  assert cm.measured == 2 * len(g.nodes) + 1 + 2 * len(g.nodes)  # F/B twice, whole, B/W twice
  assert cm.step_time_s(g) == pytest.approx(sum(cm.profile_all()))
  assert cm.whole_step_time_s() == pytest.approx(whole_s)
  # Both profiles are kept in the one cache, apart.
  keys = set(json.loads(cm.cache_path.read_text())["nodes"])
  assert {g.node_fingerprint(n) + "|tasks" for n in g.nodes} <= keys
  assert {g.node_fingerprint(n) + f"|tasks|flush={FLUSH}" for n in g.nodes} <= keys
  assert cm.transfer_time_s(1e6, 0, 1) == pytest.approx(LINK.alpha_s + 1e6 / LINK.bandwidth_bytes_s)


def test_the_blend_feeds_the_planner_and_lockstep(tmp_path, monkeypatch):
  from jaxhybrid.planner.core import problem as problem_lib
  from jaxhybrid.program import lockstep

  _fake_timers(monkeypatch, 0.0)
  g = _graph()
  cm = costs.cache_blended(g, flush_bytes=FLUSH, cold_share=0.5, cache_dir=tmp_path, repeats=1,
                           warmup=1, link=LINK, subtract_dispatch=False, tasks=True)
  fwd, bwd = lockstep.task_times(g, cm)
  assert fwd == pytest.approx([0.00125 * (n.id + 1) for n in g.nodes])
  assert bwd == pytest.approx([0.00375 * (n.id + 1) for n in g.nodes])
  prob = problem_lib.Problem.from_graph(g, cm, problem_lib.PlannerOptions(devices=2))
  assert prob.forward_s == pytest.approx(tuple(fwd))


def test_share_from_program_interpolates_and_clips():
  assert cache_blend.share_from_program(1.0, 2.0, 1.25) == pytest.approx(0.25)
  assert cache_blend.share_from_program(1.0, 2.0, 0.5) == 0.0  # faster than all warm
  assert cache_blend.share_from_program(1.0, 2.0, 3.0) == 1.0  # slower than all cold
  assert cache_blend.share_from_program(1.0, 1.0, 5.0) == 0.0  # the profiles do not differ


def test_a_program_anchored_blend_prices_at_the_interpolated_share(tmp_path, monkeypatch):
  from jaxhybrid.program import lockstep

  _fake_timers(monkeypatch, 0.0)  # the whole-step fit says warm
  g = _graph()
  cm = costs.cache_blended(g, flush_bytes=FLUSH, cache_dir=tmp_path, repeats=1, warmup=1,
                           link=LINK, subtract_dispatch=False, tasks=True)
  assert cm.cold_share == 0.0
  anchored = cm.anchored(program_s=0.0175, warm_s=0.015, cold_s=0.025)
  assert anchored.cold_share == pytest.approx(0.25)
  assert cm.cold_share == 0.0  # the original blend is unchanged
  fit = anchored.fit.to_dict()
  assert fit["anchor"] == "program" and cm.fit.anchor == "whole"
  assert (fit["program_s"], fit["program_warm_s"], fit["program_cold_s"]) == (0.0175, 0.015, 0.025)
  assert (fit["warm_sum_s"], fit["cold_sum_s"]) == pytest.approx((0.012, 0.018))
  fwd, _ = lockstep.task_times(g, anchored)
  assert fwd == pytest.approx([0.001 * (n.id + 1) * (1 + 0.25 * 0.5) for n in g.nodes])
  cold = cm.at_share(1.0, "cold")
  assert cold.cold_share == 1.0 and cold.fit.anchor == "cold" and cold.fit.program_s is None
  assert cold.fit.whole_s == cm.fit.whole_s
  assert cold.node_time_s(g.nodes[0]) == pytest.approx(0.004 * 1.5)


def test_a_fixed_share_skips_the_fit(tmp_path, monkeypatch):
  _fake_timers(monkeypatch, 0.0)

  def fail(*args, **kwargs):
    raise AssertionError("the whole step was timed for a fixed share")

  monkeypatch.setattr(cost_model, "time_graph", fail)
  g = _graph()
  cm = costs.cache_blended(g, flush_bytes=FLUSH, cold_share=0.25, cache_dir=tmp_path, repeats=1,
                           warmup=1, link=LINK, subtract_dispatch=False, tasks=True)
  n = g.nodes[0]
  assert cm.cold_share == 0.25
  assert cm.node_time_s(n) == pytest.approx(0.004 * (1 + 0.25 * 0.5))


def test_bad_blends_are_clear_errors(tmp_path):
  g = _graph()
  kw = {"cache_dir": tmp_path, "link": LINK}
  warm = costs.ProfiledCostModel(g, **kw)
  cold = costs.ProfiledCostModel(g, flush_bytes=FLUSH, **kw)
  with pytest.raises(ValueError, match="back to back"):
    costs.CacheBlendedCostModel(cold, cold)
  with pytest.raises(ValueError, match="same OpGraph"):
    costs.CacheBlendedCostModel(costs.ProfiledCostModel(_graph(), **kw), cold)
  with pytest.raises(ValueError, match="same tasks"):
    costs.CacheBlendedCostModel(
      warm, costs.ProfiledCostModel(g, flush_bytes=FLUSH, tasks=True, **kw))
  with pytest.raises(ValueError, match=r"cold_share=1.5 must be in \[0, 1\]"):
    costs.CacheBlendedCostModel(warm, cold, cold_share=1.5)
  with pytest.raises(ValueError, match="flushes nothing"):
    costs.cache_blended(g, flush_bytes=0, **kw)
