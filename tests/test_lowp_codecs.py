"""FP8 and FP4 codecs (issue 34): error bounds, no clipping, unbiasedness, wire bytes.

Each codec is checked against a NumPy reference of its own rule (``ml_dtypes``
for the FP8 casts, an explicit E2M1 grid for FP4) and against the bounds its
docstring states. Leaves are small and few shapes are compiled.
"""

import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import gradcomp
from configs.default import compressor as compressor_config
from gradcomp.kernels import bits
from gradcomp.parallel.wire import collective_bytes
from train.optimizer import compressor as compressor_from_config

import harness

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def single(tx, x):
  """One update of ``tx`` on one leaf ``x``; the output as float64 NumPy."""
  g = {"x": jnp.asarray(x)}
  out, state = jax.jit(tx.update)(g, tx.init(g))
  return np.asarray(out["x"], np.float64), state


def blocks(x, block_size):
  """``x`` split as the codecs split it: full blocks, then the tail."""
  step = x.size if block_size is None else block_size
  return [x[i : i + step] for i in range(0, x.size, step)]


def spread(size, seed=0):
  """float32 values over 16 binades, signs mixed, a few exact zeros."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(size) * 2.0 ** rng.integers(-12, 4, size)
  x[::37] = 0.0
  return x.astype(np.float32)


# -- FP8 ----------------------------------------------------------------------------


def fp8_reference(x, fmt, block_size):
  """Decoded values and per-element scales: s = max|x| (1 / F), RN_8(x (1 / s)) s."""
  dtype = FP8[fmt]
  fmax = np.float32(ml_dtypes.finfo(dtype).max)
  out, scales = [], []
  for b in blocks(x, block_size):
    s = np.maximum(np.max(np.abs(b)) * (np.float32(1) / fmax), np.float32(2.0**-126))
    y = np.clip(b * (np.float32(1) / s), -fmax, fmax).astype(np.float32)
    out.append(y.astype(dtype).astype(np.float32) * s)
    scales.append(np.full(b.shape, s))
  return np.concatenate(out).astype(np.float64), np.concatenate(scales)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block_size", [None, 32])
def test_fp8_rounds_to_nearest_within_half_an_ulp(fmt, block_size):
  x = spread(1000)  # 31 blocks of 32 and a tail of 8
  out, _ = single(gradcomp.fp8(fmt, block_size=block_size), x)
  want, s = fp8_reference(x, fmt, block_size)
  np.testing.assert_array_equal(out, want)
  # Half an FP8 ulp of y = x / s, at y's binade (its subnormal step below
  # the smallest normal), plus a few float32 roundings (x / s, y s, the
  # scale itself: 2^-22 relative is ample).
  info = ml_dtypes.finfo(FP8[fmt])
  m, emin = info.nmant, int(np.log2(float(info.smallest_normal)))
  y = np.abs(x.astype(np.float64)) / s
  binade = np.floor(np.log2(np.where(y > 0, y, 1.0)))
  half_ulp = 0.5 * 2.0 ** (np.maximum(binade, emin) - m)
  error = np.abs(out - x)
  assert np.all(error <= half_ulp * s * (1 + 2**-20) + 2**-22 * np.abs(x))
  # Relative bound 2^-(m + 1) where y is a normal FP8 number.
  normal = y >= 2.0**emin
  relative = error[normal] / np.abs(x[normal])
  assert relative.max() <= 2.0 ** -(m + 1) * (1 + 2**-20)
  assert relative.max() > 2.0 ** -(m + 2)  # the bound is nearly reached


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_block_max_maps_to_the_format_max_without_clipping(fmt):
  # Block maxima at a power of two, just above one, and at 1.99 * 2^j, which
  # MX's power-of-two scale clips (E4M3: 1.99 * 2^8 saturates at 1.75 * 2^8).
  two = np.float32(2.0**-5)
  tops = [two, np.nextafter(two, np.float32(1)), np.float32(1.99) * two]
  x = np.concatenate([np.array([t, -t / 3, t / 7, 0.0], np.float32) for t in tops])
  out, _ = single(gradcomp.fp8(fmt, block_size=4), x)
  for i, t in enumerate(tops):
    assert abs(out[4 * i] - t) <= 2**-22 * t, (i, out[4 * i], t)


def test_fp8_hostile_values_saturate_and_stay_finite():
  x = np.array([np.inf, -np.inf, np.nan, 1.0, 3e38, -3.4e38, 1e-38, 0.0], np.float32)
  out, _ = single(gradcomp.fp8("e5m2", block_size=4), x)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[:4], [1.0, -1.0, 0.0, 1.0])
  assert abs(out[5] + 3.4e38) <= 2**-20 * 3.4e38


# -- FP4 ----------------------------------------------------------------------------


def fp4_exponent(top):
  """The smallest k with top <= 6 * 2^k (exact), in [-126, 126]."""
  if top == 0:
    return -126
  k = math.ceil(math.log2(top / 6.0))
  while top <= 6.0 * 2.0 ** (k - 1):  # guard the float log
    k -= 1
  while top > 6.0 * 2.0**k:
    k += 1
  return int(np.clip(k, -126, 126))


def e2m1_nearest(y):
  """Nearest E2M1 value of each |y| <= 6, ties to the even code, with y's sign."""
  a = np.abs(y)[:, None]
  distance = np.abs(GRID[None, :] - a)
  best = distance.min(axis=1, keepdims=True)
  ties = distance == best
  # Among tied codes, the even one (E2M1's ties-to-even: mantissa bit 0).
  index = np.where(ties & (np.arange(8) % 2 == 0), np.arange(8), 99).min(axis=1)
  index = np.where(ties.sum(axis=1) == 1, ties.argmax(axis=1), index)
  return np.sign(y) * GRID[index]


def fp4_reference(x, block_size):
  out, spans = [], []
  for b in blocks(x.astype(np.float64), block_size):
    top = np.max(np.abs(b))
    k = fp4_exponent(top)
    assert top <= 6.0 * 2.0**k  # never clips
    out.append(e2m1_nearest(b / 2.0**k) * 2.0**k)
    spans.append(np.full(b.shape, top))
  return np.concatenate(out), np.concatenate(spans)


@pytest.mark.parametrize("block_size", [None, 32])
def test_fp4_matches_the_reference_within_a_quarter_of_the_block_max(block_size):
  x = spread(1000, seed=1)
  out, _ = single(gradcomp.fp4(block_size=block_size), x)
  want, top = fp4_reference(x, block_size)
  np.testing.assert_array_equal(out, want)
  ratio = np.abs(out - x) / np.where(top > 0, top, 1.0)
  assert ratio.max() <= 0.25
  if block_size is not None:  # over 32 blocks the bound is approached
    assert ratio.max() > 0.15


def test_nibbles_pack_two_to_a_byte_low_first():
  codes = np.arange(15) % 16  # odd: the last byte's high nibble is padding
  packed = bits.pack_nibbles(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8 and packed.shape == (8,)
  assert int(packed[0]) == 0x10 and int(packed[7]) == 0x0E
  np.testing.assert_array_equal(bits.unpack_nibbles(packed, 15), codes)


def test_fp4_sends_e2m1_values_exactly():
  # Blocks of E2M1 values times 2^j, whatever their largest value: the scale
  # makes every one of them a grid value again.
  rng = np.random.default_rng(2)
  x = rng.choice(GRID, size=(12, 8)) * rng.choice([-1.0, 1.0], size=(12, 8))
  x[:, 0] = GRID[1 + np.arange(12) % 7]  # each block's largest value differs
  x = (x * 2.0 ** rng.integers(-30, 30, size=(12, 1))).astype(np.float32)
  out, _ = single(gradcomp.fp4(block_size=8), x.reshape(-1))
  np.testing.assert_array_equal(out, x.reshape(-1))


def test_fp4_block_max_is_not_clipped():
  j = 2.0**-4
  tops = [
    np.float32(j),  # a power of two
    np.nextafter(np.float32(j), np.float32(1)),  # just above one
    np.float32(6 * j),  # the top of the range at scale 2^-4
    np.nextafter(np.float32(6 * j), np.float32(1)),  # just above: the scale doubles
    np.float32(7.9 * j),  # MX's rule clips this to 6 * 2^-4 (24 %)
  ]
  x = np.concatenate([np.array([t, -t / 5, t / 9, 0.0], np.float32) for t in tops])
  out, _ = single(gradcomp.fp4(block_size=4), x)
  np.testing.assert_array_equal(out[::4], [j, j, 6 * j, 6 * j, 8 * j])
  for i, t in enumerate(tops):
    assert np.all(np.abs(out[4 * i : 4 * i + 4] - x[4 * i : 4 * i + 4]) <= t / 4)


def test_fp4_hostile_values_saturate_and_stay_finite():
  x = np.array([np.inf, -np.inf, np.nan, 2.0, 3.4e38, -1.0, 1e-38, 0.0], np.float32)
  out, _ = single(gradcomp.fp4(block_size=4), x)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[:4], [3.0, -3.0, 0.0, 2.0])  # k = -1
  # y = 3.4e38 / 2^126 = 3.99 rounds to 4, and 4 * 2^126 = 2^128 is held at
  # float32's largest finite value.
  assert out[4] == float(np.finfo(np.float32).max)


def test_fp4_stochastic_rounding_is_unbiased():
  """The mean of N draws is within 6 sigma of x, sigma^2 = (hi - x)(x - lo) / N."""
  draws = 4000
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(16) * np.array([1.0] * 8 + [1e-3] * 8)).astype(np.float32)
  x[3] = 0.0
  tx = gradcomp.fp4(block_size=8, stochastic=True)
  g = {"x": jnp.asarray(x)}

  def step(state, _):
    out, state = tx.update(g, state)
    return state, out["x"]

  _, outs = jax.jit(lambda s: jax.lax.scan(step, s, length=draws))(tx.init(g))
  outs = np.asarray(outs, np.float64)
  lo, hi = [], []
  for b in blocks(x.astype(np.float64), 8):
    scale = 2.0 ** fp4_exponent(np.max(np.abs(b)))
    a = np.abs(b) / scale
    below = np.array([GRID[GRID <= v].max() for v in a])
    above = np.array([GRID[GRID >= v].min() for v in a])
    lo.append(np.sign(b) * np.where(b < 0, above, below) * scale)
    hi.append(np.sign(b) * np.where(b < 0, below, above) * scale)
  lo, hi = np.concatenate(lo), np.concatenate(hi)
  # Every draw is one of the two neighbours, and both occur where x is off-grid.
  assert np.all((outs == lo) | (outs == hi))
  assert np.all(((outs == lo).any(0) & (outs == hi).any(0)) | (lo == hi))
  sigma = np.sqrt((hi - x) * (x - lo) / draws)
  # 2^-24 of the spacing: the uniforms' 24 bits.
  slack = 2.0**-22 * (hi - lo)
  assert np.all(np.abs(outs.mean(0) - x) <= 6 * sigma + slack)


# -- both -----------------------------------------------------------------------------


def test_bfloat16_leaves_round_as_their_float32_values():
  x = spread(64, seed=4).astype(jnp.bfloat16)
  for tx in (gradcomp.fp8(block_size=16), gradcomp.fp4(block_size=16)):
    g = {"x": jnp.asarray(x)}
    out = tx.update(g, tx.init(g))[0]["x"]
    assert out.dtype == jnp.bfloat16
    want, _ = single(tx, np.asarray(x, np.float32))
    np.testing.assert_array_equal(
      np.asarray(out, np.float64), want.astype(jnp.bfloat16).astype(np.float64)
    )


def test_error_feedback_conserves_mass():
  rng = np.random.default_rng(5)
  grads = rng.standard_normal((3, 40)).astype(np.float32)
  for tx in (
    gradcomp.fp8("e5m2", block_size=8, error_feedback=True),
    gradcomp.fp4(block_size=8, error_feedback=True),
  ):
    state = tx.init({"x": jnp.zeros(40)})
    sent = np.zeros(40)
    for g in grads:
      out, state = tx.update({"x": jnp.asarray(g)}, state)
      sent += np.asarray(out["x"], np.float64)
    residual = np.asarray(state.leaves["x"].residual, np.float64)
    np.testing.assert_allclose(sent + residual, grads.sum(0), atol=1e-5)
    assert np.any(residual != 0)


def test_wire_bytes_are_a_quarter_and_an_eighth_of_float32_plus_scales():
  size, block = 2**14, 32
  expected = {
    "fp8 block": (gradcomp.fp8, {"block_size": block}, size + 4 * (size // block)),
    "fp8 leaf": (gradcomp.fp8, {"format": "e5m2"}, size + 4),
    "fp4": (gradcomp.fp4, {"block_size": block}, size // 2 + size // block),
  }
  grads = harness.shard({"x": jnp.zeros((harness.WORKERS, size))})
  for label, (factory, kwargs, want) in expected.items():
    tx = factory(axis_name=harness.AXIS, **kwargs)
    state = harness.worker_state(tx, {"x": jax.ShapeDtypeStruct((size,), jnp.float32)})
    text = harness.sharded_update(tx).lower(grads, state).compile().as_text()
    totals = {k: v for k, v in collective_bytes(text).items() if v}
    assert totals == {"all-gather": want}, label


def test_mean_over_workers_is_the_mean_of_the_decoded_payloads():
  grads = harness.random_grads({"x": (40,)}, seed=6)
  tx = gradcomp.fp4(block_size=8, axis_name=harness.AXIS)
  params = {"x": jnp.zeros(40)}
  out, _ = harness.sharded_update(tx)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  harness.assert_same_on_workers(out)
  decoded = [single(gradcomp.fp4(block_size=8), g)[0] for g in np.asarray(grads["x"])]
  np.testing.assert_allclose(np.asarray(out["x"])[0], np.mean(decoded, 0), rtol=1e-6)


def test_local_sgd_with_an_error_feedback_pseudo_gradient_compressor():
  for compressor in (
    gradcomp.fp8(block_size=8, error_feedback=True),
    gradcomp.fp4(block_size=8, error_feedback=True),
  ):
    tx = gradcomp.local_sgd(optax.sgd(0.1), every=2, compressor=compressor)
    params = {"w": jnp.ones((4, 4))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(4):
      grads = {"w": jnp.full((4, 4), 0.3) + i}
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
    chex.assert_tree_all_finite((params, state))
    residual = state.compressor_state.leaves["w"].residual
    assert residual.shape == (4, 4)


@pytest.mark.parametrize(
  "build, message",
  [
    (lambda: gradcomp.fp8("e4m3fnuz"), r"format must be one of \('e4m3', 'e5m2'\)"),
    (lambda: gradcomp.fp8(block_size=0), r"block_size must be an integer in \[1,"),
    (lambda: gradcomp.fp8(block_size=2.0), "block_size"),
    (lambda: gradcomp.fp4(block_size=-1), r"block_size .* got -1"),
    (lambda: gradcomp.fp4(stochastic=1), "stochastic must be True or False, got 1"),
  ],
)
def test_bad_hyperparameters_raise(build, message):
  with pytest.raises(ValueError, match=message):
    build()


def test_chosen_by_name_from_the_training_config():
  assert {"fp8", "fp4"} <= set(gradcomp.names())
  tx = compressor_from_config(compressor_config("fp8", format="e5m2"), None)
  out, _ = single(tx, np.array([1.0, 0.1], np.float32))
  np.testing.assert_allclose(out, [1.0, 0.1], rtol=2**-3)
  tx = compressor_from_config(compressor_config("fp4", stochastic=True), None)
  assert np.all(np.isfinite(single(tx, np.array([1.0, 0.1], np.float32))[0]))
