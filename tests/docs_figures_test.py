"""The figure tables of README.md and docs/ equal what experiments/bench/docs_figures.py renders from
the results files, so a figure cannot drift from the file it names."""

from __future__ import annotations

import os
import re

from conftest import experiment_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_figure_table_matches_its_results_file():
  figures = experiment_module("docs_figures")
  for rel in figures.DOCS:
    with open(os.path.join(ROOT, rel)) as f:
      text = f.read()
    assert "<!-- figures:" in text, f"{rel} has no generated table"
    assert figures.render(text) == text, (
      f"{rel}: a table differs from experiments/results; run python experiments/bench/docs_figures.py")


def test_a_changed_figure_is_caught():
  figures = experiment_module("docs_figures")
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  rendered = figures.render(text)
  start = rendered.index("<!-- figures:headline -->")
  tampered = rendered[:start] + rendered[start:].replace("x |", "1x |", 1)
  assert tampered != rendered and figures.render(tampered) == rendered


def test_tagged_prose_figures_match_their_results_files():
  figures = experiment_module("docs_figures")
  tagged = 0
  for rel in figures.DOCS:
    with open(os.path.join(ROOT, rel)) as f:
      text = f.read()
    tagged += len(figures.INLINE.findall(text))
    assert not figures.inline_mismatches(text), (rel, figures.inline_mismatches(text))
  assert tagged, "no prose figure carries a <!-- value: FILE PATH --> tag"


def test_a_changed_prose_figure_is_caught():
  import json

  figures = experiment_module("docs_figures")
  tag = ("<!-- value: bench_planner.json "
         "model=inception_v3&devices=2&microbatches=1.predicted_speedup -->")
  with open(os.path.join(figures.RESULTS, "bench_planner.json")) as f:
    value = next(c["predicted_speedup"] for c in json.load(f)
                 if (c["model"], c["devices"], c["microbatches"]) == ("inception_v3", 2, 1))
  right, wrong = f"{value:.2f}", f"{value + 0.01:.2f}"
  assert not figures.inline_mismatches(f"predicted {right}x{tag}")
  assert figures.inline_mismatches(f"predicted {wrong}x{tag}") == [
    f"{wrong}x but bench_planner.json {tag.split()[3]} is {right}"]
  assert figures.inline_mismatches(f"gap {value:.1f} %{tag}")  # a % figure is the value x 100
  assert not figures.inline_mismatches(f"gap {100 * value:.1f} %{tag}")


def test_every_results_path_the_docs_name_exists():
  named = set()
  for rel in ("README.md", "docs/design.md", "docs/benchmarks.md", "docs/paper.md"):
    with open(os.path.join(ROOT, rel)) as f:
      named |= {(rel, m) for m in re.findall(r"experiments/results/[\w./-]*\w", f.read())}
  assert len(named) > 5
  missing = [(rel, p) for rel, p in sorted(named) if not os.path.exists(os.path.join(ROOT, p))]
  assert not missing, missing
