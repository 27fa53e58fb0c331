"""jaxhybrid: hybrid data x model parallel training for JAX/Flax (after Pal et al. 2019).

The flow, one sub-package per step (each `__init__` says what it owns and may import):

  graph/       a Flax model's forward loss -> OpGraph (nodes, edges, FLOPs, bytes)
  costs/       node, transfer and all-reduce times on a hardware spec or measured
  planner      (installed from planner/) DLPlacer: OpGraph + costs -> Plan
  program/     Plan -> ONE jitted shard_map train step on a (data, model) mesh
  train/       the training loop, checkpoints, and the run behind experiments/run.py
  projection/  DP vs hybrid time-to-accuracy at scale, statistical efficiency

`api.parallelize` chains trace -> cost -> place -> compile in one call; `advisor` (and
`jaxhybrid.advise`) plans a model at scale and says where hybrid parallelism wins. Leaf modules shared by
several steps: `mesh` (the only place a mesh is made), `noise_scale` (gradient noise scale
estimators), `errors` (one-line user errors). `models` (installed from models/) holds the paper's
models and data and knows nothing of parallelism.

Sub-packages load on first use, so `import jaxhybrid` stays cheap and does not start a JAX
backend: `jaxhybrid.mesh.simulate_cpu_devices(8)` still works after it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the modules they load. `hardware` is a shortcut for `jaxhybrid.costs.hardware`.
_LAZY = {
  "advisor": "jaxhybrid.advisor",
  "api": "jaxhybrid.api",
  "costs": "jaxhybrid.costs",
  "errors": "jaxhybrid.errors",
  "graph": "jaxhybrid.graph",
  "hardware": "jaxhybrid.costs.hardware",
  "mesh": "jaxhybrid.mesh",
  "models": "jaxhybrid.models",
  "noise_scale": "jaxhybrid.noise_scale",
  "planner": "jaxhybrid.planner",
  "program": "jaxhybrid.program",
  "projection": "jaxhybrid.projection",
  "train": "jaxhybrid.train",
}

__all__ = ["advise", "parallelize", *sorted(_LAZY)]


def advise(*args, **kwargs):
  """Where hybrid parallelism wins for a Flax module; see `jaxhybrid.advisor.advise`."""
  from jaxhybrid import advisor

  return advisor.advise(*args, **kwargs)


def parallelize(*args, **kwargs):
  """Traces, places and compiles a hybrid DP x MP train step; see `jaxhybrid.api.parallelize`."""
  from jaxhybrid import api

  return api.parallelize(*args, **kwargs)


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    module = importlib.import_module(_LAZY[name])
    globals()[name] = module
    return module
  raise AttributeError(f"module 'jaxhybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))
