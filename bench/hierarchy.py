r"""Exchanges on a fast axis and a slow one: bytes per axis, measured and simulated.

``python -m bench hierarchy [--models resnet50,gpt2_small]
[--nodes 4,8,16,48,64] [--out bench_out/hierarchy/]``

DESIGN §7. Each model's gradient is one fused float32 buffer (what
``layerfusion(..., "single")`` sends). Each exchange of :data:`EXCHANGES`
runs under ``shard_map``:

* **Measured** on the 8 virtual devices as a ``(2, 4)`` mesh ``("node",
  "local")`` and as a flat ``(8,)`` mesh: the compiled HLO's collectives
  (``gradcomp.axis_wire``), their operand bytes and ring link bytes per
  mesh axis. Flat exchanges run over all devices (``("node", "local")`` on
  the two-axis mesh); hierarchical ones reduce-scatter over ``"local"`` and
  compress over ``"node"``; qgZ runs its two hops.
* **Simulated** on described two-tier clusters of ``N`` nodes x 8 GPUs
  (:data:`NODES`), 900 GB/s inside a node and 100 or 25 Gbit/s between
  nodes (:data:`INTER_GBPS`): the same exchanges traced on an abstract
  ``(N, 8)`` mesh (``traced_axis_wire``: no devices; on ``(2, 4)`` it equals
  the HLO's records, which the result checks), each collective priced on its
  link class (``Cluster.axis_seconds``: rings, one after another, not
  overlapped with compute), beside a described compute time per step
  (:data:`COMPUTE`). A collective over both axes is priced on the slow link:
  a ring across nodes goes at the speed of its slowest hop.

The result sets the simulated figures beside ZeRO++'s (Wang et al. 2023,
arXiv 2306.10209): 4x less cross-node volume (qwZ + hpZ + qgZ together;
qgZ alone replaces ZeRO-3's fp16 gradient reduce-scatter by int4) and up to
2.16x throughput at 384 GPUs on a low-bandwidth cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from bench import output
from gradcomp.models import shapes
from gradcomp.parallel import traced, wire

FAST, SLOW = "local", "node"
BOTH = (SLOW, FAST)
#: Nodes of the simulated clusters; 48 x 8 = 384 GPUs is ZeRO++'s largest run.
NODES = (4, 8, 16, 48, 64)
GPUS_PER_NODE = 8
INTRA_GBPS = 900 * 8  # 900 GB/s: NVLink 4 inside an H100 node.
INTRA_LATENCY_US = 5.0
INTER_GBPS = (100.0, 25.0)
INTER_LATENCY_US = 25.0
TOPK_RATIO = 0.01
#: Described compute per step on one GPU: training FLOPs (6 x params x tokens
#: for GPT-2 small: 8 sequences of 1,024 tokens; 3 x forward for ResNet-50:
#: 64 images of 224 x 224 at 4.1 GFLOPs each) at 150 TFLOP/s sustained.
GPU_FLOPS = 150e12
COMPUTE = {
  "gpt2_small": 6 * 124_439_808 * 8 * 1024 / GPU_FLOPS,
  "resnet50": 3 * 4.1e9 * 64 / GPU_FLOPS,
}
#: ZeRO++'s published figures (arXiv 2306.10209, abstract and §6).
ZEROPP = {"cross_node_volume_reduction": 4.0, "throughput_at_384_gpus": 2.16}


class Exchange(NamedTuple):
  """One way to exchange the gradient: ``build(axes)`` gives the compressor.

  ``flat``: it runs over one group of every device (``axes`` the mesh's
  axes); otherwise it needs a fast and a slow axis.
  """

  label: str
  build: Callable[[tuple[str, ...]], Any]
  flat: bool
  why: str


def _hier(inner: Callable[[str], Any]) -> Callable[[tuple[str, ...]], Any]:
  return lambda axes: gradcomp.hierarchical(inner(SLOW), FAST)


EXCHANGES: dict[str, Exchange] = {
  e.label: e
  for e in (
    Exchange("dense", lambda a: gradcomp.none(axis_name=a), True, "fp32 all-reduce"),
    Exchange(
      "topk",
      lambda a: gradcomp.topk(TOPK_RATIO, axis_name=a),
      True,
      "top-k 1 %, all-gathered",
    ),
    Exchange(
      "ef_sign",
      lambda a: gradcomp.ef_signsgd(axis_name=a),
      True,
      "EF-signSGD, all-gathered bits",
    ),
    Exchange(
      "int4",
      lambda a: gradcomp.int_quantize(4, axis_name=a),
      True,
      "block int4, all-gathered codes",
    ),
    Exchange(
      "ef_sign_scatter",
      lambda a: gradcomp.ef_signsgd(axis_name=a, exchange="scatter"),
      True,
      "EF-signSGD, reduce-scatter form (all-to-all, re-encode, all-gather)",
    ),
    Exchange(
      "int4_scatter",
      lambda a: gradcomp.int_quantize(4, axis_name=a, exchange="scatter"),
      True,
      "block int4, reduce-scatter form",
    ),
    Exchange(
      "hier_dense",
      _hier(lambda s: gradcomp.none(axis_name=s)),
      False,
      "Horovod's hierarchical all-reduce: dense inside and across",
    ),
    Exchange(
      "hier_topk",
      _hier(lambda s: gradcomp.topk(TOPK_RATIO, axis_name=s)),
      False,
      "dense reduce-scatter inside the node, top-k 1 % of the shard across",
    ),
    Exchange(
      "hier_sign",
      _hier(lambda s: gradcomp.ef_signsgd(axis_name=s)),
      False,
      "dense reduce-scatter inside, EF-signSGD of the shard across",
    ),
    Exchange(
      "hier_int4",
      _hier(lambda s: gradcomp.int_quantize(4, axis_name=s, exchange="scatter")),
      False,
      "dense reduce-scatter inside, int4 reduce-scatter form across",
    ),
    Exchange(
      "qgz",
      lambda a: gradcomp.qgz(axis_name=(FAST, SLOW)),
      False,
      "ZeRO++ qgZ: int4 all-to-all inside, requantize, int4 all-to-all across",
    ),
  )
}
DEFAULT_MODELS = ("resnet50", "gpt2_small")


def check(models: Sequence[str], nodes: Sequence[int], exchanges: Sequence[str]):
  """The arguments validated: known models and exchanges, node counts >= 2."""
  unknown = [m for m in models if m not in shapes.MODELS]
  if unknown or not models:
    raise ValueError(f"unknown models {unknown}; valid: {', '.join(shapes.MODELS)}")
  bad = [n for n in nodes if isinstance(n, bool) or not isinstance(n, int) or n < 2]
  if bad or not nodes:
    raise ValueError(f"nodes must be integers >= 2, got {list(nodes)}")
  unknown = [e for e in exchanges if e not in EXCHANGES]
  if unknown or "dense" not in exchanges:
    raise ValueError(
      f"exchanges must include 'dense' and be among {', '.join(EXCHANGES)}, "
      f"got {list(exchanges)}"
    )


def _program(tx, mesh, size: int):
  """The exchange of one fused buffer of ``size`` values per device, and its argument.

  The state is made inside ``shard_map`` from the buffer's shape (a fresh
  run's first step), so the program holds the exchange alone.
  """
  axes = tuple(mesh.axis_names)
  spec = P(axes)

  def step(g):
    g = g[0]
    return tx.update(g, tx.init(jax.ShapeDtypeStruct(g.shape, g.dtype)))[0][None]

  f = jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec)
  devices = 1
  for s in mesh.axis_sizes:
    devices *= s
  arg = jax.ShapeDtypeStruct(
    (devices, size), jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  return f, arg


def _per_axis(records) -> dict[str, dict[str, float]]:
  """``{axes label: {"operand", "link"}}``: ``"node+local"`` for both."""
  return {
    ("+".join(axes) if axes else "none"): totals
    for axes, totals in wire.bytes_by_axes(records).items()
  }


def measure(label: str, size: int) -> dict[str, Any]:
  """The exchange's compiled collectives on the (2, 4) mesh and (if flat) on (8,)."""
  exchange = EXCHANGES[label]
  out: dict[str, Any] = {"label": label, "why": exchange.why}
  two = jax.make_mesh((2, 4), BOTH)
  meshes = {"2x4": two}
  if exchange.flat:
    meshes["8"] = jax.make_mesh((8,), ("data",))
  for name, mesh in meshes.items():
    axes = tuple(mesh.axis_names)
    f, arg = _program(exchange.build(axes), mesh, size)
    t0 = time.perf_counter()
    text = jax.jit(f).lower(arg).compile().as_text()
    records = wire.collectives(text, mesh)
    entry = {"per_axis": _per_axis(records), "compile_s": time.perf_counter() - t0}
    if name == "2x4":  # The traced records the simulation uses, checked.
      abstract = AbstractMesh((2, 4), BOTH)
      tf, targ = _program(exchange.build(BOTH), abstract, size)
      key = lambda r: (r.kind, r.axes, r.operand_bytes)
      got = sorted(map(key, traced.traced_axis_wire(tf, targ, mesh=abstract)))
      entry["traced_agrees"] = got == sorted(map(key, records))
    out[name] = entry
  return out


def simulate(label: str, size: int, model: str, nodes: int) -> dict[str, Any]:
  """The exchange traced on ``nodes`` x 8 devices, priced per link class."""
  exchange = EXCHANGES[label]
  mesh = AbstractMesh((nodes, GPUS_PER_NODE), BOTH)
  f, arg = _program(exchange.build(BOTH), mesh, size)
  records = traced.traced_axis_wire(f, arg, mesh=mesh)
  row: dict[str, Any] = {"per_axis": _per_axis(records), "seconds": {}}
  for gbps in INTER_GBPS:
    cluster = gradcomp.sim.Cluster(
      nodes * GPUS_PER_NODE,
      bandwidth_gbps=gbps,
      latency_us=INTER_LATENCY_US,
      intra_bandwidth_gbps=INTRA_GBPS,
      intra_latency_us=INTRA_LATENCY_US,
    )
    comm = cluster.axis_seconds(records, fast_axes=(FAST,))
    row["seconds"][str(gbps)] = {"comm": comm, "step": COMPUTE[model] + comm}
  return row


def cross_node(per_axis: dict[str, dict[str, float]]) -> float:
  """Link bytes of the collectives that cross nodes (any group naming ``node``)."""
  return sum(v["link"] for k, v in per_axis.items() if SLOW in k.split("+"))


def run(
  models: Sequence[str] = DEFAULT_MODELS,
  nodes: Sequence[int] = NODES,
  exchanges: Sequence[str] = tuple(EXCHANGES),
  out_dir: str = "bench_out/hierarchy/",
  sizes: dict[str, int] | None = None,
) -> dict[str, Any]:
  """Measures and simulates every exchange; writes ``hierarchy.{json,md}``.

  ``sizes`` overrides a model's buffer size (tests use small ones).
  """
  models, nodes, exchanges = tuple(models), tuple(nodes), tuple(exchanges)
  check(models, nodes, exchanges)
  start = time.perf_counter()
  result: dict[str, Any] = {
    "devices": jax.device_count(),
    "nodes": list(nodes),
    "gpus_per_node": GPUS_PER_NODE,
    "intra_gbps": INTRA_GBPS,
    "inter_gbps": list(INTER_GBPS),
    "compute_seconds": {m: COMPUTE.get(m) for m in models},
    "zeropp": ZEROPP,
    "models": {},
  }
  for model in models:
    size = (sizes or {}).get(model) or shapes.total_size(shapes.MODELS[model]())
    rows = {}
    for label in exchanges:
      row = measure(label, size)
      row["simulated"] = {str(n): simulate(label, size, model, n) for n in nodes}
      rows[label] = row
      print(f"# hierarchy: {model} {label}: {_summary(row)}", flush=True)
    result["models"][model] = {"size": size, "exchanges": rows}
  result["wall_s"] = time.perf_counter() - start
  output.publish(out_dir, "hierarchy", result, format_table(result), _plot)
  return result


def _summary(row) -> str:
  two = row["2x4"]["per_axis"]
  return ", ".join(f"{k} {v['link']:,.0f} link B" for k, v in sorted(two.items()))


def _plot(result, path):
  """Simulated step time against GPUs, one panel per model and bandwidth."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(result["models"])
  fig, axes = plt.subplots(
    len(models), len(result["inter_gbps"]), figsize=(11, 4 * len(models)), squeeze=False
  )
  for i, model in enumerate(models):
    rows = result["models"][model]["exchanges"]
    for j, gbps in enumerate(result["inter_gbps"]):
      ax = axes[i][j]
      for label, row in rows.items():
        sim = row["simulated"]
        xs = [int(n) * result["gpus_per_node"] for n in sim]
        ys = [sim[n]["seconds"][str(gbps)]["step"] for n in sim]
        ax.plot(xs, ys, marker="o", label=label)
      ax.set(
        xscale="log",
        yscale="log",
        xlabel="GPUs",
        ylabel="simulated step (s)",
        title=f"{model}, {gbps:g} Gbit/s between nodes",
      )
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def format_table(result: dict[str, Any]) -> str:
  """Markdown: measured bytes per axis on (2, 4); simulated step times; ZeRO++."""
  lines = [
    "Measured: compiled HLO on 8 virtual devices, one fused float32 buffer; "
    "operand / ring link bytes per device, by the mesh axes of each "
    "collective (`node+local`: one group of all 8).",
    "",
  ]
  for model, entry in result["models"].items():
    rows = entry["exchanges"]
    dense = rows["dense"]
    lines += [
      f"### {model} ({entry['size']:,} values)",
      "",
      "| exchange | local (fast) link B | crossing nodes, link B | vs dense | "
      "flat (8,) link B | traced = HLO |",
      "| --- | ---: | ---: | ---: | ---: | :-: |",
    ]
    base = cross_node(dense["2x4"]["per_axis"])
    for label, row in rows.items():
      per_axis = row["2x4"]["per_axis"]
      fast = per_axis.get(FAST, {}).get("link", 0.0)
      slow = cross_node(per_axis)
      flat = row.get("8", {}).get("per_axis")
      flat_link = sum(v["link"] for v in flat.values()) if flat else None
      lines.append(
        f"| {label} | {fast:,.0f} | {slow:,.0f} | {slow / base:.4f} | "
        + (f"{flat_link:,.0f}" if flat_link is not None else "-")
        + f" | {'yes' if row['2x4']['traced_agrees'] else 'NO'} |"
      )
    lines += [
      "",
      "Simulated step time (s): compute "
      f"{result['compute_seconds'][model] or 0:.4f} s + exchange, "
      "N nodes x 8 GPUs.",
      "",
    ]
    for gbps in result["inter_gbps"]:
      header = " | ".join(f"{n} x 8" for n in result["nodes"])
      lines += [
        f"{gbps:g} Gbit/s between nodes:",
        "",
        f"| exchange | {header} | speed-up vs dense at {result['nodes'][-1]} x 8 |",
        "| --- | " + " | ".join("---:" for _ in result["nodes"]) + " | ---: |",
      ]
      last = str(result["nodes"][-1])
      dense_last = dense["simulated"][last]["seconds"][str(gbps)]["step"]
      for label, row in rows.items():
        cells = " | ".join(
          f"{row['simulated'][str(n)]['seconds'][str(gbps)]['step']:.4f}"
          for n in result["nodes"]
        )
        mine = row["simulated"][last]["seconds"][str(gbps)]["step"]
        lines.append(f"| {label} | {cells} | {dense_last / mine:.2f}x |")
      lines.append("")
  lines.append(
    f"ZeRO++ (arXiv 2306.10209): {ZEROPP['cross_node_volume_reduction']:g}x less "
    f"cross-node volume, up to {ZEROPP['throughput_at_384_gpus']:g}x throughput at "
    "384 GPUs."
  )
  return "\n".join(lines)
