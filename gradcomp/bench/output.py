"""Where a benchmark suite's results go: one JSON file per suite in ``--out``."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(out_dir: str, name: str, result: Any) -> str:
  """Writes ``result`` to ``out_dir/name`` (creating ``out_dir``); returns the path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, name)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  return path
