"""One suite over every registered compressor (STYLE §12)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from gradcomp.compressors import scatter

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
  "fp8": {"format": "e4m3", "block_size": 16},
  "fp4": {"block_size": 16, "stochastic": True, "error_feedback": True},
  "int_quantize": {"bits": 4, "block_size": 16},
  "qgz": {"block_size": 16},
}
# The reduce-scatter forms of the quantizing codecs (exchange="scatter",
# compressors/scatter.py), each a case "name:scatter" with the config above.
SCATTER = scatter.SCATTERED
CASES = {name: (name, config) for name, config in CONFIGS.items()} | {
  f"{name}:scatter": (name, {**CONFIGS[name], "exchange": "scatter"})
  for name in SCATTER
}
NAMES = sorted(CASES)

PARAMS = harness.MIXED_PARAMS

# One pytest-xdist worker runs the module: the single-device eager runs reuse
# the primitive programs compiled for the compressors before them (the same
# casts, reshapes and hashes), which a second worker would compile again.
pytestmark = pytest.mark.xdist_group("conformance")


def make(case, axis_name=None):
  name, config = CASES[case]
  return gradcomp.get(name, axis_name=axis_name, **config)


def assert_like(tree, reference):
  chex.assert_trees_all_equal_shapes_and_dtypes(tree, reference)
  chex.assert_tree_all_finite(tree)


def test_every_registered_compressor_is_covered():
  assert set(gradcomp.names()) == set(CONFIGS)


# Eager runs compile every primitive on its own, once per leaf shape (484
# compiles, ~12 s, for dynamic fixed point on PARAMS), so the eager case runs
# on two leaves. Eager and jit run the same Python: what only an eager run can
# break is code that needs a tracer (or a concrete value), whatever the leaves;
# the leaf-dependent branches (dtypes, scalars, reshaped ranks) are traced
# alike and checked under jit on PARAMS. The two leaves still cross a
# half-precision boundary (cast in, saturate out) and take both the matrix
# and the reshaped-vector paths (PowerSGD, 1-bit SGD's columns).
EAGER_PARAMS = {
  "kernel": jnp.zeros((12, 10), jnp.float32),
  "bias": jnp.zeros((10,), jnp.bfloat16),
}


# Eagerly, a scatter form on one device is its codec's encode and decode of
# one chunk (the gather form's primitives); it runs jitted, and eagerly on 8
# workers in test_shard_map_without_jit.
@pytest.mark.parametrize(
  ("name", "jit"),
  [
    pytest.param(name, jit, id=f"{'jit' if jit else 'nojit'}-{name}")
    for name in NAMES
    for jit in (True, False)
    if jit or ":scatter" not in name
  ],
)
def test_single_device_update(name, jit):
  """One update keeps shapes, dtypes and the state's type; finite outputs.

  Jitted, three updates chained through the state trace once: the state comes
  back with the avals it went in with (no retracing).
  """
  chex.clear_trace_counter()  # ids of collected functions get reused
  tx = make(name)
  params = PARAMS if jit else EAGER_PARAMS
  state = tx.init(params)
  update = jax.jit(chex.assert_max_traces(tx.update, n=1)) if jit else tx.update
  for seed in range(3 if jit else 1):
    grads = harness.grads_like(params, seed)
    updates, new_state = update(grads, state)
    assert_like(updates, grads)
    # The state keeps its type, structure, shapes and dtypes.
    assert type(new_state) is type(state)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    state = new_state


@pytest.mark.parametrize("name", NAMES)
def test_empty_tree(name):
  tx = make(name)
  assert tx.update({}, tx.init({}))[0] == {}


@pytest.mark.parametrize("name", NAMES)
def test_init_on_shape_dtype_structs(name):
  tx = make(name)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(tx.init(abstract), tx.init(PARAMS))


# The scatter forms share one exchange (scatter.two_stage), checked for
# every codec against NumPy on 8 workers in test_scatter_forms.py; here two
# of them: an error-feedback one and an unbiased one with fresh keys.
PMAP_NAMES = [n for n in NAMES if ":scatter" not in n] + [
  "ef_signsgd:scatter",
  "qsgd:scatter",
]


@pytest.mark.parametrize("name", PMAP_NAMES)
def test_shard_map_identical_on_every_worker_and_equal_to_pmap(name):
  tx = make(name, harness.AXIS)
  grads = harness.random_grads(
    {"kernel": (12, 10), "vector": (50,), "scale": ()}, seed=1
  )
  params = jax.tree.map(lambda g: g[0], grads)
  start = harness.worker_state(tx, params)
  updates, state = harness.sharded_update(tx)(harness.shard(grads), start)
  assert_like(updates, grads)
  harness.assert_same_on_workers(updates)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, start)
  # pmap on the same inputs: the same update, up to the order in which the
  # collectives add 8 float32 terms (bit for bit on this backend today).
  by_pmap, _ = harness.pmapped_update(tx)(
    grads, gradcomp.add_worker_axis(tx.init(params), harness.WORKERS)
  )
  harness.assert_same_on_workers(by_pmap)
  chex.assert_trees_all_close(by_pmap, updates, rtol=1e-5, atol=1e-6)


# Eager shard_map compiles every primitive on 8 devices, afresh on every call
# (2-7 s per compressor alone on 2 cores, several times that beside another
# pytest worker), so it runs the fewest compressors that still use every collective
# the codecs use (exchange.py), each through its own code path:
# - randomk: the step key agreed by pmax (as sketch_topk's), and the shared
#   k values all-reduced (psum);
# - powersgd: exchange.all_reduce_mean, none's exact path (fp16 and
#   sketch_topk psum through all_reduce_sum the same way), here of the
#   factors, and a state entry computed from all-reduced values recast as
#   varying (vary_like's pcast, as dynamic fixed point's exponent);
# - fixed_point: a per-worker key from axis_index (as qsgd, terngrad and
#   dynamic fixed point) and exchange.all_gather of packed codes, the gather
#   that every other codec's payload takes (topk's and dgc's values and
#   indices, the sign codecs' packed bits);
# - fixed_point:scatter: scatter.two_stage, the all_to_all of every scatter
#   form and the owner's chunk chosen by axis_index, then its all-gather.
# What the others compute on their own payload runs eagerly in
# test_single_device_update, and every compressor runs jitted on 8 workers.
EAGER_NAMES = ("fixed_point", "fixed_point:scatter", "powersgd", "randomk")


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
