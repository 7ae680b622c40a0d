"""In-place updates: ``kernels.ordering`` and the compressors that rely on it.

XLA copies a donated buffer that an operation overwrites unless a data
dependency orders the overwrite after every read of the old contents
(``gradcomp/kernels/ordering.py``). These tests read the compiled program:
with the gradient and state donated, random-k and DGC must need no
temporary buffer of the gradient's size (fresh memory, page-faulted on every
call on CPU), which they did before the dependencies were added (BUILD_NOTES,
issue 18).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from gradcomp.kernels import ordering

SIZE = 1 << 18  # above selection._DIRECT_ALWAYS: DGC takes its sampled path


@pytest.mark.parametrize(
  "value", [0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-45]
)
def test_zero_after_is_positive_zero_for_every_value(value):
  x = jnp.full((3,), value, jnp.float32)
  zero = jax.jit(ordering.zero_after)(x)
  assert zero.dtype == jnp.float32 and zero.shape == ()
  assert float(zero) == 0.0 and not np.signbit(float(zero))


def test_zero_after_of_an_empty_array():
  assert float(ordering.zero_after(jnp.zeros((0,), jnp.float32))) == 0.0


def _temporaries_over_gradient(name, **kwargs):
  """XLA's temporary bytes of a donated update, over the gradient's bytes."""
  tx = gradcomp.get(name, **kwargs)
  grads = {"w": jnp.zeros((SIZE,), jnp.float32)}
  update = jax.jit(lambda g, s: tx.update(g, s, None), donate_argnums=(0, 1))
  memory = update.lower(grads, tx.init(grads)).compile().memory_analysis()
  return memory.temp_size_in_bytes / (4 * SIZE)


@pytest.mark.parametrize(
  "name, kwargs",
  [
    ("randomk", {"ratio": 0.01}),
    ("randomk", {"ratio": 0.01, "error_feedback": False}),
    ("dgc", {"ratio": 0.01}),
    ("ef_signsgd", {}),
  ],
)
def test_donated_update_needs_no_gradient_sized_temporary(name, kwargs):
  # Before the dependencies: 1.04 (random-k), 1.03 (without error feedback)
  # and 2.09 (DGC) gradients of fresh memory per call; what remains is the
  # O(k) payload and index work (k = 1 % of the gradient), or EF-signSGD's
  # bits (1.03 when its residual did not wait for the payload's pass).
  assert _temporaries_over_gradient(name, **kwargs) < 0.25
