"""One suite over every registered compressor (STYLE §12)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp

import harness

# Hyper-parameters for each registered compressor; small ratios would keep a
# single coordinate of these tiny leaves, so the sparsifiers keep 30%.
CONFIGS = {
  "none": {},
  "fp16": {},
  "topk": {"ratio": 0.3},
  "randomk": {"ratio": 0.3},
  "dgc": {"ratio": 0.3},
  "qsgd": {"levels": 4},
  "terngrad": {},
  "signsgd": {},
  "ef_signsgd": {},
  "powersgd": {"rank": 2},
  "threshold_quantize": {"threshold": 0.5},
  "sketch_topk": {"ratio": 0.3},
  "onebit_sgd": {},
  "fixed_point": {"bits": 8},
  "dynamic_fixed_point": {"bits": 12, "block_size": 16},
  "sparse_quantize": {"threshold": 0.5, "max_ratio": 0.3},
}
NAMES = sorted(CONFIGS)

PARAMS = harness.MIXED_PARAMS


def make(name, axis_name=None):
  return gradcomp.get(name, axis_name=axis_name, **CONFIGS[name])


def assert_like(tree, reference):
  chex.assert_trees_all_equal_shapes_and_dtypes(tree, reference)
  chex.assert_tree_all_finite(tree)


def test_every_registered_compressor_is_covered():
  assert set(gradcomp.names()) == set(CONFIGS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
def test_single_device_update(name, jit):
  tx = make(name)
  grads = harness.grads_like(PARAMS)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update) if jit else tx.update
  updates, new_state = update(grads, state)
  assert_like(updates, grads)
  # The state keeps its type, structure, shapes and dtypes.
  assert type(new_state) is type(state)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)


@pytest.mark.parametrize("name", NAMES)
def test_no_retracing_and_empty_tree(name):
  chex.clear_trace_counter()  # ids of collected functions get reused
  tx = make(name)
  state = tx.init(PARAMS)
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))
  for seed in range(3):
    _, state = update(harness.grads_like(PARAMS, seed), state)
  assert tx.update({}, tx.init({}))[0] == {}


@pytest.mark.parametrize("name", NAMES)
def test_init_on_shape_dtype_structs(name):
  tx = make(name)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(tx.init(abstract), tx.init(PARAMS))


@pytest.mark.parametrize("name", NAMES)
def test_shard_map_identical_on_every_worker(name):
  tx = make(name, harness.AXIS)
  grads = harness.random_grads(
    {"kernel": (12, 10), "vector": (50,), "scale": ()}, seed=1
  )
  params = jax.tree.map(lambda g: g[0], grads)
  updates, state = harness.sharded_update(tx)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  assert_like(updates, grads)
  harness.assert_same_on_workers(updates)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, harness.worker_state(tx, params))


@pytest.mark.parametrize("name", NAMES)
def test_pmap_matches_shard_map(name):
  tx = make(name, harness.AXIS)
  grads = harness.random_grads({"kernel": (12, 10), "vector": (50,)}, seed=2)
  params = jax.tree.map(lambda g: g[0], grads)
  state = gradcomp.add_worker_axis(tx.init(params), harness.WORKERS)
  by_pmap, _ = harness.pmapped_update(tx)(grads, state)
  by_shard_map, _ = harness.sharded_update(tx)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  harness.assert_same_on_workers(by_pmap)
  chex.assert_trees_all_close(by_pmap, by_shard_map, rtol=1e-5, atol=1e-6)


# Eager shard_map dispatches every primitive on 8 devices, one compile each
# (3-25 s per compressor on 2 cores), so it runs one compressor per exchange
# pattern rather than all twelve: dense psum (none, fp16), shared-index psum
# with a shared PRNG (randomk), values + indices all-gather with error feedback
# (topk), a sampled threshold with momentum (dgc), packed-bit all-gather
# (signsgd; qsgd, terngrad, ef_signsgd and threshold_quantize pack the same
# way), factor psum (powersgd). Under jit every compressor runs on 8 workers
# in the tests above.
EAGER_NAMES = ("dgc", "fp16", "none", "powersgd", "randomk", "signsgd", "topk")


@pytest.mark.parametrize("name", EAGER_NAMES)
def test_shard_map_without_jit(name):
  tx = make(name, harness.AXIS)
  grads = harness.random_grads({"vector": (50,)}, seed=3)
  params = jax.tree.map(lambda g: g[0], grads)
  updates, _ = harness.sharded_update(tx, jit=False)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  assert_like(updates, grads)
  harness.assert_same_on_workers(updates)


def test_output_is_the_mean_for_exact_compressors():
  grads = harness.random_grads({"vector": (50,)}, seed=4)
  params = {"vector": jnp.zeros(50)}
  tx = gradcomp.none(axis_name=harness.AXIS)
  updates, _ = harness.sharded_update(tx)(
    harness.shard(grads), harness.worker_state(tx, params)
  )
  g = np.asarray(grads["vector"], np.float64)
  want = g.mean(axis=0)
  # A float32 sum of 8 values in any order, then a division: at most
  # 8 u sum|g_i| / 8 + u |mean| (u = 2^-24), whatever order the psum takes.
  u = np.finfo(np.float32).eps / 2
  bound = 8 * u * np.abs(g).mean(axis=0) + u * np.abs(want)
  error = np.abs(np.asarray(updates["vector"], np.float64)[0] - want)
  assert np.all(error <= bound), np.max(error / bound)
