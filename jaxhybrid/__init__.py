"""jaxhybrid: hybrid data x model parallel training for JAX/Flax (after Pal et al. 2019).

The one-call API is `jaxhybrid.parallelize` (see `jaxhybrid.api`); the parts are the modules
`graph`, `costs`, `hardware`, `mesh`, `program`, `train`, `projection`, `stat_eff`, and the
packages `jaxhybrid.planner` and `jaxhybrid.models`.
"""

from __future__ import annotations

__version__ = "0.1.0"


def parallelize(*args, **kwargs):
  """Traces, places and compiles a hybrid DP x MP train step; see `jaxhybrid.api.parallelize`."""
  from jaxhybrid import api

  return api.parallelize(*args, **kwargs)
