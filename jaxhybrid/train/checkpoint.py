"""Orbax checkpoints of a hybrid `TrainState`: every K steps, at the end, and restore for resume.

The parameters, optimizer state and model state (BatchNorm statistics) are saved as sharded
arrays (each process writes its shards; orbax coordinates the processes of a multi-host job); the
step number travels as JSON next to them. Orbax writes each checkpoint to a temporary folder and
renames it when complete, so a process killed mid-save leaves the previous checkpoints intact and
`latest_step` never names a partial one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxhybrid import errors
from jaxhybrid import program as program_lib

log = logging.getLogger(__name__)


def _abstract(tree: Any) -> Any:
  """Shape, dtype and sharding of every array leaf (the restore target)."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
    tree,
  )


class Checkpointer:
  """Saves and restores `TrainState`s in `directory/<step>/`.

  Example:
    ckpt = Checkpointer(workdir + "/checkpoints", every=100)
    if (step := ckpt.latest_step()) is not None:
      state = ckpt.restore(step, like=hybrid.init())
    ...
    ckpt.maybe_save(step, state)   # saves when step % every == 0
    ckpt.close()                   # waits for the last asynchronous save
  """

  def __init__(self, directory: str, *, every: int, max_to_keep: int | None = 3):
    """Opens (or creates) the checkpoint folder.

    Args:
      directory: the folder; created if missing.
      every: save every `every` steps in `maybe_save` (0: only when forced, e.g. at the end).
      max_to_keep: keep this many most recent checkpoints (None: all).

    Raises:
      ValueError: a negative `every`.
    """
    if every < 0:
      raise ValueError(f"checkpoint every={every}: use 0 (only at the end) or a positive step count")
    self.directory = os.path.abspath(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The most recent complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of all complete checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: program_lib.TrainState) -> None:
    """Saves `state` as the checkpoint of `step` (asynchronously; `wait` or `close` to finish)."""
    items = {"params": state.params, "opt_state": state.opt_state}
    if state.model_state:  # BatchNorm statistics and the like (`TrainState.model_state`)
      items["model_state"] = list(state.model_state)
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave({"step": int(step)})
      ),
      force=True,
    )
    log.info("checkpoint: saving step %d to %s", step, self.directory)

  def maybe_save(self, step: int, state: program_lib.TrainState, *, force: bool = False) -> bool:
    """Saves when `step` is a multiple of `every` (or `force`); returns whether it saved."""
    if force or (self.every and step % self.every == 0):
      if step not in self._manager.all_steps():
        self.save(step, state)
      return True
    return False

  def restore(self, step: int, like: program_lib.TrainState) -> program_lib.TrainState:
    """Restores the checkpoint of `step` onto the shardings of `like` (e.g. a fresh init).

    Raises:
      UsageError: the checkpoint does not fit `like` (e.g. saved under another plan's rows).
    """
    target = {"params": _abstract(like.params), "opt_state": _abstract(like.opt_state)}
    if like.model_state:
      target["model_state"] = _abstract(list(like.model_state))

    def restore(target_: dict[str, Any]) -> Any:
      return self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(target_), meta=ocp.args.JsonRestore()),
      )

    try:
      try:
        out = restore(target)
      except (ValueError, TypeError, KeyError):
        if "model_state" not in target:
          raise
        # A checkpoint saved without model state: parameters and optimizer state still resume.
        out = restore({k: v for k, v in target.items() if k != "model_state"})
        log.warning(
          "checkpoint step %d has no model state: BatchNorm statistics and the like restart from "
          "the model's initial values", step)
        out["state"]["model_state"] = list(like.model_state)
    except (ValueError, TypeError, KeyError) as e:
      # Typically the parameter rows of another plan (another placement gives rows of other
      # sizes). Nothing is written: the checkpoint stays as it is.
      what = " ".join(str(e).split())[:240] or type(e).__name__
      raise errors.UsageError(
        f"checkpoint step {step} in {self.directory} does not fit this program's state ({what}): "
        "resume with the plan and flags the run was made with (its workdir's plan.json) or start "
        "a new --workdir"
      ) from None
    items, meta = out["state"], out["meta"]
    log.info("checkpoint: restored step %d from %s", meta["step"], self.directory)
    return program_lib.TrainState(
      params=items["params"], opt_state=items["opt_state"],
      step=jnp.asarray(meta["step"], dtype=jnp.asarray(like.step).dtype),
      model_state=tuple(items.get("model_state", ())),
    )

  def wait(self) -> None:
    """Blocks until asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
