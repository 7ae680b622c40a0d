"""An ``axis_name`` across which the params are different shards is refused (issue 32).

On a (2 x 4) mesh ``("data", "model")`` with ``w`` sharded over ``"model"``,
compressing over ``"data"`` is per-shard compression: each device gets the
mean over ``"data"`` of the workers' top-k of its own block. Compressing
over ``("data", "model")`` would add different blocks together: a
``ValueError`` naming ``'model'``, raised while tracing (no compile). One
program is compiled, for the per-shard result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel.branches import varying_axes

import harness

MESH = jax.make_mesh((2, 4), ("data", "model"))
BOTH = ("data", "model")
BLOCK = 4  # coordinates of w per model shard
REQUIRED = harness.REQUIRED
WRONG = r"axis_name includes 'model', but the params differ across 'model'"

rng = np.random.default_rng(0)
# Per device (d, m): its gradient of w's block m, its gradient of b (replicated).
G_W = rng.standard_normal((2, 4 * BLOCK)).astype(np.float32)
G_B = rng.standard_normal((2, 3)).astype(np.float32)
W = rng.standard_normal(4 * BLOCK).astype(np.float32)
B = rng.standard_normal(3).astype(np.float32)


def _put(x, spec):
  return jax.device_put(x, NamedSharding(MESH, spec))


ARGS = (_put(G_W, P("data", "model")), _put(G_B, P("data")), _put(W, P("model")), B)
IN_SPECS = (P("data", "model"), P("data"), P("model"), P())


def _local(g_w, g_b, w, b):
  """This device's gradients and params: w's block varies over "model" only."""
  return {"w": g_w[0], "b": g_b[0]}, {"w": w, "b": b}


def _per_worker(tree):
  """``tree`` typed varying over both axes, as a scheme's per-worker values are."""

  def vary(x):
    missing = tuple(a for a in BOTH if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(vary, tree)


def _unvarying(tree):
  """Zeros shaped like ``tree``, typed replicated: a state's init that passes."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)


def _trace(f):
  return jax.eval_shape(
    jax.shard_map(f, mesh=MESH, in_specs=IN_SPECS, out_specs=P()), *ARGS
  )


def _topk_mean(g, k):
  """NumPy: the mean over rows of each row's k largest-magnitude entries."""
  keep = np.zeros_like(g)
  for d, row in enumerate(g):
    top = np.argsort(-np.abs(row))[:k]
    keep[d, top] = row[top]
  return keep.mean(axis=0)


def test_per_shard_compression_over_data_is_the_mean_of_each_blocks_topk():
  plain = gradcomp.topk(0.5, axis_name="data")
  fused = gradcomp.layerfusion(gradcomp.topk(0.5, axis_name="data"), "layerwise")

  def step(*args):
    grads, params = _local(*args)
    return tuple(tx.update(grads, tx.init(params), params)[0] for tx in (plain, fused))

  out = {"w": P("model"), "b": P()}
  got, got_fused = jax.jit(
    jax.shard_map(step, mesh=MESH, in_specs=IN_SPECS, out_specs=(out, out))
  )(*ARGS)
  blocks = [G_W[:, m * BLOCK : (m + 1) * BLOCK] for m in range(4)]
  want_w = np.concatenate([_topk_mean(g, BLOCK // 2) for g in blocks])
  np.testing.assert_allclose(got["w"], want_w, rtol=1e-6)
  np.testing.assert_allclose(got["b"], _topk_mean(G_B, 1), rtol=1e-6)
  for key in got:
    np.testing.assert_array_equal(got_fused[key], got[key])


def test_averaging_across_the_shards_axis_is_refused_in_update():
  tx = gradcomp.topk(0.5, axis_name=BOTH)

  def step(*args):
    grads, params = _local(*args)
    return tx.update(grads, tx.init(_unvarying(grads)), params)[0]["b"]

  with pytest.raises(ValueError, match=WRONG + r".*params\['w'\]"):
    _trace(step)


def test_averaging_across_the_shards_axis_is_refused_in_init():
  tx = gradcomp.topk(0.5, axis_name=BOTH)

  def init(*args):
    tx.init(_local(*args)[1])
    return jnp.zeros(())

  with pytest.raises(ValueError, match=WRONG):  # traced
    _trace(init)
  with pytest.raises(ValueError, match=WRONG):  # concrete: eager shard_map
    jax.shard_map(init, mesh=MESH, in_specs=IN_SPECS, out_specs=P())(*ARGS)


def test_layerfusion_checks_the_unfused_params():
  """A single fused buffer of w and b: the error names the leaf w, not the buffer."""
  tx = gradcomp.layerfusion(gradcomp.topk(0.5, axis_name=BOTH), "single")

  def step(*args):
    grads, params = _local(*args)
    return tx.update(grads, tx.init(_unvarying(grads)), params)[0]["b"]

  def init(*args):
    tx.init(_local(*args)[1])
    return jnp.zeros(())

  for f in (step, init):
    with pytest.raises(ValueError, match=WRONG + r".*params\['w'\]"):
      _trace(f)


def test_params_none_pass_and_per_worker_params_are_refused_on_one_axis():
  """No params pass; params that differ between the workers of the group are
  refused whether the group has one axis or two: the schemes that exchange
  per-worker values pass their compressor no params."""
  for axis in ("data", BOTH):
    tx = gradcomp.topk(0.5, axis_name=axis)

    def none(*args):
      grads, _ = _local(*args)
      return tx.update(grads, tx.init(_unvarying(grads)))[0]["b"]

    def per_worker(*args):
      grads, params = _local(*args)
      return tx.update(grads, tx.init(_unvarying(grads)), _per_worker(params))[0]["b"]

    _trace(none)
    with pytest.raises(ValueError, match="axis_name includes 'data'"):
      _trace(per_worker)


@pytest.mark.parametrize("name", gradcomp.names())
def test_every_registered_compressor_refuses_it(name):
  """Traced only; the check runs before the codec is traced."""
  tx = gradcomp.get(name, axis_name=BOTH, **REQUIRED.get(name, {}))

  def step(*args):
    grads, params = _local(*args)
    return tx.update(grads, tx.init(_unvarying(grads)), params)[0]["b"]

  with pytest.raises(ValueError, match=WRONG):
    _trace(step)
