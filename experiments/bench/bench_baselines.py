"""What bench_mp times besides the hybrid program: a median step timer, the plain `jax.jit`
training step (on this process's own device: `local_carry`), data parallelism with every
gradient in ONE flat all-reduce (the DP a user would write over slow links), and GSPMD tensor
parallelism (`gspmd_tp_step_s`)."""

from __future__ import annotations

import time


def step_times(fn, state, batch, steps, warmup):
  """Seconds of each of `steps` calls of fn(state, batch) -> (state, metrics) after `warmup`
  untimed ones; returns (times, final state, last metrics)."""
  import jax

  m = None
  for _ in range(warmup):
    state, m = fn(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = fn(state, batch)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t0)
  return times, state, m


def timeit(fn, state, batch, steps, warmup):
  """Median seconds of `steps` calls of fn(state, batch) -> (state, metrics) after `warmup`."""
  import numpy as np

  times, state, _ = step_times(fn, state, batch, steps, warmup)
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


def local_carry(opt, params_state, batch):
  """[carry, batch] of the plain step on this process's first local device (no collective: in a
  multi-process job every process can time its own device at once); the carry is a copy (the
  step donates it, and device_put onto the device an array is on aliases it)."""
  import jax

  local = jax.local_devices()[0]
  p, s = params_state
  carry = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), jax.device_put((p, opt.init(p), s), local))
  return [carry, jax.device_put(batch, local)]


def gspmd_tp_step_s(pure, opt, params_state, batch, mesh, steps, warmup):
  """Median step of plain jit with every weight sharded over 'model' on its largest dimension
  that divides by the axis size (GSPMD tensor parallelism as a user would first try it)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  m = mesh.shape["model"]
  def tp_sharding(x):
    shape = np.shape(x)
    dims = [i for i in np.argsort(shape)[::-1] if shape[i] % m == 0 and shape[i] >= m]
    if not dims or np.ndim(x) < 2:
      return NamedSharding(mesh, P())
    spec = [None] * len(shape)
    spec[dims[0]] = "model"
    return NamedSharding(mesh, P(*spec))

  p, s = params_state
  params = jax.tree.map(lambda x: _put(x, tp_sharding(x)), p)
  carry = (params, jax.jit(opt.init)(params), jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), s))
  bt = jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), batch)
  return timeit(jax.jit(plain_step(pure, opt), donate_argnums=0), carry, bt, steps, warmup)[0]


def fsdp_step_s(pure, opt, params_state, batch, mesh, steps, warmup):
  """Median step of FSDP as a user writes it with `NamedSharding`: every parameter leaf (and so
  its optimizer state) sharded over all devices of `mesh` along its largest dimension that
  divides by the device count (else replicated), the batch's leading dimension split over them,
  plain `jax.jit` (XLA gathers the parameters for use and reduce-scatters the gradients). The
  sharding rule is `jaxhybrid.program.memory.baseline_bytes`'s, whose memory bench_memory
  reports."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  axes = tuple(mesh.axis_names)
  n = mesh.size

  def shard(x):
    shape = np.shape(x)
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
      if shape[i] % n == 0:
        spec = [None] * len(shape)
        spec[i] = axes
        return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())

  p, s = params_state
  params = jax.tree.map(lambda x: _put(x, shard(x)), p)
  carry = (params, jax.jit(opt.init)(params),
           jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), s))
  bt = fsdp_batch(batch, mesh)
  return timeit(jax.jit(plain_step(pure, opt), donate_argnums=0), carry, bt, steps, warmup)[0]


def bucketed_fsdp_step(pure, opt, mesh, params, state, batch):
  """FSDP with every parameter in ONE flat buffer over all devices of `mesh`: each device keeps
  1/n of the buffer (and so of the optimizer state); a step all-gathers the buffer once, runs
  value_and_grad on the device's rows of the batch, reduce-scatters the flat gradient once and
  updates its share. Two collectives per step whatever the leaf count: the FSDP a user would
  write where each collective costs a fixed latency (`fsdp_step_s`'s per-leaf collectives are
  the other end). Returns (jitted step(carry, batch) -> (carry, loss), carry, the batch placed
  by `fsdp_batch`). Elementwise optimizers only (the update of a share must not depend on the
  other shares)."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.flatten_util import ravel_pytree
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  axes = tuple(mesh.axis_names)
  n = mesh.size
  flat, unravel = ravel_pytree(params)
  size = flat.shape[0]
  flat = jnp.pad(flat, (0, (-size) % n))
  length = flat.shape[0]
  shard = _put(flat, NamedSharding(mesh, P(axes)))
  opt_state = jax.jit(opt.init)(shard)
  spec_of = lambda x: P(axes) if jnp.ndim(x) == 1 and x.shape[0] == length else P()
  opt_spec = jax.tree.map(spec_of, opt_state)
  st_spec = jax.tree.map(lambda _: P(), state)

  def body(carry, b):
    mine, o, st = carry  # this device's share of the buffer and of the optimizer state
    full = lax.all_gather(mine, axes, tiled=True)[:size]
    loss, g = jax.value_and_grad(pure)(unravel(full), st, b)
    gflat = ravel_pytree(g)[0]
    gflat = jnp.pad(gflat, (0, length - size))
    gmine = lax.psum_scatter(gflat, axes, tiled=True) / n
    u, o = opt.update(gmine, o, mine)
    return (mine + u, o, st), lax.pmean(loss, axes)

  carry_spec = (P(axes), opt_spec, st_spec)
  bt = fsdp_batch(batch, mesh)
  carry = (shard, opt_state,
           jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P())), state))
  bt_spec = jax.tree.map(lambda x: x.sharding.spec, bt)
  f = jax.shard_map(body, mesh=mesh, in_specs=(carry_spec, bt_spec), out_specs=(carry_spec, P()),
                    check_vma=False)
  return jax.jit(f, donate_argnums=0), carry, bt


def fsdp_bucketed_step_s(pure, opt, params_state, batch, mesh, steps, warmup):
  """Median step of `bucketed_fsdp_step` on `batch` (`fsdp_batch`)."""
  p, s = params_state
  step, carry, bt = bucketed_fsdp_step(pure, opt, mesh, p, s, batch)
  return timeit(step, carry, bt, steps, warmup)[0]


def fsdp_batch(batch, mesh):
  """`batch` as the FSDP baselines read it: leaves with the batch's row count (divisible by the
  device count) split over every device of `mesh` on their leading dimension, others whole."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  axes, n = tuple(mesh.axis_names), mesh.size
  rows = max(np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x))
  return jax.tree.map(
    lambda x: _put(x, NamedSharding(mesh, P(axes) if np.ndim(x) and np.shape(x)[0] == rows
                                    and rows % n == 0 else P())), batch)


def hybrid_zero_steps_s(model, loss_fn, opt, batch, mesh, stages, rounds, steps, warmup):
  """Median step seconds of the hybrid program with the one-device plan on `mesh` at each ZeRO
  stage in `stages`, timed in rotating rounds in the same processes (a stage's order in the round
  moves by one each round)."""
  import numpy as np

  from jaxhybrid import api

  runs = []
  for z in stages:
    hy = api.parallelize(model, loss_fn, opt, batch, mesh=mesh, microbatches=1,
                         planner="single", program_options={"zero": z})
    runs.append([lambda st, bt, h=hy: h.program.step_fn()(st, bt), hy.init(),
                 hy.program.shard_batch(batch)])
  times: list[list] = [[] for _ in stages]
  n = len(stages)
  for r in range(max(1, rounds)):
    for i in list(range(n))[r % n:] + list(range(n))[:r % n]:
      fn, state, bt = runs[i]
      t, runs[i][1], _ = step_times(fn, state, bt, steps, warmup)
      times[i].append(t)
  return {z: float(np.median(np.concatenate(t))) for z, t in zip(stages, times)}


def dp_steps_s(pure, opt, params_state, batch, mesh, steps, warmup, steps_bucketed=None):
  """Median steps of data parallelism over 'data' (the batch's leading dimension split):
  plain jit, where XLA all-reduces each gradient leaf, over `steps` timed steps, and
  `bucketed_dp_step` (one flat all-reduce) over `steps_bucketed` (default `steps`). Returns
  (plain, bucketed)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  p, s = params_state
  n = max(np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x))
  rep = NamedSharding(mesh, P())
  bt = jax.tree.map(
    lambda x: _put(x, NamedSharding(mesh, P("data") if np.ndim(x) and np.shape(x)[0] == n else P())),
    batch,
  )
  carry = jax.tree.map(lambda x: _put(x, rep), (p, opt.init(p), s))
  plain = timeit(jax.jit(plain_step(pure, opt), donate_argnums=0), carry, bt, steps, warmup)[0]
  carry = jax.tree.map(lambda x: _put(x, rep), (p, opt.init(p), s))
  bucketed = timeit(bucketed_dp_step(pure, opt, mesh, carry, bt), carry, bt,
                    steps_bucketed or steps, warmup)[0]
  return plain, bucketed


def _put(x, sharding):
  """`x` (host or device) as a global array with `sharding` (every process builds its shards)."""
  import jax
  import numpy as np

  return jax.make_array_from_callback(np.shape(x), sharding, lambda i: np.asarray(x)[i])


# Files by which the single job's load process (rank 1) and its profiling process (rank 0) meet.
LOAD_RUNNING, LOAD_STOP, LOAD_STOPPED = "load_running_{}", "load_stop_{}", "load_stopped_{}"


def run_load(step, carry, batch, work, name, max_s):
  """Runs `step` back to back on this process's core until `work / LOAD_STOP` exists (or max_s):
  the busy neighbour of a profiling process, as the other device is busy while the program runs.
  Writes LOAD_RUNNING after the first (compiling) step and LOAD_STOPPED on the way out."""
  import jax

  t0 = time.perf_counter()
  try:
    carry, _ = step(carry, batch)
    jax.block_until_ready(carry)
    (work / LOAD_RUNNING.format(name)).touch()
    while not (work / LOAD_STOP.format(name)).exists() and time.perf_counter() - t0 < max_s:
      carry, _ = step(carry, batch)
      jax.block_until_ready(carry)
  finally:
    (work / LOAD_STOPPED.format(name)).touch()


def run_model_load(model, loss_fn, batch, work, name, max_s):
  """`run_load` with the model's plain one-device training step (Adam), as rank 1 of bench_mp's
  single job runs it."""
  import jax
  import numpy as np
  import optax

  from jaxhybrid import graph as graph_lib

  opt = optax.adam(1e-4)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, loss_fn, scopes=False)
  step = jax.jit(plain_step(pure, opt), donate_argnums=0)
  run_load(step, (p, opt.init(p), s), jax.tree.map(np.asarray, batch), work, name, max_s)


def wait_for(path, timeout_s, fail_if=None):
  """Waits until `path` exists; raises TimeoutError after timeout_s, RuntimeError as soon as
  `fail_if` exists first (e.g. the load process stopped before it ran)."""
  t0 = time.perf_counter()
  while not path.exists():
    if fail_if is not None and fail_if.exists():
      raise RuntimeError(f"{fail_if.name} appeared before {path.name}: the other process stopped (see its error)")
    if time.perf_counter() - t0 > timeout_s:
      raise TimeoutError(f"{path.name} did not appear within {timeout_s:.0f} s")
    time.sleep(0.05)
