"""What a run shows and leaves behind: progress lines, ``metrics.jsonl`` and
TensorBoard event files.

``metrics.jsonl`` holds one JSON object per logged step (``step``,
``wall_time``, ``loss``, ``samples_per_sec``, ``wire_bytes_per_step``, ...),
per evaluation (``step``, ``wall_time``, ``eval_loss``, ``eval_accuracy``) and
per start or resume of the program (``step``, ``wall_time``, ``started``: the
origin of ``elapsed_seconds``); non-finite values are written as ``null`` so
every line is strict JSON. The same scalars go to ``events.out.tfevents.*``
(``tensorboard --logdir WORKDIR``), written with ``tensorboardX``: flax's
``metrics.tensorboard`` needs TensorFlow.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
  if hasattr(value, "item"):  # NumPy and JAX scalars.
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricWriter:
  """Logs rows to ``workdir/metrics.jsonl`` and TensorBoard; a no-op when not
  ``enabled``.

  Args:
    workdir: the run's directory.
    resume_step: rows after this step are dropped from an existing file: they
      were written by a run killed after its last checkpoint, and the resumed
      run writes them again. TensorBoard drops its own copies of them too
      (``purge_step``).
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
    from tensorboardX import SummaryWriter  # Only process 0 pays for the import.

    self._tb = SummaryWriter(
      str(workdir),
      purge_step=resume_step + 1 if resume_step else None,
      # Event files are named by the second they open in, and opened with
      # "wb": the suffix keeps a resume within that second from erasing them.
      filename_suffix=f".from{resume_step}",
    )
    self._file = open(self.path, "a")
    self._write_row({"step": resume_step, "wall_time": _now(), "started": True})

  def write(self, step: int, **scalars: Any) -> None:
    if not self.enabled:
      return
    row = {"step": step, "wall_time": _now()}
    row.update((k, _clean(v)) for k, v in scalars.items())
    self._write_row(row)
    for key, value in row.items():
      if key not in ("step", "wall_time") and isinstance(value, (int, float)):
        self._tb.add_scalar(key, float(value), step, walltime=row["wall_time"])
    self._tb.flush()  # As the jsonl: a killed run keeps what it logged.

  def histogram(self, step: int, name: str, counts) -> None:
    """A histogram of the integers ``0 .. len(counts) - 1`` (``counts[i]`` of value ``i``).

    TensorBoard gets it as a histogram; ``metrics.jsonl`` as a row with the
    counts (trailing zeros dropped) under ``name``.
    """
    if not self.enabled:
      return
    counts = [int(c) for c in counts]
    while counts and counts[-1] == 0:
      counts.pop()
    self._write_row({"step": step, "wall_time": _now(), name: counts})
    total = sum(counts)
    if total:
      values = np.arange(len(counts))
      weights = np.asarray(counts)
      self._tb.add_histogram_raw(
        name,
        min=float(values[weights > 0].min()),
        max=float(len(counts) - 1),
        num=total,
        sum=float(values @ weights),
        sum_squares=float(values**2 @ weights),
        bucket_limits=[v + 0.5 for v in values.tolist()],
        bucket_counts=counts,
        global_step=step,
      )
      self._tb.flush()

  def _write_row(self, row: dict[str, Any]) -> None:
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      self._tb.close()


def _now() -> float:
  return round(time.time(), 3)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
  """The rows of a ``metrics.jsonl`` file (a torn last line is skipped)."""
  rows = []
  for line in Path(path).read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # A run killed mid-write.
  return rows


def elapsed_seconds(rows: list[dict[str, Any]]) -> list[float]:
  """Seconds of training up to each row, summed over the resumes of a run.

  Each ``started`` row restarts the clock at the time already accumulated by
  the row before it, so the gap between a kill and its resume is not counted
  (nor the steps redone after the last checkpoint twice). Files without
  ``started`` rows count from their first row.
  """
  elapsed, offset, origin, last = [], 0.0, None, 0.0
  for row in rows:
    if row.get("started") or origin is None:
      offset, origin = last, row["wall_time"]
    last = offset + row["wall_time"] - origin
    elapsed.append(last)
  return elapsed


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


class Profiler:
  """Traces ``steps`` steps after the first (which compiles) into ``workdir/profile``.

  On process 0 only (``enabled``): processes sharing a host would write the
  same file names. A run that stops mid-trace turns the profiler off
  (:meth:`close`).
  """

  def __init__(
    self, workdir: Path, start: int, num_steps: int, steps: int, enabled, progress
  ):
    self.path = Path(workdir) / "profile"
    self.steps = range(start + 2, min(start + 2 + steps, num_steps + 1))
    self.steps = self.steps if enabled else range(0)
    self.progress = progress
    self.tracing = False

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.path)
      self.tracing = True

  def after(self, step: int, metrics) -> None:
    if self.steps and step == self.steps[-1]:
      jax.block_until_ready(metrics)
      jax.profiler.stop_trace()
      self.tracing = False
      self.progress.message(f"profiled steps {self.steps[0]}-{step} into {self.path}")

  def close(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
