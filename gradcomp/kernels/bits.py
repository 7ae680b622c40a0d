"""Bit packing for the quantizers' wire formats.

Signs travel as 1 bit per coordinate (``jnp.packbits``), ternary codes
{-1, 0, +1} as 2 bits per coordinate, four to a byte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack_signs(x: jax.Array) -> jax.Array:
  """1 bit per coordinate of flat ``x``: set where ``x >= 0``. uint8[ceil(d/8)]."""
  return jnp.packbits(x.reshape(-1) >= 0)


def unpack_signs(bits: jax.Array, size: int) -> jax.Array:
  """+1.0 / -1.0 float32 signs from :func:`pack_signs`."""
  b = jnp.unpackbits(bits, count=size).astype(jnp.float32)
  return 2.0 * b - 1.0


_SHIFTS = np.array([0, 2, 4, 6], np.uint8)  # numpy: importing must not start JAX


def pack_ternary(t: jax.Array) -> jax.Array:
  """2 bits per coordinate of flat ternary ``t`` in {-1, 0, 1}. uint8[ceil(d/4)]."""
  codes = (t.reshape(-1) + 1).astype(jnp.uint8)
  pad = -codes.shape[0] % 4
  codes = jnp.pad(codes, (0, pad), constant_values=1).reshape(-1, 4)
  shifted = codes << _SHIFTS
  return shifted[:, 0] | shifted[:, 1] | shifted[:, 2] | shifted[:, 3]


def unpack_ternary(packed: jax.Array, size: int) -> jax.Array:
  """float32 {-1, 0, 1} values from :func:`pack_ternary`."""
  codes = (packed[:, None] >> _SHIFTS) & 3
  return codes.reshape(-1)[:size].astype(jnp.float32) - 1.0
