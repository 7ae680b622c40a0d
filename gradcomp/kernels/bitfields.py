"""Unsigned codes of any width from 0 to 32 bits, packed end to end into bytes.

``bits.py`` packs the widths the quantizers use (1, 2, 4, 8, 12, 16 bits);
chunked top-k sends positions within a tile in ``ceil(log2(tile size))``
bits (12 for a 64 x 64 tile, 6 for a vector's chunk of 64) and quantised
values in 1 to 8 bits, so its widths are arbitrary. Codes are laid out
least significant bit first, code after code, with no padding between codes:
``n`` codes of ``b`` bits take ``ceil(n * b / 8)`` bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_BYTE_SHIFTS = np.arange(8, dtype=np.uint8)  # numpy: importing must not start JAX


def packed_bytes(count: int, bits: int) -> int:
  """Bytes :func:`pack` uses for ``count`` codes of ``bits`` bits.

  Examples:
    >>> from gradcomp.kernels.bitfields import packed_bytes
    >>> packed_bytes(64, 12), packed_bytes(3, 6), packed_bytes(5, 0)
    (96, 3, 0)
  """
  _check(bits)
  return -(-count * bits // 8)


def _check(bits: int) -> None:
  if not (isinstance(bits, int) and 0 <= bits <= 32):
    raise ValueError(f"bits must be an integer in [0, 32], got {bits!r}")


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Codes in ``[0, 2**bits)``, flattened, as ``uint8[ceil(n * bits / 8)]``.

  Bit ``j`` of code ``i`` is bit ``(i * bits + j) % 8`` of byte
  ``(i * bits + j) // 8``; the last byte's unused high bits are 0. Bits of a
  code above ``bits`` are dropped.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradcomp.kernels.bitfields import pack, unpack
    >>> packed = pack(jnp.array([5, 3, 7]), 3)  # 101, 011, 111 -> 0b11011101, 0b1
    >>> packed.tolist(), unpack(packed, 3, 3).tolist()
    ([221, 1], [5, 3, 7])
  """
  _check(bits)
  flat = codes.reshape(-1).astype(jnp.uint32)
  if bits == 0 or flat.shape[0] == 0:
    return jnp.zeros((0,), jnp.uint8)
  shifts = jnp.arange(bits, dtype=jnp.uint32)
  stream = ((flat[:, None] >> shifts) & 1).astype(jnp.uint8).reshape(-1)
  stream = jnp.pad(stream, (0, -stream.shape[0] % 8)).reshape(-1, 8)
  # A sum of disjoint fields is their OR; as a reduction XLA computes it once.
  return jnp.sum(stream << _BYTE_SHIFTS, axis=1, dtype=jnp.uint8)


def unpack(packed: jax.Array, bits: int, count: int) -> jax.Array:
  """The first ``count`` codes of :func:`pack`, as uint32."""
  _check(bits)
  if bits == 0 or count == 0:
    return jnp.zeros((count,), jnp.uint32)
  stream = ((packed.reshape(-1, 1) >> _BYTE_SHIFTS) & 1).reshape(-1)
  fields = stream[: count * bits].reshape(count, bits).astype(jnp.uint32)
  shifts = jnp.arange(bits, dtype=jnp.uint32)
  return jnp.sum(fields << shifts, axis=1, dtype=jnp.uint32)
