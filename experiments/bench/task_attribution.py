"""Which task spent a traced step's time: XLA:CPU profile events attributed through the HLO.

The hybrid program runs each task under a named scope (`jaxhybrid.program.executor.task_scope`,
e.g. 'B12_mb3'), which XLA keeps in every instruction's `op_name` metadata. A profile of the
compiled step (`jax.profiler`, XLA's CPU runtime) has one event per executed instruction, named
by the instruction. So per traced step:

- `op_names(hlo_text)`: instruction name -> op_name, from the optimized HLO XLA dumped;
- `exclusive_times(events)`: each event's own time on its thread, its nested events' time taken
  out (a while loop's event holds its body's instructions);
- `attribute(...)`: the events of one step window summed per task (kind, node), over its
  micro-batches, and the rest per category (beside them `busy_s`, the time any thread ran an
  instruction other than a collective): the group conditionals' own dispatch, the messages
  (`ppermute`), the data-axis all-reduce, instructions outside every task (the branch packing its
  outputs into the group buffer, the update, fills: 'outside_tasks') and the runtime's own
  events ('runtime').

Times are wall time on the thread: on a one-core process whose runtime runs thunks on two
threads, an event can include time the core spent on the other thread.
"""

from __future__ import annotations

import collections
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxhybrid.program.executor import task_of_op_name

# An instruction line of an HLO text dump: its name, and the op_name of its metadata if any.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^\n]*?op_name=\"([^\"]*)\"", re.M)
COLLECTIVES = ("ppermute", "collective-permute", "all-reduce")
# Events that are not the device's work: markers, the Python caller's frames ('$file:line ...')
# and the caller's wait for the step, which spans the whole step on another thread.
CALLER_EVENTS = ("end:", "$", "ThunkExecutor::Execute (wait for completion)")


def op_names(hlo_text: str) -> dict[str, str]:
  """Instruction name -> its `op_name` metadata, over every computation of an HLO text."""
  return {m.group(1): m.group(2) for m in _INSTR.finditer(hlo_text)}


def exclusive_times(events: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], float]]:
  """(event, its duration less its nested events' on the same thread) for complete ('X')
  events; microseconds as the trace gives them."""
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X":
      by_thread[e.get("tid")].append(e)
  out = []
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []  # [event, end, own time]
    for e in evs:
      end = e["ts"] + e["dur"]
      while stack and stack[-1][1] <= e["ts"]:
        done = stack.pop()
        out.append((done[0], done[2]))
      if stack:
        stack[-1][2] -= min(e["dur"], stack[-1][1] - e["ts"])
      stack.append([e, end, float(e["dur"])])
    out.extend((s[0], s[2]) for s in stack)
  return out


def _category(name: str, names: Mapping[str, str]) -> str:
  base = name.split(".")[0]
  if base in COLLECTIVES:
    return "all-reduce" if base == "all-reduce" else "ppermute"
  if base == "conditional":
    return "conditional"
  if name in names:
    return "outside_tasks"
  return "runtime"


def attribute(events: Sequence[Mapping[str, Any]], names: Mapping[str, str],
              window: tuple[float, float]) -> dict[str, Any]:
  """One step window's (seconds) time per task and per category, in seconds."""
  lo, hi = window[0] * 1e6, window[1] * 1e6
  inside = [e for e in events if e.get("ph") == "X" and lo <= e["ts"] and e["ts"] + e["dur"] <= hi
            and not e["name"].startswith(CALLER_EVENTS)]
  tasks: dict[str, float] = collections.defaultdict(float)
  other: dict[str, float] = collections.defaultdict(float)
  for e, own in exclusive_times(inside):
    hlo = e.get("args", {}).get("hlo_op", e["name"])
    task = task_of_op_name(names[hlo]) if hlo in names else None
    if task is not None:
      tasks[f"{task[0]}{task[1]}"] += own * 1e-6
    else:
      other[_category(hlo, names)] += own * 1e-6
  # The time any thread ran an instruction other than a collective (which waits for the other
  # device): below the sums above where two threads overlapped.
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in inside
                 if e.get("args", {}).get("hlo_op", e["name"]) in names
                 and e["name"].split(".")[0] not in COLLECTIVES)
  busy, end = 0.0, float("-inf")
  for a, b in spans:
    busy += max(0.0, b - max(a, end))
    end = max(end, b)
  return {"tasks": dict(tasks), "other": dict(other), "busy_s": busy * 1e-6}


def median_over_steps(per_step: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """Per key, the median over steps (0 where a step lacks the key)."""
  keys = sorted({k for s in per_step for k in s})
  return {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}
