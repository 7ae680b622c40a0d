"""1-bit SGD: one bit per value, two reconstruction values per column, error feedback.

Paper 004 §4.1 (quantization with error feedback); Seide et al. 2014. The survey
prints the residual as ``g - Q^{-1}(G)``; the memory that makes 1-bit SGD work
is ``(g + residual) - Q^{-1}(G)`` (paper 004 NOTES), which is what
``memory.error_feedback`` keeps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomp.compressors import exchange as exchanges
from gradcomp.compressors import scatter
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.memory import error_feedback
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import bits, ordering


def column_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """The ``(rows, columns)`` matrix a leaf is quantized as; columns are the last axis.

  A scalar is one value in one column, a vector of ``d`` values one column of
  ``d`` rows, and a leaf of rank >= 2 is reshaped to
  ``(prod(shape[:-1]), shape[-1])``: a flax ``Dense`` kernel ``(in, out)``
  gets one column per output unit, a conv kernel ``(h, w, in, out)`` one per
  output channel.
  """
  if not shape:
    return 1, 1
  if len(shape) == 1:
    return shape[0], 1
  return math.prod(shape[:-1]), shape[-1]


def column_counts(m: jax.Array, packed: jax.Array) -> jax.Array:
  """Per column of ``m``, the number of entries ``>= 0`` (int32).

  One column (a vector, a fused buffer) counts the set bits of its payload
  ``packed`` (``jnp.packbits(m >= 0)``, zero-padded): 1/32 of the bytes of an
  int32 count of ``m``, which XLA:CPU also wrote to memory in full.
  """
  if m.shape[1] == 1:
    return jnp.sum(lax.population_count(packed), dtype=jnp.int32)[None]
  return jnp.sum(m >= 0, axis=0, dtype=jnp.int32)


def column_means(
  m: jax.Array, n_pos: jax.Array, zero: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Per column of ``m``: the mean of its entries ``>= 0`` and of its entries ``< 0``.

  ``n_pos`` is :func:`column_counts`; ``zero`` a traced ``+0.0``
  (``kernels/ordering.py``). A column with no entry in a group gets 0 for
  that group (nothing decodes to it). Each entry is multiplied by
  ``1 / count`` before the column sum (scale before you sum), so the means
  of finite entries are finite.

  One column sums ``max(m, 0)`` and ``min(m, 0)`` (the same terms as a
  select, up to the sign of a zero): XLA:CPU's YNNPACK reduction takes a
  select from memory, a gradient-sized temporary per sum, and a constant
  zero's broadcast too, hence the traced one (BUILD_NOTES, issue 18).
  """
  rows = m.shape[0]
  inv_pos = 1.0 / jnp.maximum(n_pos, 1).astype(jnp.float32)
  inv_neg = 1.0 / jnp.maximum(rows - n_pos, 1).astype(jnp.float32)
  if m.shape[1] == 1:
    v = m.reshape(-1)
    mean_pos = jnp.sum(jnp.maximum(v, zero) * inv_pos[0])
    mean_neg = jnp.sum(jnp.minimum(v, zero) * inv_neg[0])
    return mean_pos[None], mean_neg[None]
  pos = m >= 0
  mean_pos = jnp.sum(jnp.where(pos, m * inv_pos, 0.0), axis=0)
  mean_neg = jnp.sum(jnp.where(pos, 0.0, m * inv_neg), axis=0)
  return mean_pos, mean_neg


def column_sign_codec(axis_name: exchanges.AxisName) -> LeafCodec:
  """One bit per value and two float32 per column, all-gathered (no memory).

  Passes over memory, with error feedback around it (``x = r + g`` built in
  each pass): the payload's bits, the column sums, the remainder written
  over ``r`` (from ``x`` and the means: the bits are not unpacked for it),
  the output written over ``g``. The sums wait for the payload (through
  the counts and the zero read from it) and the output for the remainder
  (``kernels/ordering.py``).
  """

  def apply(x, state, key, step):
    del key, step
    rows, cols = column_shape(x.shape)
    size = rows * cols
    m = x.reshape(rows, cols)
    # jnp.packbits's row sum, not bits.pack_signs's OR (the same bytes): a
    # reduction is computed once, in memory, so the counts and zero read
    # from it come after it (signs.py says the same).
    packed = jnp.packbits(m.reshape(-1) >= 0)
    zero = ordering.zero_after(packed)
    mean_pos, mean_neg = column_means(m, column_counts(m, packed), zero)
    remainder = m - jnp.where(m >= 0, mean_pos, mean_neg)

    def decode(p, high, low):
      ones = bits.unpack_signs(p, size).reshape(rows, cols) > 0
      return jnp.where(ones, high, low).reshape(x.shape)

    after = ordering.zero_after(remainder)
    sent = (packed, mean_pos + after, mean_neg + after)
    mean = exchanges.gathered_mean(sent, decode, axis_name)
    return mean, remainder.reshape(x.shape), state

  return LeafCodec(stateless_init, apply)


@recorded
def onebit_sgd(
  *, axis_name: exchanges.AxisName = None, exchange: str = "gather"
) -> optax.GradientTransformation:
  """1-bit SGD with error feedback and per-column reconstruction values.

  Each leaf is viewed as a matrix of ``rows x columns`` (:func:`column_shape`:
  columns are the last axis; a vector is one column, a scalar a 1 x 1 matrix).
  For each column ``j`` of the error-corrected gradient ``e = r + g``:

  .. math::
    b_{ij} = 1_{e_{ij} \\ge 0},\\quad
    \\mu^+_j = \\operatorname{mean}\\{e_{ij} : b_{ij} = 1\\},\\quad
    \\mu^-_j = \\operatorname{mean}\\{e_{ij} : b_{ij} = 0\\}

  .. math::
    \\hat e_{ij} = b_{ij} \\mu^+_j + (1 - b_{ij}) \\mu^-_j,\\quad r = e - \\hat e

  Zeros join the positive group (bit 1, as ``kernels.bits.pack_signs`` and
  signSGD count them); a column with no entry in a group sends 0 for it. The
  two means are the reconstruction values that minimise the squared
  quantization error of each column given the bits (Seide et al. §3). The wire
  format is ``ceil(rows * columns / 8)`` bytes of packed bits plus two float32
  per column, all-gathered; the output is the mean over workers of the
  decoded ``e_hat``. Under LayerFusion a fused buffer is 1-D, i.e. one column
  with one pair of values.

  ``exchange="scatter"`` (``scatter.two_stage``, the two-stage
  error-compensated exchange of 1-bit Adam, Tang et al. 2021 §4, Alg. 1):
  the leaf is flattened and split into ``n`` chunks of ``ceil(d / n)``
  values; each chunk is one column, sent to its owner as its bits and its
  two means (scales per chunk; the leaf's own columns are not used, so a
  matrix's per-column values become per-chunk ones). ``r`` keeps what that
  lost (worker error). The owner averages the decoded chunks, adds its
  server error (kept at the leaf's size, flattened, only its chunk in use),
  re-encodes the sum with its own bits and two means, keeps what that lost
  as its new server error, and the owners' chunks are all-gathered. Both
  stages send one bit per value and 8 bytes per chunk.

  Bad input: NaN or Inf gradient coordinates are dropped by the error
  feedback (``memory.py``: the memory keeps its value there), so
  state and output stay finite. For finite ``e`` the means are finite (each
  entry is scaled by ``1 / count`` before the column sum), ``|r_ij| <=
  max_i |e_ij|`` (an entry and its group's mean have the same sign), and each
  worker's decoded payload is divided by ``n`` before the workers' are added.

  Args:
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    exchange: ``"gather"`` (all-gather bits and column means) or
      ``"scatter"`` (the two-stage exchange above; not with an
      ``exchange.Pattern`` axis).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``CompressorState``
    holding an ``ErrorFeedbackState`` per leaf (around a
    ``scatter.ServerErrorState`` in the scatter form).

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.onebit import onebit_sgd
    >>> tx = onebit_sgd()
    >>> g = {"w": jnp.array([[1.0, -2.0], [3.0, 4.0], [-1.0, 0.0]])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["w"].tolist()
    [[2.0, -2.0], [2.0, 2.0], [-1.0, 2.0]]
    >>> state.leaves["w"].residual.tolist()
    [[-1.0, 0.0], [1.0, 2.0], [0.0, -2.0]]

  References:
    Seide, Fu, Droppo, Li, Yu, *1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs*,
    Interspeech 2014, §3; paper 004 §4.1 (with the residual corrected, NOTES);
    Tang et al., *1-bit Adam*, ICML 2021, §4 and Alg. 1 (the scatter form).
  """
  if scatter.check_form(exchange, axis_name) == "scatter":
    codec = scatter.scatter_codec(TWO_MEANS, axis_name, server_error=True)
    return leafwise(error_feedback(codec))
  return leafwise(error_feedback(column_sign_codec(axis_name)))


def _two_means_encode(rows, counts, key):
  """Sign words and the means of each row's entries ``>= 0`` and ``< 0``.

  Only the first ``counts[i]`` entries of row ``i`` count (the rest is
  padding). Each entry is scaled by ``1 / count`` before the sum, so the
  means of finite rows are finite.
  """
  del key
  c = rows.shape[-1]
  valid = jnp.arange(c) < counts[:, None]
  up = rows >= 0
  n_pos = jnp.sum(up & valid, axis=-1, dtype=jnp.int32)
  n_neg = counts - n_pos
  inv_pos = 1.0 / jnp.maximum(n_pos, 1).astype(jnp.float32)
  inv_neg = 1.0 / jnp.maximum(n_neg, 1).astype(jnp.float32)
  mean_pos = jnp.sum(jnp.where(up & valid, rows * inv_pos[:, None], 0.0), axis=-1)
  mean_neg = jnp.sum(jnp.where(up, 0.0, rows * inv_neg[:, None]), axis=-1)
  return bits.pack_words(up), mean_pos, mean_neg


def _two_means_decode(payload, c):
  words, high, low = payload
  return jnp.where(bits.unpack_words(words, c), high[..., None], low[..., None])


#: 1-bit SGD's scatter form: sign bits and the two reconstruction values per chunk.
TWO_MEANS = scatter.ChunkCodec(
  encode=_two_means_encode,
  decode=_two_means_decode,
  reduce=None,
  row_bytes=lambda c: scatter.sign_row_bytes(c) + 8,
)
