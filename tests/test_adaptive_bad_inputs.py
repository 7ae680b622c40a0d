"""Hostile gradients through 1-bit, compressed-momentum and 0/1 Adam and DeMo, as the program wraps them.

The training program puts each optimizer inside ``gradcomp.apply_if_finite``
(any worker's non-finite gradient skips the step on every worker). One
hostile step on worker 0 (NaN, an infinity, zeros, subnormals), then clean
steps through every phase: the state stays finite, a non-finite step
changes nothing, and the params stay finite (and, but for 0/1 Adam's local
steps, the same on every worker).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import exchange
from gradcomp.optimizers.compressed_adam import compressed_adam
from gradcomp.parallel.branches import varying_axes
from gradcomp.parallel.workers import add_worker_axis

AXIS, N, STEPS = "data", 4, 4
OPTIMIZERS = {
  "onebit_adam": lambda: gradcomp.onebit_adam(1e-2, freeze_step=1, axis_name=AXIS),
  "zero_one_adam": lambda: gradcomp.zero_one_adam(
    1e-2,
    var_freeze_step=2,
    var_update_scaler=1,
    local_step_scaler=1,
    local_step_clipper=2,
    axis_name=AXIS,
  ),
  "demo": lambda: gradcomp.demo(1e-2, chunk=4, topk=2, axis_name=AXIS),
  "compressed_adam": lambda: compressed_adam(
    1e-2, gradcomp.topk(0.25, axis_name=AXIS), freeze_step=1, axis_name=AXIS
  ),
}
# The leaves: a matrix, a bfloat16 vector, a scalar, one element.
SHAPES = {"m": ((6, 5), jnp.float32), "b": ((8,), jnp.bfloat16), "s": ((), jnp.float32)}
SHAPES["one"] = ((1,), jnp.float32)
CASES = {"nan": np.nan, "+inf": np.inf, "zeros": 0.0, "subnormal": 3e-45}


def vary(tree):
  """Every leaf typed varying over the workers (those already varying kept)."""
  cast = lambda x: x if AXIS in varying_axes(x) else lax.pcast(x, AXIS, to="varying")
  return jax.tree.map(cast, tree)


def hostile_run(tx, value):
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), d) for k, (s, d) in SHAPES.items()}
  grads = {
    k: rng.normal(size=(STEPS, N, *s)).astype(np.float32)
    for k, (s, _) in SHAPES.items()
  }
  for k, (_, d) in SHAPES.items():  # Worker 0's first gradient is hostile.
    grads[k][0, 0] = value
    grads[k] = jnp.asarray(grads[k], d)

  def body(g, p):
    g = jax.tree.map(lambda x: x[:, 0], g)
    p, s = vary((p, tx.init(p)))  # Every leaf per worker, as the scan carries it.

    def step(carry, g):
      p, s = carry
      u, new = tx.update(g, s, p)
      p = vary(optax.apply_updates(p, u))
      return (p, exchange.vary_like(new, s)), p

    (p, s), trail = lax.scan(step, (p, s), g)
    return add_worker_axis((trail, s))

  mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])
  put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, AXIS), P()), out_specs=P(AXIS))
  trail, state = jax.jit(f)(put(grads, P(None, AXIS)), put(params, P()))
  return params, jax.tree.map(np.asarray, trail), jax.tree.map(np.asarray, state)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_hostile_step_leaves_everything_defined(name, case):
  tx = gradcomp.apply_if_finite(OPTIMIZERS[name](), 2**31 - 2, axis_name=AXIS)
  params, trail, state = hostile_run(tx, CASES[case])
  for leaf in jax.tree.leaves(state):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64))), (name, case)
  for k in SHAPES:
    got = trail[k].astype(np.float64)  # (workers, steps, ...)
    assert np.all(np.isfinite(got)), (name, case, k)
    if not np.isfinite(CASES[case]):  # Skipped on every worker: unchanged.
      want = np.broadcast_to(np.asarray(params[k], np.float64), got[:, 0].shape)
      np.testing.assert_array_equal(got[:, 0], want)
    if name != "zero_one_adam":  # The same step on every worker.
      assert all(np.array_equal(got[0], got[w]) for w in range(N)), (name, case, k)
