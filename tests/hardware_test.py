"""Tests for jaxhybrid.costs.hardware: the DGX-1 cube-mesh, the registry and the measured CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxhybrid.costs import hardware

_GPU_NAMES = ("dgx1-v100", "dgx-a100", "dgx-h100", "dgx-h200")


def test_cube_mesh_is_symmetric_with_six_links_per_gpu():
  hw = hardware.get("dgx1-v100")
  bw = np.array(hw.link_bandwidth)
  assert bw.shape == (8, 8)
  np.testing.assert_array_equal(bw, bw.T)
  np.testing.assert_array_equal(np.diag(bw), 0)
  np.testing.assert_allclose(bw.sum(axis=1), 6 * 25e9)
  links = np.array(hardware.DGX1_V100_NVLINKS)
  # 24 links in all; every GPU has 4 NVLink neighbours, 2 of them doubled, and 3 non-neighbours.
  assert links.sum() == 48
  assert ((links == 2).sum(axis=1) == 2).all()
  assert ((links == 0).sum(axis=1) == 4).all()  # 3 others + itself
  # The quads 0-3 and 4-7 are fully connected; the cube edges join i and i+4.
  for quad in (range(4), range(4, 8)):
    for i in quad:
      for j in quad:
        assert i == j or links[i, j] > 0
  for i in range(4):
    assert links[i, i + 4] > 0


def test_bandwidth_direct_and_two_hop():
  hw = hardware.get("dgx1-v100")
  assert hw.bandwidth(0, 3) == 50e9  # two links
  assert hw.bandwidth(0, 1) == 25e9  # one link
  # GPU0-GPU5 have no link: best 2-hop route (e.g. via GPU1: 25 then 50 GB/s) -> 25 GB/s.
  assert hw.link_bandwidth[0][5] == 0
  assert hw.bandwidth(0, 5) == 25e9
  assert hw.alpha(0, 5) == 2 * hw.alpha(0, 1)
  assert hw.alpha(2, 2) == 0.0
  assert hw.bandwidth(4, 4) == hw.mem_bandwidth
  for i in range(8):
    for j in range(8):
      assert hw.bandwidth(i, j) > 0
      assert hw.bandwidth(i, j) == hw.bandwidth(j, i)


def test_bandwidth_rejects_bad_device():
  hw = hardware.get("dgx1-v100")
  with pytest.raises(ValueError, match="out of range"):
    hw.bandwidth(0, 8)


@pytest.mark.parametrize("name", _GPU_NAMES)
def test_gpu_specs_are_sane(name):
  hw = hardware.get(name)
  assert hw.name == name
  assert hw.devices_per_node == 8
  assert hw.peak_flops > 1e13 and hw.mem_bandwidth > 5e11 and hw.memory_bytes >= 16 * 2**30
  assert hw.nic_bandwidth > 0 and hw.nic_alpha_s > 0 and hw.link_alpha_s > 0
  assert 0 < hw.efficiency <= 1
  assert hw.source
  bw = np.array(hw.link_bandwidth)
  np.testing.assert_array_equal(bw, bw.T)


def test_switched_nodes_are_uniform():
  for name in ("dgx-a100", "dgx-h100", "dgx-h200"):
    hw = hardware.get(name)
    assert hw.switched
    off_diag = {hw.bandwidth(i, j) for i in range(8) for j in range(8) if i != j}
    assert len(off_diag) == 1
  assert hardware.get("dgx-a100").bandwidth(0, 7) == 300e9
  assert hardware.get("dgx-h100").bandwidth(0, 7) == 450e9


def test_paper_interconnect_numbers():
  hw = hardware.get("dgx1-v100")
  assert hw.nic_bandwidth == 50e9  # 4 x 100 Gb/s
  assert hw.peak_flops == 15.7e12 and hw.peak_flops_dtype == "float32"


def test_get_unknown_name_lists_names():
  assert set(hardware.names()) == {*_GPU_NAMES, "cpu"}
  with pytest.raises(ValueError, match="dgx1-v100"):
    hardware.get("tpu-v9")


def test_bad_matrix_is_rejected():
  hw = hardware.get("dgx-a100")
  with pytest.raises(ValueError, match="4x4"):
    dataclasses.replace(hw, devices_per_node=4)


def test_measure_cpu_is_cached_and_positive():
  hw = hardware.get("cpu")
  assert hw is hardware.get("cpu")
  assert hw.peak_flops > 1e8 and hw.mem_bandwidth > 1e8 and hw.op_overhead_s > 0
  assert hw.devices_per_node >= 1 and hw.efficiency == 1.0
  assert all(hw.bandwidth(0, j) > 0 for j in range(hw.devices_per_node))
  assert "measured" in hw.source
