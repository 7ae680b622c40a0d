"""Each codec's fused time on a model's gradient against the memory floor.

The floor is one read and one write of the gradient: ``x * -1`` on the fused
gradient (one float32 buffer of ``d`` values), jitted with the gradient donated,
so the output is written over the input in place. No program that looks at every
value and writes a dense output can take less: it must stream ``4d`` bytes in
and ``4d`` bytes out (100 MB each for ResNet-50, far over the 32 MB L3 here).
``x * 1`` would not do: XLA folds it to the identity, which moves nothing
(donated, it is a no-op). A plain copy into a fresh buffer would measure first
touch page faults (``PERFORMANCE_NOTES.md``), not bandwidth.

Each codec runs as ``bench compress``'s fused layout (:func:`compress.
layout_contender`): one worker (``axis_name=None``: compress + decompress, no
collective), the whole gradient one pre-flattened 1-D buffer (a tree of one
leaf: LayerFusion's ``plan="single"`` in its per-buffer form, so a scale, a
norm or a selection budget is one for the buffer), gradient and state donated,
the state fed back. Each row interleaves the floor, the codec and its naive-JAX
peers (``peers.py``; PyTorch's too where it is installed, ``torch_peers.py``)
call by call (:func:`timing.interleaved`), so the row's multiple of the floor
and its ratio to the peers compare programs timed in the same rounds of the
same process, not two moments of a shared machine.

Run: ``python -m bench floor [--model resnet50] [--repeats 9]``.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import compress, peers, timing, torch_peers
from bench.output import write_json
from gradcomp.models import shapes as shapes_lib

CODECS = (
  "qsgd",
  "sketch_topk",
  "powersgd",
  "dgc",
  "threshold_quantize",
  "ef_signsgd",
  "randomk",
)
"""The rows: issue 43's seven codecs, as ``bench compress`` labels."""

TARGET = 6.0
"""Issue 43's target: each codec's fused time within this multiple of the floor."""

PEER_TARGET = 0.8
"""Issue 43's target for random-k, DGC, PowerSGD: this fraction of the best peer."""

_PEER_LAYOUTS = ("per_tensor", "one_buffer")


def floor_contender(grads, *, warmup: int = 1) -> compress.Contender:
  """One read and one write of every gradient value: ``x * -1``, donated."""
  return compress._update_contender(
    lambda g, s: (jax.tree.map(lambda x: x * jnp.float32(-1.0), g), s),
    (),
    grads,
    warmup,
  )


def _contenders(label, layer, fused, warmup, with_peers, with_torch):
  """``(name, build)`` of the row: the floor, the codec fused, its peers."""
  (cfg,) = compress.select([label])
  out = [
    ("floor", lambda: floor_contender(fused, warmup=warmup)),
    ("fused", lambda: compress.layout_contender(cfg, fused, warmup=warmup)),
  ]
  if not (with_peers and label in peers.PEERS):
    return out
  # The peer doing the same work: with error feedback where gradcomp's row has it.
  ef = peers.PEERS[label][2]
  trees = {"per_tensor": list(layer.values()), "one_buffer": list(fused.values())}
  for layout in _PEER_LAYOUTS:
    out.append(
      (
        f"jax_{layout}",
        lambda t=trees[layout]: compress.peer_contender(label, ef, t, warmup=warmup),
      )
    )
  if with_torch and label in torch_peers.LABELS:
    for layout in _PEER_LAYOUTS:
      arrays = [np.asarray(t) for t in trees[layout]]
      out.append(
        (
          f"torch_{layout}",
          lambda a=arrays: compress.Contender(
            *torch_peers.contender(label, ef, a, warmup=warmup)
          ),
        )
      )
  return out


def run(
  model: str = "resnet50",
  repeats: int = 9,
  only: str | Sequence[str] | None = None,
  out_dir: str = "bench_out",
  warmup: int = 1,
  with_peers: bool = True,
  shape_list: Sequence[tuple[str, tuple[int, ...]]] | None = None,
  log=sys.stderr,
) -> dict[str, Any]:
  """Times the floor, each codec fused and its peers; writes ``floor.json``.

  Args:
    model: a :data:`gradcomp.models.shapes.MODELS` key, the gradient's shapes.
    repeats: interleaved rounds per row (medians of this many calls).
    only: comma-separated labels among :data:`CODECS` (default: all).
    out_dir: where ``floor.json`` goes.
    warmup: untimed calls after the first (compiling) one.
    with_peers: time the naive-JAX (and, where installed, PyTorch) peers.
    shape_list: ``(name, shape)`` pairs instead of ``model``'s (tests).
    log: the progress stream.

  Returns:
    The JSON record: per row the floor's and the codec's median ms in the
    same rounds, their ratio (``multiple``), and the peers' medians.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  labels = _labels(only)
  with_torch = with_peers and torch_peers.available()
  if with_peers and not with_torch:
    print("# PyTorch is not installed: only the naive-JAX peers", file=log)
  if shape_list is None:
    shape_list = shapes_lib.MODELS[model]()
  d = shapes_lib.total_size(shape_list)
  t0 = time.perf_counter()
  load_start = list(os.getloadavg())
  layer = shapes_lib.make_tree(shape_list)
  fused = {"fused": jnp.concatenate([x.ravel() for x in layer.values()])}
  print(
    f"# floor: {model}, {len(shape_list)} tensors, d={d:,}; load {load_start}",
    file=log,
    flush=True,
  )
  rows = []
  for label in labels:
    built, row = [], {"label": label}
    for name, make in _contenders(label, layer, fused, warmup, with_peers, with_torch):
      try:
        built.append((name, make()))
      except Exception as e:  # noqa: BLE001  (report, keep going)
        row[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    times = timing.interleaved([(c.prepare, c.call) for _, c in built], repeats)
    for (name, c), t in zip(built, times, strict=True):
      res = c.result(t)
      res.pop("times_ms")
      row[name] = {**res, "times_ms": [round(x, 4) for x in t]}
    del built
    gc.collect()
    _ratios(row)
    rows.append(row)
    print(f"  {_line(row)}", file=log, flush=True)
  floors = [r["floor"]["median_ms"] for r in rows if "median_ms" in r["floor"]]
  result = {
    "suite": "floor",
    "model": model,
    "num_tensors": len(shape_list),
    "num_params": d,
    "floor_program": "x * -1 on the fused gradient, donated (one read, one write)",
    "floor_bytes": 8 * d,
    "floor_ms": statistics.median(floors) if floors else None,
    "target_multiple": TARGET,
    "peer_target": PEER_TARGET,
    "repeats": repeats,
    "warmup": warmup,
    "with_torch": with_torch,
    "machine": compress.machine_info(),
    "loadavg_start": load_start,
    "loadavg_end": list(os.getloadavg()),
    "wall_s": time.perf_counter() - t0,
    "rows": rows,
  }
  print(format_table(result))
  path = write_json(out_dir, "floor.json", result)
  print(f"\nwrote {path} ({result['wall_s']:.0f} s)")
  return result


def _stage_programs(label: str, d: int) -> dict[str, Any]:
  """``name -> fn(x, r) -> (out, ...)`` for the passes of one codec, fused.

  Each is one jitted program over the fused gradient ``x`` (and a residual
  ``r``), donated like the codec's own update, so a gradient-sized output is
  written in place where the codec's would be; its time is what that pass
  costs alone, temporaries included. The passes re-create the codec's
  (``gradcomp``'s kernels, the codec's hyper-parameters of :data:`CODECS`).
  """
  from gradcomp.compressors import checks, quantizers  # noqa: PLC0415
  from gradcomp.compressors import sketch_topk as sk  # noqa: PLC0415
  from gradcomp.kernels import bits, count_sketch, hashing, numerics  # noqa: PLC0415
  from gradcomp.kernels.selection import top_k_magnitude  # noqa: PLC0415

  key = jnp.array([3, 4], jnp.uint32)
  body = d - d % 512
  k = checks.keep_count(0.01, d)
  cols = sk.default_cols(k, 5)

  def buckets(x):
    return x[:body].reshape(-1, 512)

  def payload(x, per_byte):
    # A packed payload of ceil(d / per_byte) bytes: x's leading bytes. (The
    # decoded output is added to r: a donated output goes over the first
    # matching input, r, so r is read in place and the payload is not.)
    words = -(-d // (4 * per_byte)) + 1
    # Materialised first, as the codec's payload is (on a wire, or through
    # its one-device conditional); fused into the unpack, the bitcast of a
    # slice made XLA write a byte per coordinate.
    packed = jax.lax.bitcast_convert_type(x[:words], jnp.uint8).reshape(-1)
    return jax.lax.optimization_barrier(packed)

  def ternary(e):
    return (e >= 0.5).astype(jnp.float32) - (e <= -0.5).astype(jnp.float32)

  if label == "qsgd":
    return {
      "bucket max |x| (512 per row)": lambda x, r: numerics.max_abs(
        buckets(x), axis=-1
      ),
      "bucket sum of squares": lambda x, r: jnp.sum(jnp.square(buckets(x)), -1),
      "bucket norms (overflow-free: both)": lambda x, r: numerics.scaled_norm(
        buckets(x), axis=-1
      ),
      "hash uniforms + round to int8 codes": lambda x, r: (
        jnp.floor(jnp.abs(x) * 4.0 + hashing.hash_uniform(key, x.shape)) * jnp.sign(x)
      ).astype(jnp.int8),
      "quantize (norms, round, codes)": lambda x, r: quantizers._quantize_buckets(
        buckets(x), key, 4
      ),
    }
  if label == "sketch_topk":
    table = count_sketch.sketch(jnp.ones((d,), jnp.float32), 5, cols, 0)
    return {
      "e = r + g": lambda x, r: x + r,
      "sketch (5 rows)": lambda x, r: count_sketch.sketch(x, 5, cols, 0),
      "estimate every coordinate (d out)": lambda x, r: count_sketch.estimate_all(
        table + r[:1], d, 0
      ),
      "top-k of d priorities": lambda x, r: top_k_magnitude(x, k),
      "heavymix (estimate + top-k)": lambda x, r: sk.heavymix(
        table + r[:1], d, k, key, 0
      ),
    }
  if label == "threshold_quantize":
    return {
      "e = r + g": lambda x, r: x + r,
      "ternary codes + 2-bit pack": lambda x, r: bits.pack_ternary(ternary(x + r)),
      "unpack + residual": lambda x, r: bits.unpack_ternary(payload(x, 4), d) * 0.5 + r,
    }
  if label == "ef_signsgd":
    return {
      "e = r + g": lambda x, r: x + r,
      "mean |e|": lambda x, r: jnp.mean(jnp.abs(x + r)),
      "pack signs": lambda x, r: bits.pack_signs(x + r),
      "unpack signs * scale": lambda x, r: (
        bits.unpack_signs(payload(x, 8), d) * 0.5 + r
      ),
    }
  if label == "powersgd":
    rows = math.isqrt(d - 1) + 1
    cols_m = -(-d // rows)
    q = jnp.ones((cols_m, 4), jnp.float32)

    def matrix(x):
      return jnp.pad(x, (0, rows * cols_m - d)).reshape(rows, cols_m)

    return {
      "zero-padded matrix": lambda x, r: matrix(x),
      "P = M Q": lambda x, r: matrix(x) @ q,
      "Q = M^T P": lambda x, r: matrix(x).T @ jnp.ones((rows, 4), jnp.float32),
      "P Q^T into the buffer": lambda x, r: (
        (jnp.ones((rows, 4), jnp.float32) @ q.T).reshape(-1)[:d] + x
      ),
    }
  return {}


def stages(
  model: str = "resnet50",
  only: str | Sequence[str] | None = "qsgd,sketch_topk,powersgd",
  repeats: int = 5,
  out_dir: str = "bench_out",
  log=sys.stderr,
) -> dict[str, Any]:
  """Times the passes of the worst codecs, each alone, interleaved with the floor.

  Writes ``floor_stages.json``: per codec, per pass, its median ms and its
  multiple of the floor timed in the same rounds.
  """
  labels = _labels(only)
  shape_list = shapes_lib.MODELS[model]()
  d = shapes_lib.total_size(shape_list)
  rng = np.random.default_rng(0)
  grads = {
    "x": jnp.asarray(rng.standard_normal(d, dtype=np.float32)),
    "r": jnp.asarray(0.1 * rng.standard_normal(d, dtype=np.float32)),
  }
  load_start = list(os.getloadavg())
  out = {}
  for label in labels:
    programs = _stage_programs(label, d)
    if not programs:
      continue
    built = [("floor", floor_contender({"x": grads["x"]}))]
    for name, fn in programs.items():
      built.append(
        (
          name,
          compress._update_contender(
            lambda g, s, fn=fn: (fn(g["x"], g["r"]), s), (), grads, 0
          ),
        )
      )
    times = timing.interleaved([(c.prepare, c.call) for _, c in built], repeats)
    floor_ms = statistics.median(times[0])
    out[label] = {
      name: {
        "median_ms": statistics.median(t),
        "multiple": statistics.median(t) / floor_ms,
      }
      for (name, _), t in zip(built, times, strict=True)
    }
    del built
    gc.collect()
    for name, res in out[label].items():
      print(
        f"  {label:>18} {name:>36}: {res['median_ms']:8.2f} ms {res['multiple']:6.1f}x",
        file=log,
        flush=True,
      )
  result = {
    "suite": "floor_stages",
    "model": model,
    "num_params": d,
    "repeats": repeats,
    "loadavg_start": load_start,
    "loadavg_end": list(os.getloadavg()),
    "stages": out,
  }
  path = write_json(out_dir, "floor_stages.json", result)
  print(f"wrote {path}")
  return result


def _labels(only) -> list[str]:
  if not only:
    return list(CODECS)
  labels = only.split(",") if isinstance(only, str) else list(only)
  labels = [x.strip() for x in labels if x.strip()]
  unknown = sorted(set(labels) - set(CODECS))
  if unknown or not labels:
    raise ValueError(f"unknown codec label(s) {unknown}; known: {', '.join(CODECS)}")
  return labels


def _ratios(row: dict[str, Any]) -> None:
  """The row's multiple of the floor and its ratio to the best peer, in place."""
  floor, ours = row["floor"].get("median_ms"), row["fused"].get("median_ms")
  row["multiple"] = None if floor is None or ours is None else ours / floor
  peer_times = {
    k: v["median_ms"]
    for k, v in row.items()
    if k.startswith(("jax_", "torch_")) and "median_ms" in v
  }
  if peer_times and ours is not None:
    best = min(peer_times, key=peer_times.get)
    row["best_peer"] = best
    row["vs_best_peer"] = ours / peer_times[best]


def _ms(x: float | None) -> str:
  return "" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _line(row: dict[str, Any]) -> str:
  m = row.get("multiple")
  peer = row.get("vs_best_peer")
  return (
    f"{row['label']:>18}: floor {_ms(row['floor'].get('median_ms'))} ms, "
    f"fused {_ms(row['fused'].get('median_ms')) or row['fused'].get('error')} ms"
    + ("" if m is None else f" = {m:.1f}x")
    + ("" if peer is None else f"; vs best peer {peer:.2f}")
  )


def format_table(result: dict[str, Any]) -> str:
  """Markdown table of a :func:`run` result."""
  m = result["machine"]
  lines = [
    f"fused codecs on the {result['model']} gradient ({result['num_params']:,} fp32, "
    f"one buffer, one worker) against one read + write of it, medians of "
    f"{result['repeats']} interleaved rounds",
    f"{m['backend']} ({m['device_kind']}), {m['cpu_count']} CPUs, jax "
    f"{m['jax_version']}; load {result['loadavg_start']} -> {result['loadavg_end']}",
    "",
    "| codec | floor ms | fused ms | multiple | JAX per tensor / one buffer "
    "| PyTorch per tensor / one buffer | fused / best peer |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for row in result["rows"]:
    peer = [
      " / ".join(
        _ms(row.get(f"{who}_{lay}", {}).get("median_ms")) or "—"
        for lay in _PEER_LAYOUTS
      )
      if f"{who}_per_tensor" in row or f"{who}_one_buffer" in row
      else "—"
      for who in ("jax", "torch")
    ]
    mult = row.get("multiple")
    vs = row.get("vs_best_peer")
    lines.append(
      f"| {row['label']} | {_ms(row['floor'].get('median_ms')) or 'error'} "
      f"| {_ms(row['fused'].get('median_ms')) or 'error'} "
      f"| {'' if mult is None else f'{mult:.1f}x'} | {peer[0]} | {peer[1]} "
      f"| {'' if vs is None else f'{vs:.2f}'} |"
    )
  errors = [
    f"- {row['label']} ({k}): {v['error']}"
    for row in result["rows"]
    for k, v in row.items()
    if isinstance(v, dict) and "error" in v
  ]
  if errors:
    lines += ["", "errors:", *errors]
  return "\n".join(lines)
