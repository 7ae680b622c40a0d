"""1-bit SGD, fixed point and dynamic fixed point (issue 17; paper 004 §4.1).

Each against a float64 NumPy reference written from the papers (STYLE §13),
plus its invariants: 1-bit SGD's error feedback conserves mass, stochastic
rounding is unbiased inside the range, the dynamic exponent follows the
overflow rule, and the bytes on the wire, read from the compiled HLO, are the
packed payloads'.
"""

import doctest
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import fixed_point as fixed_point_module
from gradcomp.compressors import onebit as onebit_module
from gradcomp.compressors.fixed_point import (
  DynamicFixedPointState,
  dynamic_fixed_point,
  fixed_point,
)
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.compressors.onebit import onebit_sgd
from gradcomp.compressors.spec import spec_of
from gradcomp.kernels import bits
from gradcomp.parallel import wire

import harness

AXIS, N = harness.AXIS, harness.WORKERS


@pytest.mark.parametrize("module", [onebit_module, fixed_point_module])
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def steps_on_workers(tx, grads):
  """``tx`` on 8 workers over grads of shape (T, workers, ...): outputs (T, ...)."""
  params = jax.tree.map(lambda g: jnp.zeros(g.shape[2:], g.dtype), grads)
  outputs, state = harness.sharded_steps(tx)(
    harness.shard(jax.tree.map(jnp.asarray, grads), P(None, AXIS)),
    harness.worker_state(tx, params),
  )
  return jax.tree.map(lambda a: np.asarray(a, np.float64), outputs), state


def single(tx, x):
  """One single-device update of the leaf ``x``."""
  out, state = jax.jit(tx.update)({"x": x}, tx.init({"x": x}))
  return np.asarray(out["x"], np.float64), state


# -- packed codes ------------------------------------------------------------


@pytest.mark.parametrize("width", bits.CODE_BITS)
@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_codes_round_trip_packed(width, size):
  low, high = bits.code_range(width)
  codes = np.random.default_rng(size).integers(low, high + 1, size)
  codes[: min(size, 2)] = [low, high][: min(size, 2)]
  packed = bits.pack_codes(jnp.asarray(codes, jnp.int32), width)
  assert packed.nbytes == bits.packed_code_bytes(size, width)
  want = {4: -(-size // 2), 8: size, 12: 3 * -(-size // 2), 16: 2 * size}[width]
  assert packed.nbytes == want
  np.testing.assert_array_equal(bits.unpack_codes(packed, width, size), codes)


@pytest.mark.parametrize("shape", [(1, 1000), (3, 32), (2, 45), (4, 7), (2, 0)])
def test_row_counts_match_numpy(shape):
  # Words of 32 plus a ragged end; the dynamic fixed point's overflow rates.
  mask = np.random.default_rng(shape[1]).random(shape) < 0.3
  got = jax.jit(bits.row_counts)(jnp.asarray(mask))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, mask.sum(axis=1))


# -- 1-bit SGD ---------------------------------------------------------------


def onebit_reference(g):
  """Seide et al. with the corrected residual, float64: g has shape (T, W, ...).

  Returns the per-step mean of the decoded payloads, the final residuals
  (W, ...) and the smallest |e| met (how far every bit was from flipping).
  """
  steps, workers, *shape = g.shape
  cols = shape[-1] if len(shape) >= 2 else 1
  rows = int(np.prod(shape)) // cols
  residual = np.zeros((workers, rows, cols))
  outputs, closest = [], np.inf
  for t in range(steps):
    decoded = np.zeros((workers, rows, cols))
    for w in range(workers):
      e = residual[w] + g[t, w].reshape(rows, cols)
      closest = min(closest, np.abs(e).min())
      for j in range(cols):
        col = e[:, j]
        pos, neg = col[col >= 0], col[col < 0]
        high = pos.mean() if pos.size else 0.0
        low = neg.mean() if neg.size else 0.0
        decoded[w, :, j] = np.where(col >= 0, high, low)
      residual[w] = e - decoded[w]
    outputs.append(decoded.mean(axis=0).reshape(shape))
  return np.stack(outputs), residual.reshape(workers, *shape), closest


def test_onebit_matches_numpy_on_eight_workers():
  shapes = {"conv": (4, 3, 5), "vector": (37,), "scalar": ()}
  rng = np.random.default_rng(0)
  grads = {
    k: rng.standard_normal((4, N, *s)).astype(np.float32) for k, s in shapes.items()
  }
  outputs, state = steps_on_workers(onebit_sgd(axis_name=AXIS), grads)
  for k, g in grads.items():
    want, residual, closest = onebit_reference(g.astype(np.float64))
    # float32 changes no bit: every |e| is far above the ~1e-6 it errs by.
    assert closest > 1e-4, closest
    # Column means of <= 37 float32 terms over 4 steps: a few 1e-6 at most.
    np.testing.assert_allclose(outputs[k], want, rtol=1e-5, atol=1e-5)
    got = np.asarray(state.leaves[k].residual, np.float64)
    np.testing.assert_allclose(got, residual, rtol=1e-5, atol=1e-5)
  # A scalar is its own column: sent exactly, nothing left.
  np.testing.assert_array_equal(np.asarray(state.leaves["scalar"].residual), 0.0)


def test_onebit_columns_are_the_last_axis():
  x = np.array([[1.0, -1.0, 0.0], [3.0, -3.0, -4.0]], np.float32)
  out, state = single(onebit_sgd(), jnp.asarray(x))
  # Column means; the zero joins the positive group (alone there: exact).
  np.testing.assert_array_equal(out, [[2.0, -2.0, 0.0], [2.0, -2.0, -4.0]])
  np.testing.assert_array_equal(state.leaves["x"].residual, [[-1, 1, 0], [1, -1, 0]])
  # The same values as one column (a vector) share one pair of means.
  out, _ = single(onebit_sgd(), jnp.asarray(x.reshape(-1)))
  np.testing.assert_allclose(
    out, np.where(x.reshape(-1) >= 0, 4 / 3, -8 / 3), rtol=1e-6
  )


def test_onebit_error_feedback_conserves_mass():
  """sum_t out_t + mean_w residual_w == sum_t mean_w g_w (float64 sums)."""
  g = np.random.default_rng(1).standard_normal((20, N, 10, 10)).astype(np.float32)
  outputs, state = steps_on_workers(onebit_sgd(axis_name=AXIS), {"x": g})
  sent = outputs["x"].sum(axis=0)
  residual = np.asarray(state.leaves["x"].residual, np.float64).mean(axis=0)
  total = g.astype(np.float64).sum(axis=(0, 1)) / N
  # 20 steps of float32 rounding of terms of size <= ~10: well below 1e-4;
  # lost mass (a residual dropped or sent twice) is O(1).
  np.testing.assert_allclose(sent + residual, total, atol=1e-4)
  assert np.abs(residual).max() < 10  # the memory stays bounded


def test_onebit_drops_non_finite_coordinates_and_loses_no_mass():
  tx = onebit_sgd()
  good = {"x": jnp.arange(20.0).reshape(4, 5) - 7.3}
  _, state = tx.update(good, tx.init(good))
  before = np.asarray(state.leaves["x"].residual)
  out, after = tx.update({"x": good["x"].at[0, 1].set(jnp.nan)}, state)
  chex.assert_tree_all_finite((out, after))
  kept = np.asarray(good["x"]).copy()
  kept[0, 1] = 0.0  # the NaN coordinate counts as 0
  np.testing.assert_allclose(
    np.asarray(out["x"]) + np.asarray(after.leaves["x"].residual),
    before + kept,
    atol=1e-5,
  )


def test_onebit_state_is_error_feedback():
  state = onebit_sgd().init({"x": jnp.zeros((3, 4))})
  assert isinstance(state.leaves["x"], ErrorFeedbackState)


# -- fixed point --------------------------------------------------------------


def floor_eps(x, eps):
  return np.floor(np.asarray(x, np.float64) / eps) * eps


@pytest.mark.parametrize(
  "width, int_bits", [(4, 2), (8, 1), (12, 3), (16, 1), (8, -4), (8, 10)]
)
def test_fixed_point_rounds_to_a_neighbour_and_saturates(width, int_bits):
  eps = 2.0 ** (int_bits - width)
  low, high = -(2.0 ** (int_bits - 1)), 2.0 ** (int_bits - 1) - eps
  rng = np.random.default_rng(width)
  inside = rng.uniform(low, high, 200)
  on_grid = rng.integers(-(2 ** (width - 1)), 2 ** (width - 1), 50) * eps
  x = np.concatenate([inside, on_grid, [low, high, 0.0]]).astype(np.float32)
  out, _ = single(fixed_point(width, int_bits=int_bits), jnp.asarray(x))
  down = floor_eps(x, eps)
  assert np.all((out == down) | (out == down + eps))
  np.testing.assert_array_equal(out[200:], x[200:])  # representable: exact
  # Saturation: beyond the range, +-Inf, 1e38; NaN is sent as 0.
  hostile = np.array([2 * high + 1, -2 * high - 1, np.inf, -np.inf, 1e38, np.nan])
  out, _ = single(
    fixed_point(width, int_bits=int_bits), jnp.asarray(hostile, jnp.float32)
  )
  np.testing.assert_array_equal(out, [high, low, high, low, high, 0.0])


def sample_outputs(tx, x, draws):
  """``draws`` single-device outputs for the same input, fresh randomness each."""

  def body(state, _):
    out, state = tx.update({"x": x}, state)
    return state, out["x"]

  run = jax.jit(lambda s: jax.lax.scan(body, s, None, length=draws)[1])
  return np.asarray(run(tx.init({"x": x})), np.float64)


@pytest.mark.parametrize("width", [4, 8, 12])
def test_fixed_point_is_unbiased_inside_the_range(width):
  """Mean of N roundings of x is x: within 5 sigma, sigma^2 = eps^2 p (1 - p) / N.

  With p = (x - floor_eps(x)) / eps the chance of rounding up. Rounding up
  with probability 1 - p (the survey's inverted rule) errs by (1 - 2p) eps,
  tens of sigma here.
  """
  eps = 2.0 ** (1 - width)  # int_bits = 1: [-1, 1)
  rng = np.random.default_rng(width)
  p = rng.uniform(0.05, 0.95, 64)  # keeps the binomial near normal
  k = rng.integers(-(2 ** (width - 1)), 2 ** (width - 1) - 1, 64)
  x = ((k + p) * eps).astype(np.float32)
  p = (x - floor_eps(x, eps)) / eps  # the exact probability of the float32 x
  draws = 2000
  outs = sample_outputs(fixed_point(width), jnp.asarray(x), draws)
  sigma = eps * np.sqrt(p * (1 - p) / draws)
  z = (outs.mean(axis=0) - x) / sigma
  # 64 coordinates, |z| > 5 has probability ~6e-7 each when unbiased.
  assert np.abs(z).max() < 5.0, np.abs(z).max()
  # The up-rate itself is p (not 1 - p): its empirical value per coordinate.
  up = (outs - floor_eps(x, eps)).mean(axis=0) / eps
  assert np.abs(up - p).max() < 5 * np.sqrt(0.25 / draws)


def test_fixed_point_rounding_is_independent_between_workers():
  """The mean of 8 workers' roundings of one vector has 1/8 of the variance."""
  x = np.random.default_rng(2).uniform(-0.9, 0.9, 512).astype(np.float32)
  grads = {"x": np.broadcast_to(x, (1, N, 512)).copy()}
  outputs, _ = steps_on_workers(fixed_point(4, axis_name=AXIS), grads)
  one, _ = single(fixed_point(4), jnp.asarray(x))
  ratio = np.var(outputs["x"][0] - x) / np.var(one - x)
  assert 0.06 < ratio < 0.25, ratio


def test_fixed_point_mean_over_workers_is_exact_on_the_grid():
  rng = np.random.default_rng(3)
  g = (rng.integers(-128, 128, (1, N, 33)) / 128).astype(np.float32)
  outputs, _ = steps_on_workers(fixed_point(8, axis_name=AXIS), {"x": g})
  harness.assert_mean_over_workers(outputs["x"][0], g[0])


def test_fixed_point_error_feedback_keeps_what_saturation_clipped():
  tx = fixed_point(8, error_feedback=True)
  x = {"x": jnp.array([3.0, -0.25])}
  out, state = tx.update(x, tx.init(x))
  np.testing.assert_array_equal(out["x"], [127 / 128, -0.25])
  np.testing.assert_array_equal(state.leaves["x"].residual, [3 - 127 / 128, 0.0])


# -- dynamic fixed point ------------------------------------------------------


def dfxp_reference(g, width, *, block=None, rho=1e-4, every=1, int_bits=None):
  """Courbariaux et al.'s dynamic fixed point in NumPy, one worker.

  ``g`` has shape (T, d). Rounds to nearest (half to even); the exponents do
  not depend on the rounding (overflow is judged before it). Returns outputs
  (T, d) and the exponent of each group used at each step (T, groups).
  """
  steps, d = g.shape
  block = d if block is None else block
  starts = list(range(0, d, block))
  low, high = -(2 ** (width - 1)), 2 ** (width - 1) - 1
  exps = np.full(len(starts), 0 if int_bits is None else int_bits - width)
  sums = np.zeros((2, len(starts)))
  outs, used = np.zeros((steps, d)), []
  for t in range(steps):
    if t == 0 and int_bits is None:
      exps = np.array([np.frexp(np.abs(g[0, s : s + block]).max())[1] for s in starts])
      exps = exps - (width - 1)
    used.append(exps.copy())
    for i, s in enumerate(starts):
      x = g[t, s : s + block].astype(np.float64)
      scaled = x / 2.0 ** exps[i]
      codes = np.round(np.clip(scaled, low, high))
      outs[t, s : s + block] = codes * 2.0 ** exps[i]
      sums[0, i] += np.mean((scaled > high) | (scaled < low))
      sums[1, i] += np.mean((2 * scaled > high) | (2 * scaled < low))
    if (t + 1) % every == 0:
      r, r_1 = sums / every
      exps = exps + np.where(r > rho, 1, np.where(r_1 > rho, 0, -1))
      sums[:] = 0
  return outs, np.array(used)


def dfxp_steps(tx, g):
  """Outputs and the exponents each step used, one device, step by step."""
  state = tx.init({"x": jnp.zeros(g.shape[1])})
  update = jax.jit(tx.update)
  outs, used = [], []
  for t in range(g.shape[0]):
    used.append(np.asarray(state.leaves["x"].exponent, np.int64))
    out, state = update({"x": jnp.asarray(g[t])}, state)
    outs.append(np.asarray(out["x"], np.float64))
  return np.stack(outs), np.stack(used), state


def growing(steps=14, d=40, seed=4):
  """Gradients whose scale grows by 1.6x a step, with a heavy tail."""
  rng = np.random.default_rng(seed)
  base = rng.standard_t(3, (steps, d)) * 1e-3
  return (base * 1.6 ** np.arange(steps)[:, None]).astype(np.float32)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(width=12),
    dict(width=8, block=16),  # groups of 16, 16 and 8
    dict(width=8, block=16, rho=0.05, every=3),
    dict(width=4, int_bits=-2, rho=0.1),  # starts far too small
  ],
  ids=["leaf", "blocks", "every3", "from_int_bits"],
)
def test_dynamic_fixed_point_follows_the_overflow_rule(kwargs):
  g = growing()
  tx = dynamic_fixed_point(
    kwargs["width"],
    block_size=kwargs.get("block"),
    max_overflow_rate=kwargs.get("rho", 1e-4),
    update_every=kwargs.get("every", 1),
    int_bits=kwargs.get("int_bits"),
    rounding="nearest",
  )
  outs, used, _ = dfxp_steps(tx, g)
  want_outs, want_used = dfxp_reference(g, **kwargs)
  # Step 0's exponent is calibrated from the data unless int_bits is given
  # (the state before it holds a placeholder); step 0's outputs show it.
  first = 0 if "int_bits" in kwargs else 1
  np.testing.assert_array_equal(used[first:], want_used[first:])
  np.testing.assert_array_equal(outs, want_outs)  # codes * 2^E: exact in float32
  # The gradient grows ~2^0.68 a step; the range follows it up.
  assert want_used[-1].min() > want_used[1].max(), want_used[:, 0]


def test_dynamic_fixed_point_narrows_one_bit_per_update_when_gradients_shrink():
  g = np.full((6, 8), 0.7, np.float32)
  g[1:] = 1e-3
  tx = dynamic_fixed_point(8, rounding="nearest")
  _, used, _ = dfxp_steps(tx, g)
  # Calibrated to 0.7 (< 2^0): E = -7. Then it may halve every step: -8, -9, ...
  np.testing.assert_array_equal(used[1:, 0], [-7, -8, -9, -10, -11])
  np.testing.assert_array_equal(used[1:], dfxp_reference(g, 8)[1][1:])


def test_dynamic_fixed_point_stochastic_rounding_stays_on_the_group_grid():
  g = growing(steps=3)
  tx = dynamic_fixed_point(12, block_size=16)
  outs, used, _ = dfxp_steps(tx, g)
  _, want_used = dfxp_reference(g, 12, block=16)
  np.testing.assert_array_equal(used[1:], want_used[1:])
  eps = np.repeat(2.0**want_used, 16, axis=1)[:, :40]  # step 0: calibrated
  scaled = g / eps  # exact: eps is a power of two
  inside = (scaled >= -2048) & (scaled <= 2047)
  assert inside.mean() > 0.9
  down = np.floor(scaled) * eps
  assert np.all(((outs == down) | (outs == down + eps))[inside])
  np.testing.assert_array_equal(
    outs[~inside], np.clip(scaled, -2048, 2047)[~inside] * eps[~inside]
  )
  assert np.any(outs != np.round(g / eps) * eps)  # it is not round-to-nearest


def test_dynamic_fixed_point_exponents_are_per_worker():
  """Worker w's gradient is 2^w times worker 0's: its exponent is w higher,
  and the output is the mean of each worker's own decoding."""
  x = growing(steps=1, d=24)[0]
  g = np.stack([x * 2.0**w for w in range(N)])[None]
  tx = dynamic_fixed_point(8, rounding="nearest", axis_name=AXIS)
  outputs, state = steps_on_workers(tx, {"x": g})
  exps = np.asarray(state.leaves["x"].exponent)[:, 0].astype(int)
  np.testing.assert_array_equal(exps - exps[0], np.arange(N))
  per_worker = np.stack([dfxp_reference(g[:, w], 8)[0][0] for w in range(N)])
  harness.assert_mean_over_workers(outputs["x"][0], per_worker)


def test_dynamic_fixed_point_bad_input_leaves_finite_bounded_state():
  x = jnp.array([np.nan, np.inf, -np.inf, 1e38, 0.5, -3e-45], jnp.float32)
  tx = dynamic_fixed_point(12, block_size=2)
  state = tx.init({"x": x})
  for _ in range(3):
    out, state = jax.jit(tx.update)({"x": x}, state)
    chex.assert_tree_all_finite((out, state))
  leaf = state.leaves["x"]
  assert isinstance(leaf, DynamicFixedPointState)
  assert np.asarray(leaf.exponent).max() <= 128 - 12
  assert np.asarray(out["x"])[0] == 0.0  # NaN is sent as 0


# -- wire bytes from the compiled HLO -----------------------------------------

D = 4097  # odd: the 4- and 12-bit packings pad one code


def gathered_bytes(tx, shape):
  grads = harness.shard({"x": jnp.zeros((N, *shape))})
  state = harness.worker_state(tx, {"x": jax.ShapeDtypeStruct(shape, jnp.float32)})
  text = harness.sharded_update(tx).lower(grads, state).compile().as_text()
  return wire.collective_bytes(text)


@pytest.mark.parametrize(
  "name, make, shape, payload",
  [
    (
      "onebit",
      lambda: onebit_sgd(axis_name=AXIS),
      (512, 64),
      512 * 64 // 8 + 2 * 4 * 64,
    ),
    ("fixed4", lambda: fixed_point(4, axis_name=AXIS), (D,), (D + 1) // 2),
    ("fixed8", lambda: fixed_point(8, axis_name=AXIS), (D,), D),
    ("fixed12", lambda: fixed_point(12, axis_name=AXIS), (D,), 3 * (D + 1) // 2),
    ("fixed16", lambda: fixed_point(16, axis_name=AXIS), (D,), 2 * D),
    (
      "dynamic12",
      lambda: dynamic_fixed_point(12, block_size=256, axis_name=AXIS),
      (D,),
      3 * (D + 1) // 2 + math.ceil(D / 256),  # codes + one int8 per group
    ),
  ],
)
def test_wire_bytes_are_the_packed_payload(name, make, shape, payload):
  sent = gathered_bytes(make(), shape)
  assert sent["all-gather"] == payload, (name, sent)
  assert sum(sent.values()) == payload


def test_compressors_run_in_gossip_with_their_payload_on_the_permutes():
  """CHOCO-SGD on a ring with each codec: the codec's own payload crosses
  the two edges (collective-permute), nothing is gathered, params stay finite."""
  params = {"w": jnp.zeros((16, 8))}
  g = np.random.default_rng(5).standard_normal((3, N, 16, 8)).astype(np.float32)
  # One step to count bytes: the scan of the later steps would repeat them.
  one, three = (harness.shard({"w": jnp.asarray(g[:t])}, P(None, AXIS)) for t in (1, 3))
  for compressor, payload in [
    (onebit_sgd(), 16 * 8 // 8 + 2 * 4 * 8),
    (fixed_point(12), 3 * 16 * 8 // 2),
    (dynamic_fixed_point(4, block_size=32), 16 * 8 // 2 + 4),
  ]:
    tx = gradcomp.gossip(
      optax.sgd(0.1), "ring", compressor=compressor, gamma=0.5, axis_name=AXIS
    )
    f = harness.scheme_steps(tx)
    sent = wire.collective_bytes(f.lower(params, one).compile().as_text())
    assert sent["collective-permute"] == 2 * payload, sent
    assert sent["all-gather"] == 0
    out, _ = f(params, three)
    chex.assert_tree_all_finite(out)


# -- hyper-parameters ---------------------------------------------------------


@pytest.mark.parametrize(
  "build, message",
  [
    (lambda: fixed_point(5), r"bits must be one of \(4, 8, 12, 16\), got 5"),
    (lambda: fixed_point(8.0), "bits"),
    (lambda: fixed_point(True), "bits"),
    (
      lambda: fixed_point(8, int_bits=-119),
      r"int_bits must be an integer in \[-118, 128\]",
    ),
    (lambda: fixed_point(8, int_bits=129), "int_bits"),
    (lambda: fixed_point(8, int_bits=1.0), "int_bits"),
    (lambda: dynamic_fixed_point(10), "bits"),
    (lambda: dynamic_fixed_point(12, block_size=0), "block_size"),
    (lambda: dynamic_fixed_point(12, max_overflow_rate=1.0), "max_overflow_rate"),
    (lambda: dynamic_fixed_point(12, max_overflow_rate=-0.1), "max_overflow_rate"),
    (lambda: dynamic_fixed_point(12, update_every=0), "update_every"),
    (lambda: dynamic_fixed_point(12, int_bits=200), "int_bits"),
    (lambda: dynamic_fixed_point(12, rounding="floor"), "rounding"),
  ],
)
def test_invalid_hyper_parameters_raise_naming_the_parameter(build, message):
  with pytest.raises(ValueError, match=message):
    build()


def test_factories_are_recorded():
  spec = spec_of(dynamic_fixed_point(8, block_size=64))
  assert spec.name == "dynamic_fixed_point"
  assert spec.hyperparameters["block_size"] == 64
  assert spec_of(onebit_sgd()).name == "onebit_sgd"
  assert spec_of(fixed_point()).hyperparameters["int_bits"] == 1
