"""The main job's bad inputs: each is one line on stderr and exit status 2, before any tracing;
`--dry_run` on a model that does not fit prints the fit table, then says what to try; the main
job is quiet at the default verbosity; the names the guide uses resolve after `import jaxhybrid`.
"""

from __future__ import annotations

import dataclasses

import pytest
from run_test import run_py

from jaxhybrid import errors
from jaxhybrid.models import biglstm, gnmt, inception_v3
from jaxhybrid.train import runner


@pytest.mark.parametrize(
  "args,flag",
  [
    (["--set", "hidden_size=-4"], "--set hidden_size=-4"),
    (["--set", "num_layers=0"], "--set num_layers=0"),
    (["--set", "dtype=int7"], "--set dtype='int7'"),
    (["--set", "embed_size=2.5"], "--set embed_size=2.5"),
    (["--set", "nonsense=3"], "--set nonsense=3: BigLSTMConfig has no field 'nonsense'"),
    (["--set", "hidden_size=big"], "--set hidden_size='big': does not parse as int"),
    (["--set", "forget_bias=1.5", "--set", "nonsense=3"], "--set nonsense=3"),
    (["--set", "forget_bias=nan"], "--set forget_bias=nan: must be a finite number"),
    # Beyond the tiny preset's vocabulary (the size this CPU run resolves to).
    (["--set", "num_sampled=1000"], "--set num_sampled=1000 must be in [0, vocab_size="),
    (["--zero=3"], "--zero=3: use 0"),
    (["--memory_cap_gib=-1"], "--memory_cap_gib=-1.0: use a positive number of GiB"),
    (["--batch=-1"], "--batch=-1: must be positive"),
    (["--batch=0"], "--batch=0: must be positive"),
    (["--steps=0"], "--steps=0: must be positive"),
    (["--microbatches=0"], "--microbatches=0: must be positive"),
    (["--mesh=0x2"], "--mesh: mesh '0x2' has a zero axis"),
    (["--mesh=2xbig"], "--mesh"),
  ],
)
def test_bad_cli_input_is_one_line_and_exit_2(args, flag, tmp_path):
  proc = run_py("--model=biglstm", "--mesh=1x2", "--steps=1", f"--workdir={tmp_path / 'wd'}",
                *args, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
  assert flag in lines[0], lines[0]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "wd").exists(), "nothing runs (or is written) after a bad input"


@pytest.mark.parametrize(
  "cls,field,value",
  [
    (biglstm.BigLSTMConfig, "hidden_size", -4),
    (biglstm.BigLSTMConfig, "num_sampled", -1),
    (biglstm.BigLSTMConfig, "param_dtype", "float7"),
    (gnmt.GNMTConfig, "label_smoothing", 1.0),
    (gnmt.GNMTConfig, "vocab_size", "many"),
    (gnmt.GNMTConfig, "share_embedding", 3),
    (inception_v3.InceptionV3Config, "bn_momentum", 1.5),
    (inception_v3.InceptionV3Config, "bn_epsilon", 0.0),
    (inception_v3.InceptionV3Config, "num_classes", True),
    (gnmt.GNMTConfig, "init_scale", float("inf")),
  ],
)
def test_model_configs_name_the_bad_field(cls, field, value):
  with pytest.raises(ValueError, match=f"^{field}="):
    dataclasses.replace(cls.tiny(), **{field: value})


def test_every_preset_passes_its_own_checks():
  for cls in (biglstm.BigLSTMConfig, gnmt.GNMTConfig, inception_v3.InceptionV3Config):
    for preset in (cls.tiny, cls.small, cls.paper):
      assert dataclasses.replace(preset()) == preset()


def test_validate_checks_the_model_config_before_the_size_is_resolved():
  config = runner.RunConfig(model="gnmt", overrides=(("hidden_size", 0),))
  with pytest.raises(errors.UsageError, match=r"^--set hidden_size=0: must be >= 1$"):
    runner.validate(config)


def test_an_unresolved_size_refuses_a_value_only_if_no_preset_takes_it():
  # 1000 samples exceed the tiny vocabulary but not the paper one (a GPU resolves to paper).
  runner.validate(runner.RunConfig(model="biglstm", overrides=(("num_sampled", 1000),)))
  with pytest.raises(errors.UsageError, match=r"^--set num_sampled=1000000000 must be in \[0, vocab_size=793471\)"):
    runner.validate(runner.RunConfig(model="biglstm", overrides=(("num_sampled", 10**9),)))


def test_dry_run_of_a_model_that_does_not_fit_prints_the_table(tmp_path):
  proc = run_py("--model=biglstm", "--size=paper", "--mesh=1x1", "--dry_run",
                f"--workdir={tmp_path}", timeout=600)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "memory per device" in proc.stdout and "does NOT fit" in proc.stdout, proc.stdout
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-2000:]
  assert "device(s) 0" in lines[0] and "--mesh=1x2" in lines[0] and "--microbatches" in lines[0]
  assert (tmp_path / "results.json").exists()


def _log_lines(text: str) -> list[str]:
  """absl-formatted log lines ('I1204 04:50:25.27 123 file.py:12] ...', any level)."""
  return [ln for ln in text.splitlines() if ln[:1] in "DIWEF" and ln[1:5].isdigit()]


def test_does_not_fit_advice_on_micro_batches_follows_the_plan():
  """More micro-batches shrink a placed plan's buffers; a plan whose split nodes keep their
  weights in slices keeps a gathered copy per micro-batch in flight, so the advice turns."""
  import types

  from jaxhybrid.train import memory_check

  placed = types.SimpleNamespace(batch_splits=())
  replicated = types.SimpleNamespace(batch_splits=({"node": "l0", "bounds": [0, 4, 8]},))
  sliced = types.SimpleNamespace(batch_splits=({"node": "l0", "split_params": ["w"]},))
  assert memory_check.microbatch_advice(placed, 2) == " or more --microbatches (now 2)"
  assert memory_check.microbatch_advice(replicated, 1) == " or more --microbatches (now 1)"
  assert memory_check.microbatch_advice(sliced, 4).startswith(" or fewer --microbatches (now 4: ")
  assert memory_check.microbatch_advice(sliced, 1) == ""

@pytest.mark.parametrize("verbosity", [0, 1])
def test_planner_details_show_only_with_verbosity(verbosity, tmp_path):
  proc = run_py("--model=biglstm", "--mesh=1x2", "--steps=2", "--microbatches=2", "--time_limit=4",
                "--noprojection",
                f"--progress={verbosity == 0}", f"--verbosity={verbosity}",
                f"--workdir={tmp_path}", timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "Plan:" in proc.stdout and "loss" in proc.stdout and "step time:" in proc.stdout
  # --noprojection: no projection table, no projection plot.
  assert "projection.png" not in proc.stdout and "crossover" not in proc.stdout
  assert not (tmp_path / "projection.png").exists()
  logs = _log_lines(proc.stdout + proc.stderr)
  if verbosity == 0:
    # The plan and result summaries, nothing else: no planner detail, no JAX backend probing.
    assert not logs, logs[:5]
    # Not a terminal: the solve's progress comes as whole lines, the last one the plan's state.
    solve = [ln for ln in proc.stdout.splitlines() if ln.startswith("solve ")]
    assert solve and solve[-1].endswith("[done]"), proc.stdout[:2000]
    assert " step " in solve[-1] and " bound " in solve[-1] and " gap " in solve[-1]
  else:
    # The planner's details (warm start against the bound, each priced plan) are there, and
    # third-party DEBUG chatter (matplotlib's font search) is not.
    assert any("place.py" in ln and "bound" in ln for ln in logs), logs[:20]
    assert not [ln for ln in logs if "findfont" in ln or "selector" in ln], logs[:5]


def test_the_guides_names_resolve_after_import_jaxhybrid():
  import jaxhybrid

  assert callable(jaxhybrid.program.lockstep.plan_step_s)
  assert callable(jaxhybrid.planner.pricing.lockstep_rule.lockstep_groups)
  assert jaxhybrid.costs.hardware.get("dgx1-v100").memory_bytes > 0
  assert jaxhybrid.models.biglstm.BigLSTMConfig.tiny().num_layers >= 1
  with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
    jaxhybrid.program.not_a_module


def test_dry_run_under_a_cap_nothing_meets_shows_the_plan_made_for_the_hardware(tmp_path):
  """No plan under --memory_cap_gib: the table is the plan made under the hardware's memory
  (which still splits and spreads to fit it), and the one-line error says so and what to try."""
  from jaxhybrid.train import dry_run

  config = runner.RunConfig(model="biglstm", size="tiny", mesh="1x2", microbatches=2,
                            planner="dp", dry_run=True, workdir=str(tmp_path), progress=False,
                            hardware="dgx1-v100", memory_cap_gib=0.0001)
  r = dry_run.run(config)
  assert not r["fits"] and r["planner_error"]
  assert r["plan_shown"].startswith("no plan found under the 104.86 KiB cap; below: the plan "
                                    "made under the dgx1-v100 memory (16.00 GiB per device)")
  assert r["memory_table"].startswith(r["plan_shown"])
  assert r["plan"]["memory_caps_bytes"] == [16 * 2**30] * 2
  msg = r["does_not_fit"]
  assert "\n" not in msg and msg.startswith("does not fit: every model-axis device needs ")
  assert ("of 104.86 KiB (--memory_cap_gib) in the plan shown (table above); the planner found "
          "no plan within the cap (node ") in msg
  assert "--mesh=1x4" in msg and "--batch_split --batch_split_params=split" in msg
