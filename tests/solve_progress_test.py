"""The solve's progress: the planner reports each phase to `PlannerOptions.progress`, and
`SolveProgress` draws elapsed time, incumbent, bound and gap (in place on a terminal, plain
lines otherwise).
"""

from __future__ import annotations

import io
import math

from planner_test import FAST, _random_problem

from jaxhybrid import planner
from jaxhybrid.train import solve_progress


def test_the_planner_reports_each_phase_with_a_bound_below_the_incumbent():
  calls = []
  prob = _random_problem(3, 6)
  opts = planner.PlannerOptions(devices=prob.devices, microbatches=2,
                                progress=lambda *a: calls.append(a), **FAST)
  plan = planner.place_problem(prob, opts)
  phases = [c[0] for c in calls]
  assert phases[0] == "bounds" and math.isinf(calls[0][1])
  assert "search" in phases and phases[-2:] == ["milp", "done"], phases
  for phase, incumbent, bound in calls[1:]:
    assert 0 < bound <= incumbent + 1e-9, (phase, incumbent, bound)
  assert calls[-1][1] == plan.predicted_step_s
  # The callback does not enter the options' equality (plans and caches compare options).
  assert opts == planner.PlannerOptions(devices=prob.devices, microbatches=2, **FAST)


def test_lockstep_objective_reports_the_lockstep_step_last():
  calls = []
  prob = _random_problem(4, 5)
  fast = {**FAST, "objective": "lockstep", "lockstep_evaluations": 50, "lockstep_patience": 20}
  plan = planner.place_problem(prob, planner.PlannerOptions(
    devices=prob.devices, microbatches=2, progress=lambda *a: calls.append(a), **fast))
  assert calls[-1][0] == "done"
  assert calls[-1][1] == plan.lockstep_step_s and calls[-1][2] == plan.lockstep_bound_s


def test_plain_stream_gets_whole_lines_and_a_final_state():
  out = io.StringIO()
  with solve_progress.SolveProgress(out, plain_every_s=3600.0) as progress:
    progress("search", 0.004, 0.003)
  lines = out.getvalue().splitlines()
  assert len(lines) == 1 and "\r" not in out.getvalue()
  assert "step 4 ms" in lines[0] and "bound 3 ms" in lines[0] and "gap 25.0%" in lines[0]
  assert "[search]" in lines[0]


class _Tty(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_terminal_line_is_rewritten_in_place():
  out = _Tty()
  progress = solve_progress.SolveProgress(out)
  progress("bounds", math.inf, 0.002)
  progress._draw()
  progress("cpsat", 0.005, 0.004)
  progress._draw(final=True)
  text = out.getvalue()
  assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
  assert "step - " in text and "gap -" in text and "gap 20.0%" in text


def test_done_draws_the_final_line_once_and_stops():
  out = io.StringIO()
  with solve_progress.SolveProgress(out, plain_every_s=3600.0) as progress:
    progress("done", 0.002, 0.002)
    assert out.getvalue().count("\n") == 1 and "[done]" in out.getvalue()
  assert out.getvalue().count("\n") == 1


def test_nothing_is_drawn_when_nothing_was_solved():
  out = io.StringIO()
  with solve_progress.SolveProgress(out, plain_every_s=3600.0):
    pass
  assert out.getvalue() == ""
