r"""Runs experiments/run.py's runner over models x meshes x batches x planners; one row per run.

  python experiments/sweep.py --models=biglstm,gnmt --meshes=2x2,4x2 --batches=4 \
      --planners=milp,etf --steps=20 --workdir=runs/sweep

Writes --workdir/sweep.jsonl and sweep.csv (one row per run: config, predicted and measured step
time, plan speedup, losses) and sweep.png (measured versus predicted step time per run); each
run's own outputs go to --workdir/<run name>/. Rerunning skips the rows already done (a run
killed half-way resumes from its checkpoint); failed runs are recorded with their error and
retried on the next invocation.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging

from jaxhybrid import errors, mesh
from jaxhybrid.train import runner

_MODELS = flags.DEFINE_list("models", ["biglstm"], "Models.")
_MESHES = flags.DEFINE_list("meshes", ["2x2"], "DATAxMODEL meshes.")
_BATCHES = flags.DEFINE_list("batches", ["4"], "Per-worker batches.")
_PLANNERS = flags.DEFINE_list("planners", ["milp"], "Planners (milp, etf, dp, interleaved, single).")
_SIZE = flags.DEFINE_string("size", None, "Model size (default: paper on GPU, tiny on CPU).")
_MICRO = flags.DEFINE_integer("microbatches", 2, "Micro-batches per worker batch.")
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps per run.")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 30.0, "Planner time limit per run, seconds.")
_DATA = flags.DEFINE_string("data", "synthetic", "synthetic | generated | a data folder.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/sweep", "Sweep folder.")
_PROJECTION = flags.DEFINE_bool(
  "projection", False, "Also project each run to the paper's scenario (run.py's projection; the "
  "sweep's rows do not use it, and it plans the paper-size model once per run).")

FIELDS = ("name", "model", "size", "mesh", "batch", "planner", "status", "predicted_step_s",
          "measured_step_s", "plan_speedup", "first_loss", "final_loss", "error")


def run_name(model: str, mesh_spec: str, batch: int, planner: str) -> str:
  return f"{model}-{mesh_spec}-b{batch}-{planner}"


def done_rows(path: str) -> dict[str, dict]:
  """Rows already in sweep.jsonl that succeeded, by run name (the last row of a name wins)."""
  rows: dict[str, dict] = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          rows[row["name"]] = row
  return {k: r for k, r in rows.items() if r["status"] == "ok"}


def plot(rows: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ok = [r for r in rows if r["status"] == "ok"]
  fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(ok)), 4))
  x = range(len(ok))
  ax.bar([i - 0.2 for i in x], [r["predicted_step_s"] * 1e3 for r in ok], 0.4, label="predicted")
  ax.bar([i + 0.2 for i in x], [r["measured_step_s"] * 1e3 for r in ok], 0.4, label="measured")
  ax.set_xticks(list(x))
  ax.set_xticklabels([r["name"] for r in ok], rotation=45, ha="right", fontsize=7)
  ax.set_yscale("log")
  ax.set_ylabel("step time (ms)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  absl_logging.get_absl_handler().python_handler.stream = sys.stdout
  logging.getLogger("absl").setLevel(logging.WARNING)
  root = _WORKDIR.value
  try:
    batches = [int(b) for b in _BATCHES.value]
    sizes = [runner._mesh_shape_early(m) for m in _MESHES.value]  # noqa: SLF001
    if any(s is None for s in sizes):
      raise errors.UsageError("--meshes: give explicit sizes (no -1) so devices can be simulated")
    mesh.simulate_cpu_devices(max(s.size for s in sizes))
    os.makedirs(root, exist_ok=True)
  except (ValueError, OSError) as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(2)
  jsonl = os.path.join(root, "sweep.jsonl")
  done = done_rows(jsonl)
  for model, mesh_spec, batch, planner in itertools.product(
      _MODELS.value, _MESHES.value, batches, _PLANNERS.value):
    name = run_name(model, mesh_spec, batch, planner)
    if name in done:
      print(f"skip {name}: done")
      continue
    config = runner.RunConfig(
      model=model, size=_SIZE.value, mesh=mesh_spec, batch=batch, microbatches=_MICRO.value,
      planner=planner, time_limit_s=_TIME_LIMIT.value, data=_DATA.value, steps=_STEPS.value,
      workdir=os.path.join(root, name), resume=True, progress=False, projection=_PROJECTION.value,
    )
    row = {"name": name, "model": model, "mesh": mesh_spec, "batch": batch, "planner": planner}
    try:
      res = runner.run(config)
      m = res["metrics"]
      row.update(status="ok", size=res["config"]["size"], predicted_step_s=res["predicted_step_s"],
                 measured_step_s=res["measured_step_s"],
                 plan_speedup=res["plan"]["predicted_speedup"], first_loss=m["first_loss"],
                 final_loss=m["final_loss"])
    except errors.UsageError as e:
      row.update(status="error", error=str(e))
    print(f"{name}: {row['status']} {row.get('error', '')}")
    with open(jsonl, "a") as f:
      f.write(json.dumps(row) + "\n")
    if row["status"] == "ok":
      done[name] = row
  rows = list(done.values())
  with open(os.path.join(root, "sweep.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=FIELDS)
    w.writeheader()
    for r in rows:
      w.writerow({k: r.get(k, "") for k in FIELDS})
  if rows:
    plot(rows, os.path.join(root, "sweep.png"))
  print(f"{len(rows)} runs done; table in {os.path.join(root, 'sweep.csv')}")


if __name__ == "__main__":
  app.run(main)
