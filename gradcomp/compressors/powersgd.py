"""PowerSGD: rank-r compression by one warm-started power iteration.

Vogels, Karimireddy & Jaggi, *PowerSGD*, NeurIPS 2019, Alg. 1 (paper 000 ref.
[48], Table 1 *PowerSGD - Rank 4*). P and Q are linear in the gradient, so both
are all-reduced; with error feedback around it (Alg. 2).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.compressors.base import LeafCodec, leafwise
from gradcomp.compressors.memory import error_feedback
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import numerics


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """The matrix a leaf is compressed as.

  ND leaves become ``(prod(shape[:-1]), shape[-1])`` (JAX kernels are
  ``(..., in, out)``); 1-D and scalar leaves become the near-square
  ``(ceil(sqrt(d)), ceil(d / rows))``, zero-padded.
  """
  if len(shape) >= 2:
    return math.prod(shape[:-1]), shape[-1]
  size = math.prod(shape)
  rows = math.isqrt(max(size - 1, 0)) + 1
  return rows, -(-size // rows)


def compresses(shape: tuple[int, ...], rank: int) -> bool:
  """Whether rank-``rank`` factors are smaller than the matrix itself."""
  n, m = matrix_shape(shape)
  return rank * (n + m) < n * m


#: How a 1-D (or scalar) leaf is sent: ``"matrix"`` reshapes it to the
#: near-square :func:`matrix_shape` and factorises it (what a fused 1-D buffer
#: needs); ``"dense"`` all-reduces it uncompressed, as Vogels et al. 2019 do
#: for biases and normalisation scales (their reference code, §3).
VECTORS = ("matrix", "dense")


def goes_dense(shape: tuple[int, ...], rank: int, vectors: str = "matrix") -> bool:
  """Whether a leaf of ``shape`` is all-reduced uncompressed rather than factorised.

  It is when its rank-``rank`` factors would not be smaller than its matrix
  (:func:`compresses`), or when it has fewer than two axes and ``vectors`` is
  ``"dense"``.
  """
  if vectors == "dense" and len(shape) < 2:
    return True
  return not compresses(shape, rank)


class PowerSGDLeafState(NamedTuple):
  q: jax.Array  # (cols, rank) float32: warm start, identical on every worker.


def _as_matrix(x: jax.Array) -> jax.Array:
  n, m = matrix_shape(x.shape)
  flat = x.reshape(-1)
  return jnp.pad(flat, (0, n * m - flat.shape[0])).reshape(n, m)


def orthonormal_columns(p: jax.Array) -> jax.Array:
  """An orthonormal basis of the columns of ``p`` (``(..., rows, rank)``), by QR.

  A leading batch axis orthogonalises each matrix of the stack on its own.
  """
  # QR is scale-invariant; dividing by a power of two near max |p| first
  # (exact) keeps its column norms from overflowing.
  top = numerics.max_abs(p, axis=(-2, -1), keepdims=True)
  q, _ = jnp.linalg.qr(p / numerics.power_of_two_above(top))
  return q


def householder_columns(p: jax.Array) -> jax.Array:
  """:func:`orthonormal_columns` by ``rank`` Householder reflections in plain ops.

  For ``p`` ``(..., rows, rank)`` with ``rows >= rank``: reflection ``j`` is
  ``H_j = I - 2 v v^T / (v^T v)`` with ``v = x - beta e_j``, ``x`` column ``j``
  of the partly reduced matrix from row ``j`` down and ``beta = -sign(x_j)
  ||x||`` (LAPACK's ``sgeqrf`` convention; no reflection when ``x`` is zero
  below row ``j``); the basis is ``H_0 ... H_{rank-1}`` applied to the first
  ``rank`` columns of the identity. Householder QR is backward stable
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., Thm
  19.4), the same guarantee as LAPACK's, and the result is orthonormal
  whatever ``p`` is (a product of reflections): a zero ``p`` gives the first
  ``rank`` columns of the identity, as LAPACK does.

  Why not ``jnp.linalg.qr``: on XLA:CPU a batched QR is a LAPACK custom call
  that splits its batch over the intra-op thread pool and blocks until the
  pieces are done (jaxlib 0.10's ``ParallelBatchMap``); when the program runs
  as many independent batched calls at once as the pool has threads, every
  thread waits on work queued behind it and the step deadlocks (issue 43:
  per-leaf PowerSGD on the ResNet-50 gradient, two threads on a two-core
  machine). These reflections are a few fused elementwise passes and
  reductions over the thin ``p``, with no custom call, on every backend.
  """
  top = numerics.max_abs(p, axis=(-2, -1), keepdims=True)
  a = p / numerics.power_of_two_above(top)
  rows, rank = a.shape[-2], a.shape[-1]
  index = jnp.arange(rows)
  reflections = []
  for j in range(rank):
    x = jnp.where(index >= j, a[..., :, j], 0.0)
    head = x[..., j : j + 1]
    below = jnp.sum(jnp.where(index > j, x * x, 0.0), axis=-1, keepdims=True)
    norm = jnp.sqrt(head * head + below)
    beta = jnp.where(head >= 0, -norm, norm)
    v = x - jnp.where(index == j, beta, 0.0)
    scale = jnp.where(below > 0, 2.0 / jnp.sum(v * v, axis=-1, keepdims=True), 0.0)
    reflections.append((v, scale))
    a = a - v[..., :, None] * (
      scale[..., None] * jnp.sum(v[..., :, None] * a, axis=-2, keepdims=True)
    )
  q = jnp.broadcast_to(jnp.eye(rows, rank, dtype=a.dtype), a.shape)
  for v, scale in reversed(reflections):
    q = q - v[..., :, None] * (
      scale[..., None] * jnp.sum(v[..., :, None] * q, axis=-2, keepdims=True)
    )
  return q


def unit_columns(q: jax.Array) -> jax.Array:
  """``q`` with every non-zero column scaled to norm 1 (the same column space).

  Columns are along axis -2, so a stack ``(..., cols, rank)`` works too.
  """
  scale, root = numerics.scaled_norm(q, axis=-2, keepdims=True)
  return q / scale / jnp.where(root > 0, root, 1.0)


def transposed_product(m: jax.Array, p: jax.Array) -> jax.Array:
  """``m^T @ p`` for a thin ``p`` (rank columns), as a fused multiply-reduce.

  XLA:CPU's dot contracting ``m``'s rows ran 8x slower than ``m @ q`` on a
  (4608, 512) matrix at rank 4 (1.84 vs 0.23 ms); the broadcast product
  summed over the rows reads ``m`` once in 0.49 ms (BUILD_NOTES, issue 18).
  The same products are added, in another order. ``m`` ``(..., rows, cols)``
  and ``p`` ``(..., rows, rank)`` may carry a leading batch axis.
  """
  return jnp.sum(m[..., :, :, None] * p[..., :, None, :], axis=-3)


def outer_product(p: jax.Array, q: jax.Array) -> jax.Array:
  """``p @ q^T`` for thin ``p`` ``(..., rows, rank)`` and ``q`` ``(..., cols, rank)``.

  As ``rank`` broadcast products added in one elementwise pass: XLA:CPU's dot
  with a contraction of 4 ran 10-20x slower than this on a (3, 4608, 512)
  batch (26 vs 1.8 ms, issue 43), and the pass fuses with its consumer
  (the remainder ``x - p q^T``). The same products, added in rank order.
  """
  total = p[..., :, None, 0] * q[..., None, :, 0]
  for j in range(1, p.shape[-1]):
    total = total + p[..., :, None, j] * q[..., None, :, j]
  return total


def headroom(size: int) -> float:
  """``2**-k`` for the smallest ``k`` with ``2**k >= sqrt(size)``."""
  return 2.0 ** -math.ceil(math.log2(max(size, 1)) / 2)


def factor_limit(rank: int) -> float:
  """Where ``Q``'s entries saturate: ``|P Q^T|`` stays below half the float32 max."""
  return numerics.FLOAT32_MAX / (2 * math.sqrt(rank))


def powersgd_codec(
  rank: int, axis_name: exchange.AxisName, vectors: str = "matrix"
) -> LeafCodec:
  """One power iteration per step; leaves too small to compress go dense.

  So do 1-D leaves when ``vectors="dense"`` (:func:`goes_dense`).

  Overflow-free for every finite ``x`` (all scales are powers of two, so they
  round nothing): the warm start is rescaled to unit columns times ``2**-a``
  with ``2**a >= sqrt(cols)``, so every entry and partial sum of ``M Q`` is at
  most ``max |M|``; ``Q`` is computed as ``M^T (P 2**-b) 2**b`` with
  ``2**b >= sqrt(rows)`` and its entries saturate at ``float32 max / (2
  sqrt(rank))``, so ``P Q^T`` is at most half the float32 maximum; the
  remainder ``x - P Q^T`` saturates at the maximum. Means are taken by
  dividing before the all-reduce.
  """

  def init(leaf, key):
    if goes_dense(tuple(leaf.shape), rank, vectors):
      return ()
    _, m = matrix_shape(tuple(leaf.shape))
    return PowerSGDLeafState(q=jax.random.normal(key, (m, rank), jnp.float32))

  def apply(x, state, key, step):
    del key, step
    if goes_dense(x.shape, rank, vectors):
      return exchange.all_reduce_mean(x, axis_name), jnp.zeros_like(x), state
    rows, cols = matrix_shape(x.shape)
    down_p, down_q = headroom(cols), headroom(rows)
    m = _as_matrix(x)
    p = exchange.all_reduce_mean(m @ (unit_columns(state.q) * down_p), axis_name)
    p = orthonormal_columns(p)
    q = exchange.all_reduce_mean(transposed_product(m, p * down_q), axis_name)
    q = q * (1.0 / down_q)
    # Saturating the small factor bounds every entry of P Q^T by max / 2.
    limit = factor_limit(rank)
    q = jnp.clip(q, -limit, limit)
    approx = outer_product(p, q).reshape(-1)[: x.size].reshape(x.shape)
    big = numerics.FLOAT32_MAX
    return approx, jnp.clip(x - approx, -big, big), PowerSGDLeafState(q=q)

  return LeafCodec(init, apply)


@recorded
def powersgd(
  rank: int = 4,
  *,
  seed: int = 0,
  axis_name: exchange.AxisName = None,
  vectors: str = "matrix",
) -> optax.GradientTransformation:
  """PowerSGD with warm start and error feedback.

  For each leaf seen as a matrix ``M`` (see :func:`matrix_shape`):

  .. math::
    M = r + G,\\quad P = \\overline{M Q},\\quad \\hat P = \\operatorname{orth}(P),
    \\quad Q = \\overline{M^\\top \\hat P},\\quad \\text{out} = \\hat P Q^\\top,
    \\quad r = M - \\hat P Q^\\top

  where the bars are all-reduced means. ``Q`` is kept for the next step (warm
  start) and starts from a Gaussian drawn from ``seed``, the same on every
  worker. The output is exact whenever the workers' mean ``M`` has rank
  ``<= rank``. Leaves whose factors would not be smaller than the matrix are
  all-reduced uncompressed, as in the reference implementation; so are 1-D
  leaves with ``vectors="dense"`` (the paper's treatment of biases).

  Under ``gradcomp.layerfusion`` PowerSGD keeps these semantics:
  every leaf of a fused group keeps its own ``P`` and ``Q``, leaves of one
  matrix shape are factorised as one batch, and each group all-reduces its
  ``P``'s (with its dense leaves) and its ``Q``'s in one collective each
  (:func:`gradcomp.compressors.powersgd_groups.powersgd_per_leaf`).

  Bad input: NaN or Inf gradient coordinates are dropped by the error
  feedback (``memory.py``: the memory keeps its value there), so state and
  output stay finite. Finite gradients up to the float32 maximum never
  overflow (see :func:`powersgd_codec`): entries of
  ``Q`` beyond ``float32 max / (2 sqrt(rank))`` and of the remainder beyond
  the float32 range, possible only for a matrix with entries within a factor
  ~``sqrt(rows)`` of that maximum, saturate there.

  Args:
    rank: the rank ``r``, >= 1.
    seed: seeds the initial ``Q``.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    vectors: ``"matrix"`` (a 1-D leaf is reshaped to a near-square matrix and
      factorised) or ``"dense"`` (a 1-D leaf is all-reduced uncompressed);
      :data:`VECTORS`.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: ``rank`` below 1 or ``vectors`` not in :data:`VECTORS`.

  Examples:
    A 3 x 4 matrix of rank 1 is sent as P (3 x 1) and Q (4 x 1) and
    recovered exactly; of a rank-3 matrix the rest stays in the residual:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.powersgd(rank=1)
    >>> update = jax.jit(tx.update)
    >>> g = {"w": jnp.outer(jnp.array([1.0, 2.0, -1.0]), jnp.array([2.0, 0.0, 1.0, -3.0]))}
    >>> out, state = update(g, tx.init(g))
    >>> state.leaves["w"].inner.q.shape, round(float(jnp.abs(out["w"] - g["w"]).max()), 4)
    ((4, 1), 0.0)
    >>> g = {"w": g["w"] + jnp.eye(3, 4)}
    >>> out, state = update(g, tx.init(g))
    >>> r = state.leaves["w"].residual  # sent + r = g, up to rounding
    >>> round(float(jnp.abs(r).max()), 2), round(float(jnp.abs(out["w"] + r - g["w"]).max()), 4)
    (0.82, 0.0)

  References:
    Vogels et al., NeurIPS 2019, Alg. 1-2; paper 000 Table 1 and §5.
  """
  rank = checks.at_least("rank", rank, 1)
  vectors = checked_vectors(vectors)
  return leafwise(error_feedback(powersgd_codec(rank, axis_name, vectors)), seed=seed)


def checked_vectors(vectors) -> str:
  """``vectors`` if it is one of :data:`VECTORS`, else a ValueError naming it."""
  if vectors not in VECTORS:
    raise ValueError(f"vectors must be one of {VECTORS}, got {vectors!r}")
  return vectors
