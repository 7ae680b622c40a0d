"""Count Sketch and Sketch-Fusion SGD (issue 3): references and invariants."""

import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.compressors.sketch_topk import sketch_topk
from gradcomp.kernels import count_sketch as cs

import harness

AXIS, N = harness.AXIS, harness.WORKERS

# One pytest-xdist worker runs the module: the Count Sketch programs one test
# runs eagerly or compiles (per rows, cols and size) serve the others there.
pytestmark = pytest.mark.xdist_group("sketch")


def numpy_count_sketch(x, rows, cols, seed):
  """Slow reference: per-coordinate buckets and signs from the same block hashes."""
  h = jax.tree.map(np.asarray, cs.block_hashes(rows, cols, x.size, seed))
  i = np.arange(x.size)
  b, p = i // cols, i % cols
  buckets = (p[None] + h.offsets[:, b]) % cols  # (rows, d)
  signs = h.signs[:, b] * h.pattern[p][None]
  table = np.zeros((rows, cols), np.float64)
  for j in range(rows):
    np.add.at(table[j], buckets[j], signs[j] * x)
  per_row = signs * np.take_along_axis(table, buckets, axis=1)
  return table, np.median(per_row, axis=0), np.median((table**2).sum(axis=1))


def single(tx, grads):
  return jax.jit(tx.update)(grads, tx.init(grads))[0]


def on_workers(tx, grads):
  params = jax.tree.map(lambda g: g[0], grads)
  updates, state = harness.sharded_update(tx)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  harness.assert_same_on_workers(updates)
  return np.asarray(updates["x"])[0], state


def sketch_on_workers(x, rows, cols, seed, reduce):
  """Each worker sketches its row of ``x``; optionally psum; (workers, rows, cols)."""

  def f(xw):
    t = cs.sketch(xw[0], rows, cols, seed)
    return (jax.lax.psum(t, AXIS) if reduce else t)[None]

  f = jax.shard_map(f, mesh=harness.mesh(), in_specs=P(AXIS), out_specs=P(AXIS))
  return np.asarray(jax.jit(f)(harness.shard(jnp.asarray(x))))


# -- Count Sketch -----------------------------------------------------------


def test_median_networks_match_numpy():
  for n in range(1, 7):
    perms = np.array(list(itertools.permutations(range(n))), np.float32)
    got = cs._median([jnp.asarray(perms[:, j]) for j in range(n)])
    np.testing.assert_array_equal(got, np.median(perms, axis=1))


@pytest.mark.parametrize("rows", [1, 4, 5, 7])
def test_windowed_sketch_equals_numpy_count_sketch(rows):
  d, cols, seed = 1003, 37, 3  # a partial last block
  x = np.random.default_rng(0).standard_normal(d).astype(np.float32)
  table = jax.jit(cs.sketch, static_argnums=(1, 2, 3))(x, rows, cols, seed)
  ref_table, ref_est, ref_l2 = numpy_count_sketch(x, rows, cols, seed)
  np.testing.assert_allclose(table, ref_table, rtol=1e-5, atol=1e-5)
  est = jax.jit(cs.estimate_all, static_argnums=(1, 2))(table, d, seed)
  np.testing.assert_allclose(est, ref_est, rtol=1e-5, atol=1e-5)
  idx = np.array([0, 36, 37, 500, 1002])
  np.testing.assert_allclose(
    cs.query(table, idx, d, seed), ref_est[idx], rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(cs.l2_estimate(table), ref_l2, rtol=1e-5)


def test_sketches_are_linear_bit_for_bit():
  rows, cols, seed, d = 5, 31, 1, 1000
  x = np.random.default_rng(1).integers(-50, 51, (N, d)).astype(np.float32)
  one = jax.jit(cs.sketch, static_argnums=(1, 2, 3))
  merged = sum(np.asarray(one(x[w], rows, cols, seed)) for w in range(N))
  of_sum = np.asarray(one(x.sum(axis=0), rows, cols, seed))
  np.testing.assert_array_equal(merged, of_sum)
  # The real all-reduce: every worker holds the sketch of the summed vector.
  for table in sketch_on_workers(x, rows, cols, seed, reduce=True):
    np.testing.assert_array_equal(table, of_sum)


def test_hashes_agree_across_workers_and_calls_and_depend_on_the_seed():
  x = np.random.default_rng(2).standard_normal(500).astype(np.float32)
  tables = sketch_on_workers(np.broadcast_to(x, (N, 500)), 5, 20, 7, reduce=False)
  reference = np.asarray(cs.sketch(x, 5, 20, 7))
  for table in tables:
    np.testing.assert_array_equal(table, reference)
  np.testing.assert_array_equal(cs.sketch(x, 5, 20, 7), reference)
  assert not np.allclose(cs.sketch(x, 5, 20, 8), reference)


def test_estimates_of_huge_coordinates_are_within_the_count_sketch_bound():
  rng = np.random.default_rng(3)
  d, rows, cols = 20000, 5, 200
  x = rng.standard_normal(d).astype(np.float32)
  heavy = rng.choice(d, 6, replace=False)
  x[heavy] = [300.0, -250.0, 200.0, 180.0, -400.0, 500.0]
  est = np.asarray(cs.estimate_all(cs.sketch(x, rows, cols, 0), d, 0))
  # A row errs by more than 3 ||x|| / sqrt(cols) with probability <= 1/9
  # (Chebyshev); the median of 5 rows does with probability < 0.015.
  bound = 3 * np.linalg.norm(x) / np.sqrt(cols)
  assert np.all(np.abs(est[heavy] - x[heavy]) <= bound)
  assert np.mean(np.abs(est - x) > bound) < 0.015
  # ...and the huge ones stand out: they are the 6 largest estimates.
  assert set(np.argsort(-np.abs(est))[:6]) == set(heavy)


@pytest.mark.parametrize("kind", ["gaussian", "constant"])
def test_l2_estimate_is_within_ten_percent(kind):
  """Relative error of a row ~ sqrt(2 / cols) = 4.5%; the median of 5 is tighter.

  A constant vector has identical blocks, which line up in every bucket when
  the signs are constant per block; the within-block sign pattern is what
  keeps its estimate as good as a random vector's.
  """
  d, cols = 100_000, 1000
  x = np.random.default_rng(4).standard_normal(d).astype(np.float32)
  if kind == "constant":
    x = np.ones(d, np.float32)
  norm2 = float(np.sum(x.astype(np.float64) ** 2))
  for seed in range(3):
    l2 = float(cs.l2_estimate(cs.sketch(x, 5, cols, seed)))
    assert abs(l2 / norm2 - 1) < 0.1, (seed, l2 / norm2)


def test_no_rows_by_d_array_is_materialized():
  d, rows, cols = 40009, 5, 400
  nb = cs.num_blocks(d, cols)

  def f(x):
    table = cs.sketch(x, rows, cols, 0)
    return cs.estimate_all(table, d, 0), cs.l2_estimate(table)

  hlo = jax.jit(f).lower(jax.ShapeDtypeStruct((d,), jnp.float32)).compile().as_text()
  sizes = {
    (dtype, dims): int(np.prod([int(n) for n in dims.split(",") if n]))
    for dtype, dims in re.findall(r"\b([a-z]+[0-9]+)\[([0-9,]*)\]", hlo)
  }
  # Nothing larger than the padded blocks (nb * cols floats; the sketch now
  # reads x block by block and pads nothing, so x and the estimates are the
  # largest); no index array of size d or more exists.
  assert max(sizes.values()) <= nb * cols
  big_ints = [k for k, n in sizes.items() if k[0][0] in "su" and n >= d]
  assert not big_ints, big_ints


# -- Sketch-Fusion SGD ------------------------------------------------------


def heavy_vector(rng, d, values, noise=0.1):
  x = (noise * rng.standard_normal(d)).astype(np.float32)
  heavy = rng.choice(d, len(values), replace=False)
  x[heavy] = values
  return x, heavy


def test_single_device_recovers_heavy_coordinates_with_exact_values():
  x, heavy = heavy_vector(np.random.default_rng(5), 4096, [20.0, -30.0, 40.0, -50.0])
  out = np.asarray(single(sketch_topk(0.01), {"x": jnp.asarray(x)})["x"])
  np.testing.assert_array_equal(out[heavy], x[heavy])
  chosen = np.flatnonzero(out)
  assert chosen.size == 40  # k = 40: the 4 heavy ones plus 36 random fills
  np.testing.assert_array_equal(out[chosen], x[chosen])


def test_eight_workers_recover_heavy_coordinates_with_their_mean():
  rng = np.random.default_rng(6)
  x, heavy = heavy_vector(rng, 4096, [20.0, -30.0, 40.0, -50.0])
  g = x + 0.1 * rng.standard_normal((N, 4096)).astype(np.float32)
  out, _ = on_workers(sketch_topk(0.01, axis_name=AXIS), {"x": jnp.asarray(g)})
  chosen = np.flatnonzero(out)
  assert set(heavy) <= set(chosen) and chosen.size == 40
  # Exact values: each chosen coordinate is the workers' mean, up to the
  # rounding of their one 8-term sum (the random fills' means may cancel).
  harness.assert_mean_over_workers(out[chosen], g[:, chosen])


def test_finds_coordinates_heavy_in_the_sum_that_local_topk_misses():
  """Spikes that cancel across workers fill every local top-k.

  Workers w and w + 4 carry +50 and -50 on the same 40 = k coordinates; three
  target coordinates are 1.0 on every worker: small locally, but 8 in the
  sum, where the spikes are 0. Local top-k sends only spikes (which average to
  0) and never a target; the summed sketch sees only the targets.
  """
  rng = np.random.default_rng(7)
  d, k = 4000, 40
  g = 0.01 * rng.standard_normal((N, d)).astype(np.float32)
  coords = rng.permutation(d)
  targets, spikes = coords[:3], coords[3 : 3 + 4 * k].reshape(4, k)
  for w in range(N):
    g[w, spikes[w % 4]] = 50.0 if w < 4 else -50.0
  g[:, targets] = 1.0
  grads = {"x": jnp.asarray(g)}
  sketched, _ = on_workers(sketch_topk(k / d, axis_name=AXIS), grads)
  local, _ = on_workers(gradcomp.topk(k / d, axis_name=AXIS), grads)
  np.testing.assert_allclose(sketched[targets], g.mean(axis=0)[targets], rtol=1e-6)
  np.testing.assert_array_equal(local[targets], 0.0)
  # Local top-k spent its whole budget on spikes that cancel.
  np.testing.assert_allclose(local[spikes.reshape(-1)], 0.0, atol=1e-5)
  assert np.count_nonzero(local) <= 4 * k


def steps_on_workers(tx, g):
  """Runs ``g`` (steps, workers, d) through ``tx``; sum of outputs, mean residual."""
  outputs, state = harness.sharded_steps(tx)(
    harness.shard({"x": jnp.asarray(g)}, P(None, AXIS)),
    harness.worker_state(tx, {"x": jnp.zeros(g.shape[2:])}),
  )
  sent = np.asarray(outputs["x"]).sum(axis=0)
  return sent, np.asarray(state.leaves["x"].residual).mean(axis=0)


def test_error_feedback_conserves_mass_and_drains():
  steps, drain = 5, 150
  g = np.zeros((steps + drain, N, 100), np.float32)
  g[:steps] = np.random.default_rng(8).standard_normal((steps, N, 100))
  sent, residual = steps_on_workers(sketch_topk(0.1, axis_name=AXIS), g)
  total = g.sum(axis=0).mean(axis=0)
  np.testing.assert_allclose(sent + residual, total, atol=1e-4)
  # The random fill reaches every coordinate: the memory drains.
  np.testing.assert_allclose(sent, total, atol=1e-4)


def test_without_random_fill_a_spread_out_residual_is_never_sent():
  """HEAVYMIX without fill stalls: mass spread over > k coordinates is never heavy.

  ``cols = d`` makes the sketch exact (one block, no collisions), so the stall
  is the selection rule's, not sketch noise. Two coordinates are heavy and
  sent at step 1; the other 98 hold 8 each in the sum, under the threshold
  ``||E|| / sqrt(k) = sqrt(98 * 64 / 10) ~ 25``, and stay in the memory
  forever. With the random fill the same memory drains.
  """
  g = np.zeros((60, N, 100), np.float32)
  g[0] = 1.0
  g[0, :, :2] = 20.0
  total = g.sum(axis=0).mean(axis=0)
  stalled = sketch_topk(0.1, cols=100, random_fill=False, axis_name=AXIS)
  sent, residual = steps_on_workers(stalled, g)
  np.testing.assert_array_equal(sent[:2], 20.0)
  np.testing.assert_array_equal(sent[2:], 0.0)
  np.testing.assert_array_equal(residual[2:], 1.0)
  np.testing.assert_array_equal(sent + residual, total)
  drained = sketch_topk(0.1, cols=100, random_fill=True, axis_name=AXIS)
  sent, _ = steps_on_workers(drained, g)
  np.testing.assert_allclose(sent, total, atol=1e-6)


def test_eight_workers_equal_one_device_on_the_summed_gradient():
  """Same seed, same key: identical choices and values (integer inputs are exact).

  The 8 workers sum their sketches; one device sketches the mean, 1/8 of the
  sum: every estimate, the norm and hence the heavy test and the priorities
  differ by exact powers of two. The fill key is the same: every worker starts
  from the same state, so leafwise's ``pmax`` agrees on the single-device key.
  """
  g = np.random.default_rng(9).integers(-8, 9, (N, 2000)).astype(np.float32)
  g[:, :3] += np.float32(40.0)  # a few heavy coordinates, plus random fill
  tx = lambda a: sketch_topk(0.02, seed=11, axis_name=a)
  out, _ = on_workers(tx(AXIS), {"x": jnp.asarray(g)})
  mean = g.sum(axis=0) / np.float32(N)
  expected = np.asarray(single(tx(None), {"x": jnp.asarray(mean)})["x"])
  np.testing.assert_array_equal(out, expected)
  assert np.count_nonzero(expected) == 40


def test_pmap_equals_shard_map_and_state_has_the_documented_type():
  rng = np.random.default_rng(10)
  grads = {"x": jnp.asarray(rng.standard_normal((N, 300)), jnp.float32)}
  tx = sketch_topk(0.05, axis_name=AXIS)
  expected, _ = on_workers(tx, grads)
  state = gradcomp.add_worker_axis(tx.init({"x": jnp.zeros(300)}), N)
  updates, new_state = harness.pmapped_update(tx)(grads, state)
  harness.assert_same_on_workers(updates)
  np.testing.assert_array_equal(np.asarray(updates["x"])[0], expected)
  assert isinstance(new_state, CompressorState)
  assert isinstance(new_state.leaves["x"], ErrorFeedbackState)


def test_shapes_dtypes_and_finiteness_are_preserved():
  rng = np.random.default_rng(11)
  grads = {
    "w": jnp.asarray(rng.standard_normal((12, 10)), jnp.float32),
    "b": jnp.asarray(rng.standard_normal(10), jnp.bfloat16),
    "s": jnp.asarray(0.5, jnp.float32),
  }
  tx = sketch_topk(0.1, rows=3)
  state = tx.init(grads)
  update = jax.jit(tx.update)
  for _ in range(2):
    updates, new_state = update(grads, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, grads)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    chex.assert_tree_all_finite((updates, new_state))
    state = new_state


@pytest.mark.parametrize(
  "kwargs, parameter",
  [
    ({"ratio": 0.0}, "ratio"),
    ({"ratio": 1.5}, "ratio"),
    ({"ratio": 0.01, "rows": 0}, "rows"),
    ({"ratio": 0.01, "cols": 0}, "cols"),
  ],
)
def test_invalid_hyper_parameters_raise_naming_the_parameter(kwargs, parameter):
  with pytest.raises(ValueError, match=parameter):
    sketch_topk(**kwargs)


def test_wire_bytes_are_under_six_percent_of_dense():
  """Sketch 5 x ceil(4.75 k / 5) floats + k values + an 8-byte key agreement."""
  size = 2**20
  tx = sketch_topk(0.01, axis_name=AXIS)
  grads = harness.shard({"x": jnp.zeros((N, size))})
  state = harness.worker_state(tx, {"x": jax.ShapeDtypeStruct((size,), jnp.float32)})
  sent = gradcomp.wire_bytes(harness.sharded_update(tx), grads, state)
  k = size // 100
  assert sent == 4 * (5 * -(-475 * k // 500) + k) + 8
  assert sent <= 0.06 * 4 * size, sent / (4 * size)
