"""Count Sketch with block-rotation hashes: linear, mergeable, O(rows * cols + d).

A Count Sketch (Charikar, Chen & Farach-Colton 2002) of ``x in R^d`` is a
``rows x cols`` table; row ``j`` adds ``sigma_j(i) x_i`` into bucket
``h_j(i)``. It is linear in ``x``, so sketches of gradients from different
workers are merged by adding tables (an all-reduce), and the sum of the
sketches is the sketch of the summed gradient (paper 000 Alg. 1, §4.1; Ivkin
et al. 2019, ref [17]). The estimate of ``x_i`` is the median over rows of
``sigma_j(i) T[j, h_j(i)]``; each row's error has mean 0 and variance at most
``||x_{-i}||^2 / cols``, and the median over ``rows`` independent rows makes a
large error exponentially unlikely in ``rows``.

**Hash family.** Storing ``h_j`` and ``sigma_j`` as ``rows x d`` tables (or
scattering element by element) is what makes a naive Count Sketch slow and
large. Here ``x`` (zero-padded) is split into ``nb = ceil(d / cols)`` blocks
of ``cols`` consecutive coordinates, and for every row ``j`` and block ``b``
one offset ``o[j, b]`` uniform in ``[0, cols)`` and one sign ``s[j, b]`` in
``{-1, +1}`` are drawn; a sign pattern ``pi[p]`` in ``{-1, +1}`` over
positions within a block is drawn once. Coordinate ``(b, p)`` (index
``b * cols + p``) goes, in row ``j``, to bucket ``(p + o[j, b]) mod cols``
with sign ``s[j, b] * pi[p]``:

- two coordinates of one block never collide (a rotation is a bijection);
- two coordinates of different blocks collide with probability exactly
  ``1 / cols`` (``o[j, b] - o[j, b']`` is uniform mod ``cols``), and the
  product of their signs has mean 0 (``s[j, b] s[j, b']``), independently of
  whether they collide;
- rows are independent given ``pi`` (their ``o`` and ``s`` are).

Those are the pairwise properties Count Sketch's analysis uses, so every row's
estimate of ``x_i`` is unbiased with variance
``sum_{l in other blocks} x_l^2 / cols <= ||x||^2 / cols``. The ``r * nb``
offsets and signs and the ``cols`` pattern signs come from a static seed and
are recomputed inside the compiled program (a few hundred values for a 25.6M
buffer): nothing of size ``d`` is stored, and every worker derives the same
hashes.

Why the pattern ``pi``: the norm estimate (AMS: a row's sum of squares has
mean ``||x||^2``) also needs products of *four* signs to average out. With
signs constant on a block, two blocks that are shifted copies of each other
(a constant or periodic vector) line up in every bucket at once and the
estimate's variance grows to ``O(||x||^4)``; multiplying by random ``pi[p]``
brings it back to ``O(||x||^4 / cols)`` (in expectation over ``pi``) for any
fixed ``x``. ``pi`` is shared by the rows, so it costs one multiply per
coordinate, on the block while it is in cache.

**Speed.** Sketching is a windowed scatter-add: block ``b`` is one contiguous
window added at ``o[j, b]`` into a doubled row of ``2 * cols`` buckets, which
is then folded, ``T = D[:cols] + D[cols:]``. Positive and negative blocks go
to two such rows (the sign selects the row), so the updates are the blocks of
``x`` themselves and no signed copy of ``x`` is made. A loop over blocks
reads each block of ``x`` once and adds it into every row's table (the
``rows x 2 x 2 cols`` tables, 9.7 MB for ResNet-50's gradient, stay in
cache): one pass over ``x``, no padded copy of it. A scatter of the padded
``(nb, cols)`` blocks, one per row, materialized them and read them ``rows``
times (2.1x the loop's time on the ResNet-50 gradient, same process); both
add the blocks in the same order, so the tables are bit for bit the same. Estimating is the transpose, a windowed gather
``est_j[b, p] = s[j, b] * pi[p] * [T, T][j, p + o[j, b]]``: a loop over blocks
reads one contiguous window per row, and the median over up to 5 rows is a
min/max network evaluated in the same fused pass, written in place into the
``(d,)`` output. Nothing of shape ``(rows, d)`` is materialized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gradcomp.kernels import hashing

# Medians of up to this many rows use a min/max network (an elementwise
# pass); jnp.median over a rows x d array sorts and costs ~7 s on 25.6M values.
_NETWORK_ROWS = 5


class BlockHashes(NamedTuple):
  """The hash functions of a ``rows x cols`` sketch of a length-``d`` vector.

  Attributes:
    offsets: int32 ``(rows, nb)``: block ``b`` is rotated by ``offsets[j, b]``
      in row ``j``.
    signs: float32 ``(rows, nb)`` in ``{-1, +1}``: the sign of block ``b`` in
      row ``j``.
    pattern: float32 ``(cols,)`` in ``{-1, +1}``: the sign of position ``p``
      within every block, shared by the rows.
  """

  offsets: jax.Array
  signs: jax.Array
  pattern: jax.Array


def num_blocks(d: int, cols: int) -> int:
  """Number of ``cols``-long blocks covering ``d`` coordinates."""
  return max(1, -(-d // cols))


def block_hashes(rows: int, cols: int, d: int, seed: int) -> BlockHashes:
  """The hashes of a ``rows x cols`` sketch of ``d`` coordinates from ``seed``.

  Deterministic in ``(rows, cols, d, seed)``: every worker and every call
  builds the same hashes. ``rows * nb + cols`` values, computed where they are
  used (inside the compiled program), never ``rows * d``.
  """
  nb = num_blocks(d, cols)
  key_offsets, key_signs, key_pattern = jax.random.split(jax.random.PRNGKey(seed), 3)
  offsets = jax.random.randint(key_offsets, (rows, nb), 0, cols, dtype=jnp.int32)
  signs = jax.random.rademacher(key_signs, (rows, nb), dtype=jnp.float32)
  top_bit = hashing.hash_bits(key_pattern, (cols,)) >> 31
  pattern = 1.0 - 2.0 * top_bit.astype(jnp.float32)
  return BlockHashes(offsets, signs, pattern)


def _check_table(table: jax.Array) -> tuple[int, int]:
  if table.ndim != 2:
    raise ValueError(f"table must have shape (rows, cols), got {table.shape}")
  return table.shape


def sketch(x: jax.Array, rows: int, cols: int, seed: int) -> jax.Array:
  """The Count Sketch of ``x``: a float32 ``(rows, cols)`` table.

  Linear: ``sketch(a + b) == sketch(a) + sketch(b)`` (exactly, when the sums
  are exact in float32, e.g. small integers), so sketches are merged by
  adding tables.

  .. math::
    T[j, c] = \\sum_{i:\\ h_j(i) = c} \\sigma_j(i)\\, x_i,\\quad
    h_j(bC + p) = (p + o_{jb}) \\bmod C,\\quad \\sigma_j(bC + p) = s_{jb}\\, \\pi_p

  Args:
    x: array of any shape; its flat view (float32) is sketched.
    rows: static number of independent rows, >= 1.
    cols: static number of buckets per row, >= 1.
    seed: static hash seed; sketches to be merged must share it.

  Returns:
    The table, float32 of shape ``(rows, cols)``.

  References:
    Charikar, Chen & Farach-Colton 2002; paper 000 Alg. 1 (§4.1).
  """
  flat = jnp.ravel(x).astype(jnp.float32)
  d = flat.shape[0]
  h = block_hashes(rows, cols, d, seed)
  negative = (h.signs < 0).astype(jnp.int32)
  # Row j accumulates into a (2, 2 * cols) table of its own: row 0 collects
  # +1 blocks, row 1 -1 blocks, each block added as one window at its offset.
  # Like x (zeros_like), so that under shard_map the loop's carry varies
  # over the same axes as its updates.
  zeros = jnp.zeros_like(flat, shape=(rows, 2, 2 * cols))

  def add_block(acc, b, block):
    # One block, read once (it stays in cache), added into every row's table.
    block = block * h.pattern[: block.shape[0]]
    for j in range(rows):
      at = (j, negative[j, b], h.offsets[j, b])
      window = lax.dynamic_slice(acc, at, (1, 1, block.shape[0]))
      acc = lax.dynamic_update_slice(acc, window + block[None, None], at)
    return acc

  def body(b, acc):
    return add_block(acc, b, lax.dynamic_slice(flat, (b * cols,), (cols,)))

  # A loop over blocks of contiguous slices of x: one pass over x, where a
  # scatter of the padded (nb, cols) blocks materialized them (a gradient-
  # sized temporary) and read them once per row.
  full = d // cols
  acc = lax.fori_loop(0, full, body, zeros) if full else zeros
  if d > full * cols:  # The last, partial block.
    acc = add_block(acc, full, flat[full * cols :])
  doubled = acc[:, 0] - acc[:, 1]
  return doubled[:, :cols] + doubled[:, cols:]


def _median(values: list[jax.Array]) -> jax.Array:
  """Elementwise median of a list of equally shaped arrays.

  A min/max network for up to 5 inputs (fuses with whatever produces them);
  ``jnp.median`` over a stacked array otherwise. Even counts average the two
  middle values, as ``jnp.median`` does.
  """
  n = len(values)
  mn, mx = jnp.minimum, jnp.maximum

  def med3(a, b, c):
    return mx(mn(a, b), mn(mx(a, b), c))

  if n == 1:
    return values[0]
  if n == 2:
    return 0.5 * (values[0] + values[1])
  if n == 3:
    return med3(*values)
  a, b, c, d = values[:4]
  # Of four values, the larger of the two pair minima and the smaller of the
  # two pair maxima are the 2nd and 3rd smallest (in some order).
  low, high = mx(mn(a, b), mn(c, d)), mn(mx(a, b), mx(c, d))
  if n == 4:
    return 0.5 * (low + high)
  if n == 5:
    # The 1st and 4th order statistics of a..d cannot be the median of five.
    return med3(values[4], low, high)
  return jnp.median(jnp.stack(values), axis=0)


def estimate_all(
  table: jax.Array,
  d: int,
  seed: int,
  finish: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
  """Estimates of every coordinate of the sketched vector: float32 ``(d,)``.

  .. math::
    \\hat x_i = \\operatorname{median}_j\\ \\sigma_j(i)\\, T[j, h_j(i)]

  Each row's estimate has mean ``x_i`` and variance at most
  ``||x||^2 / cols``; by Chebyshev a row errs by more than
  ``3 ||x|| / sqrt(cols)`` with probability <= 1/9, and the median of 5 rows
  only when 3 of them do (probability < 0.015).

  Args:
    table: a ``(rows, cols)`` sketch from :func:`sketch` (or a sum of them).
    d: static length of the sketched vector.
    seed: the static seed the sketch was built with.
    finish: optional elementwise map ``finish(est, index) -> float32`` applied
      to the estimates (``index``: their int32 coordinates) in the same pass,
      so that a consumer of a function of the estimates (HEAVYMIX's
      priorities) does not materialize them first.

  Returns:
    float32 ``(d,)``: the estimates, or ``finish`` of them.
  """
  rows, cols = _check_table(table)
  h = block_hashes(rows, cols, d, seed)
  doubled = jnp.concatenate([table, table], axis=1).astype(jnp.float32)

  def block_estimate(b, length):
    # Block b reads, in row j, the contiguous window of buckets at o[j, b].
    per_row = [
      h.signs[j, b] * lax.dynamic_slice(doubled[j], (h.offsets[j, b],), (length,))
      for j in range(rows)
    ]
    est = _median(per_row) * h.pattern[:length]
    if finish is None:
      return est
    return finish(est, b * cols + jnp.arange(length, dtype=jnp.int32))

  def body(b, out):
    return lax.dynamic_update_slice(out, block_estimate(b, cols), (b * cols,))

  # A loop over blocks of contiguous slices, written in place: ~20x faster on
  # CPU than one fused gather, whose every element computes its own address.
  full = d // cols
  out = jnp.zeros_like(doubled, shape=(d,))
  if full:
    out = lax.fori_loop(0, full, body, out)
  if d > full * cols:  # The last, partial block.
    out = lax.dynamic_update_slice(
      out, block_estimate(full, d - full * cols), (full * cols,)
    )
  return out


def query(table: jax.Array, idx: jax.Array, d: int, seed: int) -> jax.Array:
  """Estimates of the coordinates ``idx`` (any int shape) of the sketched vector.

  Same estimator as :func:`estimate_all`, for a few coordinates: O(rows * |idx|)
  work.

  Args:
    table: a ``(rows, cols)`` sketch.
    idx: integer indices in ``[0, d)``.
    d: static length of the sketched vector.
    seed: the static seed the sketch was built with.

  Returns:
    float32 estimates with the shape of ``idx``.
  """
  rows, cols = _check_table(table)
  h = block_hashes(rows, cols, d, seed)
  idx = jnp.asarray(idx).astype(jnp.int32)
  b, p = idx // cols, idx % cols
  table = table.astype(jnp.float32)
  per_row = [
    h.signs[j][b] * table[j][(p + h.offsets[j][b]) % cols] for j in range(rows)
  ]
  return _median(per_row) * h.pattern[p]


def l2_estimate(table: jax.Array) -> jax.Array:
  """AMS estimate of ``||x||^2``: the median over rows of each row's sum of squares.

  A row's sum of squares is ``||x||^2`` plus ``2 sum sigma_l sigma_m x_l x_m``
  over colliding pairs, which has mean 0. For a vector without a dominant
  block structure its relative standard deviation is ~``sqrt(2 / cols)``
  (about 2% at ``cols = 5000``); the median over rows trims outliers.

  Args:
    table: a ``(rows, cols)`` sketch.

  Returns:
    A float32 scalar.

  References:
    Alon, Matias & Szegedy 1996; Charikar et al. 2002.
  """
  rows, _ = _check_table(table)
  squares = jnp.sum(jnp.square(table.astype(jnp.float32)), axis=1)
  return _median([squares[j] for j in range(rows)])
