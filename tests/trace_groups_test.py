"""experiments/bench/trace_groups.py: cutting a traced timeline into lock-step groups (no JAX run)."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import experiment_module


@pytest.fixture(scope="module")
def tg():
  return experiment_module("trace_groups")


def _x(name, ts_us, dur_us, tid=7):
  return {"ph": "X", "name": name, "ts": ts_us, "dur": dur_us, "tid": tid, "pid": 1}


def test_timeline_keeps_outermost_events_of_the_executing_thread(tmp_path, tg):
  events = [
    _x("conditional.3", 0, 100), _x("dot.1", 10, 50),  # inside the conditional: dropped
    _x("ppermute.2", 120, 30), _x("end: ppermute.2", 150, 0),
    _x("conditional.4", 200, 40), _x("ppermute.9", 210, 5),  # nested in a conditional: dropped
    _x("all-reduce.1", 300, 10),
    _x("ppermute.1", 0, 1000, tid=8),  # another thread with fewer ppermutes
    _x(tg.STEP_EVENT, 500, 400, tid=9), _x(tg.STEP_EVENT, 0, 400, tid=9),
  ]
  folder = tmp_path / "trace" / "plugins" / "profile" / "run"
  folder.mkdir(parents=True)
  with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  got, windows = tg._timeline(tmp_path / "trace")
  assert [k for k, _, _ in got] == ["conditional", "ppermute", "conditional", "all-reduce"]
  assert got[1][1:] == pytest.approx((120e-6, 150e-6))
  assert [t for w in windows for t in w] == pytest.approx([0.0, 400e-6, 500e-6, 900e-6])


def test_groups_split_busy_and_ppermute_time_per_step(tg):
  # Two steps of three groups with 2, 0 and 1 messages; seconds. Group 0: busy 1.0 from the
  # step's start, ppermutes 0.2 + 0.1; group 1 (no message) counts to group 2: busy 0.5, then
  # ppermute 0.3; then 0.4 to the step's end.
  def step(t, conds=True):
    evs = [("conditional", t, t + 0.8), ("ppermute", t + 1.0, t + 1.2), ("ppermute", t + 1.2, t + 1.3),
           ("conditional", t + 1.35, t + 1.4), ("conditional", t + 1.4, t + 1.6),
           ("ppermute", t + 1.8, t + 2.1), ("all-reduce", t + 2.2, t + 2.3)]
    return evs if conds else [e for e in evs if e[0] != "conditional"]
  windows = [(0.0, 2.5), (3.0, 5.5)]
  # Cut at the conditionals, and (none traced) at the messages by count: the same figures.
  for timeline in (step(0.0) + step(3.0), step(0.0, False) + step(3.0, False)):
    got, tail, pp, step_s = tg._measured_groups(timeline, windows, [2, 0, 1])
    assert got[0]["busy_s"] == pytest.approx(1.0) and got[0]["ppermute_s"] == pytest.approx(0.3)
    assert got[1] == {"busy_s": 0.0, "ppermute_s": 0.0}
    assert got[2]["busy_s"] == pytest.approx(0.5) and got[2]["ppermute_s"] == pytest.approx(0.3)
    assert tail == pytest.approx(0.4) and pp == pytest.approx(0.6) and step_s == pytest.approx(2.5)
  # Neither count matches the program's: no groups, the step's ppermute time still.
  got, tail, pp, step_s = tg._measured_groups(step(0.0, False) + step(3.0, False), windows, [2, 2])
  assert got is None and pp == pytest.approx(0.6) and step_s == pytest.approx(2.5)
  # A step whose first events the trace lost (only its last message) is left out of the averages.
  lost = step(0.0)[-2:] + step(3.0)
  got, tail, pp, step_s = tg._measured_groups(lost, [(0.0, 2.5), (3.0, 6.5)], [2, 0, 1])
  assert got[0]["busy_s"] == pytest.approx(1.0) and got[2]["ppermute_s"] == pytest.approx(0.3)
  assert tail == pytest.approx(1.4) and pp == pytest.approx(0.6) and step_s == pytest.approx(3.5)
  with pytest.raises(RuntimeError, match="no .* events in the trace"):
    tg._measured_groups(step(0.0), [], [2, 0, 1])


def test_step_windows_start_where_the_calling_thread_ran_the_step_itself(tg):
  # Step 1 ran on a worker thread (tid 7) while the caller (tid 9) waited for it: the wait is
  # the window. Step 2 ran on the calling thread's executor before a ~0 s wait: the window
  # starts at that execution (its nested execution, a branch, does not start a step).
  by_thread = {
    7: [_x(tg.EXECUTE_EVENT, 120, 300), _x("ppermute.1", 200, 10),
        _x(tg.EXECUTE_EVENT, 1000, 500), _x(tg.EXECUTE_EVENT, 1100, 50), _x("ppermute.1", 1200, 10)],
    9: [_x(tg.STEP_EVENT, 100, 400, tid=9), _x(tg.STEP_EVENT, 1500, 0.2, tid=9)],
  }
  windows = tg._step_windows(by_thread, 7)
  assert [t for w in windows for t in w] == pytest.approx([100e-6, 500e-6, 1000e-6, 1500.2e-6])
