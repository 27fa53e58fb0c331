"""Runs a task-scheduled training step inside `shard_map`: forward and backward as tasks.

No `jax.grad` wraps a conditional. Per group of the lock-step structure (`tasks.build`):

- ONE `lax.switch(axis_index('model'), branches)`: device d's branch runs d's tasks of the group:
  F(n, c) calls `jax.vjp` of node n and keeps the pullback's new arrays (its residuals); B(n, c)
  rebuilds the pullback from them (arguments re-read: parameters from d's own row, activations
  from where they arrived), applies it to the summed output cotangents and emits the input
  cotangents; the parameter gradient is added into d's own gradient row at static offsets (in B,
  or in W for split schedules). The branch returns one flat buffer per dtype in the group's
  layout (union-sized: the largest device's outputs), and the gradient rows;
- then one `ppermute` per (shift, dtype) carries the group's messages; receivers read at static
  offsets.

A device never slices, views or differentiates another device's parameter leaves.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxhybrid import graph as graph_lib
from jaxhybrid.graph.remat import remat_policy
from jaxhybrid.mesh import MODEL
from jaxhybrid.planner.core import dtypes
from jaxhybrid.planner.core import task_schedule as sched_lib
from jaxhybrid.program import gradients
from jaxhybrid.program import lookups as lookups_lib
from jaxhybrid.program import zero as zero_lib
from jaxhybrid.program import structure as structure_lib
from jaxhybrid.program import tasks as tasks_lib
from jaxhybrid.program.node_calls import NodeCalls, pullback_leaves, split_pullback
from jaxhybrid.program.structure import ParamLayout

# Each task's operations run under a named scope, so the compiled HLO's `op_name` metadata (and a
# profile's events through it) tells which task an instruction belongs to.
_TASK_SCOPE = re.compile(r"(?:^|/)([FBW])(\d+)_mb(\d+)(?=/|$)")


def task_scope(kind: str, node: int, microbatch: int) -> str:
  """The named scope of task `kind`(node, micro-batch), e.g. 'B12_mb3'."""
  return f"{kind}{node}_mb{microbatch}"


def task_of_op_name(op_name: str) -> tuple[str, int, int] | None:
  """(kind, node, micro-batch) of the innermost task scope in an HLO `op_name`, else None."""
  found = _TASK_SCOPE.findall(op_name)
  return (found[-1][0], int(found[-1][1]), int(found[-1][2])) if found else None


def _on_param_access(device: int, leaf: int, what: str) -> None:
  """Called at trace time for every parameter leaf a branch reads ('read') or adds a gradient
  to ('grad'); a no-op hook the tests use to check that devices touch only their own leaves."""


def structure_for(
  graph: graph_lib.OpGraph,
  assignment: Sequence[int],
  devices: int,
  microbatches: int,
  schedule: str | sched_lib.TaskSchedule = sched_lib.DEFAULT_KIND,
  *,
  order: Sequence[tuple[int, int]] | None = None,
  forward_s: Sequence[float] | None = None,
  branch_remat: str = "none",
  remat: frozenset[int] = frozenset(),
  canonical_convs: bool = False,
  sparse_lookups: bool = True,
) -> tuple[sched_lib.TaskSchedule, tasks_lib.Structure, NodeCalls]:
  """The task schedule, lock-step structure and node calls of a placement (no mesh needed).

  Args:
    graph, assignment, devices, microbatches: the placed graph.
    schedule: 'gpipe', '1f1b' or 'zb' (generated from the placement), or a TaskSchedule.
    order: (node, micro-batch) forward priority (e.g. a plan's start order).
    forward_s: estimated forward time per node for generating the schedule (default: FLOPs).
    branch_remat: 'none', 'dots' or 'full' (every node rematerialised).
    remat: nodes whose forward saves nothing.
    canonical_convs: replay convolutions in the canonical layout (`graph.convs`).
    sparse_lookups: tables read only by row lookups get row gradients (`program.lookups`).

  Raises:
    ValueError: a schedule that does not fit the placement.
  """
  remat_policy(branch_remat)  # validates the name
  assignment = tuple(int(a) for a in assignment)
  edges = [(e.src, e.dst) for e in graph.edges]
  if isinstance(schedule, str):
    fwd = forward_s if forward_s is not None else [max(n.flops, 1.0) for n in graph.nodes]
    schedule = sched_lib.generate(
      schedule, len(graph.nodes), edges, assignment, devices, microbatches, forward_s=fwd,
      order=order,
    )
  if schedule.microbatches != microbatches:
    raise ValueError(
      f"the schedule is for {schedule.microbatches} micro-batches but the program runs "
      f"{microbatches}: generate it for microbatches={microbatches}"
    )
  if len(schedule.devices) != devices:
    raise ValueError(
      f"the schedule is for {len(schedule.devices)} model-axis devices but the mesh has {devices}"
    )
  sched_lib.validate(schedule, len(graph.nodes), edges, assignment)
  if branch_remat == "full":
    remat = frozenset(range(len(graph.nodes)))
  calls = NodeCalls(
    graph=graph, canonical_convs=canonical_convs, branch_remat=branch_remat, remat=remat,
    sparse_lookups=sparse_lookups,
  )
  consts = dict(zip(graph.jaxpr.constvars, graph.closed_jaxpr.consts))
  structure = tasks_lib.build(
    graph, assignment, schedule, lambda nid: calls.residuals(nid, consts), remat
  )
  return schedule, structure, calls


@dataclasses.dataclass
class Inputs:
  """What the branches read besides values: own parameter row, shared leaves, state, batch."""

  rows: dict[str, jax.Array]  # dtype -> this device's parameter row [size]
  shared: list[jax.Array]
  state: Sequence[jax.Array]
  microbatches: list[list[jax.Array]]  # per batch leaf, per micro-batch


def _token(dep: jax.Array | None) -> jax.Array | None:
  """A conditional's extra output `0 * dep`, added to the loss: it makes the conditional read
  `dep` (an element of the gradient buffers after the previous group's additions), so XLA cannot
  run it before them, and it changes nothing (NaN when that gradient is not finite, which the
  loss then shows). An output of its own, rather than `0 * dep` added into one of the branch's
  arrays: that addition copied a 3 GiB window on paper BigLSTM 1x2."""
  return None if dep is None else dep * 0


def run_groups(
  st: tasks_lib.Structure,
  calls: NodeCalls,
  layout: ParamLayout,
  inp: Inputs,
  consts: dict[Any, Any],
  zero_cuts: dict[str, tuple[int, ...]] | None = None,
  data: int = 1,
  single_windows: bool = False,
  scatter_ring: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array], list[jax.Array]]:
  """Runs every group; returns (this device's loss share, flat gradients, whole-window rows,
  shared gradients, state writes).

  The loss share is the mean over micro-batches on the loss node's device and 0 elsewhere; the
  flat gradients are one buffer per dtype holding this device's own gradient rows side by side
  (other devices' leaves never appear; `gradients.cut_rows` gives the rows). With
  `single_windows`, a row whose whole gradient is one window of the step
  (`gradients.single_window_rows`) is returned as that window (row key -> array) and has no
  place in the flat buffers.

  With `zero_cuts` (ZeRO stage 2 over `data` replicas; `jaxhybrid.program.zero`), every window
  is reduce-scattered over 'data' as it leaves its group and the flat buffers hold only this
  replica's share of the rows (1/data of them), summed over the replicas, not yet averaged;
  `scatter_ring`: those reduce-scatters go round a ppermute ring (`zero.reduce_scatter`).

  The state writes (one per `graph.state_writes`, e.g. BatchNorm running averages) are this
  device's share, zeros where another device's node makes the write: a floating-point write is
  the mean of its micro-batches' values, any other the last micro-batch's (a counter: every
  micro-batch starts from the same state, so they all agree). They are accumulated as the F
  tasks make them, each carried through the conditionals of the groups that make it, so no
  group buffer holds them until the end of the step.
  """
  g = calls.graph
  k = st.schedule.microbatches
  M = st.devices
  kinds = dict(zip(g.jaxpr.invars, g.input_kinds))
  shared_pos = {leaf: j for j, leaf in enumerate(layout.shared)}
  loss_var = g.jaxpr.outvars[0]
  write_of = {v: j for j, v in enumerate(g.jaxpr.outvars[1:])}
  me = lax.axis_index(MODEL) if M > 1 else 0
  bufs: dict[tuple, jax.Array] = {}
  # The gradient rows of one dtype live side by side in ONE flat buffer while the groups add
  # into it (dynamic-update-slices, in place); they are cut apart at the end. (Separate buffers
  # per slot row let XLA fuse a row's additions over all groups into the optimizer's pass at the
  # end, which keeps every group's window alive until then.)
  all_windows = gradients.gradient_windows(st, g, layout, lookups=calls.lookups)
  row_lengths = gradients.lookup_lengths(st, g, layout, calls.lookups)
  single = gradients.single_window_rows(
    all_windows, layout, exclude=gradients.looked_up_rows(st, g, layout, calls.lookups)
  ) if single_windows else {}
  whole: dict[str, jax.Array] = {}
  base: dict[str, int] = {}
  flat_len: dict[str, int] = {}
  for r, n in layout.sizes:
    if r in single:
      continue
    dt = structure_lib.row_dtype(r)
    base[r] = flat_len.get(dt, 0)
    flat_len[dt] = base[r] + n
  W = int(data) if zero_cuts is not None else 1
  grads = {dt: jnp.zeros((n // W,), dt) for dt, n in flat_len.items()}
  gshared = [jnp.zeros_like(x) for x in inp.shared]
  writes = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in write_of]
  # Per group, the writes its F tasks make (on any device): only those pass through its
  # conditional (each carried array is copied in and out of it).
  writing: dict[int, list[int]] = {}
  for gi, lay in enumerate(st.groups):
    made = sorted({write_of[v] for _, op in lay.tasks if op.kind == "F"
                   for v in g.nodes[op.node].outvars if v in write_of})
    if made:
      writing[gi] = made

  def param_value(idx: int, d: int, rows: dict[str, jax.Array]) -> jax.Array:
    _on_param_access(d, idx, "read")
    if layout.owner[idx] < 0:
      return inp.shared[shared_pos[idx]]
    if layout.owner[idx] != d:
      raise RuntimeError(f"internal: device {d} reads parameter leaf {idx} it does not own")
    n = math.prod(layout.shapes[idx])
    off = layout.offset[idx]
    row = rows[layout.row_of[idx]]
    if layout.read_in_place(idx):  # a slot row the leaf fills: read in place, no copy
      return row.reshape(layout.shapes[idx])
    return lax.slice(row, (off,), (off + n,)).reshape(layout.shapes[idx])

  def make_branch(
    gi: int, d: int, lay: tasks_lib.GroupLayout, windows: list[gradients.Window] | None
  ):
    carry_at = {j: p for p, j in enumerate(writing.get(gi, ()))}  # write -> position in the carry

    def branch(operand):
      sh_g, acc, dep = operand
      acc = list(acc)
      # This group's parameter gradients, in a window of this device's gradient row.
      # leaf -> its gradient from this device's gradient task (summed over repeated arguments)
      leaf_grads: dict[int, jax.Array] = {}
      # dtype -> (leaf, lookup, row ids, rows' gradients) of looked-up tables (`lookups`)
      leaf_rows: dict[str, list[Any]] = {}
      local: dict[Any, jax.Array] = {}
      pullbacks: dict[tuple[int, int], Any] = {}

      def read(key):
        if key in local:
          return local[key]
        loc = st.locs[(key, d)]
        return lax.slice(bufs[loc.buf], (loc.offset,), (loc.offset + loc.size,)).reshape(loc.shape)

      def args_of(node, c, need=None):
        out = []
        for i, v in enumerate(node.invars):
          if need is not None and i not in need:
            out.append(None)  # not used by this task
          elif v in consts:
            out.append(consts[v])
          elif v in kinds:
            kind, idx = kinds[v]
            if kind == graph_lib.PARAM:
              out.append(param_value(idx, d, inp.rows))
            elif kind == graph_lib.STATE:
              out.append(inp.state[idx])
            else:
              out.append(inp.microbatches[idx][c])
          else:
            out.append(read(("a", v, c)))
        return out

      for dd, op in lay.tasks:
        if dd != d:
          continue
        node, c = g.nodes[op.node], op.microbatch
        with jax.named_scope(task_scope(op.kind, op.node, c)):  # names its ops in HLO
          if op.kind == "F" or node.id in calls.remat or (node.id, c) in pullbacks:
            need = None
          else:
            need = set(calls.residuals(node.id, consts).arg_indices)
          args = args_of(node, c, need)
          if op.kind == "F":
            if node.id in calls.remat:
              full = calls.full_args(node.id, args)
              outs, _ = calls.split_outs(node.id, calls.fn(node.id)(*full))
            else:
              full = calls.full_args(node.id, args)
              outs, pb = jax.vjp(calls.fn(node.id), *full)
              outs, ids = calls.split_outs(node.id, outs)
              treedef, _, packed = split_pullback(pb, full, outs)
              packed = packed + ids
              res = calls.residuals(node.id, consts)
              if res.has_fresh:  # saved: res.stored; the others are made again in B
                packed = [packed[j] for j in res.stored]
              want = res.avals
              if [(p.shape, p.dtype) for p in packed] != [(a.shape, a.dtype) for a in want]:
                raise RuntimeError(f"internal: residuals of node {node.name} differ from the probe")
              calls.treedefs[node.id] = treedef
              pullbacks[(node.id, c)] = pb
              for j, r in enumerate(packed):
                local[("r", node.id, c, j)] = r
            for v, o in zip(node.outvars, outs):
              local[("a", v, c)] = o
              if v in write_of:
                j = carry_at[write_of[v]]
                if dtypes.is_float(v.aval.dtype):
                  acc[j] = acc[j] + o / jnp.asarray(k, o.dtype)
                elif c == k - 1:
                  acc[j] = o
            continue
          # B or W: the pullback of F(n, c).
          found = calls.lookups(node.id)
          ids = None
          if (node.id, c) in pullbacks:
            pb = pullbacks[(node.id, c)]
          elif node.id in calls.remat:
            outs, pb = jax.vjp(calls.fn(node.id), *calls.full_args(node.id, args))
            ids = calls.split_outs(node.id, outs)[1]
          else:
            res = calls.residuals(node.id, consts)
            leaves = pullback_leaves(
              res, calls.full_args(node.id, args), lambda i, n=node.id, c=c: read(("r", n, c, i)),
              lambda i, node=node, c=c: read(("a", node.outvars[i], c)))
            pb = jax.tree.unflatten(calls.treedefs[node.id], leaves)
          if found and ids is None:
            ids = [read(("r", node.id, c, j)) for j in calls.residuals(node.id, consts).ids]
          cts = []
          for v in node.outvars:
            a = v.aval
            if not dtypes.is_float(a.dtype):
              cts.append(np.zeros(a.shape, jax.dtypes.float0))
              continue
            ct = jnp.zeros(a.shape, a.dtype)
            for src in st.ct_sources.get(("a", v, c), []):
              ct = ct + read(src)
            if v is loss_var:
              ct = ct + jnp.asarray(1.0 / k, a.dtype)
            cts.append(ct)
          in_cts = pb(calls.full_cts(node.id, cts))
          if op.kind == "B":
            for key in st.makes[(d, op)]:  # ('g', var, c, node): summed over the var's positions
              v = key[1]
              total = None
              for i, u in enumerate(node.invars):
                if u is v:
                  total = in_cts[i] if total is None else total + in_cts[i]
              local[key] = total
          if op.kind == "W" or not st.schedule.split:
            tables = {lk.arg for lk in found}
            for j, lk in enumerate(found):  # a looked-up table's gradient: its rows' gradients
              idx = kinds[node.invars[lk.arg]][1]
              rows = in_cts[len(node.invars) + j].reshape(lk.rows, lk.row_elems)
              rid = lookups_lib.row_ids(lk, ids[j])
              _on_param_access(d, idx, "grad")
              if layout.owner[idx] < 0:  # a shared leaf: its gradient is carried whole
                p = shared_pos[idx]
                dense = jnp.zeros((lk.table_shape[0], lk.row_elems), lk.dtype).at[rid].add(
                  rows, mode="drop").reshape(lk.table_shape)
                sh_g = sh_g[:p] + [sh_g[p] + dense] + sh_g[p + 1 :]
              else:
                leaf_rows.setdefault(lk.dtype, []).append((idx, lk, rid, rows))
            for i, v in enumerate(node.invars):
              if v not in kinds or kinds[v][0] != graph_lib.PARAM or i in tables:
                continue
              idx = kinds[v][1]
              gv = in_cts[i]
              _on_param_access(d, idx, "grad")
              if layout.owner[idx] < 0:
                j = shared_pos[idx]
                sh_g = sh_g[:j] + [sh_g[j] + gv] + sh_g[j + 1 :]
              else:
                gv = gv.reshape(-1)
                leaf_grads[idx] = leaf_grads[idx] + gv if idx in leaf_grads else gv
      outs = []
      for lane in sorted(lay.sizes):
        dt = tasks_lib.lane_dtype(lane)
        parts, pos = [], 0
        for key, kdt, off, shape in sorted(
          (w for w in lay.writes[d] if w[1] == lane), key=lambda w: w[2]
        ):
          if off > pos:
            parts.append(jnp.zeros((off - pos,), dt))
          parts.append(local[key].reshape(-1).astype(dt))
          pos = off + math.prod(shape)
        if lay.sizes[lane] > pos:
          parts.append(jnp.zeros((lay.sizes[lane] - pos,), dt))
        outs.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
      if windows is None:
        return outs, None, acc, _token(dep)
      wins = []
      for w in windows:
        # Gradients at their offsets in the window, zeros between and around: a window that is
        # exactly one leaf's gradient is that array itself, with no second buffer.
        parts, pos = [], w.starts[d]
        for idx in w.leaves[d]:
          if layout.offset[idx] > pos:
            parts.append(jnp.zeros((layout.offset[idx] - pos,), w.dtype))
          gv = leaf_grads[idx] if idx in leaf_grads else jnp.zeros(
            (math.prod(layout.shapes[idx]),), w.dtype)
          parts.append(gv.astype(w.dtype))
          pos = layout.offset[idx] + gv.shape[0]
        if w.starts[d] + w.length > pos:
          parts.append(jnp.zeros((w.starts[d] + w.length - pos,), w.dtype))
        win = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        if zero_cuts is not None:  # [W, length/W]: row r is replica r's share
          win = zero_lib.to_chunks(win, w.starts[d], zero_cuts[w.row_key], W)
        wins.append(win)
      scattered = []
      for dt, length in sorted(row_lengths[gi].items()):
        parts = [lookups_lib.flat_positions(
                   lk, rid, layout.offset[idx], base[layout.row_of[idx]], flat_len[dt], W,
                   zero_cuts[layout.row_of[idx]] if zero_cuts is not None else None)
                 for idx, lk, rid, _ in leaf_rows.get(dt, [])]
        vals = [rows.reshape(-1).astype(dt) for _, _, _, rows in leaf_rows.get(dt, [])]
        scattered.append(lookups_lib.padded(parts, vals, length, dt))
      return outs, (wins, sh_g, scattered), acc, _token(dep)

    return branch

  dep = None  # an element of each gradient buffer the last group's windows were added into
  tokens = None  # the sum of the conditionals' 0 * dep (see _token)
  for gi, lay in enumerate(st.groups):
    windows = all_windows[gi]
    carry_grads = windows is not None
    carry = gshared if carry_grads else []
    acc = [writes[j] for j in writing.get(gi, ())]
    if M == 1:
      outs, new, acc, _ = make_branch(gi, 0, lay, windows)((carry, acc, None))
    else:
      branches = [make_branch(gi, d, lay, windows) for d in range(M)]
      outs, new, acc, tok = lax.switch(me, branches, (carry, acc, dep))
      if tok is not None:
        tokens = tok if tokens is None else tokens + tok
    for j, x in zip(writing.get(gi, ()), acc):
      writes[j] = x
    if carry_grads:
      wins, gshared, scattered = new
      last: dict[str, Any] = {}
      for dt, (pos, vals) in zip(sorted(row_lengths[gi]), scattered):
        # Looked-up tables' row gradients, added where they belong (`lookups.flat_positions`).
        grads[dt] = lookups_lib.scatter_add(grads[dt], pos, vals, W if zero_cuts is not None else 1)
        last.setdefault(dt, jnp.int32(0))
      # Add the window into this device's own row outside the conditional, in place: a whole
      # row carried through a conditional is copied by XLA on the way in and out.
      for w, win in zip(windows, wins):
        if w.row_key in single:
          whole[w.row_key] = win
          continue
        at = [base[w.row_key] + a for a in w.starts]
        length = w.length
        if zero_cuts is not None:  # this replica's share of the window, summed over replicas
          win = zero_lib.reduce_scatter(win, W, scatter_ring)
          at, length = [a // W for a in at], length // W
        start = jnp.asarray(at, jnp.int32)[me] if M > 1 else jnp.int32(at[0])
        # The offset goes through an optimization barrier: XLA's CPU backend emits a
        # dynamic-update-slice whose start it can fold to a constant as a pass over the whole
        # buffer, not in place (a 4 KiB window into a 34 MB buffer took 100 ms; with an
        # offset it cannot fold, 0.1 ms).
        start = lax.optimization_barrier(start)
        cur = lax.dynamic_slice(grads[w.dtype], (start,), (length,))
        grads[w.dtype] = lax.dynamic_update_slice(grads[w.dtype], cur + win, (start,))
        last[w.dtype] = start
      if M > 1 and last:
        # The next group's conditional reads one element of each buffer just updated, so XLA
        # adds these windows before it runs. Without a data dependence XLA's scheduler may put
        # the adds off past later conditionals and keep every window they return alive
        # (GNMT-small 1x2 1F1B k=4: four groups' windows at the peak). An optimization barrier
        # does not do it: XLA:CPU removes barriers before scheduling. (On one model device the
        # groups are not conditionals; there a first form of this dependence, 0 * dep added
        # into the next group's arrays, made the chain's temp larger.)
        dep = sum(
          lax.dynamic_slice(grads[dt], (at,), (1,))[0].astype(jnp.float32)
          for dt, at in sorted(last.items())
        )
    for dt, buf in zip(sorted(lay.sizes), outs):
      bufs[("out", gi, dt)] = buf
    for s, dt, start, length in st.message_plan(gi):
      part = lax.slice(bufs[("out", gi, dt)], (start,), (start + length,))
      perm = [(i, (i + s) % M) for i in range(M)]
      bufs[("recv", gi, s, dt)] = lax.ppermute(part, MODEL, perm=perm)
  total = None
  for key in st.loss_keys:
    loc = st.locs[(key, st.loss_device)]
    x = lax.slice(bufs[loc.buf], (loc.offset,), (loc.offset + loc.size,)).reshape(loc.shape)
    total = x if total is None else total + x
  loss = total / k
  if tokens is not None:  # keeps the dependences (0, or NaN when a gradient is not finite)
    loss = loss + tokens.astype(loss.dtype)
  if M > 1:
    loss = jnp.where(me == st.loss_device, loss, jnp.zeros_like(loss))
  return loss, grads, whole, gshared, writes
