"""Bit packing for the quantizers' wire formats.

Signs travel as 1 bit per coordinate (``jnp.packbits``), ternary codes
{-1, 0, +1} as 2 bits per coordinate, four to a byte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack_signs(x: jax.Array) -> jax.Array:
  """1 bit per coordinate of flat ``x``: set where ``x >= 0``. uint8[ceil(d/8)].

  The bytes of ``jnp.packbits(x >= 0)`` (first coordinate in the high bit, a
  short tail padded with 0 bits), built as an OR of eight shifted strided
  views: one element-wise loop. ``jnp.packbits`` sums a (d/8, 8) array along
  its rows, which XLA:CPU runs as a reduction at about 1.4x the time on the
  ResNet-50 buffer (BUILD_NOTES, issue 18).
  """
  flat = (x.reshape(-1) >= 0).astype(jnp.uint8)
  pad = -flat.shape[0] % 8
  if pad:
    flat = jnp.pad(flat, (0, pad))
  rows = flat.reshape(-1, 8)
  packed = rows[:, 0] << 7
  for j in range(1, 8):
    packed = packed | (rows[:, j] << (7 - j))
  return packed


def unpack_signs(bits: jax.Array, size: int) -> jax.Array:
  """+1.0 / -1.0 float32 signs from :func:`pack_signs`."""
  b = jnp.unpackbits(bits, count=size).astype(jnp.float32)
  return 2.0 * b - 1.0


WORD = 32  # bits in a word of pack_words
_WORD_SHIFTS = np.arange(WORD, dtype=np.uint32)


def pack_words(mask: jax.Array) -> jax.Array:
  """A boolean mask packed along its last axis, 32 entries to a uint32 word.

  Bit ``j`` of word ``w`` is ``mask[..., 32 * w + j]``; a ragged end of
  fewer than 32 entries is one more word, without padding the whole mask.
  The words are a row sum over a short minor axis, which XLA:CPU fuses with
  the computation of the mask and runs multi-threaded.
  """
  *lead, n = mask.shape
  body = n - n % WORD
  grouped = mask[..., :body].reshape(*lead, body // WORD, WORD).astype(jnp.uint32)
  words = jnp.sum(grouped << _WORD_SHIFTS, axis=-1, dtype=jnp.uint32)
  if body == n:
    return words
  # Not summed apart: XLA recomputed such a sum inside later consumers.
  tail = mask[..., body:].astype(jnp.uint32) << _WORD_SHIFTS[: n - body]
  tail = jnp.sum(tail, axis=-1, dtype=jnp.uint32)[..., None]
  return jnp.concatenate([words, tail], axis=-1)


def row_counts(mask: jax.Array) -> jax.Array:
  """int32 number of set entries in each row of a 2-D boolean ``mask``.

  The popcounts of :func:`pack_words`. ``jnp.sum(mask, axis=1)`` writes the
  mask, converted, to memory on XLA:CPU first (its YNNPACK reduction takes
  its operand from memory): 4 bytes per entry against 1/8 here (BUILD_NOTES,
  issue 18).
  """
  words = pack_words(mask)
  return jnp.sum(jax.lax.population_count(words), axis=1, dtype=jnp.int32)


_SHIFTS = np.array([0, 2, 4, 6], np.uint8)  # numpy: importing must not start JAX
_PAIR_SHIFTS = np.array([0, 12], np.uint32)


def pack_ternary(t: jax.Array) -> jax.Array:
  """2 bits per coordinate of flat ternary ``t`` in {-1, 0, 1}. uint8[ceil(d/4)].

  Byte ``j`` holds codes ``t + 1`` of coordinates ``4j .. 4j + 3`` at bits
  0-1, 2-3, 4-5, 6-7; a short tail is padded with code 1 (a zero). The four
  fields are disjoint, so their sum is their OR; as a sum it is a reduction,
  which XLA computes once, in memory, where it recomputed an element-wise OR
  inside each consumer. Callers that must order a write after the payload
  (``kernels/ordering.py``) rely on that.
  """
  codes = (t.reshape(-1) + 1).astype(jnp.uint8)
  pad = -codes.shape[0] % 4
  codes = jnp.pad(codes, (0, pad), constant_values=1).reshape(-1, 4)
  return jnp.sum(codes << _SHIFTS, axis=1, dtype=jnp.uint8)


def unpack_ternary(packed: jax.Array, size: int) -> jax.Array:
  """float32 {-1, 0, 1} values from :func:`pack_ternary`."""
  codes = (packed[:, None] >> _SHIFTS) & 3
  return codes.reshape(-1)[:size].astype(jnp.float32) - 1.0


# Fixed-point codes: two's complement integers of 4, 8, 12 or 16 bits. 8 and 16
# travel as int8 / int16; 4 and 12 are stored offset (code + 2^(bits-1), an
# unsigned value) and packed: two 4-bit codes to a byte, two 12-bit codes to
# three bytes (1.5 bytes per code; a uint16 per code would cost as much as 16
# bits and make 12 bits pointless on the wire).
CODE_BITS = (4, 8, 12, 16)


def _check_code_bits(bits: int) -> None:
  if bits not in CODE_BITS:
    raise ValueError(f"bits must be one of {CODE_BITS}, got {bits!r}")


def code_range(bits: int) -> tuple[int, int]:
  """The smallest and largest ``bits``-bit two's complement code."""
  return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def packed_code_bytes(size: int, bits: int) -> int:
  """Bytes :func:`pack_codes` uses for ``size`` codes of ``bits`` bits."""
  _check_code_bits(bits)
  if bits == 4:
    return -(-size // 2)
  if bits == 12:
    return 3 * -(-size // 2)
  return size * bits // 8


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """Integer ``codes`` in :func:`code_range` of ``bits``, flattened and packed.

  Returns:
    int8[d] (8 bits), int16[d] (16 bits), uint8[ceil(d/2)] (4 bits, the first
    code of each pair in the low nibble) or uint8[3 ceil(d/2)] (12 bits: for
    offset codes ``a, b`` the bytes ``a & 0xff``, ``(a >> 8) | (b & 0xf) << 4``,
    ``b >> 4``). An odd tail is padded with the code 0.
  """
  _check_code_bits(bits)
  codes = codes.reshape(-1)
  if bits == 8:
    return codes.astype(jnp.int8)
  if bits == 16:
    return codes.astype(jnp.int16)
  offset = 2 ** (bits - 1)
  wide = jnp.uint8 if bits == 4 else jnp.uint16
  u = (codes.astype(jnp.int32) + offset).astype(wide)
  u = jnp.pad(u, (0, codes.shape[0] % 2), constant_values=offset).reshape(-1, 2)
  a, b = u[:, 0], u[:, 1]
  if bits == 4:
    return a | (b << 4)
  # The pair's 24 bits as one word, summed from its two disjoint fields: a
  # reduction, which XLA computes once, in memory. Built element-wise, each
  # of the three bytes recomputed both codes (and their rounding hashes):
  # 12-bit fixed point on the ResNet-50 gradient went 32.0 / 47.6 -> 21.3 /
  # 31.7 ms layer-wise / fused (BUILD_NOTES, issue 18).
  word = jnp.sum(u.astype(jnp.uint32) << _PAIR_SHIFTS, axis=1, dtype=jnp.uint32)
  parts = [word, word >> 8, word >> 16]
  return jnp.stack([p.astype(jnp.uint8) for p in parts], axis=1).reshape(-1)


def unpack_codes(packed: jax.Array, bits: int, size: int) -> jax.Array:
  """int32 codes from :func:`pack_codes`, the first ``size`` of them."""
  _check_code_bits(bits)
  if bits in (8, 16):
    return packed.astype(jnp.int32)
  offset = 2 ** (bits - 1)
  if bits == 4:
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=1)
  else:
    t = packed.reshape(-1, 3).astype(jnp.int32)
    pairs = jnp.stack(
      [t[:, 0] | ((t[:, 1] & 0xF) << 8), (t[:, 1] >> 4) | (t[:, 2] << 4)], axis=1
    )
  return pairs.reshape(-1)[:size].astype(jnp.int32) - offset


_NIBBLE_SHIFTS = np.array([0, 4], np.uint8)


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """4-bit ``codes`` in [0, 15], flattened, two to a byte: uint8[ceil(d/2)].

  The first code of each pair in the low nibble (as :func:`pack_codes` with 4
  bits, without its offset); an odd tail is padded with 0. The two nibbles are
  a sum, a reduction that XLA computes once: as an element-wise OR it fused
  the codes' computation into the packing loop and, for FP4's codes of blocks
  of 32, recomputed each block's maximum per value (8.9 vs 0.9 ms on 2^20
  values, issue 34).
  """
  c = codes.reshape(-1).astype(jnp.uint8)
  c = jnp.pad(c, (0, c.shape[0] % 2)).reshape(-1, 2)
  return jnp.sum(c << _NIBBLE_SHIFTS, axis=1, dtype=jnp.uint8)


def unpack_nibbles(packed: jax.Array, size: int) -> jax.Array:
  """int32 codes in [0, 15] from :func:`pack_nibbles`, the first ``size`` of them."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=1)
  return pairs.reshape(-1)[:size].astype(jnp.int32)


def unpack_words(words: jax.Array, size: int) -> jax.Array:
  """The boolean mask of :func:`pack_words`, its last axis cut to ``size`` entries."""
  bits_ = (words[..., None] >> _WORD_SHIFTS) & 1
  return bits_.reshape(*words.shape[:-1], -1)[..., :size].astype(bool)
