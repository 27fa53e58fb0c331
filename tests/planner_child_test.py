"""The solver's child process (planner/solvers/child.py): a crash or a hang in a solve ends the
child, the solve is retried once in a fresh child, then answered by its fallback; results and
errors come back as they would in-process."""

import logging
import os
import signal
import time

import pytest

from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.search import heuristics
from jaxhybrid.planner.solvers import child, milp


def _fallback(*args, **kwargs):
  return "fallback"


@child.isolated(_fallback)
def _crash_unless_marked(marker: str, time_limit_s: float = 1.0):
  """Dies by SIGSEGV the first time (no marker file yet), answers its pid the second."""
  if not os.path.exists(marker):
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGSEGV)
  return os.getpid()


@child.isolated(_fallback)
def _always_crash(time_limit_s: float = 1.0):
  os.write(2, b"native solver says goodbye\n")
  os.abort()


@child.isolated(_fallback)
def _hang(time_limit_s: float = 0.0):
  time.sleep(60)


@child.isolated(_fallback)
def _raise(time_limit_s: float = 1.0):
  raise ValueError("bad input, said the solver")


def test_a_solve_runs_in_the_child_and_matches_inline(monkeypatch):
  prob = Problem.build([1.0, 3.0, 2.0, 2.0, 1.0], [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)],
                       devices=2, edge_bytes=[0, 0, 0, 0, 0])
  warm = heuristics.single(prob, 2, None)
  kw = dict(warm=warm, time_limit_s=600.0, max_nodes=200, gap=0.0)  # the node limit stops it
  got = milp.solve(prob, 2, **kw)
  assert child._worker is not None and child._worker.pid != os.getpid()
  monkeypatch.setenv(child.INLINE_ENV, "1")
  want = milp.solve(prob, 2, **kw)
  assert got.status == want.status
  assert got.candidate.makespan == pytest.approx(want.candidate.makespan, rel=1e-12)
  assert got.candidate.assignment == want.candidate.assignment
  assert got.bound == pytest.approx(want.bound, rel=1e-12)


def test_a_crash_is_retried_in_a_fresh_child(tmp_path, caplog):
  with caplog.at_level(logging.WARNING, logger=child.__name__):
    pid = _crash_unless_marked(str(tmp_path / "marker"))
  assert pid != os.getpid()
  assert "(signal " in caplog.text and "fresh process" in caplog.text


def test_a_crash_twice_gives_the_fallback(caplog):
  with caplog.at_level(logging.DEBUG, logger=child.__name__):
    assert _always_crash() == "fallback"
  assert caplog.text.count("(signal 6)") == 1 + child.CRASH_RETRIES
  assert "keeping the heuristics' result" in caplog.text
  assert "native solver says goodbye" in caplog.text  # its stderr, kept for debugging


def test_a_hung_solve_is_killed(monkeypatch, caplog):
  monkeypatch.setattr(child, "TIMEOUT_SLACK_S", 0.5)
  monkeypatch.setattr(child, "CRASH_RETRIES", 0)
  with caplog.at_level(logging.WARNING, logger=child.__name__):
    assert _hang() == "fallback"
  assert "no answer within" in caplog.text and "(killed)" in caplog.text


def test_an_error_in_the_solve_is_raised_here():
  with pytest.raises(ValueError, match="bad input, said the solver"):
    _raise()


@child.isolated(_fallback)
def _pid(time_limit_s: float = 1.0):
  return os.getpid()


def test_without_a_worker_the_solve_runs_here(monkeypatch, tmp_path, caplog):
  assert _pid() != os.getpid()  # normally in the worker
  monkeypatch.setattr(child, "_worker", None)
  monkeypatch.setattr(child.sys, "executable", str(tmp_path / "no-such-python"))
  with caplog.at_level(logging.WARNING, logger=child.__name__):
    assert _pid() == os.getpid()
  assert "cannot start a solver process" in caplog.text
