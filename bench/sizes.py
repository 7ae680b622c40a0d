"""Compression time per call against tensor size: paper 000 Fig. 1b on this backend.

Paper 000 §3.2 (Fig. 1b) times each compressor on tensors of ``2^4 .. 2^20``
values on a GPU and finds that the time "does not double" over that range: a
fixed cost per call dominates, which is the case for LayerFusion. This suite
measures the same curve here, for every registered compressor with the
hyper-parameters of :data:`bench.fusion.SEARCH_COMPRESSORS`, with
:func:`gradcomp.fusion.profile` on one device: per size, ``jit(tx.update)`` of a
float32 buffer with ``axis_name=None`` (compress + decompress, the payload
materialised), the state donated and fed back, median of ``repeats``
steady-state calls after a warm-up. The profile also times the same number of
values fused from four leaves (``fused_seconds``, kept in the JSON) and traces
the bytes one worker sends per call (``wire_bytes``, from
``profile.traced_wire``). A plain copy (``x * -1`` into a
donated buffer, the same timer) is the memory-bandwidth and launch reference.

The **per-call overhead reading**, per compressor: the fixed cost ``c`` is the
time at the smallest size, the proportional cost ``b`` the slope between the
two largest sizes (seconds per value); they are equal at ``x* = c / b``
values. Tensors much smaller than ``x*`` pay mostly the fixed cost (the
paper's claim, which needs ``x*`` near or above 2^20); tensors above it pay
mostly for their values. The ratio ``t(2^20) / t(2^4)`` is the paper's own
reading ("not doubling" means < 2). The curve need not be affine in between
(on XLA:CPU it steps up several-fold between 2^6 and 2^10 values), so a second table reads it per model (ResNet-20,
ResNet-50, PTB LSTM), with ``t(d_i)`` of each of its ``N`` tensors
interpolated from the measured curve as ``Profile.comp_seconds`` does:

* the tensors below ``x*``;
* the *fixed share* ``N c / sum_i t(d_i)``, with ``c`` taken at the smallest
  size (it misses the step above);
* the *per-call share* ``sum_i max(t(d_i) - b d_i, 0) / sum_i t(d_i)``:
  everything layer-wise compression costs beyond the large-size rate per
  value, the step included (and also whatever makes a small tensor dearer
  per value than a large one that streams from memory);
* ``sum_i t(d_i) / t(sum_i d_i)``: layer-wise over one call on all values,
  the compression time fusion could save (concatenation not included; the
  JSON's ``fused_seconds`` times it on four leaves).

Per-call overhead dominates a model's layer-wise compression when these shares
are above 50 %.

The default grid is every second power of two, ``2^4, 2^6, .., 2^24``
(``gradcomp.fusion.profile``'s ``DEFAULT_SIZES``); ``--full`` times every power.
Run time is mostly compilation (two programs per compressor and size): 2.5 to
4.5 minutes for the default on the 2-core CPU with other jobs running (load
average 3 to 8), about 5 minutes with ``--full``; more under heavier load.

Run: ``python -m bench sizes [--full] [--only topk,dgc] [--repeats 7]``.
Writes ``sizes.json`` and ``sizes.png`` to ``--out`` and prints markdown tables.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gradcomp
from bench.compress import machine_info
from bench.fusion import SEARCH_COMPRESSORS
from bench.output import write_json
from bench.plots import line_plot
from gradcomp.fusion.profiling import backend_name, steady_state_seconds
from gradcomp.models import shapes
from gradcomp.sim import profile as profile_lib
from gradcomp.sim.profile import DEFAULT_SIZES

#: ``--full``: every power of two from 2^4 to 2^24.
FULL_SIZES = tuple(2**p for p in range(4, 25))
#: Models whose tensors are counted against each compressor's ``x*``.
OVERHEAD_MODELS = ("resnet20", "resnet50", "lstm_ptb", "gpt2_small")
#: The paper's range: time at 2^20 over time at 2^4 (§3.2: "not doubling").
PAPER_LARGE = 2**20


def select(only: str | Sequence[str] | None) -> list[str]:
  """Compressor names to time: all of ``SEARCH_COMPRESSORS``, or those in ``only``."""
  if only is None:
    return list(SEARCH_COMPRESSORS)
  names = only.split(",") if isinstance(only, str) else list(only)
  names = [n.strip() for n in names if n.strip()]
  unknown = [n for n in names if n not in SEARCH_COMPRESSORS]
  if unknown or not names:
    raise ValueError(
      f"unknown compressors {unknown}; valid: {', '.join(SEARCH_COMPRESSORS)}"
    )
  return names


def grid(text: str | None = None, *, full: bool = False) -> tuple[int, ...]:
  """The sizes to time: ``text`` ("16,65536"), :data:`FULL_SIZES`, or the default."""
  if text is None:
    return FULL_SIZES if full else DEFAULT_SIZES
  if full:
    raise ValueError("give either --sizes or --full, not both")
  try:
    sizes = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise ValueError(f"sizes must be comma-separated integers, got {text!r}") from None
  if not sizes or min(sizes) < 1 or list(sizes) != sorted(set(sizes)):
    raise ValueError(f"sizes must be increasing integers >= 1, got {text!r}")
  return sizes


def copy_seconds(sizes: Sequence[int], repeats: int) -> list[float]:
  """Steady-state seconds of ``x * -1`` into a donated float32 buffer, per size."""
  scale = jax.jit(lambda x: (x * jnp.float32(-1.0),), donate_argnums=0)
  return [
    steady_state_seconds(scale, jnp.ones((size,), jnp.float32), repeats=repeats)
    for size in sizes
  ]


def overhead(sizes: Sequence[int], seconds: Sequence[float]) -> dict[str, Any]:
  """Fixed cost, proportional cost and where they are equal, from one curve.

  Returns:
    ``fixed_s`` (time at the smallest size), ``per_value_s`` (slope between
    the two largest sizes; ``None`` with one size), ``crossover`` (``x* =
    fixed / per_value`` values; ``None`` unless the slope is > 0),
    ``growth_to_2^20`` (``t(2^20) / t(smallest)`` when 2^20 was timed), and
    ``models``: per model of :data:`OVERHEAD_MODELS`, its ``tensors``, how
    many are ``below`` ``x*``, ``layerwise_s`` (the sum over its tensors of
    the curve as ``Profile.comp_seconds`` interpolates it), ``single_s`` (the
    curve at all its values in one buffer), ``fixed_share`` (``tensors x
    fixed / layerwise_s``) and ``per_call_share`` (``sum_i max(t(d_i) -
    per_value d_i, 0) / layerwise_s``: what layer-wise compression costs
    beyond the large-size rate per value; ``None`` without a slope).
  """
  fixed = float(seconds[0])
  slope = None
  if len(sizes) > 1:
    slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
  crossover = fixed / slope if slope is not None and slope > 0 else None
  growth = None
  if PAPER_LARGE in sizes and fixed > 0:
    growth = seconds[list(sizes).index(PAPER_LARGE)] / fixed
  curve = profile_lib._curve(sizes, seconds)  # what Profile.comp_seconds uses
  models = {}
  for model in OVERHEAD_MODELS:
    tensor_sizes = [math.prod(s) for _, s in shapes.MODELS[model]()]
    d = np.asarray(tensor_sizes, np.float64)
    per_tensor = curve(d)
    layerwise = float(np.sum(per_tensor))
    per_call = None
    if slope is not None and layerwise > 0:
      per_call = float(np.sum(np.maximum(per_tensor - slope * d, 0.0))) / layerwise
    models[model] = {
      "tensors": len(tensor_sizes),
      "below": 0 if crossover is None else sum(x < crossover for x in tensor_sizes),
      "layerwise_s": layerwise,
      "single_s": float(curve(float(d.sum()))),
      "fixed_share": len(tensor_sizes) * fixed / layerwise if layerwise > 0 else None,
      "per_call_share": per_call,
    }
  return {
    "fixed_s": fixed,
    "per_value_s": slope,
    "crossover": crossover,
    "growth_to_2^20": growth,
    "models": models,
  }


def run(
  compressors: str | Sequence[str] | None = None,
  sizes: Sequence[int] = DEFAULT_SIZES,
  repeats: int = 7,
  out_dir: str = "bench_out/",
) -> dict[str, Any]:
  """Times every compressor at every size; writes JSON and PNG; returns the result."""
  names = select(compressors)
  sizes = tuple(int(s) for s in sizes)
  rows = []
  for name in names:
    hyperparameters = SEARCH_COMPRESSORS[name]
    t0 = time.perf_counter()
    p = gradcomp.fusion.profile(name, sizes, repeats=repeats, **hyperparameters)
    elapsed = time.perf_counter() - t0
    per_size_bytes = [
      int(sum(v[i] for v in p.wire_bytes.values())) for i in range(len(sizes))
    ]
    rows.append(
      {
        "compressor": name,
        "label": p.compressor,
        "hyperparameters": hyperparameters,
        "seconds": list(p.seconds),
        "fused_seconds": list(p.fused_seconds),
        "wire_bytes": per_size_bytes,
        "overhead": overhead(sizes, p.seconds),
        "profile_s": elapsed,
      }
    )
    print(
      f"{name}: {p.seconds[0] * 1e6:.1f} us at {sizes[0]}, "
      f"{p.seconds[-1] * 1e3:.2f} ms at {sizes[-1]} ({elapsed:.0f} s)",
      flush=True,
    )
  copy = copy_seconds(sizes, repeats)
  result = {
    "backend": backend_name(1),
    "machine": machine_info(),
    "sizes": list(sizes),
    "repeats": repeats,
    "rows": rows,
    "copy": {"seconds": copy, "overhead": overhead(sizes, copy)},
    "summary": summarize(rows),
  }
  write_json(out_dir, "sizes.json", result)
  plot(result, os.path.join(out_dir, "sizes.png"))
  print(format_table(result))
  return result


def summarize(rows: list[dict]) -> dict[str, Any]:
  """The verdict over compressors: ``x*``, fixed shares, growth to 2^20."""
  known = [r["overhead"]["crossover"] for r in rows]
  known = [c for c in known if c is not None]
  growths = [r["overhead"]["growth_to_2^20"] for r in rows]
  growths = [g for g in growths if g is not None]

  def median(field):
    out = {}
    for model in OVERHEAD_MODELS:
      values = [r["overhead"]["models"][model][field] for r in rows]
      values = [v for v in values if v is not None]
      out[model] = statistics.median(values) if values else None
    return out

  return {
    "median_crossover": statistics.median(known) if known else None,
    "min_crossover": min(known) if known else None,
    "max_crossover": max(known) if known else None,
    "median_fixed_share": median("fixed_share"),
    "median_per_call_share": median("per_call_share"),
    "compressors_under_2x_to_2^20": sum(g < 2 for g in growths),
    "compressors_with_growth": len(growths),
  }


def plot(result: dict[str, Any], path: str) -> str:
  sizes = result["sizes"]
  series = {
    r["compressor"]: (sizes, [t * 1e3 for t in r["seconds"]]) for r in result["rows"]
  }
  return line_plot(
    path,
    series,
    xlabel="tensor size (float32 values)",
    ylabel="compress + decompress per call (ms)",
    title=(
      f"Per-call compression time vs tensor size (paper 000 Fig. 1b) on "
      f"{result['backend']}, jax {result['machine']['jax_version']}, "
      f"median of {result['repeats']}"
    ),
    logx=True,
    logy=True,
    reference={
      "copy x * -1 (donated)": (sizes, [t * 1e3 for t in result["copy"]["seconds"]])
    },
  )


def _pow2(x: float | None) -> str:
  if x is None:
    return "—"
  if x < 1:
    return f"{x:.2g}"
  exponent = math.log2(x)
  return f"2^{exponent:.0f}" if exponent == round(exponent) else f"2^{exponent:.1f}"


def _time(seconds: float) -> str:
  if seconds < 1e-3:
    return f"{seconds * 1e6:.3g} us"
  if seconds < 1:
    return f"{seconds * 1e3:.3g} ms"
  return f"{seconds:.3g} s"


def _share(x: float | None) -> str:
  return "—" if x is None else f"{x:.0%}"


def format_table(result: dict[str, Any]) -> str:
  sizes = result["sizes"]
  small, large = _pow2(sizes[0]), _pow2(sizes[-1])
  entries = [
    (r["compressor"], r["seconds"], r.get("fused_seconds"), r["overhead"])
    for r in result["rows"]
  ]
  entries.append(
    ("copy (x * -1)", result["copy"]["seconds"], None, result["copy"]["overhead"])
  )
  lines = [
    f"Compress + decompress per call on {result['backend']} "
    f"({result['machine']['cpu_count']} CPU cores, jax "
    f"{result['machine']['jax_version']}), median of {result['repeats']} "
    "steady-state calls; gradcomp.profile.",
    "",
    "Per-call overhead: fixed cost c = t(smallest size); proportional cost b = "
    "slope between the two largest sizes; x* = c / b is where they are equal.",
    "",
    f"| compressor | t({small}) | t({large}) | t(2^20) / t({small}) | ns / value "
    f"| x* | fused 4 leaves / one at {large} |",
    "| --- |" + " ---: |" * 6,
  ]
  for name, seconds, fused, o in entries:
    growth = o["growth_to_2^20"]
    slope = o["per_value_s"]
    lines.append(
      f"| {name} | {_time(seconds[0])} | {_time(seconds[-1])} "
      f"| {'—' if growth is None else f'{growth:.1f}'} "
      f"| {'—' if slope is None else f'{slope * 1e9:.3g}'} "
      f"| {_pow2(o['crossover'])} "
      f"| {'—' if not fused else f'{fused[-1] / seconds[-1]:.2f}'} |"
    )
  lines += [
    "",
    "Per model, layer-wise (one call per tensor, t(d_i) interpolated from the "
    "curve): tensors below x*; fixed share N c / sum t(d_i); per-call share "
    "sum max(t(d_i) - b d_i, 0) / sum t(d_i) (all but the large-size rate per "
    "value); and sum t(d_i) over one call on all values, t(sum d_i).",
    "",
    "| compressor | model | tensors < x* | fixed share | per-call share "
    "| layer-wise / one buffer |",
    "| --- | --- |" + " ---: |" * 4,
  ]
  for name, _, _, o in entries:
    for model, m in o["models"].items():
      ratio = m["layerwise_s"] / m["single_s"] if m["single_s"] > 0 else None
      lines.append(
        f"| {name} | {model} | {m['below']} / {m['tensors']} "
        f"| {_share(m['fixed_share'])} | {_share(m['per_call_share'])} "
        f"| {'—' if ratio is None else f'{ratio:.2f}'} |"
      )
  s = result["summary"]
  lines.append("")
  if s["median_crossover"] is not None:
    lines.append(
      f"x* over {len(result['rows'])} compressors: median "
      f"{_pow2(s['median_crossover'])} values (from {_pow2(s['min_crossover'])} "
      f"to {_pow2(s['max_crossover'])})."
    )
  for field, what in (
    ("median_fixed_share", "fixed share"),
    ("median_per_call_share", "per-call share"),
  ):
    if any(v is not None for v in s[field].values()):
      lines.append(
        f"Median {what} of layer-wise compression: "
        + ", ".join(f"{m} {_share(v)}" for m, v in s[field].items())
        + "."
      )
  if s["compressors_with_growth"]:
    lines.append(
      "From 2^4 to 2^20 values the time grows less than 2x (paper 000 §3.2's GPU "
      f"reading) for {s['compressors_under_2x_to_2^20']} of "
      f"{s['compressors_with_growth']} compressors."
    )
  lines += [
    "",
    "Time per call at each size:",
    "",
    "| compressor | " + " | ".join(_pow2(x) for x in sizes) + " |",
    "| --- |" + " ---: |" * len(sizes),
  ]
  for name, seconds, _, _ in entries:
    lines.append(f"| {name} | " + " | ".join(_time(t) for t in seconds) + " |")
  return "\n".join(lines)
