"""Overflow-safe reductions and saturating casts for the codecs (issue 11 §6).

A finite gradient must never leave a non-finite compressor state. The sums of
squares, sums and matrix products the codecs compute overflow float32 long
before their inputs do (``1e20 ** 2`` already does), so they are computed
on values divided by their largest magnitude, whose squares are at most 1:

.. math::
  \\|x\\|_2 = m \\sqrt{\\textstyle\\sum_i (x_i / m)^2},\\quad m = \\max_i |x_i|

and values are cast to a narrower float type by clipping them to its finite
range first (``saturate``), so a float32 result too large for a float16 leaf
becomes float16's maximum rather than an infinity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def max_abs(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
  """``max |x|`` as ``max(max x, -min x)`` (NaN if any ``x`` is NaN).

  ``jnp.max(jnp.abs(x))`` shares its ``|x|`` with any other ``|x|`` of the
  caller (XLA merges the two), and the shared one is materialised: a full
  extra buffer of ``x``'s size (TernGrad: one gradient per call, BUILD_NOTES
  issue 18).
  """
  top = jnp.max(x, axis=axis, keepdims=keepdims)
  bottom = jnp.min(x, axis=axis, keepdims=keepdims)
  return jnp.maximum(top, -bottom)


def power_of_two_above(m: jax.Array) -> jax.Array:
  """A power of two ``p`` with ``m / p`` in ``[0.5, 1)`` for normal ``m > 0``.

  Dividing by ``p`` is exact (no rounding) while nothing underflows, so values
  normalised this way keep every comparison and ratio of the originals. The
  exponent is clipped to ``[-126, 126]`` so that ``p`` and ``1 / p`` are both
  normal floats (XLA may divide by multiplying with the reciprocal, and CPUs
  flush subnormals to zero): ``m`` at or above ``2**126`` gives ``2**126``
  (``m / p < 4``), a subnormal ``m`` at most ``2**-126``, ``m = 0`` gives 1.
  ``m`` must be finite.
  """
  exponent = jnp.frexp(m.astype(jnp.float32))[1]
  exponent = jnp.clip(exponent, -126, 126)
  bits = (exponent + 127).astype(jnp.uint32) << 23
  return lax.bitcast_convert_type(bits, jnp.float32)


def scaled_norm(x: jax.Array, axis=None, keepdims: bool = False):
  """The L2 norm of ``x`` as ``(p, root)`` with ``norm = p * root``, overflow-free.

  ``p`` is the power of two just above ``max |x|`` (:func:`power_of_two_above`)
  and ``root = ||x / p||_2``: every ``|x_i / p| < 4``, so the squares neither
  overflow nor, for the largest entries, underflow; ``root`` is in
  ``[0.5, 4 sqrt(size))``, or 0 where ``x`` is all zero. Neither overflows for
  finite ``x``; the product ``p * root`` can (the norm itself may exceed the
  float32 range), so callers that need ratios like ``x / norm`` compute
  ``(x / p) / root``.

  Args:
    x: a float array; finite for a finite result.
    axis: the axes to reduce, as in ``jnp.max``.
    keepdims: as in ``jnp.max``.

  Returns:
    ``(p, root)``, float32, reduced over ``axis``.
  """
  x = x.astype(jnp.float32)
  p = power_of_two_above(max_abs(x, axis=axis, keepdims=True))
  root = jnp.sqrt(jnp.sum(jnp.square(x / p), axis=axis, keepdims=True))
  if not keepdims:
    p, root = jnp.squeeze(p, axis), jnp.squeeze(root, axis)
  return p, root


def safe_bound(dtype, factor: float) -> float:
  """The largest ``b`` of ``dtype`` with ``factor * b`` at most ``dtype``'s maximum.

  Checked exactly in float64. What each of ``factor`` payloads is clipped to
  so that their sum in ``dtype`` stays finite (a 16-bit all-reduce or
  reduce-scatter), and the largest scale whose product with the largest
  code (``factor``) decodes finite.

  Examples:
    >>> import jax.numpy as jnp
    >>> safe_bound(jnp.float16, 2) * 2 <= 65504.0
    True
  """
  high = np.asarray(jnp.finfo(dtype).max, np.float64)
  bound = np.asarray(high / factor, dtype)
  while float(bound) * factor > float(high):
    bound = np.nextafter(bound, np.asarray(0, dtype))
  return float(bound)


def saturate(x: jax.Array, dtype, high: float | None = None) -> jax.Array:
  """``x`` cast to ``dtype``, finite values clipped to ``[-high, high]`` first.

  ``high`` defaults to ``dtype``'s largest finite value, so nothing finite
  becomes an infinity in the cast. Non-finite values stay what they are (NaN
  stays NaN, +-Inf stay +-Inf), so a saturated output still shows a
  non-finite input. Without ``high``, a ``dtype`` at least as wide as ``x``'s
  is a plain cast.
  """
  dtype = jnp.dtype(dtype)
  if not (
    jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)
  ):
    return x.astype(dtype)
  if high is None:
    high = float(jnp.finfo(dtype).max)
    if high >= float(jnp.finfo(x.dtype).max):
      return x.astype(dtype)
  clipped = jnp.clip(x, -high, high)
  return jnp.where(jnp.isfinite(x), clipped, x).astype(dtype)
