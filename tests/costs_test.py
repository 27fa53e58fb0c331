"""Tests of jaxhybrid.costs (analytic and profiled node times, transfers) and calibrate's step
comparison (its link calibration: calibrate_link_test.py)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxhybrid import costs, graph
from jaxhybrid.costs import calibrate, cost_model, hardware
from jaxhybrid.graph import remat as remat_lib

F32 = jnp.float32


def _toy_hardware(**overrides) -> hardware.Hardware:
  fields = dict(
    name="toy", device_kind="toy", peak_flops=1e12, mem_bandwidth=1e11, memory_bytes=2**30,
    devices_per_node=4,
    link_bandwidth=tuple(tuple(0.0 if i == j else 1e10 for j in range(4)) for i in range(4)),
    link_alpha_s=1e-5, nic_bandwidth=1e9, nic_alpha_s=1e-4, op_overhead_s=1e-6, efficiency=0.5,
    source="made up for tests",
  )
  fields.update(overrides)
  return hardware.Hardware(**fields)


def _matmul_graph(m=64, k=32, n=16):
  return graph.trace_function(
    lambda p, s, b: jnp.sum(b @ p), jax.ShapeDtypeStruct((k, n), F32), {},
    jax.ShapeDtypeStruct((m, k), F32),
  )


class MLP(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(16, 64, rngs=rngs)
    self.l2 = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _mlp_loss(model, x):
  return jnp.mean(model(x) ** 2)


# ---- analytic --------------------------------------------------------------------------------


def test_analytic_roofline_compute_bound():
  g = _matmul_graph()
  (node,) = g.nodes
  hw = _toy_hardware(mem_bandwidth=1e15)  # memory is never the limit
  model = costs.AnalyticCostModel(hw, backward_factor=2.0)
  kernels = costs.kernel_count(node.eqns)
  assert kernels == 2  # the matmul, and the fused reduction
  fwd = node.flops / (1e12 * 0.5) + kernels * 1e-6
  assert model.forward_time_s(node) == pytest.approx(fwd)
  assert model.node_time_s(node) == pytest.approx(3 * fwd)
  half = costs.AnalyticCostModel(hw, backward_factor=1.0)
  assert half.node_time_s(node) == pytest.approx(2 * fwd)
  assert model.step_time_s(g) == pytest.approx(model.node_time_s(node))
  assert model.source == "analytic" and model.hardware_name == "toy"


def test_analytic_roofline_memory_bound():
  g = _matmul_graph()
  (node,) = g.nodes
  hw = _toy_hardware(peak_flops=1e20, op_overhead_s=0.0)  # compute is never the limit
  model = costs.AnalyticCostModel(hw, memory_efficiency=0.5)
  assert model.forward_time_s(node) == pytest.approx(node.bytes_accessed / (1e11 * 0.5))


def test_kernel_count_multiplies_scan_length():
  def loss(p, s, b):
    _, ys = jax.lax.scan(lambda h, x: (jnp.tanh(x @ p + h), h), jnp.zeros((2, 4)), b)
    return jnp.sum(ys)

  g = graph.trace_function(
    loss, jax.ShapeDtypeStruct((4, 4), F32), {}, jax.ShapeDtypeStruct((5, 2, 4), F32)
  )
  # scan: 5 x (matmul + fused elementwise); outside: the zeros / sum, fused.
  assert costs.kernel_count(g.nodes[0].eqns) == 5 * 2 + 1


def test_analytic_bad_arguments():
  with pytest.raises(ValueError, match="backward_factor"):
    costs.AnalyticCostModel(_toy_hardware(), backward_factor=-1)
  with pytest.raises(ValueError, match="memory_efficiency"):
    costs.AnalyticCostModel(_toy_hardware(), memory_efficiency=0)
  with pytest.raises(ValueError, match="Unknown hardware"):
    costs.AnalyticCostModel("no-such-machine")


# ---- transfers and all-reduce ----------------------------------------------------------------


def test_transfer_time_alpha_beta():
  model = costs.AnalyticCostModel(_toy_hardware())
  assert model.transfer_time_s(1e6, 2, 2) == 0.0
  assert model.transfer_time_s(1e6, 0, 1) == pytest.approx(1e-5 + 1e6 / 1e10)
  # Devices 0 and 5 are on different nodes of 4: the NIC.
  assert model.transfer_time_s(1e6, 0, 5) == pytest.approx(1e-4 + 1e6 / 1e9)
  with pytest.raises(ValueError):
    model.transfer_time_s(-1, 0, 1)


def test_transfer_on_dgx1_uses_nvlink_counts():
  model = costs.AnalyticCostModel("dgx1-v100")
  hw = hardware.get("dgx1-v100")
  assert model.transfer_time_s(50e6, 0, 3) == pytest.approx(hw.alpha(0, 3) + 50e6 / 50e9)
  assert model.transfer_time_s(50e6, 0, 1) == pytest.approx(hw.alpha(0, 1) + 50e6 / 25e9)


def test_ring_allreduce_formula():
  p, alpha, bw = 4e8, 1e-5, 1e10
  for w in (2, 4, 8):
    want = 2 * (w - 1) * alpha + 2 * (w - 1) / w * p / bw
    assert costs.ring_allreduce_time_s(p, w, alpha, bw) == pytest.approx(want)
  assert costs.ring_allreduce_time_s(p, 1, alpha, bw) == 0.0
  with pytest.raises(ValueError, match="workers"):
    costs.ring_allreduce_time_s(p, 0, alpha, bw)


def test_allreduce_inside_and_across_nodes():
  model = costs.AnalyticCostModel(_toy_hardware())
  p = 1e8
  assert model.allreduce_time_s(p, 1) == 0.0
  want = costs.ring_allreduce_time_s(p, 4, 1e-5, 1e10)
  assert model.allreduce_time_s(p, 4) == pytest.approx(want)
  # 8 workers span two nodes: the NIC is the bottleneck link.
  assert model.allreduce_time_s(p, 8) == pytest.approx(costs.ring_allreduce_time_s(p, 8, 1e-4, 1e9))


def test_dgx1_ring_avoids_missing_links():
  # The naive ring 0..7 has hop 3->4 without a direct link; the best ring uses double links.
  alpha, bw = costs.ring_bottleneck(hardware.get("dgx1-v100"), 8)
  assert bw == 50e9  # e.g. 0-3-2-1-5-6-7-4-0: every hop has two NVLinks
  assert alpha == hardware.get("dgx1-v100").link_alpha_s


def test_link_model():
  link = costs.Link(alpha_s=2e-6, bandwidth_bytes_s=1e9, source="test")
  assert costs.transfer_time_s(link, 1e3, 0, 1) == pytest.approx(2e-6 + 1e-6)
  assert costs.transfer_time_s(link, 1e3, 1, 1) == 0.0
  with pytest.raises(ValueError, match="bandwidth"):
    costs.Link(alpha_s=0.0, bandwidth_bytes_s=0.0)


# ---- profiled --------------------------------------------------------------------------------


def _mlp_graph():
  model = nnx.eval_shape(lambda: MLP(rngs=nnx.Rngs(0)))
  return graph.trace(model, _mlp_loss, jax.ShapeDtypeStruct((32, 16), F32), depth=1)


def _record_time_node(monkeypatch, what):
  """Wraps costs.time_node to append what(args, kwargs) of every call to the returned list."""
  calls = []
  real = costs.time_node

  def recording(*args, **kwargs):
    calls.append(what(args, kwargs))
    return real(*args, **kwargs)

  monkeypatch.setattr(cost_model, "time_node", recording)
  return calls


def test_profiled_times_are_cached_on_disk(tmp_path, monkeypatch):
  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  calls = _record_time_node(monkeypatch, lambda args, kwargs: args[1].name)
  first = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=2, warmup=1, link=link)
  times = first.profile_all()
  assert calls == ["l1", "l2"] and first.measured == 2
  assert all(t >= 0 for t in times)
  assert first.source == "profiled"

  cache = json.loads(first.cache_path.read_text())
  assert cache["backend"] == jax.default_backend()
  assert cache["device_kind"] == jax.devices()[0].device_kind
  assert set(cache["nodes"]) == {g.node_fingerprint(n) for n in g.nodes}
  assert all(e["raw_s"] > 0 for e in cache["nodes"].values())

  # A new model (as in a new process) reads the cache: nothing is compiled or timed.
  def fail(*args, **kwargs):
    raise AssertionError("a cached node was timed again")

  monkeypatch.setattr(cost_model, "time_node", fail)
  g2 = _mlp_graph()  # traced again: the same fingerprints
  second = costs.ProfiledCostModel(
    g2, cache_dir=tmp_path, repeats=2, warmup=1, link=link, subtract_dispatch=False
  )
  assert second.profile_all() == [cache["nodes"][g.node_fingerprint(n)]["raw_s"] for n in g.nodes]
  assert second.measured == 0
  assert second.step_time_s(g2) == pytest.approx(sum(second.profile_all()))


def test_whole_step_is_timed_once_and_cached_beside_the_nodes(tmp_path, monkeypatch):
  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  seen = []
  real = costs.time_graph

  def recording(graph_, **kwargs):
    seen.append(graph_)
    return real(graph_, **kwargs)

  monkeypatch.setattr(cost_model, "time_graph", recording)
  first = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=2, warmup=1, link=link, subtract_dispatch=False)
  whole = first.whole_step_time_s()
  assert seen == [g] and first.measured == 1 and whole > 0
  assert first.whole_step_time_s(g) == whole and len(seen) == 1  # in memory
  first.profile_all()
  nodes = json.loads(first.cache_path.read_text())["nodes"]
  assert len(nodes) == len(g.nodes) + 1  # the nodes and the whole step, apart
  assert [e["raw_s"] for e in nodes.values() if e["name"] == "<whole step>"] == [whole]

  def fail(*args, **kwargs):
    raise AssertionError("a cached whole step was timed again")

  monkeypatch.setattr(cost_model, "time_graph", fail)
  second = costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, repeats=2, warmup=1, link=link,
                                   subtract_dispatch=False)
  assert second.whole_step_time_s() == whole and second.measured == 0


def test_whole_step_timing_differentiates_params_only(monkeypatch):
  """time_graph differentiates the parameters, not the batch or state, of any traced loss."""
  class Counted(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(50, 8, rngs=rngs)
      self.seen = nnx.BatchStat(jnp.zeros((8,), F32))  # float state: no gradient either

    def __call__(self, tokens):
      h = self.embed(tokens)
      self.seen[...] = self.seen[...] + jnp.mean(h, axis=(0, 1))
      return h * self.seen[...]

  model = nnx.eval_shape(lambda: Counted(nnx.Rngs(0)))
  g = graph.trace(model, lambda m, b: jnp.mean(m(b) ** 2), jax.ShapeDtypeStruct((6, 3), jnp.int32), depth=1)
  grads = []
  real_vjp = jax.vjp

  def vjp(f, *primals, **kw):
    grads.append([p.shape for p in primals])
    return real_vjp(f, *primals, **kw)

  monkeypatch.setattr(jax, "vjp", vjp)
  assert costs.time_graph(g, warmup=1, repeats=1) > 0
  assert grads == [[(50, 8)]]  # the embedding table only: not the int batch, not the float state


def test_profiled_handles_int_inputs_and_scan(tmp_path):
  class Tagger(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(50, 8, rngs=rngs)
      self.out = nnx.Linear(8, 50, rngs=rngs)

    def __call__(self, tokens):
      h = self.embed(tokens)  # [time, batch, 8]
      _, hs = jax.lax.scan(lambda c, x: (jnp.tanh(c + x), c), jnp.zeros(h.shape[1:]), h)
      return self.out(hs)

  def loss(m, b):
    logits = m(b["x"])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1))

  model = nnx.eval_shape(lambda: Tagger(nnx.Rngs(0)))
  tok = jax.ShapeDtypeStruct((6, 3), jnp.int32)
  g = graph.trace(model, loss, {"x": tok, "y": tok}, depth=1)
  prof = costs.ProfiledCostModel(
    g, cache_dir=tmp_path, repeats=1, warmup=1, link=costs.Link(alpha_s=0, bandwidth_bytes_s=1)
  )
  assert len(prof.profile_all()) == len(g.nodes) == 2
  assert prof.measured == 2


def test_profiled_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="repeats"):
    costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, repeats=0)
  with pytest.raises(ValueError, match="branch_remat='some'"):
    costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, branch_remat="some")
  with pytest.raises(ValueError, match="warmup_s=-1"):
    costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, warmup_s=-1)
  with pytest.raises(ValueError, match="flush_bytes=-1"):
    costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, flush_bytes=-1)


def test_rematerialised_times_are_cached_apart(tmp_path, monkeypatch):
  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  seen = _record_time_node(monkeypatch, lambda args, kwargs: kwargs.get("policy"))
  plain = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=1, warmup=1, link=link)
  plain.profile_all()
  remat = costs.ProfiledCostModel(
    g, cache_dir=tmp_path, repeats=1, warmup=1, link=link, branch_remat="dots"
  )
  remat.profile_all()
  # The dots-policy model timed every node again, under its policy, and both sets are cached.
  assert remat.measured == len(g.nodes) and seen[:2] == [None, None]
  assert all(p is remat_lib.BRANCH_REMAT_POLICIES["dots"] for p in seen[2:])
  keys = set(json.loads(plain.cache_path.read_text())["nodes"])
  assert {g.node_fingerprint(n) + "|remat=dots" for n in g.nodes} <= keys
  assert {g.node_fingerprint(n) for n in g.nodes} <= keys


def test_task_profiles_measure_the_forward_share_for_planner_and_lockstep(tmp_path, monkeypatch):
  from jaxhybrid.planner.core import problem as problem_lib
  from jaxhybrid.program import lockstep

  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  fused = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=1, warmup=1, link=link)
  assert not hasattr(fused, "forward_time_s")  # the planner then assumes its FORWARD_SHARE
  # Deterministic wiring: a fake task timer (F, B) per node, no dispatch subtracted.
  fake = {n.name: (0.001 * (n.id + 1), 0.004 * (n.id + 1)) for n in g.nodes}
  monkeypatch.setattr(cost_model, "time_node_tasks", lambda graph, node, **kw: fake[node.name])
  monkeypatch.setattr(cost_model, "time_node_split", lambda graph, node, **kw: (0.0, 0.0))
  tasks = costs.ProfiledCostModel(
    g, cache_dir=tmp_path, repeats=1, warmup=1, link=link, subtract_dispatch=False, tasks=True
  )
  for n in g.nodes:
    f, b = fake[n.name]
    assert tasks.forward_time_s(n) == pytest.approx(f)
    assert tasks.node_time_s(n) == pytest.approx(f + b)
  fwd, bwd = lockstep.task_times(g, tasks)
  assert fwd == pytest.approx([fake[n.name][0] for n in g.nodes])
  assert bwd == pytest.approx([fake[n.name][1] for n in g.nodes])
  prob = problem_lib.Problem.from_graph(g, tasks, problem_lib.PlannerOptions(devices=2))
  assert prob.forward_s == pytest.approx(tuple(fake[n.name][0] for n in g.nodes))
  # Cached apart from the fused times, with both parts.
  entries = json.loads(tasks.cache_path.read_text())["nodes"]
  for n in g.nodes:
    e = entries[g.node_fingerprint(n) + "|tasks"]
    assert (e["forward_raw_s"], e["backward_raw_s"]) == fake[n.name]
    assert g.node_fingerprint(n) not in entries  # the fused model was never asked


def test_task_profiles_time_real_forward_and_backward(tmp_path):
  g = _mlp_graph()
  n = g.nodes[0]
  f, b = cost_model.time_node_tasks(g, n, warmup=1, repeats=1)
  assert f > 0 and b > 0
  prof = costs.ProfiledCostModel(
    g, cache_dir=tmp_path, repeats=1, warmup=1, link=costs.Link(alpha_s=0, bandwidth_bytes_s=1),
    tasks=True,
  )
  assert 0 <= prof.forward_time_s(n) <= prof.node_time_s(n)


def _lstm_graph():
  import toy

  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  _, p, s, pure = graph.nnx_pure_loss(model, toy.lstm_loss)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), toy.lstm_batch(4))
  return graph.trace_function(pure, p, s, batch)


def test_split_profiles_give_the_planner_and_lockstep_their_own_b_and_w(tmp_path, monkeypatch):
  """A split schedule's B and W come from their own timings (time_node_split), measured only
  when a split schedule may be planned, cached apart; B + W may exceed the backward."""
  from jaxhybrid.planner.core import problem as problem_lib
  from jaxhybrid.program import lockstep

  g = _lstm_graph()
  fp = g.node_fingerprint  # equal layers (l0, l1) share a fingerprint, hence their timings
  fake = {fp(n): (0.001 * (n.id + 1), 0.004 * (n.id + 1)) for n in g.nodes}
  split = {fp(n): (0.0015 * (n.id + 1), 0.003 * (n.id + 1)) for n in g.nodes}  # B+W 1.125 bwd
  calls = []
  monkeypatch.setattr(cost_model, "time_node_tasks", lambda graph, node, **kw: fake[fp(node)])
  monkeypatch.setattr(cost_model, "time_node_split",
                      lambda graph, node, **kw: calls.append(fp(node)) or split[fp(node)])
  prof = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=1, warmup=1, link=costs.Link(
    alpha_s=1e-6, bandwidth_bytes_s=1e9), subtract_dispatch=False, tasks=True)
  unsplit = problem_lib.Problem.from_graph(
    g, prof, problem_lib.PlannerOptions(devices=2, schedule_kinds=("1f1b",)))
  assert calls == [] and not unsplit.weight_grad_task_s
  prob = problem_lib.Problem.from_graph(g, prof, problem_lib.PlannerOptions(devices=2))
  assert sorted(calls) == sorted({fp(n) for n in g.nodes})  # each measured once
  for n in g.nodes:
    b, w = split[fp(n)]
    assert prob.task_s("B", n.id, True) == pytest.approx(b)
    assert prob.task_s("W", n.id, True) == pytest.approx(w)
    assert prob.task_s("B", n.id, False) == pytest.approx(fake[fp(n)][1])  # unsplit: as before
  b_in, w = lockstep.split_task_times(g, prof)
  assert b_in == pytest.approx([split[fp(n)][0] for n in g.nodes])
  assert w == pytest.approx([split[fp(n)][1] for n in g.nodes])
  entries = json.loads(prof.cache_path.read_text())["nodes"]
  e = entries[fp(g.nodes[1]) + "|split"]
  assert (e["input_grad_raw_s"], e["weight_grad_raw_s"]) == split[fp(g.nodes[1])]
  # A sub-problem keeps each node's own W.
  sub = prob.subproblem([1, 2])
  assert sub.weight_grad_s(0) == pytest.approx(split[fp(g.nodes[1])][1])


def test_split_timing_runs_the_pullback_halves_and_analytic_w_of_a_loop():
  g = _lstm_graph()
  cell = next(n for n in g.nodes if cost_model.has_loop(n.eqns))
  dense = [n for n in g.nodes if not cost_model.has_loop(n.eqns)]
  assert dense
  b, w = cost_model.time_node_split(g, cell, warmup=1, repeats=1)
  assert b > 0 and w > 0
  hw = _toy_hardware()
  analytic = costs.AnalyticCostModel(hw)
  bwd = analytic.node_time_s(cell) - analytic.forward_time_s(cell)
  assert analytic.input_grad_time_s(cell) == pytest.approx(0.5 * bwd)
  assert analytic.weight_grad_time_s(cell) == pytest.approx(cost_model.RECURRENT_W_SHARE * bwd)
  for n in dense:
    bwd = analytic.node_time_s(n) - analytic.forward_time_s(n)
    assert analytic.input_grad_time_s(n) + analytic.weight_grad_time_s(n) == pytest.approx(bwd)


# ---- calibration and prediction vs measurement -----------------------------------------------


def test_predict_vs_measure(tmp_path):
  model = MLP(rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (32, 16))
  _, params, state, pure = graph.nnx_pure_loss(model, _mlp_loss)
  g = graph.trace(model, _mlp_loss, x, depth=1)
  analytic = costs.AnalyticCostModel(_toy_hardware())
  cmp = calibrate.predict_vs_measure(g, analytic, pure, params, state, x, warmup=1, repeats=3)
  assert cmp.predicted_s == pytest.approx(analytic.step_time_s(g))
  assert cmp.measured_s > 0
  assert cmp.relative_error == pytest.approx((cmp.predicted_s - cmp.measured_s) / cmp.measured_s)
  assert cmp.source == "analytic" and cmp.backend == jax.default_backend()
  assert "error" in str(cmp)


def test_time_table_lists_every_node():
  g = _mlp_graph()
  table = costs.time_table(g, costs.AnalyticCostModel("dgx1-v100"))
  assert "l1" in table and "l2" in table and "single-device step" in table


def test_profiles_with_flushed_caches_are_kept_apart(tmp_path, monkeypatch):
  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  seen = _record_time_node(monkeypatch, lambda args, kwargs: (args[1].name, kwargs["flush_bytes"]))
  warm = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=1, warmup=1, link=link)
  cold = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=1, warmup=1, link=link, flush_bytes=1 << 20)
  warm.profile_all()
  cold.profile_all()  # the back-to-back times in the cache are not taken for flushed ones
  assert seen == [("l1", 0), ("l2", 0), ("l1", 1 << 20), ("l2", 1 << 20)]
  keys = set(json.loads(warm.cache_path.read_text())["nodes"])
  assert keys == {g.node_fingerprint(n) + suffix for n in g.nodes for suffix in ("", "|flush=1048576")}


def test_profiled_min_time_is_validated_and_cached_apart(tmp_path, monkeypatch):
  g = _mlp_graph()
  link = costs.Link(alpha_s=1e-6, bandwidth_bytes_s=1e9)
  with pytest.raises(ValueError, match="min_time_s"):
    costs.ProfiledCostModel(g, cache_dir=tmp_path, link=link, min_time_s=-1.0)
  seen = _record_time_node(monkeypatch, lambda args, kwargs: kwargs["min_time_s"])
  costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=2, warmup=1, link=link).profile_all()
  timed = costs.ProfiledCostModel(g, cache_dir=tmp_path, repeats=2, warmup=1, link=link, min_time_s=0.01)
  timed.profile_all()
  # The longer timing is passed down and cached apart: both graphs' nodes were timed twice.
  assert seen == [0.0, 0.0, 0.01, 0.01] and timed.measured == 2
  keys = set(json.loads(timed.cache_path.read_text())["nodes"])
  assert {g.node_fingerprint(n) + "|min_time=0.01" for n in g.nodes} <= keys


def test_auto_flush_is_resolved_once_and_keys_the_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(cost_model, "cache_flush_bytes", lambda: 3 << 20)
  cm = costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, flush_bytes="auto")
  assert cm.flush_bytes == 3 << 20  # the CPU backend: sized from the host's caches
  assert cm._timing_key() == f"|flush={3 << 20}"
  with pytest.raises(ValueError, match="'auto'"):
    costs.ProfiledCostModel(_mlp_graph(), cache_dir=tmp_path, flush_bytes="cold")

