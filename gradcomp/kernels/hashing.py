"""Counter-based random numbers: cheap, stateless, per coordinate.

The default threefry PRNG costs ~280 ms for 25.6M uniforms on a 2-core CPU
(PERFORMANCE_NOTES); stochastic rounding needs one uniform per coordinate every
step. Here a uniform is the murmur3 32-bit finalizer (``fmix32``) applied to the
coordinate index mixed with a 64-bit seed drawn from a JAX key. fmix32 is a
bijection of uint32 with full avalanche, so distinct coordinates give distinct,
well-mixed words; it passes the statistical tests we need (unbiased rounding),
not cryptographic ones. The seed comes from a fresh key per step and worker, so
streams do not repeat across steps or workers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fmix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer on uint32 words."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def derive(key: jax.Array, index) -> jax.Array:
  """A key for sub-stream ``index`` (an int or an int array) of a raw uint32[2] key.

  Cheaper to compile and run than ``jax.random.fold_in`` (a threefry call per
  use, hundreds per step for a 161-leaf model); the result is a valid raw key.
  """
  salt = (jnp.asarray(index).astype(jnp.uint32) + 1) * jnp.uint32(0x9E3779B9)
  return fmix32(fmix32(key.astype(jnp.uint32) ^ salt) + salt)


def hash_bits_at(key: jax.Array, counter: jax.Array) -> jax.Array:
  """Word ``counter`` of the stream of ``key``: ``hash_bits(key, ...)[counter]``."""
  seed = key.astype(jnp.uint32)
  return fmix32(fmix32(counter.astype(jnp.uint32) ^ seed[0]) + seed[1])


def hash_bits(key: jax.Array, shape) -> jax.Array:
  """uint32 words, one per element of ``shape``, from a raw uint32[2] ``key``."""
  size = 1
  for s in shape:
    size *= s
  return hash_bits_at(key, jnp.arange(size, dtype=jnp.uint32)).reshape(shape)


def hash_below(key: jax.Array, shape, bound: int) -> jax.Array:
  """int32 values roughly uniform in ``[0, bound)`` (modulo bias < bound / 2^32)."""
  return (hash_bits(key, shape) % jnp.uint32(bound)).astype(jnp.int32)


def to_uniform(bits: jax.Array) -> jax.Array:
  """float32 uniforms in [0, 1) from the top 24 bits of uint32 words."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def hash_uniform(key: jax.Array, shape) -> jax.Array:
  """float32 uniforms in [0, 1) with 24 random bits each."""
  return to_uniform(hash_bits(key, shape))
