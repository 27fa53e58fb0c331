"""bench_memory's summary: the ratios its targets and the docs quote, computed from the rows
(`bench_memory.py` writes them beside the rows after every row)."""

GiB = 2**30


def summary(rows):
  """The targets' ratios (the file's `summary`), from its rows."""
  out = {}

  def best(model, m, sched=None, k=None):
    c = [r["compiled"] for r in rows if r["model"] == model and r["M"] == m
         and (sched is None or r["schedule"] == sched) and (k is None or r["k"] == k)]
    return min(c) if c else None

  one = best("chain", 1)
  for m in (2, 4, 8):
    b = best("chain", m, "1f1b")
    if one and b:
      out[f"chain_1x{m}_over_1x1"] = b / one
  t = {r["k"]: r["compiled_temp"] for r in rows
       if r["model"] == "chain_big_batch" and r["schedule"] == "1f1b"}
  if 4 in t and 16 in t:
    out["chain_1x4_temp_k16_over_k4"] = t[16] / t[4]
  for model in sorted({r["model"] for r in rows if r["model"].endswith("@fixed_mb")}):
    t = {r["k"]: r["compiled_temp"] for r in rows if r["model"] == model}
    if 4 in t and 16 in t:
      m = next(r["M"] for r in rows if r["model"] == model)
      out[f"{model.split('@')[0]}_1x{m}_1f1b_temp_k16_over_k4_fixed_microbatch"] = t[16] / t[4]
  errs = [abs(r["error"]) for r in rows if r["error"] is not None]
  if errs:
    out["prediction_error_max"] = max(errs)
    out["prediction_error_mean"] = sum(errs) / len(errs)
  for model in sorted({r["model"] for r in rows if r["model"].endswith("@zero")}):
    name = model.split("@")[0]
    for mesh in sorted({r["mesh"] for r in rows if r["model"] == model}):
      by = {r["zero"]: r for r in rows if r["model"] == model and r["mesh"] == mesh}
      fsdp = by.get(0, {}).get("baselines", {}).get("fsdp", {}).get("total")
      for z, r in by.items():
        if z and 0 in by:
          out[f"{name}_{mesh}_zero{z}_over_zero0"] = r["compiled"] / by[0]["compiled"]
        if z and fsdp:
          out[f"{name}_{mesh}_zero{z}_over_fsdp"] = r["compiled"] / fsdp
  for model in {r["model"] for r in rows if not r["model"].endswith("@zero")}:
    for m in {r["M"] for r in rows if r["model"] == model}:
      b = best(model, m)
      # The planner's rows compare with the FSDP baseline of the same model's registry row.
      of = model.split("@")[0] if "@planner" in model else model
      base = next((r for r in rows if r["model"] == of and r["M"] == m and "baselines" in r),
                  None)
      if b and base:
        out[f"{model}_1x{m}_over_fsdp"] = b / base["baselines"]["fsdp"]["total"]
        out[f"{model}_1x{m}_over_dp"] = b / base["baselines"]["dp"]["total"]
  for r in rows:
    if "@batch_split_" in r["model"]:
      name, label = r["model"].split("@")
      key = f"{name}_1x{r['M']}_k{r['k']}_{label}"
      out[f"{key}_over_fsdp"] = r["compiled"] / r["fsdp_total"]
      placed = next((x for x in rows if x["model"] == f"{name}@placed" and x["M"] == r["M"]
                     and x["k"] == r["k"]), None)
      if placed:
        out[f"{key}_over_placed"] = r["compiled"] / placed["compiled"]
      rep = next((x for x in rows if x["model"] == f"{name}@batch_split_replicated"
                  and x["M"] == r["M"] and x["k"] == r["k"]), None)
      if rep and label == "batch_split_split":
        out[f"{key}_over_replicated"] = r["compiled"] / rep["compiled"]
  planned = [e for r in rows if "@planner" in r["model"] for e in r.get("planner_device_error", ())]
  if planned:  # the planner's per-device figure against the compiled program, every device
    out["planner_device_error_max"] = max(abs(e) for e in planned)
  # The same over the rows whose planner was given the tasks' temporaries (`task_temp`: asked
  # for by ':temps', or 'auto' on a model whose static bytes reach a quarter of the cap).
  counted = [e for r in rows if "@planner" in r["model"] and (
    r.get("planner_task_temp") == "program" or (r.get("planner_task_temp") == "auto"
                                                and r.get("planner_counted_task_temps")))
    for e in r.get("planner_device_error", ())]
  if counted:
    out["planner_device_error_max_task_temps"] = max(abs(e) for e in counted)
  for m in (1, 2):
    b = best("biglstm:paper", m)
    if b:
      out[f"biglstm_paper_1x{m}_gib"] = b / GiB
      out[f"biglstm_paper_1x{m}_fits_16gib"] = b <= 16 * GiB
  return out
