"""Projection reports and inputs: a text table, a speedup plot, and S_MP read from planner JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jaxhybrid.projection.framework import Projection


def format_table(p: Projection) -> str:
  """A plain-text table of one projection (for logs and the command line)."""
  lines = [
    f"{p.model} on {p.hardware}, M={p.m}, S_MP={p.s_mp:g}",
    f"{'N':>6} {'S_DP':>9} {'S_hyb':>9} {'hyb/DP':>7} {'T_DP ms':>9} {'T_hyb ms':>9} "
    f"{'SE_DP':>6} {'SE_hyb':>6}  best (W x M)",
  ]
  for i, n in enumerate(p.devices):
    _, w_best, m_best, _ = p.best[i]
    lines.append(
      f"{n:>6} {p.s_dp[i]:>9.2f} {p.s_hyb[i]:>9.2f} {p.s_hyb[i] / p.s_dp[i]:>7.3f} "
      f"{p.t_step_dp_s[i] * 1e3:>9.1f} {p.t_step_hyb_s[i] * 1e3:>9.1f} {p.se_dp[i]:>6.3f} "
      f"{p.se_hyb[i]:>6.3f}  {w_best} x {m_best}"
    )
  lines.append(
    f"crossover N* = {p.crossover_devices}; gain at scale (best hybrid / best DP - 1) = "
    f"{p.gain_at_scale * 100:.1f}%; at N={p.devices[-1]}: {p.gain_at_max_devices * 100:.1f}%"
  )
  return "\n".join(lines)


def plot(projections: Sequence[Projection], path: str) -> None:
  """Speedup versus devices, DP and hybrid per model, crossover marked; saved as a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(projections), figsize=(5 * len(projections), 4), squeeze=False)
  for ax, p in zip(axes[0], projections):
    ax.plot(p.devices, p.s_dp, "o-", label="DP")
    ax.plot(p.devices, p.s_hyb, "s-", label=f"hybrid (M={p.m}, S_MP={p.s_mp:g})")
    if p.crossover_devices is not None:
      ax.axvline(p.crossover_devices, color="gray", ls="--", label=f"N* = {p.crossover_devices}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("devices N")
    ax.set_ylabel("time-to-accuracy speedup over 1 device")
    ax.set_title(f"{p.model} ({p.hardware}): gain {p.gain_at_scale * 100:.1f}%")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def s_mp_from_json(
  path: str, model: str | None = None, m: int | None = None, key: str = "predicted_speedup"
) -> float:
  """Reads S_MP (`predicted_speedup`, or another `key`) from a Plan JSON or a planner bench JSON.

  A Plan JSON has a top-level `predicted_speedup`. In any other JSON the dicts holding `key` are
  collected, anywhere in the file; if several, `model` (matched against a 'model' or 'name' key)
  and `m` (against 'devices', 'num_devices' or 'm') select; if several still match once both are
  given (e.g. one per micro-batch count), the largest speedup counts, the configuration one runs.

  Raises:
    ValueError: if no entry matches, or several do and `model` or `m` is missing.
  """
  with open(path) as f:
    data = json.load(f)
  found: list[dict[str, Any]] = []

  def walk(x: Any) -> None:
    if isinstance(x, dict):
      if key in x:
        found.append(x)
      for v in x.values():
        walk(v)
    elif isinstance(x, list):
      for v in x:
        walk(v)

  walk(data)
  if len(found) > 1 and model is not None:
    found = [e for e in found if model in (e.get("model"), e.get("name"))] or found
  if len(found) > 1 and m is not None:
    found = [e for e in found if m in (e.get("devices"), e.get("num_devices"), e.get("m"))]
  if not found or (len(found) > 1 and (model is None or m is None)):
    raise ValueError(
      f"{path}: {len(found)} entries with {key!r} match model={model!r}, M={m}; "
      "pass a Plan JSON or name the model and M."
    )
  return max(float(e[key]) for e in found)
