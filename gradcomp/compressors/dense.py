"""Uncompressed baselines: the fp32 mean and the half-precision cast.

``none`` is paper 000's *Baseline (FP32)*; ``fp16`` is its *FP16* row of §5
(semi-precision communication), with bfloat16 as an option.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import numerics


@recorded
def none(axis_name: exchange.AxisName = None) -> optax.GradientTransformation:
  """Dense float32 mean over workers: the baseline every compressor is measured against.

  .. math:: \\bar g = \\frac{1}{n} \\sum_w g_w  \\quad\\text{(all-reduce, 4 bytes/coordinate)}

  Bad input: NaN and Inf reach the output of that step (nothing is stored, so
  the next step is clean); each worker sends ``g / n``, so finite gradients
  always give a finite mean.

  Args:
    axis_name: the mapped axis of the workers, or ``None`` for one device.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp, gradcomp
    >>> tx = gradcomp.none()
    >>> g = {"w": jnp.ones(3)}
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [1.0, 1.0, 1.0]
  """

  def apply(x, state, key, step):
    del key, step
    return exchange.all_reduce_mean(x, axis_name), jnp.zeros_like(x), state

  return leafwise(LeafCodec(stateless_init, apply))


@recorded
def fp16(
  axis_name: exchange.AxisName = None, dtype=jnp.float16
) -> optax.GradientTransformation:
  """Half-precision all-reduce: each worker sends ``g / n`` cast to ``dtype``.

  Dividing before the cast keeps the 16-bit sum of ``n`` workers in range.

  Bad input: NaN and Inf reach the output of that step (nothing is stored).
  Each finite payload ``g / n`` saturates at ``dtype``'s maximum divided by
  ``n`` (float16: 65504 / 8 = 8188 on 8 workers), so the 16-bit sum of the
  ``n`` payloads stays finite: larger coordinates are clipped, not sent as
  Inf.

  Args:
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    dtype: ``jnp.float16`` (paper 000's FP16) or ``jnp.bfloat16``.

  Returns:
    An ``optax.GradientTransformation``; the output is the float mean, rounded
    as the 16-bit sum was.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> g = {"w": jnp.array([1 / 3, 1e5, -2.0])}
    >>> tx = gradcomp.fp16()  # one worker: 1e5 saturates at float16's 65504
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [0.333251953125, 65504.0, -2.0]
    >>> tx = gradcomp.fp16(dtype=jnp.bfloat16)  # float32's range, 8 bits of mantissa
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [0.333984375, 99840.0, -2.0]

  References:
    Paper 000 §5 (FP16 with LayerFusion, Figs. 3-5).
  """
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")

  def apply(x, state, key, step):
    del key, step
    n = exchange.num_workers(axis_name)
    payload = numerics.saturate(x / n, dtype, numerics.safe_bound(dtype, n))
    mean = exchange.all_reduce_sum(payload, axis_name).astype(jnp.float32)
    remainder = x - payload.astype(jnp.float32) * n
    return mean, remainder, state

  return leafwise(LeafCodec(stateless_init, apply))
