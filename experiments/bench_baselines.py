"""What bench_mp times besides the hybrid program: a median step timer, the plain `jax.jit`
training step, and data parallelism with every gradient in ONE flat all-reduce (the DP a user
would write over slow links)."""

from __future__ import annotations

import time


def timeit(fn, state, batch, steps, warmup):
  """Median seconds of `steps` calls of fn(state, batch) -> (state, metrics) after `warmup`."""
  import jax

  for _ in range(warmup):
    state, m = fn(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = fn(state, batch)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t0)
  import numpy as np

  return float(np.median(times)), state


def plain_step(pure, opt):
  """The training step a user writes for one device: value_and_grad, optimizer, apply."""
  import jax
  import optax

  def step(carry, batch):
    params, opt_state, state = carry
    loss, g = jax.value_and_grad(pure)(params, state, batch)
    u, opt_state = opt.update(g, opt_state, params)
    return (optax.apply_updates(params, u), opt_state, state), loss

  return step


def bucketed_dp_step(pure, opt, mesh, carry, batch):
  """Data parallelism over 'data' with every gradient in one flat buffer and one pmean."""
  import jax
  import optax
  from jax.flatten_util import ravel_pytree
  from jax.sharding import PartitionSpec as P

  carry_spec = jax.tree.map(lambda _: P(), carry)
  batch_spec = jax.tree.map(lambda x: x.sharding.spec, batch)

  def body(c, b):
    params, opt_state, state = c
    loss, g = jax.value_and_grad(pure)(params, state, b)
    flat, unravel = ravel_pytree(g)
    g = unravel(jax.lax.pmean(flat, "data"))
    u, opt_state = opt.update(g, opt_state, params)
    return (optax.apply_updates(params, u), opt_state, state), jax.lax.pmean(loss, "data")

  f = jax.shard_map(body, mesh=mesh, in_specs=(carry_spec, batch_spec),
                    out_specs=(carry_spec, P()), check_vma=False)
  return jax.jit(f, donate_argnums=0)
