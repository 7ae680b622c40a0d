"""Top-k sparsification: send the k coordinates of largest magnitude.

Paper 000 Table 1 (Top-K 1%); paper 004 §4 (drop-ratio sparsification with
error feedback, Aji & Heafield 2017).
"""

from __future__ import annotations

import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels.selection import top_k_magnitude


@recorded
def topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
) -> optax.GradientTransformation:
  """Magnitude top-k with error feedback; payloads are all-gathered.

  Each worker keeps ``k = max(1, floor(ratio * d))`` coordinates of each leaf
  (exactly the k largest ``|e_i|``) and sends them as float32 values and int32
  indices; every worker scatter-adds all ``n * k`` pairs and divides by ``n``.

  .. math::
    e = r + g,\\quad S = \\operatorname{argtop}_k |e|,\\quad
    \\bar g = \\tfrac{1}{n}\\sum_w e_w \\odot 1_{S_w},\\quad r = e \\odot 1_{\\bar S}

  Bad input: with error feedback NaN or Inf gradient coordinates are dropped
  by the memory (``memory.py``), so state and output stay finite; without it NaN or
  Inf coordinates can be selected and reach that step's output (nothing is
  stored). Finite values are sent exactly and divided by ``n`` before the
  workers' values are added, so their mean is finite.

  Args:
    ratio: fraction of coordinates kept, in (0, 1].
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: keep what was not sent and add it to the next gradient.

  Returns:
    An ``optax.GradientTransformation``.

  References:
    Paper 000 Table 1; Aji & Heafield, *Sparse communication for distributed
    gradient descent*, 2017 (paper 004 §4).
  """
  ratio = checks.fraction("ratio", ratio)

  def apply(x, state, key, step):
    del key, step
    flat = x.reshape(-1)
    k = checks.keep_count(ratio, flat.shape[0])
    values, indices = top_k_magnitude(flat, k)
    mean = sparse.gather_mean(values, indices, x.shape, axis_name)
    return mean, sparse.zero_at(x, indices, after=values), state

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback))
