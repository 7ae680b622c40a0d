"""Tiles of a leaf, cut as DeMo cuts it: each axis by its largest divisor <= chunk.

DeMo (Peng et al. 2024, arXiv 2411.19870, ``gradcomp/optimizers/demo.py``)
and SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706; Templar's
``src/tplr/compress/topk.py``) view a leaf as a matrix and cut each of its two
axes into chunks of the largest divisor of the axis that is at most
``chunk``: a 2-D leaf of 128 x 128 is four 64 x 64 tiles, a vector of 100 is
two chunks of 50. DeMo's optimizer and the chunked top-k both use this one
cut, at the kernel layer so that compressors may use it
(``tests/test_topk_chunk.py`` checks it against an independent reference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax


def chunk_size(n: int, chunk: int) -> int:
  """The largest divisor of ``n`` that is at most ``chunk`` (``n`` when smaller).

  Examples:
    >>> from gradcomp.kernels.tiles import chunk_size
    >>> chunk_size(128, 64), chunk_size(100, 64), chunk_size(17, 64), chunk_size(17, 8)
    (64, 50, 17, 1)
  """
  best = 1
  for d in range(1, math.isqrt(n) + 1):
    if n % d == 0:
      for divisor in (d, n // d):
        if best < divisor <= chunk:
          best = divisor
  return best


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
  """The matrix a leaf is tiled as: ``(1, d)`` for a vector, ``(1, 1)`` for a scalar.

  A leaf of more than two dimensions is ``(prod(shape[:-1]), shape[-1])``.
  """
  if len(shape) == 0:
    return 1, 1
  if len(shape) == 1:
    return 1, shape[0]
  return math.prod(shape[:-1]), shape[-1]


def tile_shape(shape: Sequence[int], chunk: int | None) -> tuple[int, int]:
  """``(h, w)`` of the tiles of a leaf; ``chunk=None``: the whole leaf is one tile.

  A vector's tiles are ``(1, w)`` chunks.

  Examples:
    >>> from gradcomp.kernels.tiles import tile_shape
    >>> tile_shape((128, 192), 64), tile_shape((100,), 64), tile_shape((3, 5), None)
    ((64, 64), (1, 50), (3, 5))
  """
  rows, cols = matrix_shape(shape)
  if chunk is None:
    return rows, cols
  return chunk_size(rows, chunk), chunk_size(cols, chunk)


def num_tiles(shape: Sequence[int], chunk: int | None) -> int:
  """How many tiles :func:`tile_shape` cuts a leaf of ``shape`` into."""
  h, w = tile_shape(shape, chunk)
  return math.prod(shape) // (h * w) if shape else 1


def to_tiles(x: jax.Array, chunk: int | None) -> jax.Array:
  """``x`` as ``(tiles, h * w)``: tiles in row-major order over the leaf's matrix.

  Within a tile, entry ``(b, d)`` (``b`` along rows, ``d`` along columns) is
  at ``b * w + d``, as DeMo's ``chunked_dct`` orders its coefficients.
  """
  rows, cols = matrix_shape(x.shape)
  h, w = tile_shape(x.shape, chunk)
  t = x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
  return t.reshape(-1, h * w)


def from_tiles(t: jax.Array, shape: Sequence[int], chunk: int | None) -> jax.Array:
  """Inverse of :func:`to_tiles`: an array of ``shape``."""
  rows, cols = matrix_shape(shape)
  h, w = tile_shape(shape, chunk)
  x = t.reshape(rows // h, cols // w, h, w).transpose(0, 2, 1, 3)
  return x.reshape(shape)
