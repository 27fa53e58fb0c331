"""The MILP solves run in a child process, so that a crash inside CBC ends the child, not the job.

CBC (python-mip's default solver, C++ behind cffi) has crashed under this planner's time limits:
SIGSEGV in `CbcHeuristicDive` and SIGABRT in `CglPreProcess::postProcess`, each time after the
solve had run for a while, and only on some runs of the same input (the point where the clock
stops the search differs). A signal in the solver would kill the whole program, user's job
included, with a native backtrace and no Python error. So each decorated `solve` (milp, fbw_milp,
relax, lockstep_bound) is sent, pickled, to one long-lived worker process (started on the first
solve, one per process, `python -c` importing only the planner), which runs it and sends the
result back. The worker imports nothing of JAX; a solve's extra cost is pickling its problem
(a millisecond or so) and, once per process, the worker's start (about a second).

When the worker dies during a solve, the solve is retried once in a fresh worker
(`CRASH_RETRIES`); when it dies again, or runs past its time limit by far (`timeout_s`), the solve
returns its `fallback`: a result with no solution and the trivial bound, which every caller
already handles (the heuristics' plan is kept). A warning names what happened.

`JAXHYBRID_SOLVE_INLINE=1` in the environment runs solves in the calling process (for debugging
with pdb or a profiler); so does a platform without `select` on pipes (Windows). A process forked
after a solve starts its own worker rather than share its parent's pipes.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import logging
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

# Set to "1" to solve in the calling process.
INLINE_ENV = "JAXHYBRID_SOLVE_INLINE"
# Fresh workers tried after the first one died during a solve, before the fallback result.
CRASH_RETRIES = 1
# A solve's result is awaited for TIMEOUT_FACTOR x its time limit + TIMEOUT_SLACK_S (the limit
# is CBC's own; this only catches a solver that ignores it), then the worker is killed.
TIMEOUT_FACTOR = 3.0
TIMEOUT_SLACK_S = 120.0

_BOOT = ("import sys, pickle; sys.path[:] = pickle.load(sys.stdin.buffer); "
         "from jaxhybrid.planner.solvers import child; child.serve()")

_in_worker = False
_lock = threading.Lock()
_worker: subprocess.Popen | None = None
_worker_owner = 0  # the pid that started _worker


class WorkerDied(RuntimeError):
  """The worker process ended (or was killed) before it answered."""


class NoWorker(RuntimeError):
  """No worker process could be started (the solve then runs in the caller)."""


def serve() -> None:
  """The worker's loop: reads (module, name, args, kwargs), answers ('ok', value) or
  ('error', exception) until its input closes. Native output (CBC's) goes to stderr so that
  stdout carries only answers."""
  global _in_worker
  _in_worker = True
  answers = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  requests = sys.stdin.buffer
  while True:
    try:
      module, name, args, kwargs = pickle.load(requests)
    except EOFError:
      return
    try:
      value = ("ok", getattr(importlib.import_module(module), name)(*args, **kwargs))
    except Exception as err:  # sent back and raised in the caller
      value = ("error", err)
    try:
      data = pickle.dumps(value)
    except Exception as err:
      data = pickle.dumps(("error", RuntimeError(f"{module}.{name}: {value[0]} value does not "
                                                 f"pickle ({err})")))
    answers.write(data)
    answers.flush()


def _start() -> subprocess.Popen:
  # The worker's stderr (a native backtrace when CBC dies) goes to a file, read back into the
  # warning's debug record, not onto the user's terminal.
  errors = tempfile.TemporaryFile()
  proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=errors)
  proc.errors = errors
  pickle.dump([p for p in sys.path if isinstance(p, str)], proc.stdin)
  proc.stdin.flush()
  return proc


def _stderr_tail(proc: subprocess.Popen, chars: int = 2000) -> str:
  """The end of a worker's stderr file."""
  try:
    err = proc.errors
    err.seek(max(0, err.seek(0, os.SEEK_END) - chars))
    return err.read().decode(errors="replace")
  except (AttributeError, OSError, ValueError):
    return ""


def _stop(proc: subprocess.Popen | None, kill: bool = False) -> None:
  if proc is None:
    return
  try:
    if kill:
      proc.kill()
    else:
      proc.stdin.close()
    proc.wait(timeout=5)
  except (OSError, subprocess.TimeoutExpired):
    proc.kill()


@atexit.register
def _close() -> None:
  global _worker
  if _worker_owner == os.getpid():
    _stop(_worker)
  _worker = None


def _ask(module: str, name: str, args: tuple, kwargs: dict, timeout_s: float) -> Any:
  """One request to the worker (started if needed); raises WorkerDied when it ends or times out
  (it is then discarded)."""
  global _worker, _worker_owner
  if _worker is None or _worker_owner != os.getpid() or _worker.poll() is not None:
    try:
      _worker, _worker_owner = _start(), os.getpid()
    except (OSError, ValueError) as err:
      _worker = None
      raise NoWorker(f"cannot start a solver process ({err})") from err
  proc = _worker
  try:
    pickle.dump((module, name, args, kwargs), proc.stdin)
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
      _stop(proc, kill=True)
      _worker = None
      raise WorkerDied(f"no answer within {timeout_s:.0f} s (killed)")
    kind, value = pickle.load(proc.stdout)
  except (EOFError, BrokenPipeError, pickle.UnpicklingError, OSError) as err:
    code = proc.wait()
    _worker = None
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    log.debug("the solver process's last output:\n%s", _stderr_tail(proc))
    raise WorkerDied(f"the solver process ended ({how})") from err
  if kind == "error":
    raise value
  return value


def isolated(fallback: Callable[..., Any]) -> Callable[[Callable], Callable]:
  """Decorates a module-level solve: it runs in the worker (see the module docstring).
  `fallback(*args, **kwargs)` (same signature) gives the result of a solve whose worker died."""

  def wrap(fn: Callable) -> Callable:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if _in_worker or os.environ.get(INLINE_ENV) == "1" or os.name == "nt":
        return fn(*args, **kwargs)
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      limit = bound.arguments.get("time_limit_s") or 0.0
      timeout_s = TIMEOUT_FACTOR * float(limit) + TIMEOUT_SLACK_S
      for attempt in range(CRASH_RETRIES + 1):
        try:
          with _lock:
            return _ask(fn.__module__, fn.__name__, args, kwargs, timeout_s)
        except NoWorker as err:
          log.warning("%s; solving in this process", err)
          return fn(*args, **kwargs)
        except WorkerDied as err:
          last = err
          log.warning("%s.%s: %s%s", fn.__module__, fn.__name__, err,
                      "; solving again in a fresh process" if attempt < CRASH_RETRIES else
                      "; keeping the heuristics' result for this solve")
      del last
      return fallback(*args, **kwargs)

    return call

  return wrap
