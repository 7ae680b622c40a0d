"""MXNet's 2-bit threshold quantization with a residual (used by CD-SGD).

Paper 001 §3 (CD-SGD compresses with it); MXNet ``gradient_compression`` type
``2bit``: ``+t`` where ``e >= t``, ``-t`` where ``e <= -t``, else 0, and the
residual keeps ``e`` minus what was sent.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.memory import error_feedback
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import bits, ordering


@recorded
def threshold_quantize(
  threshold: float = 0.5, *, axis_name: exchange.AxisName = None
) -> optax.GradientTransformation:
  """2-bit threshold quantization with error feedback.

  .. math::
    e = r + g,\\quad q = t\\,(1_{e \\ge t} - 1_{e \\le -t}),\\quad r = e - q

  The wire format is 2 bits per coordinate (packed ternary codes); payloads are
  all-gathered and the output is ``t`` times the mean code.

  Bad input: NaN or Inf gradient coordinates are dropped by the error
  feedback (``memory.py``), so state and output stay finite. Outputs are bounded by
  ``t`` whatever the input; a huge finite ``e`` sends ``+-t`` and keeps the
  rest in the residual.

  Args:
    threshold: ``t > 0``.
    axis_name: the mapped axis of the workers, or ``None`` for one device.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.threshold_quantize(0.5)
    >>> update = jax.jit(tx.update)
    >>> g = {"w": jnp.array([0.75, -0.25, -1.5, 0.375])}
    >>> out, state = update(g, tx.init(g))
    >>> out["w"].tolist(), state.leaves["w"].residual.tolist()
    ([0.5, 0.0, -0.5, 0.0], [0.25, -0.25, -1.0, 0.375])
    >>> update(g, state)[0]["w"].tolist()  # e = r + g = [1.0, -0.5, -2.5, 0.75]
    [0.5, -0.5, -0.5, 0.5]

  References:
    Paper 001 §3 (2-bit quantization in CD-SGD); paper 004 §4 (threshold
    quantization with error feedback).
  """
  t = checks.positive("threshold", threshold)

  def apply(x, state, key, step):
    del key, step
    size = x.size
    ternary = (x >= t).astype(jnp.float32) - (x <= -t).astype(jnp.float32)
    packed = bits.pack_ternary(ternary)
    # x = r + g is rebuilt in each pass, never stored. The remainder (over r)
    # waits for a zero read from the payload, the output (over g) for one
    # read from the remainder (kernels/ordering.py): XLA copied both donated
    # buffers without the order (BUILD_NOTES, issue 18).
    # The zero rides on the payload (gathered, so replicated), not on t.
    # The remainder compares x with t again rather than reading the codes:
    # with two consumers XLA wrote them out as a float32 array (a write and
    # a read of 4 bytes per coordinate). Same values: (a - b) t' is t', -t'
    # or +0.0 for the indicators a, b of x >= t and x <= -t.
    sent_t = t + ordering.zero_after(packed)
    remainder = x - jnp.where(x >= t, sent_t, jnp.where(x <= -t, -sent_t, 0.0))
    sent = packed + ordering.zero_after(remainder).astype(jnp.uint8)
    mean = exchange.gathered_mean(
      (sent,), lambda p: bits.unpack_ternary(p, size) * t, axis_name
    ).reshape(x.shape)
    return mean, remainder, state

  return leafwise(error_feedback(LeafCodec(stateless_init, apply)))
