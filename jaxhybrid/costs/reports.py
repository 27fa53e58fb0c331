"""Printable reports of a cost model: the per-node time table."""

from __future__ import annotations

from jaxhybrid import graph as graph_lib
from jaxhybrid.costs.cost_model import CostModel


def time_table(graph: graph_lib.OpGraph, costs: CostModel, max_rows: int | None = None) -> str:
  """A node table of forward + backward times and outgoing-activation transfer times (0 -> 1)."""
  total = costs.step_time_s(graph)
  rows = [
    f"{'id':>4}  {'module path':<40} {'fwd+bwd ms':>11} {'share':>6} {'send ms':>9}"
    f"   ({costs.source}, {costs.hardware_name})"
  ]
  for n in graph.nodes[: max_rows or len(graph.nodes)]:
    t = costs.node_time_s(n)
    send = costs.transfer_time_s(n.out_bytes, 0, 1)
    rows.append(
      f"{n.id:>4}  {n.name[:40]:<40} {t * 1e3:>11.4f} {t / total if total else 0:>6.1%} "
      f"{send * 1e3:>9.4f}"
    )
  if max_rows and len(graph.nodes) > max_rows:
    rows.append(f"  ... {len(graph.nodes) - max_rows} more nodes")
  grad_bytes = graph.total_param_bytes
  rows.append(
    f"single-device step {total * 1e3:.3f} ms; all-reduce of {grad_bytes / 1e6:.1f} MB gradients "
    f"over 8 workers {costs.allreduce_time_s(grad_bytes, 8) * 1e3:.3f} ms"
  )
  return "\n".join(rows)

