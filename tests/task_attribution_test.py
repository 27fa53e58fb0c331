"""Per-task attribution of a traced step: task scopes in the program's HLO, and the sums over a
profile's events (experiments/bench/task_attribution.py)."""

from __future__ import annotations

import jax
import optax
import pytest
import toy
from conftest import experiment_module
from flax import nnx
from program_test import build, split_lstm

from jaxhybrid.program import executor


@pytest.fixture(scope="module")
def ta():
  return experiment_module("task_attribution")


def test_task_scope_round_trips_and_takes_the_innermost():
  assert executor.task_scope("B", 12, 3) == "B12_mb3"
  assert executor.task_of_op_name("jit(step)/cond/branch_1_fun/B12_mb3/dot") == ("B", 12, 3)
  assert executor.task_of_op_name("a/F1_mb0/transpose(jvp(F1_mb0))/W2_mb1") == ("W", 2, 1)
  assert executor.task_of_op_name("jit(step)/shard_map/cond/F10_mb0x/add") is None
  assert executor.task_of_op_name("jit(step)/shard_map/add") is None


def test_every_task_of_a_compiled_program_is_named_in_its_hlo(ta):
  model = toy.LSTMNet(rngs=nnx.Rngs(0))
  batch = toy.lstm_batch(8)
  prog, p, _, _ = build(model, toy.lstm_loss, batch, "1x2", split_lstm, 2, optax.adam(1e-2))
  hlo = prog.lower(prog.init_state(jax.tree.leaves(p)), batch).compile().as_text()
  names = ta.op_names(hlo)
  named = {executor.task_of_op_name(n) for n in names.values()} - {None}
  want = {(op.kind, op.node, op.microbatch) for lay in prog.structure.groups for _, op in lay.tasks}
  assert want and named == want


def _x(name, ts, dur, tid=1, hlo=None):
  e = {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}
  if hlo:
    e["args"] = {"hlo_op": hlo}
  return e


def test_op_names_reads_instructions_of_every_computation(ta):
  text = """
  %fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(step)/F2_mb0/add"}
  ROOT conditional.1 = (f32[4]{0}) conditional(%i), metadata={op_name="jit(step)/cond"}
  %param.0 = f32[4]{0} parameter(0)
"""
  assert ta.op_names(text) == {"fusion.3": "jit(step)/F2_mb0/add",
                               "conditional.1": "jit(step)/cond"}


def test_exclusive_times_take_nested_events_out(ta):
  events = [_x("while.1", 0, 100), _x("dot.2", 10, 30), _x("add.3", 50, 20),
            _x("dot.4", 0, 60, tid=2)]
  got = {e["name"]: own for e, own in ta.exclusive_times(events)}
  assert got == {"while.1": 50.0, "dot.2": 30.0, "add.3": 20.0, "dot.4": 60.0}


def test_attribute_sums_per_task_and_category_inside_the_window(ta):
  names = {"conv.1": "jit(step)/cond/branch_0_fun/F3_mb0/conv", "conv.2": "x/F3_mb1/conv",
           "dot.5": "x/B3_mb1/dot", "fusion.9": "jit(step)/shard_map/concatenate",
           "conditional.4": "jit(step)/cond", "ppermute.7": "jit(step)/ppermute"}
  events = [_x("conditional.4", 0, 1000, hlo="conditional.4"), _x("conv.1", 100, 300, hlo="conv.1"),
            _x("conv.2", 400, 200, hlo="conv.2"), _x("dot.5", 600, 100, hlo="dot.5"),
            _x("fusion.9", 1000, 50, hlo="fusion.9"), _x("ppermute.7", 1050, 400, hlo="ppermute.7"),
            _x("ThunkExecutor::Execute", 1450, 10),
            _x("ThunkExecutor::Execute (wait for completion)", 0, 1800, tid=2),  # the caller's
            _x("$api.py:1 block_until_ready", 0, 1900, tid=2),
            _x("conv.1", 5000, 300, hlo="conv.1")]  # outside the window
  got = ta.attribute(events, names, (0.0, 2000e-6))
  assert got["tasks"] == pytest.approx({"F3": 500e-6, "B3": 100e-6})
  assert got["other"] == pytest.approx({"conditional": 400e-6, "outside_tasks": 50e-6,
                                        "ppermute": 400e-6, "runtime": 10e-6})
  assert got["busy_s"] == pytest.approx(1050e-6)  # the conditional (holding the tasks), fusion.9
  got = ta.median_over_steps([{"a": 1.0}, {"a": 3.0, "b": 2.0}, {"a": 2.0}])
  assert got == {"a": 2.0, "b": 0.0}
