"""The project speaks of itself only: no tracked text names numbered work periods or issues
(history lives in git). Results data is included: a results file's notes are read as docs."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The banned word, spelled in two parts so that this file does not contain it.
_WORD = "sess" + "ion"
# The word (whole, any case, singular or plural), and "issue <number>".
HISTORY = re.compile(rf"\b{_WORD}s?\b|\bissue\s+#?\d+", re.IGNORECASE)
# Results files named after a numbered work period ("_s12", "_s20_auto").
NUMBERED_NAME = re.compile(r"_s\d+(_|\.|$)")
# Such a file named in text (a results name ending in "_s" and a number), tracked or not.
NUMBERED_FILE_IN_TEXT = re.compile(r"\w_s\d+(?:_\w+)?\.(?:json|txt|csv|png)\b")


def _tracked() -> list[str]:
  out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
  return out.stdout.split()


def test_no_tracked_text_names_work_history_or_issue_numbers():
  hits = []
  for rel in _tracked():
    try:
      with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    except (UnicodeDecodeError, FileNotFoundError):
      continue  # binary (PNG) or deleted in the working tree
    for n, line in enumerate(text.splitlines(), 1):
      if HISTORY.search(line) or NUMBERED_FILE_IN_TEXT.search(line):
        hits.append(f"{rel}:{n}: {line.strip()[:100]}")
  assert not hits, "\n".join(hits[:20])


def test_the_patterns_catch_history_and_spare_technical_names():
  assert HISTORY.search(f"as measured in {_WORD.capitalize()} 17") and HISTORY.search(f"issue {7}")
  assert not HISTORY.search("an issue with the bound") and not HISTORY.search(f"{_WORD}less")
  assert NUMBERED_NAME.search(f"bench_mp_s{18}.json") and NUMBERED_NAME.search("run_s20_auto")
  assert not NUMBERED_NAME.search("step_s_1dev.json") and not NUMBERED_NAME.search("s_mp.json")
  assert NUMBERED_FILE_IN_TEXT.search(f"see results/slot_rows_ab_s{18}.json")
  assert not NUMBERED_FILE_IN_TEXT.search("a 1F1B step of 0.5 s.")


def test_no_results_file_is_named_after_a_numbered_work_period():
  names = [rel for rel in _tracked() if NUMBERED_NAME.search(os.path.basename(rel))]
  assert not names, names
