"""Compress + decompress time of each compressor on one model's gradient.

For every row of :data:`COMPRESSORS` the suite builds ``tx = gradcomp.get(name,
**kwargs)`` on a single worker (``axis_name=None``, so the exchange is the identity
and ``update`` is compress + decompress) and times ``jax.jit(tx.update,
donate_argnums=(1,))(grads, state)`` in two layouts:

* **layer-wise**: the gradient tree as is (161 leaves for ResNet-50);
* **fused**: one pre-flattened 1-D buffer of all values (a tree with one leaf),
  the extreme of LayerFusion's ``plan="single"``; the concatenation is done once,
  outside the timed call.

The state is donated and the returned state fed back into the next call, so state
buffers are reused as in a training step; the gradients are donated too (each call
gets its own copy, made before timing), because in a step the gradient buffer is
dead once compressed. Without that every fused call writes its output into freshly
allocated memory, and on CPU a fresh 100 MB buffer costs tens of ms of first-touch
page faults (``PERFORMANCE_NOTES.md``), which would dominate the fused time of the
cheap compressors (none, fp16, signSGD). Times are medians of ``repeats`` calls after a first
(compiling) call and one warm-up call; the first call's time is recorded as
``compile_ms``. A row's variants (gradcomp in both layouts, every peer) are
timed in interleaved rounds, one call each per round
(:func:`bench.timing.interleaved`), so the machine's drift over the
row's seconds falls on all of them alike and their ratio compares programs,
not moments.

Each time is set against a **memory-bandwidth floor**: the bytes an ideal
single-pass implementation must read and write (:class:`Floor`) divided by the copy
bandwidth measured in the same run (:func:`bench.timing.copy_bandwidth_gbps`).
This reproduces the measurement of paper 000 §3.1, Table 1 (ResNet-50 gradient on
a V100), whose numbers are shown beside ours.

Run: ``python -m bench compress [--model resnet50] [--only topk,dgc]``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bench import peers, timing, torch_peers
from bench.output import write_json
from gradcomp.models import shapes as shapes_lib

_F32 = 4  # bytes per float32 element
_I32 = 4  # bytes per int32 index


@dataclasses.dataclass(frozen=True)
class Floor:
  """Minimum memory traffic of one compress + decompress call on ``d`` float32 values.

  The model is an ideal **single pass**: every input and state byte is read once,
  every output, state and payload byte written once (the payload is what would
  cross the wire, so it must be materialised; reading it back for decompression is
  assumed fused with its write). ``k = ratio * d`` selected coordinates for
  sparsifiers. It is a lower bound: compressors that need a global reduction
  before their element-wise work (top-k's threshold, QSGD / TernGrad norms,
  EF-signSGD's scale, PowerSGD's two dependent matmuls) need at least two passes
  over data larger than cache, so a ratio of 2-3 to this floor is already good.

  Attributes:
    read: bytes read per element (gradient 4, plus 4 per float32 state buffer).
    write: bytes written per element (output 4, state 4 each, dense payload).
    write_per_k: payload bytes per selected coordinate (sparsifiers).
    formula: the same, as text, for the table and the JSON.
  """

  read: float
  write: float
  write_per_k: float = 0.0
  formula: str = ""

  def bytes(self, d: int, ratio: float | None = None) -> float:
    k = 0 if ratio is None else math.ceil(ratio * d)
    return d * (self.read + self.write) + k * self.write_per_k


@dataclasses.dataclass(frozen=True)
class CompressorConfig:
  """One row of the compressor benchmarks.

  Attributes:
    label: row name, unique (``"bf16"`` for ``fp16`` with ``dtype=jnp.bfloat16``).
    name: registered name, as passed to ``gradcomp.get``.
    kwargs: keyword arguments of the factory.
    floor: its memory-traffic floor.
    paper_ms: paper 000 Table 1 (compress + decompress of the ResNet-50 gradient on
      a V100), where the paper gives one.
  """

  label: str
  name: str
  kwargs: Mapping[str, Any]
  floor: Floor
  paper_ms: float | None = None

  def ratio(self) -> float | None:
    return self.kwargs.get("ratio")

  def kwargs_json(self) -> dict[str, Any]:
    return {
      k: (jnp.dtype(v).name if isinstance(v, type) or hasattr(v, "dtype") else v)
      for k, v in self.kwargs.items()
    }


# Single-pass floors (bytes per element unless ``*k``); "EF" = error-feedback
# residual, read 4 and written 4. Defaults follow DESIGN.md §1: top-k and
# random-k use error feedback, QSGD does not; DGC keeps momentum and residual.
_NONE = Floor(0, 0, formula="0 (identity on one worker)")
_FP16 = Floor(_F32, 2 + _F32, formula="read 4d; write 2d payload + 4d out")
_TOPK = Floor(
  2 * _F32, 2 * _F32, _F32 + _I32, "read 4d g + 4d EF; write 4d EF + 4d out + 8k"
)
# Random-k: indices come from a shared seed, only the k values are sent.
_RANDK = Floor(2 * _F32, 2 * _F32, _F32, "read 4d g + 4d EF; write 4d EF + 4d out + 4k")
_DGC = Floor(
  3 * _F32,
  3 * _F32,
  _F32 + _I32,
  "read 4d g + 4d momentum + 4d residual; write those 8d + 4d out + 8k",
)


def _bits_floor(bits: float, ef: bool, what: str) -> Floor:
  state = _F32 if ef else 0
  return Floor(
    _F32 + state,
    _F32 + state + bits / 8,
    formula=f"read 4d g{' + 4d EF' if ef else ''}; write "
    f"{'4d EF + ' if ef else ''}4d out + {bits:g}/8 d ({what})",
  )


def _qsgd_bits(levels: int) -> int:
  """Bits of one QSGD code: sign and level in ``{-s..s}``, ``ceil(log2(2s + 1))``."""
  return math.ceil(math.log2(2 * levels + 1))


COMPRESSORS: list[CompressorConfig] = [
  CompressorConfig("none", "none", {}, _NONE),
  CompressorConfig("fp16", "fp16", {}, _FP16),
  CompressorConfig("bf16", "fp16", {"dtype": jnp.bfloat16}, _FP16),
  CompressorConfig("topk", "topk", {"ratio": 0.01}, _TOPK, paper_ms=122),
  CompressorConfig("randomk", "randomk", {"ratio": 0.01}, _RANDK, paper_ms=187),
  CompressorConfig("dgc", "dgc", {"ratio": 0.01}, _DGC, paper_ms=242),
  # Paper 000 Table 1 row is "QSGD - 2 bit"; ours uses 4 levels (4-bit codes).
  CompressorConfig(
    "qsgd",
    "qsgd",
    {"levels": 4},
    _bits_floor(_qsgd_bits(4), False, "codes"),
    paper_ms=46,
  ),
  CompressorConfig(
    "terngrad", "terngrad", {}, _bits_floor(2, False, "ternary codes"), paper_ms=70
  ),
  CompressorConfig(
    "signsgd", "signsgd", {}, _bits_floor(1, False, "sign bits"), paper_ms=13
  ),
  CompressorConfig("ef_signsgd", "ef_signsgd", {}, _bits_floor(1, True, "sign bits")),
  # PowerSGD: P and Q factors are O(r (n + m)) and left out of the floor.
  CompressorConfig(
    "powersgd",
    "powersgd",
    {"rank": 4},
    Floor(2 * _F32, 2 * _F32, formula="read 4d g + 4d EF; write 4d EF + 4d out"),
    paper_ms=174,
  ),
  CompressorConfig(
    "threshold_quantize",
    "threshold_quantize",
    {"threshold": 0.5},
    _bits_floor(2, True, "2-bit codes"),
  ),
  # Survey 004 §4.1: 1-bit SGD (two floats per column left out), fixed point.
  CompressorConfig("onebit_sgd", "onebit_sgd", {}, _bits_floor(1, True, "sign bits")),
  CompressorConfig(
    "fixed_point_8", "fixed_point", {"bits": 8}, _bits_floor(8, False, "8-bit codes")
  ),
  CompressorConfig(
    "fixed_point_12",
    "fixed_point",
    {"bits": 12},
    _bits_floor(12, False, "12-bit codes"),
  ),
  CompressorConfig(
    "dynamic_fixed_point_12",
    "dynamic_fixed_point",
    {"bits": 12},
    _bits_floor(12, False, "12-bit codes + an exponent per leaf"),
  ),
  # Strom 2015 (survey §4.2): ~0.93 % of N(0, 1) values exceed 2.6; one int32
  # per slot (index, sign in the top bit), k = 1 % of d.
  CompressorConfig(
    "sparse_quantize",
    "sparse_quantize",
    {"threshold": 2.6, "max_ratio": 0.01},
    Floor(
      2 * _F32,
      2 * _F32 + 4 * 0.01,
      formula="read 4d g + 4d EF; write 4d EF + 4d out + 4k",
    ),
  ),
  # Sketch-Fusion SGD (paper 000 Alg. 1): the sketch pass reads e once per row
  # set (one fused pass), estimate-all writes nothing dense beyond the output;
  # the tables (rows x cols) and the k values are O(k) and left out.
  CompressorConfig(
    "sketch_topk",
    "sketch_topk",
    {"ratio": 0.01},
    Floor(2 * _F32, 2 * _F32, _F32, "read 4d g + 4d EF; write 4d EF + 4d out + 4k"),
  ),
]
"""The rows of the compressor suites; later suites (sketch_topk, layerfusion) append."""


def select(only: str | Sequence[str] | None) -> list[CompressorConfig]:
  """The configs whose labels are listed in ``only`` (comma-separated), in order."""
  if not only:
    return list(COMPRESSORS)
  labels = only.split(",") if isinstance(only, str) else list(only)
  labels = [x.strip() for x in labels if x.strip()]
  known = {c.label for c in COMPRESSORS}
  unknown = [x for x in labels if x not in known]
  if unknown:
    raise ValueError(f"unknown compressor label(s) {unknown}; known: {sorted(known)}")
  return [c for c in COMPRESSORS if c.label in labels]


def machine_info() -> dict[str, Any]:
  dev = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device_kind": dev.device_kind,
    "device_count": jax.device_count(),
    "cpu_count": os.cpu_count(),
    "jax_version": jax.__version__,
    "numpy_version": np.__version__,
    "python": platform.python_version(),
    "platform": platform.platform(),
    "processor": platform.processor(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "prng_impl": str(jax.config.jax_default_prng_impl),
    # 1/5/15-minute load: other processes on a shared 2-core box inflate times.
    "loadavg": list(os.getloadavg()),
  }


def _copy_tree(tree):
  # Fresh buffers, so that donating the state can never invalidate arrays that
  # ``init`` may have aliased (e.g. the gradients themselves).
  return jax.tree.map(
    lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree
  )


def _build(cfg: CompressorConfig):
  import gradcomp  # noqa: PLC0415  (imported late: the library may still be growing)

  get = getattr(gradcomp, "get", None)
  if get is None:
    raise AttributeError("gradcomp.get does not exist (yet)")
  return get(cfg.name, **cfg.kwargs)


LAYOUTS = ("layerwise", "fused")
# The peers' name for each of gradcomp's layouts.
_PEER_LAYOUT = {"layerwise": "per_tensor", "fused": "one_buffer"}


class Contender(NamedTuple):
  """One variant of a row (gradcomp in a layout, or a peer), ready to be timed
  call by call in rounds with the others (:func:`timing.interleaved`).

  Attributes:
    prepare: ``prepare() -> inputs`` of one call (a fresh copy of the gradient).
    call: ``call(inputs)``, returning once its work is done.
    result: ``result(times_ms) -> dict``, the JSON record of those times.
  """

  prepare: Callable[[], Any]
  call: Callable[[Any], Any]
  result: Callable[[list[float]], dict[str, Any]]


def layout_contender(cfg: CompressorConfig, grads, *, warmup: int = 1) -> Contender:
  """One compressor on one gradient tree, compiled and warmed up."""
  tx = _build(cfg)
  return _update_contender(
    lambda g, s: tx.update(g, s, None), tx.init(grads), grads, warmup
  )


def peer_contender(label: str, ef: bool, grads, *, warmup: int = 1) -> Contender:
  """The naive peer of ``label`` (``peers.py``) on a list of tensors."""
  peer = peers.lift(label, ef)
  return _update_contender(peer.update, peer.init(grads), grads, warmup)


def _update_contender(fn, state, grads, warmup: int) -> Contender:
  state = _copy_tree(state)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
  # Gradients and state are both donated: in a training step the gradient
  # buffer is dead once compressed, so the output can reuse it. Without that,
  # every fused call writes 100 MB of fresh pages (~25-50 ms of page faults on
  # this CPU) and the table would measure the allocator. Each call gets its own
  # copy of the gradients, made (and touched) before timing.
  update = jax.jit(fn, donate_argnums=(0, 1))
  box = [state]

  def prepare():
    return jax.block_until_ready(_copy_tree(grads))

  def call(g):
    out, box[0] = update(g, box[0])
    return jax.block_until_ready((out, box[0]))[0]

  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    ((first,),) = timing.interleaved([(prepare, call)], 1)
    for _ in range(warmup):
      call(prepare())

  def result(times: list[float]) -> dict[str, Any]:
    out = call(prepare())
    finite = bool(all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out)))
    return {
      "median_ms": statistics.median(times),
      "min_ms": min(times),
      "times_ms": list(times),
      "compile_ms": first,
      "state_bytes": int(state_bytes),
      "finite": finite,
    }

  return Contender(prepare, call, result)


def run(
  model: str = "resnet50",
  repeats: int = 7,
  only: str | Sequence[str] | None = None,
  out_dir: str = "bench_out",
  warmup: int = 1,
  log=sys.stderr,
  with_peers: bool = True,
  layouts: Sequence[str] = LAYOUTS,
) -> dict[str, Any]:
  """Runs the suite, prints the markdown table, writes ``<out_dir>/compress.json``.

  With ``with_peers``, the naive-JAX peer of each row that has one
  (``peers.PEERS``) is timed in the same process, per tensor (one jit over the
  list of tensors) and on the one buffer, without error feedback and, where
  gradcomp's row has it, with it; ``row["peers"]`` holds those times. Where
  PyTorch is installed (``torch_peers.py``; not a gradcomp dependency), its
  peers are timed the same way into ``row["torch_peers"]``.

  ``layouts`` picks gradcomp's layouts (``"layerwise"``, ``"fused"``) and the
  peers' matching ones (per tensor, one buffer); fused alone skips the
  per-leaf compiles, which take 16-60 s a row on a GPU.
  """
  layouts = _check_layouts(layouts)
  configs = select(only)
  with_torch = with_peers and torch_peers.available()
  if with_peers and not with_torch:
    print("# PyTorch is not installed: its peers are not timed", file=log)
  shape_list = shapes_lib.MODELS[model]()
  d = shapes_lib.total_size(shape_list)
  t_start = time.perf_counter()
  layer = shapes_lib.make_tree(shape_list)
  fused = {"fused": jnp.concatenate([x.ravel() for x in layer.values()])}
  gbps = timing.copy_bandwidth_gbps()  # ~100 MiB: DRAM, not cache, for every model
  info = machine_info()
  print(
    f"# compress: {model}, {len(shape_list)} tensors, d={d:,} "
    f"({d * _F32 / 1e6:.1f} MB fp32); copy bandwidth {gbps:.1f} GB/s; "
    f"{info['backend']} / {info['device_kind']}, {info['cpu_count']} CPUs",
    file=log,
    flush=True,
  )
  rows = []
  for cfg in configs:
    floor_bytes = cfg.floor.bytes(d, cfg.ratio())
    row = {
      "label": cfg.label,
      "name": cfg.name,
      "kwargs": cfg.kwargs_json(),
      "floor_formula": cfg.floor.formula,
      "floor_bytes": floor_bytes,
      "floor_ms": floor_bytes / (gbps * 1e9) * 1e3,
      # Paper 000 Table 1 measured ResNet-50 only.
      "paper_v100_ms": cfg.paper_ms if model == "resnet50" else None,
    }
    contenders = _row_contenders(
      cfg, layer, fused, warmup, with_peers, with_torch, layouts
    )
    built = []
    for path, make in contenders:
      try:
        built.append((path, make()))
      except Exception as e:  # noqa: BLE001  (report, keep going)
        _put(row, path, {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    times = timing.interleaved([(c.prepare, c.call) for _, c in built], repeats)
    for (path, contender), t in zip(built, times, strict=True):
      _put(row, path, contender.result(t))
    del built
    gc.collect()
    for layout in layouts:
      res = row[layout]
      if "median_ms" in res and row["floor_ms"] > 0:
        res["ratio_to_floor"] = res["median_ms"] / row["floor_ms"]
    for path, _ in contenders:
      res = _get(row, path)
      msg = (
        f"{res['median_ms']:9.2f} ms"
        + (
          f" (first call {res['compile_ms'] / 1e3:.1f} s)"
          if "compile_ms" in res
          else ""
        )
        if "median_ms" in res
        else f"FAILED {res['error']}"
      )
      print(f"  {cfg.label:>18} {' '.join(path):>26}: {msg}", file=log, flush=True)
    rows.append(row)
  result = {
    "suite": "compress",
    "model": model,
    "num_tensors": len(shape_list),
    "num_params": d,
    "repeats": repeats,
    "warmup": warmup,
    "layouts": list(layouts),
    "copy_bandwidth_gbps": gbps,
    "machine": info,
    "wall_s": time.perf_counter() - t_start,
    "loadavg_end": list(os.getloadavg()),
    "rows": rows,
  }
  print(format_table(result))
  path = write_json(out_dir, "compress.json", result)
  print(f"\nwrote {path} ({result['wall_s']:.0f} s)")
  return result


def _check_layouts(layouts: Sequence[str]) -> tuple[str, ...]:
  layouts = tuple(layouts)
  if not layouts or set(layouts) - set(LAYOUTS) or len(set(layouts)) < len(layouts):
    raise ValueError(f"layouts must be distinct names from {LAYOUTS}, got {layouts}")
  return layouts


def _row_contenders(cfg, layer, fused, warmup, with_peers, with_torch, layouts):
  """``(path in the row, build)`` for gradcomp's layouts and the peers'."""
  trees = {"layerwise": layer, "fused": fused}
  out = [
    ((layout,), functools.partial(layout_contender, cfg, trees[layout], warmup=warmup))
    for layout in layouts
  ]
  label = cfg.label
  if not (with_peers and label in peers.PEERS):
    return out
  kinds = ("plain", "ef") if peers.PEERS[label][2] else ("plain",)
  layouts = [(_PEER_LAYOUT[layout], list(trees[layout].values())) for layout in layouts]
  for kind in kinds:
    for layout, tensors in layouts:
      build = functools.partial(
        peer_contender, label, kind == "ef", tensors, warmup=warmup
      )
      out.append((("peers", kind, layout), build))
  if with_torch and label in torch_peers.LABELS:
    host = [(layout, [np.asarray(t) for t in tensors]) for layout, tensors in layouts]
    for kind in kinds:
      for layout, arrays in host:
        build = functools.partial(
          torch_peers.contender, label, kind == "ef", arrays, warmup=warmup
        )
        out.append((("torch_peers", kind, layout), lambda b=build: Contender(*b())))
  return out


def _put(row: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    row = row.setdefault(key, {})
  row[path[-1]] = value


def _get(row: dict, path: tuple[str, ...]):
  for key in path:
    row = row[key]
  return row


def _best(*results) -> float | None:
  times = [r["median_ms"] for r in results if "median_ms" in r]
  return min(times) if times else None


def _ms(x: float | None) -> str:
  return "" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _cell(res: Mapping[str, Any] | None) -> str:
  """A table cell: a median, "error", or "—" for a layout that was not run."""
  if res is None:
    return "—"
  return _ms(res.get("median_ms")) or "error"


def format_table(result: Mapping[str, Any]) -> str:
  """Markdown table of a :func:`run` result."""
  m = result["machine"]
  lines = [
    f"compress + decompress, {result['model']} gradient "
    f"({result['num_tensors']} tensors, {result['num_params']:,} fp32), one worker; "
    f"medians of {result['repeats']} calls",
    f"backend {m['backend']} ({m['device_kind']}), {m['cpu_count']} CPUs, "
    f"jax {m['jax_version']}; copy bandwidth {result['copy_bandwidth_gbps']:.1f} GB/s",
    "",
    "| compressor | layer-wise ms | fused ms | floor ms | layer-wise/floor "
    "| fused/floor | paper (V100) ms | first call s (lw / fused) |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for row in result["rows"]:
    cells, ratios, firsts = [], [], []
    for layout in LAYOUTS:
      res = row.get(layout)
      if res is None:  # Not run (``layouts``).
        cells.append("—")
        ratios.append("")
        firsts.append("")
      elif "median_ms" in res:
        cells.append(_ms(res["median_ms"]))
        r = res.get("ratio_to_floor")
        ratios.append("n/a" if r is None else f"{r:.1f}x")
        firsts.append(f"{res['compile_ms'] / 1e3:.1f}")
      else:
        cells.append("error")
        ratios.append("")
        firsts.append("")
    lines.append(
      f"| {row['label']} | {cells[0]} | {cells[1]} | {_ms(row['floor_ms'])} "
      f"| {ratios[0]} | {ratios[1]} | {_ms(row['paper_v100_ms'])} "
      f"| {firsts[0]} / {firsts[1]} |"
    )
  errors = [
    (row["label"], layout, row[layout]["error"])
    for row in result["rows"]
    for layout in LAYOUTS
    if "error" in row.get(layout, {})
  ]
  with_peers = [row for row in result["rows"] if "peers" in row]
  if with_peers:
    lines += [
      "",
      "peers, same process: naive JAX (``peers.py``; per tensor = one jit over "
      "the list of tensors) and, where installed, PyTorch eager "
      "(``torch_peers.py``; per tensor = a loop over the tensors); "
      "``+ EF`` = with error feedback. Ratio = best gradcomp / best peer doing "
      "the same work (the peers with error feedback where gradcomp's row has "
      "it; < 1: gradcomp faster).",
      "",
      "| compressor | gradcomp layer-wise / fused | JAX per tensor / one buffer "
      "| JAX + EF | PyTorch per tensor / one buffer | PyTorch + EF "
      "| best gradcomp / best peer |",
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in with_peers:
      cells, same_work = [], []
      for p in (row["peers"], row.get("torch_peers")):
        for kind in ("plain", "ef"):
          q = (p or {}).get(kind)
          cells.append(
            " / ".join(_cell(q.get(lay)) for lay in ("per_tensor", "one_buffer"))
            if q
            else "—"
          )
        if p:
          same = p.get("ef") or p["plain"]
          same_work += [same.get("per_tensor", {}), same.get("one_buffer", {})]
      ours = _best(*(row.get(lay, {}) for lay in LAYOUTS))
      theirs = _best(*same_work)
      ratio = "" if ours is None or theirs is None else f"{ours / theirs:.2f}"
      gcs = " / ".join(_cell(row.get(lay)) for lay in LAYOUTS)
      lines.append(f"| {row['label']} | {gcs} | {' | '.join(cells)} | {ratio} |")
  if errors:
    lines += ["", "errors:"] + [f"- {lbl} ({lay}): {err}" for lbl, lay, err in errors]
  return "\n".join(lines)
