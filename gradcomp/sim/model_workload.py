"""The papers' models as the cost model sees them: leaf sizes and compute.

``model_workload(name)`` turns a built-in model (``gradcomp.models``) into a
:class:`~gradcomp.sim.timeline.Workload`: its leaves in gradient-ready order
(the reverse of the forward order ``gradcomp.models.shapes`` reads from the
flax model the training program trains) with their sizes and a backward time
split in proportion to each leaf's forward FLOPs, at an assumed throughput
(paper 000 §5: V100s). The LayerFusion planner,
its command line and the benchmarks price steps with it.
"""

from __future__ import annotations

import dataclasses
import math

from gradcomp.models import shapes
from gradcomp.sim.timeline import Workload

#: Per-worker batch of paper 000 Table 3; for ``gpt2_small``, sequences of
#: 1,024 tokens (8: nanoGPT's 12 x 1024 per GPU, rounded to a power of two).
BATCH_SIZES = {
  "resnet20": 128,
  "vgg16": 128,
  "resnet50": 128,
  "lstm_ptb": 32,
  "gpt2_small": 8,
}
#: Effective training throughput assumed for the compute time, TFLOP/s: about
#: half a V100's 15.7 fp32 peak, the paper's GPUs (§5).
DEFAULT_TFLOPS = 8.0


@dataclasses.dataclass(frozen=True)
class ModelWorkload:
  """A built-in model as the planner sees it."""

  order: tuple[int, ...]  # gradient-ready order of the tree's leaves.
  workload: Workload  # leaves listed in that order.


def model_workload(
  model: str,
  *,
  batch_size: int | None = None,
  tflops: float = DEFAULT_TFLOPS,
  backward_ms: float | None = None,
) -> ModelWorkload:
  """Sizes and compute of a built-in model's leaves, in gradient-ready order.

  Backward FLOPs are taken as twice the forward's (gradients for inputs and
  weights), per leaf in proportion to ``shapes.forward_flops``; the forward
  pass is half the backward. ``backward_ms``, when given, replaces the
  FLOPs-derived total (e.g. a measured one).
  """
  if model not in shapes.MODELS:
    raise ValueError(
      f"unknown model {model!r}; valid: {', '.join(sorted(shapes.MODELS))}"
    )
  if tflops <= 0:
    raise ValueError(f"tflops must be > 0, got {tflops}")
  named = shapes.MODELS[model]()
  flops = shapes.forward_flops(model)
  batch = BATCH_SIZES[model] if batch_size is None else batch_size
  names = [n for n, _ in named]
  # Leaf index in the flax params tree, also that of shapes.make_tree's flat
  # {name: array}: both flatten in sorted-name order.
  tree_index = {n: i for i, n in enumerate(sorted(names))}
  ready = list(reversed(range(len(named))))
  backward_s = (
    2 * sum(flops) * batch / (tflops * 1e12)
    if backward_ms is None
    else backward_ms * 1e-3
  )
  workload = Workload.from_weights(
    [math.prod(named[i][1]) for i in ready], [flops[i] for i in ready], backward_s
  )
  return ModelWorkload(tuple(tree_index[names[i]] for i in ready), workload)
