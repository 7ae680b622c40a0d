"""Bytes per step on the wire: every compressor, layer-wise vs fused, on model trees.

For each model (ResNet-20, ResNet-50, the PTB LSTM; float32 gradient trees
shaped as ``gradcomp.models.shapes.MODELS``) and each compressor of
:data:`bench.fusion.SEARCH_COMPRESSORS`, built with
``axis_name="data"``, the step is ``shard_map(tx.update)`` on ``workers``
devices (8 virtual CPU devices by default), in two layouts:

* **layer-wise**: ``tx`` applied to the tree, one compression per tensor;
* **fused**: ``gradcomp.layerfusion(tx, "single")``, all tensors in one buffer.

The count is the operand bytes of every collective one worker issues per step
(``gradcomp.wire_bytes``'s convention, DESIGN §4): for an all-reduce its
buffer, for an all-gather its own piece; indices, norms, scales, bit-packing
padding and second rounds included. It is shown as a fraction of dense, the
fp32 all-reduce of all parameters (``4 x`` parameters bytes; the ``none``
compressor's row must read 1.0). Because an all-gather moves ``n - 1`` times
its operand on a ring and an all-reduce ``2 (n - 1) / n`` times, the JSON and
table also give the ring traffic per worker at ``workers`` as a fraction of
dense's (volume factors of ``gradcomp.sim.Cluster``, topology ``"ring"``).

**Where the numbers come from.** Fused: the compiled, optimised HLO of the
step (``jit(...).lower(...).compile()``, parsed by
``gradcomp.parallel.wire.collective_bytes``, the parser behind
``gradcomp.wire_bytes``), compiled from ``jax.ShapeDtypeStruct`` arguments on
the real mesh, so nothing is allocated. Layer-wise: the *traced* program of
the same step, the whole tree at once (``jax.make_jaxpr`` under ``shard_map``
on an ``AbstractMesh`` of ``workers``:
``gradcomp.fusion.profiling.traced_collectives``), not compiled by default: on the
2-core CPU the 12 layer-wise ResNet-20 steps alone took ~2.5 minutes to
compile (sketch_topk 61 s), and ResNet-50's 161 tensors take longer, which
with the fused compiles is over this suite's 10-minute budget. The two counts
agree: ``tests/test_fusion_planner.py`` checks traced == compiled HLO, per
collective kind, for all 12 compressors on one leaf; all 24 ResNet-20 steps
(12 compressors, both layouts) were compiled once and matched; this suite
checks every fused buffer it compiles (the ``agree`` field, and the table's
last line); and ``--compile-layerwise`` compiles the layer-wise steps as well
(then every number is from the HLO, at several more minutes per model).
Each entry records its ``source`` (``"hlo"`` or ``"traced"``). The number of
collectives per step is the traced program's; XLA's combiners may merge
collectives of one kind in the compiled program, which leaves the bytes as
they are.

Run: ``python -m bench wire [--models resnet20] [--only topk,none]``;
about 2 minutes on the 2-core CPU with other jobs running, up to ~6 under a
load average of 16 (almost all of it the 36 fused compiles). Writes
``wire.json`` and ``wire.png`` (bars: fraction of dense, log scale, one panel per model) to
``--out`` and prints a markdown table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from bench.compress import machine_info
from bench.fusion import SEARCH_COMPRESSORS
from bench.output import write_json
from bench.plots import grouped_bar_plot
from bench.sizes import select
from gradcomp.compressors.spec import spec_of
from gradcomp.fusion.profiling import backend_name
from gradcomp.models import shapes
from gradcomp.parallel.traced import traced_collectives
from gradcomp.parallel.wire import collective_bytes
from gradcomp.parallel.workers import sharded_update

AXIS = "data"
MODELS = ("resnet20", "resnet50", "lstm_ptb")
LAYOUTS = ("layerwise", "fused")
_LAYOUT_NAMES = {"layerwise": "layer-wise", "fused": "fused (single)"}


def check_models(models: str | Sequence[str]) -> tuple[str, ...]:
  """The model names in ``models`` ("resnet20,lstm_ptb"), each a known one."""
  names = models.split(",") if isinstance(models, str) else list(models)
  names = tuple(n.strip() for n in names if n.strip())
  unknown = [n for n in names if n not in shapes.MODELS]
  if unknown or not names:
    raise ValueError(f"unknown models {unknown}; valid: {', '.join(shapes.MODELS)}")
  return names


def model_tree(model: str) -> dict[str, jax.ShapeDtypeStruct]:
  """The model's float32 gradient tree as shapes, one leaf per parameter tensor."""
  if model not in shapes.MODELS:
    raise ValueError(f"unknown model {model!r}; valid: {', '.join(shapes.MODELS)}")
  return {
    name: jax.ShapeDtypeStruct(shape, jnp.float32)
    for name, shape in shapes.MODELS[model]()
  }


def _layout(tx, layout: str):
  return tx if layout == "layerwise" else gradcomp.layerfusion(tx, "single")


def _arguments(tx, tree, workers: int, sharding=None):
  """Shapes of the per-worker gradients and state, optionally with a sharding."""

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  grads = jax.tree.map(lambda x: sds((workers, *x.shape), x.dtype), tree)
  state = jax.eval_shape(lambda: gradcomp.add_worker_axis(tx.init(tree), workers))
  return grads, jax.tree.map(lambda x: sds(x.shape, x.dtype), state)


def compiled_collectives(tx, tree, mesh) -> dict[str, int]:
  """``{kind: bytes}`` one worker sends, from the compiled HLO of the step."""
  args = _arguments(tx, tree, mesh.devices.size, NamedSharding(mesh, P(AXIS)))
  text = jax.jit(sharded_update(tx, mesh, AXIS)).lower(*args).compile().as_text()
  return {k: int(b) for k, b in collective_bytes(text).items() if b}


def ring_bytes(per_kind: dict[str, int], workers: int) -> float:
  """Bytes one worker moves on a ring for operand bytes ``per_kind``.

  ``Cluster.exchange_seconds`` with no latency at 8 Gbit/s (1 ns per byte) is
  the ring's volume factor times the operand bytes, in ns.
  """
  ring = gradcomp.sim.Cluster(workers, bandwidth_gbps=8.0, latency_us=0.0)
  return sum(
    float(ring.exchange_seconds(kind, nbytes, 0)) * 1e9
    for kind, nbytes in per_kind.items()
  )


def measure(
  name: str, tree, mesh, *, compile_layerwise: bool = False
) -> dict[str, Any]:
  """Wire bytes of compressor ``name`` on ``tree`` in both layouts."""
  workers = mesh.devices.size
  tx = gradcomp.get(name, axis_name=AXIS, **SEARCH_COMPRESSORS[name])
  row: dict[str, Any] = {
    "compressor": name,
    "label": spec_of(tx).label(),
    "hyperparameters": SEARCH_COMPRESSORS[name],
  }
  for layout in LAYOUTS:
    layout_tx = _layout(tx, layout)
    t0 = time.perf_counter()
    traced = traced_collectives(layout_tx, tree, AXIS, workers)
    trace_s = time.perf_counter() - t0
    traced_bytes = {k: b for k, (b, _) in traced.items()}
    entry: dict[str, Any] = {
      "collectives": sum(m for _, m in traced.values()),
      "traced": traced_bytes,
      "trace_s": trace_s,
    }
    if layout == "fused" or compile_layerwise:
      t0 = time.perf_counter()
      hlo = compiled_collectives(layout_tx, tree, mesh)
      entry.update(hlo=hlo, compile_s=time.perf_counter() - t0)
      entry.update(agree=hlo == traced_bytes, source="hlo", per_kind=hlo)
    else:
      entry.update(hlo=None, agree=None, source="traced", per_kind=traced_bytes)
    entry["bytes"] = sum(entry["per_kind"].values())
    entry["ring_bytes"] = ring_bytes(entry["per_kind"], workers)
    row[layout] = entry
  return row


def run(
  models: Sequence[str] = MODELS,
  compressors: str | Sequence[str] | None = None,
  workers: int = 8,
  out_dir: str = "bench_out/",
  compile_layerwise: bool = False,
) -> dict[str, Any]:
  """Wire bytes per step for every model x compressor x layout; writes JSON and PNG."""
  names = select(compressors)
  trees = {model: model_tree(model) for model in check_models(models)}
  if workers < 2 or workers > jax.device_count():
    raise ValueError(
      f"workers must be in [2, {jax.device_count()}] (the devices; on CPU set "
      f"jax_num_cpu_devices before JAX starts), got {workers}"
    )
  mesh = jax.make_mesh((workers,), (AXIS,))
  result: dict[str, Any] = {
    "backend": backend_name(workers),
    "machine": machine_info(),
    "workers": workers,
    "dense": "fp32 all-reduce of all parameters: 4 bytes x parameters",
    "models": {},
  }
  for model, tree in trees.items():
    values = sum(x.size for x in tree.values())
    dense = 4 * values
    dense_ring = ring_bytes({"all-reduce": dense}, workers)
    rows = []
    for name in names:
      row = measure(name, tree, mesh, compile_layerwise=compile_layerwise)
      for layout in LAYOUTS:
        entry = row[layout]
        entry["fraction"] = entry["bytes"] / dense
        entry["ring_fraction"] = entry["ring_bytes"] / dense_ring
      rows.append(row)
      print(
        f"{model} {name}: layer-wise {row['layerwise']['bytes']:,} B, "
        f"fused {row['fused']['bytes']:,} B "
        f"(compile {row['fused'].get('compile_s', 0):.0f} s)",
        flush=True,
      )
    result["models"][model] = {
      "tensors": len(tree),
      "values": values,
      "dense_bytes": dense,
      "dense_ring_bytes": dense_ring,
      "rows": rows,
    }
  write_json(out_dir, "wire.json", result)
  plot(result, os.path.join(out_dir, "wire.png"))
  print(format_table(result))
  return result


def plot(result: dict[str, Any], path: str) -> str:
  panels = {}
  for model, m in result["models"].items():
    categories = [r["compressor"] for r in m["rows"]]
    series = {
      _LAYOUT_NAMES[layout]: [r[layout]["fraction"] for r in m["rows"]]
      for layout in LAYOUTS
    }
    panels[f"{model}: {m['tensors']} tensors, {m['values']:,} values"] = (
      categories,
      series,
    )
  return grouped_bar_plot(
    path,
    panels,
    ylabel="bytes sent / dense fp32",
    title=(
      f"Bytes per step on the wire, per worker, {result['workers']} workers "
      "(operand bytes of the step's collectives)"
    ),
    logy=True,
  )


def format_table(result: dict[str, Any]) -> str:
  n = result["workers"]
  lines = [
    f"Bytes one worker sends per step on {result['backend']}: operand bytes of "
    "the step's collectives, as a fraction of dense (fp32 all-reduce of all "
    f"parameters); 'ring' is the traffic of a ring at {n} workers over dense's. "
    "Sources: fused from the compiled HLO; layer-wise from the traced step "
    "(marked †) unless compiled.",
    "",
    "| model | compressor | layer-wise bytes | of dense | fused bytes | of dense "
    "| fused / layer-wise | collectives traced (layer-wise / fused) | ring, layer-wise "
    "| ring, fused |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  checks = []
  for model, m in result["models"].items():
    for r in m["rows"]:
      lw, fu = r["layerwise"], r["fused"]
      mark = " †" if lw["source"] == "traced" else ""
      ratio = fu["bytes"] / lw["bytes"] if lw["bytes"] else float("nan")
      lines.append(
        f"| {model} | {r['compressor']} | {lw['bytes']:,}{mark} "
        f"| {lw['fraction']:.4f} | {fu['bytes']:,} | {fu['fraction']:.4f} "
        f"| {ratio:.3f} | {lw['collectives']} / {fu['collectives']} "
        f"| {lw['ring_fraction']:.4f} | {fu['ring_fraction']:.4f} |"
      )
      checks += [e["agree"] for e in (lw, fu) if e["agree"] is not None]
  if checks:
    lines.append(
      f"\ntraced == compiled HLO (per collective kind) for {sum(checks)} of "
      f"{len(checks)} compiled steps."
    )
  return "\n".join(lines)
