"""The training schemes on params sharded over another mesh axis (DESIGN §7).

On a (2 x 4) mesh ``("data", "model")`` with ``w`` sharded over ``"model"``,
a scheme built with ``axis_name="data"`` runs each block's workers on their
own: its result for block ``m`` must be what the same scheme gives on the two
``"data"`` workers alone with block ``m`` as the leaf (one program, run for
each block), as for the compressors (``test_sharded_params.py``). ``T``
steps, so rounds, delays and error feedback all act. Both programs do the
same float32 operations on the same values; only a reduction's order may
differ, a few ulps of the largest magnitude per step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp

pytestmark = pytest.mark.xdist_group("sharded")

MESH = jax.make_mesh((2, 4), ("data", "model"))
PAIR = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
BLOCK, T = 8, 5  # the last step local: the workers differ
U = float(jnp.finfo(jnp.float32).eps) / 2

rng = np.random.default_rng(1)
G_W = rng.standard_normal((2, T, 4 * BLOCK)).astype(np.float32)
G_B = rng.standard_normal((2, T, 3)).astype(np.float32)
W = rng.standard_normal(4 * BLOCK).astype(np.float32)
B = rng.standard_normal(3).astype(np.float32)


def _topk():
  return gradcomp.topk(0.5, axis_name="data")


SCHEMES = {
  "diloco_topk": lambda: gradcomp.local_sgd(
    optax.sgd(0.1),
    2,
    outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    compressor=_topk(),
    axis_name="data",
  ),
  "streaming": lambda: gradcomp.local_sgd(
    optax.sgd(0.1),
    4,
    fragments=2,
    overlap=1,
    alpha=0.5,
    split_leaves=True,
    axis_name="data",
  ),
  "easgd": lambda: gradcomp.easgd(optax.sgd(0.1), 0.4, axis_name="data"),
  "cdsgd": lambda: gradcomp.cdsgd(
    optax.sgd(0.1), _topk(), local_learning_rate=0.05, warmup_steps=1, axis_name="data"
  ),
  "choco_ring": lambda: gradcomp.gossip(
    optax.sgd(0.1), "ring", compressor=_topk(), gamma=0.5, axis_name="data"
  ),
}


def _steps(tx, g_w, g_b, w, b):
  """``T`` scheme steps of one device's ``{"w", "b"}``; its final params."""
  params = {"w": w, "b": b}
  state = tx.init(params)
  for t in range(T):
    updates, state = tx.update({"w": g_w[0, t], "b": g_b[0, t]}, state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(lambda x: x[None], params)


def _sharded(tx):
  put = lambda x, spec: jax.device_put(x, NamedSharding(MESH, spec))
  every = P(("data", "model"))
  f = jax.shard_map(
    lambda *a: _steps(tx, *a),
    mesh=MESH,
    in_specs=(P("data", None, "model"), P("data"), P("model"), P()),
    out_specs={"w": every, "b": every},
  )
  args = (
    put(G_W, P("data", None, "model")),
    put(G_B, P("data")),
    put(W, P("model")),
    B,
  )
  return jax.device_get(jax.jit(f)(*args))


def _reference(tx):
  f = jax.jit(
    jax.shard_map(
      lambda *a: _steps(tx, *a),
      mesh=PAIR,
      in_specs=(P("data"), P("data"), P(), P()),
      out_specs={"w": P("data"), "b": P("data")},
    )
  )
  put = lambda x: jax.device_put(x, NamedSharding(PAIR, P("data")))
  runs = []
  for m in range(4):
    block = slice(m * BLOCK, (m + 1) * BLOCK)
    runs.append(jax.device_get(f(put(G_W[..., block]), put(G_B), W[block], B)))
  return runs


@pytest.mark.parametrize("name", SCHEMES)
def test_each_block_trains_as_on_its_own_workers(name):
  got = _sharded(SCHEMES[name]())
  want = _reference(SCHEMES[name]())
  scale = max(np.abs(got["w"]).max(), np.abs(W).max(), np.abs(G_W).max(), 1.0)
  bound = T * 8 * U * scale
  for d in range(2):
    for m in range(4):
      row = d * 4 + m
      np.testing.assert_allclose(got["w"][row], want[m]["w"][d], rtol=0, atol=bound)
      np.testing.assert_allclose(got["b"][row], want[m]["b"][d], rtol=0, atol=bound)
  assert not np.allclose(got["w"][0], got["w"][4])  # the two data workers differ
