"""The README's code blocks run as written: the quick start and the pieces on a stand-in module,
the command-line examples in a fresh folder, and every run.py command names only flags run.py
defines. Its install, test and main commands are what .ci/run runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from conftest import subprocess_env
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks(lang: str) -> list[str]:
  with open(os.path.join(ROOT, "README.md")) as f:
    return re.findall(rf"```{lang}\n(.*?)```", f.read(), flags=re.S)


class MyModel(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _batch(n: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(n, 4)).astype(np.float32),
          "y": rng.normal(size=(n, 2)).astype(np.float32)}


def test_quick_start_runs_as_written():
  quick = next(b for b in _blocks("python") if "jaxhybrid.parallelize" in b)
  scope = {"MyModel": MyModel, "global_batch": _batch(16)}
  exec(quick, scope)  # noqa: S102 - the README's own text
  metrics, params = scope["metrics"], scope["params"]
  assert np.isfinite(float(metrics["loss"]))
  assert jax.tree.structure(params) is not None and scope["hybrid"].plan.assignment


def test_the_pieces_run_as_written(tmp_path, monkeypatch):
  pieces = next(b for b in _blocks("python") if "planner.place(" in b)
  model = MyModel(rngs=nnx.Rngs(0))

  def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch(16))
  monkeypatch.chdir(tmp_path)
  scope = {"model": model, "loss_fn": loss_fn, "batch_spec": spec}
  exec(pieces, scope)  # noqa: S102
  assert len(scope["plan"].assignment) == len(scope["g"].nodes)
  assert (tmp_path / "plan.json").exists() and (tmp_path / "gantt.png").exists()


def test_every_run_command_uses_defined_flags():
  # run.py's own flags, read from its source (importing it beside other scripts would define
  # absl flags twice), and absl's logging flags.
  with open(os.path.join(ROOT, "experiments", "run.py")) as f:
    defined = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", f.read())) | {"verbosity", "v"}
  assert {"model", "mesh", "dry_run", "resume", "workdir"} <= defined
  commands = [line for block in _blocks("bash") for line in block.splitlines()
              if "experiments/run.py" in line]
  assert commands, "the README shows the main job"
  for line in commands:
    for flag in re.findall(r"--(\w+)", line.split("#")[0]):
      assert flag in defined, f"README's {line!r} uses --{flag}, which run.py does not define"


def test_the_command_line_block_runs_as_written(tmp_path):
  """The README's command-line examples, in order, in a fresh folder: a run, its resume to more
  steps, and the paper-size fit check (each exit status 0)."""
  block = next(b for b in _blocks("bash") if "--resume" in b)
  commands = [ln.split("#")[0].strip() for ln in block.splitlines() if "experiments/run.py" in ln]
  assert len(commands) == 3
  run_py = os.path.join(ROOT, "experiments", "run.py")
  for cmd in commands:
    argv = shlex.split(cmd)
    assert argv[:2] == ["python", "experiments/run.py"], cmd
    proc = subprocess.run([sys.executable, run_py, *argv[2:]], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd}\n{proc.stderr[-2000:]}"
  steps = [json.loads(line)["step"] for line in (tmp_path / "runs" / "a" / "metrics.jsonl").open()]
  assert steps[-1] == 30 and len(steps) == len(set(steps)), steps[-5:]
  # The main job's outputs, the projection's included.
  results = json.loads((tmp_path / "runs" / "a" / "results.json").read_text())
  for key in ("config", "plan", "metrics", "predicted_step_s", "measured_step_s", "projection"):
    assert key in results
  for png in ("gantt.png", "loss.png", "projection.png"):
    assert (tmp_path / "runs" / "a" / png).stat().st_size > 0
  # The fit check planned the paper's GNMT for four model devices and compiled it per device
  # (tests/paper_plan_test.py also checks, in one process, that nothing of its size is allocated).
  (dry,) = (tmp_path / "runs").glob("gnmt-paper-1x4-*/results.json")
  saved = json.loads(dry.read_text())
  assign = saved["plan"]["assignment"]
  assert len(assign) == saved["graph"]["nodes"] > 0
  assert set(assign) <= {0, 1, 2, 3} and len(set(assign)) > 1, assign
  assert saved["mesh"] == {"data": 1, "model": 4} and len(saved["plan"]["device_peak_bytes"]) == 4
  mem = saved["memory"]
  assert mem["compiled"] == mem["compiled_arguments"] + mem["compiled_temp"] > 4e8  # >100M params
  assert "memory per device" in saved["memory_table"]
