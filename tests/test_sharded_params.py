"""Every registered compressor on params sharded over another axis (DESIGN §7).

On a (2 x 4) mesh ``("data", "model")`` with ``w`` sharded over ``"model"``,
a compressor built with ``axis_name="data"`` compresses each device's block:
its result for block ``m`` must be what the same compressor gives on a mesh
of the two ``"data"`` workers alone, with block ``m`` as the leaf (one
program, run for each block). Two steps, so the state carries over. The
reference runs the same float32 operations on the same values; only the
order of a reduction may differ between the two programs, by at most a few
units in the last place of the largest magnitude involved.

And ``init`` on abstract params placed on the mesh gives state shaped and
sharded like the params: every state leaf shaped like ``w`` is sharded over
``"model"``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp

import harness

pytestmark = pytest.mark.xdist_group("sharded")

MESH = jax.make_mesh((2, 4), ("data", "model"))
PAIR = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
BLOCK = 8
REQUIRED = harness.REQUIRED
U = float(jnp.finfo(jnp.float32).eps) / 2

rng = np.random.default_rng(0)
# Two steps of gradients per device: w's block (data, step, model block), b.
G_W = rng.standard_normal((2, 2, 4 * BLOCK)).astype(np.float32)
G_B = rng.standard_normal((2, 2, 3)).astype(np.float32)
W = rng.standard_normal(4 * BLOCK).astype(np.float32)
B = rng.standard_normal(3).astype(np.float32)


def _two_steps(tx, g_w, g_b, w, b):
  """Two updates of one device's ``{"w", "b"}``; init on its params."""
  params = {"w": w, "b": b}
  state = tx.init(params)
  outs = []
  for t in range(2):
    out, state = tx.update({"w": g_w[0, t], "b": g_b[0, t]}, state, params)
    outs.append(out)
  return outs


def _sharded(tx):
  put = lambda x, spec: jax.device_put(x, NamedSharding(MESH, spec))
  out = [{"w": P("model"), "b": P()}] * 2
  f = jax.shard_map(
    lambda *a: _two_steps(tx, *a),
    mesh=MESH,
    in_specs=(P("data", None, "model"), P("data"), P("model"), P()),
    out_specs=out,
  )
  args = (
    put(G_W, P("data", None, "model")),
    put(G_B, P("data")),
    put(W, P("model")),
    B,
  )
  return jax.jit(f)(*args)


def _reference(tx):
  """Block m on the two data workers alone, for each m (one compile)."""
  f = jax.jit(
    jax.shard_map(
      lambda *a: _two_steps(tx, *a),
      mesh=PAIR,
      in_specs=(P("data"), P("data"), P(), P()),
      out_specs=[{"w": P(), "b": P()}] * 2,
    )
  )
  put = lambda x, spec: jax.device_put(x, NamedSharding(PAIR, spec))
  runs = []
  for m in range(4):
    block = slice(m * BLOCK, (m + 1) * BLOCK)
    runs.append(f(put(G_W[..., block], P("data")), put(G_B, P("data")), W[block], B))
  return runs


@pytest.mark.parametrize("name", gradcomp.names())
def test_each_block_is_compressed_as_a_leaf_of_its_own(name):
  tx = gradcomp.get(name, axis_name="data", **REQUIRED.get(name, {}))
  got = _sharded(tx)
  want = _reference(tx)
  scale = max(np.abs(G_W).max(), np.abs(G_B).max(), 1.0)
  for t in range(2):
    w = np.concatenate([np.asarray(run[t]["w"]) for run in want])
    out_scale = max(scale, np.abs(w).max())
    bound = 8 * U * out_scale  # a reduction's order, a few ulps
    np.testing.assert_allclose(got[t]["w"], w, rtol=0, atol=bound)
    np.testing.assert_allclose(got[t]["b"], want[0][t]["b"], rtol=0, atol=bound)


@pytest.mark.parametrize("name", gradcomp.names())
def test_init_on_abstract_params_shards_the_state_like_the_params(name):
  tx = gradcomp.get(name, axis_name="data", **REQUIRED.get(name, {}))
  params = {
    "w": jax.ShapeDtypeStruct(
      (4 * BLOCK,), jnp.float32, sharding=NamedSharding(MESH, P("model"))
    ),
    "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(MESH, P())),
  }
  with jax.set_mesh(MESH):
    state = jax.eval_shape(tx.init, params)
  like_w = [x for x in jax.tree.leaves(state) if x.shape == (4 * BLOCK,)]
  for x in like_w:
    assert x.sharding.spec == P("model"), (name, x)


@pytest.mark.parametrize(
  "make",
  [
    lambda: gradcomp.onebit_adam(1e-3, freeze_step=10, axis_name="data"),
    lambda: gradcomp.zero_one_adam(1e-3, axis_name="data"),
    lambda: gradcomp.demo(1e-3, axis_name="data"),
  ],
  ids=["onebit_adam", "zero_one_adam", "demo"],
)
def test_the_adaptive_optimizers_moments_are_sharded_like_the_params(make):
  """Their momentum / variance / DeMo's delta; 1-bit Adam's flat error
  buffers concatenate every leaf and are not param-shaped."""
  params = {
    "w": jax.ShapeDtypeStruct(
      (4 * BLOCK,), jnp.float32, sharding=NamedSharding(MESH, P("model"))
    ),
    "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(MESH, P())),
  }
  with jax.set_mesh(MESH):
    state = jax.eval_shape(make().init, params)
  like_w = [x for x in jax.tree.leaves(state) if x.shape == (4 * BLOCK,)]
  assert like_w and all(x.sharding.spec == P("model") for x in like_w)
