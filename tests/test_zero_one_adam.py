"""0/1 Adam against a NumPy float64 transcription of its algorithm (Lu et al. 2022, Alg. 1).

The transcription follows DeepSpeed's ``zoadam.py`` step by step, with the
module's stated readings (bias correction by step and by variance update,
errors zeroed at the freeze, zero-variance coordinates held, weight decay
outside the accumulated update). The schedule
of variance steps and synchronisations is recomputed here, independently
of :func:`exchange_schedule`, and the two must agree.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from test_onebit_adam import AXIS, N, mesh, np_onebit_allreduce, run_sharded, split

import gradcomp
from gradcomp.optimizers.zero_one_adam import exchange_schedule, zero_one_adam

__all__ = ["mesh"]  # The shared fixture.

HYPER = {
  "var_freeze_step": 6,
  "var_update_scaler": 2,
  "local_step_scaler": 2,
  "local_step_clipper": 4,
}
LR, B1, B2, EPS, WD = 0.01, 0.9, 0.999, 1e-8, 0.01
# 12 steps: variance steps and 1-bit rounds, then local steps whose last
# one synchronises (every worker ends at the same params).
STEPS = 12


def np_zero_one_adam(params, grads):
  """``grads``: (steps, n, d). Returns final params (n, d), momentum (n, d), kinds."""
  steps, n, d = grads.shape
  p = np.repeat(params.astype(float)[None], n, axis=0)
  mu, nu, k = np.zeros((n, d)), np.zeros(d), 0
  acc, lr_sum = np.zeros((n, d)), 0.0
  we, se = np.zeros((n, d)), np.zeros((n, d))
  var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
  kinds = []

  def adam(mu, t, live):
    m_hat = mu / (1 - B1**t)
    scale = np.sqrt(nu / (1 - B2 ** max(k, 1))) + EPS
    return -LR * (np.where(live, m_hat / scale, 0.0) + WD * p)

  for t in range(1, steps + 1):
    g = grads[t - 1].astype(float)
    if t <= HYPER["var_freeze_step"]:
      if t % var_interval == 0:
        kinds.append("dense")
        gbar = g.mean(axis=0)
        mu = B1 * mu + (1 - B1) * gbar
        nu = B2 * nu + (1 - B2) * gbar**2
        k += 1
        var_counter += 1
        if var_counter == HYPER["var_update_scaler"]:
          var_counter, var_interval = 0, var_interval * 2
      else:
        kinds.append("onebit")
        live = nu > 0
        g1, we, se = np_onebit_allreduce(np.where(live, g, 0.0), we, se)
        mu = np.where(live, B1 * mu + (1 - B1) * g1, 0.0)
      p = p + adam(mu, t, nu > 0)
      continue
    if t == HYPER["var_freeze_step"] + 1:
      we, se = np.zeros_like(we), np.zeros_like(se)
    live = nu > 0
    scale = np.sqrt(nu / (1 - B2**k)) + EPS
    mu = np.where(live, B1 * mu + (1 - B1) * g, 0.0)
    u = adam(mu, t, live)
    # Weight decay outside the accumulation: the accumulator takes the
    # moment part and decays as the params do (the params are then
    # prod(1 - LR WD) x_sync + acc on every worker).
    acc, lr_sum = (1 - LR * WD) * acc + (u + LR * WD * p), lr_sum + LR
    sync = t % local_interval == 0
    local_counter += 1
    if local_counter == HYPER["local_step_scaler"]:
      local_counter = 0
      local_interval = min(HYPER["local_step_clipper"], local_interval * 2)
    if not sync:
      kinds.append("none")
      p = p + u
      continue
    kinds.append("onebit")
    mean, we, se = np_onebit_allreduce(np.where(live, acc * scale, 0.0), we, se)
    mean = np.where(live, mean, 0.0)
    p = p + u - acc + mean / scale
    mu = np.repeat((-(1 - B1**t) * mean / lr_sum)[None], n, axis=0)
    acc, lr_sum = np.zeros_like(acc), 0.0
  return p, mu, kinds


def test_the_schedule_is_the_algorithms():
  _, _, kinds = np_zero_one_adam(np.zeros(1), np.zeros((STEPS, 1, 1)))
  assert exchange_schedule(STEPS, **HYPER) == kinds
  # DeepSpeed's defaults: the variance every step for 16 steps, then every
  # 2nd for 16 updates, every 4th...; local steps only after 100,000.
  default = exchange_schedule(100)
  assert default[:16] == ["dense"] * 16
  assert default[16:20] == ["onebit", "dense", "onebit", "dense"]
  assert default[48:56] == ["onebit", "onebit", "onebit", "dense"] * 2


SHAPES = {"b": (7,), "w": (5, 3)}


def test_zero_one_adam_matches_the_algorithm(mesh):
  rng = np.random.default_rng(5)
  d = 22
  flat_params = rng.normal(size=d).astype(np.float32)
  flat_grads = rng.normal(size=(STEPS, N, d)).astype(np.float32)
  tx = zero_one_adam(
    LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, axis_name=AXIS, **HYPER
  )
  # After a synchronisation each worker undoes its own local steps: the
  # params agree up to that undo's rounding (a few ulps of values ~1).
  params, state = run_sharded(
    mesh, tx, split(flat_params, SHAPES), split(flat_grads, SHAPES), atol=1e-6
  )
  want_p, want_mu, _ = np_zero_one_adam(flat_params, flat_grads)
  got = np.concatenate([np.ravel(params[k]) for k in SHAPES])
  # Updates are lr x O(1), each a few float32 roundings of float64's; the
  # local steps and the 1-bit rounds add no cancellation: 1e-6 absolute on
  # params of size ~1 after 12 steps of 0.01 leaves a factor of ~10.
  np.testing.assert_allclose(got, want_p[0], atol=1e-6)
  got_mu = np.concatenate([state.mu[k].reshape(N, -1) for k in SHAPES], axis=1)
  np.testing.assert_allclose(got_mu, want_mu, atol=1e-5)
  assert int(state.count[0]) == STEPS and int(state.local_interval[0]) == 4
  assert not np.any(state.accumulator["w"]) and float(state.lr_sum[0]) == 0.0


def test_with_zero_gradients_the_params_decay_as_adamws(mesh):
  # Every phase (variance steps, 1-bit rounds, local steps, their
  # synchronisations) with zero gradients: the moments stay zero and the
  # decayed leaves follow AdamW's decoupled decay, x0 prod_t (1 - lr_t wd);
  # the mask keeps "b" as it is. With the decay inside the accumulated
  # update (DeepSpeed's), a synchronisation would undo the local steps'
  # decay and send none of it (nothing is live to send).
  rng = np.random.default_rng(8)
  params = {k: rng.normal(size=shape).astype(np.float32) for k, shape in SHAPES.items()}
  grads = {k: np.zeros((STEPS, N, *shape), np.float32) for k, shape in SHAPES.items()}
  schedule = optax.linear_schedule(0.05, 0.01, STEPS)
  wd = 0.5
  tx = zero_one_adam(
    schedule, weight_decay=wd, mask={"b": False, "w": True}, axis_name=AXIS, **HYPER
  )
  got, state = run_sharded(mesh, tx, params, grads)
  factor = np.prod([1 - float(schedule(t)) * wd for t in range(STEPS)])
  # Each step rounds x - lr (wd x) once or twice in float32 (2^-24 each):
  # 12 steps stay under 1e-6 relative.
  np.testing.assert_allclose(got["w"], params["w"] * factor, rtol=1e-6)
  np.testing.assert_array_equal(got["b"], params["b"])
  assert factor < 0.85  # The decay is there to see.
  for leaf in jax.tree.leaves((state.mu, state.accumulator)):
    assert not np.any(leaf)


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"learning_rate": -1.0}, "learning_rate must be > 0"),
    ({"b2": 1.0}, r"b2 must be in \[0, 1\)"),
    ({"var_freeze_step": -1}, "var_freeze_step must be an integer >= 1, got -1"),
    ({"var_freeze_step": 0}, "var_freeze_step must be an integer >= 1, got 0"),
    ({"var_update_scaler": 0}, "var_update_scaler must be an integer >= 1, got 0"),
    ({"local_step_clipper": 2.5}, "local_step_clipper must be an integer >= 1"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
  ],
)
def test_bad_hyperparameters_are_named(kwargs, message):
  lr = kwargs.pop("learning_rate", 0.1)
  with pytest.raises(ValueError, match=message):
    zero_one_adam(lr, **kwargs)


def test_no_two_state_leaves_share_a_buffer():
  # The training step donates its state: one buffer in two leaves fails to
  # run ("donate the same buffer twice"; under pytest, a crash).
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  for tx in (
    gradcomp.zero_one_adam(0.1),
    gradcomp.onebit_adam(0.1, freeze_step=2),
    gradcomp.demo(0.1),
  ):
    leaves = jax.tree.leaves(tx.init(params))
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers), type(tx.init(params)).__name__


def test_bfloat16_params_and_pmap(mesh):
  # bf16 params: float32 state, bf16 updates; under pmap, the shard_map
  # result (the same arithmetic: a few ulps of values ~1).
  rng = np.random.default_rng(7)
  params = {"w": jnp.asarray(rng.normal(size=16), jnp.bfloat16)}
  grads = {"w": jnp.asarray(rng.normal(size=(STEPS, N, 16)), jnp.bfloat16)}
  tx = zero_one_adam(LR, axis_name=AXIS, **HYPER)
  want, state = run_sharded(mesh, tx, params, grads, atol=1e-2)
  assert want["w"].dtype == jnp.bfloat16 and state.nu["w"].dtype == np.float32

  def body(g_seq, p):
    def step(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    return lax.scan(step, (p, tx.init(p)), g_seq)[0][0]

  per_device = jax.tree.map(lambda g: np.swapaxes(np.asarray(g), 0, 1), grads)
  replicated = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
  got = jax.pmap(body, AXIS, devices=jax.devices()[:N])(per_device, replicated)
  # bf16 params: one bf16 ulp (2^-8 of values ~1) per rounding differs.
  np.testing.assert_allclose(
    np.asarray(got["w"][0], np.float32), np.asarray(want["w"], np.float32), atol=2e-2
  )
