"""Typed errors of the training runner: bad user input that the entry points report in one line.

`experiments/run.py` turns a `UsageError` into one line on stderr and exit status 2 (absl's and
argparse's convention for bad command-line input), with no traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
  """Bad user input: the message names the bad value and how to fix it, on one line."""

  def __init__(self, message: str):
    # One line: the entry point prints the message as is.
    super().__init__(" ".join(str(message).split()))


class NonFiniteLossError(UsageError):
  """The loss became NaN or infinite; training stopped and the last good checkpoint was kept."""

  def __init__(self, message: str, *, step: int, last_checkpoint: int | None):
    super().__init__(message)
    # The step whose loss was not finite.
    self.step = step
    # The last checkpointed step (None: no checkpoint was written).
    self.last_checkpoint = last_checkpoint


class DoesNotFitError(UsageError):
  """No plan fits the devices' memory (the planner's static check or its solve was infeasible)."""
