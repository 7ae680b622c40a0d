"""``islands.jsonl``: one JSON line per event of an islands run (DESIGN §12).

Events: ``quorum`` (a round closed: who made it, what was applied, the
agreed hash), ``join`` (an island came in: from a live peer, by replaying
the rounds it missed, or from the outer checkpoint), ``leave`` (an island
died), ``reject`` (a payload not applied, with the reason), ``mismatch``
(islands' hashes differ: the run stops), ``checkpoint`` (the outer state was
saved), and ``fault`` (an injected failure fired), ``resume``, ``end``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

FILE = "islands.jsonl"
EVENTS = (
  "quorum",
  "join",
  "leave",
  "reject",
  "mismatch",
  "checkpoint",
  "fault",
  "resume",
  "end",
)


class EventLog:
  """Appends events to ``workdir/islands.jsonl`` (flushed line by line)."""

  def __init__(self, workdir: str | Path):
    self.path = Path(workdir) / FILE
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._file = open(self.path, "a")

  def write(self, round_: int, event: str, island: int | None = None, **fields: Any):
    if event not in EVENTS:
      raise ValueError(f"unknown event {event!r}; valid: {', '.join(EVENTS)}")
    row = {"round": round_, "event": event, "island": island, "time": time.time()}
    row.update(fields)
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def read(workdir: str | Path) -> list[dict[str, Any]]:
  """Every event of ``workdir/islands.jsonl``, in order."""
  path = Path(workdir) / FILE
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]
