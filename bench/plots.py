"""Figures for the benchmark suites: a line plot and a grouped bar chart, as PNG.

Each helper draws on its own :class:`matplotlib.figure.Figure` (no ``pyplot``,
no global state, no GUI backend: PNGs are rendered by Agg) and writes one file.
Series are plain mappings ``label -> values`` so any suite can reuse them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

# A dozen lines stay distinguishable: tab20's ten dark colours, then its ten
# light ones, each with its own marker.
_MARKERS = "osD^v<>pPX*h"


def _style(i: int) -> dict:
  colour = colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)
  return {"color": colour, "marker": _MARKERS[i % len(_MARKERS)], "markersize": 4}


def _save(fig: Figure, path: str | os.PathLike) -> str:
  directory = os.path.dirname(os.fspath(path))
  if directory:
    os.makedirs(directory, exist_ok=True)
  fig.savefig(path, dpi=120)
  return os.fspath(path)


def line_plot(
  path: str | os.PathLike,
  series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
  *,
  xlabel: str,
  ylabel: str,
  title: str = "",
  logx: bool = False,
  logy: bool = False,
  reference: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
) -> str:
  """One line per series on one axes; writes a PNG and returns its path.

  Args:
    path: the PNG file to write (its directory is created).
    series: ``label -> (x, y)``; a ``None`` or non-finite y is not drawn.
    xlabel: the x axis label.
    ylabel: the y axis label.
    title: the figure title.
    logx: log-scale x axis (base 2).
    logy: log-scale y axis (base 10).
    reference: ``label -> (x, y)`` drawn as black dashed lines (e.g. a
      bandwidth floor or an ideal scaling line).
  """
  fig = Figure(figsize=(8, 5.5), layout="constrained")
  ax = fig.add_subplot()
  for i, (label, (x, y)) in enumerate(series.items()):
    y = np.asarray([np.nan if v is None else v for v in y], np.float64)
    ax.plot(np.asarray(x, np.float64), y, label=label, linewidth=1.2, **_style(i))
  for label, (x, y) in (reference or {}).items():
    y = np.asarray([np.nan if v is None else v for v in y], np.float64)
    ax.plot(np.asarray(x, np.float64), y, "k--", label=label, linewidth=1.5)
  if logx:
    ax.set_xscale("log", base=2)
  if logy:
    ax.set_yscale("log")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="major", alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  return _save(fig, path)


def grouped_bar_plot(
  path: str | os.PathLike,
  panels: Mapping[str, tuple[Sequence[str], Mapping[str, Sequence[float]]]],
  *,
  ylabel: str,
  title: str = "",
  logy: bool = False,
) -> str:
  """Grouped bars, one panel per entry, stacked vertically; writes a PNG.

  Args:
    path: the PNG file to write (its directory is created).
    panels: ``panel title -> (categories, {series label: one value per
      category})``; each category gets one bar per series, side by side.
    ylabel: the y axis label of every panel.
    title: the figure title.
    logy: log-scale y axes.
  """
  fig = Figure(figsize=(10, 3.2 * len(panels) + 0.6), layout="constrained")
  axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
  for ax, (panel, (categories, series)) in zip(axes, panels.items(), strict=True):
    x = np.arange(len(categories))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
      offset = (i - (len(series) - 1) / 2) * width
      ax.bar(x + offset, values, width, label=label, color=f"C{i}")
    ax.set_xticks(x, categories, rotation=30, ha="right", fontsize=8)
    if logy:
      ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(panel, fontsize=10)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    ax.legend(fontsize=8)
  if title:
    fig.suptitle(title, fontsize=11)
  return _save(fig, path)
