"""The README's example, run as written: a data-parallel step that trains."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def test_readme_step_trains_on_eight_workers():
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rng = np.random.default_rng(0)
  true_w = rng.standard_normal((16, 1)).astype(np.float32)
  x = rng.standard_normal((64, 16)).astype(np.float32)
  batch = (x, x @ true_w)
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  params = {"w": jnp.zeros((16, 1)), "b": jnp.zeros((1,))}

  tx = optax.chain(gradcomp.topk(0.25, axis_name="data"), optax.sgd(0.1))
  opt_state = gradcomp.add_worker_axis(tx.init(params), mesh.size)
  opt_state = jax.device_put(opt_state, NamedSharding(mesh, P("data")))

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), P("data"), P("data")),
    out_specs=(P(), P("data"), P()),
  )
  def step(params, opt_state, batch):
    # Differentiate a per-worker copy: the gradient of the replicated params
    # would come back already summed over workers (psum is pvary's transpose).
    local = jax.lax.pcast(params, "data", to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    updates, opt_state = tx.update(grads, gradcomp.drop_worker_axis(opt_state), params)
    loss = jax.lax.pmean(loss, "data")
    return (
      optax.apply_updates(params, updates),
      gradcomp.add_worker_axis(opt_state),
      loss,
    )

  # Only the compressed payloads (and the 4-byte loss) cross the wire: the
  # 17-float gradient is never all-reduced densely.
  sent = gradcomp.wire_bytes(step, params, opt_state, batch)
  assert sent == (4 + 1) * 8 + 4, sent

  losses = []
  for _ in range(60):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  assert losses[-1] < 0.05 * losses[0], losses[::10]
  # Residuals are per worker: they differ between workers.
  residual = np.asarray(opt_state[0].leaves["w"].residual)
  assert residual.shape == (mesh.size, 16, 1)
  assert not np.allclose(residual[0], residual[1])
