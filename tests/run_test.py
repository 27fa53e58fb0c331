"""experiments/run.py and jaxhybrid/train/runner.py: outputs, bad input (exit 2, one line), SIGKILL + resume.

Most bad-input cases run in-process through the runner (a typed UsageError, which run.py turns
into exit status 2); a few run the real entry point as a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import subprocess_env

from jaxhybrid import errors
from jaxhybrid.train import run_data, runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "experiments", "run.py")

TINY = runner.RunConfig(model="biglstm", size="tiny", mesh="2x2", batch=4, microbatches=2,
                        planner="etf", steps=3, checkpoint_every=2, progress=False)


def run_py(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
  env = subprocess_env()
  return subprocess.run([sys.executable, RUN, *args], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=timeout)


def losses(workdir) -> list[float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["loss"] for line in f]


# ---- in-process: the runner ------------------------------------------------------------------

def test_parse_overrides():
  assert runner.parse_overrides(["hidden_size=256", "dtype=bfloat16", "scale=0.5", "x=[1, 2]"]) == (
    ("hidden_size", 256), ("dtype", "bfloat16"), ("scale", 0.5), ("x", [1, 2]))
  with pytest.raises(errors.UsageError, match="key=value"):
    runner.parse_overrides(["hidden_size"])


def test_data_is_a_function_of_seed_and_step():
  from jaxhybrid import models

  spec = models.get("biglstm", "tiny")
  f = run_data.make_batch_fn(spec, "synthetic", seed=3, global_batch=8)
  g = run_data.make_batch_fn(spec, "synthetic", seed=3, global_batch=8)
  assert (f(5)["inputs"] == g(5)["inputs"]).all()
  assert not (f(5)["inputs"] == f(6)["inputs"]).all()
  with pytest.raises(errors.UsageError, match="--data='nope'"):
    run_data.make_batch_fn(spec, "nope", seed=3, global_batch=8)


# Inception-V3 tiny takes ~2-3 minutes here (tracing ~60 s, compiling ~50 s): marked slow.
@pytest.mark.parametrize("model", ["gnmt", pytest.param("inception_v3", marks=pytest.mark.slow)])
def test_other_models_run_end_to_end(model, tmp_path, deterministic_place):
  overrides = (("image_size", 75),) if model == "inception_v3" else ()
  # The projection (planning the paper-size model) is the README CLI test's to run.
  cfg = dataclasses.replace(TINY, model=model, mesh="1x2", batch=2, steps=2, planner="milp",
                            workdir=str(tmp_path / "w"), overrides=overrides, projection=False)
  res = runner.run(cfg)
  for key in ("config", "plan", "metrics", "predicted_step_s", "measured_step_s", "memory"):
    assert res[key] is not None, key
  assert res["projection"] is None
  mem = res["memory"]
  # One data replica (1x2) runs the default stage as 0: nothing to shard over 'data'.
  assert runner.DEFAULT_ZERO == 1 and mem["zero"] == 0
  assert mem["predicted_bytes"] > mem["params_bytes"] > 0
  assert res["metrics"]["steps"] == 2
  assert os.path.exists(tmp_path / "w" / "gantt.png")
  # The prediction is the lock-step price of the program plus the gradient all-reduce.
  pred = res["predicted"]
  assert pred["step_s"] == pytest.approx(pred["lockstep_step_s"] + pred["allreduce_s"])
  assert pred["lockstep_step_s"] > 0 and pred["fused_makespan_s"] > 0
  # Not calibrated (run.py --calibrate): no measured fixed costs priced.
  assert res["calibration"] is None and pred["lockstep_parts_s"]["group_sync_s"] == 0


def test_a_run_on_one_data_replica_resumes_at_any_zero_stage(tmp_path):
  """With one data replica every ZeRO stage runs as 0, so a 1x2 run written at stage 0 (the
  default before) resumes under the default stage and continues from its checkpoint."""
  wd = str(tmp_path / "w")
  cfg = dataclasses.replace(TINY, mesh="1x2", workdir=wd, steps=2, projection=False)
  runner.run(dataclasses.replace(cfg, zero=0))
  res = runner.run(dataclasses.replace(cfg, resume=True, steps=3))
  assert cfg.zero == runner.DEFAULT_ZERO != 0 and res["metrics"]["resumed_from"] == 2


BAD_CONFIGS = [
  (dict(model="resnet"), "--model='resnet' is unknown"),
  (dict(size="huge"), "--size='huge' is unknown"),
  (dict(planner="greedy"), "--planner='greedy' is unknown"),
  (dict(batch=5), "not divisible by --microbatches=2"),
  (dict(optimizer="lion"), "--optimizer='lion' is unknown"),
  (dict(clip_norm=-1.0), "--clip_norm=-1.0: use a positive norm"),
  (dict(overrides=(("no_such_field", 1),)), "no_such_field"),
  (dict(mesh="8x2"), "needs 16 devices"),
]


def test_auto_schedule_runs_the_plans_own_task_schedule(tmp_path, deterministic_place):
  cfg = dataclasses.replace(TINY, mesh="1x2", batch=2, steps=1, planner="milp", schedule="auto",
                            workdir=str(tmp_path / "w"))
  spec, hybrid, _ = runner.build(runner._resolve(cfg), abstract=True)
  assert hybrid.plan.task_schedule is not None
  assert hybrid.program.schedule == hybrid.plan.task_schedule


@pytest.mark.parametrize("changes,message", BAD_CONFIGS)
def test_bad_config_raises_one_line_usage_error(changes, message, tmp_path):
  cfg = dataclasses.replace(TINY, workdir=str(tmp_path / "w"), **changes)
  with pytest.raises(errors.UsageError) as e:
    runner.run(cfg)
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("mesh", ["16by2", "0x2", "-1x-1", ""])
def test_malformed_mesh(mesh):
  with pytest.raises(errors.UsageError, match="--mesh"):
    runner.setup_devices(dataclasses.replace(TINY, mesh=mesh))


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(errors.UsageError, match="not writable"):
    runner.run(dataclasses.replace(TINY, workdir=str(blocker / "w")))


def test_existing_run_needs_resume_and_same_config(tmp_path):
  # Under ZeRO stage 2: its checkpoint (optimizer state sharded over 'data') resumes too.
  wd, cfg = str(tmp_path / "w"), dataclasses.replace(TINY, zero=2)
  first = runner.run(dataclasses.replace(cfg, workdir=wd, steps=2, projection=False))
  assert first["memory"]["zero"] == 2
  before = open(os.path.join(wd, "metrics.jsonl")).read()
  with pytest.raises(errors.UsageError, match="already holds a run: pass --resume"):
    runner.run(dataclasses.replace(cfg, workdir=wd))
  with pytest.raises(errors.UsageError, match="has seed=0 but this command gives 1"):
    runner.run(dataclasses.replace(cfg, workdir=wd, resume=True, seed=1))
  with pytest.raises(errors.UsageError, match="has zero=2 but this command gives 0"):
    runner.run(dataclasses.replace(cfg, workdir=wd, resume=True, zero=0))
  # A run saved before the config had a zero field ran without ZeRO (the default then).
  saved = os.path.join(wd, "config.json")
  text = open(saved).read()
  with open(saved, "w") as f:
    json.dump({k: v for k, v in json.loads(text).items() if k != "zero"}, f)
  with pytest.raises(errors.UsageError, match="has zero=0 but this command gives 2"):
    runner.run(dataclasses.replace(cfg, workdir=wd, resume=True))
  with open(saved, "w") as f:
    f.write(text)
  assert open(os.path.join(wd, "metrics.jsonl")).read() == before  # nothing lost
  # The same flags with --resume and more steps continue from the last checkpoint.
  res = runner.run(dataclasses.replace(cfg, workdir=wd, resume=True, steps=3, projection=False))
  assert res["metrics"]["resumed_from"] == 2
  assert [json.loads(x)["step"] for x in open(os.path.join(wd, "metrics.jsonl"))] == [1, 2, 3]


def test_corrupt_plan_and_plan_for_another_graph(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{ not json")
  with pytest.raises(errors.UsageError, match="cannot be read"):
    runner.run(dataclasses.replace(TINY, workdir=str(tmp_path / "a"), plan=str(bad)))
  other = dataclasses.replace(TINY, workdir=str(tmp_path / "b"), overrides=(("hidden_size", 32),),
                              steps=1, projection=False)
  runner.run(other)
  with pytest.raises(errors.UsageError, match="re-plan"):
    runner.run(dataclasses.replace(TINY, workdir=str(tmp_path / "c"),
                                   plan=str(tmp_path / "b" / "plan.json")))


def test_nan_loss_is_a_usage_error_and_keeps_checkpoint(tmp_path):
  cfg = dataclasses.replace(TINY, workdir=str(tmp_path / "w"), steps=8, optimizer="sgd",
                            learning_rate=1e30, checkpoint_every=1, projection=False)
  with pytest.raises(errors.NonFiniteLossError) as e:
    runner.run(cfg)
  last = e.value.last_checkpoint
  assert last is not None and last < e.value.step
  assert f"last good checkpoint is step {last}" in str(e.value)
  rows = [json.loads(x) for x in open(tmp_path / "w" / "metrics.jsonl")]
  assert rows[-1]["step"] == e.value.step - 1


# ---- subprocesses: the real entry point ------------------------------------------------------

@pytest.mark.parametrize("args,message", [
  (["--model=resnet"], "--model='resnet' is unknown"),
  (["--mesh=2y2"], "--mesh"),
])
def test_run_py_bad_input_exits_2_with_one_line(args, message, tmp_path):
  proc = run_py(*args, f"--workdir={tmp_path / 'w'}")
  assert proc.returncode == 2, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and message in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout


def test_sigkill_then_resume_reproduces_uninterrupted_losses(tmp_path):
  common = ["--model=biglstm", "--size=tiny", "--mesh=2x2", "--batch=4", "--planner=etf",
            "--steps=60", "--checkpoint_every=5", "--progress=false"]
  # (The projection, 14 s of planning the paper model, is checked by the README's CLI test.)
  full = run_py(*common, f"--workdir={tmp_path / 'full'}", "--noprojection")
  assert full.returncode == 0, full.stderr

  wd = tmp_path / "killed"
  env = subprocess_env()
  proc = subprocess.Popen([sys.executable, RUN, *common, f"--workdir={wd}"], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpts = wd / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir()):
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  done = len(losses(wd))
  assert done < 60
  resumed = run_py(*common, f"--workdir={wd}", "--resume", "--noprojection")
  assert resumed.returncode == 0, resumed.stderr
  assert json.load(open(wd / "results.json"))["metrics"]["resumed_from"] > 0
  assert losses(wd) == losses(tmp_path / "full")


def test_paper_size_defaults_to_the_papers_optimizer():
  """--size=paper without --optimizer trains BigLSTM as the paper did (AdaGrad 0.2); an explicit
  flag wins, and other sizes and models keep Adam."""
  from jaxhybrid.train import runner

  def resolved(**kw):
    c = runner._resolve(runner.RunConfig(workdir="/tmp/unused", **kw))  # noqa: SLF001
    return c.optimizer, c.learning_rate

  assert resolved(model="biglstm", size="paper") == ("adagrad", 0.2)
  assert resolved(model="biglstm", size="paper", optimizer="adam") == ("adam", runner.DEFAULT_LEARNING_RATE)
  assert resolved(model="biglstm", size="tiny") == ("adam", runner.TINY_LEARNING_RATE)
  assert resolved(model="gnmt", size="paper") == ("adam", runner.DEFAULT_LEARNING_RATE)
