"""What a run predicts: the program's step time (lock step + all-reduce) and the projection."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import math
import os
import pathlib
from typing import Any

import numpy as np

from jaxhybrid import mesh as mesh_lib

log = logging.getLogger(__name__)

# Model config fields a run's `--set` passes on to the paper-size projection: they change how the
# model is cut into graph nodes (BigLSTM's and GNMT's `time_chunks`), not its size or its math.
# The run's other overrides describe its own (usually tiny) model and are not applied at paper
# size.
PROJECTION_OVERRIDES = ("time_chunks",)


def predicted_step_s(hybrid: Any, hardware: str | None,
                     calibration_values: dict[str, Any] | None = None) -> dict[str, Any]:
  """The program's per-worker step plus the ring all-reduce of the largest per-device gradient
  shard.

  The per-worker step is the lock-step price of the plan as the program runs it
  (`jaxhybrid.program.lockstep`: the program's task groups in lock step, transfers not
  overlapping compute). Without `calibration_values` (`jaxhybrid.train.calibration`, `run.py
  --calibrate`) the optimizer and buffer-fill passes and the groups' fixed costs are left out
  (they need timing on the device) and the links are the hardware profile's; with them, the
  measured link, passes and fixed costs are in (`lockstep_parts_s`). `fused_makespan_s` keeps
  the fused task model's makespan (the planner's warm start) for comparison.
  """
  from jaxhybrid import api
  from jaxhybrid.program import lockstep
  from jaxhybrid.train import calibration

  cal = calibration_values
  costs = api.default_costs(hardware, link=calibration.link(cal) if cal else None)
  prog = hybrid.program
  priced = lockstep.program_step_s(hybrid.graph, prog.structure, prog.assignment, costs,
                                   calibration.pass_costs(cal) if cal else None)
  lock = priced.step_s
  lay = hybrid.program.layout
  shared = sum(math.prod(lay.shapes[i]) * np.dtype(lay.dtypes[i]).itemsize for i in lay.shared)
  grad_bytes = max(lay.bytes_per_device()) + shared
  workers = hybrid.mesh.shape[mesh_lib.DATA]
  ar = costs.allreduce_time_s(grad_bytes, workers)
  # Under ZeRO stage 1 the rows' all-reduce is a reduce-scatter plus an all-gather: the same
  # bytes over the same ring, so the same time (none of it overlaps compute in the program).
  # Stage 2 reduce-scatters every micro-batch's gradients: k halves plus the all-gather's half.
  zero = getattr(prog, "zero", 0)
  if zero == 2 and workers > 1:
    ar *= (prog.microbatches + 1) / 2
  return {"fused_makespan_s": hybrid.plan.fused_makespan_s, "lockstep_step_s": lock,
          "lockstep_parts_s": {k: float(v) for k, v in dataclasses.asdict(priced).items()
                               if k.endswith("_s") and k != "step_s"},
          "allreduce_s": ar,
          "step_s": lock + ar, "grad_bytes_per_device": float(grad_bytes),
          "data_exchange": ("all-reduce" if not zero else "reduce-scatter + all-gather" if zero == 1
                            else f"{prog.microbatches} reduce-scatters + all-gather")}


def _code_digest() -> str:
  """A digest of the installed jaxhybrid sources (planner, cost model and models included): a
  cached S_MP is reused only by the code that computed it."""
  import jaxhybrid

  h = hashlib.sha256()
  root = pathlib.Path(jaxhybrid.__file__).parent
  dirs = [root] + [pathlib.Path(importlib.import_module(f"jaxhybrid.{sub}").__file__).parent
                   for sub in ("planner", "models")]
  for d in dirs:
    for f in sorted(d.rglob("*.py")):
      h.update(str(f.relative_to(d)).encode())
      h.update(f.read_bytes())
  return h.hexdigest()[:16]


def _s_mp_cached(key: dict[str, Any], compute: Any) -> Any:
  """S_MP from the cache under the measured-costs cache root (`$JAXHYBRID_PROFILE_CACHE`, default
  ~/.cache/jaxhybrid/profiles), folder `s_mp/`, keyed by `key` and the code's digest; else
  `compute()`, stored there. Planning the paper model takes seconds to minutes per run (14 s for
  BigLSTM on 2 cores); a rerun or a resumed run of the same configuration reads it back and
  reports the same projection. An unreadable or unwritable cache is skipped, never an error."""
  from jaxhybrid.costs import hardware
  from jaxhybrid.projection import s_mp

  # The key as JSON gives it back (tuples as lists): what a stored key is compared with.
  full = json.loads(json.dumps({**key, "code": _code_digest()}, sort_keys=True, default=str))
  name = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]
  path = pathlib.Path(os.environ.get(hardware.CACHE_ENV, hardware.DEFAULT_CACHE_DIR)).expanduser()
  path = path / "s_mp" / f"{name}.json"
  try:
    with open(path) as f:
      data = json.load(f)
    if data.get("key") == full:
      return s_mp.SMPEstimate(**data["estimate"])
  except (OSError, ValueError, TypeError, KeyError):
    pass
  est = compute()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
      json.dump({"key": full, "estimate": est.to_json()}, f, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:
    log.info("S_MP cache not written (%s)", e)
  return est


def project(config: Any, plan: Any, model_axis: int) -> Any:
  """The paper scenario's projection, S_MP from our planner: the model traced at paper size and
  the paper's batch on the run's DGX hardware (else dgx1-v100), planned for M = the model axis (2
  if 1) and every k of `advisor.SearchConfig` (heuristics + MILP, <= 5 s), priced in lock step;
  the best plan gives S_MP (cached: `_s_mp_cached`). This run's `plan` (tiny size) says nothing
  about the paper model's. The run's overrides named in PROJECTION_OVERRIDES apply to the paper
  model too.

  Returns:
    (Projection, SMPEstimate): the projection and the S_MP estimate it used (with its source).
  """
  del plan
  from jaxhybrid import advisor, projection
  from jaxhybrid.costs import hardware
  from jaxhybrid.projection import paper_scenario

  hw_name = config.hardware if config.hardware and config.hardware.startswith("dgx") else "dgx1-v100"
  hw = hardware.get(hw_name)
  m = model_axis if model_axis >= 2 else 2
  search = advisor.SearchConfig(devices=(m,), time_limit_s=min(config.time_limit_s, 5.0),
                                seed=config.seed)
  overrides = {k: v for k, v in getattr(config, "overrides", ()) if k in PROJECTION_OVERRIDES}
  key = {"model": config.model, "hardware": hw.name, "search": dataclasses.asdict(search),
         "overrides": overrides}
  est = _s_mp_cached(key, lambda: advisor.advise_model(
    config.model, hardware=hw.name, config=search, devices=[8], model_overrides=overrides).s_mp[0])
  w = paper_scenario.paper_workload(config.model, hw, s_mp=[est])
  comm = projection.CommConfig(zero=getattr(config, "zero", 0),
                               reduce_scatters=max(1, int(getattr(config, "microbatches", 1) or 1)))
  p = projection.project(w, hw, comm, [2**i for i in range(11)], m=m)
  return p, est
