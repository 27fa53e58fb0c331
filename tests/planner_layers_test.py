"""The planner's layers import only the layers below them (planner/__init__.py lists the order)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PLANNER = pathlib.Path(__file__).resolve().parents[1] / "planner"
# Each layer and the layers it may import (besides itself), as planner/__init__.py states.
ALLOWED = {
  "core": set(),
  "pricing": {"core"},
  "lower_bounds": {"core", "pricing"},
  "search": {"core", "pricing", "lower_bounds"},
  "solvers": {"core", "pricing", "lower_bounds", "search"},
  "output": {"core"},
}


def _planner_imports(path: pathlib.Path) -> set[str]:
  """The planner layers (or top-level planner modules) a file imports, at any depth."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for n in names:
      parts = n.split(".")
      if parts[:2] == ["jaxhybrid", "planner"] and len(parts) > 2:
        out.add(parts[2])
  return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
  files = sorted((PLANNER / layer).glob("*.py"))
  assert files, f"planner/{layer}/ is empty"
  for f in files:
    bad = _planner_imports(f) - ALLOWED[layer] - {layer}
    assert not bad, f"planner/{layer}/{f.name} imports {sorted(bad)}"


def test_every_module_lives_in_a_layer_and_flat_names_still_resolve():
  import importlib

  from jaxhybrid import planner

  top = {p.stem for p in PLANNER.glob("*.py")} - {"__init__"}
  assert top == {"place", "place_lockstep", "place_shards"}, top
  for flat, layer in planner._LAYER_OF.items():  # noqa: SLF001
    assert (PLANNER / layer / f"{flat}.py").exists(), (flat, layer)
    if flat.endswith("_worker"):
      # Solver child processes run as scripts: importing OR-Tools beside python-mip's CBC in one
      # process fails (clashing CBC symbols), which is why they are child processes.
      continue
    assert importlib.import_module(f"jaxhybrid.planner.{flat}") is importlib.import_module(
      f"jaxhybrid.planner.{layer}.{flat}")
