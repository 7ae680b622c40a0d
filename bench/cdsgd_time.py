"""Paper 001's Table 2 and Fig. 10, simulated: CD-SGD's epoch time and speedup.

Paper 001 §4.1, §4.3 (Table 2) and §4.4 (Fig. 10) measure MXNet 1.4.1 on two
4-node clusters joined by 56 Gbit/s InfiniBand, 4 GPUs a node (two dual-GPU
K80 boards, or four V100s), 32 images per GPU. This module prices the same
runs with :mod:`gradcomp.sim.delayed` (paper 001 eqs. 2, 4, 5, 6-7) on a
described :class:`~gradcomp.sim.cluster.Cluster`, from the library's own
pieces, and puts the result next to the paper's numbers. Nothing is trained
and nothing is timed on this machine.

**What is derived, not fitted.**

* Compute: ``tau`` = one GPU's training FLOPs per step
  (:func:`~gradcomp.sim.clock.training_flops`: 3 x the forward FLOPs that
  :func:`gradcomp.models.shapes.forward_flops` reads off the flax model, x
  the per-GPU batch) at the GPU's effective FLOP/s. A node's 4 GPUs work in
  parallel; the node is one worker of the cluster. Combining the 4 GPUs'
  gradients inside a node (PCIe) is not modelled: it is inside the
  calibrated ``tau``.
* Full-precision wire: 4 bytes per parameter, one message per parameter
  array (MXNet's KVStore pushes and pulls every array as its own key).
* 2-bit wire: what :func:`gradcomp.threshold_quantize` sends, *traced* from
  the program (:func:`gradcomp.parallel.traced.traced_collectives` on the
  model's gradient tree): one all-gather per array of ``ceil(d / 4)`` bytes
  (2 bits per value, packed), 67,431 bytes in 59 messages for ResNet-20.
* Links: the Cluster's ``"parameter_server"`` alpha-beta price, 56 Gbit/s
  (§4.1), alpha = the Cluster's default 25 us per message (the paper gives no
  latency; not fitted). MXNet's launcher starts one server per node and
  spreads the keys over them, so ``servers = nodes`` servers work in
  parallel, each on ``1 / servers`` of the bytes: priced as one server of the
  Cluster's model on ``bytes / servers`` (each worker still pays alpha twice
  per message). ``servers=1`` gives the Cluster's single-server price. The
  compressed exchange is gradcomp's (all codes gathered by every worker,
  ``(n + n^2) B`` through a server), not MXNet's (2-bit push, 32-bit pull).
* ``delta``: the single-pass memory-traffic floor of ``threshold_quantize``
  (``bench.compress``: 16.25 bytes per value: read gradient and residual,
  write residual, output and codes) at the GPU's memory bandwidth: a lower
  bound, with no kernel-launch cost. It matters only to BIT-SGD here (CD-SGD
  hides it when compute-bound): each extra millisecond of ``delta`` adds
  ``steps_per_epoch`` ms to BIT-SGD's epoch.

**What is calibrated: one number.** The K80's effective FLOP/s is set so
that CD-SGD k=5 on 4 nodes takes the paper's 1.78 s an epoch, checked to be
compute-bound in the model (then the epoch is ``steps x tau``); every other
Table 2 entry is a prediction. The V100 is taken to reach the same fraction
of its fp32 peak (15.7 TFLOP/s) as the calibrated K80 of its own (4.37
TFLOP/s per GK210 at boost clock): an assumption, no V100 number of the
paper being legible. The tables also show a second reading, ``"V100
(ResNet-50 rate)"``: NVIDIA's published fp32 ResNet-50 training rate (8.76
TFLOP/s, :func:`bench.paper.v100_tflops`), which puts the small
models' steps on the exchange-bound side. Fig. 10's AlexNet and Inception-bn have no model in
:mod:`gradcomp.models`; its VGG-16 is the CIFAR variant the library has.

An epoch is ``50,000 / (nodes x 4 x batch)`` steps (fractional) at the
steady step of :func:`~gradcomp.sim.delayed.steady_step_seconds`; warm-up
is not counted (§3.2.1: "it takes little time usually").
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import gradcomp
from bench.compress import COMPRESSORS
from bench.paper import V100_FP32_PEAK_TFLOPS, V100_HBM_GBPS, v100_tflops
from gradcomp.models import shapes
from gradcomp.parallel.traced import traced_collectives
from gradcomp.sim.clock import training_flops
from gradcomp.sim.cluster import Cluster
from gradcomp.sim.delayed import steady_step_seconds

#: Paper 001 Table 2: average epoch wall-clock time (s) of ResNet-20 on
#: CIFAR-10, K80 cluster, by nodes (4 GPUs each) and method.
PAPER_TABLE2 = {
  4: {
    "S-SGD": 2.24,
    "BIT-SGD": 2.22,
    "CD-SGD k=2": 1.79,
    "CD-SGD k=5": 1.78,
    "CD-SGD k=10": 1.78,
    "CD-SGD k=20": 1.76,
  },
  2: {
    "S-SGD": 4.32,
    "BIT-SGD": 3.61,
    "CD-SGD k=2": 3.48,
    "CD-SGD k=5": 3.44,
    "CD-SGD k=10": 3.46,
    "CD-SGD k=20": 3.44,
  },
}
#: Paper 001 §4.4: CD-SGD (k=5) speedups over S-SGD stated in the text for
#: Fig. 10 (4 nodes), four models each in the figure's order (not legible
#: here, so not matched to models); for reference only.
PAPER_FIG10_CD_SPEEDUPS = {
  "K80, 32/GPU": (0.00, 0.43, 0.33, 0.32),
  "V100, 32/GPU": (0.24, 0.43, 0.39, 0.44),
  "V100, 64/GPU": (0.28, 0.35, 0.71, 0.89),
  "V100, 128/GPU": (0.03, 0.45, 0.02, 0.89),
}
#: The Table 2 entry the K80's effective FLOP/s is calibrated to.
CALIBRATION = (4, "CD-SGD k=5")

CIFAR10_TRAIN_IMAGES = 50_000  # §4.1
GPUS_PER_NODE = 4  # §4.1: two dual-GPU K80 boards, or four V100s, a node
BATCH_PER_GPU = 32  # §4.2, Table 2, Fig. 10a-b
BANDWIDTH_GBPS = 56.0  # §4.1: 56 Gbit/s InfiniBand
TABLE2_KS = (2, 5, 10, 20)
FIG10_K = 5  # Fig. 10 caption
FIG10_BATCHES = (32, 64, 128)
FIG10_MODELS = ("resnet20", "vgg16", "resnet50")
#: The paper's 2-bit threshold (§4.2); it does not change the wire.
THRESHOLD = 0.5

#: One K80 GPU (a GK210, half a board): 2,496 CUDA cores x 2 FLOP x 875 MHz
#: boost, and 240 GB/s (NVIDIA Tesla K80 datasheet: 8.73 TFLOP/s fp32 and
#: 480 GB/s per board of two).
K80_FP32_PEAK_TFLOPS = 2496 * 2 * 0.875e9 / 1e12
K80_MEMORY_GBPS = 240.0
#: The GPUs priced: fp32 peak TFLOP/s and memory GB/s. ``"V100"`` runs at the
#: calibrated K80's fraction of its peak; ``"V100 (ResNet-50 rate)"`` at
#: :func:`bench.paper.v100_tflops` (NVIDIA's published fp32
#: ResNet-50 training throughput of one V100, 8.76 TFLOP/s): two readings of
#: an unknown, shown side by side.
GPUS = {
  "K80": (K80_FP32_PEAK_TFLOPS, K80_MEMORY_GBPS),
  "V100": (V100_FP32_PEAK_TFLOPS, V100_HBM_GBPS),
  "V100 (ResNet-50 rate)": (V100_FP32_PEAK_TFLOPS, V100_HBM_GBPS),
}

_AXIS = "cdsgd_time"


@dataclasses.dataclass(frozen=True)
class ModelCost:
  """What the time model needs of a model (per sample / per worker).

  Attributes:
    values: parameters (gradient values).
    arrays: parameter arrays (MXNet keys: messages per exchange).
    forward_flops: forward FLOPs of one sample (``shapes.forward_flops``).
    compressed_bytes: bytes one worker contributes to ``threshold_quantize``'s
      all-gather, traced from the program.
    compressed_messages: its collectives (one per array).
  """

  values: int
  arrays: int
  forward_flops: float
  compressed_bytes: int
  compressed_messages: int


@functools.cache
def model_cost(model: str) -> ModelCost:
  """:class:`ModelCost` of a ``gradcomp.models.shapes.MODELS`` key (cached)."""
  named = shapes.MODELS[model]()
  tree = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in named}
  tx = gradcomp.threshold_quantize(THRESHOLD, axis_name=_AXIS)
  wire = traced_collectives(tx, tree, _AXIS, 2)
  if set(wire) != {"all-gather"}:
    raise AssertionError(f"threshold_quantize's wire changed: {wire}")
  nbytes, messages = wire["all-gather"]
  return ModelCost(
    values=sum(math.prod(shape) for _, shape in named),
    arrays=len(named),
    forward_flops=float(sum(shapes.forward_flops(model))),
    compressed_bytes=int(nbytes),
    compressed_messages=int(messages),
  )


def _cluster(nodes: int, flops_per_second: float = 1.0) -> Cluster:
  return Cluster(
    nodes,
    bandwidth_gbps=BANDWIDTH_GBPS,
    topology="parameter_server",
    flops_per_second=flops_per_second,
  )


def exchange_seconds(
  model: str, *, nodes: int, gpu: str, servers: int | None = None
) -> dict[str, float]:
  """``phi``, ``psi`` and ``delta`` of one step, seconds (see the module docstring).

  Args:
    model: a ``shapes.MODELS`` key.
    nodes: workers of the cluster (4 GPUs each).
    gpu: ``"K80"`` or ``"V100"`` (its memory bandwidth prices ``delta``).
    servers: parameter servers sharing the keys; default one per node.
  """
  cost = model_cost(model)
  servers = nodes if servers is None else servers
  if servers < 1:
    raise ValueError(f"servers must be >= 1, got {servers!r}")
  cluster = _cluster(nodes)
  phi = cluster.comm_seconds({"all-reduce": (4 * cost.values / servers, cost.arrays)})
  psi = cluster.comm_seconds(
    {"all-gather": (cost.compressed_bytes / servers, cost.compressed_messages)}
  )
  (floor,) = [c.floor for c in COMPRESSORS if c.label == "threshold_quantize"]
  delta = floor.bytes(cost.values) / (GPUS[gpu][1] * 1e9)
  return {"phi": float(phi), "psi": float(psi), "delta": float(delta)}


def steps_per_epoch(nodes: int, batch_per_gpu: int = BATCH_PER_GPU) -> float:
  """CIFAR-10 steps per epoch: 50,000 / (nodes x 4 GPUs x batch), unrounded."""
  return CIFAR10_TRAIN_IMAGES / (nodes * GPUS_PER_NODE * batch_per_gpu)


@functools.cache
def effective_flops_per_second(gpu: str) -> float:
  """A GPU's effective training FLOP/s: calibrated on Table 2 (see the module).

  K80: ``tau`` of ResNet-20 at 32 images such that CD-SGD k=5 on 4 nodes
  takes the paper's 1.78 s an epoch; the model must find that run
  compute-bound (``phi`` and ``delta + psi`` <= ``tau``), else it raises.
  ``"V100"``: the same fraction of its fp32 peak. ``"V100 (ResNet-50
  rate)"``: :func:`bench.paper.v100_tflops`.
  """
  nodes, method = CALIBRATION
  tau = PAPER_TABLE2[nodes][method] / steps_per_epoch(nodes)
  times = exchange_seconds("resnet20", nodes=nodes, gpu="K80")
  if max(times["phi"], times["delta"] + times["psi"]) > tau:
    raise AssertionError(f"the calibration run is not compute-bound: {times}, {tau=}")
  k80 = training_flops(model_cost("resnet20").forward_flops, BATCH_PER_GPU) / tau
  if gpu not in GPUS:
    raise ValueError(f"gpu must be one of {tuple(GPUS)}, got {gpu!r}")
  if gpu == "V100 (ResNet-50 rate)":
    return v100_tflops() * 1e12
  return k80 * GPUS[gpu][0] / K80_FP32_PEAK_TFLOPS


def step_times(
  model: str, *, gpu: str, nodes: int, batch_per_gpu: int, servers: int | None = None
) -> dict[str, float]:
  """``tau``, ``phi``, ``psi``, ``delta`` of one step, seconds."""
  cluster = _cluster(nodes, effective_flops_per_second(gpu))
  flops = training_flops(model_cost(model).forward_flops, batch_per_gpu)
  tau = float(cluster.compute_seconds(flops, 1).max())
  return {"tau": tau, **exchange_seconds(model, nodes=nodes, gpu=gpu, servers=servers)}


def _method(label: str) -> tuple[str, int]:
  if label.startswith("CD-SGD k="):
    return "cdsgd", int(label.removeprefix("CD-SGD k="))
  return {"S-SGD": "ssgd", "BIT-SGD": "bitsgd", "OD-SGD": "odsgd"}[label], 1


def _bound(method: str, k: int, t: Mapping[str, float]) -> str:
  """Which side sets an overlapped step: ``compute``, ``exchange`` or ``mixed``."""
  if method in ("ssgd", "bitsgd"):
    return "-"  # nothing overlaps
  hidden = [t["phi"]] + ([t["delta"] + t["psi"]] if method == "cdsgd" and k > 1 else [])
  if max(hidden) <= t["tau"]:
    return "compute"
  return "exchange" if min(hidden) >= t["tau"] else "mixed"


def _price(label: str, t: Mapping[str, float]) -> float:
  method, k = _method(label)
  return steady_step_seconds(
    method, tau=t["tau"], phi=t["phi"], psi=t["psi"], delta=t["delta"], k=k
  )


def table2_rows(gpus: Sequence[str] = tuple(GPUS)) -> list[dict[str, Any]]:
  """Table 2, simulated: ResNet-20 epoch time by GPU, nodes and method.

  Returns:
    One dict per (gpu, nodes, method): ``gpu``, ``nodes``, ``method``,
    ``tau_ms``, ``phi_ms``, ``psi_ms``, ``delta_ms``, ``step_ms``,
    ``epoch_s``, ``bound``, ``paper_s`` and ``ratio`` (predicted / paper;
    ``None`` without a paper number) and ``calibrated`` (the one fitted
    entry).
  """
  labels = ["S-SGD", "BIT-SGD", *(f"CD-SGD k={k}" for k in TABLE2_KS)]
  rows = []
  for gpu in gpus:
    for nodes in (4, 2):
      t = step_times("resnet20", gpu=gpu, nodes=nodes, batch_per_gpu=BATCH_PER_GPU)
      for label in labels:
        step = _price(label, t)
        epoch = step * steps_per_epoch(nodes)
        paper = PAPER_TABLE2[nodes][label] if gpu == "K80" else None
        rows.append(
          {
            "gpu": gpu,
            "nodes": nodes,
            "method": label,
            **{f"{name}_ms": 1e3 * v for name, v in t.items()},
            "step_ms": 1e3 * step,
            "epoch_s": epoch,
            "bound": _bound(*_method(label), t),
            "paper_s": paper,
            "ratio": None if paper is None else epoch / paper,
            "calibrated": gpu == "K80" and (nodes, label) == CALIBRATION,
          }
        )
  return rows


def fig10_rows(
  models: Sequence[str] = FIG10_MODELS,
  batches: Sequence[int] = FIG10_BATCHES,
  *,
  gpus: Sequence[str] = ("V100", "V100 (ResNet-50 rate)"),
  nodes: int = 4,
  k: int = FIG10_K,
) -> list[dict[str, Any]]:
  """Fig. 10, simulated: speedup over S-SGD by model and per-GPU batch.

  Returns:
    One dict per (gpu, model, batch): ``gpu``, ``nodes``, ``model``,
    ``batch``, the
    step's ``tau_ms``, ``phi_ms``, ``psi_ms``, ``delta_ms``, ``ssgd_ms`` and
    the speedups
    ``T_ssgd / T_method`` of ``BIT-SGD``, ``OD-SGD`` and ``CD-SGD k=<k>``,
    and ``bound`` (CD-SGD's).
  """
  rows = []
  for gpu, model, batch in itertools.product(gpus, models, batches):
    t = step_times(model, gpu=gpu, nodes=nodes, batch_per_gpu=batch)
    ssgd = _price("S-SGD", t)
    row = {
      "gpu": gpu,
      "nodes": nodes,
      "model": model,
      "batch": batch,
      **{f"{name}_ms": 1e3 * v for name, v in t.items()},
      "ssgd_ms": 1e3 * ssgd,
    }
    for label in ("BIT-SGD", "OD-SGD", f"CD-SGD k={k}"):
      row[label] = ssgd / _price(label, t)
    row["bound"] = _bound("cdsgd", k, t)
    rows.append(row)
  return rows


def table2_claims(table2: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Paper 001's Table 2 claims, checked on :func:`table2_rows`.

  * §4.3 / abstract: CD-SGD faster than S-SGD on the K80 cluster, by about
    20 % (Table 2: 1 - 1.78 / 2.24 = 20.5 % less time on 4 nodes, 20.4 % on
    2): two claims, faster at all, and a saving within 5 percentage points of
    the paper's own;
  * §4.3: "k has no effect on training speed because computing is the
    bottleneck on K80": CD-SGD's K80 rows compute-bound with one epoch time.

  Returns:
    Dicts with ``claim``, ``holds`` (bool) and ``detail``.
  """
  out = []
  k80 = [r for r in table2 if r["gpu"] == "K80"]
  for nodes in sorted({r["nodes"] for r in k80}, reverse=True):
    by = {r["method"]: r for r in k80 if r["nodes"] == nodes}
    model = 1 - by["CD-SGD k=5"]["epoch_s"] / by["S-SGD"]["epoch_s"]
    paper = 1 - PAPER_TABLE2[nodes]["CD-SGD k=5"] / PAPER_TABLE2[nodes]["S-SGD"]
    # The exchange S-SGD pays and CD-SGD hides, per step, in the paper.
    gap = PAPER_TABLE2[nodes]["S-SGD"] - PAPER_TABLE2[nodes]["CD-SGD k=5"]
    implied = gap / steps_per_epoch(nodes)
    cd = [r for r in by.values() if r["method"].startswith("CD-SGD")]
    spread = max(r["epoch_s"] for r in cd) - min(r["epoch_s"] for r in cd)
    out += [
      {
        "claim": f"CD-SGD k=5 faster than S-SGD (K80, {nodes} nodes)",
        "holds": model > 0,
        "detail": f"model {100 * model:.1f}% less time",
      },
      {
        "claim": f"... by about 20%, within 5 points of the paper (K80, {nodes} nodes)",
        "holds": abs(model - paper) <= 0.05,
        "detail": f"model {100 * model:.1f}%, paper {100 * paper:.1f}%; the "
        f"paper's S-SGD - CD-SGD gap is {1e3 * implied:.2f} ms a step, the "
        f"model's phi {by['S-SGD']['phi_ms']:.2f} ms",
      },
      {
        "claim": f"epoch time independent of k, compute-bound (K80, {nodes} nodes)",
        "holds": all(r["bound"] == "compute" for r in cd) and spread == 0.0,
        "detail": f"bounds {sorted({r['bound'] for r in cd})}, spread {spread:.3g} s",
      },
    ]
  return out


def fig10_claims(fig10: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Paper 001 §4.4's Fig. 10 claim, checked on :func:`fig10_rows`.

  "As the batch size becomes bigger ... the acceleration effect of CD-SGD is
  weaker": CD-SGD's speedup over S-SGD falls with the batch, per GPU and model.

  Returns:
    Dicts with ``claim``, ``holds`` (bool) and ``detail``.
  """
  if not fig10:
    return []
  label = next(key for key in fig10[0] if key.startswith("CD-SGD"))
  out = []
  for gpu, model in dict.fromkeys((r["gpu"], r["model"]) for r in fig10):
    rows = [r for r in fig10 if (r["gpu"], r["model"]) == (gpu, model)]
    rows.sort(key=lambda r: r["batch"])
    speedups = [r[label] for r in rows]
    out.append(
      {
        "claim": f"{label} speedup shrinks as the batch grows ({model}, {gpu})",
        "holds": all(a > b for a, b in zip(speedups, speedups[1:], strict=False)),
        "detail": ", ".join(
          f"{r['batch']}: {s:.2f}x ({r['bound']})"
          for r, s in zip(rows, speedups, strict=True)
        ),
      }
    )
  return out


def _cell(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, bool):
    return "yes" if value else ""
  if isinstance(value, float):
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
  return str(value)


def render(
  rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
) -> str:
  """A markdown table of ``rows`` (the keys of the first row by default)."""
  if not rows:
    return ""
  columns = list(rows[0]) if columns is None else list(columns)
  lines = [
    "| " + " | ".join(columns) + " |",
    "| " + " | ".join("---" for _ in columns) + " |",
  ]
  for row in rows:
    lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
  return "\n".join(lines)


def _claim_lines(checked: Sequence[Mapping[str, Any]]) -> list[str]:
  return [
    f"- {'HOLDS' if c['holds'] else 'does not hold'}: {c['claim']} ({c['detail']})"
    for c in checked
  ]


TABLE2_COLUMNS = (
  "gpu",
  "nodes",
  "method",
  "tau_ms",
  "phi_ms",
  "psi_ms",
  "delta_ms",
  "step_ms",
  "bound",
  "epoch_s",
  "paper_s",
  "ratio",
  "calibrated",
)


def render_table2(rows: Sequence[Mapping[str, Any]]) -> str:
  """Markdown: the assumptions, :func:`table2_rows` and :func:`table2_claims`."""
  k80 = effective_flops_per_second("K80") / 1e12
  v100 = effective_flops_per_second("V100") / 1e12
  head = (
    f"### Paper 001 Table 2, simulated (gradcomp.sim.delayed): ResNet-20 / "
    f"CIFAR-10 epoch (s), {BATCH_PER_GPU} images per GPU, {GPUS_PER_NODE} GPUs a "
    f"node, {BANDWIDTH_GBPS:g} Gbit/s, parameter servers one a node, 25 us a "
    f"message (Cluster default, not fitted). Calibrated: K80 {k80:.3f} TFLOP/s "
    f"effective ({100 * k80 / K80_FP32_PEAK_TFLOPS:.1f}% of peak) from the paper's "
    f"{CALIBRATION[1]} on {CALIBRATION[0]} nodes; the rest predicted. V100 "
    f"{v100:.2f} TFLOP/s (same fraction of peak, assumed); 'V100 (ResNet-50 "
    f"rate)' {v100_tflops():.2f} TFLOP/s (NVIDIA's published fp32 ResNet-50 rate)."
  )
  return "\n".join(
    [head, "", render(rows, TABLE2_COLUMNS), "", *_claim_lines(table2_claims(rows))]
  )


def render_fig10(rows: Sequence[Mapping[str, Any]]) -> str:
  """Markdown: :func:`fig10_rows` and :func:`fig10_claims`."""
  if not rows:
    return ""
  label = next(key for key in rows[0] if key.startswith("CD-SGD"))
  columns = [
    "gpu",
    "model",
    "batch",
    "tau_ms",
    "phi_ms",
    "psi_ms",
    "delta_ms",
    "ssgd_ms",
    "BIT-SGD",
    "OD-SGD",
    label,
    "bound",
  ]
  head = (
    f"### Paper 001 Fig. 10, simulated: speedup over S-SGD (S-SGD step / method "
    f"step), {rows[0]['nodes']} nodes; per-GPU batch 32 / 64 / 128; AlexNet and "
    "Inception-bn have no gradcomp model, VGG-16 is the CIFAR variant"
  )
  return "\n".join(
    [head, "", render(rows, columns), "", *_claim_lines(fig10_claims(rows))]
  )


def report() -> str:
  """Both simulated tables with their assumptions and claims, as markdown."""
  return render_table2(table2_rows()) + "\n\n" + render_fig10(fig10_rows())


def plot_table2(ax, rows: Sequence[Mapping[str, Any]]) -> None:
  """Bars on a matplotlib ``ax``: the simulated K80 epochs next to the paper's."""
  k80 = [r for r in rows if r["gpu"] == "K80"]
  methods = list(dict.fromkeys(r["method"] for r in k80))
  width = 0.2
  for i, nodes in enumerate(sorted({r["nodes"] for r in k80}, reverse=True)):
    by = {r["method"]: r for r in k80 if r["nodes"] == nodes}
    xs = [j + (2 * i - 1.5) * width for j in range(len(methods))]
    ax.bar(xs, [by[m]["paper_s"] for m in methods], width, label=f"paper, {nodes}n")
    ax.bar(
      [x + width for x in xs],
      [by[m]["epoch_s"] for m in methods],
      width,
      label=f"model, {nodes}n",
    )
  ax.set_xticks(range(len(methods)))
  ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=7)
  ax.set(ylabel="epoch (s), ResNet-20 / CIFAR-10, K80")
  ax.legend(fontsize=7)
  ax.set_title("Table 2: paper vs simulated (eqs. 2-7)")


def predict(
  model: str,
  cluster: Cluster,
  *,
  batch_per_worker: int,
  memory_gbps: float = V100_HBM_GBPS,
  ks: Sequence[int] = (2, 5, 10, 20),
) -> list[dict[str, Any]]:
  """Predicted steady step of S-SGD, BIT-SGD, OD-SGD and CD-SGD on a described cluster.

  Paper 001 eqs. 2, 4, 5 and 7 (:func:`gradcomp.sim.delayed.steady_step_seconds`)
  with ``tau`` the slowest worker's compute of ``model`` at
  ``batch_per_worker`` (``cluster.compute_seconds``), ``phi`` the dense
  exchange and ``psi`` the 2-bit one, one message per parameter array, priced
  by ``cluster.comm_seconds`` in its own topology (a parameter server or an
  all-reduce), and ``delta`` the threshold quantizer's memory-traffic floor at
  ``memory_gbps``.

  Returns:
    One dict per method: ``method``, ``step_ms``, ``bound``, and the inputs.
  """
  cost = model_cost(model)
  flops = training_flops(cost.forward_flops, batch_per_worker)
  t = {
    "tau": float(cluster.compute_seconds(flops, 1).max()),
    "phi": float(cluster.comm_seconds({"all-reduce": (4 * cost.values, cost.arrays)})),
    "psi": float(
      cluster.comm_seconds(
        {"all-gather": (cost.compressed_bytes, cost.compressed_messages)}
      )
    ),
  }
  (floor,) = [c.floor for c in COMPRESSORS if c.label == "threshold_quantize"]
  t["delta"] = floor.bytes(cost.values) / (memory_gbps * 1e9)
  labels = ["S-SGD", "BIT-SGD", "OD-SGD", *(f"CD-SGD k={k}" for k in ks)]
  rows = []
  for label in labels:
    method, k = _method(label)
    rows.append(
      {
        "method": label,
        "step_ms": 1e3 * _price(label, t),
        "bound": _bound(method, k, t),
        **{f"{name}_ms": 1e3 * v for name, v in t.items()},
      }
    )
  return rows


def render_prediction(rows: Sequence[Mapping[str, Any]], title: str) -> str:
  """Markdown of :func:`predict`'s rows."""
  first = rows[0]
  lines = [
    f"### {title}",
    "",
    "tau {tau_ms:,.3f} ms, phi {phi_ms:,.3f} ms, psi {psi_ms:,.3f} ms, "
    "delta {delta_ms:,.3f} ms".format(**first),
    "",
    "| method | step (ms) | speedup over S-SGD | bound |",
    "| --- | ---: | ---: | --- |",
  ]
  for r in rows:
    lines.append(
      f"| {r['method']} | {r['step_ms']:,.3f} | "
      f"{first['step_ms'] / r['step_ms']:.2f} | {r['bound']} |"
    )
  return "\n".join(lines)
