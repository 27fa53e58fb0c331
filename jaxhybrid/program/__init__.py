"""Step 4 of the flow: a plan run as ONE jitted SPMD train step on a `(data, model)` mesh.

Owns the hybrid program (`hybrid`: shard_map, per-group `lax.switch` on the model index,
micro-batches, gradient all-reduce over 'data', optax inside), its static structure from a plan
(`structure`: parameter layout; `tasks`: slots, groups, buffers, lanes, messages), the memory
it predicts (`memory`, with `group_bytes`: the bytes each group keeps, and `update_temp`: the
step's tail measured), the tasks run
in each group (`executor`), the gradient windows and flat gradient buffers (`gradients`),
parameter rows owned per device (`param_rows`), the batch shapes a step accepts (`batch_shapes`),
the lock-step price of a plan as the program runs it (`lockstep`; what a group costs
beyond its tasks and link time, measured: `group_cost`), whether a plan beats one
device as the program runs them (`plan_check`), the re-plans that hold a program to its memory
cap (`fit`), and the one-core-per-device CPU cluster used to time it (`localcluster`).

May import: `jaxhybrid.graph`, `jaxhybrid.costs`, `jaxhybrid.mesh`, `jaxhybrid.noise_scale`.
Knows nothing of the planner's search (it reads a plan's assignment and schedule) or training.
"""

from jaxhybrid.program.hybrid import CHECK_VMA, HybridProgram
from jaxhybrid.program.structure import DEFAULT_PACK_MAX_BYTES, TrainState

__all__ = ["CHECK_VMA", "DEFAULT_PACK_MAX_BYTES", "HybridProgram", "TrainState"]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
