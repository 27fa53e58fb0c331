"""Tests for jaxhybrid.projection: formulas against hand-computed values and limiting cases."""

from __future__ import annotations

import json
import math

import pytest

from jaxhybrid import projection
from jaxhybrid.costs import hardware
from jaxhybrid.projection import paper_scenario, stat_eff

V100 = hardware.get("dgx1-v100")
A100 = hardware.get("dgx-a100")
EXACT = projection.CommConfig(link_efficiency=1.0, nic_efficiency=1.0)


def _workload(*, b=1, t=0.1, grad_bytes=0.0, b_noise=96.0, s_mp=1.5, se=None):
  return projection.Workload(
    name="toy",
    per_worker_batch=b,
    step_time=projection.MeasuredStepTime(points=((b, t),)),
    grad_bytes=grad_bytes,
    se=se or stat_eff.NoiseScaleSE(b_noise=b_noise),
    s_mp=((2, s_mp),),
    s_mp_source=((2, "user: test value"),),
  )


def test_intra_node_bus_bandwidth_on_cube_mesh():
  bus = projection.intra_node_bus_bandwidth
  assert bus(V100, tuple(range(8))) == 150e9  # 6 links x 25 GB/s
  assert bus(V100, (0, 2, 4, 6)) == 50e9  # GPU2 and GPU6 have 2 links inside the group
  assert bus(V100, (1, 3, 5, 7)) == 50e9
  assert bus(V100, (0, 3)) == 50e9  # two links
  assert bus(V100, (0, 5)) == 25e9  # no link: two-hop route
  assert bus(V100, (3,)) == math.inf
  assert bus(A100, tuple(range(8))) == 300e9


def test_allreduce_single_node_hand_computed():
  s = 1e9
  # DGX A100, 8 workers: 2 (W-1) alpha + 2 (W-1)/W * S / 300 GB/s.
  want = 2 * 7 * 5e-6 + 2 * 7 / 8 * s / 300e9
  assert projection.allreduce_time(s, 8, A100, EXACT) == pytest.approx(want, rel=1e-12)
  # DGX-1: 150 GB/s per GPU over the whole cube-mesh.
  want = 2 * 7 * 5e-6 + 2 * 7 / 8 * s / 150e9
  assert projection.allreduce_time(s, 8, V100, EXACT) == pytest.approx(want, rel=1e-12)
  # Hybrid M=2 on one DGX-1: W=4 rings of S/2 bytes over {0,2,4,6} / {1,3,5,7} at 50 GB/s.
  want = 2 * 3 * 5e-6 + 2 * 3 / 4 * (s / 2) / 50e9
  got = projection.allreduce_time(s / 2, 8, V100, EXACT, devices_per_worker=2)
  assert got == pytest.approx(want, rel=1e-12)
  # Efficiency scales bandwidth only.
  half = projection.CommConfig(link_efficiency=0.5)
  want = 2 * 7 * 5e-6 + 2 * 7 / 8 * s / 75e9
  assert projection.allreduce_time(s, 8, V100, half) == pytest.approx(want, rel=1e-12)
  assert projection.allreduce_time(s, 1, V100, EXACT) == 0.0


def test_allreduce_two_nodes_ring_and_hierarchical():
  s = 1e9
  ring = projection.CommConfig(link_efficiency=1.0, nic_efficiency=1.0, algorithm="ring")
  hier = projection.CommConfig(link_efficiency=1.0, nic_efficiency=1.0, algorithm="hierarchical")
  # Flat ring of 16 over two DGX-1s: the NIC (4 x 100 Gb/s = 50 GB/s) is the bottleneck.
  want_ring = 2 * 15 * 10e-6 + 2 * 15 / 16 * s / 50e9
  assert projection.allreduce_time(s, 16, V100, ring) == pytest.approx(want_ring, rel=1e-12)
  # Hierarchical: reduce-scatter + all-gather over 8 in the node, all-reduce between 2 nodes.
  want_hier = 2 * (7 * 5e-6 + 7 / 8 * s / 150e9) + 2 * 1 * 10e-6 + 2 * 1 / 2 * s / 50e9
  assert projection.allreduce_time(s, 16, V100, hier) == pytest.approx(want_hier, rel=1e-12)
  auto = projection.allreduce_time(s, 16, V100, EXACT)
  assert auto == pytest.approx(min(want_ring, want_hier), rel=1e-12)
  # Hybrid M=2 over 4 nodes: 2 concurrent rings of S/2 share the NICs: 2(n-1)/n * S/2 * 2 / NIC.
  want = 2 * (3 * 5e-6 + 3 / 4 * (s / 2) / 50e9) + 2 * 3 * 10e-6 + 2 * 3 / 4 * s / 50e9
  got = projection.allreduce_time(s / 2, 32, V100, hier, devices_per_worker=2)
  assert got == pytest.approx(want, rel=1e-12)


def test_speedup_hand_computed():
  w = _workload(b=10, t=0.1, grad_bytes=1e9, b_noise=100.0)
  t_ar = 2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / 300e9
  se = (100 + 10) / (100 + 80)
  want = 8 * 0.1 / (0.1 + t_ar) * se
  assert projection.speedup(w, 8, 1, A100, EXACT) == pytest.approx(want, rel=1e-12)
  # Hybrid, M=2: 4 workers, T_comp / 1.5, 2 rings of 0.5 GB at 300 GB/s (switched).
  t_ar = 2 * 3 * 5e-6 + 2 * 3 / 4 * 0.5e9 / 300e9
  se = (100 + 10) / (100 + 40)
  want = 4 * 0.1 / (0.1 / 1.5 + t_ar) * se
  assert projection.speedup(w, 8, 2, A100, EXACT) == pytest.approx(want, rel=1e-12)
  # Half the all-reduce hidden behind the backward pass.
  w1 = _workload(b=10, t=0.1, grad_bytes=1e9, se=stat_eff.PerfectScaling())
  comm = projection.CommConfig(link_efficiency=1.0, nic_efficiency=1.0, overlap=0.5)
  t_ar = 2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / 300e9
  assert projection.step_time(w1, 8, 1, A100, comm) == pytest.approx(0.1 + 0.5 * t_ar)


@pytest.mark.parametrize("n", [2, 8, 16, 64, 256])
def test_hybrid_is_s_mp_times_dp_of_workers_without_communication(n):
  w = _workload(b=4, t=0.2, grad_bytes=0.0, b_noise=300.0, s_mp=1.37)
  s_hyb = projection.speedup(w, n, 2, V100, EXACT)
  s_dp = projection.speedup(w, n // 2, 1, V100, EXACT)
  assert s_hyb == pytest.approx(1.37 * s_dp, rel=1e-12)


def test_crossover_exact_on_constructed_case():
  # No communication, b=1, S_MP=1.5, B_noise=96: S_hyb >= S_DP  <=>  N b (S_MP - 1) >=
  # B_noise (M - S_MP)  <=>  N >= 96.
  w = _workload(b=1, grad_bytes=0.0, b_noise=96.0, s_mp=1.5)
  grid = [8, 16, 32, 64, 128, 256]
  assert projection.crossover(w, 2, A100, EXACT, grid) == 96
  assert projection.crossover(w, 2, A100, EXACT, grid, refine=False) == 128
  assert projection.speedup(w, 94, 2, A100, EXACT) < projection.speedup(w, 94, 1, A100, EXACT)
  assert projection.crossover(w, 2, A100, EXACT, [8, 16, 32]) is None


def test_gain_tends_to_s_mp_minus_one_once_dp_saturates():
  w = _workload(b=1, grad_bytes=0.0, b_noise=100.0, s_mp=1.32)
  grid = [2**k for k in range(1, 21)]
  p = projection.project(w, A100, EXACT, grid, m=2)
  assert p.gain_at_scale == pytest.approx(0.32, abs=1e-3)
  # With real gradients but the all-reduce fully overlapped, the limit is the same.
  w = _workload(b=1, grad_bytes=1e8, b_noise=100.0, s_mp=1.32)
  hidden = projection.CommConfig(overlap=1.0)
  gain = projection.project(w, A100, hidden, grid, m=2).gain_at_scale
  assert gain == pytest.approx(0.32, abs=1e-3)
  # At small N, DP wins (the hybrid has half the workers).
  assert p.s_hyb[0] < p.s_dp[0]


def test_best_factorisation():
  w = _workload(b=1, grad_bytes=0.0, b_noise=100.0, s_mp=1.32)
  n_w, m, s = projection.best_factorisation(w, 8, A100, EXACT)
  assert (n_w, m) == (8, 1) and s == pytest.approx(projection.speedup(w, 8, 1, A100, EXACT))
  n_w, m, _ = projection.best_factorisation(w, 4096, A100, EXACT)
  assert (n_w, m) == (2048, 2)


def test_layout_errors():
  w = _workload()
  with pytest.raises(ValueError, match="multiple"):
    projection.step_time(w, 9, 2, V100, EXACT)
  with pytest.raises(ValueError, match="exceeds"):
    projection.allreduce_time(1.0, 32, V100, EXACT, devices_per_worker=16)
  with pytest.raises(ValueError, match="M=4"):
    w.speedup_mp(4)
  with pytest.raises(ValueError, match="overlap"):
    projection.CommConfig(overlap=1.5)


def test_flop_and_measured_step_time():
  f = projection.FlopStepTime(train_flops_per_sample=2e9, achieved_flops=1e12, overhead_s=0.01)
  assert f(64) == pytest.approx(64 * 2e9 / 1e12 + 0.01)
  m = projection.MeasuredStepTime(points=((16, 0.1), (64, 0.4)))
  assert m(32) == pytest.approx(0.2)  # linear in log-log with slope 1
  assert m(128) == pytest.approx(0.8)  # end segment extended


def test_paper_workloads_and_projection_json(tmp_path):
  w = paper_scenario.paper_workload(
    "inception_v3", V100, s_mp=[paper_scenario.paper_s_mp("inception_v3")])
  assert w.per_worker_batch == 64 and w.speedup_mp(2) == 1.32
  assert w.s_mp_source_of(2).startswith("paper: ")
  # 3 x 11.42 GFLOP per image x 64 at 15.7 TFLOP/s x 0.5.
  assert w.step_time(64) == pytest.approx(64 * 3 * 2 * 5.71e9 / (15.7e12 * 0.5))
  w2 = paper_scenario.paper_workload("gnmt", V100, s_mp_2=1.5, step_time_s=0.25, b_noise=1000)
  assert w2.speedup_mp(2) == 1.5 and w2.step_time(128) == 0.25
  assert w2.se.b_noise == 1000
  assert w2.s_mp_source_of(2).startswith("user: ")
  with pytest.raises(ValueError, match="biglstm"):
    paper_scenario.paper_workload("resnet", V100, s_mp_2=1.1)
  p = projection.project(w, V100, projection.CommConfig(), [8, 16, 32, 64], m=2)
  d = json.loads(json.dumps(p.to_json()))
  for key in ("crossover_devices", "gain_at_scale", "s_mp", "s_dp", "s_hyb", "assumptions"):
    assert key in d
  assert "se_curve" in d["assumptions"] and "overlap" in d["assumptions"]
  assert len(d["time_to_accuracy_dp_h"]) == 4
  assert "crossover" in projection.format_table(p)
  projection.plot([p], str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 1000


def test_s_mp_from_json(tmp_path):
  plan = tmp_path / "plan.json"
  plan.write_text(json.dumps({"schema": 1, "predicted_speedup": 1.41, "nodes": []}))
  assert projection.s_mp_from_json(str(plan)) == 1.41
  bench = tmp_path / "bench.json"
  bench.write_text(
    json.dumps(
      {
        "results": [
          {"model": "gnmt", "devices": 2, "predicted_speedup": 1.1},
          {"model": "biglstm", "devices": 2, "predicted_speedup": 1.6},
          {"model": "biglstm", "devices": 4, "predicted_speedup": 2.1},
          {"model": "biglstm", "devices": 2, "microbatches": 4, "predicted_speedup": 1.7},
        ]
      }
    )
  )
  assert projection.s_mp_from_json(str(bench), "biglstm", 2) == 1.7  # best micro-batch count
  assert projection.s_mp_from_json(str(bench), "gnmt", 2) == 1.1
  with pytest.raises(ValueError, match="entries"):
    projection.s_mp_from_json(str(bench), "biglstm")
