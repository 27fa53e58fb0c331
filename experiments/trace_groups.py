r"""Where a 2-way plan's step goes: each lock-step group, measured on one-core devices vs priced.

    python experiments/bench_mp.py --models=gnmt --workdir=/tmp/bmp        # plans, profiles, link
    python experiments/trace_groups.py --workdir=/tmp/bmp --model=gnmt --plan=plan_gnmt_0.json \
        --out=trace_gnmt.json

Runs the plan as bench_mp's multi role does (mesh 1x2, two processes pinned to one core each,
jaxhybrid.program.localcluster), traces --trace_steps steps with `jax.profiler` (perfetto JSON)
in each process and cuts each device's timeline at the program's group conditionals (one
`lax.switch` per group): per group and device, `busy_s` is the time outside the group's
ppermutes (the branch, packing and unpacking) and `ppermute_s` the time inside them (the
transfer and the wait for the other device). Beside them, the lock-step model's price of the same
group (`jaxhybrid.program.lockstep`, from the workdir's node profiles and link): the device's
tasks (`tasks_s`) and the group's messages (`transfer_s`). Also each process's minor page faults
per step (getrusage). Reads bench_mp's workdir: single_{model}.json (batch, micro-batches,
branch_remat), link.json, profiles/. The trace event names ('conditional', 'ppermute') are those of
XLA's CPU runtime; registry models only (not bench_mp's chain).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import pathlib
import resource
import sys
import time

from absl import app, flags

flags.DEFINE_string("workdir", "/tmp/jaxhybrid_bench_mp", "bench_mp's workdir (plans, profiles, link).")
flags.DEFINE_string("model", "gnmt", "Registry model the plan was made for.")
flags.DEFINE_string("size", "small", "Model size preset (as bench_mp's --size).")
flags.DEFINE_string("plan", "", "Plan JSON, relative to --workdir (default plan_{model}.json).")
flags.DEFINE_enum("schedule", "1f1b", ["gpipe", "1f1b", "zb"], "Task schedule the program runs.")
flags.DEFINE_integer("steps", 3, "Timed steps before the trace.")
flags.DEFINE_integer("trace_steps", 2, "Traced steps.")
flags.DEFINE_string("out", "", "Write the JSON here.")
flags.DEFINE_string("role", "driver", "Internal: driver | trace.")
FLAGS = flags.FLAGS


def _settings(work: pathlib.Path) -> dict:
  single = json.loads((work / f"single_{FLAGS.model}.json").read_text())
  return {"batch": single["batch"], "k": single["microbatches"], "remat": single["branch_remat"]}


def _plan_path(work: pathlib.Path) -> pathlib.Path:
  return work / (FLAGS.plan or f"plan_{FLAGS.model}.json")


def role_trace(work: pathlib.Path) -> None:
  import jax
  import optax
  from flax import nnx

  from jaxhybrid import api, models, planner
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import localcluster

  localcluster.worker_init()
  cfg = _settings(work)
  spec = models.get(FLAGS.model, FLAGS.size)
  batch = spec.synthetic_batch(0, cfg["batch"])
  hy = api.parallelize(
    spec.make(nnx.Rngs(0)), spec.loss_fn, optax.adam(1e-4), batch, mesh=mesh_lib.make("1x2"),
    microbatches=cfg["k"], plan=planner.Plan.load(_plan_path(work)),
    program_options={"branch_remat": cfg["remat"], "schedule": FLAGS.schedule},
  )
  fn, state, shards = hy.program.step_fn(), hy.init(), hy.program.shard_batch(batch)
  for _ in range(2):  # the first compiles
    state, m = fn(state, shards)
  jax.block_until_ready(state)
  faults0, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
  for _ in range(FLAGS.steps):
    t0 = time.perf_counter()
    state, m = fn(state, shards)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t0)
  faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / FLAGS.steps
  rank = jax.process_index()
  folder = work / f"trace_{FLAGS.model}_{rank}"
  jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
  for _ in range(FLAGS.trace_steps):
    state, m = fn(state, shards)
    jax.block_until_ready((state, m))
  jax.profiler.stop_trace()
  (folder / "steps.json").write_text(json.dumps({"step_s": times, "minor_faults_per_step": faults}))


def _timeline(folder: pathlib.Path) -> list[tuple[str, float, float]]:
  """Outermost 'conditional' / 'ppermute' / 'all-reduce' events of the executing thread (s)."""
  path = glob.glob(str(folder / "**" / "*perfetto*"), recursive=True)[0]
  with gzip.open(path) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith("end:"):
      by_thread[e["tid"]].append(e)
  thread = max(by_thread, key=lambda t: sum(e["name"].startswith("conditional") for e in by_thread[t]))
  out, end = [], -1.0
  for e in sorted(by_thread[thread], key=lambda e: (e["ts"], -e["dur"])):
    kind = e["name"].split(".")[0]
    if kind in ("conditional", "ppermute", "all-reduce") and e["ts"] >= end:
      out.append((kind, e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))
      end = e["ts"] + e["dur"]
  return out


def _measured_groups(timeline, groups: int, steps: int) -> list[dict]:
  """Per group (averaged over the traced steps): busy and ppermute seconds on one device."""
  conds = [i for i, ev in enumerate(timeline) if ev[0] == "conditional"]
  if len(conds) < groups * steps:
    raise RuntimeError(f"the trace holds {len(conds)} group conditionals, expected {groups} x {steps}")
  out = [{"busy_s": 0.0, "ppermute_s": 0.0} for _ in range(groups)]
  for s in range(steps):
    prev_end = timeline[conds[s * groups]][1]
    for g in range(groups):
      i = conds[s * groups + g]
      nxt = conds[s * groups + g + 1] if s * groups + g + 1 < len(conds) else len(timeline)
      pp = [ev for ev in timeline[i + 1 : nxt] if ev[0] == "ppermute"]
      first = pp[0][1] if pp else (timeline[nxt][1] if nxt < len(timeline) else timeline[i][2])
      out[g]["busy_s"] += (first - prev_end) / steps
      out[g]["ppermute_s"] += sum(b - a for _, a, b in pp) / steps
      prev_end = pp[-1][2] if pp else first
  return out


def _priced_groups(work: pathlib.Path, cfg: dict) -> list[dict]:
  import jax.numpy as jnp
  from flax import nnx

  from jaxhybrid import api, costs, models, planner
  from jaxhybrid import graph as graph_lib
  from jaxhybrid.program import executor, lockstep
  from jaxhybrid.program import structure as structure_lib
  from jaxhybrid.program import tasks as tasks_lib

  spec = models.get(FLAGS.model, FLAGS.size)
  b, k = cfg["batch"], cfg["k"]
  batch = spec.synthetic_batch(0, b)
  micro_spec, _ = api.microbatch_spec(batch, b, b // k)
  _, p, s, pure = graph_lib.nnx_pure_loss(spec.make(nnx.Rngs(0)), spec.loss_fn)
  g = graph_lib.trace_function(pure, p, s, micro_spec)
  link = json.loads((work / "link.json").read_text())
  cm = costs.ProfiledCostModel(
    g, cache_dir=work / "profiles", branch_remat=cfg["remat"], tasks=True,
    link=costs.Link(alpha_s=link["alpha_s"], bandwidth_bytes_s=link["bandwidth"], source="bench_mp"),
  )
  plan = planner.Plan.load(_plan_path(work))
  fwd, bwd = lockstep.task_times(g, cm)
  _, st, _ = executor.structure_for(
    g, plan.assignment, plan.devices, plan.microbatches, FLAGS.schedule,
    order=structure_lib.plan_order(plan.schedule) or None, forward_s=fwd, branch_remat=cfg["remat"],
  )
  if st.schedule.split:
    b_in, w = lockstep.split_task_times(g, cm)
  out = []
  for gi, lay in enumerate(st.groups):
    tasks = [0.0] * plan.devices
    names = [[] for _ in range(plan.devices)]
    for d, op in lay.tasks:
      if op.kind == "F":
        tasks[d] += fwd[op.node]
      else:
        tasks[d] += (b_in if op.kind == "B" else w)[op.node] if st.schedule.split else bwd[op.node]
      names[d].append(f"{op.kind}{op.node}")
    transfer = 0.0
    for shift, dt, _, length in st.message_plan(gi):
      nbytes = length * jnp.dtype(tasks_lib.lane_dtype(dt)).itemsize
      transfer += max(cm.transfer_time_s(nbytes, i, (i + shift) % plan.devices)
                      for i in range(plan.devices))
    out.append({"tasks_s": tasks, "transfer_s": transfer, "tasks": [" ".join(n) for n in names]})
  return out


def driver() -> dict:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from jaxhybrid.program import localcluster

  work = pathlib.Path(FLAGS.workdir)
  cfg = _settings(work)
  argv = [__file__, "--role=trace", *(f"--{n}={getattr(FLAGS, n)}" for n in (
    "workdir", "model", "size", "plan", "schedule", "steps", "trace_steps"))]
  localcluster.launch(argv, 2)
  priced = _priced_groups(work, cfg)
  per_device, steps = [], []
  for rank in range(2):
    folder = work / f"trace_{FLAGS.model}_{rank}"
    per_device.append(_measured_groups(_timeline(folder), len(priced), FLAGS.trace_steps))
    steps.append(json.loads((folder / "steps.json").read_text()))
  groups = [{**pr, "busy_s": [d[gi]["busy_s"] for d in per_device],
             "ppermute_s": [d[gi]["ppermute_s"] for d in per_device]} for gi, pr in enumerate(priced)]
  totals = {
    "tasks_s": [sum(g["tasks_s"][d] for g in groups) for d in range(2)],
    "busy_s": [sum(g["busy_s"][d] for g in groups) for d in range(2)],
    "ppermute_s": [sum(g["ppermute_s"][d] for g in groups) for d in range(2)],
    "transfer_s": sum(g["transfer_s"] for g in groups),
    "lockstep_compute_s": sum(max(g["tasks_s"]) for g in groups),
  }
  return {"model": FLAGS.model, "plan": str(_plan_path(work)), "schedule": FLAGS.schedule, **cfg,
          "glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "processes": steps,
          "totals": totals, "groups": groups}


def main(argv):
  del argv
  if FLAGS.role == "trace":
    from jaxhybrid.program import localcluster

    localcluster.worker_setup()
    return role_trace(pathlib.Path(FLAGS.workdir))
  res = driver()
  t = res["totals"]
  print(f"{'group':>5} {'tasks_s d0/d1':>17} {'busy_s d0/d1':>17} {'ppermute_s d0/d1':>17} {'transfer_s':>10}")
  for gi, g in enumerate(res["groups"]):
    print(f"{gi:>5} {g['tasks_s'][0]:8.4f} {g['tasks_s'][1]:8.4f} {g['busy_s'][0]:8.4f} "
          f"{g['busy_s'][1]:8.4f} {g['ppermute_s'][0]:8.4f} {g['ppermute_s'][1]:8.4f} {g['transfer_s']:10.4f}")
  print(f"total tasks {t['tasks_s']}, busy {t['busy_s']}, ppermute {t['ppermute_s']}, "
        f"steps {[p['step_s'] for p in res['processes']]}, "
        f"faults/step {[p['minor_faults_per_step'] for p in res['processes']]}")
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
