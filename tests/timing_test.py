"""jaxhybrid.costs.timing.median_time_s: warm-up, flushed caches and min_time_s (a fake clock
where a count of calls is asserted)."""

from __future__ import annotations

import time

import jax.numpy as jnp


def test_timing_warms_up_for_warmup_s_after_the_first_call():
  from jaxhybrid.costs import timing

  ends = []  # (start, end) of every call

  def fn():
    t0 = time.perf_counter()
    time.sleep(0.002)
    ends.append((t0, time.perf_counter()))
    return jnp.zeros(())

  timing.median_time_s(fn, warmup=2, repeats=3)
  assert len(ends) == 5  # no warmup_s: exactly warmup + repeats calls
  ends.clear()
  timing.median_time_s(fn, warmup=2, repeats=3, warmup_s=0.05)
  first_timed = ends[-3][0]
  # The untimed calls after the first (which may compile) took at least warmup_s.
  assert len(ends) >= 2 + 3 and first_timed - ends[0][1] >= 0.05


def test_flushing_between_timed_runs_writes_one_buffer_in_place():
  from jaxhybrid.costs import timing

  calls = []
  t = timing.median_time_s(lambda: calls.append(1) or jnp.zeros(()), warmup=1, repeats=3, flush_bytes=1 << 16)
  assert t >= 0 and len(calls) == 4
  flush = timing._Flush.of(1 << 16)
  before = flush.buf.unsafe_buffer_pointer()
  flush()
  assert flush.buf.unsafe_buffer_pointer() == before and float(flush.buf[0]) == 5.0  # 4 calls + this one


def test_median_time_keeps_timing_until_min_time(monkeypatch):
  from jaxhybrid.costs import timing

  # A fake clock that moves only when `fn` runs (1/256 s a call, exact in binary), so the count
  # of timed calls does not depend on how busy the machine is.
  clock = {"t": 0.0}
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])
  calls = []

  def fn():
    calls.append(clock["t"])
    clock["t"] += 1 / 256

  # At least `repeats` timed calls, and more until they add up to min_time_s: 0.03 s needs
  # ceil(0.03 * 256) = 8 of them; warm-up calls are not counted.
  assert timing.median_time_s(fn, warmup=1, repeats=2, min_time_s=0.03) == 1 / 256
  assert len(calls) - 1 == 8
  calls.clear()
  timing.median_time_s(fn, warmup=1, repeats=3)
  assert len(calls) - 1 == 3
  calls.clear()
  monkeypatch.setattr(timing, "MAX_REPEATS", 5)
  timing.median_time_s(fn, warmup=1, repeats=2, min_time_s=100.0)
  assert len(calls) - 1 == 5


def test_cache_flush_bytes_is_a_multiple_of_the_largest_cache(tmp_path):
  from jaxhybrid.costs import timing

  for cpu, index, size in [(0, 0, "48K"), (0, 2, "2048K"), (0, 3, "32M"), (1, 3, "16384K")]:
    d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    (d / "size").write_text(size + "\n")
  assert timing.cache_flush_bytes(sysfs=str(tmp_path)) == int(1.5 * (32 << 20))
  assert timing.cache_flush_bytes(factor=2.0, sysfs=str(tmp_path)) == 64 << 20
  # No readable description: the named fallback.
  assert timing.cache_flush_bytes(sysfs=str(tmp_path / "absent")) == timing.FLUSH_FALLBACK_BYTES

