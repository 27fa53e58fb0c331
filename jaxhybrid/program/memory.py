"""Will it fit? Per-device memory of a hybrid program: predicted by our model, and compiled.

Predicted (bytes per model-axis device; every device holds buffers of the same sizes, SPMD):

- parameters: the device's row per dtype (padded to the longest device's share) + shared leaves;
- optimizer state: `optimizer.init` of those parameters (e.g. Adam: 2x, AdaGrad: 1x);
- gradients: a gradient row + shared leaves, accumulated over the micro-batches, less the rows
  whose whole gradient is one window of the step (`gradients.single_window_rows`: the window is
  the row's gradient, counted with the windows);
- live buffers: the peak over the step of the task groups' output buffers and messages
  (activations, cotangents, residuals; `program.group_bytes.live_bytes`), which the schedule decides;
- group peak: the largest, over groups, of those buffers plus the values the group's branch
  makes and reads itself without returning them (`program.group_bytes.in_group_bytes`: an activation
  passed to the device's next task of the group, residuals whose B runs in the same group; with
  the whole step in one group, all of its activations) plus the running task's own temporaries
  (XLA's compiled temp of each node's F and B alone, `node_calls.task_temp_bytes`) and the
  parameter leaves its tasks copy out of the device's rows (`param_copies`);
- gradient windows: the largest set of gradient-row windows one group's conditional returns
  (one node's parameter gradients; `program.gradients.gradient_windows`), plus the gradients a
  branch concatenates into a shared window before returning it (a leaf alone is not copied);
- update_temp: what the step's tail needs beyond parameters, optimizer state and gradient row,
  measured: XLA's compiled temp of the last window's addition, the squared norms and the
  optimizer update alone, on one device's rows, from abstract inputs (`update_temp_bytes`:
  optimizer-dependent; on the CPU Adam's keeps two row-sized buffers beyond the gradient row);
- batch: this device's share of the global batch.

Predicted total = parameters + optimizer state + batch + max(the largest, over groups, of a
group's peak + its own gradient windows + the gradient accumulators alive then, gradients +
update_temp): an accumulator exists from the group that first returns a gradient for it (under
GPipe none exists at the turn from forwards to backwards, where the group buffers peak), and
the tail runs after the last group, when the groups' buffers are dead (`_with_accumulators`;
under ZeRO stage 2 the gradients count over the whole step).

Compiled: XLA's compile-time memory analysis of the jitted step lowered from abstract inputs
(`jax.ShapeDtypeStruct` with shardings: nothing is allocated), arguments + temporaries per device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid import graph as graph_lib
from jaxhybrid.mesh import DATA, MODEL
from jaxhybrid.program import gradients, group_bytes, node_calls
from jaxhybrid.program import zero as zero_lib
from jaxhybrid.program.structure import TrainState, row_dtype
from jaxhybrid.program.update_temp import update_temp_bytes

GiB = 2**30


def _nbytes(tree: Any) -> int:
  return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
  """Per-device memory of one program (bytes), predicted and, if compiled, measured by XLA."""

  devices: int  # model-axis devices M
  params: int
  optimizer: int
  gradients: int
  live_peak: int
  window: int
  update_temp: int
  batch: int
  # Per device: parameter bytes it owns (useful, excluding padding and shared leaves).
  owned: tuple[int, ...]
  # Row padding per device (the rows are as long as the longest device's share).
  padding: tuple[int, ...]
  # max over groups of (live buffers + values made and read inside the group's branch + the
  # running task's compiled temporaries); None: a report without it (the live peak is used).
  group_peak: int | None = None
  # max over groups of (that group's peak + its own gradient windows): the groups' largest peak
  # and largest windows need not be one group's; None: their sum is used.
  group_total: int | None = None
  # max over groups of (that group's total + the gradient accumulators alive during it): an
  # accumulator exists from the group whose conditional first returns a gradient for it (XLA
  # makes it when the first window is added); None: the whole gradient row counts over the step.
  group_grad_total: int | None = None
  compiled_arguments: int | None = None
  compiled_temp: int | None = None
  compiled_output: int | None = None
  compiled_alias: int | None = None
  # The model state the step carries (`TrainState.model_state`: every state leaf, replicated,
  # when the loss writes some; its outputs alias it), 0 when it writes none.
  model_state: int = 0

  @property
  def predicted(self) -> int:
    # The tail (optimizer update) runs after every group: its temporaries and the groups' buffers
    # and windows are not alive at the same time.
    static = self.params + self.optimizer + self.batch + self.model_state
    if self.group_grad_total is not None:
      return static + max(self.group_grad_total, self.gradients + self.update_temp)
    peak = self.live_peak if self.group_peak is None else self.group_peak
    groups = peak + self.window if self.group_total is None else self.group_total
    return static + self.gradients + max(groups, self.update_temp)

  @property
  def compiled(self) -> int | None:
    if self.compiled_arguments is None:
      return None
    return self.compiled_arguments + self.compiled_temp

  @property
  def error(self) -> float | None:
    """(predicted - compiled) / compiled."""
    c = self.compiled
    return None if not c else (self.predicted - c) / c

  def fits(self, capacity_bytes: float) -> bool:
    """Whether the compiled (else predicted) bytes per device are within `capacity_bytes`."""
    return (self.compiled if self.compiled is not None else self.predicted) <= capacity_bytes

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.update(predicted=self.predicted, compiled=self.compiled, error=self.error)
    return out

  def table(self, capacity_bytes: float | None = None) -> str:
    """A per-device table in GiB (the same on every model-axis device, SPMD)."""
    rows = [
      ("parameters (row + shared)", self.params), ("optimizer state", self.optimizer),
      ("gradient row + shared", self.gradients), ("peak live buffers (act./res./msg.)",
                                                   self.live_peak),
      ("peak with in-group values", self.live_peak if self.group_peak is None else self.group_peak),
      ("gradient window", self.window), ("optimizer update (compiled)", self.update_temp), ("batch shard", self.batch),
    ]
    if self.group_grad_total is not None:
      rows.append(("largest group + accumulators", self.group_grad_total))
    if self.model_state:
      rows.append(("model state (carried)", self.model_state))
    rows.append(("predicted total", self.predicted))
    if self.compiled is not None:
      rows += [
        ("compiled arguments", self.compiled_arguments), ("compiled temporaries", self.compiled_temp),
        ("compiled total", self.compiled),
      ]
    lines = [f"memory per device (model axis M={self.devices}), GiB:"]
    lines += [f"  {name:<36} {b / GiB:10.3f}" for name, b in rows]
    if self.error is not None:
      lines.append(f"  {'predicted vs compiled':<36} {self.error:+10.1%}")
    lines.append(
      "  owned parameters per device: " + ", ".join(f"{b / GiB:.3f}" for b in self.owned)
      + "; row padding: " + ", ".join(f"{b / GiB:.3f}" for b in self.padding)
    )
    if capacity_bytes is not None:
      verdict = "fits" if self.fits(capacity_bytes) else "does NOT fit"
      lines.append(f"  {verdict} in {capacity_bytes / GiB:.1f} GiB per device")
    return "\n".join(lines)


def abstract_params(prog: Any) -> dict[str, Any]:
  """The program's parameters as `ShapeDtypeStruct`s with their shardings (nothing allocated)."""
  lay, mesh = prog.layout, prog.mesh
  rows = NamedSharding(mesh, P(MODEL, None))
  rep = NamedSharding(mesh, P())
  return {
    "owned": {
      r: jax.ShapeDtypeStruct((lay.devices, n), row_dtype(r), sharding=rows) for r, n in lay.sizes
    },
    "shared": [
      jax.ShapeDtypeStruct(lay.shapes[i], lay.dtypes[i], sharding=rep) for i in lay.shared
    ],
  }


def abstract_state(prog: Any) -> Any:
  """An abstract `TrainState` (parameters, optimizer state, step) with shardings."""
  params = abstract_params(prog)
  opt = jax.eval_shape(prog.optimizer.init, params)
  specs = prog._opt_specs(opt)  # noqa: SLF001 (the program's own sharding rule)
  opt = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(prog.mesh, s)),
    opt, specs, is_leaf=lambda x: isinstance(x, P),
  )
  rep = NamedSharding(prog.mesh, P())
  step = jax.ShapeDtypeStruct((), np.int32, sharding=rep)
  model_state = tuple(
    jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=rep) for x in prog.state_leaves
  ) if prog.graph.state_writes else ()
  return TrainState(params=params, opt_state=opt, step=step, model_state=model_state)


def abstract_batch(prog: Any) -> list[jax.ShapeDtypeStruct]:
  """The global batch leaves as `ShapeDtypeStruct`s sharded over 'data'."""
  W, k = prog.mesh.shape[DATA], prog.microbatches
  g = prog.graph
  avals = [v.aval for v, (kind, _) in zip(g.jaxpr.invars, g.input_kinds) if kind == graph_lib.BATCH]
  out = []
  for a, pe in zip(avals, prog.per_example):
    shape = ((a.shape[0] * W * k,) + tuple(a.shape[1:])) if pe else tuple(a.shape)
    out.append(jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(prog.mesh, P(DATA) if pe else P())))
  return out


def param_copies(prog: Any) -> Callable[[int, Any], dict[Any, int]]:
  """Per (device, task): {('p', leaf): bytes} of the parameter leaves the task copies out of
  its rows (`group_bytes.in_group_bytes`'s `copies`).

  A task reads its node's leaves as slices of the device's rows (`executor.run_groups`,
  `param_value`); XLA materialises such a slice before a matmul, a convolution or a loop reads
  it, in the group's branch (BigLSTM-small 1x4 1F1B: the LSTM's two 4 MiB weights copied for its
  backward scan, 9.5 MB of the 9.6 MB the model missed). Not copied: a leaf that fills a slot
  row (read in place), a shared leaf (passed whole) and a looked-up table (the gather reads the
  row in place; no table-sized value in the compiled step). F reads every argument; B and W
  the arguments their pullback is rebuilt from (`Residuals.arg_indices`), all of them for a
  rematerialised node.
  """
  g, lay, calls = prog.graph, prog.layout, prog.calls
  kinds = dict(zip(g.jaxpr.invars, g.input_kinds))
  consts = dict(zip(g.jaxpr.constvars, g.closed_jaxpr.consts))
  item = {i: np.dtype(lay.dtypes[i]).itemsize for i in range(len(lay.shapes))}
  cache: dict[tuple[int, bool], dict[Any, int]] = {}

  def of(nid: int, forward: bool) -> dict[Any, int]:
    if (nid, forward) in cache:
      return cache[(nid, forward)]
    node = g.nodes[nid]
    tables = {lk.arg for lk in calls.lookups(nid)}
    need = None if forward or nid in calls.remat else set(calls.residuals(nid, consts).arg_indices)
    out = {}
    for i, v in enumerate(node.invars):
      if (need is not None and i not in need) or i in tables or v in consts or v not in kinds:
        continue
      kind, idx = kinds[v]
      if kind != graph_lib.PARAM or lay.owner[idx] < 0:
        continue
      if lay.read_in_place(idx):
        continue
      out[("p", idx)] = math.prod(lay.shapes[idx]) * item[idx]
    cache[(nid, forward)] = out
    return out

  return lambda d, op: of(op.node, op.kind == "F")


def _first_shared_gradient(prog: Any) -> int | None:
  """The first group whose gradient tasks (W; B when not split) read a shared leaf, or None."""
  g, lay, st = prog.graph, prog.layout, prog.structure
  kinds = dict(zip(g.jaxpr.invars, g.input_kinds))
  for gi, group in enumerate(st.groups):
    for _, op in group.tasks:
      if not gradients.makes_gradients(op, st.schedule.split):
        continue
      for v in g.nodes[op.node].invars:
        if v in kinds and kinds[v][0] == graph_lib.PARAM and lay.owner[kinds[v][1]] < 0:
          return gi
  return None


def _with_accumulators(
  during: Sequence[int], after: Sequence[int], per_group: Sequence[Any],
  row_lengths: Sequence[dict[str, int]], lay: Any, single: dict[str, Any],
  looked_up: set[str], shared: int, shared_first: int | None, conditionals: bool,
) -> list[int]:
  """Per group, its bytes with the gradient accumulators alive then.

  A row's accumulator is made when the first window of it (or, for a looked-up table, the first
  rows of its gradient) is added, after that group's conditional. The shared leaves' gradients
  are carried through every conditional that makes gradients; until a task writes one
  (`shared_first`, the first group that does; None: none does) they are zeros XLA passes
  around the conditionals. (A branch that leaves them as they are may return a copy: seen in
  GNMT small 1x8 GPipe's buffer assignment, but counting one in every later group put GNMT's
  1F1B and ZB rows 5-8 % over their compiled bytes, against 0-3 % without.) So during group g's
  conditional (`during`: group buffers + in-group values + windows) the accumulators of rows
  first written before g are alive, and after it (`after`: group buffers + windows) also those
  first written in g (on one model device, without conditionals, during g too). GNMT small 1x8
  GPipe k=8: the groups' largest total is at the turn from forwards to backwards, where almost
  no accumulator exists yet (XLA's buffer assignment: 7.3 of the 11.4 MB of gradient rows appear
  after the turn's first backward group).
  """
  size = {r: n * np.dtype(row_dtype(r)).itemsize for r, n in lay.sizes}
  first: dict[str, int] = {}
  for g, ws in enumerate(per_group):
    for w in ws or ():
      first.setdefault(w.row_key, g)
  for g, lengths in enumerate(row_lengths):
    for r in looked_up:
      if row_dtype(r) in lengths:
        first.setdefault(r, g)
  start = len(per_group) if shared_first is None else shared_first

  def alive(g: int) -> int:
    rows = sum(size[r] for r, g0 in first.items() if g0 <= g and r not in single and r in size)
    return rows + (shared if g >= start else 0)

  # On one model device there is no conditional: a group's gradients are added as they are
  # made, beside its own values.
  return [max(a + alive(g - 1 if conditionals else g), b + alive(g))
          for g, (a, b) in enumerate(zip(during, after))]


def report(prog: Any, *, compile: bool = True) -> MemoryReport:
  """Predicted (and, with `compile`, XLA-compiled) per-device memory of `prog`'s step."""
  lay = prog.layout
  ts = abstract_state(prog)
  M = lay.devices
  row_bytes = lay.row_bytes()
  shared = sum(math.prod(lay.shapes[i]) * np.dtype(lay.dtypes[i]).itemsize for i in lay.shared)
  params = row_bytes + shared
  opt = _nbytes(ts.opt_state)
  W = prog.mesh.shape[DATA]
  # Row-sharded optimizer leaves hold 1/M of their global bytes per device.
  row_shapes = {(M, n) for _, n in lay.sizes}
  opt_rows = sum(
    _nbytes(x) for x in jax.tree.leaves(ts.opt_state) if tuple(x.shape) in row_shapes
  )
  # Under ZeRO the rows' optimizer state is also split over the W data replicas.
  opt_per_device = opt - opt_rows + opt_rows // (M * (W if getattr(prog, "zero", 0) else 1))
  batch = abstract_batch(prog)
  batch_bytes = sum(
    _nbytes(x) // (W if pe else 1) for x, pe in zip(batch, prog.per_example)
  )
  owned = lay.bytes_per_device()
  lookups = prog.calls.lookups
  per_group = gradients.gradient_windows(prog.structure, prog.graph, lay, lookups=lookups)
  row_lengths = gradients.lookup_lengths(prog.structure, prog.graph, lay, lookups)
  all_windows = [ws for ws in per_group if ws]
  zero = getattr(prog, "zero", 0)
  W = prog.mesh.shape[DATA]
  ring = zero_lib.ring_scatter(prog.mesh)

  # Rows given whole by one window (no zero accumulator; executor.run_groups): outside ZeRO.
  looked_up = gradients.looked_up_rows(prog.structure, prog.graph, lay, lookups)
  single = {} if zero else gradients.single_window_rows(all_windows, lay, exclude=looked_up)
  single_bytes = sum(w.nbytes for w in single.values())

  def group_rows(lengths: dict[str, int]) -> int:
    # Looked-up tables' row gradients (lookups.py): positions (int32) and values, built in
    # pieces and padded (two copies); under ZeRO stage 2 passed round the 'data' ring (the
    # hop received beside the one held) with each hop's local positions.
    out = 0
    for dt, n in lengths.items():
      one = n * (4 + np.dtype(dt).itemsize)
      out += 2 * one + (2 * one + 4 * n if zero == 2 and W > 1 else 0)
    return out

  def group_windows(ws) -> int:
    # Every window of the group counted alive at once. On one model device (no conditional)
    # XLA may update a row given whole as soon as its window is made and hold fewer (a uniform
    # chain: 15 MB compiled against 34 MB of windows); BigLSTM and GNMT hold them all.
    if not ws:
      return 0
    out = sum(w.nbytes for w in ws) + max(w.copies(lay) for w in ws)
    if zero == 2:  # + a window cut into several segments is copied into its [W, L/W] form,
      # + one reduce-scatter's output (its share) at a time, all the windows still alive
      cuts = prog.zero_cuts
      out += max(
        (w.nbytes for w in ws
         if any(len(zero_lib.pieces(s, s + w.length, cuts[w.row_key])) > 1 for s in w.starts)),
        default=0)
      if W > 1 and ring:  # + the hop each window received beside its share: the group's
        # windows go round the ring together (zero.reduce_scatter; chain 2x2-16x2 within 2 %)
        out += max(w.nbytes // W for w in ws) + sum(w.nbytes // W for w in ws)
      else:
        out += max(w.nbytes // W for w in ws)
    return out

  windows = [group_windows(ws or []) + group_rows(n) for ws, n in zip(per_group, row_lengths)]
  window = max(windows, default=0)
  last = all_windows[-1][-1] if all_windows else None
  fields: dict[str, Any] = {}
  if compile:
    ma = prog.step_fn().lower(ts, batch).compile().memory_analysis()
    fields = dict(
      compiled_arguments=int(ma.argument_size_in_bytes), compiled_temp=int(ma.temp_size_in_bytes),
      compiled_output=int(ma.output_size_in_bytes), compiled_alias=int(ma.alias_size_in_bytes),
    )
  live = group_bytes.live_bytes(prog.structure)
  consts = dict(zip(prog.graph.jaxpr.constvars, prog.graph.closed_jaxpr.consts))
  scheduled = {op.node for ops in prog.structure.schedule.devices for op in ops}
  # Each node's task temporaries are compiled once per program (the memory check after planning
  # and the dry run's table both ask for them).
  cache = prog.__dict__.setdefault("_task_temp_cache", {})
  for n in sorted(scheduled - set(cache)):
    cache[n] = node_calls.task_temp_bytes(prog.calls, n, consts)
  temps = {n: cache[n] for n in scheduled}
  # Gradients waiting for one sum (group_bytes.loop_read_leaves): on one model device, where
  # the step is one computation. Inside a conditional's branch XLA held them apart: counted
  # there, BigLSTM small 1x4 ZB k = 8 (two W tasks of an LSTM in a group) read +13.9 % against
  # -1.7 % without.
  looped = group_bytes.loop_read_leaves(prog.graph) if M == 1 else {}
  leaf_bytes = [math.prod(s) * np.dtype(t).itemsize for s, t in zip(lay.shapes, lay.dtypes)]
  split = prog.structure.schedule.split
  inner = group_bytes.in_group_bytes(
    prog.structure, lambda op: temps[op.node][0 if op.kind == "F" else 1],
    copies=param_copies(prog),
    waits=lambda d, op: ({i: leaf_bytes[i] for i in looped.get(op.node, ())}
                         if gradients.makes_gradients(op, split) else {}))
  totals = [a + b + w for a, b, w in zip(live, inner, windows)]
  grad_totals = None
  if zero != 2:
    grad_totals = _with_accumulators(
      totals, [a + w for a, w in zip(live, windows)], per_group, row_lengths, lay, single,
      looked_up, shared, _first_shared_gradient(prog), M > 1)
  return MemoryReport(
    devices=M, params=params, optimizer=opt_per_device,
    gradients=params - single_bytes if zero != 2 else row_bytes // W + shared,
    live_peak=max(live, default=0), window=window,
    group_peak=max((a + b for a, b in zip(live, inner)), default=0),
    group_total=max(totals, default=0),
    group_grad_total=None if grad_totals is None else max(grad_totals, default=0),
    update_temp=update_temp_bytes(
      prog.optimizer, lay, last.length if last else 0, last.row_key if last else None,
      data_shards=W if zero else 1, zero=zero, zero_cuts=prog.zero_cuts if zero else None),
    batch=batch_bytes, owned=tuple(owned), padding=tuple(row_bytes - b for b in owned),
    model_state=_nbytes(ts.model_state), **fields,
  )


def baseline_bytes(
  loss: Callable[[Any, Any, Any], jax.Array],
  params: Any,
  state: Any,
  batch: Any,
  optimizer: Any,
  mesh: jax.sharding.Mesh,
  mode: str,
) -> dict[str, int]:
  """Compiled per-device bytes of what a user would write instead, on the same devices.

  'dp': plain `jax.jit` data parallelism (parameters and optimizer state replicated, the batch
  sharded over every device). 'fsdp': parameters and optimizer state sharded over every device
  (each leaf along its largest dimension divisible by the device count, `NamedSharding`), the
  batch sharded likewise, plain `jax.jit` (XLA inserts the all-gathers and reduce-scatters).
  Inputs are abstract (`ShapeDtypeStruct`s): nothing is allocated.

  Returns:
    {'arguments', 'temp', 'total'} bytes per device.
  """
  import optax

  if mode not in ("dp", "fsdp"):
    raise ValueError(f"mode={mode!r}: use 'dp' or 'fsdp'")
  axes = tuple(mesh.axis_names)
  n = mesh.size
  rep = NamedSharding(mesh, P())

  def param_sharding(x):
    if mode == "dp":
      return rep
    dims = sorted(range(len(x.shape)), key=lambda i: -x.shape[i])
    for i in dims:
      if x.shape[i] % n == 0:
        spec = [None] * len(x.shape)
        spec[i] = axes
        return NamedSharding(mesh, P(*spec))
    return rep

  def batch_sharding(x):
    return NamedSharding(mesh, P(axes)) if x.shape and x.shape[0] % n == 0 else rep

  shard = lambda f: lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=f(x))  # noqa: E731
  p_abs = jax.tree.map(shard(param_sharding), params)
  o_abs = jax.eval_shape(optimizer.init, p_abs)
  p_shardings = jax.tree.map(param_sharding, params)
  o_abs = optax.tree_map_params(
    optimizer, lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), o_abs, p_shardings,
    transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
  )
  b_abs = jax.tree.map(shard(batch_sharding), batch)
  s_abs = jax.tree.map(shard(lambda x: rep), state)

  def step(p, o, s, b):
    value, grads = jax.value_and_grad(loss)(p, s, b)
    updates, o = optimizer.update(grads, o, p)
    return optax.apply_updates(p, updates), o, value

  out_shardings = (
    jax.tree.map(lambda x: x.sharding, p_abs), jax.tree.map(lambda x: x.sharding, o_abs), rep
  )
  compiled = jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings).lower(
    p_abs, o_abs, s_abs, b_abs
  ).compile()
  ma = compiled.memory_analysis()
  args, temp = int(ma.argument_size_in_bytes), int(ma.temp_size_in_bytes)
  return {"arguments": args, "temp": temp, "total": args + temp}


def fit_table(rows: Sequence[tuple[str, MemoryReport]]) -> str:
  """One line per (name, report): predicted and compiled GiB and their error."""
  out = [f"{'program':<28} {'predicted GiB':>14} {'compiled GiB':>13} {'error':>8}"]
  for name, r in rows:
    comp = f"{r.compiled / GiB:13.3f}" if r.compiled is not None else f"{'-':>13}"
    err = f"{r.error:+8.1%}" if r.error is not None else f"{'-':>8}"
    out.append(f"{name:<28} {r.predicted / GiB:14.3f} {comp} {err}")
  return "\n".join(out)
