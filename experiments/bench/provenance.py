"""Which program a benchmark row measured, and results files that keep other runs' rows."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from collections.abc import Callable, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))


def program_commit() -> str | None:
  """The commit the program is measured at ('+changes' when jaxhybrid/, planner/ or models/
  differ from it); None outside a git checkout."""
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=_HERE, check=True).stdout.strip()
    # Top-level pathspecs (':/'): the script's folder is not the repository's root.
    dirty = subprocess.run(["git", "status", "--porcelain", "--", ":/jaxhybrid", ":/planner",
                            ":/models"], capture_output=True, text=True, check=True,
                           cwd=_HERE).stdout.strip()
    return out + ("+changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return None


class RowsFile:
  """A JSON list of result rows written after every row. With `update`, the rows the file held
  before this run that `replaced` does not select are kept in front of this run's rows; every
  row of this run records `program_commit()` as 'program'."""

  def __init__(self, path: str, update: bool, replaced: Callable[[dict], bool]):
    self.path = pathlib.Path(path) if path else None
    self.kept: list[dict] = []
    if self.path and update and self.path.exists():
      self.kept = [r for r in json.loads(self.path.read_text()) if not replaced(r)]
    self.program = program_commit() if self.path else None

  def write(self, rows: Sequence[dict]) -> None:
    if self.path is None:
      return
    for r in rows:
      r.setdefault("program", self.program)
    self.path.write_text(json.dumps(self.kept + list(rows), indent=1))
