"""1-bit Adam, 0/1 Adam and DeMo as ``hierarchical``'s inner (issue 33, DESIGN §7).

On a (2 x 4) mesh ``("node", "local")``: the gradient is reduce-scattered
over ``"local"``, the optimizer runs on each device's quarter of every leaf
over ``"node"`` (its momentum, variance and errors a quarter of the memory),
and the updates are all-gathered over ``"local"``. Before its freeze step
1-bit Adam is AdamW on the mean gradient, so the composition equals
``optax.adam`` on the mean over all 8 devices: per step the two means differ
by at most ``(n + 2) u`` relative (``n = 8`` additions, a division, the cast),
the moments carry that relative error, and ``m / (sqrt(v) + eps)`` (at most
3 in magnitude over these steps) doubles it and adds ~8 roundings, so each
update is within ``3 (2 (n + 2) + 8) u lr``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp

pytestmark = pytest.mark.xdist_group("adaptive_hierarchical")

MESH = jax.make_mesh((2, 4), ("node", "local"))
ALL = ("node", "local")
T, N, LR = 3, 8, 1e-2
U = float(jnp.finfo(jnp.float32).eps) / 2
SHAPES = {"w": (4, 3), "b": (5,)}  # 12 and 5 values: shards of 3 and 2

rng = np.random.default_rng(0)
GRADS = {
  k: rng.standard_normal((N, T, *s)).astype(np.float32) for k, s in SHAPES.items()
}
PARAMS = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _run(tx):
  """``T`` updates on every device; each device's updates and the final state."""

  def steps(grads, params):
    state = tx.init(params)
    outs = []
    for t in range(T):
      g = jax.tree.map(lambda x: x[0, t], grads)
      updates, state = tx.update(g, state, params)
      outs.append(jax.tree.map(lambda u: u[None], updates))
    shapes = jax.tree.map(lambda x: jnp.zeros((1,) + x.shape), state)
    return outs, shapes

  spec = P(ALL)
  f = jax.jit(
    jax.shard_map(steps, mesh=MESH, in_specs=(spec, P()), out_specs=(spec, spec))
  )
  grads = jax.device_put(GRADS, NamedSharding(MESH, spec))
  return jax.device_get(f(grads, PARAMS))


def _same_on_every_device(outs):
  for step in outs:
    for x in jax.tree.leaves(step):
      np.testing.assert_array_equal(x, np.broadcast_to(x[:1], x.shape))


def test_onebit_adam_before_its_freeze_is_adam_on_the_mean_of_all_eight():
  inner = gradcomp.onebit_adam(LR, freeze_step=100, axis_name="node")
  outs, _ = _run(gradcomp.hierarchical(inner, "local"))
  _same_on_every_device(outs)
  adam = optax.adam(LR, b1=0.9, b2=0.999, eps=1e-8)
  state = adam.init(PARAMS)
  bound = 3 * (2 * (N + 2) + 8) * U * LR
  for t in range(T):
    mean = {
      k: np.mean(np.float64(g[:, t]), axis=0).astype(np.float32)
      for k, g in GRADS.items()
    }
    want, state = adam.update(mean, state, PARAMS)
    for k in SHAPES:
      err = np.max(np.abs(np.float64(outs[t][k][0]) - np.float64(want[k])))
      assert err <= bound, (t, k, err, bound)


@pytest.mark.parametrize(
  "name, inner",
  [
    ("onebit_adam", lambda: gradcomp.onebit_adam(LR, freeze_step=1, axis_name="node")),
    (
      "zero_one_adam",
      lambda: gradcomp.zero_one_adam(LR, var_freeze_step=1, axis_name="node"),
    ),
    ("demo", lambda: gradcomp.demo(LR, chunk=2, topk=1, axis_name="node")),
  ],
)
def test_compressed_phase_runs_on_the_shards(name, inner):
  """Past the freeze (1-bit, 0/1 Adam) or from the start (DeMo): defined
  updates, the same on every device, and state a quarter of each leaf."""
  outs, state = _run(gradcomp.hierarchical(inner(), "local"))
  _same_on_every_device(outs)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(outs))
  assert any(np.any(x != 0) for x in jax.tree.leaves(outs[-1]))
  sized = {x.shape[1:] for x in jax.tree.leaves(state) if x.ndim > 1}
  assert (3,) in sized and not {(4, 3), (12,)} & sized, (name, sized)
