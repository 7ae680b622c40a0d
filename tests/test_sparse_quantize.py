"""sparse_quantize (Strom 2015, survey 004 §4.2) against NumPy, and its invariants.

The multi-step reference runs on a dyadic grid: gradients are multiples of
2^-16 below 2^4 in magnitude, the threshold is 1/2 and there are 8 workers,
so every residual (|r| < 2^7 over these steps), every ``e = r + g``, every
``e - +-t`` and every partial sum of the ``+-t / 8`` is exactly representable
in float32 (at most 23 significant bits). The float32 program is then exact,
and it must equal the float64 reference bit for bit: residuals, outputs and
which coordinates each worker sent.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import sparse_quantize as sq_lib
from gradcomp.compressors.sparse_quantize import sparse_quantize
from gradcomp.compressors.spec import spec_of
from gradcomp.parallel import wire

import harness

AXIS, N = harness.AXIS, harness.WORKERS


def _reference_step(e, t, k):
  """One worker's step in float64: (q, r, sent indices) from ``e = r + g``."""
  order = np.argsort(-np.abs(e), kind="stable")
  above = order[np.abs(e[order]) >= t]
  if above.size > k:
    # The k largest must be well defined: no tie at the cut.
    assert abs(e[above[k - 1]]) != abs(e[above[k]]), "tie at the cut: change seed"
    above = above[:k]
  q = np.zeros_like(e)
  q[above] = t * np.sign(e[above])
  return q, e - q, set(above.tolist())


def reference(grads, t, max_ratio):
  """Float64 replay: per-step means and final residuals, per leaf."""
  steps = next(iter(grads.values())).shape[0]
  outs, residuals, sent = {}, {}, {}
  for name, g in grads.items():
    g = g.astype(np.float64).reshape(steps, N, -1)
    d = g.shape[-1]
    k = max(1, int(max_ratio * d))
    r = np.zeros((N, d))
    outs[name], sent[name] = [], []
    for s in range(steps):
      qs, sets = [], []
      for w in range(N):
        q, r[w], chosen = _reference_step(r[w] + g[s, w], t, k)
        qs.append(q)
        sets.append(chosen)
      outs[name].append(np.mean(qs, axis=0))
      sent[name].append(sets)
    residuals[name] = r
  return outs, residuals, sent


def _grid_grads(shapes, steps, seed):
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in shapes.items():
    g = rng.standard_normal((steps, N, *shape))
    out[name] = (np.clip(np.round(g * 2**16), -(2**20) + 1, 2**20 - 1) / 2**16).astype(
      np.float32
    )
  return out


def _run_steps(tx, grads):
  params = {k: jnp.zeros(g.shape[2:]) for k, g in grads.items()}
  return harness.sharded_steps(tx)(
    harness.shard(jax.tree.map(jnp.asarray, grads), P(None, AXIS)),
    harness.worker_state(tx, params),
  )


def test_eight_workers_several_steps_equal_the_numpy_reference_exactly():
  t, max_ratio, steps = 0.5, 0.1, 6
  # 100 coordinates with 10 slots: ~60 qualify on the first step (capacity
  # overflows); the 7-element leaf has one slot.
  grads = _grid_grads({"w": (10, 10), "b": (7,)}, steps, seed=3)
  tx = sparse_quantize(t, max_ratio=max_ratio, axis_name=AXIS)
  outputs, state = _run_steps(tx, grads)
  want_out, want_r, sent = reference(grads, t, max_ratio)
  assert all(len(s) == 10 for s in sent["w"][0])  # the overflow is exercised
  for name in grads:
    got = np.asarray(outputs[name], np.float64).reshape(steps, -1)
    np.testing.assert_array_equal(got, np.asarray(want_out[name]))
    residual = np.asarray(state.leaves[name].residual, np.float64)
    np.testing.assert_array_equal(residual.reshape(N, -1), want_r[name])


def test_error_feedback_conserves_mass_and_leaves_less_than_the_threshold():
  """sum_t out_t + mean_w r_w == sum_t mean_w g_w; after draining, |r| < t."""
  t, steps, drain = 0.5, 5, 150
  rng = np.random.default_rng(10)
  g = np.zeros((steps + drain, N, 10, 10), np.float32)
  g[:steps] = rng.standard_normal((steps, N, 10, 10))
  tx = sparse_quantize(t, max_ratio=0.05, axis_name=AXIS)
  outputs, state = _run_steps(tx, {"x": g})
  sent = np.asarray(outputs["x"], np.float64).sum(axis=0)
  total = g.astype(np.float64).sum(axis=0).mean(axis=0)
  residual = np.asarray(state.leaves["x"].residual, np.float64)
  # As in test_algorithms.py's conservation test: each step rounds every
  # residual update (|r| <= 8) once and the mean of +-t/8 not at all (t = 1/2);
  # lost mass (a coordinate dropped or sent twice) would be >= t / 8.
  np.testing.assert_allclose(sent + residual.mean(axis=0), total, atol=1e-4)
  # 155 steps at 5 slots of 100 drain every worker's residual below t.
  assert np.abs(residual).max() < t


def test_overflow_sends_the_k_largest_and_keeps_the_rest_whole():
  t, k = 0.5, 5
  x = np.random.default_rng(4).standard_normal(100).astype(np.float32) * 3
  assert np.sum(np.abs(x) >= t) > 5 * k
  tx = sparse_quantize(t, max_ratio=k / 100)
  update = jax.jit(tx.update)
  out, state = update({"x": jnp.asarray(x)}, tx.init({"x": x}))
  out = np.asarray(out["x"])
  largest = np.argsort(-np.abs(x))[:k]
  np.testing.assert_array_equal(np.flatnonzero(out), np.sort(largest))
  np.testing.assert_array_equal(out[largest], t * np.sign(x[largest]))
  np.testing.assert_array_equal(np.asarray(state.leaves["x"].residual), x - out)
  # With zero gradients each step sends at most k coordinates, each exactly
  # +-t, until nothing reaches the threshold; nothing is lost on the way.
  total = out.astype(np.float64)
  zero = {"x": jnp.zeros(100)}
  for _ in range(400):
    out, state = update(zero, state)
    assert np.count_nonzero(out["x"]) <= k
    assert set(np.abs(np.asarray(out["x"])[np.asarray(out["x"]) != 0])) <= {t}
    total += np.asarray(out["x"], np.float64)
  residual = np.asarray(state.leaves["x"].residual, np.float64)
  assert np.abs(residual).max() < t
  np.testing.assert_allclose(total + residual, x, atol=1e-5)


def test_codes_carry_index_and_sign_in_one_int32():
  x = jnp.asarray([0.1, -2.0, 0.7, -0.6, 3.0, 0.0], jnp.float32)
  codes = np.asarray(sq_lib.encode(x, 0.5, 5))
  assert codes.dtype == np.int32 and codes.shape == (5,)
  # Sent: +t at 2 and 4, -t at 1 and 3 (~1 = -2, ~3 = -4); one slot empty (6).
  assert sorted(codes.tolist()) == [-4, -2, 2, 4, 6]
  dense = np.asarray(sq_lib.decode(jnp.asarray(codes), 0.5, 6))
  np.testing.assert_array_equal(dense, [0, -0.5, 0.5, -0.5, 0.5, 0])
  # Index 0 with a negative sign is ~0 = -1, not "+0".
  codes = sq_lib.encode(jnp.asarray([-1.0, 0.0]), 0.5, 1)
  assert np.asarray(codes).tolist() == [-1]
  np.testing.assert_array_equal(sq_lib.decode(codes, 0.5, 2), [-0.5, 0.0])


SIZE = 2**20


def test_wire_is_one_int32_per_slot_from_the_compiled_hlo():
  tx = sparse_quantize(2.5, max_ratio=0.01, axis_name=AXIS)
  grads = harness.shard({"x": jnp.zeros((N, SIZE))})
  state = harness.worker_state(tx, {"x": jax.ShapeDtypeStruct((SIZE,), jnp.float32)})
  text = harness.sharded_update(tx).lower(grads, state).compile().as_text()
  totals = wire.collective_bytes(text)
  k = int(0.01 * SIZE)
  # Indices with their signs, nothing else: no values, no all-reduce.
  assert totals["all-gather"] == 4 * k
  assert sum(totals.values()) == 4 * k
  topk = gradcomp.topk(0.01, axis_name=AXIS)
  topk_state = harness.worker_state(
    topk, {"x": jax.ShapeDtypeStruct((SIZE,), jnp.float32)}
  )
  # Half of top-k's (float32 value, int32 index) pairs.
  assert gradcomp.wire_bytes(harness.sharded_update(topk), grads, topk_state) == 8 * k


def test_gossip_puts_the_codes_on_collective_permute_and_mixes_them():
  """CHOCO-SGD with sparse_quantize, one step from zero params on a ring.

  Each edge carries the k int32 codes. The step (Koloskova et al. 2019,
  Alg. 2; ``schemes/gossip.py``) is x = h + gamma (W q - q) with
  h = -lr g and q = Q(h) (public copies start at 0, the codec memoryless).
  """
  t, lr, gamma = 0.05, 0.1, 0.5
  rng = np.random.default_rng(7)
  shapes = {"w": (100, 100), "b": (100,)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  grads = {
    k: rng.standard_normal((1, N, *s)).astype(np.float32) for k, s in shapes.items()
  }
  tx = gradcomp.gossip(
    optax.sgd(lr),
    "ring",
    compressor=sparse_quantize(t, max_ratio=0.01),
    gamma=gamma,
    axis_name=AXIS,
  )
  f = harness.scheme_steps(tx)
  sharded = harness.shard(jax.tree.map(jnp.asarray, grads), P(None, AXIS))
  totals = wire.collective_bytes(f.lower(params, sharded).compile().as_text())
  assert totals["collective-permute"] == 2 * 4 * (100 + 1)  # two edges
  assert totals["all-gather"] == totals["all-reduce"] == 0
  out, _ = f(params, sharded)
  ring = np.zeros((N, N))
  for i in range(N):
    for j in (i - 1, i, i + 1):
      ring[i, j % N] += 1 / 3
  for k in shapes:
    h = -lr * grads[k][0].astype(np.float64).reshape(N, -1)
    size = h.shape[1]
    q = np.stack(
      [_reference_step(h[w], t, max(1, int(0.01 * size)))[0] for w in range(N)]
    )
    want = h + gamma * (ring @ q - q)
    got = np.asarray(out[k], np.float64).reshape(N, -1)
    # float32 rounding of h (|h| < 1) and of a 3-term mix of +-t: ~1e-7.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# -- the conformance checks (STYLE §12), until it is in the registry --------


def test_non_finite_coordinates_are_dropped_and_huge_ones_stay_bounded():
  tx = sparse_quantize(0.5, max_ratio=0.5)
  update = jax.jit(tx.update)
  good = {"x": jnp.arange(8.0) - 3.5, "h": jnp.full((4,), 1.0, jnp.float16)}
  out, state = update(good, tx.init(good))
  before = {k: np.asarray(s.residual) for k, s in state.leaves.items()}
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    hostile = {"x": good["x"].at[::2].set(bad), "h": good["h"].at[0].set(bad)}
    out, after = update(hostile, state)
    chex.assert_tree_all_finite((out, after))
    kept = {  # the non-finite coordinates count as 0; nothing is lost
      "x": np.where(np.arange(8) % 2 == 0, 0.0, np.asarray(good["x"])),
      "h": np.array([0.0, 1.0, 1.0, 1.0]),
    }
    for k in good:
      np.testing.assert_array_equal(
        np.asarray(out[k], np.float32) + np.asarray(after.leaves[k].residual),
        before[k] + kept[k],
      )
  huge = {"x": jnp.full((8,), 3e38), "h": jnp.full((4,), 6e4, jnp.float16)}
  out, state = update(huge, state)
  out, state = update(huge, state)  # 3e38 + 3e38 overflows: dropped
  chex.assert_tree_all_finite((out, state))
  assert all(np.abs(np.asarray(v, np.float32)).max() <= 0.5 for v in out.values())
  out, state = update(good, state)
  chex.assert_tree_all_finite((out, state))


def test_a_huge_threshold_saturates_in_a_half_precision_leaf():
  tx = sparse_quantize(1e6, max_ratio=1.0)
  g = {"h": jnp.full((3,), 6e4, jnp.float16)}
  update, state = jax.jit(tx.update), tx.init(g)
  for _ in range(30):  # the residual (float32) grows past 1e6 on step 17
    out, state = update(g, state)
    if np.any(np.asarray(out["h"]) != 0):
      break
  assert out["h"].dtype == jnp.float16
  np.testing.assert_array_equal(out["h"], np.finfo(np.float16).max)


def test_a_leaf_too_large_for_31_bit_indices_is_refused_at_trace_time():
  tx = sparse_quantize(0.5)
  big = {"x": jax.ShapeDtypeStruct((2**31,), jnp.float32)}
  state = jax.eval_shape(tx.init, big)
  with pytest.raises(ValueError, match="31 bits"):
    jax.eval_shape(tx.update, big, state)


@pytest.mark.parametrize(
  "kwargs, parameter",
  [
    ({"threshold": 0.0}, "threshold"),
    ({"threshold": -0.5}, "threshold"),
    ({"threshold": float("nan")}, "threshold"),
    ({"threshold": float("inf")}, "threshold"),
    ({"threshold": True}, "threshold"),
    ({"threshold": 0.5, "max_ratio": 0.0}, r"max_ratio must be in \(0, 1\]"),
    ({"threshold": 0.5, "max_ratio": 1.5}, "max_ratio"),
    ({"threshold": 0.5, "max_ratio": -0.1}, "max_ratio"),
  ],
)
def test_invalid_hyper_parameters_raise_naming_the_parameter(kwargs, parameter):
  with pytest.raises(ValueError, match=parameter):
    sparse_quantize(**kwargs)


def test_spec_is_recorded():
  spec = spec_of(sparse_quantize(0.5, axis_name=AXIS))
  assert spec.label() == "sparse_quantize(max_ratio=0.01, threshold=0.5)"
  assert spec.axis_name == AXIS
