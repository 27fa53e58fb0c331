"""Child process of cpsat.py: builds and solves the CP-SAT model of the pipelined placement.

Run as a script (`python cpsat_worker.py`), JSON in on stdin, JSON out on stdout, so that OR-Tools
never shares a process with python-mip (see cpsat.py). All times are integers (cpsat.py scales
and rounds them down). Input fields: k, devices, durations[i], edges[e] = [src, dst],
delays[e][a][b], horizon, lower, memory[i] and caps[d] (or null), first_devices (allowed devices
of node 0: one per class of devices interchangeable in links and caps), hint_assignment[i],
hint_starts[i][c], time_limit_s, deterministic_time (or null), threads, seed, gap. Output:
status, bound (CP-SAT's proven bound on C, or null), objective (its best C), assignment[i] and
starts[i][c] (or null).
"""

import json
import sys
import time

from ortools.sat.python import cp_model


def build(data):
  """The model: placement literals x, starts s and makespan C (see cpsat.py)."""
  k, M, P = data["k"], data["devices"], data["durations"]
  n, H = len(P), data["horizon"]
  m = cp_model.CpModel()
  x = [[m.new_bool_var(f"x{i}_{d}") for d in range(M)] for i in range(n)]
  s = [[m.new_int_var(0, H, f"s{i}_{c}") for c in range(k)] for i in range(n)]
  C = m.new_int_var(min(data["lower"], H), H, "C")
  intervals = [[] for _ in range(M)]
  for i in range(n):
    m.add_exactly_one(x[i])
    for c in range(k):
      for d in range(M):
        intervals[d].append(
          m.new_optional_fixed_size_interval_var(s[i][c], P[i], x[i][d], f"t{i}_{c}_{d}")
        )
      if c:  # the micro-batches of a node run in order
        m.add(s[i][c] >= s[i][c - 1] + P[i])
    m.add(C >= s[i][k - 1] + P[i])
    if data.get("release") is not None:  # bounds valid for every placement (bounds._earliest)
      for c in range(k):
        m.add(s[i][c] >= data["release"][i][c])
        m.add(C >= s[i][c] + P[i] + data["tail"][i][c])
  for d in range(M):
    m.add_no_overlap(intervals[d])
    # Redundant: a device's load ends by C (strengthens the linear relaxation).
    m.add(C >= k * sum(P[i] * x[i][d] for i in range(n)))
  for e, (j, i) in enumerate(data["edges"]):
    for c in range(k):
      m.add(s[i][c] >= s[j][c] + P[j])
    for a in range(M):
      for b in range(M):
        delay = data["delays"][e][a][b]
        if delay > 0:
          for c in range(k):
            m.add(s[i][c] >= s[j][c] + P[j] + delay).only_enforce_if(x[j][a], x[i][b])
  if data["caps"] is not None:
    for d in range(M):
      m.add(sum(data["memory"][i] * x[i][d] for i in range(n)) <= data["caps"][d])
  if n:  # symmetry: the first node on a representative device of each orbit
    m.add_bool_or([x[0][d] for d in data["first_devices"]])
  m.minimize(C)
  _hint(m, x, s, [[a == d for d in range(M)] for a in data["hint_assignment"]],
        data["hint_starts"])
  return m, x, s


def _hint(m, x, s, x_values, s_values):
  """Hints every placement literal and start time."""
  for row, values in zip(x + s, x_values + s_values):
    for v, value in zip(row, values):
      m.add_hint(v, value)


def _snapshot(solver, x, s):
  """(objective, placement literal values, starts) of the solver's best solution."""
  return (solver.objective_value, [[solver.value(v) for v in row] for row in x],
          [[solver.value(v) for v in row] for row in s])


# Share of the time limit for the first phase, CP-SAT's default portfolio (a full search beside
# the neighbourhood searches: it proves small problems optimal). The rest goes, with two or more
# workers, to neighbourhood search alone from the best schedule so far: on Inception-V3 (M = 4,
# k = 4, 40 s, two workers) the default portfolio reached 0.392-0.400 s (mean 0.397 s, 7 runs),
# neighbourhood search alone 0.389-0.396 s (mean 0.394 s, 7 runs).
FULL_SEARCH_SHARE = 0.15


def _params(solver, data, seconds, lns_only):
  params = solver.parameters
  params.max_time_in_seconds = max(0.05, seconds)
  params.random_seed = data["seed"]
  params.relative_gap_limit = data["gap"]
  if data.get("deterministic_time") is not None:
    params.max_deterministic_time = data["deterministic_time"]
  if data["threads"] <= 1:
    # One thread: interleave two subsolvers in it (the full search and the large-neighbourhood
    # searches), deterministic like a single worker. Measured on Inception-V3 (M = 4, k = 4, 45
    # s): one plain worker reached 0.439 s, two interleaved 0.407 s, four 0.412 s, eight 0.428 s;
    # eight also took 20 s to prove a 3-node problem that the others prove in 0.4 s.
    params.interleave_search = True
    params.num_workers = 2
  else:
    params.num_workers = data["threads"]
    params.use_lns_only = lns_only


def main():
  data = json.load(sys.stdin)
  start = time.monotonic()
  m, x, s = build(data)
  limit = data["time_limit_s"]
  solver = cp_model.CpSolver()
  # Two phases only with parallel workers, whose search races anyway; they split the limit by
  # wall-clock time, so a deterministic time limit keeps one phase.
  two_phases = data["threads"] > 1 and data.get("deterministic_time") is None
  _params(solver, data, limit * FULL_SEARCH_SHARE if two_phases else limit, lns_only=False)
  status = solver.solve(m)
  bound = solver.best_objective_bound
  best = _snapshot(solver, x, s) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
  left = limit - (time.monotonic() - start)
  closed = best is not None and best[0] - bound <= data["gap"] * abs(best[0])
  if two_phases and status in (cp_model.FEASIBLE, cp_model.UNKNOWN) and not closed and left > 0.5:
    if best is not None:  # continue from the best schedule
      m.clear_hints()
      _hint(m, x, s, best[1], best[2])
    solver = cp_model.CpSolver()
    _params(solver, data, left, lns_only=True)
    status = solver.solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and (
        best is None or solver.objective_value < best[0]):
      best = _snapshot(solver, x, s)
    if status != cp_model.INFEASIBLE:
      bound = max(bound, solver.best_objective_bound)
  out = {"status": solver.status_name(status), "bound": None, "objective": None,
         "assignment": None, "starts": None}
  if status == cp_model.INFEASIBLE:
    json.dump(out, sys.stdout)
    return
  out["bound"] = int(bound)
  if best is not None:
    out["status"] = "OPTIMAL" if best[0] <= bound else "FEASIBLE"
    out["objective"] = int(best[0])
    out["assignment"] = [next(d for d, v in enumerate(row) if v) for row in best[1]]
    out["starts"] = best[2]
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
