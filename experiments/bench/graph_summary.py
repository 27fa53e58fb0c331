r"""Prints the op graph of a model's training loss and its analytic per-node times.

Traces abstractly (no parameter is allocated), so paper sizes work on a laptop:

  python experiments/bench/graph_summary.py --model=biglstm --size=paper
  python experiments/bench/graph_summary.py --model=inception_v3 --size=paper --depth=2 --max_nodes=40 \
      --hardware=dgx1-v100
  python experiments/bench/graph_summary.py --model=gnmt --size=small --hardware=cpu

Expect two tables: the graph (module path, forward GFLOP, MB read/written, parameter MB, output
activation MB per node) and the analytic forward + backward time per node on `--hardware`, with
the time to send each node's outputs to another device, the single-device step time and the
8-worker ring all-reduce of the gradients.
"""

from __future__ import annotations

import time

from absl import app, flags

from jaxhybrid import costs, graph, models
from jaxhybrid.costs import hardware

_MODEL = flags.DEFINE_enum("model", "biglstm", list(models.names()), "Model to trace.")
_SIZE = flags.DEFINE_enum("size", "paper", list(models.SIZES), "Model size preset.")
_BATCH = flags.DEFINE_integer(
  "batch", 128, "Per-device batch size (128 is BigLSTM's per-GPU batch in the paper)."
)
_DEPTH = flags.DEFINE_integer(
  "depth", None, "Uniform cut: module-path components that name a node (default: cut the "
  "module tree towards --max_nodes, as parallelize does)."
)
_MAX_NODES = flags.DEFINE_integer(
  "max_nodes", None, "Node-count target and bound (default: jaxhybrid.graph.DEFAULT_MAX_NODES "
  "without --depth, no bound with it)."
)
_HARDWARE = flags.DEFINE_enum(
  "hardware", "dgx1-v100", list(hardware.names()), "Hardware of the analytic cost model."
)
_ROWS = flags.DEFINE_integer("rows", None, "Print at most this many node rows per table.")


def main(argv):
  del argv
  spec = models.get(_MODEL.value, _SIZE.value)
  start = time.perf_counter()
  g = graph.trace(
    spec.abstract_model(), spec.loss_fn, spec.batch_spec(_BATCH.value),
    depth=_DEPTH.value, max_nodes=_MAX_NODES.value,
  )
  seconds = time.perf_counter() - start
  print(
    f"{spec.name} ({spec.size}), batch {_BATCH.value}, depth {_DEPTH.value}: traced in "
    f"{seconds:.1f} s"
  )
  print(g.summary(max_rows=_ROWS.value))
  print()
  print(costs.time_table(g, costs.AnalyticCostModel(_HARDWARE.value), max_rows=_ROWS.value))


if __name__ == "__main__":
  app.run(main)
