r"""Where hybrid parallelism wins: per device count the best (data, model, micro-batches, planner).

  python experiments/advise.py --model=inception_v3 --hardware=dgx1-v100
  python experiments/advise.py --model=biglstm --hardware=dgx-a100 --devices=8,64,512 \
      --planners=dp,interleaved,etf --b_noise=measured:runs/x/metrics.jsonl --set time_chunks=4

The model is traced at --size (abstractly), planned for every M in --mp and k in --microbatches
with each of --planners, priced as the program runs (lock step), and checked against the device
memory; every (W, M) split of each N is then scored by predicted time-to-accuracy (the paper
scenario's workload: FLOP-count step time, all-reduce over the topology, SE of the global batch).
Prints the table (the recommended split never exceeds the memory) and the crossover; writes
advice.json and advice.png to --out_dir. Expect a few minutes on 2 cores with the MILP in the grid.
For your own module, call `jaxhybrid.advise(model, loss_fn, batch, b_noise=...)`.
"""

from __future__ import annotations

import json
import logging
import os

from absl import app, flags

from jaxhybrid import advisor, projection
from jaxhybrid.costs import hardware
from jaxhybrid.projection import paper_scenario
from jaxhybrid.train import runner

_MODEL = flags.DEFINE_enum("model", "inception_v3", list(paper_scenario.PAPER_MODELS), "Model.")
_SIZE = flags.DEFINE_enum("size", "paper", ["tiny", "small", "paper"], "Size traced and planned.")
_HARDWARE = flags.DEFINE_enum("hardware", "dgx1-v100", list(hardware.names()), "Node type.")
_DEVICES = flags.DEFINE_list("devices", [str(2**k) for k in range(3, 11)], "Device counts N.")
_MP = flags.DEFINE_list("mp", ["2", "4", "8"], "M values planned.")
_K = flags.DEFINE_list("microbatches", ["1", "2", "4", "8"], "k values planned.")
_PLANNERS = flags.DEFINE_list("planners", ["dp", "interleaved", "etf", "milp"], "Planners.")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 5.0, "Seconds per MILP plan.")
_OPT_FACTOR = flags.DEFINE_float("optimizer_state_factor", 2.0, "Optimizer bytes per param byte.")
_MEM_FRACTION = flags.DEFINE_float("usable_memory_fraction", 0.9, "Usable share of memory.")
_B_NOISE = flags.DEFINE_string("b_noise", None, "Noise scale: a value or measured:<metrics.jsonl>.")
_B_NOISE_MODE = flags.DEFINE_enum("b_noise_mode", "trajectory", ["trajectory", "mean"],
                                  "Measured noise scale: integrate the run, or its mean.")
_OVERLAP = flags.DEFINE_float("overlap", 0.0, "Fraction of the all-reduce hidden by backward.")
_OUT = flags.DEFINE_string("out_dir", "results/advise", "Output directory.")
_SET = flags.DEFINE_multi_string("set", [], "Model config override key=value before tracing, "
                                 "e.g. --set time_chunks=4 (BigLSTM's layers in 4 time chunks).")


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("mip").setLevel(logging.WARNING)
  config = advisor.SearchConfig(
    devices=tuple(int(v) for v in _MP.value), microbatches=tuple(int(v) for v in _K.value),
    planners=tuple(_PLANNERS.value), time_limit_s=_TIME_LIMIT.value,
    optimizer_state_factor=_OPT_FACTOR.value, usable_memory_fraction=_MEM_FRACTION.value,
  )
  overrides = {}
  if _B_NOISE.value and _B_NOISE.value.startswith("measured:"):
    measured = projection.read_noise_scale(_B_NOISE.value.partition(":")[2])
    overrides["se"] = projection.se_from_noise_scale(measured, _B_NOISE_MODE.value)
  elif _B_NOISE.value:
    overrides["b_noise"] = float(_B_NOISE.value)
  advice = advisor.advise_model(
    _MODEL.value, hardware=_HARDWARE.value, devices=[int(n) for n in _DEVICES.value],
    size=_SIZE.value, config=config, comm=projection.CommConfig(overlap=_OVERLAP.value),
    model_overrides=dict(runner.parse_overrides(_SET.value)), **overrides,
  )
  print(advisor.format_advice(advice))
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "advice.json"), "w") as f:
    json.dump(advice.to_json(), f, indent=1)
  advisor.plot_advice([advice], os.path.join(_OUT.value, "advice.png"))
  logging.info("wrote %s/advice.json and advice.png", _OUT.value)


if __name__ == "__main__":
  app.run(main)
