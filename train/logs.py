"""What a run shows and leaves behind: progress lines and ``metrics.jsonl``.

``metrics.jsonl`` holds one JSON object per logged step (``step``,
``wall_time``, ``loss``, ``samples_per_sec``, ``wire_bytes_per_step``, ...) and
per evaluation (``step``, ``wall_time``, ``eval_loss``, ``eval_accuracy``); non-finite values are written as
``null`` so every line is strict JSON. TensorBoard event files are not
written: ``flax.metrics.tensorboard`` needs TensorFlow and ``tensorboardX`` is
not a dependency.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
  if hasattr(value, "item"):  # NumPy and JAX scalars.
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricWriter:
  """Appends rows to ``workdir/metrics.jsonl``; a no-op when not ``enabled``.

  Args:
    workdir: the run's directory.
    resume_step: rows after this step are dropped from an existing file: they
      were written by a run killed after its last checkpoint, and the resumed
      run writes them again.
    enabled: write (only process 0 of a multi-host run does).
  """

  def __init__(self, workdir: str | Path, resume_step: int = 0, enabled: bool = True):
    self.path = Path(workdir) / METRICS_FILE
    self.enabled = enabled
    if not enabled:
      return
    if self.path.exists():
      kept = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
      self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
    self._file = open(self.path, "a")

  def write(self, step: int, **scalars: Any) -> None:
    if not self.enabled:
      return
    row = {"step": step, "wall_time": round(time.time(), 3)}
    row.update((k, _clean(v)) for k, v in scalars.items())
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
  """The rows of a ``metrics.jsonl`` file (a torn last line is skipped)."""
  rows = []
  for line in Path(path).read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # A run killed mid-write.
  return rows


class Progress:
  """Prints ``step, loss, throughput, ETA`` lines to stderr.

  Args:
    total_steps: the step the run ends at.
    enabled: print (only process 0 does).
  """

  def __init__(self, total_steps: int, enabled: bool = True):
    self.total = total_steps
    self.enabled = enabled

  def update(
    self, step: int, loss: float, samples_per_sec: float, steps_per_sec: float, **extra
  ) -> None:
    """One line; the ETA assumes the current ``steps_per_sec`` holds."""
    if not self.enabled:
      return
    eta = (self.total - step) / steps_per_sec if steps_per_sec > 0 else math.nan
    eta_text = (
      str(datetime.timedelta(seconds=round(eta))) if math.isfinite(eta) else "?"
    )
    width = len(str(self.total))
    parts = [
      f"step {step:>{width}}/{self.total} ({100 * step / self.total:3.0f}%)",
      f"loss {loss:.4f}",
      f"{samples_per_sec:,.0f} samples/s" if math.isfinite(samples_per_sec) else "",
      f"ETA {eta_text}",
    ]
    parts += [f"{k} {v}" for k, v in extra.items()]
    print(" | ".join(p for p in parts if p), file=sys.stderr, flush=True)

  def message(self, text: str) -> None:
    if self.enabled:
      print(text, file=sys.stderr, flush=True)
