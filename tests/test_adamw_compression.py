"""What ``optax.chain(compressor, adam)`` does to error feedback, in closed form.

Error feedback conserves the *gradient's* mass: after T steps, what was sent
plus the residual is the sum of the gradients. SGD is linear, so its
displacement is ``-lr`` times what was sent: the compressed run trails the
dense one by at most ``lr`` times the residual. Adam is not: it normalises
each coordinate, so a coordinate held back for k steps and then sent with k
steps' mass moves once, by about ``lr``, where dense Adam moved ``k`` times.
With ``b1 = b2 = 0`` Adam's update is ``lr * g / (|g| + eps)``, a sign step,
and the displacement of a coordinate is exactly ``lr`` times the number of
steps in which it was sent: its effective learning rate is scaled by its
sending frequency. This is why 1-bit Adam compresses the momentum once the
variance is frozen instead (Tang et al. 2021, §3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradcomp

STEPS = 60
LR = 0.01
# Coordinate 0 always has the larger gradient; coordinate 1 accumulates in the
# residual until it overtakes, then is sent once (top-1 of 2 coordinates).
GRAD = jnp.array([1.0, 0.25])


def run(tx):
  """``STEPS`` updates on the constant gradient; params, state, each step's sent mask."""

  @jax.jit
  def scan(params):
    def step(carry, _):
      params, state = carry
      updates, state = tx.update(GRAD, state, params)
      return (optax.apply_updates(params, updates), state), updates != 0

    return jax.lax.scan(step, (params, tx.init(params)), length=STEPS)

  (params, state), sent = scan(jnp.zeros(2))
  return np.asarray(params), state, np.asarray(sent)


def test_sgd_after_error_feedback_trails_dense_by_the_residual():
  params, state, _ = run(optax.chain(gradcomp.topk(0.5), optax.sgd(LR)))
  residual = np.asarray(state[0].leaves.residual)
  # sent + residual = STEPS * g, and SGD moves -LR * sent.
  np.testing.assert_allclose(
    params, -LR * (STEPS * np.asarray(GRAD) - residual), rtol=1e-5
  )
  # At most one step's larger gradient waits behind, per coordinate.
  assert np.all((0 <= residual) & (residual <= GRAD[0] + GRAD[1]))


def test_adam_after_error_feedback_moves_each_coordinate_once_per_send():
  adam = optax.adam(LR, b1=0.0, b2=0.0, eps=1e-12)
  params, _, sent = run(optax.chain(gradcomp.topk(0.5), adam))
  sends = sent.sum(0)
  assert sends.sum() == STEPS  # top-1 of 2: one coordinate per step.
  # Each send moves its coordinate by LR (a sign step), whatever mass it carries.
  np.testing.assert_allclose(params, -LR * sends, rtol=1e-5)
  dense, _, _ = run(adam)
  np.testing.assert_allclose(dense, -LR * STEPS * np.ones(2), rtol=1e-5)
  # Coordinate 1 is sent when its residual 0.25 t exceeds coordinate 0's 1:
  # at t = 5, then every 5 steps (coordinate 0 waits one step, sent next with
  # 2). Dense Adam moved it 5 times as far, though all its mass was delivered.
  assert sends.tolist() == [STEPS - STEPS // 5, STEPS // 5]
