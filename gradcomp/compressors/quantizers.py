"""Unbiased stochastic quantizers: QSGD and TernGrad.

Both round each coordinate up or down at random so that ``E[decode(encode(x))]
= x`` (paper 004 §4, stochastic rounding). Rounding is independent between
workers (each folds its worker index into the step key) and uses counter-based
hash uniforms (``hashing.py``) rather than threefry, which dominates their cost
on CPU (PERFORMANCE_NOTES).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange, memory
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import bits, hashing, numerics
from gradcomp.kernels.hashing import hash_uniform

_TINY = float(jnp.finfo(jnp.float32).tiny)


@recorded
def qsgd(
  levels: int = 4,
  *,
  bucket_size: int = 512,
  seed: int = 0,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  """QSGD: ``s`` levels of ``|x_i| / ||x_B||_2`` per bucket, stochastic rounding.

  .. math::
    Q(x_i) = \\|x_B\\|_2 \\operatorname{sign}(x_i) \\, \\xi_i / s,\\quad
    \\xi_i = \\lfloor s|x_i|/\\|x_B\\|_2 + u_i \\rfloor,\\ u_i \\sim U[0,1)

  where ``B`` is the bucket of ``bucket_size`` consecutive coordinates holding
  ``i`` (QSGD §5 uses buckets of 512: one norm per leaf makes most codes zero
  and the variance grows with ``sqrt(d)``). The wire format is one signed int8
  code ``sign * xi`` per coordinate (``levels <= 127``) plus one float32 norm
  per bucket; payloads are all-gathered.

  Bad input: without error feedback nothing is stored, and a NaN or Inf
  gradient gives a NaN output for that step (its bucket's norm is not
  finite); with ``error_feedback=True`` the memory drops it (``memory.py``).
  Bucket norms are computed overflow-free (``numerics.scaled_norm``), so
  finite gradients up to the float32 maximum quantize to finite codes; a
  bucket whose norm itself exceeds the float32 maximum (values near it in
  several coordinates) sends that maximum as its norm: those coordinates
  saturate (decode smaller than they are, biased). Each decoded payload is
  divided by ``n`` before the workers' payloads are added.

  Args:
    levels: number of positive levels ``s``, in [1, 127].
    bucket_size: coordinates sharing one norm, >= 1.
    seed: seeds the rounding stream.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: add a memory of the rounding error (off in the paper).
      The memory stays bounded only if the quantizer is a contraction, i.e. its
      variance factor ``min(b / s^2, sqrt(b) / s) < 1`` for bucket size ``b``
      (Karimireddy et al. 2019); with ``levels=4, bucket_size=512`` it is not.

  Returns:
    An ``optax.GradientTransformation``; unbiased when ``error_feedback=False``.

  Examples:
    Every output is a multiple of ``||g|| / s``, and their average over steps
    (fresh rounding each step) is ``g``:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.qsgd(levels=2)
    >>> g = {"w": jnp.array([0.3, -0.4, 0.5, 0.0])}  # one bucket, ||g|| = 0.707
    >>> def step(state, _):
    ...   out, state = tx.update(g, state)
    ...   return state, out["w"]
    >>> _, outs = jax.lax.scan(step, tx.init(g), length=4000)
    >>> jnp.unique(jnp.round(outs / (jnp.linalg.norm(g["w"]) / 2), 3)).tolist()
    [-2.0, -1.0, 0.0, 1.0, 2.0]
    >>> [round(v, 2) for v in outs.mean(axis=0).tolist()]
    [0.3, -0.4, 0.5, 0.0]

  References:
    Alistarh et al., *QSGD*, NeurIPS 2017, §3 and §5 (paper 000 ref. [3],
    Table 1).
  """
  levels = checks.at_least("levels", levels, 1, 127)
  bucket_size = checks.at_least("bucket_size", bucket_size, 1)

  def apply(x, state, key, step):
    del step
    flat = x.reshape(-1)
    size = flat.shape[0]
    bucket = min(bucket_size, size)
    body = size - size % bucket
    # Full buckets as a (buckets, bucket) view and the ragged tail apart:
    # padding the whole leaf to a multiple of the bucket would copy it.
    parts = [flat[:body].reshape(-1, bucket)]
    if body < size:
      parts.append(flat[body:].reshape(1, -1))
    key = exchange.worker_key(key, axis_name)
    payload = [quantize(p, hashing.derive(key, i)) for i, p in enumerate(parts)]

    def decode(*payload):
      return jnp.concatenate(
        [(c.astype(jnp.float32) * s).reshape(-1) for c, s in payload]
      ).reshape(x.shape)

    mean = exchange.gathered_mean(payload, decode, axis_name)
    return mean, x - decode(*payload), state

  def quantize(buckets, key):
    """int8 codes and float32 scales of each row of ``buckets``."""
    # norm = p * root without overflow, and s / norm = (1 / p) (s / root). That
    # factor is below float32's normal range only when the norm is above
    # s * 2**126; it is then held there (codes saturate) instead of flushing
    # to 0. One factor per bucket keeps the pass over |x| a single multiply.
    p, root = numerics.scaled_norm(buckets, axis=1, keepdims=True)
    factor = (1.0 / p) * (levels / jnp.where(root > 0, root, 1.0))
    scaled = jnp.abs(buckets) * jnp.maximum(factor, _TINY)
    u = hash_uniform(key, buckets.shape)
    # At most s: |x_i| = ||x_B|| may round to just above s.
    xi = jnp.minimum(jnp.floor(scaled + u), levels)
    codes = (jnp.sign(buckets) * xi).astype(jnp.int8)
    norms = jnp.minimum(p * root, numerics.FLOAT32_MAX)
    return codes, norms / levels

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)


@recorded
def terngrad(
  *, seed: int = 0, axis_name: exchange.AxisName = None
) -> optax.GradientTransformation:
  """TernGrad: ``s * sign(x_i) * b_i`` with ``b_i ~ Bernoulli(|x_i| / s)``, ``s = max|x|``.

  The wire format is 2 bits per coordinate (packed ternary codes) plus one
  float32 scale per leaf; payloads are all-gathered. Gradient clipping and
  scaler sharing from the TernGrad paper are left to the surrounding optimizer.

  Bad input: nothing is stored; a NaN or Inf gradient gives a non-finite
  output for that step (its scale ``max |x|`` is not finite). Finite
  gradients up to the float32 maximum give a finite mean: the scale is a
  maximum, not a sum, and each decoded payload is divided by ``n`` before the
  workers' payloads are added.

  Args:
    seed: seeds the rounding stream.
    axis_name: the mapped axis of the workers, or ``None`` for one device.

  Returns:
    An ``optax.GradientTransformation``; the output is unbiased.

  Examples:
    Every output is ``-s``, 0 or ``s`` with ``s = max |g| = 2``, and their
    average over steps is ``g``:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.terngrad()
    >>> g = {"w": jnp.array([0.4, -1.2, 2.0, 0.0])}
    >>> def step(state, _):
    ...   out, state = tx.update(g, state)
    ...   return state, out["w"]
    >>> _, outs = jax.lax.scan(step, tx.init(g), length=4000)
    >>> jnp.unique(outs).tolist()
    [-2.0, 0.0, 2.0]
    >>> [round(v, 1) for v in outs.mean(axis=0).tolist()]
    [0.4, -1.2, 2.0, 0.0]

  References:
    Wen et al., *TernGrad*, NeurIPS 2017 (paper 000 Table 1).
  """

  def apply(x, state, key, step):
    del step
    size = x.size
    scale = numerics.max_abs(x)
    u = hash_uniform(exchange.worker_key(key, axis_name), x.shape)
    keep = u * scale < jnp.abs(x)
    ternary = jnp.where(keep, jnp.sign(x), 0.0)
    packed = bits.pack_ternary(ternary)

    def decode(p, s):
      return bits.unpack_ternary(p, size) * s

    mean = exchange.gathered_mean((packed, scale), decode, axis_name)
    return mean.reshape(x.shape), x - ternary * scale, state

  return leafwise(LeafCodec(stateless_init, apply), seed=seed)
