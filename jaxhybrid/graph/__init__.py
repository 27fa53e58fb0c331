"""Step 1 of the flow: a Flax model's forward loss as an op graph with costs.

Owns tracing (`jax.make_jaxpr` on abstract inputs, `opgraph`), coarsening equations into
module-level nodes (`coarsen`), per-equation FLOPs and bytes (`eqn_costs`), the Flax linen/NNX adapters
(`flax_adapters`), how a node's equations are replayed: remat policies (`remat`) and CPU
convolutions in canonical layout (`convs`), and shard options: large leaves split into one
piece per model device (`shard`, its jaxpr rules in `shard_rules`) and nodes split by rows of
the micro-batch (`batch_split`, its test of which equations keep examples apart in
`batch_rules`).

May import: jax, flax, numpy, and nothing else of jaxhybrid.
"""

from jaxhybrid.graph.coarsen import DEFAULT_MAX_NODES, ROOT
from jaxhybrid.graph.eqn_costs import EqnCost, aval_bytes, eqn_cost
from jaxhybrid.graph.flax_adapters import is_linen_module, is_nnx_module, nnx_pure_loss
from jaxhybrid.graph.opgraph import (
  BATCH,
  PARAM,
  STATE,
  Edge,
  Node,
  OpGraph,
  trace,
  trace_function,
)

__all__ = [
  "BATCH", "DEFAULT_MAX_NODES", "PARAM", "ROOT", "STATE", "Edge", "EqnCost", "Node", "OpGraph", "aval_bytes",
  "eqn_cost", "is_linen_module", "is_nnx_module", "nnx_pure_loss", "trace", "trace_function",
]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
