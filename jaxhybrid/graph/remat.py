"""Rematerialisation policies for replaying a node's equations (`branch_remat`).

Shared by the program (what a conditional branch saves for its backward), the profiled cost model
(node times measured under the same policy) and the lock-step model (residual bytes).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxhybrid.graph import convs

# `jax.checkpoint` policies for a group's conditional branches (`HybridProgram.build`'s
# branch_remat). JAX differentiates `lax.switch` by making every branch return the residuals of
# all branches, so each device writes zeros for the other devices' saved activations: saving less
# trades that zero-filling (and memory) for recomputation. 'dots' keeps matmul and convolution
# outputs (the canonical CPU convolutions are custom VJPs, recognised by their checkpoint name).
# Not in the paper (its devices run their own programs).
BRANCH_REMAT_POLICIES: dict[str, Any] = {
  "none": None,
  "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(convs.CONV_NAME),
  ),
  "full": jax.checkpoint_policies.nothing_saveable,
}


def remat_policy(name: str) -> Any:
  """The `jax.checkpoint` policy of a `branch_remat` name (None for 'none': nothing rematerialised).

  Raises:
    ValueError: for an unknown name.
  """
  if name not in BRANCH_REMAT_POLICIES:
    raise ValueError(
      f"branch_remat={name!r} is unknown: use one of {', '.join(BRANCH_REMAT_POLICIES)}"
    )
  return BRANCH_REMAT_POLICIES[name]
