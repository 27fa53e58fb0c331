"""Child process of lockstep_cpsat.py: the CP-SAT model of a placement's lock-step groups.

Run as a script (`python lockstep_cpsat_worker.py`), JSON in on stdin, JSON out on stdout, so that
OR-Tools never shares a process with python-mip (cpsat.py says why); it imports nothing of
jaxhybrid. All quantities are integers (lockstep_cpsat.py scales them). Input fields:
  devices, groups (G: group indices 0..G-1), dur[t], dev[t], deps[] = [u, t, cross] (t runs in a
  group >= u's, > when cross), send[t] (message time of what t sends), grad[t] (parameter-gradient
  bytes of t, -1 for a task that writes none), grad_node[t], grad_cap, memory (null or
  {residual[t], release[t] (index of the task that frees t's residuals, or -1), room[d], null for a device
  whose residuals all fit at once}),
  hint[t], time_limit_s, deterministic_time (or null), threads, seed.
Output: status, objective, bound (null when none) and group[t] (or null).
"""

import json
import sys
import threading
import time

from ortools.sat.python import cp_model


def build(data):
  """Group indicators b[t][j], group lengths L[j] and message times S[j]; objective sum L + S."""
  M, G = data["devices"], data["groups"]
  dur, dev = data["dur"], data["dev"]
  T = len(dur)
  h = data["hint"]
  m = cp_model.CpModel()
  g = [m.new_int_var(0, G - 1, f"g{t}") for t in range(T)]
  b = [[m.new_bool_var(f"b{t}_{j}") for j in range(G)] for t in range(T)]
  for t in range(T):
    m.add_exactly_one(b[t])
    m.add(g[t] == sum(j * b[t][j] for j in range(G)))
  for u, t, cross in data["deps"]:
    m.add(g[t] >= g[u] + cross)
  on = [[t for t in range(T) if dev[t] == d] for d in range(M)]
  L = [m.new_int_var(0, max(1, sum(dur)), f"L{j}") for j in range(G)]
  S = [m.new_int_var(0, max(1, sum(data["send"])), f"S{j}") for j in range(G)]
  for j in range(G):
    for d in range(M):
      m.add(L[j] >= sum(dur[t] * b[t][j] for t in on[d]))
      senders = [t for t in on[d] if data["send"][t]]
      if senders:
        m.add(S[j] >= sum(data["send"][t] * b[t][j] for t in senders))
    # A complete hint (every variable), so that CP-SAT starts from the warm schedule itself.
    m.add_hint(L[j], max(sum(dur[t] for t in on[d] if h[t] == j) for d in range(M)))
    m.add_hint(S[j], max(sum(data["send"][t] for t in on[d] if h[t] == j) for d in range(M)))
  # Gradient tasks: one node per device and group, or several whose bytes fit the cap.
  for d in range(M):
    nodes = sorted({data["grad_node"][t] for t in on[d] if data["grad"][t] >= 0})
    if len(nodes) < 2:
      continue
    tasks_of = {n: [t for t in on[d] if data["grad"][t] >= 0 and data["grad_node"][t] == n]
                for n in nodes}
    nbytes = {n: data["grad"][tasks_of[n][0]] for n in nodes}
    for j in range(G):
      z = {}
      for n in nodes:
        z[n] = m.new_bool_var("")
        for t in tasks_of[n]:
          m.add_implication(b[t][j], z[n])
        m.add_hint(z[n], int(any(h[t] == j for t in tasks_of[n])))
      one = m.new_bool_var("")
      m.add_hint(one, int(sum(any(h[t] == j for t in tasks_of[n]) for n in nodes) <= 1))
      m.add(sum(z.values()) <= 1).only_enforce_if(one)
      m.add(sum(nbytes[n] * z[n] for n in nodes) <= data["grad_cap"]).only_enforce_if(~one)
  mem = data.get("memory")
  if mem is not None:
    # Residuals alive in group j: every F in a group <= j whose release task is in a group >= j
    # (all of group j's forwards counted before any of its releases: an upper bound).
    capped = {d for d in range(M) if mem["room"][d] is not None}
    upto = {}  # t -> [g[t] <= j for j]
    for t in range(T):
      if dev[t] in capped:
        upto[t] = [m.new_bool_var("") for j in range(G)]
        m.add(upto[t][0] == b[t][0])
        for j in range(1, G):
          m.add(upto[t][j] == upto[t][j - 1] + b[t][j])
        for j in range(G):
          m.add_hint(upto[t][j], int(h[t] <= j))
    for d in range(M):
      fwd = [t for t in on[d] if mem["residual"][t] > 0]
      if not fwd or mem["room"][d] is None:
        continue
      for j in range(G):
        alive = []
        for t in fwd:
          r = mem["release"][t]
          # F done by j and release not before j: upto[t][j] - upto[r][j - 1].
          alive.append(mem["residual"][t] * upto[t][j])
          if j > 0 and r >= 0:
            alive.append(-mem["residual"][t] * upto[r][j - 1])
        m.add(sum(alive) <= mem["room"][d])
  m.minimize(sum(L) + sum(S))
  for t in range(T):
    m.add_hint(g[t], h[t])
    for j in range(G):
      m.add_hint(b[t][j], int(h[t] == j))
  return m, g


class _Stall(cp_model.CpSolverSolutionCallback):
  """Stops the search once `stall_s` pass without a better solution (the clock: only runs
  without a deterministic limit)."""

  def __init__(self, solver, stall_s, start, log=False):
    super().__init__()
    self._cp, self.stall_s, self.log = solver, stall_s, log
    self.last = time.monotonic()
    self.start_time = start
    self.done = threading.Event()
    self.thread = threading.Thread(target=self._watch, daemon=True)

  def start(self):
    self.thread.start()

  def on_solution_callback(self):
    self.last = time.monotonic()
    if self.log:
      print(f"{self.last - self.start_time:.2f}s {self.objective_value:.0f}", file=sys.stderr)

  def _watch(self):
    while not self.done.wait(0.05):
      if time.monotonic() - self.last > self.stall_s:
        self._cp.stop_search()
        return



def main():
  data = json.load(sys.stdin)
  start = time.monotonic()
  m, g = build(data)
  if data.get("log"):
    print(f"built in {time.monotonic() - start:.2f}s", file=sys.stderr)
  solver = cp_model.CpSolver()
  params = solver.parameters
  # The limit covers building the model too.
  params.max_time_in_seconds = max(0.05, data["time_limit_s"] - (time.monotonic() - start))
  params.random_seed = data["seed"]
  if data.get("deterministic_time") is not None:
    params.max_deterministic_time = data["deterministic_time"]
  if data["threads"] <= 1:
    params.interleave_search = True  # as cpsat_worker: two subsolvers in one thread
    params.num_workers = 2
  else:
    params.num_workers = data["threads"]
  # No presolve: measured on Inception-V3 paper M=4 k=4 (two workers), presolve took 2.6 s
  # before the first move from the (complete) hint; without it the search reached in 5.8 s
  # what it reached in 11.7 s with it.
  params.cp_model_presolve = False
  stall = data.get("stall_s")
  stopper = None
  if stall and data.get("deterministic_time") is None:
    stopper = _Stall(solver, stall, start, log=bool(data.get("log")))
    stopper.start()
  status = solver.solve(m, stopper)
  if stopper is not None:
    stopper.done.set()
  out = {"status": solver.status_name(status), "objective": None, "bound": None, "group": None}
  if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
    out["objective"] = int(solver.objective_value)
    out["bound"] = int(solver.best_objective_bound)
    out["group"] = [int(solver.value(v)) for v in g]
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
