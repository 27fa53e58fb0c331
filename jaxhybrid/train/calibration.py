"""`run.py --calibrate`: the run's machine measured once and cached, then planned and priced with.

Without it a run plans with the analytic cost model of its hardware profile (node times from a
roofline, the profile's links) and prices the program's step without the per-step passes or the
fixed costs of a lock-step group. With it, before planning, on two of the run's model-axis
devices:

- the link between them (`costs.calibrate.calibrate_link`: latency and bandwidth of a ring
  `ppermute`), which replaces the profile's links in the planner's and the prediction's costs;
- the optimizer's update, a gradient addition and a buffer fill, per byte
  (`program.lockstep.measure_pass_costs`), added to the predicted step;
- the per-group and per-task costs of the hybrid program beyond its tasks and its messages
  (`program.group_cost.measure`), which the planner prices (`PlannerOptions.group_s`,
  `task_fixed_s`) and the prediction adds.

The figures are a property of the machine, its devices and the optimizer, so they are cached
(`costs.calibration_cache`, `$JAXHYBRID_CALIBRATION_CACHE`), keyed by the machine fields and the
setup below, and a later run on the same machine reads them (`source: cache`). One process
only: the measurements run collectives on this process's devices.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

# Cache entry name and setup (bump `version` when the measurement changes).
NAME = "run"
VERSION = 1
# Timed ppermutes per message size and timed steps per tiny program (counts).
LINK_REPEATS = 11
GROUP_STEPS = 20


def _pair_mesh(mesh: Any) -> Any:
  """A 1 x 2 (data, model) mesh of the first two devices of `mesh`'s first model row."""
  from jaxhybrid import mesh as mesh_lib

  devices = np.asarray(mesh.devices).reshape(-1, mesh.shape[mesh_lib.MODEL])[0, :2]
  return jax.sharding.Mesh(devices.reshape(1, 2), (mesh_lib.DATA, mesh_lib.MODEL))


def measure(mesh: Any, optimizer: Any, *, link_repeats: int = LINK_REPEATS,
            group_steps: int = GROUP_STEPS) -> dict[str, Any]:
  """The three measurements of the module docstring on `mesh`'s first two model devices (every
  process holding one of them must call it)."""
  from jaxhybrid.costs import calibrate
  from jaxhybrid.program import group_cost, lockstep

  pair = _pair_mesh(mesh)
  link = calibrate.calibrate_link(list(pair.devices.flat), repeats=link_repeats)
  passes = lockstep.measure_pass_costs(optimizer)
  groups = group_cost.measure(pair, link, steps=group_steps)
  return {"link_alpha_s": link.alpha_s, "link_bandwidth_bytes_s": link.bandwidth_bytes_s,
          "update_s_per_byte": passes.update_s_per_byte, "add_s_per_byte": passes.add_s_per_byte,
          "fill_s_per_byte": passes.fill_s_per_byte, "group_s": groups.group_s,
          "task_fixed_s": groups.task_fixed_s, "group_fit": groups.to_json()}


def load_or_measure(mesh: Any, optimizer: Any, optimizer_name: str, *,
                    refresh: bool = False) -> dict[str, Any]:
  """This machine's entry ({'source', 'path', 'values', 'provenance'}): cached, else measured
  on `mesh` (model axis >= 2, one process) and cached.

  Raises:
    ValueError: a model axis of one device, or several processes.
  """
  from jaxhybrid import mesh as mesh_lib
  from jaxhybrid.costs import calibration_cache

  if mesh.shape[mesh_lib.MODEL] < 2:
    raise ValueError("--calibrate measures between two model-axis devices: use a mesh with a "
                     "model axis of 2 or more (e.g. --mesh=1x2)")
  if jax.process_count() > 1:
    raise ValueError("--calibrate runs in one process: calibrate once single-process on this "
                     "machine (the figures are cached), then start the multi-process run")
  device = jax.devices()[0]
  setup = {"version": VERSION, "optimizer": optimizer_name, "platform": device.platform,
           "device_kind": device.device_kind, "devices": jax.device_count()}
  cache = calibration_cache.CalibrationCache()
  how = (f"ring ppermute between two model-axis devices (median of {LINK_REPEATS} per size); "
         "update, addition and fill of a 32 MiB float32 buffer; per-group and per-task costs "
         f"fitted to tiny hybrid programs ({GROUP_STEPS} steps each)")
  entry, measured = cache.get_or_measure(NAME, lambda: measure(mesh, optimizer), setup, how,
                                         refresh=refresh)
  source = "measured" if measured else "cache"
  entry = {**entry, "values": refit_groups(entry["values"])}
  log.info("calibration (%s): group %.3g s, task %.3g s, link alpha %.3g s", source,
           entry["values"]["group_s"], entry["values"]["task_fixed_s"],
           entry["values"]["link_alpha_s"])
  return {"source": source, "path": str(cache.path(NAME, setup)), **entry}


def refit_groups(values: dict[str, Any]) -> dict[str, Any]:
  """`values` with the per-group and per-task costs fitted again, by this version's
  `group_cost.fit`, to the programs' points the entry recorded (`group_fit.points`): the points
  are the measurement, the fit is the model's, so a cached entry is priced as a new one would
  be. Values without points are returned as they are."""
  from jaxhybrid.program import group_cost

  points = (values.get("group_fit") or {}).get("points")
  if not points:
    return values
  group_s, task_fixed_s, intercept = group_cost.fit([tuple(p) for p in points])
  fitted = {"group_s": group_s, "task_fixed_s": task_fixed_s}
  return {**values, **fitted, "group_fit": {**values["group_fit"], **fitted,
                                            "intercept_s": intercept}}


def link(values: dict[str, Any], source: str = "run.py --calibrate") -> Any:
  from jaxhybrid import costs

  return costs.Link(alpha_s=values["link_alpha_s"],
                    bandwidth_bytes_s=values["link_bandwidth_bytes_s"], source=source)


def pass_costs(values: dict[str, Any]) -> Any:
  from jaxhybrid.program import lockstep

  return lockstep.PassCosts(
    update_s_per_byte=values["update_s_per_byte"], add_s_per_byte=values["add_s_per_byte"],
    fill_s_per_byte=values["fill_s_per_byte"], group_s=values["group_s"],
    task_fixed_s=values["task_fixed_s"])


def planner_options(values: dict[str, Any]) -> dict[str, float]:
  """The fixed costs the planner prices, as `PlannerOptions` fields."""
  return {"group_s": float(values["group_s"]), "task_fixed_s": float(values["task_fixed_s"])}
