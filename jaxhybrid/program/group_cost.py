"""What one lock-step group costs beyond its tasks and its messages' link time, measured.

Each group of the program (`program.tasks`) is a `lax.switch` on the model index followed by its
`ppermute`s, which every model-axis device enters together. Besides the tasks' work and the
link's time (`costs.calibrate.calibrate_link`: one `ppermute` per jitted call), a group pays for
the two devices meeting: on this project's VM (two one-core processes, gloo over localhost) a
chain of 16-wide layers placed so that its hybrid program runs 6, 15, 34 and 78 groups per step
took 3.9, 11.9, 30.1 and 78.0 ms, about 0.9 ms a group, where its messages priced at the
calibrated link (0.13 ms latency) came to 0.1 ms a group. Pricing groups at the link alone
left GNMT's and Inception-V3's plans 6-29 % slower than priced, most for the plans with the most
groups (bench_mp).

`measure` times such tiny programs on the mesh it is given (every process of a multi-process
job must call it: the programs' collectives run in all of them), prices each with the same
lock-step model and link, and `fit` takes the per-group cost as the slope of (measured - priced)
over the group count (least squares; the intercept, the step's own fixed cost, is reported and
not priced: a one-device step pays it too). The programs' tasks are tiny (a 16 x 16 matmul per
node), so their price (`ZeroTaskCosts`) is zero and the intercept holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxhybrid import costs as costs_lib

# Chain layers, width and rows per micro-batch of the programs `measure` times; micro-batches.
LAYERS, WIDTH, ROWS, MICROBATCHES = 16, 16, 16, 4
# Placements of the chain's nodes on two devices: alternating blocks of n // b nodes for each b
# (2 blocks: two stages; len(nodes) blocks: every node on the other device from its neighbours).
BLOCKS = (2, 4, 8, 0)  # 0: one block per node


@dataclasses.dataclass(frozen=True)
class GroupCost:
  """Fitted per-group cost (s) and what it was fitted to."""

  group_s: float
  intercept_s: float
  # Per program: (groups, messages, measured median step s, priced step s).
  points: tuple[tuple[int, int, float, float], ...]

  def to_json(self) -> dict[str, Any]:
    return {"group_s": self.group_s, "intercept_s": self.intercept_s,
            "points": [list(p) for p in self.points]}


class ZeroTaskCosts(costs_lib.CostModel):
  """Node times 0, messages at the given link: what a group pays beyond its tasks and link time
  is then the measured step less this price."""

  def __init__(self, link: costs_lib.Link):
    self.link = link

  def node_time_s(self, node) -> float:
    return 0.0


def fit(points: Sequence[tuple[int, int, float, float]]) -> tuple[float, float]:
  """(per-group seconds, intercept seconds) of `measured - priced = intercept + group_s * groups`
  by least squares over `points` (groups, messages, measured, priced); the slope is clipped at
  0 (more groups never make a step faster).

  Raises:
    ValueError: fewer than two distinct group counts.
  """
  g = np.asarray([p[0] for p in points], np.float64)
  if len(set(g.tolist())) < 2:
    raise ValueError(f"fitting a per-group cost needs two distinct group counts, got {g.tolist()}")
  extra = np.asarray([p[2] - p[3] for p in points], np.float64)
  slope, intercept = np.polyfit(g, extra, 1)
  return max(float(slope), 0.0), float(intercept)


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
  blocks: Sequence[int] = BLOCKS,
  steps: int = 40,
  warmup: int = 5,
) -> GroupCost:
  """Times the tiny chain's hybrid program at each placement of `blocks` on `mesh` (1 x 2: data
  axis 1, model axis 2) and fits the per-group cost (module docstring).

  Raises:
    ValueError: a mesh whose model axis is not 2 devices, or fewer than two distinct group counts.
  """
  import time

  import jax
  import jax.numpy as jnp
  import optax

  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import hybrid, lockstep

  if mesh.shape.get(mesh_lib.MODEL) != 2 or mesh.shape.get(mesh_lib.DATA, 1) != 1:
    raise ValueError(f"group_cost.measure needs a 1x2 (data, model) mesh, got {dict(mesh.shape)}")
  keys = jax.random.split(jax.random.key(0), LAYERS)
  params = {f"layer{i:02d}": jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) / WIDTH**0.5
            for i, k in enumerate(keys)}
  batch = {"x": jnp.ones((ROWS * MICROBATCHES, WIDTH), jnp.float32)}

  def loss(p, state, b):
    del state
    h = b["x"]
    for name in sorted(p):
      with jax.named_scope(name):
        h = jnp.tanh(h @ p[name])
    return jnp.mean(h**2)

  spec = {"x": jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)}
  g = graph_lib.trace_function(loss, params, {}, spec)
  priced_costs = ZeroTaskCosts(link)
  opt = optax.sgd(1e-3)
  points = []
  for assign in _placements(len(g.nodes), blocks):
    prog = hybrid.HybridProgram.build(g, mesh, opt, assign, microbatches=MICROBATCHES,
                                      schedule="1f1b")
    step = prog.step_fn()
    state = prog.init_state(jax.tree.leaves(params))
    bt = prog.shard_batch(batch)
    for _ in range(warmup):
      state, _ = step(state, bt)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      state, m = step(state, bt)
      jax.block_until_ready((state, m))
      times.append(time.perf_counter() - t0)
    st = prog.structure
    price = lockstep.program_step_s(g, st, assign, priced_costs)
    points.append((len(st.groups), price.transfers, float(np.median(times)), price.step_s))
  group_s, intercept = fit(points)
  return GroupCost(group_s=group_s, intercept_s=intercept, points=tuple(points))
