"""Symmetric block integer quantization (kernels/blockq.py): layout, error, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

from gradcomp.kernels import bits as bitpack
from gradcomp.kernels import blockq

U = 2.0**-24  # float32 unit roundoff


def _bound(x, scales, bits, block_size):
  """Per element: s / 2 plus the float32 roundings of x * (1 / s) and c * s."""
  q = blockq.max_code(bits)
  s = np.repeat(np.asarray(scales, np.float64), block_size, axis=-1)[..., : x.shape[-1]]
  return s / 2 + s * q * 4 * U + np.abs(x) * U


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("size,block_size", [(1, 1), (7, 3), (64, 16), (1000, 128)])
def test_round_trip_within_half_a_step(bits, size, block_size):
  rng = np.random.default_rng(size + bits)
  x = (rng.standard_normal(size) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
  codes, scales = blockq.quantize(jnp.asarray(x), bits, block_size)
  blocks = -(-size // block_size)
  assert scales.shape == (blocks,) and scales.dtype == jnp.float32
  assert codes.shape == (blockq.code_bytes(size, bits, block_size),)
  assert codes.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
  out = np.asarray(blockq.dequantize(codes, scales, bits, block_size, size))
  assert out.shape == (size,) and out.dtype == np.float32
  err = np.abs(out.astype(np.float64) - x)
  assert np.all(err <= _bound(x, scales, bits, block_size))
  # The scale is the block's largest magnitude over q, to float32 rounding.
  q = blockq.max_code(bits)
  padded = np.pad(x, (0, blocks * block_size - size)).reshape(blocks, block_size)
  want = np.abs(padded).max(axis=1).astype(np.float64) / q
  np.testing.assert_allclose(np.asarray(scales, np.float64), want, rtol=2 * U)
  # quantize_dequantize agrees with the two calls.
  c2, s2, d2 = blockq.quantize_dequantize(jnp.asarray(x), bits, block_size)
  np.testing.assert_array_equal(c2, codes)
  np.testing.assert_array_equal(s2, scales)
  np.testing.assert_array_equal(d2, out)


def test_codes_layout():
  x = jnp.array([1.0, -1.0, 0.4, -0.25, 0.0])
  codes8, scales8 = blockq.quantize(x, 8, 5)
  np.testing.assert_array_equal(codes8, [127, -127, 51, -32, 0])  # 50.8, -31.75
  codes4, _ = blockq.quantize(x, 4, 5)
  ints = np.array([7, -7, 3, -2, 0])  # 2.8 and -1.75 round to 3 and -2
  np.testing.assert_array_equal(codes4, bitpack.pack_codes(jnp.asarray(ints), 4))
  np.testing.assert_allclose(scales8, [1 / 127], rtol=U)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_never_share_a_block(bits):
  rng = np.random.default_rng(1)
  rows = rng.standard_normal((3, 10)).astype(np.float32)
  rows[1] *= 1000.0
  codes, scales = blockq.quantize(jnp.asarray(rows), bits, 4)
  assert scales.shape == (3, 3)
  assert codes.shape == (3, 12 if bits == 8 else 6)
  for r in range(3):
    c, s = blockq.quantize(jnp.asarray(rows[r]), bits, 4)
    np.testing.assert_array_equal(codes[r], c)
    np.testing.assert_array_equal(scales[r], s)
  out = blockq.dequantize(codes, scales, bits, 4, 10)
  assert out.shape == (3, 10)


@pytest.mark.parametrize("bits", [4, 8])
def test_bad_input_is_defined(bits):
  big = float(np.finfo(np.float32).max)
  x = np.array(
    [0, 0, 0, 0, np.nan, 1.0, np.inf, -np.inf, big, -big, big, 1.0, np.inf, np.nan]
    + [0, 0],
    np.float32,
  )
  codes, scales = blockq.quantize(jnp.asarray(x), bits, 4)
  out = np.asarray(blockq.dequantize(codes, scales, bits, 4, x.size))
  assert np.all(np.isfinite(np.asarray(scales))) and np.all(np.isfinite(out))
  q = blockq.max_code(bits)
  assert scales[0] == 0 and np.all(out[:4] == 0)  # an all-zero block
  np.testing.assert_allclose(scales[1], 1.0 / q, rtol=U)  # from the finite 1.0 only
  assert out[4] == 0  # NaN sent as 0
  np.testing.assert_allclose(out[5:8], [1.0, 1.0, -1.0], rtol=4 * U)  # Inf saturate
  assert np.all(np.abs(out[8:11]) <= big) and out[8] > 0 > out[9]
  np.testing.assert_allclose(out[8:11], x[8:11], rtol=q * 4 * U)
  assert scales[3] == 0 and np.all(out[12:] == 0)  # Inf, NaN, 0, 0: no finite mass


def test_tiny_blocks_keep_a_normal_scale():
  x = jnp.array([1e-37, -5e-38, 0.0, 0.0], jnp.float32)
  codes, scales = blockq.quantize(x, 8, 4)
  assert float(scales[0]) == float(np.finfo(np.float32).tiny)
  out = np.asarray(blockq.dequantize(codes, scales, 8, 4, 4), np.float64)
  assert np.all(np.abs(out - np.asarray(x, np.float64)) <= float(scales[0]) / 2)


def test_invalid_arguments():
  x = jnp.ones(4)
  with pytest.raises(ValueError, match="bits must be one of"):
    blockq.quantize(x, 2, 4)
  with pytest.raises(ValueError, match="block_size must be an integer"):
    blockq.quantize(x, 8, 0)
