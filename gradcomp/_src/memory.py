"""Error feedback: the memory part shared by every compressor that uses it.

DESIGN §1, *memory*; paper 004 §4 (1-bit quantization with error feedback,
Seide et al. 2014) and Karimireddy et al. 2019 (EF-signSGD):

.. math::
  e_t = r_{t-1} + g_t, \\quad p_t = C(e_t), \\quad r_t = e_t - D(p_t)

Non-finite policy: a step whose corrected gradient ``e_t`` holds a NaN or an
Inf leaves the residual and the inner codec state exactly as they were, so one
bad batch never poisons the memory. The step's output is still non-finite (the
exchange carries it to every worker), which is what ``apply_if_finite`` checks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradcomp._src.base import LeafCodec


class ErrorFeedbackState(NamedTuple):
  residual: jax.Array  # leaf shape, float32: what earlier steps did not send.
  inner: Any  # the wrapped codec's state.


def keep_if_finite(finite: jax.Array, new, old):
  """``new`` where ``finite`` else ``old``, leaf by leaf."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def error_feedback(codec: LeafCodec) -> LeafCodec:
  """Wraps ``codec`` so that what it leaves behind is sent in later steps."""

  def init(leaf, key):
    return ErrorFeedbackState(
      residual=jnp.zeros(leaf.shape, jnp.float32),
      inner=codec.init(leaf, key),
    )

  def apply(g, state, key, step):
    e = state.residual + g
    mean, remainder, inner = codec.apply(e, state.inner, key, step)
    finite = jnp.all(jnp.isfinite(e))
    new_state = keep_if_finite(finite, ErrorFeedbackState(remainder, inner), state)
    return mean, remainder, new_state

  return LeafCodec(init, apply)


def maybe_error_feedback(codec: LeafCodec, enabled: bool) -> LeafCodec:
  """``error_feedback(codec)`` when ``enabled``, else ``codec`` unchanged."""
  return error_feedback(codec) if enabled else codec
