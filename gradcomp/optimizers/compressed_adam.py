r"""Compressed-momentum Adam: 1-bit Adam's frozen-variance phase with any codec.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021: §3 (error compensation fails under Adam's nonlinear
normalisation; the variance becomes stable early, so Adam can be run as a
momentum SGD with a fixed preconditioner, which takes error-compensated
compression) and §4, Alg. 1, with its 1-bit compressor :math:`C` replaced
by any gradcomp compressor.

**Warm-up** (updates ``1 .. freeze_step``): ``optax.adamw`` on the dense
mean gradient (an all-reduce of float32), bias correction and decoupled
weight decay included; it is ``optax.adamw``'s own chain.

**Compressed phase** (updates ``t > freeze_step``, Alg. 1 lines 6-12): the
variance is frozen at its value :math:`v_T` after the warm-up; each worker
:math:`w` updates the momentum with its own gradient and the momenta go
through ``codec``, whose output, the mean over workers of the decoded
payloads, is the same on every worker:

.. math::
  m_w = \beta_1 m_{t-1} + (1 - \beta_1) g_{t,w}, \qquad
  m_t = \operatorname{codec}(m_w), \qquad
  x_t = x_{t-1} - \eta_t \Big(\frac{m_t / (1 - \beta_1^t)}
    {\sqrt{v_T / (1 - \beta_2^T)} + \epsilon} + \lambda x_{t-1}\Big).

The codec's own error feedback (a top-k's residual, PowerSGD's, EF-signSGD's)
plays the worker error :math:`\delta_w` of Alg. 1: what a worker did
not send of :math:`m_w + \delta_w` is added to its next momentum. A codec
with a reduce-scatter form (``exchange="scatter"``) also keeps the server
error of Alg. 1 (each chunk's owner re-compresses the average and keeps
what that lost); an all-gathered or all-reduced payload has no second
compression, so no server error. Its state starts at the freeze: the
warm-up's exchange is dense (or ``warmup_codec``'s) and leaves it as
``codec.init`` made it.

The readings are :func:`gradcomp.onebit_adam`'s (shared code,
:mod:`gradcomp.optimizers.frozen_variance`): bias correction of the
momentum with the running count and of the variance at the freeze step;
coordinates whose frozen variance is exactly zero send zero, keep zero
momentum and take no Adam step (the codec's own error there is not
cleared: a sign codec's scaled sign of a zero may leave one; the output is
masked). ``onebit_adam`` stays the 1-bit Adam of the paper, its exchange
the two-stage scaled-sign all-reduce of one flattened buffer.

Wire bytes: ``freeze_step`` dense all-reduces of ``4 d`` bytes, then each
update the codec's exchange of the momentum tree (read it from the compiled
step with :func:`gradcomp.wire_bytes`; the program prices the two phases
apart).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

from gradcomp.compressors import axes, exchange, warmup
from gradcomp.optimizers import frozen_variance


class CompressedAdamState(NamedTuple):
  """State of :func:`compressed_adam`.

  Attributes:
    adam: ``optax.adamw``'s state (its ``ScaleByAdamState`` holds the
      count, the momentum and the variance, frozen after the warm-up).
    warmup: ``warmup_codec``'s state, ``()`` with the dense warm-up.
    codec: the codec's state (per worker: its error-feedback residuals),
      as ``codec.init`` made it until the freeze.
  """

  adam: Any
  warmup: Any
  codec: Any


def codec_exchange(
  codec: optax.GradientTransformation,
) -> frozen_variance.MomentumExchange:
  """The momenta's exchange through ``codec`` (its state: the ``codec`` field)."""

  def init(zeros):
    return {"codec": codec.init(zeros)}

  def apply(local, live, state):
    del live  # Masked by frozen_variance_adam, before and after.
    mean, codec_state = codec.update(local, state.codec)
    return mean, {"codec": codec_state}

  return frozen_variance.MomentumExchange(init, apply)


def compressed_adam(
  learning_rate: optax.ScalarOrSchedule,
  codec: optax.GradientTransformation,
  *,
  freeze_step: int,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  mask=None,
  axis_name: exchange.AxisName = None,
  warmup_codec: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """Compressed-momentum Adam (module docstring): AdamW, then the momentum through ``codec``.

  Args:
    learning_rate: a float or an optax schedule of the update count.
    codec: a compressor built by a gradcomp factory over the same
      ``axis_name`` (``gradcomp.topk(0.01, axis_name="data")``,
      ``powersgd``, ``int_quantize``, ``ef_signsgd``, ..., or a
      ``layerfusion`` of one); it sees the momentum tree, float32, shaped
      as the params.
    freeze_step: updates of dense AdamW before the variance freezes and the
      momentum goes through ``codec`` (update ``freeze_step + 1`` is the
      first compressed one); ``>= 1``.
    b1, b2, eps: Adam's.
    weight_decay: decoupled weight decay, as ``optax.adamw``'s.
    mask: ``optax.adamw``'s weight-decay mask (a tree of bools, or a
      function of the params).
    axis_name: the workers' mesh axis, or ``None`` on one device.
    warmup_codec: ``None`` (a dense float32 all-reduce through the warm-up)
      or a gradcomp compressor over ``axis_name`` whose mean of the
      gradients the warm-up's AdamW takes, as :func:`gradcomp.onebit_adam`'s.

  Returns:
    An ``optax.GradientTransformation`` whose ``update(grads, state,
    params)`` takes each worker's own gradient and returns the same update
    on every worker; its state is a :class:`CompressedAdamState`. ``params``
    are required.

  Raises:
    ValueError: a hyper-parameter outside its range, or a ``codec`` that is
      not a transformation over ``axis_name``, named.

  Examples:
    Before the freeze it is ``optax.adamw`` (one device: the dense mean is
    the gradient itself); after it, the momentum goes through the codec:

    >>> import jax.numpy as jnp, optax, gradcomp
    >>> p, g = {"w": jnp.array([1.0, -2.0, 0.5])}, {"w": jnp.array([0.5, 0.25, -1.0])}
    >>> tx = gradcomp.compressed_adam(0.1, gradcomp.topk(0.34), freeze_step=1)
    >>> ref = optax.adamw(0.1, weight_decay=0.0)
    >>> u, state = tx.update(g, tx.init(p), p)
    >>> v, _ = ref.update(g, ref.init(p), p)
    >>> bool(jnp.array_equal(u["w"], v["w"]))
    True
    >>> u, state = tx.update(g, state, p)  # top-1 of the momentum: one moves
    >>> [round(float(x), 4) + 0.0 for x in u["w"]]
    [0.0, 0.0, 0.1]
    >>> [round(x, 4) for x in state.codec.leaves["w"].residual.tolist()]  # unsent
    [0.095, 0.0475, 0.0]

  References:
    Tang et al. 2021, "1-bit Adam", ICML, §3 and §4, Alg. 1;
  """
  frozen_variance.check_adam(
    learning_rate, b1, b2, eps, weight_decay, freeze_step=freeze_step
  )
  warmup.check_compressor(codec, axis_name, "codec")
  tx = frozen_variance.frozen_variance_adam(
    learning_rate,
    codec_exchange(codec),
    CompressedAdamState,
    name="compressed_adam",
    freeze_step=freeze_step,
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=weight_decay,
    mask=mask,
    axis_name=axis_name,
    warmup_codec=warmup_codec,
  )
  # Its axes filed so hierarchical() can take it as its inner;
  # params that are shards of a partition across axis_name are refused.
  return axes.checked(tx, axis_name, strict=False)
