"""The package layout: imports flow one way between the steps, no cycles, README names import.

The import graph is read statically (ast), so the check is exact and fast: every `import` /
`from ... import` of a jaxhybrid module, at module level or inside a function, is an edge.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Installed package name -> folder (pyproject's package-dir mapping).
PACKAGE_DIRS = {"jaxhybrid": "jaxhybrid", "jaxhybrid.models": "models", "jaxhybrid.planner": "planner"}

# Which step may import which (DESIGN.md's flow). Keys and values are "units": a sub-package
# (jaxhybrid.graph, ...), a leaf module (jaxhybrid.mesh, ...), or jaxhybrid.api. A unit may always
# import itself.
LEAVES = {"jaxhybrid.mesh", "jaxhybrid.errors", "jaxhybrid.noise_scale"}
ALLOWED = {
  "jaxhybrid.graph": set(),
  "jaxhybrid.costs": {"jaxhybrid.graph", "jaxhybrid.mesh"},
  "jaxhybrid.planner": set(),
  "jaxhybrid.models": set(),
  "jaxhybrid.program": {"jaxhybrid.graph", "jaxhybrid.costs", "jaxhybrid.mesh",
                        "jaxhybrid.noise_scale", "jaxhybrid.errors", "jaxhybrid.planner"},
  "jaxhybrid.projection": {"jaxhybrid.costs", "jaxhybrid.noise_scale", "jaxhybrid.models"},
  "jaxhybrid.api": {"jaxhybrid.graph", "jaxhybrid.costs", "jaxhybrid.planner", "jaxhybrid.program",
                    "jaxhybrid.mesh", "jaxhybrid.errors"},
  # The planner -> projection glue (S_MP from our plans, the advisor): above api, below train.
  "jaxhybrid.advisor": {"jaxhybrid.api", "jaxhybrid.graph", "jaxhybrid.costs", "jaxhybrid.planner",
                        "jaxhybrid.program", "jaxhybrid.projection", "jaxhybrid.models",
                        "jaxhybrid.mesh", "jaxhybrid.errors", "jaxhybrid.noise_scale"},
  "jaxhybrid.train": {"jaxhybrid.advisor", "jaxhybrid.api", "jaxhybrid.graph", "jaxhybrid.costs", "jaxhybrid.planner",
                      "jaxhybrid.program", "jaxhybrid.projection", "jaxhybrid.models",
                      "jaxhybrid.mesh", "jaxhybrid.errors", "jaxhybrid.noise_scale"},
  "jaxhybrid.mesh": set(),
  "jaxhybrid.errors": set(),
  "jaxhybrid.noise_scale": set(),
}


def _modules() -> dict[str, pathlib.Path]:
  """Every module of the installed package: dotted name -> file."""
  out = {}
  for pkg, folder in PACKAGE_DIRS.items():
    for path in sorted((ROOT / folder).rglob("*.py")):
      rel = path.relative_to(ROOT / folder).with_suffix("")
      parts = [p for p in rel.parts if p != "__init__"]
      if pkg == "jaxhybrid" and parts and parts[0] in ("models", "planner"):
        continue
      out[".".join([pkg, *parts])] = path
  return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The jaxhybrid modules `name` imports (module level and inside functions)."""
  is_pkg = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = name.split(".") if is_pkg else name.split(".")[:-1]
        base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for t in targets:
      while t and t not in modules:
        t = t.rpartition(".")[0]
      if t and t != name and t != "jaxhybrid":  # the root package loads nothing eagerly
        found.add(t)
  return found


def _unit(module: str) -> str:
  if module in LEAVES or module in ("jaxhybrid.api", "jaxhybrid"):
    return module
  return ".".join(module.split(".")[:2])


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_the_layout_has_one_package_per_step():
  modules = _modules()
  for unit in ALLOWED:
    assert unit in modules, f"{unit} is missing"
  for m in modules:
    assert m == "jaxhybrid" or _unit(m) in ALLOWED, f"{m} belongs to no step of the flow"


def test_imports_flow_one_way_between_steps():
  bad = []
  for module, targets in _graph().items():
    if module == "jaxhybrid":
      continue  # the top-level package only loads sub-packages lazily, by name
    src = _unit(module)
    for t in targets:
      dst = _unit(t)
      if dst != src and dst not in ALLOWED[src]:
        bad.append(f"{module} -> {t}")
  assert not bad, "imports against the flow:\n" + "\n".join(sorted(bad))


def test_no_import_cycles_between_modules():
  graph = _graph()
  state: dict[str, int] = {}
  stack: list[str] = []
  cycles = []

  def visit(m: str) -> None:
    state[m] = 1
    stack.append(m)
    for t in sorted(graph.get(m, ())):
      # A package's __init__ re-exporting its own modules is not a cycle with them.
      if m != "jaxhybrid" and t.startswith(m + "."):
        continue
      if state.get(t) == 1:
        cycles.append(stack[stack.index(t):] + [t])
      elif t not in state:
        visit(t)
    stack.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state and m != "jaxhybrid":
      visit(m)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail():
  """The DFS above on a hand-made graph with a cycle (so the check is not vacuous)."""
  modules = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
  seen, cyc = set(), []

  def visit(m, path):
    for t in modules[m]:
      if t in path:
        cyc.append(path + [t])
      elif t not in seen:
        seen.add(t)
        visit(t, path + [t])

  visit("a", ["a"])
  assert cyc == [["a", "b", "c", "a"]]


@pytest.mark.parametrize(
  "package",
  ["graph", "costs", "program", "train", "projection", "planner", "models", "api", "advisor"],
)
def test_each_package_imports_alone_in_a_fresh_interpreter(package):
  """Importing one step first (nothing else loaded) works: no hidden order dependence."""
  code = f"import jaxhybrid.{package} as m; assert m.__doc__"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_readme_names_work_after_import_jaxhybrid():
  code = """
import jaxhybrid
jaxhybrid.mesh.simulate_cpu_devices(4)
import jax
assert len(jax.devices()) == 4, jax.devices()
from jaxhybrid import graph, costs, hardware, planner
assert callable(graph.trace) and callable(planner.place) and callable(planner.gantt)
assert costs.AnalyticCostModel and costs.ProfiledCostModel and hardware.get('dgx1-v100')
assert planner.Plan.load
from jaxhybrid.program import lockstep
from jaxhybrid.train import optim
assert callable(lockstep.plan_step_s) and callable(optim.clip_by_global_norm)
assert jaxhybrid.program.CHECK_VMA in (True, False) and jaxhybrid.program.DEFAULT_PACK_MAX_BYTES > 0
assert callable(jaxhybrid.parallelize) and callable(jaxhybrid.models.get)
assert callable(jaxhybrid.projection.project) and callable(jaxhybrid.train.fit)
try:
  jaxhybrid.no_such_name
except AttributeError:
  pass
else:
  raise SystemExit('no AttributeError')
"""
  env = subprocess_env()
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
