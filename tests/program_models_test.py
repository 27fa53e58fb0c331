"""Each tiny paper model, placed by the MILP and by a heuristic, equals the single-device reference.

The reference trains on the same global batch with plain `jax.grad`; its loss is the mean over
the (worker, micro-batch) chunks the hybrid program sees, which equals the full-batch mean for
every model except through BatchNorm's batch statistics (Inception), where it is the exact
counterpart of what the hybrid program computes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DETERMINISTIC_PLANNER, subprocess_env

from jaxhybrid import api, models
from jaxhybrid import graph as graph_lib
from jaxhybrid import mesh as mesh_lib

STEPS = 3
PER_CHUNK = 2  # examples per micro-batch


# Tiny Inception's BatchNorm normalises 8 values per channel on small maps; with the default
# epsilon (1e-3) a near-constant channel divides by ~0.03 and the loss surface is so curved that
# float32 rounding explodes step to step. Measured (4x2 mesh, k=1, SGD 1e-5, epsilon 0.1): the
# hybrid program and the reference differ by 1e-12 after step 1, 1e-9 after step 2 and 8e-6 in a
# stem kernel after step 3; two plain-JAX references that differ only in summation order drift
# apart the same way (2.4e-5 at SGD 1e-4). With epsilon 1.0 the same case at SGD 1e-2 ends with
# every parameter within 1.2e-10 of the reference after 3 steps while the largest update is
# 2.4e-3, so the comparison tests the program, not the conditioning.
_OVERRIDES = {"inception_v3": {"bn_epsilon": 1.0}}
INCEPTION_LR = 1e-2


@functools.lru_cache(maxsize=None)
def _model(name, extra=()):
  spec = models.get(name, "tiny", **_OVERRIDES.get(name, {}), **dict(extra))
  return spec, spec.init(0)  # one compiled init (eager Inception init compiles per layer)


def chunked_reference(pure, params, state, batch, per_example, chunks, opt, steps=STEPS):
  leaves, treedef = jax.tree.flatten(batch)

  def loss(p, s, b):
    # One traced copy of the model, scanned over the chunks (an unrolled loop compiled one copy
    # per chunk: 8 GNMTs on a 4x2 mesh with k=2). Same summation order: ((0 + l0) + l1) + ...
    ls = jax.tree.leaves(b)
    split = [x.reshape((chunks, -1) + x.shape[1:]) for x, pe in zip(ls, per_example) if pe]

    def add(total, xs):
      it = iter(xs)
      part = [next(it) if pe else x for x, pe in zip(ls, per_example)]
      return total + pure(p, s, jax.tree.unflatten(treedef, part)), None

    total, _ = jax.lax.scan(add, jnp.zeros((), jnp.float32), split)
    return total / chunks

  @jax.jit
  def step(p, o, s, b):
    l, g = jax.value_and_grad(loss)(p, s, b)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o, l

  o = opt.init(params)
  losses = []
  for _ in range(steps):
    params, o, l = step(params, o, state, batch)
    losses.append(float(l))
  return losses, [np.asarray(x) for x in jax.tree.leaves(params)]


def check(name, mesh_spec, k, planner, max_nodes=None, schedule="1f1b", overrides=()):
  spec, model = _model(name, tuple(overrides))
  shape = mesh_lib.parse(mesh_spec)
  # BatchNorm over a handful of values is ill-conditioned (float rounding grows step to step),
  # so Inception gets bigger micro-batches and plain SGD.
  per_chunk = 8 if name == "inception_v3" else PER_CHUNK
  batch = spec.synthetic_batch(0, per_chunk * shape.data * k)
  opt = optax.sgd(INCEPTION_LR) if name == "inception_v3" else optax.adam(1e-3)
  hy = api.parallelize(
    model, spec.loss_fn, opt, batch, mesh=mesh_spec, microbatches=k, planner=planner,
    planner_options=DETERMINISTIC_PLANNER, max_nodes=max_nodes,
    program_options={"schedule": schedule},
  )
  if shape.model > 1 and (k > 1 or name == "inception_v3" or overrides):
    # Pipelined stacks and branchy blocks gain from 2 devices (a chain at k=1 does not). The
    # equivalence is of the 2-way program: a plan priced slower than one device, which
    # `parallelize` replaces by one device, is given back (a given plan is kept); a plan on one
    # device (the planner's choice for the coarsened Inception-V3 tiny) is split in two halves.
    plan = hy.check.planned if hy.check is not None and hy.check.fell_back else hy.plan
    if len(set(plan.assignment)) == 1:
      n = len(plan.assignment)
      plan = dataclasses.replace(
        plan, assignment=tuple(int(i >= n // 2) for i in range(n)), task_schedule=schedule)
    if plan is not hy.plan:
      hy = api.parallelize(
        model, spec.loss_fn, opt, batch, mesh=mesh_spec, microbatches=k, plan=plan,
        max_nodes=max_nodes,
      )
    assert len(set(hy.plan.assignment)) > 1, "the 2-way plan should use both devices"
  state = hy.init()
  losses = []
  for _ in range(STEPS):
    state, metrics = hy.step(state, batch)
    losses.append(float(metrics["loss"]))
  leaves = hy.program.unpack(state.params)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn, scopes=False)
  ref_losses, ref_leaves = chunked_reference(pure, p, s, batch, hy.program.per_example, shape.data * k, opt)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(leaves, ref_leaves):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
  # Not vacuous: training moved some parameter far beyond the tolerance.
  moved = max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in zip(ref_leaves, jax.tree.leaves(p)))
  assert moved > 100 * 2e-6, moved


# Sequence models: every mesh, MILP and heuristic plans, the three task schedules (GNMT's 2x1
# case, data parallel only and the slowest 2x1 compile, its 4x2 case, the 2x2 one with more
# data replicas, and its 1x2 cases, 18-27 s each, whose meshes and schedules BigLSTM's cases
# cover, under the slow marker: GNMT's 2x2 ZB case stays).
_SEQ_CASES = [
  ("2x1", 2, "etf", "zb"), ("1x2", 2, "milp", "1f1b"), ("1x2", 1, "etf", "gpipe"),
  ("2x2", 2, "milp", "zb"), ("4x2", 2, "milp", "1f1b"),
]


@pytest.mark.parametrize(
  "name,mesh_spec,k,planner,schedule",
  [pytest.param(n, *c, marks=pytest.mark.slow if (n, c[0], c[3]) in (
    ("gnmt", "2x1", "zb"), ("gnmt", "4x2", "1f1b"), ("gnmt", "1x2", "1f1b"), ("gnmt", "1x2", "gpipe"))
    else ())
   for c in _SEQ_CASES for n in ("gnmt", "biglstm")],
)
def test_sequence_models_match_reference(name, mesh_spec, k, planner, schedule):
  check(name, mesh_spec, k, planner, schedule=schedule)


@pytest.mark.parametrize("name,mesh_spec,schedule,chunks", [
  ("biglstm", "1x2", "1f1b", 4), ("biglstm", "2x2", "zb", 4),
  pytest.param("gnmt", "1x2", "zb", 2, marks=pytest.mark.slow)])  # GNMT's: 22-31 s
def test_time_chunked_lstm_layers_match_reference(name, mesh_spec, schedule, chunks):
  """Each LSTM layer in time chunks (one node each), k = 1: the plan spreads the layers' chunks
  over both devices (a wavefront, not micro-batches) and training equals the reference."""
  check(name, mesh_spec, 1, "milp", schedule=schedule, overrides=(("time_chunks", chunks),))


# The same matrix's remaining cases (GNMT's compile 25-70 s each): under the slow marker.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gnmt", "biglstm"])
@pytest.mark.parametrize(
  "mesh_spec,k,planner,schedule",
  [("1x1", 1, "milp", "1f1b"), ("2x2", 2, "dp", "gpipe"), ("4x2", 1, "etf", "1f1b")],
)
def test_sequence_models_match_reference_more(name, mesh_spec, k, planner, schedule):
  check(name, mesh_spec, k, planner, schedule=schedule)


# Inception's task-scheduled program compiles slowly on CPU (45-200 s per case, the graph cut to
# 4 nodes): every case under the slow marker. The default run covers convolutions in the program
# with a small CNN (user_modules_test, 1F1B and ZB on 2x2, seconds each).
@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh_spec,k,planner,schedule",
  [("2x2", 2, "milp", "1f1b"), pytest.param("2x2", 2, "milp", "zb", marks=pytest.mark.slow),
   pytest.param("2x2", 1, "milp", "1f1b", marks=pytest.mark.slow),
   pytest.param("1x2", 2, "etf", "zb", marks=pytest.mark.slow),
   pytest.param("1x2", 2, "dp", "gpipe", marks=pytest.mark.slow)],
)
def test_inception_matches_reference(mesh_spec, k, planner, schedule):
  check("inception_v3", mesh_spec, k, planner, max_nodes=4, schedule=schedule)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gnmt", "biglstm", "inception_v3"])
@pytest.mark.parametrize("mesh_spec,k,planner", [("1x1", 1, "etf"), ("2x1", 1, "milp"), ("4x2", 2, "milp"), ("4x2", 1, "etf")])
def test_all_models_more_meshes(name, mesh_spec, k, planner):
  check(name, mesh_spec, k, planner, max_nodes=16 if name == "inception_v3" else None)


def test_16x2_mesh_in_subprocess():
  """A 16x2 mesh needs 32 devices: run once in a fresh process configured for them."""
  code = (
    "import sys; sys.path.insert(0, %r)\n"
    "import program_models_test as t\n"
    "t.check('biglstm', '16x2', 2, 'milp')\n"
    "print('OK')\n"
  ) % os.path.dirname(__file__)
  env = subprocess_env()
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=32"
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
