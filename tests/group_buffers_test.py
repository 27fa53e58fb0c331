"""Group buffers as the memory model counts them: a hand-made schedule whose buffers are derived
by hand, the rule that shares packed lanes between values of different lifetimes, and the
planner's count of each task's own temporaries."""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest
import toy
from flax import nnx
from program_test import build

from jaxhybrid.planner.core import task_schedule
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.pricing import price
from jaxhybrid.program import group_bytes, tasks


def _hand_chain(device1_groups, batch):
  """Chain(width 64, 2 layers) on 1x2 with k=2 and a GPipe task order given by hand: device 0
  runs inp and layers/0 (groups 0, 0, 1, 1, 3, 3, 4, 4), device 1 layers/1 and head in
  `device1_groups`. Returns (program, parameters)."""
  model = toy.Chain(width=64, layers=2, rngs=nnx.Rngs(0))
  F = lambda n, c: task_schedule.Op("F", n, c)  # noqa: E731
  B = lambda n, c: task_schedule.Op("B", n, c)  # noqa: E731
  hand = task_schedule.TaskSchedule(
    kind="custom", split=False, microbatches=2,
    devices=((F(0, 0), F(1, 0), F(0, 1), F(1, 1), B(1, 0), B(0, 0), B(1, 1), B(0, 1)),
             (F(2, 0), F(3, 0), F(2, 1), F(3, 1), B(3, 0), B(2, 0), B(3, 1), B(2, 1))),
    groups=((0, 0, 1, 1, 3, 3, 4, 4), tuple(device1_groups)),
  )
  prog, p, _, _ = build(
    model, toy.mse_nnx, batch, "1x2", lambda n: toy.chain_stage(n, 2, 2), 2, optax.sgd(0.1),
    schedule=hand,
  )
  return prog, p


def test_group_buffers_of_a_hand_made_schedule_are_counted_as_derived():
  """The memory model counts every group buffer for as long as the program keeps it: a two-
  device GPipe schedule given by hand (explicit groups), whose buffers are derived below.

  Chain(width 64, 2 layers), 8 rows per micro-batch, k=2; device 0 runs inp and layers/0, device
  1 layers/1 and head (with the loss). A = 8x64 float32 (2048 B), Y = 8x4 float32, L = the loss
  scalar. Per micro-batch, device 0 keeps inp's output and layers/0's tanh residual (2A, until
  B(layers/0)) and sends layers/0's output (A, which its own B reads again); device 1 receives
  it (A, until B(layers/1)) and keeps layers/1's output, its residual and head's (2A + Y) and
  the loss (L, to the end); its cotangent back to device 0 is a message (A) received for one
  group. A kept lane is as long as the longest device's part (2A + Y when both keep values).
  """
  batch = toy.regression_batch(16)
  prog, p = _hand_chain((1, 1, 2, 2, 2, 2, 3, 3), batch)
  assert [n.name for n in prog.graph.nodes] == ["inp", "layers/0", "layers/1", "head"]
  A, Y, L = 8 * 64 * 4, 8 * 4 * 4, 4
  expected = [
    4 * A,                   # g0: dev 0's message A + kept 2A; dev 1's receive A
    8 * A + Y + L,           # g1: + message A, kept lane 2A + Y, loss, receive A
    12 * A + 2 * Y + 2 * L,  # g2: + cotangent message (dies), kept 2A + Y, loss, receive A
    12 * A + 2 * Y + 2 * L,  # g3: g0's receive and g2's message gone; + cotangent receive A
    4 * A + Y + 2 * L,       # g4: g1's message and kept lane, two losses, g3's receive
  ]
  assert group_bytes.live_bytes(prog.structure) == expected
  report = prog.memory(compile=False)
  assert report.live_peak == max(expected)
  ts = prog.init_state(jax.tree.leaves(p))
  temp = prog.lower(ts, batch).compile().memory_analysis().temp_size_in_bytes
  assert temp >= max(expected), (temp, expected)


def test_kept_values_share_lanes_by_lifetime_interval_at_least_bytes_times_groups():
  """`tasks.lifetime_lanes`: equal values on every device with different lifetimes share one
  lane (the SPMD program allocates a lane on every device), while a short-lived large value does
  not share the lane of a long-lived small one (that lane would live long at the large size)."""
  size = {"a": 4, "b": 4, "c": 4, "d": 4}
  life = {"a": 7, "b": 5, "c": 3, "d": 1}
  lanes = tasks.lifetime_lanes({0: ["a"], 1: ["b"], 2: ["c"], 3: ["d"]}, life, size.get)
  assert set(lanes.values()) == {0}
  size = {"long": 1, "short": 4, "short2": 4}
  life = {"long": 12, "short": 2, "short2": 2}
  lanes = tasks.lifetime_lanes({0: ["long"], 1: ["short", "short2"]}, life, size.get)
  assert lanes[12] != lanes[2]
  # Exact over interval partitions (lane length x (longest lifetime + 1)):
  size = {"x": 8, "y": 1, "z": 8}
  life = {"x": 1, "y": 10, "z": 9}
  lanes = tasks.lifetime_lanes({0: ["x", "y"], 1: ["z"]}, life, size.get)
  # {10} alone (1 x 11) + {9, 1} (8 x 10) = 91 beats one lane (9 x 11 = 99), {10, 9} + {1}
  # (8 x 11 + 8 x 2 = 104) and three lanes (11 + 80 + 16 = 107).
  assert lanes[10] != lanes[9] and lanes[9] == lanes[1]


def test_parameter_copies_are_counted_once_per_group_from_first_to_last_reader():
  """`memory.param_copies`: a task reads its node's leaves sliced out of the device's packed row
  (the chain's leaves are far below the slot-row size), so each is a copy. F of layers/0 copies
  its 64x64 kernel and 64 biases (float32); `group_bytes.in_group_bytes` counts a copy once per
  device and group however many tasks read it, from the first reader to the last."""
  from jaxhybrid.program import memory

  prog, _ = _hand_chain((1, 1, 2, 2, 2, 2, 3, 3), toy.regression_batch(16))
  copies = memory.param_copies(prog)
  F = lambda n, c: task_schedule.Op("F", n, c)  # noqa: E731
  B = lambda n, c: task_schedule.Op("B", n, c)  # noqa: E731
  assert sum(copies(0, F(1, 0)).values()) == (64 * 64 + 64) * 4
  assert copies(0, F(1, 0)) == copies(0, F(1, 1))  # the same leaves, keyed by leaf
  assert set(copies(0, B(1, 0))) <= set(copies(0, F(1, 0)))
  # Every task reads a 1000-byte copy of one key: each group holds it once on top of the rest.
  plain = group_bytes.in_group_bytes(prog.structure)
  one = group_bytes.in_group_bytes(prog.structure, copies=lambda d, op: {"w": 1000})
  assert [b - a for a, b in zip(plain, one)] == [1000] * len(plain)
  # With the program's own copies, each group grows by at most its devices' copies summed.
  real = group_bytes.in_group_bytes(prog.structure, copies=copies)
  for g, lay in enumerate(prog.structure.groups):
    most = max(
      sum({k: v for dd, op in lay.tasks if dd == d for k, v in copies(d, op).items()}.values())
      for d in range(2))
    assert plain[g] <= real[g] <= plain[g] + most


def test_a_tasks_own_temporaries_join_the_peak_of_its_group():
  """`Problem.task_temp_bytes` (F's, B's) counts while the task runs, beside what its branch and
  the group buffers hold: the hand-made two-device schedule of planner_fbw_test, whose group
  peaks without temporaries are [40, 83, 45] and whose row is 20 bytes."""
  prob = Problem.build([3, 2], [(0, 1)], devices=2, memory_bytes=[10, 20],
                       activation_bytes=[5, 3], edge_bytes=[40])
  F, B = (lambda i, t=t: task_schedule.Op(t, i, 0) for t in "FB")
  sch = task_schedule.TaskSchedule(kind="custom", split=False, microbatches=1,
                                   devices=((F(0), B(0)), (F(1), B(1))))
  assert price.group_peak_bytes(prob, (0, 1), sch) == [40, 83, 45]
  temps = dataclasses.replace(prob, task_temp_bytes=((100, 7), (1, 2)))
  # Group 0: F0's 100 beside nothing in its branch; group 1: B1's 2 beside F1's residual (3)
  # made in the branch (F1's 1 beside the same 3 is less); group 2: B0's 7.
  assert price.group_peak_bytes(temps, (0, 1), sch) == [40 + 100, 80 + 3 + 2, 45 + 7]
  assert price.peak_memory_bytes(temps, (0, 1), sch) == [20 + 140] * 2
  # On one device the residual profile: F0 (5 + 100) is the peak.
  one = dataclasses.replace(temps, devices=1, transfer_s=(((0.0,),),))
  sch1 = task_schedule.TaskSchedule(kind="custom", split=False, microbatches=1,
                                    devices=((F(0), F(1), B(1), B(0)),))
  assert price.peak_memory_bytes(one, (0, 0), sch1) == [30 + 105]
  with pytest.raises(ValueError, match="task_temp_bytes"):
    dataclasses.replace(prob, task_temp_bytes=((1, 1),))
