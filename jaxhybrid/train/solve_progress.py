"""The planner's solve as a progress line: elapsed time, incumbent step time, bound and gap.

The planner reports after each phase (`PlannerOptions.progress`), last "done"; a background
thread redraws the line at a steady rate so the elapsed time moves while a long phase (CP-SAT,
the MILP) runs, and stops at "done".
On a terminal the line is rewritten in place (carriage return); otherwise a plain line is written
every `plain_every_s` seconds, and once more at the end.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import TextIO


def _ms(seconds: float) -> str:
  return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.4g} ms"


class SolveProgress:
  """A context manager whose instance is a `PlannerOptions.progress` callback.

  Args:
    stream: where the line goes (default: sys.stdout).
    interval_s: redraw period on a terminal, seconds.
    plain_every_s: period of the plain lines when `stream` is not a terminal, seconds.
  """

  def __init__(self, stream: TextIO | None = None, *, interval_s: float = 0.5,
               plain_every_s: float = 10.0):
    self._stream = stream or sys.stdout
    self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
    self._period = interval_s if self._tty else plain_every_s
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._t0 = time.monotonic()
    self.phase, self.incumbent_s, self.bound_s = "start", math.inf, 0.0
    self._width = 0

  def __call__(self, phase: str, incumbent_s: float, bound_s: float) -> None:
    """Records a phase's result (the planner calls this); the thread draws it."""
    with self._lock:
      self.phase = phase
      # "done": the plan's own step time (in lock step it may exceed the fused searches').
      self.incumbent_s = incumbent_s if phase == "done" else min(self.incumbent_s, incumbent_s)
      self.bound_s = bound_s
    if phase == "done":
      self._finish()  # the step is built and compiled after this; its time is not the solve's

  def line(self) -> str:
    """The current state as one line of text."""
    with self._lock:
      phase, inc, bound = self.phase, self.incumbent_s, self.bound_s
    gap = f"{(inc - bound) / inc:.1%}" if math.isfinite(inc) and inc > 0 else "-"
    return (f"solve {time.monotonic() - self._t0:5.1f}s  step {_ms(inc)}  bound {_ms(bound)}  "
            f"gap {gap}  [{phase}]")

  def _draw(self, final: bool = False) -> None:
    text = self.line()
    if self._tty:
      pad = max(0, self._width - len(text))
      self._width = len(text)
      self._stream.write("\r" + text + " " * pad + ("\n" if final else ""))
    else:
      self._stream.write(text + "\n")
    self._stream.flush()

  def _run(self) -> None:
    while not self._stop.wait(self._period):
      self._draw()

  def __enter__(self) -> SolveProgress:
    self._t0 = time.monotonic()
    self._thread = threading.Thread(target=self._run, name="solve-progress", daemon=True)
    self._thread.start()
    return self

  def _finish(self) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self.phase != "start":  # something was solved: its final state
      self._draw(final=True)

  def __exit__(self, *exc: object) -> None:
    self._finish()
