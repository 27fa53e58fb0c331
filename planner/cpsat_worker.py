"""Child process of cpsat.py: builds and solves the CP-SAT model of the pipelined placement.

Run as a script (`python cpsat_worker.py`), JSON in on stdin, JSON out on stdout, so that OR-Tools
never shares a process with python-mip (see cpsat.py). All times are integers (cpsat.py scales
and rounds them down). Input fields: k, devices, durations[i], edges[e] = [src, dst],
delays[e][a][b], horizon, lower, memory[i] and caps[d] (or null), first_devices (allowed devices of
node 0), hint_assignment[i], hint_starts[i][c], time_limit_s, threads, seed, gap. Output: status,
bound (CP-SAT's proven bound on C, or null), objective (its best C), assignment[i] and starts[i][c] (or null).
"""

import json
import sys

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
  for i in range(n):
    for d in range(M):
      m.add_hint(x[i][d], data["hint_assignment"][i] == d)
    for c in range(k):
      m.add_hint(s[i][c], data["hint_starts"][i][c])
  return m, x, s


def main():
  data = json.load(sys.stdin)
  m, x, s = build(data)
  solver = cp_model.CpSolver()
  params = solver.parameters
  params.max_time_in_seconds = data["time_limit_s"]
  params.random_seed = data["seed"]
  params.relative_gap_limit = data["gap"]
  if data["threads"] <= 1:
    # One thread: interleave two subsolvers in it (the full search and the large-neighbourhood
    # searches), deterministic like a single worker. Measured on Inception-V3 (M = 4, k = 4, 45
    # s): one plain worker reached 0.439 s, two interleaved 0.407 s, four 0.412 s, eight 0.428 s;
    # eight also took 20 s to prove a 3-node problem that the others prove in 0.4 s.
    params.interleave_search = True
    params.num_workers = 2
  else:
    params.num_workers = data["threads"]
  status = solver.solve(m)
  out = {"status": solver.status_name(status), "bound": None, "assignment": None, "starts": None}
  if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
    out["bound"] = int(solver.best_objective_bound)
    out["objective"] = int(solver.objective_value)
    out["assignment"] = [next(d for d, v in enumerate(row) if solver.value(v)) for row in x]
    out["starts"] = [[solver.value(v) for v in row] for row in s]
  elif status == cp_model.UNKNOWN:
    out["bound"] = int(solver.best_objective_bound)
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
