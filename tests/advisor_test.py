"""Tests for jaxhybrid.advisor: S_MP from our plans (with sources) and the advisor.

Deterministic: only the heuristic planners (no time-limited search) on a small grid.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types

import pytest

from jaxhybrid import advisor, projection
from jaxhybrid import costs as costs_lib
from jaxhybrid.costs import hardware
from jaxhybrid.projection import paper_scenario

GRID = advisor.SearchConfig(planners=advisor.planned.HEURISTICS, devices=(2, 4),
                            microbatches=(1, 4))
DEVICES = tuple(2**i for i in range(3, 11))


@functools.lru_cache(maxsize=None)
def _search(name: str, hw: str = "dgx1-v100") -> advisor.SMPSearch:
  pm = paper_scenario.PAPER_MODELS[name]
  return advisor.planned_s_mp(name, per_worker_batch=pm.per_gpu_batch, hardware=hw, config=GRID)


@pytest.mark.parametrize("name", ["biglstm", "gnmt"])
def test_s_mp_is_one_device_over_the_best_lockstep_plan(name):
  found = _search(name)
  graph = advisor.planned.registry_trace_fn(name, "paper")(
    paper_scenario.PAPER_MODELS[name].per_gpu_batch)
  costs = costs_lib.AnalyticCostModel("dgx1-v100")
  # One device in lock step: the sum of the nodes' forward + backward times.
  assert found.single_device_s == pytest.approx(sum(costs.node_time_s(n) for n in graph.nodes))
  assert found.param_bytes == graph.total_param_bytes
  for e in found.estimates():
    cands = [c for c in found.candidates if c.m == e.m]
    assert len(cands) == len(GRID.planners) * len(GRID.microbatches)
    best = min([c for c in cands if c.fits] or cands, key=lambda c: c.step_s)
    assert e.s_mp == pytest.approx(found.single_device_s / best.step_s)
    assert (e.microbatches, e.planner, e.predicted_step_s) == (best.k, best.planner, best.step_s)


@pytest.mark.parametrize("name", list(paper_scenario.PAPER_MODELS))
def test_no_default_projection_reads_a_paper_result(name):
  hw = hardware.get("dgx1-v100")
  with pytest.raises(ValueError, match="needs S_MP"):
    paper_scenario.paper_workload(name, hw)
  w = paper_scenario.paper_workload(name, hw, s_mp=_search(name).estimates())
  for m, _ in w.s_mp:
    assert w.s_mp_source_of(m).startswith("planner: ")
    assert "paper" not in w.s_mp_source_of(m).split(",")[0].replace(" paper b=", "")
  p = projection.project(w, hw, projection.CommConfig(), DEVICES, m=2)
  assert p.s_mp_source.startswith("planner: ") and p.s_mp_source == w.s_mp_source_of(2)
  assert json.loads(json.dumps(p.to_json()))["s_mp_source"] == p.s_mp_source
  # The paper's figure only on request, and labelled.
  paper = paper_scenario.paper_s_mp(name)
  assert paper.source.startswith("paper: ") and paper.s_mp == (
    paper_scenario.PAPER_MODELS[name].paper_s_mp_2)
  # A Workload refuses an S_MP without a source.
  with pytest.raises(ValueError, match="no source"):
    dataclasses.replace(w, s_mp_source=())


def test_the_main_job_projects_with_a_planner_s_mp(deterministic_place):
  from jaxhybrid.train import predict, runner

  config = runner.RunConfig(model="biglstm", mesh="2x2")
  p, est = predict.project(config, None, 2)
  assert est.source.startswith("planner: ") and p.s_mp_source == est.source
  assert p.s_mp == est.s_mp and est.microbatches in (1, 2, 4, 8) and est.m == 2


@pytest.mark.parametrize("name,hw", [("inception_v3", "dgx1-v100"), ("gnmt", "dgx1-v100"),
                                     ("biglstm", "dgx-a100")])
def test_advisor_crossover_is_where_its_hybrid_options_first_beat_dp(name, hw):
  # Checked against the advisor's own option table (the definition of the crossover: the
  # smallest N where a hybrid's speedup reaches DP's), not by calling the projection again. On
  # every even N from 8 to 1024 the table holds every N the crossover may be.
  found = _search(name, hw)
  a = advisor.advise_model(name, hardware=hw, devices=tuple(range(8, 1025, 2)), found=found)
  assert a.dp_fits and all(e.fits for e in a.s_mp)  # memory does not bind here
  speed = {(o.devices, o.model): o.speedup for row in a.options for o in row}
  assert {m for _, m in speed} - {1}, "no hybrid option in the table"
  for m, cross in a.crossover_by_m:
    wins = [n for n in a.devices if (n, m) in speed and speed[(n, m)] >= speed[(n, 1)] * (1 - 1e-9)]
    loses = [n for n in a.devices if (n, m) in speed and n not in wins]
    if cross is None:
      assert not wins
      continue
    assert wins and min(wins) == cross
    assert all(n in loses for n in a.devices if (n, m) in speed and n < cross)
  assert a.crossover_devices == min((c for _, c in a.crossover_by_m if c is not None), default=None)
  # The recommendation is the best option.
  for i in range(len(a.devices)):
    assert a.recommended[i].speedup == max(o.speedup for o in a.options[i])


def test_advisor_never_recommends_what_does_not_fit(tmp_path):
  # BigLSTM on a 16 GB V100: one device cannot hold it (dense 1.8B-parameter gradients + Adam).
  a = advisor.advise_model("biglstm", devices=DEVICES, found=_search("biglstm"))
  assert not a.dp_fits
  assert all(r is not None and r.model > 1 and r.fits for r in a.recommended)
  assert a.crossover_devices == DEVICES[0]
  # Inception-V3 with a cap between its M=4 and M=2 per-device memory: only M=4 may be advised.
  found = _search("inception_v3")
  m2, m4 = found.estimate(2), found.estimate(4)
  frac = (m2.memory_bytes_per_device + m4.memory_bytes_per_device) / 2 / (16 * 2**30)
  cands = tuple(dataclasses.replace(c, fits=advisor.fits_memory(
    c.memory_bytes_per_device, hardware.get("dgx1-v100"), frac)) for c in found.candidates)
  tight = dataclasses.replace(found, candidates=cands, single_device_fits=False,
                              config=dataclasses.replace(found.config, usable_memory_fraction=frac))
  a = advisor.advise_model("inception_v3", devices=DEVICES, found=tight)
  for r in a.recommended:
    assert r is not None and r.fits and r.model == 4
    assert r.memory_bytes_per_device <= 16 * 2**30 * frac
  text = advisor.format_advice(a)
  assert "does NOT fit" in text and "S_MP(4)" in text
  advisor.plot_advice([a], str(tmp_path / "a.png"))
  assert (tmp_path / "a.png").stat().st_size > 1000
  json.dumps(a.to_json())


def test_advise_a_users_module():
  import jax
  from flax import nnx

  import jaxhybrid
  from tests import toy

  model = nnx.eval_shape(lambda: toy.Towers(64, rngs=nnx.Rngs(0)))
  batch = {"x": jax.ShapeDtypeStruct((32, toy.DIM), "float32"),
           "y": jax.ShapeDtypeStruct((32, 4), "float32")}
  grid = advisor.SearchConfig(planners=("dp", "etf"), devices=(2,), microbatches=(1, 2))
  a = jaxhybrid.advise(model, toy.mse_nnx, batch, b_noise=100.0, config=grid, devices=(8, 16))
  assert a.model == "Towers" and a.devices == (8, 16) and a.dp_fits
  assert all(e.source.startswith("planner: ") for e in a.s_mp)
  assert all(r is not None and r.fits for r in a.recommended)
  with pytest.raises(ValueError, match="b_noise"):
    jaxhybrid.advise(model, toy.mse_nnx, batch, config=grid)


def test_model_overrides_reach_the_traced_model_and_the_estimate_source():
  grid = advisor.SearchConfig(planners=("dp",), devices=(2,), microbatches=(1,))
  plain = advisor.planned_s_mp("biglstm", size="tiny", per_worker_batch=4, hardware="dgx1-v100",
                               config=grid)
  chunked = advisor.planned_s_mp("biglstm", size="tiny", per_worker_batch=4,
                                 hardware="dgx1-v100", config=grid,
                                 model_overrides={"time_chunks": 2})
  assert plain.model_overrides == ()
  assert chunked.model_overrides == (("time_chunks", 2),)
  assert "time_chunks=2" in chunked.estimate(2).source
  assert "time_chunks" not in plain.estimate(2).source
  # The chunked model is another graph (each LSTM layer cut in two over time), so another plan.
  chunked_graph = advisor.planned.registry_trace_fn("biglstm", "tiny", time_chunks=2)(4)
  plain_graph = advisor.planned.registry_trace_fn("biglstm", "tiny")(4)
  assert len(chunked_graph.nodes) > len(plain_graph.nodes)
  back = advisor.SMPSearch.from_json(json.loads(json.dumps(chunked.to_json())))
  assert back.model_overrides == chunked.model_overrides


def test_run_projection_passes_only_structural_overrides(monkeypatch, tmp_path):
  from jaxhybrid.train import predict, runner

  seen = {}

  class Stop(Exception):
    pass

  def fake_advise_model(name, **kw):
    seen.update(kw, name=name)
    raise Stop

  monkeypatch.setattr(advisor, "advise_model", fake_advise_model)
  monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))  # no S_MP cached by another test
  config = runner.RunConfig(model="biglstm", overrides=(("time_chunks", 4), ("hidden_size", 8)))
  with pytest.raises(Stop):
    predict.project(config, None, 2)
  assert seen["name"] == "biglstm"
  assert seen["model_overrides"] == {"time_chunks": 4}


def test_run_projection_reuses_a_cached_s_mp_of_the_same_configuration_and_code(
    monkeypatch, tmp_path):
  from jaxhybrid.projection import s_mp
  from jaxhybrid.train import predict, runner

  calls = []

  def fake_advise_model(name, **kw):
    calls.append(kw["config"].seed)
    est = s_mp.SMPEstimate(m=2, s_mp=1.5 + len(calls), source="planner: fake", microbatches=4)
    return types.SimpleNamespace(s_mp=[est])

  monkeypatch.setattr(advisor, "advise_model", fake_advise_model)
  monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
  config = runner.RunConfig(model="biglstm", mesh="2x2")
  _, first = predict.project(config, None, 2)
  _, again = predict.project(config, None, 2)
  assert calls == [0] and again == first  # read back, not planned again
  _, other = predict.project(dataclasses.replace(config, seed=1), None, 2)
  assert calls == [0, 1] and other.s_mp != first.s_mp  # another search: planned
  monkeypatch.setattr(predict, "_code_digest", lambda: "other code")
  predict.project(config, None, 2)
  assert calls == [0, 1, 0]  # other code: planned again
  # A damaged cache file is planned over, not an error.
  for f in (tmp_path / "s_mp").glob("*.json"):
    f.write_text("{not json")
  predict.project(config, None, 2)
  assert len(calls) == 4
