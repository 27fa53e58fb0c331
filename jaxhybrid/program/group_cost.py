"""What a lock-step group and a task cost beyond the tasks' profiled times and the link, measured.

Each group of the program (`program.tasks`) is a `lax.switch` on the model index followed by its
`ppermute`s, which every model-axis device enters together; inside the branch each task reads
its inputs from the group buffers and writes its outputs into them. Besides the tasks' work as
profiled (each node's F and B compiled alone) and the link's time (`costs.calibrate
.calibrate_link`: one `ppermute` per jitted call), a group pays for the devices meeting and a
task for its place in the branch. On this project's VM (two one-core processes, gloo over
localhost) a chain of 16-wide layers whose program ran 6, 17, 32 and 62 groups per step took
about 0.8-1.2 ms a group beyond its messages' link time (0.13 ms each); uniform-chain plans
whose nodes were cut in three (column pieces and their concatenation, the same placement and
groups) ran 21 % slower than the whole-node plan where the profiles priced them equal.

`measure` times tiny hybrid programs on the mesh it is given (every process of a multi-process
job must call it: the programs' collectives run in all of them): chains of `LAYER_COUNTS`
layers, each at the placements of `BLOCKS`, so that the group count and the task count vary
apart. Each is priced with the lock-step model and the link, its tasks at 0 (`ZeroTaskCosts`:
a 16 x 16 matmul per node), and `fit` solves

  measured - priced = intercept + group_s * groups + task_fixed_s * tasks

by robust least squares (a Cauchy loss, `FIT_SCALE_S`; `scipy.optimize.least_squares`), where
`tasks` is the count the price adds `task_fixed_s` for: per group, the busiest device's number
of tasks, summed over groups. A negative slope is set to 0 and the rest refitted (more groups or
tasks never make a step faster). The intercept, the step's own fixed cost, is reported and not
priced. Why robust: on a fresh VM of this project's kind the 190-group program (the longest
chain, every node on the other device from its neighbours) ran 2.1 ms a group beyond its price
while the seven others ran 0.4-1.0 ms; plain least squares, led by that one far point, priced
2.1 ms a group with a -43 ms intercept, and the uniform chain's three plans (10-28 groups) were
priced 22-65 % above their measured steps. The Cauchy fit gave 0.91 ms there (the same plans
re-priced: 3-32 % above), and 0.54 ms (plain: 0.53 ms) on the machine where the eight points
lay on a line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import optimize

from jaxhybrid import costs as costs_lib

# Assumption, named here: residuals (s) beyond about this size pull the fit less and less (the
# Cauchy loss's scale): about two groups' cost, so one program far off the others' line (a
# slow episode, or a cost that grows faster than linearly with the program's size) cannot set
# the slope for all.
FIT_SCALE_S = 0.002
# Width and rows per micro-batch of the chains `measure` times; micro-batches; chain lengths.
WIDTH, ROWS, MICROBATCHES = 16, 16, 4
LAYER_COUNTS = (16, 48)
# Placements of a chain's nodes on two devices: alternating blocks of n // b nodes for each b
# (2 blocks: two stages; 0: one block per node, every node on the other device from its
# neighbours).
BLOCKS = (2, 4, 8, 0)


@dataclasses.dataclass(frozen=True)
class GroupCost:
  """Fitted per-group and per-task costs (s) and what they were fitted to."""

  group_s: float
  task_fixed_s: float
  intercept_s: float
  # Per program: (groups, messages, busiest-device tasks summed over groups, measured median
  # step s, priced step s).
  points: tuple[tuple[int, int, int, float, float], ...]

  def to_json(self) -> dict[str, Any]:
    return {"group_s": self.group_s, "task_fixed_s": self.task_fixed_s,
            "intercept_s": self.intercept_s, "points": [list(p) for p in self.points]}


class ZeroTaskCosts(costs_lib.CostModel):
  """Node times 0, messages at the given link: what a group pays beyond its tasks and link time
  is then the measured step less this price."""

  def __init__(self, link: costs_lib.Link):
    self.link = link

  def node_time_s(self, node) -> float:
    return 0.0


def fit(points: Sequence[tuple[int, int, int, float, float]]) -> tuple[float, float, float]:
  """(group_s, task_fixed_s, intercept_s) of `measured - priced = intercept + group_s * groups +
  task_fixed_s * tasks` by robust least squares (Cauchy loss of scale `FIT_SCALE_S`) over
  `points` (groups, messages, tasks, measured, priced); a negative slope is set to 0 and the
  others refitted.

  Raises:
    ValueError: fewer than two distinct group counts.
  """
  pts = np.asarray([(p[0], p[2], p[3] - p[4]) for p in points], np.float64)
  if len(set(pts[:, 0].tolist())) < 2:
    raise ValueError(f"fitting a per-group cost needs two distinct group counts, got "
                     f"{pts[:, 0].tolist()}")
  free = [0, 1]  # columns of (groups, tasks) still fitted
  while True:
    a = np.column_stack([np.ones(len(pts))] + [pts[:, c] for c in free])
    # Started from the median cost per group (the Cauchy loss is not convex: started from the
    # plain least-squares line, it stays by the far point that line follows).
    start = np.zeros(len(free) + 1)
    if 0 in free:
      start[1 + free.index(0)] = max(float(np.median(pts[:, 2] / np.maximum(pts[:, 0], 1))), 0.0)
    coef = optimize.least_squares(lambda x: a @ x - pts[:, 2], start, loss="cauchy",
                                  f_scale=FIT_SCALE_S).x
    slopes = dict(zip(free, coef[1:]))
    bad = [c for c in free if slopes[c] < 0]
    if not bad:
      break
    free.remove(min(bad, key=lambda c: slopes[c]))
  return float(slopes.get(0, 0.0)), float(slopes.get(1, 0.0)), float(coef[0])


def _placements(nodes: int, blocks: Sequence[int]) -> list[list[int]]:
  out = []
  for b in blocks:
    b = nodes if b <= 0 else min(b, nodes)
    out.append([(b * i // nodes) % 2 for i in range(nodes)])
  return out


def measure(
  mesh: Any,
  link: costs_lib.Link,
  *,
  layer_counts: Sequence[int] = LAYER_COUNTS,
  blocks: Sequence[int] = BLOCKS,
  steps: int = 40,
  warmup: int = 5,
) -> GroupCost:
  """Times a tiny chain's hybrid program for each chain length of `layer_counts` at each
  placement of `blocks` on `mesh` (1 x 2: data axis 1, model axis 2) and fits the per-group and
  per-task costs (module docstring).

  Raises:
    ValueError: a mesh whose model axis is not 2 devices, or fewer than two distinct group counts.
  """
  import jax

  from jaxhybrid import mesh as mesh_lib

  if mesh.shape.get(mesh_lib.MODEL) != 2 or mesh.shape.get(mesh_lib.DATA, 1) != 1:
    raise ValueError(f"group_cost.measure needs a 1x2 (data, model) mesh, got {dict(mesh.shape)}")
  points = []
  for layers in layer_counts:
    g, params, batch = _chain(layers)
    for assign in _placements(len(g.nodes), blocks):
      points.append(_time_program(mesh, link, g, jax.tree.leaves(params), batch, assign, steps,
                                  warmup))
  group_s, task_fixed_s, intercept = fit(points)
  return GroupCost(group_s=group_s, task_fixed_s=task_fixed_s, intercept_s=intercept,
                   points=tuple(points))


def _chain(layers: int) -> tuple[Any, dict, dict]:
  """The op graph of a chain of `layers` WIDTH-wide tanh layers (one node each), its parameters
  and a batch of MICROBATCHES micro-batches of ROWS rows."""
  import jax
  import jax.numpy as jnp

  from jaxhybrid import graph as graph_lib

  keys = jax.random.split(jax.random.key(0), layers)
  params = {f"layer{i:03d}": jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) / WIDTH**0.5
            for i, k in enumerate(keys)}

  def loss(p, state, b):
    del state
    h = b["x"]
    for name in sorted(p):
      with jax.named_scope(name):
        h = jnp.tanh(h @ p[name])
    return jnp.mean(h**2)

  spec = {"x": jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)}
  g = graph_lib.trace_function(loss, params, {}, spec, depth=1, max_nodes=None)
  return g, params, {"x": jnp.ones((ROWS * MICROBATCHES, WIDTH), jnp.float32)}


def _time_program(mesh, link, g, leaves, batch, assign, steps, warmup):
  """(groups, messages, tasks, measured median step, priced step) of one program."""
  import optax

  from jaxhybrid.program import hybrid, lockstep

  prog = hybrid.HybridProgram.build(g, mesh, optax.sgd(1e-3), assign, microbatches=MICROBATCHES,
                                    schedule="1f1b")
  step = prog.step_fn()
  carry = {"state": prog.init_state(leaves)}
  bt = prog.shard_batch(batch)

  def run():  # the state carried from call to call, as a training loop does
    carry["state"], m = step(carry["state"], bt)
    return carry["state"], m

  measured = costs_lib.median_time_s(run, warmup=warmup, repeats=steps)
  st = prog.structure
  price = lockstep.program_step_s(g, st, assign, ZeroTaskCosts(link))
  return (len(st.groups), price.transfers, lockstep.busiest_task_count(st), measured,
          price.step_s)
