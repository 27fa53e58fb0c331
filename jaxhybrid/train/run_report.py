"""The end of a run: the loss plot and the text report printed by `experiments/run.py`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plot_loss(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
  """Loss versus step (PNG)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], "-")
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _size(n: float) -> str:
  """Bytes as GiB from 1 GiB up, else MiB."""
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_report(results: dict[str, Any]) -> str:
  """The end-of-run text: plan, predicted versus measured step time, projection, outputs."""
  c, m = results["config"], results["metrics"]
  pred, meas = results["predicted_step_s"], results["measured_step_s"]
  lines = [
    f"{c['model']} ({c['size']}) on mesh {c['mesh']}, batch {c['batch']}/worker, "
    f"{c['microbatches']} micro-batch(es), planner {c['planner']}, data {c['data']}",
    results["plan"]["summary"],
    f"loss {m['first_loss']:.4f} -> {m['final_loss']:.4f} over steps {m['resumed_from']}..{m['steps']}"
    if m["first_loss"] is not None else "no steps run",
    "step time: measured "
    + (f"{meas * 1e3:.3f} ms, {meas / pred:.2f}x the prediction" if meas and pred else "n/a")
    + (f" (the plan's predicted step + {results['predicted']['allreduce_s'] * 1e3:.3f} ms of "
       f"gradient exchange over the data axis = {pred * 1e3:.3f} ms, "
       f"{results['plan']['hardware']} costs)" if results['predicted']['allreduce_s'] else
       f" (the plan's predicted step, {results['plan']['hardware']} costs)"),
  ]
  mem = results.get("memory")
  if mem:
    lines.append(
      f"memory per device (predicted): {_size(mem['predicted_bytes'])} (parameters "
      f"{_size(mem['params_bytes'])}, optimizer state {_size(mem['optimizer_bytes'])}, gradients "
      f"{_size(mem['gradients_bytes'])}; ZeRO stage {mem['zero']})")
  if results["devices"]["platform"] == "cpu" and results["devices"]["count"] > 2:
    lines.append("  (simulated CPU devices share the cores: measured times say nothing about MP speed)")
  if results.get("projection_table"):
    lines.append(f"projection (S_MP from {results['projection']['s_mp_source']}):")
    lines.append(results["projection_table"])
  lines.append(f"outputs in {c['workdir']}: results.json plan.json metrics.jsonl gantt.png loss.png"
               + (" projection.png" if results.get("projection") else ""))
  return "\n".join(lines)
