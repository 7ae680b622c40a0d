"""Bit packing and counter-based random numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradcomp.kernels import bits, hashing


@pytest.mark.parametrize("size", [1, 7, 8, 9, 1000])
def test_signs_round_trip_in_one_bit(size):
  x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
  packed = bits.pack_signs(jnp.asarray(x))
  assert packed.dtype == jnp.uint8 and packed.shape == (-(-size // 8),)
  np.testing.assert_array_equal(
    bits.unpack_signs(packed, size), np.where(x >= 0, 1, -1)
  )


@pytest.mark.parametrize("size", [1, 7, 8, 9, 1003])
def test_sign_bytes_are_numpys_packbits(size):
  x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
  x[: min(size, 4)] = [-0.0, np.nan, np.inf, -np.inf][: min(size, 4)]
  np.testing.assert_array_equal(bits.pack_signs(jnp.asarray(x)), np.packbits(x >= 0))


@pytest.mark.parametrize("size", [1, 3, 4, 5, 1001])
def test_ternary_round_trips_in_two_bits(size):
  t = np.random.default_rng(size).integers(-1, 2, size).astype(np.float32)
  packed = bits.pack_ternary(jnp.asarray(t))
  assert packed.dtype == jnp.uint8 and packed.shape == (-(-size // 4),)
  np.testing.assert_array_equal(bits.unpack_ternary(packed, size), t)


def test_hash_uniforms_are_uniform_and_key_dependent():
  u = np.asarray(hashing.hash_uniform(jax.random.PRNGKey(0), (100_000,)))
  assert u.min() >= 0 and u.max() < 1
  counts = np.histogram(u, bins=20, range=(0, 1))[0]
  chi2 = ((counts - 5000) ** 2 / 5000).sum()
  assert chi2 < 50  # 19 dof: P(chi2 > 50) ~ 1e-4
  # Neighbouring coordinates are uncorrelated.
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
  other = np.asarray(hashing.hash_uniform(jax.random.PRNGKey(1), (100_000,)))
  assert abs(np.corrcoef(u, other)[0, 1]) < 0.02


def test_derived_keys_give_independent_streams():
  key = jax.random.PRNGKey(3)
  streams = [
    np.asarray(hashing.hash_uniform(hashing.derive(key, i), (50_000,)))
    for i in range(4)
  ]
  assert len({s.tobytes() for s in streams}) == 4
  for a in range(4):
    for b in range(a + 1, 4):
      assert abs(np.corrcoef(streams[a], streams[b])[0, 1]) < 0.03
      # Not a shifted or permuted copy either: the sorted values differ.
      assert not np.array_equal(np.sort(streams[a]), np.sort(streams[b]))
