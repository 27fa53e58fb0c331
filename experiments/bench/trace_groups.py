r"""Where a 2-way plan's step goes: each lock-step group, measured on one-core devices vs priced.

    python experiments/bench/bench_mp.py --models=gnmt --workdir=/tmp/bmp        # plans, profiles, link
    python experiments/bench/trace_groups.py --workdir=/tmp/bmp --model=gnmt --plan=plan_gnmt_0.json \
        --out=trace_gnmt.json

Runs the plan as bench_mp's time stage does (mesh 1x2, two processes pinned to one core each,
jaxhybrid.program.localcluster), traces --trace_steps steps with `jax.profiler` (perfetto JSON)
in each process and cuts each step at the group conditionals (one `lax.switch` per group) when
the step holds one per group, else at the messages (each group's ppermutes, in group order) when
it holds the program's number, else reports totals only (XLA may fold a small conditional into
selects, or drop or combine a message). Per group and device: `busy_s`, the time from the
previous group's last message to this group's first (the branch, packing, unpacking), and
`ppermute_s`, the time inside this group's ppermutes (the transfer and the wait for the other
device); `after_last_message_s`: the rest of the step (the last groups' tasks, the optimizer
update, the all-reduce). Beside them, the lock-step model's price of the same group
(`jaxhybrid.program.lockstep.group_prices`, from the workdir's node profiles and link): each device's tasks
(`tasks_s`) and the group's messages (`transfer_s`). Also each process's minor page faults per
step (getrusage). Per device, `attribution`: each task's measured time (its instructions' own
time, found through the task scopes the program names in its HLO, task_attribution.py; the
median over the traced steps, F and B summed over the micro-batches) beside its price, and the
time outside every task per category. Reads bench_mp's workdir: single_{model}.json (batch,
micro-batches, branch_remat), link.json, profiles/. The trace event names are those of XLA's CPU
runtime; registry models only (not bench_mp's chain).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import pathlib
import resource
import shutil
import sys
import time

from absl import app, flags

flags.DEFINE_string("workdir", "/tmp/jaxhybrid_bench_mp", "bench_mp's workdir (plans, profiles, link).")
flags.DEFINE_string("model", "gnmt", "Registry model the plan was made for.")
flags.DEFINE_string("size", "small", "Model size preset (as bench_mp's --size).")
flags.DEFINE_string("plan", "", "Plan JSON, relative to --workdir (default plan_{model}.json).")
flags.DEFINE_enum("schedule", "1f1b", ["gpipe", "1f1b", "zb", "auto"],
                  "Task schedule the program runs ('auto': the plan's own, as bench_mp --schedule=auto).")
flags.DEFINE_integer("steps", 3, "Timed steps before the trace.")
flags.DEFINE_integer("trace_steps", 3, "Traced steps (per-task figures: the median over them).")
flags.DEFINE_string("out", "", "Write the JSON here.")
flags.DEFINE_string("role", "driver", "Internal: driver | trace.")
FLAGS = flags.FLAGS


def _settings(work: pathlib.Path) -> dict:
  single = json.loads((work / f"single_{FLAGS.model}.json").read_text())
  return {"batch": single["batch"], "k": single["microbatches"], "remat": single["branch_remat"],
          "overrides": single.get("model_overrides", {}),  # e.g. BigLSTM's time_chunks
          # how bench_mp timed the node profiles (part of their cache keys)
          "timing": {"min_time_s": single.get("profile_min_time_s", 0.0),
                     "flush_bytes": single.get("profile_flush_bytes", 0)},
          # the share bench_mp priced between its back-to-back and flushed profiles, if any
          "cold_share": (single.get("profile_blend") or {}).get("cold_share")}


def _spec(cfg: dict):
  """The model as bench_mp ran it: a registry model, or bench_mp's uniform chain."""
  if FLAGS.model == "chain":
    import chain_model  # experiments/bench/ (the script's folder)

    return chain_model.spec(**cfg["overrides"])
  from jaxhybrid import models

  return models.get(FLAGS.model, FLAGS.size, **cfg["overrides"])


def _plan_path(work: pathlib.Path) -> pathlib.Path:
  return work / (FLAGS.plan or f"plan_{FLAGS.model}.json")


def _hlo_dir(work: pathlib.Path, rank: int) -> pathlib.Path:
  return work / f"trace_{FLAGS.model}_{rank}_hlo"


def role_trace(work: pathlib.Path) -> None:
  # The optimized HLO of the step, for the per-task attribution (task_attribution.py); XLA reads
  # its flags when JAX starts its backend, below.
  from jaxhybrid.program import localcluster

  hlo = _hlo_dir(work, int(os.environ.get(localcluster.ENV_RANK, "0")))
  shutil.rmtree(hlo, ignore_errors=True)
  # (first: XLA's parser ignores what follows a word that is not a flag)
  os.environ["XLA_FLAGS"] = (f"--xla_dump_to={hlo} --xla_dump_hlo_as_text "
                             f"--xla_dump_hlo_module_re=jit_step {os.environ.get('XLA_FLAGS', '')}")
  import jax
  import optax
  from flax import nnx

  from jaxhybrid import api, planner
  from jaxhybrid import mesh as mesh_lib

  localcluster.worker_init()
  cfg = _settings(work)
  spec = _spec(cfg)
  batch = spec.synthetic_batch(0, cfg["batch"])
  hy = api.parallelize(
    spec.make(nnx.Rngs(0)), spec.loss_fn, optax.adam(1e-4), batch, mesh=mesh_lib.make("1x2"),
    microbatches=cfg["k"], plan=planner.Plan.load(_plan_path(work)),
    program_options={"branch_remat": cfg["remat"],
                     **({} if FLAGS.schedule == "auto" else {"schedule": FLAGS.schedule})},
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
  shutil.rmtree(folder, ignore_errors=True)  # the profiler adds a dated folder per run
  jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
  for _ in range(FLAGS.trace_steps):
    state, m = fn(state, shards)
    jax.block_until_ready((state, m))
  jax.profiler.stop_trace()
  (folder / "steps.json").write_text(json.dumps({"step_s": times, "minor_faults_per_step": faults,
                                                 "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}))


def _events(folder: pathlib.Path) -> list[dict]:
  """The events of the newest perfetto trace under `folder`."""
  path = max(glob.glob(str(folder / "**" / "*perfetto*"), recursive=True), key=os.path.getmtime)
  with gzip.open(path) as f:
    events = json.load(f)
  return events["traceEvents"] if isinstance(events, dict) else events


STEP_EVENT = "ThunkExecutor::Execute (wait for completion)"  # one per executed step (XLA:CPU)
EXECUTE_EVENT = "ThunkExecutor::Execute"  # an execution of thunks (a step, a branch, a loop body)


def _timeline(folder: pathlib.Path) -> tuple[list[tuple[str, float, float]], list[tuple[float, float]]]:
  """Outermost ppermute / conditional / all-reduce events of the executing thread and the
  executed steps' windows, in seconds."""
  events = _events(folder)
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith("end:"):
      by_thread[e["tid"]].append(e)
  thread = max(by_thread, key=lambda t: sum(e["name"].startswith("ppermute") for e in by_thread[t]))
  windows = _step_windows(by_thread, thread)
  kinds = ("conditional", "ppermute", "all-reduce")
  out = [(e["name"].split(".")[0], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6)
         for e in _outermost(by_thread[thread], lambda e: e["name"].split(".")[0] in kinds)]
  return out, windows


def _outermost(events, keep) -> list[dict]:
  """The events for which keep(e) holds that lie inside no earlier kept one, in time order."""
  out, end = [], -1.0
  for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
    if keep(e) and e["ts"] >= end:
      out.append(e)
      end = e["ts"] + e["dur"]
  return out


def _step_windows(by_thread, thread) -> list[tuple[float, float]]:
  """The executed steps' windows (s): each caller's wait for a step, begun earlier where XLA ran
  the step's thunks on the calling thread itself before the wait (the wait then lasts ~0 s): at
  the first outermost execution on the executing thread since the previous step."""
  waits = sorted((e["ts"], e["dur"]) for es in by_thread.values() for e in es if e["name"] == STEP_EVENT)
  outer = [e["ts"] for e in _outermost(by_thread[thread], lambda e: e["name"] == EXECUTE_EVENT)]
  windows, prev = [], float("-inf")
  for t, d in waits:
    lo = min([t] + [s for s in outer if prev <= s <= t + d])
    windows.append((lo * 1e-6, (t + d) * 1e-6))
    prev = t + d
  return windows


def _group_messages(events, messages: list[int]):
  """Each group's ppermute events within one step, or None when the trace cannot be cut.

  Cut at the group conditionals when the step holds one per group, else at the messages by
  count when the step holds the program's number (XLA may turn a small conditional into selects,
  or drop or combine a message, so either count can differ from the program's).
  """
  conds = [i for i, ev in enumerate(events) if ev[0] == "conditional"]
  if len(conds) == len(messages):
    bounds = [*conds, len(events)]
    return [[ev for ev in events[bounds[g] + 1 : bounds[g + 1]] if ev[0] == "ppermute"]
            for g in range(len(messages))]
  pp = [ev for ev in events if ev[0] == "ppermute"]
  if len(pp) != sum(messages):
    return None
  starts = [sum(messages[:g]) for g in range(len(messages))]
  return [pp[i : i + n] for i, n in zip(starts, messages)]


def _measured_groups(timeline, windows, messages: list[int]) -> tuple[list[dict] | None, float, float, float]:
  """Averaged over the step windows that can be cut into the program's groups (a trace may lose a
  step's first events), else over all: per group, busy and ppermute seconds on one device (None
  if no window can be cut), the time after the step's last message (the last groups' tasks, the
  update, the all-reduce), the step's ppermute seconds and the windows' length.

  A group's busy time runs from the previous group's last message (or the step's start) to its
  first; a group without messages has busy 0 and its time counts to the next group that has.
  """
  if not windows:
    raise RuntimeError(f"no '{STEP_EVENT}' events in the trace: not XLA's CPU runtime?")
  cut = []
  for lo, hi in windows:
    events = [ev for ev in timeline if lo <= ev[1] and ev[2] <= hi]
    per_group = _group_messages(events, messages)
    ppermute = sum(b - a for k, a, b in events if k == "ppermute")
    if per_group is not None:
      cut.append((lo, hi, per_group, ppermute))
  if not cut:
    ppermute = [sum(b - a for k, a, b in timeline if k == "ppermute" and lo <= a and b <= hi)
                for lo, hi in windows]
    return None, float("nan"), sum(ppermute) / len(windows), sum(hi - lo for lo, hi in windows) / len(windows)
  out = [{"busy_s": 0.0, "ppermute_s": 0.0} for _ in messages]
  tail = 0.0
  for lo, hi, per_group, _ in cut:
    prev_end = lo
    for g, pp in enumerate(per_group):
      if pp:
        out[g]["busy_s"] += (pp[0][1] - prev_end) / len(cut)
        out[g]["ppermute_s"] += sum(b - a for _, a, b in pp) / len(cut)
        prev_end = pp[-1][2]
    tail += (hi - prev_end) / len(cut)
  return out, tail, sum(c[3] for c in cut) / len(cut), sum(c[1] - c[0] for c in cut) / len(cut)


def _priced_groups(work: pathlib.Path, cfg: dict) -> list[dict]:
  from flax import nnx

  from jaxhybrid import api, costs, planner
  from jaxhybrid import graph as graph_lib
  from jaxhybrid.program import executor, lockstep
  from jaxhybrid.program import structure as structure_lib

  spec = _spec(cfg)
  b, k = cfg["batch"], cfg["k"]
  batch = spec.synthetic_batch(0, b)
  micro_spec, _ = api.microbatch_spec(batch, b, b // k)
  _, p, s, pure = graph_lib.nnx_pure_loss(spec.make(nnx.Rngs(0)), spec.loss_fn)
  g = graph_lib.trace_function(pure, p, s, micro_spec)
  link = json.loads((work / "link.json").read_text())
  kw = {"cache_dir": work / "profiles", "branch_remat": cfg["remat"], "tasks": True,
        "link": costs.Link(alpha_s=link["alpha_s"], bandwidth_bytes_s=link["bandwidth"], source="bench_mp")}
  if cfg.get("cold_share") is not None:  # priced as bench_mp priced the plan
    cm = costs.cache_blended(g, cold_share=cfg["cold_share"], **cfg["timing"], **kw)
  else:
    cm = costs.ProfiledCostModel(g, **cfg["timing"], **kw)
  plan = planner.Plan.load(_plan_path(work))
  fwd, bwd = lockstep.task_times(g, cm)
  _, st, _ = executor.structure_for(
    g, plan.assignment, plan.devices, plan.microbatches,
    plan.task_schedule if FLAGS.schedule == "auto" else FLAGS.schedule,
    order=structure_lib.plan_order(plan.schedule) or None, forward_s=fwd, branch_remat=cfg["remat"],
  )
  out = []
  for lay, price in zip(st.groups, lockstep.group_prices(g, st, cm)):
    names = [[] for _ in range(plan.devices)]
    for d, op in lay.tasks:
      names[d].append(f"{op.kind}{op.node}")
    out.append({"tasks_s": list(price.tasks_s), "transfer_s": sum(price.messages_s),
                "messages": len(price.messages_s), "tasks": [" ".join(n) for n in names]})
  # Each node's F and B (with W) per step, all micro-batches, on its device.
  per_task = [{} for _ in range(plan.devices)]
  for n, d in enumerate(plan.assignment):
    per_task[d][f"F{n}"] = fwd[n] * plan.microbatches
    per_task[d][f"B{n}"] = bwd[n] * plan.microbatches
  return out, per_task


def _attributed(folder: pathlib.Path, hlo: pathlib.Path, windows, priced: dict) -> dict | None:
  """One device's traced steps attributed per task (task_attribution.py), the median over the
  steps, beside each task's price; None without the HLO dump."""
  import task_attribution as ta  # experiments/bench/ (the script's folder)

  dumps = sorted(hlo.glob("*jit_step*after_optimizations.txt"), key=lambda f: f.stat().st_size)
  if not dumps:
    return None
  names = ta.op_names(dumps[-1].read_text())
  events = _events(folder)
  steps = [ta.attribute(events, names, w) for w in windows]
  measured = ta.median_over_steps([s["tasks"] for s in steps])
  for key in [k for k in measured if k.startswith("W")]:  # split schedules: B and W as priced
    measured[f"B{key[1:]}"] = measured.get(f"B{key[1:]}", 0.0) + measured.pop(key)
  rows = [{"task": t, "priced_s": priced.get(t, 0.0), "measured_s": measured.get(t, 0.0)}
          for t in sorted(set(priced) | set(measured), key=lambda t: (int(t[1:]), t[0]))]
  return {"tasks": rows, "tasks_priced_s": sum(r["priced_s"] for r in rows),
          "tasks_measured_s": sum(r["measured_s"] for r in rows),
          "other_s": ta.median_over_steps([s["other"] for s in steps]),
          "per_step_tasks_s": [sum(s["tasks"].values()) for s in steps],
          "per_step_busy_s": [s["busy_s"] for s in steps]}


def driver() -> dict:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from jaxhybrid.program import localcluster

  work = pathlib.Path(FLAGS.workdir)
  cfg = _settings(work)
  argv = [__file__, "--role=trace", *(f"--{n}={getattr(FLAGS, n)}" for n in (
    "workdir", "model", "size", "plan", "schedule", "steps", "trace_steps"))]
  localcluster.launch(argv, 2)
  priced, priced_tasks = _priced_groups(work, cfg)
  per_device, tails, ppermute, steps, attributed = [], [], [], [], []
  for rank in range(2):
    folder = work / f"trace_{FLAGS.model}_{rank}"
    timeline, windows = _timeline(folder)
    windows = windows[-FLAGS.trace_steps :]
    groups, tail, pp, step_s = _measured_groups(timeline, windows, [g["messages"] for g in priced])
    per_device.append(groups)
    tails.append(tail)
    ppermute.append(pp)
    steps.append(json.loads((folder / "steps.json").read_text()))
    steps[-1]["traced_step_s"] = step_s
    attributed.append(_attributed(folder, _hlo_dir(work, rank), windows, priced_tasks[rank]))
    # what the traced processes ran with (localcluster's malloc tunables), not the driver
    tunables = steps[-1].pop("glibc_tunables", None)
  cut = all(d is not None for d in per_device)
  groups = [{**pr, "busy_s": [d[gi]["busy_s"] for d in per_device] if cut else None,
             "ppermute_s": [d[gi]["ppermute_s"] for d in per_device] if cut else None}
            for gi, pr in enumerate(priced)]
  totals = {
    "tasks_s": [sum(g["tasks_s"][d] for g in groups) for d in range(2)],
    "busy_s": [sum(g["busy_s"][d] for g in groups) for d in range(2)] if cut else None,
    # Everything outside the messages, the update and all-reduce included.
    "outside_ppermute_s": [p["traced_step_s"] - pp for p, pp in zip(steps, ppermute)],
    "ppermute_s": ppermute,
    "transfer_s": sum(g["transfer_s"] for g in groups),
    "lockstep_compute_s": sum(max(g["tasks_s"]) for g in groups),
    "after_last_message_s": tails,
    "cut_into_groups": cut,
  }
  return {"model": FLAGS.model, "plan": str(_plan_path(work)), "schedule": FLAGS.schedule, **cfg,
          "glibc_tunables": tunables, "processes": steps, "totals": totals, "groups": groups,
          "attribution": attributed}


def main(argv):
  del argv
  if FLAGS.role == "trace":
    from jaxhybrid.program import localcluster

    localcluster.worker_setup()
    return role_trace(pathlib.Path(FLAGS.workdir))
  res = driver()
  t = res["totals"]
  if t["cut_into_groups"]:
    print(f"{'group':>5} {'tasks_s d0/d1':>17} {'busy_s d0/d1':>17} {'ppermute_s d0/d1':>17} {'transfer_s':>10}")
    for gi, g in enumerate(res["groups"]):
      print(f"{gi:>5} {g['tasks_s'][0]:8.4f} {g['tasks_s'][1]:8.4f} {g['busy_s'][0]:8.4f} "
            f"{g['busy_s'][1]:8.4f} {g['ppermute_s'][0]:8.4f} {g['ppermute_s'][1]:8.4f} {g['transfer_s']:10.4f}")
  else:
    print("the trace could not be cut into the program's groups (XLA merged or dropped a conditional "
          "and a message); totals only")
  print(json.dumps({k: v for k, v in t.items()}))
  print(f"steps {[p['step_s'] for p in res['processes']]}, "
        f"faults/step {[p['minor_faults_per_step'] for p in res['processes']]}")
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
