"""Evaluating a jaxpr equation by equation with some equations replaced.

`jax.core.eval_jaxpr` binds every equation as written; the program sometimes needs to evaluate
a node's jaxpr with a few equations done differently (convolutions in the canonical layout,
`convs.eval_jaxpr`; a looked-up table's row gathers read under stop_gradient,
`jaxhybrid.program.lookups`). Both walk the jaxpr here and say only what they replace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.extend as jex

# rule(eqn, input values) -> the equation's outputs (a list), or None to bind it as written.
Rule = Callable[[Any, list[Any]], "list[Any] | None"]


def eval_jaxpr_with(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rule: Rule) -> list[Any]:
  """`jaxpr` (an open jaxpr) evaluated on `consts` and `args` as `jax.core.eval_jaxpr` does,
  except each equation for which `rule` returns outputs."""
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex.core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    vals = [read(v) for v in eqn.invars]
    outs = rule(eqn, vals)
    if outs is None:
      with eqn.ctx.manager:
        ans = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
      outs = ans if eqn.primitive.multiple_results else [ans]
    for v, o in zip(eqn.outvars, outs):
      if not isinstance(v, jex.core.DropVar):
        env[v] = o
  return [read(v) for v in jaxpr.outvars]
