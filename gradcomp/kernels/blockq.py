r"""Symmetric block integer quantization, as ZeRO++ does it (int8 and int4 codes).

Each block of ``block_size`` consecutive values along the last axis gets one
float32 scale, its largest finite magnitude over the largest code, and its
values are rounded to the nearest integer code, ties to even (Wang et al. 2023, *ZeRO++*,
§3 qwZ / qgZ: symmetric block-based quantization):

.. math::
  s_B = \frac{\max_{i \in B} |x_i|}{q},\quad q = 2^{b-1} - 1,\qquad
  c_i = \operatorname{round}(x_i / s_B) \in [-q, q],\qquad \hat x_i = c_i s_B

with ``b`` the bits per code (``q = 127`` for 8 bits, 7 for 4 bits). The code
range is symmetric (-128 and -8 are never used), so 0 is exact and the
decoded block is the negation of the negated one's.

API (stable: other modules import it):

- :func:`quantize(x, bits, block_size) <quantize>` -> ``(codes, scales)``.
  ``x``: float32 of shape ``(..., m)``, the last axis padded with zeros to
  ``m_pad = block_size * ceil(m / block_size)`` (a flat vector is the
  1-D case; rows of a 2-D ``x`` never share a block). ``codes``: for
  ``bits=8`` int8 ``(..., m_pad)``; for ``bits=4`` uint8
  ``(..., ceil(m_pad / 2))``, two codes to a byte, the first in the low
  nibble, each stored as ``code + 8`` (the layout of
  ``kernels.bits.pack_codes(codes, 4)``; an odd tail is padded with code 0).
  ``scales``: float32 ``(..., m_pad / block_size)``.
- :func:`dequantize(codes, scales, bits, block_size, size) <dequantize>` ->
  float32 ``(..., size)``, the first ``size`` decoded values of each row.
- :func:`quantize_dequantize`: both, and the decoded values, in one call.
- :func:`code_bytes`, :func:`num_blocks`, :func:`padded_size`,
  :func:`max_code`: the sizes, for wire-byte formulas.

Error: for finite ``x`` each decoded value is within half a step of the
value, ``|x_i - \hat x_i| <= s_B / 2``, up to float32 rounding (the codes
are ``round(x * (1 / s))``, and the product ``c s`` is rounded: together at
most ``s q 2^-22 + |x_i| 2^-24`` more). A block whose largest finite magnitude
is positive has a scale of at least ``2^-126`` (float32's smallest normal, so
the scale survives CPUs that flush subnormals): blocks of values below
``127 * 2^-126`` (about ``1.5e-36``) are quantized with that step. The scale
is at most the largest float32 ``s`` with ``q s`` finite, so decoded values
never overflow.

Bad input, defined: finite inputs give finite codes, scales and decoded
values; an all-zero block has scale 0 and decodes to 0. The scale comes from
the block's *finite* values only: ``+-Inf`` saturate at ``+-q`` (they decode
to the block's largest finite magnitude, or 0 in a block without one) and
NaN is sent as code 0. So every output is finite, whatever the input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gradcomp.kernels import numerics

BITS = (4, 8)
_TINY = float(np.finfo(np.float32).tiny)  # 2^-126
_NIBBLE_SHIFTS = np.array([0, 4], np.uint8)  # numpy: importing must not start JAX


def _check(bits: int, block_size: int) -> None:
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"block_size must be an integer in [1, inf), got {block_size!r}")


def max_code(bits: int) -> int:
  """The largest code magnitude ``q = 2^(bits - 1) - 1``: 127 or 7."""
  _check(bits, 1)
  return 2 ** (bits - 1) - 1


def num_blocks(size: int, block_size: int) -> int:
  """Blocks (scales) per row of ``size`` values: ``ceil(size / block_size)``."""
  return -(-size // block_size)


def padded_size(size: int, block_size: int) -> int:
  """Values per row after padding to whole blocks."""
  return num_blocks(size, block_size) * block_size


def code_bytes(size: int, bits: int, block_size: int) -> int:
  """Bytes of the codes of one row of ``size`` values (scales not counted)."""
  _check(bits, block_size)
  padded = padded_size(size, block_size)
  return padded if bits == 8 else -(-padded // 2)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
  """int32 codes in [-7, 7] along the last axis, two to a byte (offset 8)."""
  u = (codes + 8).astype(jnp.uint8)
  if u.shape[-1] % 2:
    pad = [(0, 0)] * (u.ndim - 1) + [(0, 1)]
    u = jnp.pad(u, pad, constant_values=8)
  u = u.reshape(*u.shape[:-1], -1, 2)
  # A sum of disjoint fields (an OR): a reduction, computed once in memory
  # (kernels.bits.pack_nibbles says why that matters on XLA:CPU).
  return jnp.sum(u << _NIBBLE_SHIFTS, axis=-1, dtype=jnp.uint8)


def _unpack_nibbles(packed: jax.Array, count: int) -> jax.Array:
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  flat = pairs.reshape(*packed.shape[:-1], -1)[..., :count]
  return flat.astype(jnp.int32) - 8


def _blocked(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` (..., m) zero-padded and viewed as (..., blocks, block_size)."""
  m = x.shape[-1]
  pad = padded_size(m, block_size) - m
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, block_size)


def _encode(x: jax.Array, bits: int, block_size: int):
  """int32 codes (..., blocks, block_size) and float32 scales (..., blocks)."""
  q = max_code(bits)
  blocks = _blocked(x.astype(jnp.float32), block_size)
  finite = jnp.where(jnp.isfinite(blocks), blocks, 0.0)
  top = jnp.maximum(jnp.max(finite, axis=-1), -jnp.min(finite, axis=-1))
  scale = jnp.where(
    top > 0,
    jnp.clip(top * np.float32(1 / q), _TINY, numerics.safe_bound(jnp.float32, q)),
    0,
  )
  inverse = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
  y = jnp.clip(blocks * inverse[..., None], -q, q)  # +-Inf saturate at +-q
  codes = jnp.where(jnp.isnan(blocks), 0.0, jnp.round(y)).astype(jnp.int32)
  return codes, scale


def _pack(codes: jax.Array, bits: int) -> jax.Array:
  flat = codes.reshape(*codes.shape[:-2], -1)
  return flat.astype(jnp.int8) if bits == 8 else _pack_nibbles(flat)


def quantize(x: jax.Array, bits: int, block_size: int) -> tuple[jax.Array, jax.Array]:
  """``(codes, scales)`` of ``x`` along its last axis (module docstring: layout).

  Args:
    x: float32 values, shape ``(..., m)``; blocks run along the last axis,
      which is zero-padded to whole blocks.
    bits: 8 (int8 codes in [-127, 127]) or 4 (codes in [-7, 7], two to a
      uint8 byte).
    block_size: values per scale, >= 1.

  Returns:
    ``codes`` (int8 ``(..., m_pad)`` or uint8 ``(..., ceil(m_pad / 2))``) and
    ``scales`` (float32 ``(..., m_pad / block_size)``).

  Examples:
    Blocks of 2: scales ``1.27 / 127`` and ``0.5 / 127``, the last block
    all zero; ``-0.4 / 0.01`` is ``-40`` steps, ``0.2`` is ``50.8``:

    >>> import jax.numpy as jnp
    >>> from gradcomp.kernels import blockq
    >>> codes, scales = blockq.quantize(jnp.array([1.27, -0.4, 0.5, 0.2, 0.0]), 8, 2)
    >>> codes.tolist(), [round(s, 6) for s in scales.tolist()]
    ([127, -40, 127, 51, 0, 0], [0.01, 0.003937, 0.0])
    >>> [round(v, 3) for v in blockq.dequantize(codes, scales, 8, 2, 5).tolist()]
    [1.27, -0.4, 0.5, 0.201, 0.0]
  """
  _check(bits, block_size)
  codes, scale = _encode(x, bits, block_size)
  return _pack(codes, bits), scale


def dequantize(
  codes: jax.Array, scales: jax.Array, bits: int, block_size: int, size: int
) -> jax.Array:
  """float32 ``(..., size)``: the first ``size`` values of each row of :func:`quantize`'s output."""
  _check(bits, block_size)
  blocks = scales.shape[-1]
  padded = blocks * block_size
  if bits == 8:
    c = codes.astype(jnp.int32)
  else:
    c = _unpack_nibbles(codes, padded)
  c = c.reshape(*c.shape[:-1], blocks, block_size).astype(jnp.float32)
  values = (c * scales[..., None]).reshape(*c.shape[:-2], padded)
  return values[..., :size]


def quantize_dequantize(x: jax.Array, bits: int, block_size: int):
  """``(codes, scales, decoded)``: :func:`quantize` and the values it decodes to.

  ``decoded`` has ``x``'s shape and is computed from the integer codes
  before packing (no unpacking pass).
  """
  _check(bits, block_size)
  codes, scale = _encode(x, bits, block_size)
  decoded = codes.astype(jnp.float32) * scale[..., None]
  decoded = decoded.reshape(*decoded.shape[:-2], -1)[..., : x.shape[-1]]
  return _pack(codes, bits), scale, decoded
