"""Timing one node on the current backend: its forward + backward fused, or the tasks the
task-scheduled program runs apart (F; B; and, split, B's input cotangents and W's weight
gradients), each its own compiled function on random inputs.
"""

from __future__ import annotations

import math
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxhybrid import graph as graph_lib


def _random_input(aval: Any, rng: np.random.Generator) -> jax.Array:
  """A concrete array for `aval`: normal floats, zero integers/bools (valid as indices), keys.

  Drawn with numpy, so that making inputs compiles nothing.
  """
  shape, dtype = aval.shape, aval.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    key = jax.random.key(int(rng.integers(2**31)))
    return jax.random.split(key, math.prod(shape)).reshape(shape)
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
  return jnp.asarray(np.zeros(shape, dtype))


def _is_float(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  return (
    dtype is not None
    and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    and jnp.issubdtype(dtype, jnp.inexact)
  )


class _Flush:
  """Writes a buffer of `nbytes` in place (donated, so nothing is allocated): between timed
  calls it evicts the timed function's data from the core's caches."""

  _made: ClassVar[dict[int, _Flush]] = {}

  def __init__(self, nbytes: int):
    self.buf = jnp.zeros((max(1, nbytes // 4),), jnp.float32)
    self.step = jax.jit(lambda z: z + 1.0, donate_argnums=0)

  @classmethod
  def of(cls, nbytes: int) -> _Flush:
    if nbytes not in cls._made:
      cls._made[nbytes] = cls(nbytes)
    return cls._made[nbytes]

  def __call__(self) -> None:
    self.buf = jax.block_until_ready(self.step(self.buf))


# `cache_flush_bytes`: the flush is this many times the largest CPU cache (assumption: a write
# of 1.5x the last-level cache evicts the timed function's data; on this project's 2-core VM,
# 32 MiB L3, 48 MiB flushed profiles brought bench_mp's mean step error from 6.4 / 8.4 / 33.5 %
# to 3.0 / 4.1 / 14.4 % on the chain, GNMT and Inception-V3, experiments/results/
# bench_mp_cold_profiles.json).
FLUSH_CACHE_FACTOR = 1.5
# `cache_flush_bytes` when the host's cache sizes cannot be read (assumption: at least the
# last-level cache of most server CPUs).
FLUSH_FALLBACK_BYTES = 64 << 20


def _size_bytes(text: str) -> int:
  """A sysfs cache size ('32768K', '2M', '512') in bytes."""
  text = text.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
  return int(text[:-1] if scale > 1 else text) * scale


def cache_flush_bytes(
  factor: float = FLUSH_CACHE_FACTOR, sysfs: str = "/sys/devices/system/cpu"
) -> int:
  """Bytes to write before a timed run so that it starts with cold caches: `factor` times the
  largest cache of any CPU in `sysfs` (Linux's cache description), or FLUSH_FALLBACK_BYTES
  when none can be read (another OS, a container without sysfs)."""
  sizes = []
  for f in pathlib.Path(sysfs).glob("cpu[0-9]*/cache/index[0-9]*/size"):
    try:
      sizes.append(_size_bytes(f.read_text()))
    except (OSError, ValueError):
      continue
  if not sizes:
    return FLUSH_FALLBACK_BYTES
  return int(factor * max(sizes))


# The most timed calls `median_time_s` makes to fill its `min_time_s`.
MAX_REPEATS = 2000


def median_time_s(
  fn: Callable[[], Any], *, warmup: int, repeats: int, warmup_s: float = 0.0, flush_bytes: int = 0,
  min_time_s: float = 0.0,
) -> float:
  """Median wall time of `fn()` (blocking on its result) after `warmup` untimed calls, and more
  untimed calls until those after the first (which may compile) have taken `warmup_s` seconds.

  flush_bytes: before every call, write a buffer of this many bytes (untimed), so that each
  timed call starts with its data out of the caches, as a task does that runs after other work
  (0: back to back, the data warm from the previous call).
  min_time_s: after `repeats` timed calls, keep timing until the timed calls add up to this
  many seconds (at most MAX_REPEATS calls), so that the median covers more than a moment of
  whatever else the machine runs (0: exactly `repeats` calls).
  """
  flush = _Flush.of(flush_bytes) if flush_bytes > 0 else (lambda: None)
  calls, start = 0, 0.0
  while calls < warmup or time.perf_counter() - start < warmup_s:
    flush()
    jax.block_until_ready(fn())
    calls += 1
    if calls == 1:
      start = time.perf_counter()
  times: list[float] = []
  while len(times) < repeats or (sum(times) < min_time_s and len(times) < MAX_REPEATS):
    flush()
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _node_case(graph: graph_lib.OpGraph, node: graph_lib.Node, seed: int, policy: Any):
  """(forward, diff_args, rest, cotangents) of `node` on random inputs: forward(diff_args, rest)
  is the F task, returning ((outputs, aux), pullback), the pullback None when nothing is
  differentiated."""
  return _case(graph, graph.node_fn(node), node.invars, node.outvars, seed, policy)


def _case(graph: graph_lib.OpGraph, fn: Callable, invars: Any, outvars: Any, seed: int, policy: Any):
  """`_node_case` of `fn(*invars) -> [outvars]` (a node, or the whole traced loss): every
  floating-point input is differentiated except the graph's batch and state."""
  no_grad = {
    v for v, (kind, _) in zip(graph.jaxpr.invars, graph.input_kinds)
    if kind in (graph_lib.BATCH, graph_lib.STATE)
  }
  rng = np.random.default_rng(seed)
  inputs = [_random_input(v.aval, rng) for v in invars]
  diff = [i for i, v in enumerate(invars) if _is_float(v.aval) and v not in no_grad]
  out_float = [_is_float(v.aval) for v in outvars]
  cts = [_random_input(v.aval, rng) for v, f in zip(outvars, out_float) if f]

  def partial(rest, *d):
    args = list(rest)
    for i, x in zip(diff, d):
      args[i] = x
    outs = fn(*args)
    floats = [o for o, f in zip(outs, out_float) if f]
    return floats, [o for o, f in zip(outs, out_float) if not f]

  def forward(diff_args, rest):
    """The F task: outputs and the pullback (its arrays are the saved residuals)."""
    f = lambda *d: partial(rest, *d)
    if not diff_args:  # nothing to differentiate (e.g. an embedding lookup of frozen inputs)
      return f(), None
    if policy is not None:
      f = jax.checkpoint(f, policy=policy)
    outs, vjp, aux = jax.vjp(f, *diff_args, has_aux=True)
    return (outs, aux), vjp

  diff_args = [inputs[i] for i in diff]
  rest = [None if i in diff else x for i, x in enumerate(inputs)]
  return forward, diff_args, rest, cts


def _param_positions(graph: graph_lib.OpGraph, node: graph_lib.Node) -> list[bool]:
  """Per differentiated argument of `_node_case` (in order), whether it is a parameter (W's)
  rather than an activation or other input (B's)."""
  kinds = dict(zip(graph.jaxpr.invars, graph.input_kinds))
  out = []
  for v in node.invars:
    kind = kinds.get(v, (None,))[0]
    if _is_float(v.aval) and kind not in (graph_lib.BATCH, graph_lib.STATE):
      out.append(kind == graph_lib.PARAM)
  return out


def time_node(
  graph: graph_lib.OpGraph, node: graph_lib.Node, *, warmup: int, repeats: int, seed: int = 0,
  policy: Any = None, warmup_s: float = 0.0, flush_bytes: int = 0, min_time_s: float = 0.0,
) -> float:
  """Compiles and times one node's forward + backward on the default device, seconds.

  The backward is `jax.vjp` of the node w.r.t. its floating-point inputs except the batch and
  read-only state (which get no gradient in training), with random cotangents. With a
  `jax.checkpoint` policy the node runs rematerialised under it, recomputation included (as the
  program's `branch_remat` runs it). Forward and backward are one compiled function (XLA fuses
  across them), as in a single-device step.
  """
  return _fused_time_s(_node_case(graph, node, seed, policy), warmup=warmup, repeats=repeats,
                       warmup_s=warmup_s, flush_bytes=flush_bytes, min_time_s=min_time_s)


def _fused_time_s(case: tuple, **kw: Any) -> float:
  """Median time of a `_case`'s forward and backward compiled as one function."""
  forward, diff_args, rest, cts = case

  def fwd_bwd(diff_args, rest, cts):
    outs, vjp = forward(diff_args, rest)
    return outs if vjp is None else (outs, vjp(cts))

  step = jax.jit(fwd_bwd)
  return median_time_s(lambda: step(diff_args, rest, cts), **kw)


def time_node_tasks(
  graph: graph_lib.OpGraph, node: graph_lib.Node, *, warmup: int, repeats: int, seed: int = 0,
  policy: Any = None, warmup_s: float = 0.0, flush_bytes: int = 0, min_time_s: float = 0.0,
) -> tuple[float, float]:
  """Compiles and times one node's F and B tasks apart, as the task-scheduled program runs them.

  F is the `jax.vjp` forward, its residuals (the pullback's arrays) written out; B applies the
  pullback to cotangents from those stored residuals. Two compiled functions, so nothing is
  fused across them (in the program F and B of a micro-batch run in different groups).
  Returns (forward seconds, backward seconds); B is 0 for a node with nothing to differentiate.
  """
  forward, diff_args, rest, cts = _node_case(graph, node, seed, policy)
  fwd = jax.jit(forward)
  kw = {"warmup": warmup, "repeats": repeats, "warmup_s": warmup_s, "flush_bytes": flush_bytes,
        "min_time_s": min_time_s}
  t_f = median_time_s(lambda: fwd(diff_args, rest), **kw)
  _, vjp = fwd(diff_args, rest)
  if vjp is None:
    return t_f, 0.0
  bwd = jax.jit(lambda vjp, cts: vjp(cts))
  return t_f, median_time_s(lambda: bwd(vjp, cts), **kw)


def time_graph(
  graph: graph_lib.OpGraph, *, warmup: int, repeats: int, seed: int = 0, warmup_s: float = 0.0,
  flush_bytes: int = 0, min_time_s: float = 0.0,
) -> float:
  """Compiles and times the whole traced loss's forward + backward as one function, seconds.

  What one device's plain `jax.jit` step computes before its optimizer update: the gradient of
  every floating-point parameter (batch and state get none), on random inputs of the traced
  shapes, the graph's constants as traced. Unlike a sum of `time_node` times it includes what
  XLA fuses and lays out across node boundaries; measured on one core, a 256-wide tanh layer at
  8192 rows took 67 ms timed alone (fastest of 60 runs) and about 53 ms inside the whole step.
  """
  jaxpr = graph.jaxpr  # its inputs are the parameters, state and batch: only parameters differentiated
  whole = jex.core.jaxpr_as_fun(graph.closed_jaxpr)
  # The loss alone: the state writes after it (graph.state_writes) take no cotangent.
  case = _case(graph, lambda *a: whole(*a)[:1], jaxpr.invars, jaxpr.outvars[:1], seed, None)
  return _fused_time_s(case, warmup=warmup, repeats=repeats, warmup_s=warmup_s,
                       flush_bytes=flush_bytes, min_time_s=min_time_s)


def dispatch_time_s(*, warmup: int = 3, repeats: int = 20) -> float:
  """Median time of a jitted no-op call: the fixed cost of timing one node by itself."""
  tiny = jax.jit(lambda x: x + 1)
  one = jnp.zeros((), jnp.float32)
  return median_time_s(lambda: tiny(one), warmup=warmup, repeats=repeats)


def time_node_split(
  graph: graph_lib.OpGraph, node: graph_lib.Node, *, warmup: int, repeats: int, seed: int = 0,
  policy: Any = None, warmup_s: float = 0.0, flush_bytes: int = 0, min_time_s: float = 0.0,
) -> tuple[float, float]:
  """Times `node`'s backward as a split (zero-bubble) schedule runs it: (B, W) seconds.

  B applies the pullback and keeps the cotangents of the node's non-parameter inputs (what is
  sent upstream); W applies it and keeps the parameter gradients. Each is its own compiled
  function, as the program's B and W tasks are, so XLA drops what a task does not return. For a
  matmul the two are disjoint products that sum to about the whole backward; a recurrence (scan)
  needs every step's cotangent for its weight gradient, so W repeats it (measured on one core,
  BigLSTM-small's LSTM layer: B 50 ms, W 116 ms, the whole backward 125 ms).
  """
  forward, diff_args, rest, cts = _node_case(graph, node, seed, policy)
  _, vjp = jax.jit(forward)(diff_args, rest)
  if vjp is None:
    return 0.0, 0.0
  is_param = _param_positions(graph, node)

  def keep(params: bool) -> Callable:
    return jax.jit(lambda vjp, cts: [g for g, p in zip(vjp(cts), is_param) if p == params])

  b, w = keep(False), keep(True)
  kw = {"warmup": warmup, "repeats": repeats, "warmup_s": warmup_s, "flush_bytes": flush_bytes,
        "min_time_s": min_time_s}
  return median_time_s(lambda: b(vjp, cts), **kw), median_time_s(lambda: w(vjp, cts), **kw)
