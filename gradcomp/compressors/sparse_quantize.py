"""Strom's threshold sparsification: indices and signs of the coordinates above a threshold.

Survey 004 §4.2 ("sparsification can be also utilized combined with
quantization", Strom 2015): each worker adds its residual to the gradient,
sends only the coordinates whose magnitude reaches a fixed threshold ``t``,
each quantized to ``+-t`` so that only its index and sign cross the wire, and
keeps the rest in the residual. The sparse relative of ``threshold_quantize``
(``threshold.py``), which sends a dense 2-bit code for every coordinate.

**Wire format.** One int32 word per slot: the coordinate's index ``i`` for
``+t`` and its bitwise complement ``~i = -i - 1`` for ``-t``, i.e. the sign
rides in the top bit, which a flat index below ``2**31`` never uses. An empty
slot holds ``d`` (the leaf's size, out of range), the convention of
``sparse.py``; receivers drop it. 4 bytes per slot, against 4 + 1/8 for an
int32 index plus a packed sign bit (``bits.pack_signs``) and 8 for top-k's
(value, index) pairs.

**Static shapes.** SPMD programs need a fixed payload, so each leaf of ``d``
coordinates has ``k = max(1, floor(max_ratio * d))`` slots. When more than
``k`` coordinates reach the threshold, the ``k`` of largest ``|e|`` are sent
(ties at the k-th magnitude broken arbitrarily, as in ``top_k_magnitude``)
and the others stay in the residual, whole: no mass is lost, and a
coordinate left behind only grows until it is among the largest. (The first
``k`` by index would be cheaper to select, but would starve the same tail of
the leaf step after step while its residual grows.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange, sparse
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.memory import error_feedback
from gradcomp.compressors.spec import recorded
from gradcomp.kernels.selection import top_k_magnitude

#: Largest leaf whose indices and "empty" marker ``d`` fit an int32 with the
#: top bit free for the sign.
MAX_SIZE = 2**31 - 1


def encode(x: jax.Array, threshold: float, k: int) -> jax.Array:
  """The wire payload of flat ``x``: ``k`` int32 codes (module docstring).

  Args:
    x: 1-D float32 array of length ``d <= MAX_SIZE``, finite.
    threshold: ``t > 0``.
    k: static number of slots, ``1 <= k <= d``.

  Returns:
    int32 codes of shape ``(k,)``: ``i`` for ``+t`` at index ``i``, ``~i``
    for ``-t``, ``d`` for an empty slot. The ``k`` largest ``|x_i|`` are
    candidates; those below ``t`` leave their slot empty.
  """
  d = x.shape[0]
  values, indices = top_k_magnitude(x, k)
  codes = jnp.where(values < 0, ~indices, indices)
  return jnp.where(jnp.abs(values) >= threshold, codes, d).astype(jnp.int32)


def decode_slots(codes: jax.Array, threshold: float) -> tuple[jax.Array, jax.Array]:
  """``(values, indices)`` of codes of any shape: ``+-t`` and the flat index.

  Empty slots decode to index ``d`` (their code), which scatters with
  ``mode="drop"`` skip.
  """
  negative = codes < 0
  indices = jnp.where(negative, ~codes, codes)
  values = jnp.where(negative, -threshold, threshold).astype(jnp.float32)
  return values, indices


def decode(codes: jax.Array, threshold: float, size: int) -> jax.Array:
  """Dense float32 vector of length ``size`` from one worker's codes."""
  values, indices = decode_slots(codes, threshold)
  return sparse.scatter_mean(values, indices, (size,), 1)


def _gather_mean(codes, threshold: float, shape, axis_name) -> jax.Array:
  """Dense mean over workers of the decoded codes (all-gather of the codes)."""

  def decoded(codes, n):
    values, indices = decode_slots(codes, threshold)
    return sparse.scatter_mean(values, indices, shape, n)

  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver
    return exchange.gathered_sum((codes,), lambda c: decoded(c, 1), axis_name)
  (gathered,) = exchange.all_gather((codes,), axis_name)
  return decoded(gathered, exchange.num_workers(axis_name))


@recorded
def sparse_quantize(
  threshold: float,
  *,
  max_ratio: float = 0.01,
  axis_name: exchange.AxisName = None,
) -> optax.GradientTransformation:
  """Threshold sparsification to ``+-t`` with error feedback (Strom 2015).

  .. math::
    e = r + g,\\quad S = \\{i : |e_i| \\ge t\\} \\cap
    \\operatorname{argtop}_k |e|,\\quad q = t \\operatorname{sign}(e)
    \\odot 1_S,\\quad r = e - q,\\quad \\bar g = \\tfrac{1}{n}\\sum_w q_w

  with ``k = max(1, floor(max_ratio * d))`` slots per leaf. Each worker sends
  ``k`` int32 words (index with the sign in the top bit, empty slots marked
  ``d``); the words are all-gathered (or, in gossip, permuted to the
  neighbours: ``exchange.Neighbours``) and every worker scatter-adds the
  ``n * k`` values ``+-t / n``. See the module docstring for the format and
  for the choice of the largest ``|e|`` when more than ``k`` qualify.

  Bad input: NaN or Inf gradient coordinates are dropped by the error
  feedback (``memory.py``), so state and output stay finite. Outputs are bounded by
  ``t`` whatever the input; a huge finite ``e`` sends ``+-t`` and keeps the
  rest in the residual.

  Args:
    threshold: ``t > 0``, the magnitude a coordinate of ``e`` must reach to
      be sent, and the value it is sent as.
    max_ratio: fraction of each leaf's coordinates that fit in the payload,
      in (0, 1]; the wire carries ``4 * max(1, floor(max_ratio * d))`` bytes
      per leaf and worker whether or not the slots are used.
    axis_name: the mapped axis of the workers, or ``None`` for one device.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: for ``threshold`` or ``max_ratio`` out of range (here), and,
      at trace time, for a leaf of more than ``MAX_SIZE`` elements.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.sparse_quantize import sparse_quantize
    >>> tx = sparse_quantize(1.0, max_ratio=0.5)  # 2 slots for 4 coordinates
    >>> g = {"w": jnp.array([2.5, -0.25, -1.5, 0.75])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"].tolist(), state.leaves["w"].residual.tolist()
    ([1.0, 0.0, -1.0, 0.0], [1.5, -0.25, -0.5, 0.75])

  References:
    Strom, *Scalable distributed DNN training using commodity GPU cloud
    computing*, Interspeech 2015 (survey 004 §4.2); the residual as in
    error feedback (``memory.py``).
  """
  t = checks.positive("threshold", threshold)
  max_ratio = checks.fraction("max_ratio", max_ratio)
  return leafwise(sparse_quantize_codec(t, max_ratio, axis_name))


def sparse_quantize_codec(
  t: float, max_ratio: float, axis_name: exchange.AxisName
) -> LeafCodec:
  """The codec of one leaf, with its error feedback (checked arguments)."""

  def apply(x, state, key, step):
    del key, step
    flat = x.reshape(-1)
    size = flat.shape[0]
    if size > MAX_SIZE:
      raise ValueError(
        f"sparse_quantize encodes indices in 31 bits: a leaf of {size} elements "
        f"is larger than {MAX_SIZE}; split it"
      )
    codes = encode(flat, t, checks.keep_count(max_ratio, size))
    mean = _gather_mean(codes, t, x.shape, axis_name)
    # r = e - q at the k slots only, in place: a dense decode to subtract
    # cost XLA two gradient-sized temporaries (BUILD_NOTES, issue 18).
    values, indices = decode_slots(codes, t)
    return mean, sparse.add_at(x, indices, -values), state

  return error_feedback(LeafCodec(stateless_init, apply))
