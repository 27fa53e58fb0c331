"""The main job's input checks that need no devices: its flags, and the model config's own checks
(`models/config_checks.py`) with the --set overrides applied, before anything is traced."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxhybrid import errors

OPTIMIZERS = ("adam", "sgd", "adagrad")


def validate(config: Any) -> None:
  """Checks the flags that need no model or devices.

  Raises:
    UsageError: naming the bad value and the fix.
  """
  from jaxhybrid import api, models
  from jaxhybrid.costs import hardware

  if config.model not in models.names():
    raise errors.UsageError(f"--model={config.model!r} is unknown: use one of {', '.join(models.names())}")
  if config.size is not None and config.size not in models.SIZES:
    raise errors.UsageError(f"--size={config.size!r} is unknown: use one of {', '.join(models.SIZES)}")
  if config.planner not in api.PLANNERS:
    raise errors.UsageError(f"--planner={config.planner!r} is unknown: use one of {', '.join(api.PLANNERS)}")
  if config.hardware is not None and config.hardware not in hardware.names():
    raise errors.UsageError(
      f"--hardware={config.hardware!r} is unknown: use one of {', '.join(hardware.names())}")
  from jaxhybrid.planner.core import task_schedule

  if config.schedule not in task_schedule.KINDS + ("auto",):
    raise errors.UsageError(
      f"--schedule={config.schedule!r} is unknown: use one of "
      f"{', '.join(task_schedule.KINDS + ('auto',))}")
  if config.optimizer is not None and config.optimizer not in OPTIMIZERS:
    raise errors.UsageError(f"--optimizer={config.optimizer!r} is unknown: use one of {', '.join(OPTIMIZERS)}")
  if config.clip_norm < 0:
    raise errors.UsageError(f"--clip_norm={config.clip_norm}: use a positive norm, or 0 for no clipping")
  if config.microbatches < 1:
    raise errors.UsageError(
      f"--microbatches={config.microbatches}: must be positive (micro-batches per worker batch)")
  if config.batch is not None and config.batch < 1:
    raise errors.UsageError(f"--batch={config.batch}: must be positive (examples per worker)")
  if config.batch is not None and config.batch % config.microbatches:
    raise errors.UsageError(
      f"--batch={config.batch} (per worker) is not divisible by --microbatches={config.microbatches}: "
      f"use a multiple of {config.microbatches}, e.g. --batch={config.microbatches * max(1, config.batch // config.microbatches)}")
  if config.zero not in (0, 1, 2):
    raise errors.UsageError(f"--zero={config.zero}: use 0 (optimizer state on every data replica), "
                            "1 (sharded over the data replicas) or 2 (gradients too)")
  if config.steps < 1:
    raise errors.UsageError(f"--steps={config.steps}: must be positive (training steps)")
  if config.checkpoint_every < 0:
    raise errors.UsageError(f"--checkpoint_every={config.checkpoint_every}: use 0 (only at the end) or more")
  if not config.time_limit_s > 0:
    raise errors.UsageError(f"--time_limit={config.time_limit_s}: use a positive number of seconds")
  cap = getattr(config, "memory_cap_gib", None)
  if cap is not None and not (math.isfinite(cap) and cap > 0):
    raise errors.UsageError(f"--memory_cap_gib={cap}: use a positive number of GiB per device "
                            "(or leave it out: the hardware's memory)")
  lr = config.learning_rate
  if lr is not None and not (math.isfinite(lr) and lr > 0):
    raise errors.UsageError(f"--learning_rate={config.learning_rate}: use a positive number")
  # The model config's own checks (models/config_checks.py), before tracing. Before the size is
  # resolved (tiny on a CPU, paper on a GPU) a --set value is refused only if neither preset
  # takes it (num_sampled=1000 is too many for the tiny vocabulary, fine at paper size);
  # run() validates again once the size is known.
  if config.size:
    model_spec(config)
    return
  try:
    model_spec(dataclasses.replace(config, size="tiny"))
  except errors.UsageError:
    model_spec(dataclasses.replace(config, size="paper"))


def model_spec(config: Any):
  """The registry entry of --model/--size with the --set overrides applied.

  Raises:
    UsageError: an unknown field or a value its config does not allow, naming the --set item.
  """
  from jaxhybrid import models

  try:
    return models.get(config.model, config.size, **dict(config.overrides))
  except (ValueError, TypeError) as e:
    if any(str(e).startswith(f"{key}=") for key, _ in config.overrides):
      raise errors.UsageError(f"--set {e}") from None
    raise errors.UsageError(f"--model/--size/--set: {e}") from None
