"""``python -m train.plot WORKDIR [WORKDIR ...] [--out PATH.png]``: learning curves.

Reads each workdir's ``metrics.jsonl`` and draws one 2x3 figure: training loss
and eval accuracy (eval bits per byte for byte-level language models), each
against the step, against the seconds of training
(``logs.elapsed_seconds``: summed over resumes, compiles included) and against
the simulated clock of the run's described cluster (``sim_seconds``, DESIGN
§6: the model's FLOPs at the described speeds plus the priced exchanges, not
this machine's time; runs logged before it existed leave that panel
empty). One line per run, labelled by its workdir's name. Written to ``WORKDIR0/curves.png`` unless
``--out`` says otherwise, e.g. to compare compressors:

  python -m train.plot /tmp/wd_default /tmp/wd_topk --out /tmp/curves.png
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from train import logs

DEFAULT_FILE = "curves.png"


def _load(workdir: Path) -> list[dict]:
  path = workdir / logs.METRICS_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f"{path} not found: is {workdir} the --workdir of a training run?"
    )
  return logs.read_metrics(path)


def _time_unit(seconds: float) -> tuple[float, str]:
  if seconds > 3 * 3600:
    return 3600.0, "hours"
  if seconds > 600:
    return 60.0, "minutes"
  return 1.0, "seconds"


def plot(workdirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
  """Draws the runs of ``workdirs`` into one PNG.

  Args:
    workdirs: training workdirs, each holding a ``metrics.jsonl``.
    out: the PNG to write; ``workdirs[0]/curves.png`` by default.

  Returns:
    The path written.

  Raises:
    ValueError: if ``workdirs`` is empty.
    FileNotFoundError: naming the first workdir without a ``metrics.jsonl``.
  """
  if not workdirs:
    raise ValueError("plot needs at least one workdir")
  dirs = [Path(w) for w in workdirs]
  runs = [(d.resolve().name, _load(d)) for d in dirs]  # Every file before drawing.
  elapsed = [logs.elapsed_seconds(rows) for _, rows in runs]
  scale, unit = _time_unit(max((max(e, default=0.0) for e in elapsed), default=0.0))
  # Byte-level language models are judged by bits per byte, not accuracy.
  bpb = any(r.get("eval_bits_per_byte") is not None for _, rows in runs for r in rows)
  metrics = ("loss", "eval_bits_per_byte" if bpb else "eval_accuracy")
  labels = ("training loss", "eval bits per byte" if bpb else "eval accuracy")

  # A bare Figure on the Agg canvas: no pyplot, so no global figure state and
  # no GUI backend is ever chosen.
  fig = Figure(figsize=(15, 7.5), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, 3)
  for (name, rows), seconds in zip(runs, elapsed, strict=True):
    # An eval row's step shares the training row's simulated time.
    sim = {
      r["step"]: r["sim_seconds"] for r in rows if r.get("sim_seconds") is not None
    }
    for row_axes, key in zip(axes, metrics, strict=True):
      picked = [
        (r, t) for r, t in zip(rows, seconds, strict=True) if r.get(key) is not None
      ]
      values = [r[key] for r, _ in picked]
      style = {"label": name, "marker": ".", "markersize": 4}  # A lone eval shows.
      row_axes[0].plot([r["step"] for r, _ in picked], values, **style)
      row_axes[1].plot([t / scale for _, t in picked], values, **style)
      simulated = [
        (sim[r["step"]], r[key]) for r, _ in picked if sim.get(r["step"]) is not None
      ]
      if simulated:
        row_axes[2].plot(*zip(*simulated, strict=True), **style)
  for row_axes, ylabel in zip(axes, labels, strict=True):
    row_axes[0].set_xlabel("step")
    row_axes[1].set_xlabel(f"wall time ({unit} of training)")
    row_axes[2].set_xlabel("simulated seconds on the described cluster")
    for ax in row_axes:
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
  axes[0, 0].legend()

  path = Path(out) if out is not None else dirs[0] / DEFAULT_FILE
  fig.savefig(path, dpi=100)
  return path


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m train.plot", description="Learning curves of training runs."
  )
  parser.add_argument("workdirs", nargs="+", metavar="WORKDIR")
  parser.add_argument(
    "--out", help=f"PNG to write (default: the first WORKDIR/{DEFAULT_FILE})"
  )
  args = parser.parse_args(argv)
  try:
    path = plot(args.workdirs, args.out)
  except FileNotFoundError as e:
    parser.error(str(e))  # Exit status 2 with the message, no traceback.
  print(path)


if __name__ == "__main__":
  main()
