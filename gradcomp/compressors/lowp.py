"""Low-precision floating point on the wire: FP8 (E4M3, E5M2) and FP4 (E2M1).

Issue 34. Each block of values (the whole leaf, or each run of ``block_size``
consecutive values of the flattened leaf, the last one shorter) is divided by
a scale and rounded to a small float format; the payloads are all-gathered,
decoded and averaged, as the other quantizers' are (``exchange.gathered_mean``).

The scale never clips. OCP's Microscaling (MX) formats take the shared scale
``2^(floor(log2 max|x|) - emax)`` (``emax`` the element format's largest
exponent), which can push a block's largest values past the format's largest
finite value, where they are clipped: by up to 12.5 % of the value for FP8
E4M3 (``1.99 * 2^8`` saturates at ``1.75 * 2^8``) and up to 25 % for FP4
(``7.99`` saturates at 6). Here the scale is chosen from the block's largest
finite magnitude so that it maps to at most the format's largest finite value;
rounding is the only error.

The FP4 element codes are E2M1: a sign bit, two exponent bits and one mantissa
bit, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, two codes to a byte
(``kernels.bits.pack_nibbles``); FP8 rounds with JAX's ``float8_e4m3fn`` and
``float8_e5m2`` casts and sends their bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradcomp.compressors import checks, exchange, memory
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import bits as bitpack
from gradcomp.kernels import numerics
from gradcomp.kernels.hashing import hash_uniform

_TINY = float(np.finfo(np.float32).tiny)  # 2^-126, the smallest normal float32
_FLOAT32_MAX = float(np.finfo(np.float32).max)

#: The FP8 formats by name: JAX's dtype (``fn``: finite, no infinities, one NaN).
FP8_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}

FP4_MAX = 6.0  # the largest E2M1 magnitude
# E8M0 exponents of the FP4 blocks: 2^k with k in [-126, 126] (a normal float32;
# any finite float32 magnitude is at most 6 * 2^126), sent biased by 127 as
# MX's E8M0 is, one uint8 per block.
_E8M0_BIAS = 127
_K_MIN, _K_MAX = -126, 126


def _blocks(flat: jax.Array, block_size: int | None) -> list[jax.Array]:
  """``flat`` as 2-D parts: the full blocks (groups, block), then the tail (1, r).

  Views, not a padded copy of the leaf (as QSGD's buckets).
  """
  size = flat.shape[0]
  block = size if block_size is None else min(block_size, size)
  body = size - size % block
  parts = [flat[:body].reshape(-1, block)]
  if body < size:
    parts.append(flat[body:].reshape(1, -1))
  return parts


def _finite_max_abs(part: jax.Array) -> jax.Array:
  """Each row's largest finite magnitude, shape (rows, 1); 0 for a row of none."""
  finite = jnp.where(jnp.isfinite(part), part, 0.0)
  return numerics.max_abs(finite, axis=1, keepdims=True)


def _pow2(k: jax.Array) -> jax.Array:
  """float32 ``2^k`` for integer ``k`` in [-126, 127], exactly (built from its bits)."""
  biased = (k.astype(jnp.int32) + 127).astype(jnp.uint32) << 23
  return lax.bitcast_convert_type(biased, jnp.float32)


def _fp8_values(bits: jax.Array, dtype) -> jax.Array:
  """float32 values of FP8 codes sent as their uint8 bit patterns."""
  return lax.bitcast_convert_type(bits, dtype).astype(jnp.float32)


@recorded
def fp8(
  format: str = "e4m3",
  *,
  block_size: int | None = None,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """FP8 payloads (E4M3 or E5M2) with a float32 scale per block, all-gathered.

  Each block ``B`` (the leaf, or ``block_size`` consecutive values of the
  flattened leaf) sends its values divided by a float32 scale, rounded to
  the nearest FP8 value (ties to even), and the scale:

  .. math::
    s_B = \\max\\Big(\\frac{\\max_{i \\in B} |x_i|}{F}, 2^{-126}\\Big),\\qquad
    \\hat x_i = s_B \\operatorname{RN}_8(x_i / s_B)

  with ``F`` the format's largest finite value (448 for E4M3, 57344 for
  E5M2), computed in float32 as ``max|x| * (1 / F)``, and ``x / s`` as
  ``x * (1 / s)``. The block's largest magnitude maps to ``F`` itself, never beyond
  it (MX's power-of-two scale clips by up to 12.5 %, module docstring), so
  the only error is the rounding: per element at most half an FP8 ulp of
  the scaled value ``y = x / s``,

  .. math::
    |\\hat x_i - x_i| \\le \\tfrac12\\, s_B\\, \\operatorname{ulp}_8(y_i)
    \\le 2^{-(m+1)} |x_i| \\quad (y_i \\text{ normal in FP8})

  with ``m`` mantissa bits (3 for E4M3: 6.25 %; 2 for E5M2: 12.5 %), and
  ``s_B 2^(e_min - m - 1)`` in FP8's subnormal range; plus the float32
  roundings of ``s`` and of ``x / s`` and ``y s`` (a few ``2^-24``
  relative; where ``x / s`` rounds just above ``F`` it is held at ``F``).
  Decided: a scale per leaf when ``block_size`` is ``None`` (not none at
  all): gradients are far from FP8's range (E4M3's smallest normal is
  2^-6), and one float32 per leaf is free.

  Wire format: one FP8 value per coordinate (the bits of a ``float8_e4m3fn``
  / ``float8_e5m2`` array, bitcast to uint8 for the collective: XLA:CPU
  widens an f8 all-gather to f16, twice the bytes) and one float32 scale
  per block: ``d + 4 ceil(d / block_size)`` bytes per worker.

  Bad input: outputs are always finite. The scale comes from the block's
  finite values; +-Inf saturate at ``+-F s`` (the block's largest finite
  magnitude), NaN is sent as 0. Scales are at most ``float32 max / F``, so
  a decoded value never overflows. With ``error_feedback=True`` the memory
  keeps the rounding error and drops a NaN or Inf gradient (``memory.py``).

  Args:
    format: ``"e4m3"`` (``jnp.float8_e4m3fn``: 3 mantissa bits, up to 448)
      or ``"e5m2"`` (``jnp.float8_e5m2``: 2 mantissa bits, up to 57344).
    block_size: values per scale (>= 1), or ``None`` for one scale per leaf.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: add a memory of the rounding error (rounding to nearest
      is biased, if by at most half an ulp).

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.fp8()  # E4M3, one scale s = 7 / 448 = 1/64
    >>> g = {"w": jnp.array([7.0, -1.0, 0.3, 0.0])}
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()  # 0.3 / s = 19.2 rounds to 20
    [7.0, -1.0, 0.3125, 0.0]
    >>> gradcomp.fp8("e3m4")
    Traceback (most recent call last):
      ...
    ValueError: format must be one of ('e4m3', 'e5m2'), got 'e3m4'

  References:
    Micikevicius et al., *FP8 Formats for Deep Learning*, arXiv:2209.05433
    (E4M3 and E5M2, §3); OCP *Microscaling Formats (MX) v1.0* §5.3 and §6.3
    (the shared-scale rule that clips, which this one does not).
  """
  if format not in FP8_FORMATS:
    raise ValueError(f"format must be one of {tuple(FP8_FORMATS)}, got {format!r}")
  if block_size is not None:
    block_size = checks.at_least("block_size", block_size, 1)
  dtype = FP8_FORMATS[format]
  fmax = float(jnp.finfo(dtype).max)
  cap = numerics.safe_bound(jnp.float32, fmax)  # decoded values never overflow

  def encode(part):
    # Products with reciprocals, said explicitly: XLA:CPU turns x / s into
    # x * (1 / s) anyway, and a reference can then round alike.
    scale = jnp.clip(_finite_max_abs(part) * np.float32(1 / fmax), _TINY, cap)
    y = jnp.clip(part * (1.0 / scale), -fmax, fmax)
    y = jnp.where(jnp.isnan(part), 0.0, y)
    # The FP8 bits travel as uint8: XLA:CPU widens an f8 all-gather to f16.
    return lax.bitcast_convert_type(y.astype(dtype), jnp.uint8), scale[:, 0]

  def apply(x, state, key, step):
    del key, step
    parts = _blocks(x.reshape(-1), block_size)
    payload = tuple(encode(p) for p in parts)

    def decode(*payload):
      pieces = [(_fp8_values(q, dtype) * s[:, None]).reshape(-1) for q, s in payload]
      return jnp.concatenate(pieces).reshape(x.shape)

    mean = exchange.gathered_mean(payload, decode, axis_name)
    return mean, x - decode(*payload), state

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback))


def e2m1_round(y: jax.Array, u: jax.Array | None) -> jax.Array:
  """E2M1 magnitude indices 0..7 of ``|y|``, ``|y| <= 6``: nearest, or stochastic.

  The grid's step is 0.5 below 2, 1 in [2, 4) and 2 from 4 up (``region``
  0, 1, 2), and the magnitude with index ``i`` is ``(i - 2 region) step``.
  ``|y| / step`` is exact (a power of two); it is rounded to the nearest
  integer, ties to even (the even index: E2M1's ties-to-even), or, given
  uniforms ``u``, up with probability ``t - floor(t)`` (exact in float32).
  """
  a = jnp.abs(y)
  region = (a >= 2.0).astype(jnp.int32) + (a >= 4.0).astype(jnp.int32)
  t = a * (2.0 / (1 << region).astype(jnp.float32))  # a / step
  if u is None:
    r = jnp.round(t)
  else:
    f = jnp.floor(t)
    r = f + (u < t - f).astype(jnp.float32)
  return r.astype(jnp.int32) + 2 * region


def e2m1_values(codes: jax.Array) -> jax.Array:
  """float32 values of 4-bit E2M1 codes (sign in bit 3, then E1 E0 M)."""
  e = (codes >> 1) & 3
  m = codes & 1
  magnitude = jnp.where(
    e == 0, 0.5 * m.astype(jnp.float32), ((2 + m) << e).astype(jnp.float32) * 0.25
  )
  return jnp.where(codes >= 8, -magnitude, magnitude)


@recorded
def fp4(
  *,
  block_size: int | None = 32,
  stochastic: bool = False,
  seed: int = 0,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """FP4 (E2M1) payloads with a power-of-two (E8M0) scale per block, all-gathered.

  Each block ``B`` of ``block_size`` consecutive values (MX's 32 by default)
  sends a power-of-two scale ``2^k`` and its values divided by it, rounded to
  E2M1: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign. ``k`` is the
  smallest exponent with ``max|x_B| <= 6 * 2^k``, so nothing is clipped
  (MX's ``k = floor(log2 max|x_B|) - 2`` clips up to 25 %: module
  docstring); from ``max|x_B| = m 2^e``, ``m`` in [0.5, 1) (``frexp``),
  ``k = e - 3`` when ``m <= 0.75`` and ``e - 2`` otherwise, exactly.

  Error bound, rounding to nearest: the scaled block ``y = x / 2^k`` has
  ``max|y|`` in (3, 6], and E2M1's spacing is 0.5 below 2, 1 in [2, 4] and
  2 in [4, 6], so an element's error is at most half the spacing where it
  lies, times ``2^k``. If ``max|y| >= 4``, that is at most 1, and ``2^k <=
  max|x_B| / 4``; if ``max|y| < 4``, it is at most 0.5, and ``2^k <
  max|x_B| / 3``. Either way

  .. math:: |\\hat x_i - x_i| \\le \\max_{j \\in B} |x_j| / 4,

  and values on the scaled grid are sent exactly. With ``stochastic=True``
  each ``y_i`` rounds to one of its two neighbours ``lo <= y_i <= hi``, up
  with probability ``(y_i - lo) / (hi - lo)``: unbiased (up to ``2^-24``,
  as :func:`gradcomp.fixed_point`), with variance ``(hi - y_i)(y_i - lo)
  4^k`` and an error below the spacing, at most ``max|x_B| / 2``.

  Wire format: two 4-bit codes to a byte (``kernels.bits.pack_nibbles``,
  the first code in the low nibble; a code is the E2M1 bit pattern, sign in
  bit 3) and one uint8 per block, ``k + 127`` (MX's E8M0; ``k`` in [-126, 126]):
  ``ceil(d / 2) + ceil(d / block_size)`` bytes per worker.

  Bad input: outputs are always finite. ``k`` comes from the block's
  finite values; +-Inf saturate at ``+-6 * 2^k``, NaN is sent as 0. Any
  finite float32 fits (``max|y| < 4`` when ``k = 126``); one that rounds to
  ``4 * 2^126 = 2^128`` (above ``3.5 * 2^126``, 2.98e38) decodes as float32's
  largest finite value, within the bound. Blocks whose
  largest magnitude is below ``6 * 2^-126`` keep ``k = -126`` (their
  values, near float32's smallest normals, may flush to 0). With
  ``error_feedback=True`` the memory keeps the rounding error and drops a
  NaN or Inf gradient (``memory.py``).

  Args:
    block_size: values per scale (>= 1), or ``None`` for one per leaf.
    stochastic: round stochastically (unbiased) instead of to nearest.
    seed: seeds the rounding stream (used when ``stochastic``).
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: add a memory of the rounding error.

  Returns:
    An ``optax.GradientTransformation``; unbiased when ``stochastic=True``
    and ``error_feedback=False``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.fp4(block_size=4)  # 7.0 = 0.875 * 2^3: k = 1, y = 3.5 -> 4
    >>> g = {"w": jnp.array([7.0, -2.5, 1.0, 0.4, 3.0, 1.5, 0.0, -0.75])}
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [8.0, -2.0, 1.0, 0.0, 3.0, 1.5, 0.0, -0.75]
    >>> gradcomp.fp4(block_size=0)
    Traceback (most recent call last):
      ...
    ValueError: block_size must be an integer in [1, inf), got 0

  References:
    OCP *Microscaling Formats (MX) v1.0* §5 (E2M1, E8M0, blocks of 32) and
    §6.3 (its scale rule, which clips); Rouhani et al., *Microscaling Data
    Formats for Deep Learning*, arXiv:2310.10537.
  """
  if block_size is not None:
    block_size = checks.at_least("block_size", block_size, 1)
  if not isinstance(stochastic, bool):
    raise ValueError(f"stochastic must be True or False, got {stochastic!r}")

  def encode(part, u):
    top = _finite_max_abs(part)
    mantissa, e = jnp.frexp(top)  # top = mantissa 2^e, mantissa in [0.5, 1)
    k = jnp.where(mantissa <= 0.75, e - 3, e - 2)
    k = jnp.clip(jnp.where(top > 0, k, _K_MIN), _K_MIN, _K_MAX)
    y = jnp.clip(part * _pow2(-k), -FP4_MAX, FP4_MAX)  # exact: a power of two
    y = jnp.where(jnp.isnan(part), 0.0, y)
    index = e2m1_round(y, u)
    codes = jnp.where(y < 0, index + 8, index)
    return codes.reshape(-1), (k[:, 0] + _E8M0_BIAS).astype(jnp.uint8)

  def apply(x, state, key, step):
    del step
    size = x.size
    parts = _blocks(x.reshape(-1), block_size)
    if stochastic:
      u = hash_uniform(exchange.worker_key(key, axis_name), (size,))
      uniforms = _blocks(u, block_size)
    else:
      uniforms = [None] * len(parts)
    encoded = [encode(p, u_p) for p, u_p in zip(parts, uniforms, strict=True)]
    codes = jnp.concatenate([c for c, _ in encoded])
    packed = bitpack.pack_nibbles(codes)
    exponents = jnp.concatenate([k for _, k in encoded])
    lengths = [p.shape for p in parts]

    def decode(packed, exponents):
      values = e2m1_values(bitpack.unpack_nibbles(packed, size))
      scales = _pow2(exponents.astype(jnp.int32) - _E8M0_BIAS)
      pieces, start, first = [], 0, 0
      for groups, length in lengths:
        v = values[start : start + groups * length].reshape(groups, length)
        v = v * scales[first : first + groups, None]  # 4 * 2^126 is 2^128: held
        pieces.append(jnp.clip(v, -_FLOAT32_MAX, _FLOAT32_MAX).reshape(-1))
        start += groups * length
        first += groups
      return jnp.concatenate(pieces).reshape(x.shape)

    payload = (packed, exponents)
    mean = exchange.gathered_mean(payload, decode, axis_name)
    return mean, x - decode(*payload), state

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)
