"""Paper 000's experimental setting as numbers, and a V100 cost model built on them.

Each constant cites where it comes from: a table or section of paper 000
(``../shared/papers/000_d141ab4bcef25a39.txt``), or, for the V100 itself, a
published measurement. Keys are gradcomp's registered compressor names and
``gradcomp.models.shapes.MODELS`` keys.

:func:`v100_profile` turns Table 1 into a synthetic
:class:`~gradcomp.sim.Profile` per compressor (``Comp(x) = c + s x``,
:func:`calibrate`), so the LayerFusion simulator can price the paper's GPUs
without measuring anything (``bench.scaling``, source ``"paper"``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import gradcomp
from bench.compress import COMPRESSORS
from gradcomp.compressors import registry
from gradcomp.compressors import spec as spec_lib
from gradcomp.models import shapes
from gradcomp.parallel.traced import traced_wire
from gradcomp.sim.profile import DEFAULT_SIZES, KINDS

#: Paper 000 §3.1, Table 1: compress + decompress time of the ResNet-50
#: gradient on a V100, in ms, one number per method. The rows are Top-K 1%,
#: DGC 1%, Random-K 1%, QSGD 2 bit, SignSGD, TernGrad, PowerSGD rank 4. The
#: table gives one total, not a layer-wise and a fused one; §3.1 argues that
#: layer-wise compression is what costs ("the compression of the gradient of
#: the DNN model layer by layer can lead to significant compressing
#: overhead"), so these are read as layer-wise totals over
#: :data:`RESNET50_TENSORS` calls.
TABLE1_MS = {
  "topk": 122.0,
  "dgc": 242.0,
  "randomk": 187.0,
  "qsgd": 46.0,
  "signsgd": 13.0,
  "terngrad": 70.0,
  "powersgd": 174.0,
}

#: ResNet-50's gradient tensors, one compression call each when layer-wise
#: (paper 000 Fig. 1c; torchvision's ``resnet50``, ``shapes.resnet50_shapes``).
RESNET50_TENSORS = 161

#: Paper 000 §3.1 (on Fig. 1b): "the compression overhead not doubling even as
#: the tensor size increases from 2^4 to 2^20". Read as an upper bound on
#: ``Comp(2^20) / Comp(2^4)``; taking the bound itself gives compression the
#: largest per-element share the paper allows, i.e. the least gain from fusion.
FIG1B_SIZES = (2**4, 2**20)
FIG1B_GROWTH = 2.0

#: Compressors with no Table 1 row, priced as a Table 1 row scaled by the ratio
#: of the two single-pass memory-traffic floors (``bench.compress.Floor``):
#: sign compression without / with a residual, a 2-bit quantizer with error
#: feedback like TernGrad's codes, a sketch + top-k recovery like top-k.
#: ``none`` (plain all-reduce) compresses nothing and costs 0.
TABLE1_PROXY = {
  "fp16": "signsgd",
  "ef_signsgd": "signsgd",
  "threshold_quantize": "terngrad",
  "sketch_topk": "topk",
}

#: Paper 000 §5, Table 3: per-worker batch size b.
TABLE3_BATCH = {"resnet20": 128, "vgg16": 128, "resnet50": 128, "lstm_ptb": 32}

#: Paper 000 §5: 16 V100 32 GB GPUs "connected by Ethernet with 20 Gbps
#: bandwidth" (PyTorch 1.8.1, Horovod 0.22.1, NCCL 2.8.3). No latency is given.
BANDWIDTH_GBPS = 20.0
MAX_WORKERS = 16

#: NVIDIA V100 (SXM2) peak fp32 throughput, TFLOP/s, and HBM2 bandwidth, GB/s
#: (NVIDIA Tesla V100 datasheet).
V100_FP32_PEAK_TFLOPS = 15.7
V100_HBM_GBPS = 900.0

#: Measured single-V100 (32 GB) fp32 training throughput of ResNet-50 v1.5 in
#: PyTorch, images/s: NVIDIA DeepLearningExamples,
#: ``PyTorch/Classification/ConvNets/resnet50v1.5/README.md``, "Training
#: performance: NVIDIA DGX-1 32GB (8x V100 32GB)", 1 GPU, FP32, pytorch-21.03
#: NGC container (the PyTorch generation of paper 000's 1.8.1). With
#: ``3 * sum(shapes.forward_flops("resnet50"))`` = 24.6 GFLOP per image for a
#: training step, that is 8.76 TFLOP/s, 56 % of :data:`V100_FP32_PEAK_TFLOPS`
#: (:func:`v100_tflops`).
V100_RESNET50_FP32_IMAGES_PER_S = 356.0

#: Paper 000 §5.1, Table 4: training throughput on the 16-GPU cluster
#: ("processed images per second"), layer-wise and with LayerFusion.
#: Sketch-Fusion SGD is reported with LayerFusion only.
TABLE4_THROUGHPUT = {
  "layerwise": {
    "topk": {"resnet20": 976, "resnet50": 428, "lstm_ptb": 1004},
    "dgc": {"resnet20": 3416, "resnet50": 1768, "lstm_ptb": 3572},
    "randomk": {"resnet20": 1040, "resnet50": 522, "lstm_ptb": 1227},
    "qsgd": {"resnet20": 4011, "resnet50": 2319, "lstm_ptb": 3471},
    "ef_signsgd": {"resnet20": 3294, "resnet50": 2038, "lstm_ptb": 2719},
    "signsgd": {"resnet20": 5240, "resnet50": 3321, "lstm_ptb": 5864},
    "powersgd": {"resnet20": 1145, "resnet50": 537, "lstm_ptb": 957},
  },
  "layerfusion": {
    "topk": {"resnet20": 1073, "resnet50": 530, "lstm_ptb": 1255},
    "dgc": {"resnet20": 4716, "resnet50": 2174, "lstm_ptb": 4136},
    "randomk": {"resnet20": 1317, "resnet50": 600, "lstm_ptb": 1476},
    "qsgd": {"resnet20": 5213, "resnet50": 3001, "lstm_ptb": 4484},
    "ef_signsgd": {"resnet20": 3418, "resnet50": 2417, "lstm_ptb": 3042},
    "signsgd": {"resnet20": 6133, "resnet50": 4187, "lstm_ptb": 6742},
    "powersgd": {"resnet20": 1371, "resnet50": 542, "lstm_ptb": 1085},
    "sketch_topk": {"resnet20": 8430, "resnet50": 6321, "lstm_ptb": 9864},
  },
}


def v100_tflops() -> float:
  """Achieved V100 fp32 training throughput, TFLOP/s, from ResNet-50's.

  :data:`V100_RESNET50_FP32_IMAGES_PER_S` times a training step's FLOPs per
  image (forward + backward = 3 forward, the convention of
  ``gradcomp.sim.model_workload``).
  """
  flops = 3 * sum(shapes.forward_flops("resnet50"))
  return V100_RESNET50_FP32_IMAGES_PER_S * flops / 1e12


# -- synthetic V100 profiles calibrated to Table 1 ----------------------------------

#: Grid of the synthetic profiles: ``Comp`` is affine, so any grid is exact;
#: the traced wire payload is interpolated between these sizes.
PROFILE_SIZES = DEFAULT_SIZES


def calibrate(
  total_ms: float,
  *,
  tensors: int = RESNET50_TENSORS,
  values: int = shapes.RESNET50_NUM_PARAMS,
  growth: float = FIG1B_GROWTH,
  sizes: tuple[int, int] = FIG1B_SIZES,
) -> tuple[float, float]:
  """``(c, s)`` in seconds of ``Comp(x) = c + s x`` matching a layer-wise total.

  Two conditions fix the two unknowns: ``tensors`` calls on ``values`` values
  in all take ``total_ms`` (``tensors c + values s``), and
  ``Comp(sizes[1]) = growth * Comp(sizes[0])``.

  Args:
    total_ms: the layer-wise compress + decompress time (paper 000 Table 1).
    tensors: calls in the layer-wise total (ResNet-50: 161).
    values: values in the gradient (ResNet-50: 25,557,032).
    growth: ``Comp(sizes[1]) / Comp(sizes[0])``, >= 1 (§3.1: at most 2).
    sizes: the two sizes of ``growth``.

  Returns:
    ``(per_call_seconds, per_value_seconds)``.
  """
  small, large = sizes
  if not 1 <= growth < large / small:
    raise ValueError(f"growth must be in [1, {large / small}), got {growth!r}")
  ratio = (growth - 1) / (large - growth * small)  # s / c
  per_call = total_ms * 1e-3 / (tensors + values * ratio)
  return per_call, per_call * ratio


def table1_ms(name: str, kwargs: Mapping) -> tuple[float, str]:
  """A compressor's layer-wise ResNet-50 ``Comp`` on a V100, ms, and its origin.

  Table 1's row where there is one; ``none`` costs 0; otherwise the row of
  :data:`TABLE1_PROXY` scaled by the ratio of the two compressors' single-pass
  memory-traffic floors on ResNet-50 (``bench.compress.Floor``: a V100
  compressor is memory-bound, so its time goes with the bytes it moves).
  """
  if name in TABLE1_MS:
    return TABLE1_MS[name], "Table 1"
  if name == "none":
    return 0.0, "no compression"
  proxy = TABLE1_PROXY.get(name)
  if proxy is None:
    raise ValueError(f"no Table 1 row or proxy for {name!r}")
  floors = {c.label: c for c in COMPRESSORS}
  d = shapes.RESNET50_NUM_PARAMS
  ours, theirs = floors[name], floors[proxy]
  scale = ours.floor.bytes(d, kwargs.get("ratio")) / theirs.floor.bytes(
    d, theirs.ratio()
  )
  return (
    TABLE1_MS[proxy] * scale,
    f"Table 1 {proxy} x {scale:.3f} (memory-traffic floors)",
  )


@functools.cache
def _traced(name: str, items: tuple, sizes: tuple[int, ...]):
  kwargs = dict(items)
  nbytes = {k: [] for k in KINDS}
  messages = {k: [] for k in KINDS}
  for size in sizes:
    traced = traced_wire(
      lambda axis: registry.get(name, axis_name=axis, **kwargs), size
    )
    for k in KINDS:
      b, m = traced.get(k, (0, 0))
      nbytes[k].append(b)
      messages[k].append(m)
  used = [k for k in KINDS if any(messages[k])]
  return (
    {k: tuple(nbytes[k]) for k in used},
    {k: tuple(messages[k]) for k in used},
  )


def v100_profile(
  name: str, kwargs: Mapping | None = None, sizes: Sequence[int] = PROFILE_SIZES
) -> gradcomp.sim.Profile:
  """The synthetic V100 :class:`~gradcomp.sim.Profile` of ``gradcomp.get(name, **kwargs)``.

  ``seconds = c + s x`` from :func:`calibrate` of :func:`table1_ms`;
  ``fused_seconds`` adds concatenating the pieces and splitting the result,
  each a copy of ``4 x`` bytes read and written at the V100's HBM bandwidth.
  The wire fields are traced from the compressor itself.
  """
  kwargs = dict(kwargs or {})
  sizes = tuple(int(s) for s in sizes)
  per_call, per_value = calibrate(table1_ms(name, kwargs)[0])
  copies = 2 * (2 * 4) / (V100_HBM_GBPS * 1e9)  # two copies of 4x bytes, r + w
  seconds = tuple(per_call + per_value * s for s in sizes)
  wire_bytes, wire_messages = _traced(name, tuple(sorted(kwargs.items())), sizes)
  return gradcomp.sim.Profile(
    compressor=spec_lib.spec_of(registry.get(name, **kwargs)).label(),
    backend="V100 (paper 000 Table 1, synthetic)",
    devices=1,
    sizes=sizes,
    seconds=seconds,
    fused_seconds=tuple(t + copies * s for t, s in zip(seconds, sizes, strict=True)),
    wire_bytes=wire_bytes,
    wire_messages=wire_messages,
  )
