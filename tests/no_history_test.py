"""The project speaks of itself only: no tracked text names work sessions or numbered issues
(history lives in git). Results data is included: a results file's notes are read as docs."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The words, whole and case-insensitive; "issue <number>" only with a number.
HISTORY = re.compile(r"\bsessions?\b|\bissue\s+#?\d+", re.IGNORECASE)
# Results files named after a work session ("_s12", "_s20_auto").
SESSION_NAME = re.compile(r"_s\d+(_|\.|$)")


def _tracked() -> list[str]:
  out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
  return out.stdout.split()


def test_no_tracked_text_mentions_work_sessions_or_issue_numbers():
  this = os.path.relpath(__file__, ROOT)
  hits = []
  for rel in _tracked():
    if rel == this:
      continue
    try:
      with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    except (UnicodeDecodeError, FileNotFoundError):
      continue  # binary (PNG) or deleted in the working tree
    for n, line in enumerate(text.splitlines(), 1):
      if HISTORY.search(line):
        hits.append(f"{rel}:{n}: {line.strip()[:100]}")
  assert not hits, "\n".join(hits[:20])


def test_no_results_file_is_named_after_a_work_session():
  names = [rel for rel in _tracked() if SESSION_NAME.search(os.path.basename(rel))]
  assert not names, names
