"""Per-device memory of the hybrid program vs what a user would run instead, compiled, no allocation.

  python experiments/bench/bench_memory.py --out=experiments/results/bench_memory.json   # ~10-20 min
  python experiments/bench/bench_memory.py --models=chain --out=/tmp/m.json              # ~2 min

For each model, mesh 1xM and task schedule: XLA's compile-time memory analysis of the jitted
step lowered from abstract inputs (arguments + temporaries per device), our predicted bytes
(`HybridProgram.memory`) and their error; beside them, on the same M devices, plain data
parallelism (`jax.jit`, parameters replicated) and FSDP (parameters and optimizer state sharded
over all devices with `NamedSharding`). Nothing is allocated, so paper sizes run on a CPU host.
Results are written after every row. Targets: the uniform 8-layer chain at
1x8 <= 0.25x and at 1x2 <= 0.6x its 1x1 bytes; 1F1B temp at k=16 <= 0.75x temp at k=4 (1x4,
global batch 2048), and at most 1.10x with a fixed micro-batch size (`--fixed_microbatch` rows:
the chain at 1x4, BigLSTM small at 1x2); predicted within 15 % of compiled; paper BigLSTM with AdaGrad fits a 16 GiB
V100 at 1x2 and not at 1x1; hybrid within 1.3x of FSDP. `--zero_rows`: the hybrid on D x M
meshes at each ZeRO stage (`HybridProgram.zero`) beside FSDP on the same D x M devices, with
summary keys `<model>_<DxM>_zero<stage>_over_zero0` and `..._over_fsdp`. `--planned_rows`: the
plan `parallelize` makes with its defaults (shard options, the hardware's cap) beside FSDP.
"""

from __future__ import annotations

import json
import os
import sys
import time

import bench_memory_summary  # experiments/bench/ (the script's folder)
import provenance
from absl import app, flags

_MODELS = flags.DEFINE_list(
  "models", ["chain", "chain_big_batch", "biglstm:small", "gnmt:small", "inception_v3:small",
             "biglstm:paper"], "chain, chain_big_batch, or <registry name>:<size>.")
_MESHES = flags.DEFINE_list("model_axis", ["1", "2", "4", "8"], "M values (mesh 1xM).")
_SCHEDULES = flags.DEFINE_list("schedules", ["gpipe", "1f1b", "zb"], "Task schedules.")
_OUT = flags.DEFINE_string("out", "experiments/results/bench_memory.json", "Results JSON.")
_FIXED_MB = flags.DEFINE_list(
  "fixed_microbatch", ["chain:4", "biglstm:small:2"],
  "<model>:<M> (chain, or <registry name>:<size>) whose 1F1B temp is compiled at k = 4, 8, 16 "
  "with a fixed micro-batch size (FIXED_MB_ROWS rows): the batch grows with k.")
# Rows per micro-batch of the fixed-micro-batch rows (assumption: small enough that a chain's
# activations, not its parameters, are most of the temporaries at 1x4).
FIXED_MB_ROWS = 32
_ZERO_ROWS = flags.DEFINE_list(
  "zero_rows", ["chain:2x2", "chain:4x2", "chain:8x2", "chain:16x2", "gnmt:paper:8x2",
                "biglstm:paper:16x2"],
  "<model>:<DxM> (chain, or <registry name>:<size>:<DxM>) compiled with each --zero_stages "
  "stage, beside FSDP on the same D x M devices (per-worker batch as the other rows).")
_PLANNED_ROWS = flags.DEFINE_list(
  "planned_rows", ["biglstm:paper:4", "biglstm:paper:8", "biglstm:paper:8:7", "gnmt:small:4",
                   "gnmt:small:8", "inception_v3:small:4", "inception_v3:small:8"],
  "<registry name>:<size>:<M>[:<cap GiB>][:batch][:k<N>][:temps]: the plan `parallelize` makes "
  "by default (shard options on, the hardware's memory cap or the given one, DGX-1 V100 costs), "
  "1F1B with k = M (or N), compiled on 1 x M; ':batch' also offers the batch split with sliced "
  "parameters (run.py --batch_split --batch_split_params=split); ':temps' gives the planner the "
  "program's task temporaries whatever the model's size (planner_options task_temp='program'; "
  "by default only near the cap); rows '<name>:<size>@planner' ('..._cap<C>GiB' with a cap, "
  "'..._batch_split' with ':batch', '..._task_temps' with ':temps'), summary keys "
  "'<row model>_1x<M>_over_fsdp' (FSDP from the same model's registry row at that M, when "
  "present) and 'planner_device_error_max' (the planner's per-device figure against the "
  "compiled bytes, every device of every planned row).")
_BATCH_SPLIT_ROWS = flags.DEFINE_list(
  "batch_split_rows", [],
  "<model>:<M>:<k> (chain, or <registry name>:<size>:<M>:<k>): every node that splits by rows "
  "of the micro-batch split over 1 x M (`batch_split.split_batch`, nodes of >= 5 % of the "
  "FLOPs), pieces and parameter slices one per device, the other nodes where the placed rows "
  "put them; compiled with the split nodes' parameters 'replicated' and 'split', beside the "
  "placed program and FSDP. Rows '<model>@batch_split_<params>' and '<model>@placed'; summary "
  "keys '<model>_1x<M>_k<k>_batch_split_<params>_over_fsdp' and "
  "'..._split_over_replicated'. Default none: bench_memory_batch_split.json is written by "
  "`--models= --fixed_microbatch= --planned_rows= --zero_rows= --batch_split_rows=...`.")
_ZERO_STAGES = flags.DEFINE_list("zero_stages", ["0", "1", "2"], "ZeRO stages of the zero rows.")
_UPDATE = flags.DEFINE_boolean(
  "update", False, "Keep the rows already in --out and replace (or add) only the rows this run "
  "measures; each row records the commit of the program that measured it ('program').")
_BASELINES = flags.DEFINE_boolean("baselines", True, "Also compile plain-jit DP and FSDP.")
_SLOT = flags.DEFINE_integer(
  "slot_min_bytes", -1, "structure.SLOT_MIN_BYTES for the program: leaves of this many bytes or "
  "more get slot rows (0: none; -1: the library default).")

GiB = 2**30


def _chain_setup(width: int, layers: int, batch: int):
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import chain_model  # experiments/bench/ (the script's folder)

  loss = chain_model.loss_fn
  model = nnx.eval_shape(lambda: chain_model.make(width, layers, 16, nnx.Rngs(0)))
  spec = {"x": jax.ShapeDtypeStruct((batch, 16), jnp.float32),
          "y": jax.ShapeDtypeStruct((batch, 16), jnp.float32)}

  def assign(node, m):
    parts = node.name.split("/")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
      return int(parts[1]) * m // layers
    return 0 if parts[0] == "inp" else m - 1

  return model, loss, spec, optax.adam(1e-3), assign


def _registry_setup(name: str, size: str, batch_rows: int | None = None):
  import jax
  import optax
  from flax import nnx

  from jaxhybrid import models

  spec = models.get(name, size)
  model = nnx.eval_shape(lambda: spec.make(nnx.Rngs(0)))
  from jaxhybrid.projection import paper_scenario

  per = paper_scenario.PAPER_MODELS[name].per_gpu_batch if size == "paper" else 8
  per = batch_rows or per
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), spec.synthetic_batch(0, per))
  # The paper trains BigLSTM with AdaGrad (PAPER.md); Adam elsewhere.
  opt = optax.adagrad(0.2) if name == "biglstm" else optax.adam(1e-3)
  return model, spec.loss_fn, batch, opt, None


def _hybrid(model, loss, batch, opt, assign, m, k, schedule, data=1, zero=0):
  """The program on a data x m mesh: the chain placed evenly by `assign`; registry models by
  the 'dp' planner."""
  import types

  import jax

  from jaxhybrid import api
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid import program as program_lib

  mesh = mesh_lib.make(mesh_lib.MeshShape(data, m), jax.devices()[:data * m])
  if assign is None:
    return api.parallelize(
      model, loss, opt, batch, mesh=mesh, microbatches=k, planner="dp", hardware="dgx1-v100",
      program_options={"schedule": schedule, "zero": zero},
    )
  b = jax.tree.leaves(batch)[0].shape[0]
  spec, per_example = api.microbatch_spec(batch, b, b // (data * k))
  _, p, s, pure = graph_lib.nnx_pure_loss(model, loss)
  g = graph_lib.trace_function(pure, p, s, spec)
  prog = program_lib.HybridProgram.build(
    g, mesh, opt, [assign(n, m) for n in g.nodes], microbatches=k, per_example=per_example,
    schedule=schedule, zero=zero,
  )
  return types.SimpleNamespace(graph=g, program=prog)


def _baselines(model, loss, batch, opt, m, modes=("dp", "fsdp")):
  import jax

  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import memory

  mesh = mesh_lib.make(mesh_lib.MeshShape(1, m), jax.devices()[:m])
  _, p, s, pure = graph_lib.nnx_pure_loss(model, loss, scopes=False)
  return {mode: memory.baseline_bytes(pure, p, s, batch, opt, mesh, mode) for mode in modes}


def _counts_temps(hy, opts, opt) -> bool:
  """Whether `parallelize` gave this row's planner the tasks' temporaries (fit.planner_task_temp,
  with the row's options, the V100's cap and the optimizer's state factor)."""
  from jaxhybrid import api
  from jaxhybrid.program import fit

  costs = api.default_costs("dgx1-v100")
  factor = api.optimizer_state_factor(opt, hy.graph)
  got = fit.planner_task_temp(dict(opts), hy.graph, costs, factor, {}, (), hy.mesh)
  return got.get("task_temp") is not None


def _planned_rows(rows, skipped, out_path, slot_min_bytes):
  """Per --planned_rows entry: what a user gets from `parallelize` with its defaults (the
  planner's choice between whole and split leaves under the hardware's memory cap)."""
  import jax

  from jaxhybrid import api
  from jaxhybrid import mesh as mesh_lib

  for entry in _PLANNED_ROWS.value:
    name, size, m, *rest = entry.split(":")
    m = int(m)
    batch_split, temps = "batch" in rest, "temps" in rest
    k = next((int(x[1:]) for x in rest if x[:1] == "k" and x[1:].isdigit()), m)
    cap = [x for x in rest
           if x not in ("batch", "temps") and not (x[:1] == "k" and x[1:].isdigit())]
    label = (f"{name}:{size}@planner" + (f"_cap{cap[0]}GiB" if cap else "")
             + ("_batch_split" if batch_split else "") + ("_task_temps" if temps else ""))
    opts = {"memory_caps_bytes": int(float(cap[0]) * GiB)} if cap else {}
    opts |= {"task_temp": "program"} if temps else {}
    if batch_split:  # run.py --batch_split --batch_split_params=split
      opts |= {"shard_rules": ("lookup", "column", "batch"), "batch_split_params": "split"}
    model, loss, batch, opt, _ = _registry_setup(name, size)
    t0 = time.perf_counter()
    try:
      hy = api.parallelize(
        model, loss, opt, batch, mesh=mesh_lib.make(mesh_lib.MeshShape(1, m), jax.devices()[:m]),
        microbatches=k, hardware="dgx1-v100", program_options={"schedule": "1f1b"},
        planner_options=opts or None)
      r = hy.program.memory()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
      skipped.append(f"{entry} planned: {type(e).__name__}: {str(e)[:200]}")
      print("SKIPPED", skipped[-1], flush=True)
      continue
    spread = [len(set(d)) > 1 for d in hy.plan.shard_devices()]
    # The planner's own figure per device against the compiled one (the same on every device).
    peaks = [float(x) for x in hy.plan.device_peak_bytes]
    planner_err = [p / r.compiled - 1 for p in peaks]
    rows.append({"model": label, "M": m, "k": k, "schedule": "1f1b",
                 "cap_bytes": int(min(hy.plan.memory_caps_bytes or (0,))),
                 "nodes": len(hy.graph.nodes), "plan_method": hy.plan.method,
                 "split_leaves": len(spread), "spread_leaves": sum(spread),
                 "batch_split_nodes": len(hy.graph.batch_splits),
                 "planner_task_temp": opts.get("task_temp", "auto"),
                 "planner_counted_task_temps": _counts_temps(hy, opts, opt), **r.to_dict(),
                 "planner_device_peak": peaks, "planner_device_error": planner_err,
                 "predicted_step_s": hy.plan.predicted_step_s,
                 "seconds": time.perf_counter() - t0})
    print(f"{label:<30} 1x{m} k={k} compiled {r.compiled / GiB:8.3f} GiB "
          f"predicted {r.predicted / GiB:8.3f} err {r.error:+6.1%}; planner per device "
          f"{min(planner_err):+6.1%}..{max(planner_err):+6.1%}; leaves split {len(spread)}, "
          f"spread {sum(spread)}; predicted step {hy.plan.predicted_step_s * 1e3:.1f} ms", flush=True)
    _write(out_path, rows, skipped, slot_min_bytes)


def _batch_split_rows(rows, skipped, out_path, slot_min_bytes):
  """Per --batch_split_rows entry: the same model with its nodes split by rows, parameters
  replicated vs stored in slices, beside the placed program and FSDP (same devices, batch, k)."""
  import re

  import jax

  from jaxhybrid import api
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid import program as program_lib
  from jaxhybrid.graph import batch_split

  for entry in _BATCH_SPLIT_ROWS.value:
    *name, m, k = entry.split(":")
    name, m, k = ":".join(name), int(m), int(k)
    if name == "chain":
      model, loss, batch, opt, assign = _chain_setup(2048, 8, 64 * k)
    else:
      model, loss, batch, opt, assign = _registry_setup(*name.split(":"))
      # micro-batches of the registry rows' batch (8 rows, or the paper's per-GPU batch) each
      rows_per = jax.tree.leaves(batch)[0].shape[0]
      model, loss, batch, opt, assign = _registry_setup(*name.split(":"), rows_per * k)
    mesh = mesh_lib.make(mesh_lib.MeshShape(1, m), jax.devices()[:m])
    b = jax.tree.leaves(batch)[0].shape[0]
    spec, per_example = api.microbatch_spec(batch, b, b // k)
    _, p, s, pure = graph_lib.nnx_pure_loss(model, loss, with_state=True)
    g0 = graph_lib.trace_function(pure, p, s, spec)
    placed = _hybrid(model, loss, batch, opt, assign, m, k, "1f1b")
    where = dict(zip((n.name for n in placed.graph.nodes), placed.program.assignment))
    small = batch_split.trace_small(pure, p, s, spec, per_example, m)
    fsdp = _baselines(model, loss, batch, opt, m, modes=("fsdp",))["fsdp"]["total"]
    for label, prog in [("placed", placed.program)] + [
        (f"batch_split_{params}", None) for params in batch_split.PARAMS]:
      t0 = time.perf_counter()
      try:
        if prog is None:
          g, rep = batch_split.split_batch(g0, small, m, min_fraction=0.05,
                                           params=label.rsplit("_", 1)[1])
          own = [re.search(r"/(batch|params)(\d+)$", n.name) for n in g.nodes]
          prog = program_lib.HybridProgram.build(
            g, mesh, opt, [int(o.group(2)) if o else int(where[n.name])
                           for o, n in zip(own, g.nodes)],
            microbatches=k, state=s, per_example=per_example, schedule="1f1b")
        r = prog.memory()
      except Exception as e:  # noqa: BLE001 - reported, not fatal
        skipped.append(f"{entry} {label}: {type(e).__name__}: {str(e)[:200]}")
        print("SKIPPED", skipped[-1], flush=True)
        continue
      rows.append({"model": f"{name}@{label}", "M": m, "k": k, "schedule": "1f1b",
                   "nodes": len(prog.graph.nodes), **r.to_dict(), "fsdp_total": fsdp,
                   "seconds": time.perf_counter() - t0})
      print(f"{name + '@' + label:<32} 1x{m} k={k:<3} compiled {r.compiled / GiB:8.3f} GiB "
            f"(args {r.compiled_arguments / GiB:.3f}, temp {r.compiled_temp / GiB:.3f}) "
            f"predicted {r.predicted / GiB:8.3f} err {r.error:+6.1%} | FSDP {fsdp / GiB:8.3f}",
            flush=True)
      _write(out_path, rows, skipped, slot_min_bytes)


def _zero_rows(rows, skipped, out_path, slot_min_bytes):
  """Per --zero_rows entry: the hybrid at each ZeRO stage and FSDP over the same D x M devices,
  with the same per-worker batch (the chain's 64 rows; a registry model's paper per-GPU batch
  or 8), so the global batch is D times that."""
  import jax

  for entry in _ZERO_ROWS.value:
    name, mesh_spec = entry.rsplit(":", 1)
    d, m = (int(x) for x in mesh_spec.split("x"))
    if d * m > len(jax.devices()):
      skipped.append(f"{entry}: only {len(jax.devices())} devices")
      continue
    if name == "chain":
      model, loss, batch, opt, assign = _chain_setup(2048, 8, 64 * d)
    else:
      rows_per = _registry_setup(*name.split(":"))[2]
      per = jax.tree.leaves(rows_per)[0].shape[0]
      model, loss, batch, opt, assign = _registry_setup(*name.split(":"), per * d)
    k = m
    for z in (int(x) for x in _ZERO_STAGES.value):
      t0 = time.perf_counter()
      try:
        hy = _hybrid(model, loss, batch, opt, assign, m, k, "1f1b", data=d, zero=z)
        r = hy.program.memory()
      except Exception as e:  # noqa: BLE001 - reported, not fatal
        skipped.append(f"{entry} zero={z}: {type(e).__name__}: {str(e)[:200]}")
        print("SKIPPED", skipped[-1], flush=True)
        continue
      row = {"model": f"{name}@zero", "mesh": mesh_spec, "D": d, "M": m, "k": k, "zero": z,
             "schedule": "1f1b", "nodes": len(hy.graph.nodes), **r.to_dict(),
             "seconds": time.perf_counter() - t0}
      if z == 0 and _BASELINES.value:
        try:
          row["baselines"] = _baselines(model, loss, batch, opt, d * m, modes=("fsdp",))
        except Exception as e:  # noqa: BLE001
          row["baselines_error"] = f"{type(e).__name__}: {str(e)[:200]}"
      rows.append(row)
      fsdp = row.get("baselines", {}).get("fsdp", {}).get("total")
      print(f"{name:<18} {mesh_spec:<5} zero={z} compiled {r.compiled / GiB:8.3f} GiB "
            f"(args {r.compiled_arguments / GiB:.3f}, temp {r.compiled_temp / GiB:.3f}) "
            f"predicted {r.predicted / GiB:8.3f} err {r.error:+6.1%}"
            + (f" | FSDP {fsdp / GiB:8.3f}" if fsdp else ""), flush=True)
      _write(out_path, rows, skipped, slot_min_bytes)


def _cases(name: str):
  """(M, k, schedule) per model: a few k per M."""
  ms = [int(x) for x in _MESHES.value]
  if name == "chain_big_batch":
    return [(4, k, s) for k in (4, 16) for s in _SCHEDULES.value]
  out = []
  for m in ms:
    for s in (_SCHEDULES.value if m > 1 else ["1f1b"]):
      for k in sorted({1 if m == 1 else m, 2 * m if m > 1 else 1}):
        out.append((m, k, s))
  return out


def main(argv):
  del argv
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from jaxhybrid import mesh as mesh_lib

  need = [8] + [int(a) * int(b) for a, b in
                (e.rsplit(":", 1)[1].split("x") for e in _ZERO_ROWS.value)]
  mesh_lib.simulate_cpu_devices(max(need))
  import jax

  from jaxhybrid.program import structure

  if _SLOT.value >= 0:
    structure.SLOT_MIN_BYTES = _SLOT.value or None

  rows = []
  out_path = _OUT.value
  global _KEPT, _KEPT_SKIPPED, _PROGRAM
  _PROGRAM = provenance.program_commit()
  if _UPDATE.value and os.path.exists(out_path):
    with open(out_path) as f:
      old = json.load(f)
    _KEPT, _KEPT_SKIPPED = old["rows"], old.get("skipped", [])
  os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
  skipped = []
  for entry in _MODELS.value:
    if entry == "chain":
      setup = _chain_setup(2048, 8, 64)
    elif entry == "chain_big_batch":
      setup = _chain_setup(2048, 8, 2048)
    else:
      name, size = entry.split(":")
      setup = _registry_setup(name, size)
    model, loss, batch, opt, assign = setup
    base_done = set()
    for m, k, sched in _cases(entry):
      if m > len(jax.devices()):
        skipped.append(f"{entry} M={m}: only {len(jax.devices())} devices")
        continue
      per_ex = jax.tree.leaves(batch)[0].shape[0]
      if per_ex % k:
        skipped.append(f"{entry} M={m} k={k}: batch {per_ex} not divisible")
        continue
      t0 = time.perf_counter()
      try:
        hy = _hybrid(model, loss, batch, opt, assign, m, k, sched)
        r = hy.program.memory()
      except Exception as e:  # noqa: BLE001 - a case that does not build is reported, not fatal
        skipped.append(f"{entry} M={m} k={k} {sched}: {type(e).__name__}: {str(e)[:200]}")
        print("SKIPPED", skipped[-1], flush=True)
        continue
      row = {"model": entry, "M": m, "k": k, "schedule": sched, "nodes": len(hy.graph.nodes),
             "in_flight": hy.program.schedule.in_flight(), **r.to_dict(),
             "seconds": time.perf_counter() - t0}
      if _BASELINES.value and m not in base_done:
        base_done.add(m)
        try:
          row["baselines"] = _baselines(model, loss, batch, opt, m)
        except Exception as e:  # noqa: BLE001
          row["baselines_error"] = f"{type(e).__name__}: {str(e)[:200]}"
      rows.append(row)
      base = next((b for b in rows if b["model"] == entry and "baselines" in b and b["M"] == m), None)
      fsdp = base["baselines"]["fsdp"]["total"] / GiB if base else float("nan")
      dp = base["baselines"]["dp"]["total"] / GiB if base else float("nan")
      print(f"{entry:<18} 1x{m} k={k:<3} {sched:<5} compiled {r.compiled / GiB:8.3f} GiB "
            f"(args {r.compiled_arguments / GiB:.3f}, temp {r.compiled_temp / GiB:.3f}) "
            f"predicted {r.predicted / GiB:8.3f} err {r.error:+6.1%} | DP {dp:8.3f} FSDP "
            f"{fsdp:8.3f}", flush=True)
      _write(out_path, rows, skipped, structure.SLOT_MIN_BYTES)
  for entry in _FIXED_MB.value:
    name, m = entry.rsplit(":", 1)
    for k in (4, 8, 16):
      if name == "chain":
        model, loss, batch, opt, assign = _chain_setup(256, 8, FIXED_MB_ROWS * k)
      else:
        model, loss, batch, opt, assign = _registry_setup(*name.split(":"), FIXED_MB_ROWS * k)
      t0 = time.perf_counter()
      hy = _hybrid(model, loss, batch, opt, assign, int(m), k, "1f1b")
      r = hy.program.memory()
      rows.append({"model": f"{name}@fixed_mb", "M": int(m), "k": k, "schedule": "1f1b",
                   "microbatch_rows": FIXED_MB_ROWS, "nodes": len(hy.graph.nodes), **r.to_dict(),
                   "seconds": time.perf_counter() - t0})
      print(f"{name + '@fixed_mb':<18} 1x{m} k={k:<3} 1f1b  temp {r.compiled_temp / 2**20:8.2f} MiB "
            f"err {r.error:+6.1%}", flush=True)
      _write(out_path, rows, skipped, structure.SLOT_MIN_BYTES)
  _planned_rows(rows, skipped, out_path, structure.SLOT_MIN_BYTES)
  _zero_rows(rows, skipped, out_path, structure.SLOT_MIN_BYTES)
  _batch_split_rows(rows, skipped, out_path, structure.SLOT_MIN_BYTES)
  # The summary of the file's rows (with --update, the kept ones too), as written.
  written = _write(out_path, rows, skipped, structure.SLOT_MIN_BYTES)
  print(json.dumps(bench_memory_summary.summary(written), indent=1))


# Rows (and skipped cases) of an earlier run kept by --update, and the commit this run measures.
_KEPT: list[dict] = []
_KEPT_SKIPPED: list[str] = []
_PROGRAM = None


def _row_key(r):
  return (r["model"], r.get("mesh"), r["M"], r["k"], r["schedule"], r.get("zero"))


def _write(path, rows, skipped, slot_min_bytes):
  """The results so far (written after every row, so a cut run keeps what it measured); returns
  the rows written (the kept rows of an --update run first)."""
  for r in rows:
    r.setdefault("program", _PROGRAM)
  new = {_row_key(r) for r in rows}
  rows = [r for r in _KEPT if _row_key(r) not in new] + rows
  skipped = [x for x in _KEPT_SKIPPED if x not in skipped] + list(skipped)
  with open(path, "w") as f:
    json.dump({"rows": rows, "skipped": skipped, "summary": bench_memory_summary.summary(rows),
               "slot_min_bytes": slot_min_bytes}, f, indent=1)
  return rows


if __name__ == "__main__":
  sys.exit(app.run(main))
