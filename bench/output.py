"""Where a benchmark suite's results go: one JSON file per suite in ``--out``."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(out_dir: str, name: str, result: Any) -> str:
  """Writes ``result`` to ``out_dir/name`` (creating ``out_dir``); returns the path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, name)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  return path


def publish(
  out_dir: str,
  suite: str,
  result: Any,
  table: str,
  plot: Callable[[Any, Path], Path],
  docs_png: str | Path | None = None,
) -> Path:
  """Prints ``table`` and writes ``suite.{json,md,png}`` to ``out_dir``.

  The figure is drawn by ``plot(result, path)`` and copied to ``docs_png``
  if given. Returns the JSON's path.
  """
  print(table)
  path = write_json(out_dir, f"{suite}.json", result)
  Path(out_dir, f"{suite}.md").write_text(table + "\n")
  png = plot(result, Path(out_dir) / f"{suite}.png")
  if docs_png is not None:
    Path(docs_png).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(png, docs_png)
  print(f"\nwrote {path}, {suite}.md, {png.name} ({result['wall_s']:.0f} s)")
  return Path(path)
