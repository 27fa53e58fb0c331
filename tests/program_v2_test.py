"""Program v2: forward and backward as scheduled tasks (GPipe, 1F1B, ZB-H1).

Equivalence with the single-device reference for every schedule and mesh; the conditionals
return the union of the devices' outputs, never another device's residuals; a device touches
only its own parameter leaves; 1F1B bounds the residuals alive and memory falls as k grows.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
import pytest
import toy
from flax import nnx
from program_test import (
  _exchange_tower,
  assert_matches_reference,
  build,
  cond_output_bytes,
  split_lstm,
)

from jaxhybrid.planner.core import task_schedule
from jaxhybrid.planner.pricing import lockstep_rule
from jaxhybrid.program import executor, gradients, structure, tasks

SCHEDULES = ["gpipe", "1f1b", "zb"]
MESHES = ["1x1", "2x1", "1x2", "2x2", "4x2"]


def _towers(n):
  return 0 if n.name.startswith("a") else 1


# Every mesh and every schedule in the default run; the remaining pairs under the slow marker.
_FAST_PAIRS = [("gpipe", "1x1"), ("1f1b", "2x1"), ("zb", "1x2"), ("1f1b", "1x2"),
               ("gpipe", "2x2"), ("zb", "2x2"), ("1f1b", "4x2"), ("zb", "4x2")]
_PAIRS = [
  pytest.param(s, m, marks=() if (s, m) in _FAST_PAIRS else pytest.mark.slow)
  for s in SCHEDULES for m in MESHES
]


@pytest.mark.parametrize("schedule,mesh_spec", _PAIRS)
def test_lstm_stack_every_schedule_and_mesh(schedule, mesh_spec):
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  opt = optax.adam(1e-2)
  two = mesh_spec.endswith("x2")
  prog, p, s, pure = build(
    model, toy.lstm_loss, batch, mesh_spec, split_lstm if two else (lambda n: 0), 2, opt,
    schedule=schedule,
  )
  assert prog.schedule.kind == schedule
  assert_matches_reference(prog, p, s, pure, batch, opt)


@pytest.mark.parametrize(
  "schedule,mesh_spec",
  [("gpipe", "1x2"), ("1f1b", "2x2"), ("zb", "4x2"),
   pytest.param("zb", "1x2", marks=pytest.mark.slow),
   pytest.param("1f1b", "4x2", marks=pytest.mark.slow),
   pytest.param("gpipe", "2x2", marks=pytest.mark.slow)],
)
def test_tied_weights_and_towers_every_schedule(schedule, mesh_spec):
  opt = optax.adam(1e-2)
  model = toy.LSTMNet(tied=True, rngs=nnx.Rngs(1))
  batch = toy.lstm_batch(16, seed=3)
  prog, p, s, pure = build(
    model, toy.lstm_loss, batch, mesh_spec, split_lstm, 2, opt, schedule=schedule
  )
  assert prog.layout.shared, "the tied embedding should be shared across devices"
  assert_matches_reference(prog, p, s, pure, batch, opt)
  model = toy.Towers(rngs=nnx.Rngs(2))
  batch = toy.regression_batch(16)
  prog, p, s, pure = build(model, toy.mse_nnx, batch, mesh_spec, _towers, 2, opt, schedule=schedule)
  assert_matches_reference(prog, p, s, pure, batch, opt)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_conditionals_return_the_union_not_the_sum(schedule):
  """Each group's conditional returns one buffer per dtype sized by the largest device's part."""
  model = toy.Exchange(rngs=nnx.Rngs(4))
  batch = toy.regression_batch(16, seed=2)
  prog, p, _, _ = build(
    model, toy.mse_nnx, batch, "1x4", lambda n: _exchange_tower(n) % 4, 2, optax.sgd(0.1),
    schedule=schedule,
  )
  st = prog.structure
  per_group = [st.output_bytes(g) for g in range(len(st.groups))]
  # The conditional also returns the group's gradient window (one node's parameter gradients).
  windows = gradients.gradient_windows(st, prog.graph, prog.layout)
  # And, once a group's windows were added, a 4-byte token (`executor._token`): the conditional
  # reads the added gradients, so XLA cannot put the additions off past it.
  want = [
    b + sum(w.nbytes for w in (ws or [])) + (4 if any(ws for ws in windows[:g]) else 0)
    for g, (b, ws) in enumerate(zip(per_group, windows))
  ]
  assert [b for b in cond_output_bytes(prog, p, batch) if b] == [b for b in want if b]
  union_smaller = 0
  for g, lay in enumerate(st.groups):
    # Properties of any valid union layout, checked on the writes each device's branch returns
    # (not on how the layout was computed): per device and lane, writes lie inside the lane and
    # never overlap; every lane is as long as some device's writes reach (no padding beyond the
    # longest part); the buffer is at least each device's part and at most their sum.
    by_dev = {}
    reach: dict[str, int] = {}
    for d, writes in lay.writes.items():
      by_dev[d] = 0
      spans: dict[str, list[tuple[int, int]]] = {}
      for _, lane, off, shape in writes:
        n = int(np.prod(shape))
        by_dev[d] += n * np.dtype(tasks.lane_dtype(lane)).itemsize
        spans.setdefault(lane, []).append((off, off + n))
      for lane, ss in spans.items():
        ss.sort()
        assert all(e <= s2 for (_, e), (s2, _) in zip(ss, ss[1:])), (g, d, lane, ss)
        assert ss[-1][1] <= lay.sizes[lane], (g, d, lane)
        reach[lane] = max(reach.get(lane, 0), ss[-1][1])
    assert reach == lay.sizes, f"group {g}: lanes longer than any device's writes"
    assert max(by_dev.values(), default=0) <= per_group[g] <= sum(by_dev.values())
    union_smaller += per_group[g] < sum(by_dev.values())
  assert union_smaller, "with 4 busy devices some group's union must be smaller than the sum"


def test_a_device_touches_only_its_own_parameter_leaves(monkeypatch):
  """Every parameter read and gradient write inside a branch is of a leaf the device owns."""
  touched = []
  model = toy.LSTMNet(tied=True, rngs=nnx.Rngs(1))
  batch = toy.lstm_batch(8)
  prog, p, _, _ = build(model, toy.lstm_loss, batch, "1x2", split_lstm, 2, optax.sgd(0.1))
  monkeypatch.setattr(executor, "_on_param_access", lambda d, idx, what: touched.append((d, idx, what)))
  ts = prog.init_state(jax.tree.leaves(p))
  jax.make_jaxpr(prog.step_fn())(ts, prog.shard_batch(batch))
  lay = prog.layout
  assert {w for _, _, w in touched} == {"read", "grad"}
  for d, idx, _ in touched:
    assert lay.owner[idx] in (d, -1), f"device {d} touched leaf {idx} owned by {lay.owner[idx]}"
  # Both devices own leaves and each touched some of its own.
  assert {d for d, idx, _ in touched if lay.owner[idx] >= 0} == {0, 1}


def test_1f1b_bounds_residuals_alive_by_the_stages():
  edges = [(i, i + 1) for i in range(3)]
  for k in (4, 8, 16):
    s = task_schedule.generate("1f1b", 4, edges, [0, 1, 2, 3], 4, k)
    assert s.in_flight() == [4, 3, 2, 1]
    g = task_schedule.generate("gpipe", 4, edges, [0, 1, 2, 3], 4, k)
    assert g.in_flight() == [k] * 4


def _temp_bytes(schedule, k, global_batch=64):
  model = toy.Chain(width=64, layers=4, rngs=nnx.Rngs(0))
  batch = toy.regression_batch(global_batch)
  prog, p, _, _ = build(
    model, toy.mse_nnx, batch, "1x4", lambda n: toy.chain_stage(n, 4), k, optax.sgd(0.1),
    schedule=schedule,
  )
  ts = prog.init_state(jax.tree.leaves(p))
  return prog.lower(ts, batch).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_temp_memory_falls_as_microbatches_grow():
  """At a fixed global batch, more micro-batches = smaller residuals each, at most 4 alive."""
  t4, t16 = _temp_bytes("1f1b", 4), _temp_bytes("1f1b", 16)
  assert t16 < t4, (t4, t16)
  assert _temp_bytes("gpipe", 16) > t16


def test_1f1b_temp_memory_is_flat_in_microbatches_at_a_fixed_microbatch_size():
  """1F1B keeps at most M micro-batches in flight, so with a fixed micro-batch size (32 rows)
  the temporaries must not grow with k. Values with different lifetimes sharing one packed
  buffer, and each micro-batch's loss read at the end, once made k=16 1.67x k=4 here."""

  def temp(k):
    model = toy.Chain(width=256, layers=8, rngs=nnx.Rngs(0))
    batch = toy.regression_batch(32 * k)
    prog, p, _, _ = build(
      model, toy.mse_nnx, batch, "1x4", lambda n: toy.chain_stage(n, 4, 8), k, optax.adam(1e-3),
      schedule="1f1b",
    )
    ts = prog.init_state(jax.tree.leaves(p))
    return prog.lower(ts, batch).compile().memory_analysis().temp_size_in_bytes

  t4, t16 = temp(4), temp(16)
  assert t16 <= 1.15 * t4, (t4, t16, t16 / t4)


def test_gradient_additions_are_not_put_off_past_later_groups():
  """Each conditional after a gradient group reads the buffers its windows were added into
  (`executor._token`), so XLA adds them before it runs instead of keeping every window alive:
  without that, this GPipe pipeline compiled to 102 MB per device against 88 MB predicted."""
  model = toy.Chain(width=1024, layers=8, rngs=nnx.Rngs(0))
  batch = toy.regression_batch(64)
  prog, _, _, _ = build(
    model, toy.mse_nnx, batch, "1x2", lambda n: toy.chain_stage(n, 2, 8), 4, optax.adam(1e-3),
    schedule="gpipe",
  )
  r = prog.memory()
  assert abs(r.error) <= 0.05, r.table()


def test_one_microbatch_rows_are_their_windows_and_the_step_is_as_lean_as_plain_jit():
  """With one micro-batch each large leaf's gradient is one window of the step: the program
  keeps no zero-filled accumulator for it and updates it as soon as it exists, as plain
  `jax.jit` of the same step does per leaf (an accumulator made the 1x1 step 1.34x plain jit
  on a wider chain). In a 1F1B pipeline each micro-batch's gradient task adds to the rows."""
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.program import memory

  model = toy.Chain(width=1024, layers=8, rngs=nnx.Rngs(0))
  batch = toy.regression_batch(64)
  opt = optax.adam(1e-3)

  def program(mesh_spec, k, assign):
    prog, _, _, _ = build(model, toy.mse_nnx, batch, mesh_spec, assign, k, opt, schedule="1f1b")
    wins = gradients.gradient_windows(prog.structure, prog.graph, prog.layout)
    return prog, gradients.single_window_rows(wins, prog.layout)

  prog, single = program("1x1", 1, lambda n: 0)
  slots = {r for r, _ in prog.layout.sizes if "#" in r}
  assert slots and slots <= set(single), (slots, single)
  assert not program("1x2", 2, lambda n: toy.chain_stage(n, 2, 8))[1]
  r = prog.memory()
  # The model counts every window alive at once; XLA updates some rows earlier here.
  assert -0.05 <= r.error <= 0.25, r.table()
  _, p, s, pure = graph_lib.nnx_pure_loss(model, toy.mse_nnx, scopes=False)
  plain = memory.baseline_bytes(pure, p, s, batch, opt, mesh_lib.make("1x1"), "dp")["total"]
  assert r.compiled <= 1.15 * plain, (r.compiled, plain, r.table())


def _tower_hybrid(schedule="1f1b", plan=None):
  from jaxhybrid import api

  model = toy.Towers(rngs=nnx.Rngs(2))
  batch = toy.regression_batch(8)
  return api.parallelize(
    model, toy.mse_nnx, optax.sgd(0.1), batch, mesh="1x2", microbatches=2, planner="etf",
    plan=plan, program_options={"schedule": schedule} if plan is None else None,
  )


def test_plan_json_carries_the_task_schedule_and_v1_plans_load_as_gpipe(tmp_path):
  from jaxhybrid import planner

  hy = _tower_hybrid("zb")
  plan = hy.plan
  assert isinstance(plan.task_schedule, task_schedule.TaskSchedule)
  assert plan.task_schedule == hy.program.schedule and plan.task_schedule.kind == "zb"
  again = planner.Plan.from_json(plan.to_json())
  assert again == plan and again.schema_version == planner.SCHEMA_VERSION
  # Reapplying the saved plan runs the same schedule.
  assert _tower_hybrid(plan=again).program.schedule == plan.task_schedule
  # A version-1 plan (no task schedule) loads and its program runs GPipe.
  old = plan.to_dict()
  old["schema_version"] = 1
  del old["task_schedule"]
  v1 = planner.Plan.from_dict(old)
  assert v1.task_schedule == "gpipe"
  assert _tower_hybrid(plan=v1).program.schedule.kind == "gpipe"
  planner.gantt(plan, tmp_path / "gantt.png")
  assert (tmp_path / "gantt.png").stat().st_size > 1000


def test_bad_schedules_are_one_line_errors():
  hy = _tower_hybrid()
  g, assign = hy.graph, hy.plan.assignment
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid import program as program_lib

  m = mesh_lib.make("1x2")
  with pytest.raises(ValueError, match="schedule='fast' is unknown") as e:
    program_lib.HybridProgram.build(g, m, optax.sgd(0.1), assign, microbatches=2, schedule="fast")
  assert "\n" not in str(e.value)
  other = [1 - a for a in assign]  # the same tasks on the other devices: another plan's schedule
  with pytest.raises(ValueError, match="schedule for another plan") as e:
    program_lib.HybridProgram.build(
      g, m, optax.sgd(0.1), other, microbatches=2, schedule=hy.program.schedule
    )
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="micro-batches"):
    program_lib.HybridProgram.build(
      g, m, optax.sgd(0.1), assign, microbatches=4, schedule=hy.program.schedule
    )


def test_timeline_orders_tasks_by_their_dependencies():
  edges = [(0, 1)]
  s = task_schedule.generate("1f1b", 2, edges, [0, 1], 2, 2)
  t = task_schedule.timeline(s, edges, [3.0, 3.0])
  for c in range(2):
    assert t[("F", 0, c)][1] <= t[("F", 1, c)][0]
    assert t[("B", 1, c)][1] <= t[("B", 0, c)][0]
  assert max(end for _, end in t.values()) < 2 * 2 * 3.0  # the pipeline overlaps the devices


def test_dry_run_reports_memory_without_allocating(tmp_path):
  """run.py --dry_run: plans, compiles from abstract inputs, writes the memory table."""
  import json

  from jaxhybrid.train import dry_run, runner

  config = runner.RunConfig(
    model="biglstm", size="tiny", mesh="1x2", microbatches=2, planner="dp", dry_run=True,
    workdir=str(tmp_path / "dry"), hardware="dgx1-v100", schedule="zb",
  )
  results = dry_run.run(config)
  saved = json.loads((tmp_path / "dry" / "results.json").read_text())
  mem = saved["memory"]
  assert saved["fits"] and mem["compiled"] > 0 and mem["predicted"] > 0
  assert mem["compiled"] == mem["compiled_arguments"] + mem["compiled_temp"]
  assert saved["schedule"]["kind"] == "zb" and "memory per device" in results["memory_table"]
  assert (tmp_path / "dry" / "plan.json").exists()
  with pytest.raises(runner.errors.UsageError, match="--schedule='fast'"):
    dry_run.run(runner.RunConfig(model="gnmt", size="tiny", mesh="1x2", schedule="fast",
                                 dry_run=True, workdir=str(tmp_path / "bad")))


def test_a_plan_that_does_not_fit_is_a_one_line_error(tmp_path):
  """A device smaller than the program's predicted bytes: one line saying what to do."""
  from jaxhybrid.train import runner

  config = runner._resolve(runner.RunConfig(  # noqa: SLF001
    model="gnmt", size="tiny", mesh="1x2", microbatches=2, planner="dp",
    workdir=str(tmp_path / "w"), hardware="dgx1-v100",
  ))
  _, hybrid, _ = runner.build(config, abstract=True)
  need = hybrid.program.memory(compile=False).predicted
  runner.check_fits(hybrid, limit_bytes=need)  # exactly enough: no error
  with pytest.raises(runner.errors.UsageError, match=r"more model-axis devices") as err:
    runner.check_fits(hybrid, limit_bytes=need - 1)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("schedule,mesh_spec", [("1f1b", "1x2"), ("zb", "2x2")])
def test_one_window_per_leaf_matches_reference(monkeypatch, schedule, mesh_spec):
  """With every touched leaf in a window of its own (the rule for leaves >= WINDOW_SPLIT_BYTES,
  forced here for all), the step still equals the reference, and a device's window that holds
  one unclamped leaf is exactly that leaf's length (returned as it is: no concatenation)."""
  monkeypatch.setattr(gradients, "WINDOW_SPLIT_BYTES", 0)
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(16)
  opt = optax.adam(1e-2)
  prog, p, s, pure = build(
    model, toy.lstm_loss, batch, mesh_spec, split_lstm, 2, opt, schedule=schedule
  )
  lay = prog.layout
  all_windows = gradients.gradient_windows(prog.structure, prog.graph, lay, split_bytes=0)
  lone = 0
  for ws in all_windows:
    for w in ws or []:
      assert all(len(leaves) <= 1 for leaves in w.leaves), "split_bytes=0: one leaf per window"
      for d, leaves in enumerate(w.leaves):
        if leaves:
          (idx,) = leaves
          n = int(np.prod(lay.shapes[idx]))
          assert w.starts[d] <= lay.offset[idx] and lay.offset[idx] + n <= w.starts[d] + w.length
          lone += n == w.length
  assert lone > 0
  assert_matches_reference(prog, p, s, pure, batch, opt)


@pytest.mark.parametrize("schedule,mesh_spec", [("1f1b", "1x2"), ("zb", "2x2")])
def test_slot_rows_match_reference_and_are_read_in_place(monkeypatch, schedule, mesh_spec):
  """Large leaves in slot rows of their own (forced here for every leaf, with room for the
  padding): the step equals the reference, every slot leaf sits at offset 0, and a leaf that
  fills its slot row is read without a slice (no copy of the weights per task)."""
  monkeypatch.setattr(structure, "SLOT_MIN_BYTES", 0)
  monkeypatch.setattr(structure, "SLOT_EXTRA_FRACTION", 1.0)
  model = toy.Towers(rngs=nnx.Rngs(2))
  batch = toy.regression_batch(16)
  opt = optax.adam(1e-2)
  prog, p, s, pure = build(model, toy.mse_nnx, batch, mesh_spec, _towers, 2, opt, schedule=schedule)
  lay = prog.layout
  slots = {r: n for r, n in lay.sizes if "#" in r}
  assert slots, "every leaf may take a slot: the towers' weights should get slot rows"
  full = 0
  for i, r in enumerate(lay.row_of):
    if r in slots:
      assert lay.offset[i] == 0 and int(np.prod(lay.shapes[i])) <= slots[r]
      full += int(np.prod(lay.shapes[i])) == slots[r]
  assert full > 0
  assert_matches_reference(prog, p, s, pure, batch, opt)


def test_slot_rows_keep_the_padding_within_the_fraction():
  """Slot rows are made only while one device's rows stay within SLOT_EXTRA_FRACTION of one flat
  row padded to the largest device; leaves never overlap within a row."""
  import types



  rng = np.random.default_rng(0)
  for trial in range(20):
    n = int(rng.integers(2, 12))
    shapes = [(int(rng.integers(1, 600)), int(rng.integers(1, 600))) for _ in range(n)]
    avals = [jax.core.ShapedArray(sh, np.float32) for sh in shapes]
    devices = int(rng.integers(1, 4))
    nodes = [types.SimpleNamespace(id=i, param_leaves=(i,)) for i in range(n)]
    graph = types.SimpleNamespace(param_avals=avals, nodes=nodes)
    assignment = [int(rng.integers(0, devices)) for _ in range(n)]
    extra = float(rng.choice([0.0, 0.05, 0.5]))
    lay = structure.param_layout(graph, assignment, devices, slot_min_bytes=4096,
                                 slot_extra_fraction=extra)
    per_dev = [sum(int(np.prod(sh)) for sh, a in zip(shapes, assignment) if a == d)
               for d in range(devices)]
    assert sum(m for _, m in lay.sizes) <= max([1] + per_dev) * (1 + extra) + 1
    for d in range(devices):
      spans: dict[str, list] = {}
      for i, r in enumerate(lay.row_of):
        if lay.owner[i] == d:
          spans.setdefault(r, []).append((lay.offset[i], lay.offset[i] + int(np.prod(shapes[i]))))
      for r, sp in spans.items():
        sp.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(sp))
        assert sp[-1][1] <= dict(lay.sizes)[r]


@pytest.mark.parametrize("schedule,mesh_spec", [("1f1b", "1x2"), ("zb", "2x4")])
def test_own_lanes_match_reference_and_cost_no_copy(monkeypatch, schedule, mesh_spec):
  """Every value in a lane of its own (LANE_MIN_BYTES forced to 0): the step equals the
  reference; each lane holds one value per device, and a device whose value fills its lane
  writes no fill bytes for it."""
  monkeypatch.setattr(lockstep_rule, "LANE_MIN_BYTES", 0)
  model = toy.Exchange(rngs=nnx.Rngs(4))
  batch = toy.regression_batch(16, seed=2)
  opt = optax.adam(1e-2)
  M = int(mesh_spec.split("x")[1])
  prog, p, s, pure = build(
    model, toy.mse_nnx, batch, mesh_spec, lambda n: _exchange_tower(n) % M, 2, opt,
    schedule=schedule,
  )
  st = prog.structure
  lanes = 0
  for g, lay in enumerate(st.groups):
    for lane in lay.sizes:
      if "@" in lane:
        lanes += 1
        for writes in lay.writes.values():
          assert len([w for w in writes if w[1] == lane]) <= 1
    assert st.fill_bytes(g) <= st.output_bytes(g)
  assert lanes > 0
  assert sum(st.fill_bytes(g) for g in range(len(st.groups))) < sum(
    st.output_bytes(g) for g in range(len(st.groups)))
  assert_matches_reference(prog, p, s, pure, batch, opt)
