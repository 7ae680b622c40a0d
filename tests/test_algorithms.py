"""Each compressor against an independent reference or an invariant (STYLE §13)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomp
from gradcomp.compressors import memory
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.dgc import DGCLeafState
from gradcomp.compressors.memory import ErrorFeedbackState

import harness

AXIS, N = harness.AXIS, harness.WORKERS


def single(tx, grads):
  """Single-device update of a tree (no collectives)."""
  return jax.jit(tx.update)(grads, tx.init(grads))[0]


def per_worker_single(factory, grads):
  """Each worker's leaf compressed alone (axis_name=None): shape (workers, ...)."""
  tx = factory(None)
  return np.stack([np.asarray(single(tx, {"x": grads["x"][w]})["x"]) for w in range(N)])


def on_workers(factory, grads):
  tx = factory(AXIS)
  params = jax.tree.map(lambda g: g[0], grads)
  updates, state = harness.sharded_update(tx)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  harness.assert_same_on_workers(updates)
  return np.asarray(updates["x"])[0], state


# -- top-k ------------------------------------------------------------------


def test_topk_equals_numpy_argpartition():
  x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
  out = np.asarray(single(gradcomp.topk(0.05), {"x": jnp.asarray(x)})["x"])
  keep = np.argpartition(-np.abs(x), 50)[:50]
  expected = np.zeros_like(x)
  expected[keep] = x[keep]
  np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
  "name, factory, wire",
  [
    ("none", lambda a: gradcomp.none(axis_name=a), jnp.float32),
    ("fp16", lambda a: gradcomp.fp16(axis_name=a), jnp.float16),
    ("bf16", lambda a: gradcomp.fp16(axis_name=a, dtype=jnp.bfloat16), jnp.bfloat16),
    ("topk", lambda a: gradcomp.topk(0.1, axis_name=a), jnp.float32),
    ("randomk", lambda a: gradcomp.randomk(0.1, axis_name=a), jnp.float32),
    # A full sample makes DGC's threshold exact, so workers are comparable.
    ("dgc", lambda a: gradcomp.dgc(0.1, sample_ratio=1.0, axis_name=a), jnp.float32),
    ("ef_signsgd", lambda a: gradcomp.ef_signsgd(axis_name=a), jnp.float32),
    ("threshold", lambda a: gradcomp.threshold_quantize(0.5, axis_name=a), jnp.float32),
  ],
)
def test_eight_workers_equal_mean_of_single_device_results(name, factory, wire):
  grads = harness.random_grads({"x": (257,)}, seed=5)
  out, _ = on_workers(factory, grads)
  # The 8 payloads are summed in the wire dtype, in the all-reduce's order: 8 u
  # of the terms' magnitudes (16-bit sums round at every partial sum).
  # ef_signsgd's scale, sum_i |x_i| / 257, is a float32 sum computed by two
  # different programs here: each within 257 u of the exact.
  # fp16's g / 8 below 2^-14 is subnormal: up to 2^-25 from fp16(g) / 8.
  harness.assert_mean_over_workers(
    out,
    per_worker_single(factory, grads),
    wire,
    rel=2 * 257 * 2.0**-24 if name == "ef_signsgd" else 0.0,
    tiny=N * 2.0**-25 if name == "fp16" else 0.0,
  )


# -- signSGD ----------------------------------------------------------------


def test_signsgd_is_the_majority_vote():
  grads = harness.random_grads({"x": (301,)}, seed=6)
  grads["x"] = grads["x"].at[:, :5].set(0.0)  # zero counts as +1
  out, _ = on_workers(lambda a: gradcomp.signsgd(axis_name=a), grads)
  votes = np.where(np.asarray(grads["x"]) >= 0, 1, -1).sum(axis=0)
  np.testing.assert_array_equal(out, np.sign(votes))


# -- random-k ---------------------------------------------------------------


def test_randomk_sends_the_same_k_coordinates_from_every_worker():
  grads = harness.random_grads({"x": (1000,)}, seed=7)
  out, _ = on_workers(lambda a: gradcomp.randomk(0.02, axis_name=a), grads)
  chosen = np.flatnonzero(out)
  assert chosen.size == 20
  harness.assert_mean_over_workers(out[chosen], np.asarray(grads["x"])[:, chosen])


def test_randomk_indices_are_distinct_and_cover_uniformly():
  from gradcomp.compressors.randomk import shared_indices

  counts = np.zeros(103)
  for s in range(300):
    idx = np.asarray(shared_indices(jax.random.PRNGKey(s), 103, 10))
    assert np.unique(idx).size == 10
    counts[idx] += 1
  # Each coordinate is chosen ~10/103 of the time: 300 draws -> ~29 +- 5.
  assert counts.min() > 10 and counts.max() < 50


# -- PowerSGD ---------------------------------------------------------------


def test_powersgd_exact_when_the_mean_has_low_rank():
  rng = np.random.default_rng(8)
  u = rng.standard_normal((40, 3))
  # Every worker's gradient differs, but their mean has rank 3 <= 4.
  v = rng.standard_normal((N, 30, 3))
  noise = rng.standard_normal((N, 40, 30))
  noise -= noise.mean(axis=0)
  g = np.einsum("ir,wjr->wij", u, v) + noise
  out, _ = on_workers(
    lambda a: gradcomp.powersgd(4, axis_name=a), {"x": jnp.asarray(g, jnp.float32)}
  )
  np.testing.assert_allclose(out, g.mean(axis=0), rtol=1e-3, atol=1e-4)


def test_powersgd_on_workers_equals_single_device_on_the_mean():
  grads = harness.random_grads({"x": (24, 20)}, seed=9)
  out, _ = on_workers(lambda a: gradcomp.powersgd(2, axis_name=a), grads)
  mean = {"x": jnp.mean(grads["x"], axis=0)}
  expected = single(gradcomp.powersgd(2), mean)["x"]
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_powersgd_reshapes_vectors_near_square():
  from gradcomp.compressors.powersgd import matrix_shape

  assert matrix_shape((1000,)) == (32, 32)
  assert matrix_shape((3, 3, 16, 32)) == (144, 32)
  assert matrix_shape(()) == (1, 1)


# -- error feedback ---------------------------------------------------------


def residual_mean(state) -> np.ndarray:
  """Mean over workers of the memory of leaf "x" (residual or DGC velocity)."""
  leaf = state.leaves["x"]
  memory = leaf.velocity if isinstance(leaf, DGCLeafState) else leaf.residual
  return np.asarray(memory, np.float64).mean(axis=0)


EF_COMPRESSORS = {
  "topk": lambda a: gradcomp.topk(0.1, axis_name=a),
  "randomk": lambda a: gradcomp.randomk(0.1, axis_name=a),
  "dgc": lambda a: gradcomp.dgc(0.1, momentum=0.0, axis_name=a),
  # Error feedback needs a contraction: QSGD's variance factor
  # min(b / s^2, sqrt(b) / s) must be < 1 (here 1/16), or the memory grows.
  "qsgd": lambda a: gradcomp.qsgd(16, bucket_size=16, error_feedback=True, axis_name=a),
  "ef_signsgd": lambda a: gradcomp.ef_signsgd(axis_name=a),
  "powersgd": lambda a: gradcomp.powersgd(1, axis_name=a),
  "threshold": lambda a: gradcomp.threshold_quantize(0.5, axis_name=a),
  "onebit_sgd": lambda a: gradcomp.onebit_sgd(axis_name=a),
}


@pytest.mark.parametrize("name", sorted(EF_COMPRESSORS))
def test_error_feedback_conserves_mass(name):
  """sum_t out_t + mean_w residual_w == sum_t mean_w g_w, and sparsifiers drain."""
  steps, drain = 5, 150
  rng = np.random.default_rng(10)
  g = np.zeros((steps + drain, N, 10, 10), np.float32)
  g[:steps] = rng.standard_normal((steps, N, 10, 10))
  tx = EF_COMPRESSORS[name](AXIS)
  outputs, state = harness.sharded_steps(tx)(
    harness.shard({"x": jnp.asarray(g)}, jax.sharding.PartitionSpec(None, AXIS)),
    harness.worker_state(tx, {"x": jnp.zeros((10, 10))}),
  )
  # The test's own sums in float64: only the compressor's float32 rounds.
  sent = np.asarray(outputs["x"], np.float64).sum(axis=0)
  total = g.astype(np.float64).sum(axis=0).mean(axis=0)
  # Each of the 155 steps rounds every worker's residual update (|r| <= 8)
  # twice and the 8-term mean of the payloads (sum over steps <= 30) once, by
  # at most u = 6e-8 of their size: ~1e-4 if every rounding had the same
  # sign, ~1e-5 as a random walk; measured <= 7e-7 (PowerSGD, whose residual
  # never drains) on AVX-512, AVX2, SSE4.2 and one thread. Lost mass (a
  # residual dropped or sent twice) is O(1).
  np.testing.assert_allclose(sent + residual_mean(state), total, atol=1e-4)
  if name in ("topk", "randomk", "dgc"):
    np.testing.assert_allclose(sent, total, atol=1e-4)


# -- unbiased quantizers ----------------------------------------------------


def sample_outputs(tx, x, draws):
  """``draws`` single-device outputs for the same input, fresh randomness each."""

  def body(state, _):
    out, state = tx.update({"x": x}, state)
    return state, out["x"]

  _, outs = jax.jit(lambda s: jax.lax.scan(body, s, None, length=draws))(
    tx.init({"x": x})
  )
  return np.asarray(outs, np.float64)


@pytest.mark.parametrize(
  "factory", [lambda: gradcomp.qsgd(2, bucket_size=16), gradcomp.terngrad]
)
def test_stochastic_quantizers_are_unbiased(factory):
  x = jnp.asarray(np.random.default_rng(11).standard_normal(64), jnp.float32)
  draws = 4000
  outs = sample_outputs(factory(), x, draws)
  stderr = outs.std(axis=0) / np.sqrt(draws) + 1e-7
  z = (outs.mean(axis=0) - np.asarray(x)) / stderr
  # 64 coordinates, |z| > 5 has probability ~6e-7 each under unbiasedness.
  assert np.abs(z).max() < 5.0, np.abs(z).max()
  assert outs.std(axis=0).max() > 0  # it really is random


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_rounding_is_independent_between_workers(name):
  """The mean of 8 workers' roundings of one vector has 1/8 of the variance."""
  factory = {"qsgd": gradcomp.qsgd, "terngrad": gradcomp.terngrad}[name]
  x = np.random.default_rng(12).standard_normal(512).astype(np.float32)
  grads = {"x": jnp.asarray(np.broadcast_to(x, (N, 512)))}
  out, _ = on_workers(lambda a: factory(axis_name=a), grads)
  one = np.asarray(single(factory(), {"x": jnp.asarray(x)})["x"])
  ratio = np.var(out - x) / np.var(one - x)
  assert 0.06 < ratio < 0.25, ratio


# -- quantizer wire formats -------------------------------------------------


def test_threshold_quantize_matches_numpy():
  x = np.random.default_rng(13).standard_normal(99).astype(np.float32)
  out = np.asarray(single(gradcomp.threshold_quantize(0.7), {"x": jnp.asarray(x)})["x"])
  np.testing.assert_array_equal(
    out, 0.7 * ((x >= 0.7).astype(np.float32) - (x <= -0.7))
  )


def test_ef_signsgd_first_step_is_scaled_sign():
  x = np.random.default_rng(14).standard_normal(77).astype(np.float32)
  out = np.asarray(single(gradcomp.ef_signsgd(), {"x": jnp.asarray(x)})["x"])
  scale = np.abs(x.astype(np.float64)).mean()
  # The scale is a float32 sum of the 77 rounded terms |x_i| / 77, in the
  # order XLA picks for this machine's vector width: within 77 u = 4.6e-6 of
  # the exact mean (measured 7e-8); another scale (an RMS, a sum) is O(1) off.
  np.testing.assert_allclose(out, scale * np.where(x >= 0, 1, -1), rtol=5e-6)


def test_ef_signsgd_matches_a_numpy_replay_through_nan_and_overflow():
  """Karimireddy et al. Alg. 1 with memory.py's policy, replayed in float64.

  Step 4 overflows float32 in ``r + g`` at one coordinate and step 5 holds a
  NaN: those coordinates of g count as 0, the rest go through.
  """
  d, rng = 77, np.random.default_rng(15)
  grads = [rng.standard_normal(d).astype(np.float32) for _ in range(6)]
  grads[2][0] = grads[3][0] = 3e38  # r + g overflows at step 4
  grads[4][5] = np.nan
  tx = gradcomp.ef_signsgd()
  update = jax.jit(tx.update)
  state = tx.init({"x": jnp.zeros(d)})
  r = np.zeros(d)
  for g in grads:
    out, state = update({"x": jnp.asarray(g)}, state)
    with np.errstate(over="ignore", invalid="ignore"):
      e = r + g.astype(np.float64)
      e = np.where(np.isfinite(e.astype(np.float32)), e, r)
    p = np.abs(e).mean() * np.where(e >= 0, 1.0, -1.0)
    r = e - p
    # Float32 rounding: e and r once each, the scale's sum of d terms.
    bound = (d + 4) * 2.0**-24 * np.abs(e).max() * len(grads)
    np.testing.assert_allclose(np.asarray(out["x"]), p, rtol=0, atol=bound)
    np.testing.assert_allclose(
      np.asarray(state.leaves["x"].residual), r, rtol=0, atol=bound
    )


def test_dgc_momentum_correction_and_factor_masking():
  """Two steps by hand: u = m u + g, v = v + u, send top of v, clear u and v there."""
  g1 = np.array([4.0, 1.0, 0.5, -0.2], np.float32)
  g2 = np.array([0.1, 1.0, -0.3, 0.2], np.float32)
  tx = gradcomp.dgc(0.25, momentum=0.5, sample_ratio=1.0)
  state = tx.init({"x": jnp.zeros(4)})
  out1, state = tx.update({"x": jnp.asarray(g1)}, state)
  out2, state = tx.update({"x": jnp.asarray(g2)}, state)
  np.testing.assert_allclose(out1["x"], [4.0, 0, 0, 0])
  # After step 1, u = v = [0, 1, 0.5, -0.2] (coordinate 0 sent and cleared).
  # Step 2: u = 0.5 u + g2 = [0.1, 1.5, -0.05, 0.1]; v = v + u = [0.1, 2.5, 0.45, -0.1].
  np.testing.assert_allclose(out2["x"], [0, 2.5, 0, 0], rtol=1e-6)
  leaf = state.leaves["x"]
  np.testing.assert_allclose(leaf.momentum, [0.1, 0, -0.05, 0.1], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(leaf.velocity, [0.1, 0, 0.45, -0.1], rtol=1e-5, atol=1e-7)


def test_dgc_warmup_sends_more_early():
  x = {"x": jnp.asarray(np.random.default_rng(15).standard_normal(1000), jnp.float32)}
  tx = gradcomp.dgc(0.01, momentum=0.0, warmup_steps=8, sample_ratio=1.0)
  state = tx.init(x)
  counts = []
  for _ in range(10):
    out, state = jax.jit(tx.update)(x, state)
    counts.append(int(np.count_nonzero(out["x"])))
  assert counts[0] == 250 and counts[-1] == 10, counts
  assert counts == sorted(counts, reverse=True)


# -- non-finite gradients ---------------------------------------------------


def test_apply_if_finite_keeps_compressor_state_on_a_nan_step():
  params = {"x": jnp.zeros(20)}
  tx = optax.apply_if_finite(optax.chain(gradcomp.topk(0.1), optax.sgd(0.1)), 3)
  state = tx.init(params)
  good = {"x": jnp.arange(20.0)}
  _, state = tx.update(good, state)
  bad = {"x": good["x"].at[3].set(jnp.nan)}
  updates, after = tx.update(bad, state)
  chex.assert_trees_all_equal(after.inner_state, state.inner_state)
  chex.assert_trees_all_equal(updates, {"x": jnp.zeros(20)})
  updates, after = tx.update(good, after)  # training continues
  chex.assert_tree_all_finite((updates, after))
  assert int(after.total_notfinite) == 1


@pytest.mark.parametrize(
  "factory",
  [
    lambda: gradcomp.topk(0.1),
    lambda: gradcomp.ef_signsgd(),
    lambda: gradcomp.powersgd(1),
    lambda: gradcomp.dgc(0.1, momentum=0.0, sample_ratio=1.0),
  ],
)
def test_memory_drops_non_finite_coordinates_and_loses_no_mass(factory):
  """Applied without apply_if_finite, NaN coordinates count as 0: what is sent
  plus what is kept is the memory plus the rest of g."""
  tx = factory()
  good = {"x": jnp.arange(20.0).reshape(4, 5) - 7.0}
  _, state = tx.update(good, tx.init(good))
  before = residual_mean_single(state)
  out, after = tx.update(
    {"x": good["x"].at[0, 1].set(jnp.nan).at[2, 2].set(-jnp.inf)}, state
  )
  chex.assert_tree_all_finite((out, after))
  kept = np.asarray(good["x"]).copy()
  kept[0, 1] = kept[2, 2] = 0.0
  np.testing.assert_allclose(
    np.asarray(out["x"]) + residual_mean_single(after), before + kept, atol=1e-5
  )


def test_corrected_drops_exactly_the_non_finite_sums():
  r = np.array([3e38, 1.0, -3e38, 2.0, 0.0, 5.0], np.float32)
  g = np.array([3e38, np.nan, -1e38, np.inf, -np.inf, -4.0], np.float32)
  want = np.array([3e38, 1.0, -3e38, 2.0, 0.0, 1.0], np.float32)
  np.testing.assert_array_equal(memory.corrected(jnp.asarray(r), jnp.asarray(g)), want)


def residual_mean_single(state) -> np.ndarray:
  leaf = state.leaves["x"]
  memory = leaf.velocity if isinstance(leaf, DGCLeafState) else leaf.residual
  return np.asarray(memory)


def test_workers_agree_to_skip_when_one_worker_has_a_nan():
  grads = harness.random_grads({"x": (40,)}, seed=16)
  params = {"x": jnp.zeros(40)}
  tx = gradcomp.apply_if_finite(gradcomp.topk(0.1, axis_name=AXIS), 2, axis_name=AXIS)
  update = harness.sharded_update(tx)
  state0 = harness.worker_state(tx, params)
  _, state1 = update(harness.shard(grads), state0)
  bad = {"x": grads["x"].at[5, 7].set(jnp.nan)}  # worker 5 only
  updates, state2 = update(harness.shard(bad), state1)
  np.testing.assert_array_equal(np.asarray(updates["x"]), 0.0)
  chex.assert_trees_all_equal(state2.inner_state, state1.inner_state)
  np.testing.assert_array_equal(np.asarray(state2.total_notfinite), 1)
  updates, state3 = update(harness.shard(grads), state2)
  chex.assert_tree_all_finite((updates, state3))
  assert np.abs(np.asarray(updates["x"])).sum() > 0


# -- hyper-parameters -------------------------------------------------------


@pytest.mark.parametrize(
  "build, parameter",
  [
    (lambda: gradcomp.topk(0.0), "ratio"),
    (lambda: gradcomp.topk(1.5), "ratio"),
    (lambda: gradcomp.randomk(-0.1), "ratio"),
    (lambda: gradcomp.dgc(2.0), "ratio"),
    (lambda: gradcomp.dgc(0.01, momentum=1.0), "momentum"),
    (lambda: gradcomp.dgc(0.01, sample_ratio=0.0), "sample_ratio"),
    (lambda: gradcomp.qsgd(0), "levels"),
    (lambda: gradcomp.qsgd(200), "levels"),
    (lambda: gradcomp.qsgd(4, bucket_size=0), "bucket_size"),
    (lambda: gradcomp.powersgd(0), "rank"),
    (lambda: gradcomp.threshold_quantize(-0.5), "threshold"),
    (lambda: gradcomp.threshold_quantize(0.0), "threshold"),
    (lambda: gradcomp.fp16(dtype=jnp.float32), "dtype"),
    (lambda: gradcomp.get("nope"), "unknown compressor"),
    (lambda: gradcomp.apply_if_finite(gradcomp.none(), -1), "max_consecutive_errors"),
  ],
)
def test_invalid_hyper_parameters_raise_naming_the_parameter(build, parameter):
  with pytest.raises(ValueError, match=parameter):
    build()


def test_ratio_error_states_the_valid_range():
  with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 0"):
    gradcomp.topk(0)


def test_compressor_state_is_the_documented_type():
  state = gradcomp.topk(0.5).init({"x": jnp.zeros(4)})
  assert isinstance(state, CompressorState)
  assert isinstance(state.leaves["x"], ErrorFeedbackState)
