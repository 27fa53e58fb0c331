r"""The data-axis collectives ZeRO chooses between, timed on one-core processes.

    python experiments/bench/bench_collectives.py --out=experiments/results/bench_collectives.json

Two (--procs) processes pinned to one core each (jaxhybrid.program.localcluster, gloo collectives
on localhost), one device each, mesh ('data',). For each payload size (MiB of float32 per
process), the median of --steps jitted calls of:

- `all_reduce_s`: `lax.psum` of the whole payload (the ZeRO-0 gradient exchange);
- `psum_scatter_s`: `lax.psum_scatter` of it ([W, n/W] -> [n/W]);
- `ring_scatter_s`: `zero.reduce_scatter(..., ring=True)`, W - 1 ppermutes of n/W and an add;
- `all_gather_s`: `lax.all_gather` of n/W per process (ZeRO's parameter gather).

Per size, `psum_scatter_plus_gather_over_all_reduce` and `ring_scatter_plus_gather_over_all_reduce`
are what ZeRO's exchange costs against the all-reduce (zero.RING_SCATTER_PLATFORMS takes the ring
on CPU devices by these figures).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from absl import app, flags

flags.DEFINE_list("mib", ["5", "38"], "Payload sizes per process (MiB of float32).")
flags.DEFINE_integer("procs", 2, "Processes (the data width W).")
flags.DEFINE_integer("steps", 15, "Timed calls per collective.")
flags.DEFINE_string("out", "", "Write the JSON here.")
flags.DEFINE_string("role", "driver", "Internal: driver | worker.")
FLAGS = flags.FLAGS

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def worker() -> None:
  from jaxhybrid.program import localcluster

  localcluster.worker_setup()
  import time

  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxhybrid.program import zero

  localcluster.worker_init()
  W = jax.process_count()
  mesh = jax.make_mesh((W,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  fns = {
    "all_reduce_s": lambda v: lax.psum(v, "data"),
    "psum_scatter_s": lambda v: zero.reduce_scatter(v.reshape(W, -1), W, ring=False),
    "ring_scatter_s": lambda v: zero.reduce_scatter(v.reshape(W, -1), W, ring=True),
    "all_gather_s": lambda v: lax.all_gather(v[: v.shape[0] // W], "data", axis=0, tiled=True),
  }
  rows = []
  for mib in (float(m) for m in FLAGS.mib):
    n = int(mib * 2**20) // 4 // W * W
    x = jax.make_array_from_callback((W * n,), NamedSharding(mesh, P("data")),
                                     lambda i, n=n: np.ones(n, np.float32))
    row = {"mib": mib, "processes": W}
    for name, f in fns.items():
      g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      jax.block_until_ready(g(x))
      ts = []
      for _ in range(FLAGS.steps):
        t = time.perf_counter()
        jax.block_until_ready(g(x))
        ts.append(time.perf_counter() - t)
      row[name] = float(np.median(ts))
    for kind in ("psum_scatter", "ring_scatter"):
      row[f"{kind}_plus_gather_over_all_reduce"] = (
        (row[f"{kind}_s"] + row["all_gather_s"]) / row["all_reduce_s"])
    rows.append(row)
  if jax.process_index() == 0:
    print("ROWS " + json.dumps(rows), flush=True)


def main(argv) -> None:
  del argv
  sys.path.insert(0, _ROOT)
  if FLAGS.role == "worker":
    worker()
    return
  from jaxhybrid.program import localcluster

  args = [os.path.abspath(__file__), "--role=worker", f"--mib={','.join(FLAGS.mib)}",
          f"--steps={FLAGS.steps}"]
  res = localcluster.launch(args, FLAGS.procs, timeout_s=900)
  rows = next(json.loads(line[5:]) for line in res[0].stdout.splitlines()
              if line.startswith("ROWS "))
  for r in rows:
    print(f"{r['mib']:g} MiB x {r['processes']}: all-reduce {r['all_reduce_s'] * 1e3:.1f} ms, "
          f"psum_scatter {r['psum_scatter_s'] * 1e3:.1f}, ring {r['ring_scatter_s'] * 1e3:.1f}, "
          f"all-gather {r['all_gather_s'] * 1e3:.1f}; (scatter + gather) / all-reduce: "
          f"psum_scatter {r['psum_scatter_plus_gather_over_all_reduce']:.2f}, "
          f"ring {r['ring_scatter_plus_gather_over_all_reduce']:.2f}")
  if FLAGS.out:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import provenance

    pathlib.Path(FLAGS.out).write_text(json.dumps(
      {"program": provenance.program_commit(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
