"""The one short prepared script for a lent accelerator: each model's one-device step, measured.

  python experiments/bench/gpu_profile.py                                   # GPU: paper sizes, ~9 min
  python experiments/bench/gpu_profile.py --size=tiny --steps=3 --out=/tmp/g.json   # any host

Per model, each part in a fresh child process (so a device's peak memory is that part's own, and
running out of memory ends that part only):

- `hybrid`: the hybrid program on mesh 1x1 (planner 'single', k=1, the run.py defaults for the
  size: the paper's per-GPU batch and optimizer at paper size) compiled once ahead of time:
  our predicted per-device bytes, XLA's compiled memory analysis, the device allocator's
  measured peak (`Device.memory_stats()['peak_bytes_in_use']`; None where the backend keeps no
  statistics, e.g. the CPU) and the median step time.
- `plain`: the training step a user writes for one device (`jax.jit` of value_and_grad and the
  optimizer, same model, batch and optimizer): compiled and measured memory, median step time;
  then, until the time budget runs out, the profiled cost model of the traced graph (every
  node's F and B tasks and the whole forward + backward, `costs.ProfiledCostModel(tasks=True)`),
  cached under `<out folder>/profiles/` as JSON (one file per device kind): the figures a
  `ProfiledCostModel(cache_dir=...)` or `JAXHYBRID_PROFILE_CACHE` pointing there reads back.

Results are written after every part to --out. `--budget_s` bounds the whole run (the device
tool lends 15 minutes, machine start included): a part that would start after it is skipped
and listed, and a child is stopped at the budget's end. One device cannot show 2-way timing:
model parallelism needs two.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app, flags

_MODELS = flags.DEFINE_list("models", ["biglstm", "gnmt", "inception_v3"], "Registry models.")
_SIZE = flags.DEFINE_string("size", None, "tiny | small | paper (default: paper on a GPU, else tiny).")
_BATCH = flags.DEFINE_integer("batch", None, "Per-device batch (default: run.py's for the size).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per program (the median is kept).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps first (after the compile).")
_PROFILE = flags.DEFINE_boolean("profile", True, "Profile every node's F and B tasks (plain part).")
_BUDGET = flags.DEFINE_float("budget_s", 540.0, "Wall-clock budget of the whole run, seconds.")
_OUT = flags.DEFINE_string("out", "experiments/results/gpu_profile.json", "Results JSON.")
_ROLE = flags.DEFINE_string("role", "driver", "driver | hybrid | plain (children).")
_MODEL = flags.DEFINE_string("model", "", "Child: the model.")
_DEADLINE = flags.DEFINE_float("deadline", 0.0, "Child: epoch seconds by which to stop profiling.")

FLAGS = flags.FLAGS
PARTS = ("hybrid", "plain")


def _config(name: str):
  """run.py's resolved configuration of `name` on one device (its defaults for the size)."""
  import tempfile

  from jaxhybrid.train import runner

  return runner._resolve(runner.RunConfig(
    model=name, size=_SIZE.value, batch=_BATCH.value, mesh="1x1", microbatches=1,
    planner="single", data="synthetic", progress=False, projection=False,
    workdir=tempfile.mkdtemp(prefix="gpu_profile_"),
  ))


def _device_memory() -> dict:
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit")}


def _median_step_s(fn, carry, batch) -> tuple[float, list[float], object]:
  import bench_baselines  # experiments/bench/ (the script's folder)
  import numpy as np

  times, _, out = bench_baselines.step_times(fn, carry, batch, _STEPS.value, _WARMUP.value)
  return float(np.median(times)), times, out


def part_hybrid(name: str) -> dict:
  import dataclasses

  import jax

  from jaxhybrid.program import memory
  from jaxhybrid.train import runner

  config = _config(name)
  t0 = time.perf_counter()
  _, hybrid, batch_fn = runner.build(config)
  prog = hybrid.program
  batch = prog.shard_batch(batch_fn(0))
  compiled = prog.step_fn().lower(memory.abstract_state(prog), batch).compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  rep = dataclasses.replace(
    prog.memory(compile=False), compiled_arguments=int(ma.argument_size_in_bytes),
    compiled_temp=int(ma.temp_size_in_bytes), compiled_output=int(ma.output_size_in_bytes),
    compiled_alias=int(ma.alias_size_in_bytes),
  )
  state = hybrid.init()
  step_s, times, metrics = _median_step_s(compiled, state, batch)
  return {
    "optimizer": config.optimizer, "learning_rate": config.learning_rate, "batch": config.batch,
    "nodes": len(hybrid.graph.nodes), "param_bytes": hybrid.graph.total_param_bytes,
    "build_and_compile_s": compile_s, "step_s": step_s, "step_times_s": times,
    "loss": float(jax.device_get(metrics["loss"])), "memory": rep.to_dict(),
    "measured": _device_memory(),
  }


def part_plain(name: str, deadline: float, profile_dir: pathlib.Path) -> dict:
  import bench_baselines  # experiments/bench/ (the script's folder)
  import jax
  import numpy as np
  import optax
  from flax import nnx

  from jaxhybrid import api, costs, models
  from jaxhybrid import graph as graph_lib
  from jaxhybrid.train import run_data

  config = _config(name)
  spec = models.get(name, config.size)
  model = spec.make(nnx.Rngs(config.seed))
  # The hybrid part's batch (run.py's synthetic data, step 0): after the same steps on the same
  # batch the two losses agree (the hybrid program on one device computes the same step).
  batch = jax.tree.map(np.asarray, run_data.make_batch_fn(spec, "synthetic", config.seed, config.batch)(0))
  opt = getattr(optax, config.optimizer)(config.learning_rate)
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn, scopes=False)
  carry = (p, opt.init(p), s)
  t0 = time.perf_counter()
  compiled = jax.jit(bench_baselines.plain_step(pure, opt), donate_argnums=0).lower(carry, batch).compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  step_s, times, loss = _median_step_s(compiled, carry, batch)
  out = {
    "build_and_compile_s": compile_s, "step_s": step_s, "step_times_s": times,
    "loss": float(jax.device_get(loss)),
    "compiled": {"arguments": int(ma.argument_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
                 "total": int(ma.argument_size_in_bytes + ma.temp_size_in_bytes)},
    "measured": _device_memory(),
  }
  if not _PROFILE.value:
    return out
  del carry, compiled
  _, p, s, pure = graph_lib.nnx_pure_loss(model, spec.loss_fn)
  g = graph_lib.trace_function(pure, p, s, api.microbatch_spec(batch, config.batch, config.batch)[0])
  # Transfers do not matter on one device; a GPU needs a link model: its analytic hardware's.
  link = None if jax.default_backend() == "cpu" else api.default_costs().hardware
  cm = costs.ProfiledCostModel(g, cache_dir=profile_dir, link=link, tasks=True)
  nodes = []
  for n in g.nodes:
    if time.time() > deadline:
      break
    nodes.append({"id": n.id, "name": n.name, "flops": n.flops, "fwd_bwd_s": cm.node_time_s(n),
                  "forward_s": cm.forward_time_s(n)})
  out["profile"] = {
    "cache": str(cm.cache_path), "nodes_profiled": len(nodes), "nodes": len(g.nodes),
    "node_times": nodes, "node_sum_s": sum(x["fwd_bwd_s"] for x in nodes),
    "whole_fwd_bwd_s": cm.whole_step_time_s() if time.time() < deadline else None,
  }
  return out


def run_part(part: str, name: str, deadline: float, out: pathlib.Path) -> dict:
  """One part of one model in this process (what a child runs)."""
  import jax

  base = {"model": name, "part": part, "backend": jax.default_backend(),
          "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
  if part == "hybrid":
    return {**base, **part_hybrid(name)}
  return {**base, **part_plain(name, deadline, out.parent / "profiles")}


def driver(models, out: pathlib.Path, budget_s: float) -> dict:
  """Runs every (model, part) in a child until `budget_s`; writes `out` after each part."""
  t_end = time.time() + budget_s
  res: dict = {"models": {}, "skipped": [], "budget_s": budget_s}
  out.parent.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # measured peaks are the part's own
  for name in models:
    for part in PARTS:
      left = t_end - time.time()
      if left < 10:
        res["skipped"].append(f"{name} {part}: time budget spent")
        continue
      child = out.parent / f".gpu_profile_{name}_{part}.json"
      argv = [sys.executable, os.path.abspath(__file__), f"--role={part}", f"--model={name}",
              f"--deadline={t_end - 5}", f"--out={child}", f"--steps={_STEPS.value}",
              f"--warmup={_WARMUP.value}", f"--profile={_PROFILE.value}"]
      argv += [f"--size={_SIZE.value}"] if _SIZE.value else []
      argv += [f"--batch={_BATCH.value}"] if _BATCH.value else []
      t0 = time.time()
      try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=left, check=False)
        ok = proc.returncode == 0 and child.exists()
        why = "" if ok else (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
      except subprocess.TimeoutExpired:
        ok, why = False, f"stopped at the time budget after {time.time() - t0:.0f} s"
      entry = json.loads(child.read_text()) if ok else {"error": why}
      entry["wall_s"] = time.time() - t0
      res["models"].setdefault(name, {})[part] = entry
      child.unlink(missing_ok=True)
      out.write_text(json.dumps(res, indent=1))
      print(f"{name} {part}: " + (f"step {entry.get('step_s', 0) * 1e3:.1f} ms" if ok else why), flush=True)
  out.write_text(json.dumps(res, indent=1))
  return res


def main(argv):
  del argv
  out = pathlib.Path(_OUT.value)
  if _ROLE.value == "driver":
    driver(_MODELS.value, out, _BUDGET.value)
    return
  if _ROLE.value not in PARTS:
    raise app.UsageError(f"--role={_ROLE.value!r}: use driver, {' or '.join(PARTS)}")
  res = run_part(_ROLE.value, _MODEL.value, _DEADLINE.value or time.time() + 3600, out)
  out.write_text(json.dumps(res))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  app.run(main)
