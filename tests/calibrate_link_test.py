"""The link calibration (`jaxhybrid.costs.calibrate`): timed ring ppermutes and the fit of a
latency and a bandwidth to them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxhybrid.costs import calibrate


def test_calibrate_link_on_two_devices():
  link = calibrate.calibrate_link(jax.devices()[:2], sizes=(2**10, 2**18), warmup=1, repeats=3)
  assert link.alpha_s >= 0 and 0 < link.bandwidth_bytes_s < float("inf")
  assert "ppermute" in link.source
  with pytest.raises(ValueError, match=">= 2 devices"):
    calibrate.calibrate_link(jax.devices()[:1])


def test_link_fit_weighs_every_size_by_its_relative_error():
  """`fit_link` recovers an exact line, and a large message 10 % slow moves the fitted latency
  by less than an unweighted fit moves it (the small messages pin it)."""
  sent = np.array(calibrate.DEFAULT_SIZES, np.float64)
  alpha, spb = 1e-3, 1 / 5e9
  exact = alpha + sent * spb
  got = calibrate.fit_link(sent, exact)
  assert got == pytest.approx((alpha, spb), rel=1e-9)
  slow = exact.copy()
  slow[-1] *= 1.10
  weighted = calibrate.fit_link(sent, slow)[0]
  plain = np.polyfit(sent, slow, 1)[1]
  assert abs(weighted - alpha) < abs(plain - alpha)
  assert abs(weighted / alpha - 1) < 0.05
