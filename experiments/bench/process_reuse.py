r"""Does a one-core step slow down once other compiled steps have run in the same process?

    python experiments/bench/process_reuse.py --model=inception_v3 \
        --out=experiments/results/process_reuse.json

bench_mp timed every candidate plan and the one-device step in the same two processes, in
rotated rounds, before it gave each configuration processes of its own. This checks what
sharing a process costs a step: two processes, each pinned to
one core as bench_mp's (jaxhybrid.program.localcluster, with its malloc tunables), build the
model's plain `jax.jit` training step (Adam) at --batch and --others more at smaller batches
(batch - 8, batch - 16, ...: other executables and other buffer sizes). Round 1 times the
--batch step before any other step has run; every later round runs the others first, then
times it again. Per process: `first_round_step_s` and `later_rounds_step_s` (medians) and their
ratio; the JSON keeps every step time.
"""

from __future__ import annotations

import json
import pathlib
import sys

if __name__ == "__main__" and "--role=worker" in sys.argv:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from jaxhybrid.program import localcluster

  localcluster.worker_setup()

from absl import app, flags

flags.DEFINE_string("model", "inception_v3", "Registry model (small preset).")
flags.DEFINE_integer("batch", 64, "Batch of the timed step.")
flags.DEFINE_integer("others", 3, "Other compiled steps run between the rounds.")
flags.DEFINE_integer("rounds", 3, "Rounds (the first before any other step).")
flags.DEFINE_integer("steps", 6, "Timed steps per round.")
flags.DEFINE_string("out", "", "Write the JSON here.")
flags.DEFINE_string("role", "driver", "Internal: driver | worker.")
FLAGS = flags.FLAGS


def worker() -> None:
  import jax  # noqa: F401  (starts the backend after the core is pinned)
  import numpy as np
  import optax
  from flax import nnx

  import bench_baselines  # experiments/bench/ (the script's folder)
  from jaxhybrid import graph as graph_lib
  from jaxhybrid import models

  spec = models.get(FLAGS.model, "small")
  opt = optax.adam(1e-4)
  _, p, s, pure = graph_lib.nnx_pure_loss(spec.make(nnx.Rngs(0)), spec.loss_fn, scopes=False)

  def make(b: int) -> list:
    step = jax.jit(bench_baselines.plain_step(pure, opt), donate_argnums=0)
    return [step, *bench_baselines.local_carry(opt, (p, s), spec.synthetic_batch(0, b))]

  runs = [make(FLAGS.batch)] + [make(FLAGS.batch - 8 * (i + 1)) for i in range(FLAGS.others)]
  times = []
  for r in range(FLAGS.rounds):
    for run in (runs[1:] + runs[:1]) if r else runs[:1]:
      t, run[1], _ = bench_baselines.step_times(run[0], run[1], run[2], FLAGS.steps, 1)
    times.append(t)  # the --batch step's, timed last in the round
  first, later = float(np.median(times[0])), float(np.median(np.concatenate(times[1:])))
  print("RESULT " + json.dumps({"first_round_step_s": first, "later_rounds_step_s": later,
                                "later_over_first": later / first, "step_s": times}))


def main(argv) -> None:
  del argv
  if FLAGS.role == "worker":
    return worker()
  from jaxhybrid.program import localcluster

  args = [__file__, "--role=worker", f"--model={FLAGS.model}", f"--batch={FLAGS.batch}",
          f"--others={FLAGS.others}", f"--rounds={FLAGS.rounds}", f"--steps={FLAGS.steps}"]
  done = localcluster.launch(args, 2, timeout_s=1800)
  procs = [json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[7:])
           for r in done]
  out = {"model": FLAGS.model, "size": "small", "batch": FLAGS.batch, "others": FLAGS.others,
         "rounds": FLAGS.rounds, "steps": FLAGS.steps, "processes": procs}
  for i, pr in enumerate(procs):
    print(f"process {i}: first round {pr['first_round_step_s']:.3f} s, later rounds "
          f"{pr['later_rounds_step_s']:.3f} s ({pr['later_over_first']:.2f}x)")
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", FLAGS.out)


if __name__ == "__main__":
  app.run(main)
