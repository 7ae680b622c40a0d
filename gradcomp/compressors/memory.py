"""Error feedback: the memory part shared by every compressor that uses it.

The *memory* of a compressor; paper 004 §4 (1-bit quantization with error feedback,
Seide et al. 2014) and Karimireddy et al. 2019 (EF-signSGD):

.. math::
  e_t = \\beta\\, r_{t-1} + g_t, \\quad p_t = C(e_t), \\quad r_t = e_t - D(p_t)

with ``decay`` :math:`\\beta = 1` (every compressor's default: nothing is
forgotten). SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706, Alg. 1) decays
the memory, :math:`\\beta < 1`, so that it stands for DiLoCo's outer
momentum; then what was sent plus what is kept is the decayed sum of the
gradients, :math:`r_T + \\sum_{t \\le T} \\beta^{T-t} D(p_t) = \\sum_{t \\le T}
\\beta^{T-t} g_t`.

Non-finite policy, per coordinate: where ``r_{t-1} + g_t`` is a NaN or an Inf
(a non-finite gradient coordinate, or two finite values whose sum overflows
float32), that coordinate of the gradient is dropped and ``e_t`` keeps the
memory's value there; every other coordinate goes through. So the memory never
stores a NaN, no mass of the memory is lost, and a gradient that is wholly
non-finite (what a NaN loss gives) is dropped whole. To skip such a step on
every worker instead (the whole update and all state left as they were), wrap
the chain in ``optax.apply_if_finite`` (one device) or
``gradcomp.apply_if_finite`` (data parallel), which look at the raw gradients
before any compressor does; the training program does.

Why per coordinate: it is decided inside the pass that builds ``e``. Dropping
the whole gradient needs a reduction over ``r + g`` before ``e`` may be
written, one more read of both buffers in every step (BUILD_NOTES, issue 18:
a third of random-k's time on the ResNet-50 gradient); keeping the old memory
and emitting a NaN instead keeps the old buffer alive through the whole step,
which costs XLA a copy of every donated buffer (~50 ms of ~150 ms on a
25.6M-value top-k).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradcomp.compressors.base import LeafCodec


class ErrorFeedbackState(NamedTuple):
  residual: jax.Array  # leaf shape, float32: what earlier steps did not send.
  inner: Any  # the wrapped codec's state.


def corrected(residual: jax.Array, g: jax.Array, decay: float = 1.0) -> jax.Array:
  """``e = decay * r + g``, with ``g`` dropped where the sum is not finite (one pass).

  ``decay=1`` multiplies nothing: the program is today's ``r + g``.
  """
  if decay != 1.0:
    residual = decay * residual
  e = residual + g
  return jnp.where(jnp.isfinite(e), e, residual)


def check_decay(decay) -> float:
  """``decay`` checked to be a number in [0, 1].

  Raises:
    ValueError: naming ``decay``, its value and the range.
  """
  if not (
    isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 <= decay <= 1
  ):
    raise ValueError(f"ef_decay must be a number in [0, 1], got {decay!r}")
  return float(decay)


def error_feedback(codec: LeafCodec, decay: float = 1.0) -> LeafCodec:
  """Wraps ``codec`` so that what it leaves behind is sent in later steps.

  Args:
    codec: the per-leaf compression and exchange to wrap; it is applied to
      ``e = decay * r + g`` and its remainder becomes the new ``r``.
    decay: the memory's decay :math:`\\beta` in [0, 1]; 1 keeps all of it
      (the default), 0 forgets it (no error feedback, but a residual kept).

  Returns:
    A ``LeafCodec`` whose state is an ``ErrorFeedbackState`` (the residual
    and ``codec``'s own state).

  Examples:
    A codec that sends ``floor(x)`` on one device: what has been sent plus
    the residual is always the sum of the gradients so far.

    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> def apply(x, state, key, step):
    ...   sent = jnp.floor(x)
    ...   return sent, x - sent, state
    >>> codec = gradcomp.LeafCodec(lambda leaf, key: (), apply)
    >>> tx = gradcomp.leafwise(gradcomp.error_feedback(codec))
    >>> g = {"w": jnp.array([0.25, 0.75, 1.5])}
    >>> out1, state = tx.update(g, tx.init(g))
    >>> out2, state = tx.update(g, state)  # e = r + g = [0.5, 1.5, 2.0]
    >>> out1["w"].tolist(), out2["w"].tolist(), state.leaves["w"].residual.tolist()
    ([0.0, 0.0, 1.0], [0.0, 1.0, 2.0], [0.5, 0.5, 0.0])
    >>> (out1["w"] + out2["w"] + state.leaves["w"].residual).tolist()  # 2 g
    [0.5, 1.5, 3.0]
  """

  def init(leaf, key):
    return ErrorFeedbackState(
      # Like the leaf: sharded as the params are.
      residual=jnp.zeros_like(leaf, jnp.float32),
      inner=codec.init(leaf, key),
    )

  decay = check_decay(decay)

  def apply(g, state, key, step):
    e = corrected(state.residual, g, decay)
    mean, remainder, inner = codec.apply(e, state.inner, key, step)
    return mean, remainder, ErrorFeedbackState(remainder, inner)

  return LeafCodec(init, apply)


def maybe_error_feedback(
  codec: LeafCodec, enabled: bool, decay: float = 1.0
) -> LeafCodec:
  """``error_feedback(codec, decay)`` when ``enabled``, else ``codec`` unchanged."""
  return error_feedback(codec, decay) if enabled else codec
