"""Unbiased stochastic quantizers: QSGD and TernGrad.

Both round each coordinate up or down at random so that ``E[decode(encode(x))]
= x`` (paper 004 §4, stochastic rounding). Rounding is independent between
workers (each folds its worker index into the step key) and uses counter-based
hash uniforms (``hashing.py``) rather than threefry, which dominates their cost
on CPU (PERFORMANCE_NOTES).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import checks, memory, scatter
from gradcomp.compressors import exchange as exchanges
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
  axis_name: exchanges.AxisName = None,
  error_feedback: bool = False,
  exchange: str = "gather",
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

  ``exchange="scatter"`` (``scatter.two_stage``; the two-stage
  exchange of 1-bit Adam, Tang et al. 2021 §4, Alg. 1, and ZeRO++'s qgZ,
  Wang et al. 2023 §3): the flattened leaf is split into ``n`` chunks of
  ``ceil(d / n)`` values, each quantized as above in buckets of
  ``min(bucket_size, chunk)`` values that never cross a chunk (scales per
  chunk), and sent to its owner (all-to-all). The owner averages the
  decoded chunks and **re-quantizes the mean with fresh randomness** (its
  own stream, independent of every worker's first rounding), and the
  owners' codes are all-gathered. Both roundings are unbiased and
  independent, so the output stays unbiased: ``E[Q_o(mean_w Q_w(x_w))] =
  mean_w x_w``; its variance is the workers' rounding variance divided by
  ``n`` plus the owner's. With ``error_feedback=True`` the worker keeps
  what its rounding lost (worker error) and the owner what its re-rounding
  lost (server error, kept at the leaf's size, flattened, only its chunk in
  use), as 1-bit Adam does.

  Args:
    levels: number of positive levels ``s``, in [1, 127].
    bucket_size: coordinates sharing one norm, >= 1.
    seed: seeds the rounding stream.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: add a memory of the rounding error (off in the paper).
      The memory stays bounded only if the quantizer is a contraction, i.e. its
      variance factor ``min(b / s^2, sqrt(b) / s) < 1`` for bucket size ``b``
      (Karimireddy et al. 2019); with ``levels=4, bucket_size=512`` it is not.
    exchange: ``"gather"`` (all-gather codes and norms) or ``"scatter"``
      (the two-stage exchange above; not with an ``exchange.Pattern`` axis).

  Returns:
    An ``optax.GradientTransformation``; unbiased when ``error_feedback=False``
    (in both forms).

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
    Table 1); Tang et al., *1-bit Adam*, ICML 2021, §4 and Alg. 1; Wang et
    al., *ZeRO++*, 2023, §3 (qgZ) for the scatter form.
  """
  levels = checks.at_least("levels", levels, 1, 127)
  bucket_size = checks.at_least("bucket_size", bucket_size, 1)
  if scatter.check_form(exchange, axis_name) == "scatter":
    codec = scatter.scatter_codec(
      qsgd_chunks(levels, bucket_size), axis_name, server_error=error_feedback
    )
    return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)

  def apply(x, state, key, step):
    del step
    payload = bucket_codes(x, key, levels, bucket_size, axis_name)

    def decode(*payload):
      return jnp.concatenate(
        [(c.astype(jnp.float32) * s).reshape(-1) for c, s in payload]
      ).reshape(x.shape)

    mean = exchanges.gathered_mean(payload, decode, axis_name)
    return mean, x - decode(*payload), state

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)


def bucket_codes(x, key, levels: int, bucket_size: int, axis_name) -> list:
  """QSGD's ``(int8 codes, scales)`` of each part of the leaf ``x``'s buckets.

  Full buckets as one ``(buckets, bucket)`` view and the ragged tail apart
  (padding the whole leaf to a multiple of the bucket would copy it); part
  ``i`` draws from ``derive(worker_key(key), i)``.
  """
  flat = x.reshape(-1)
  size = flat.shape[0]
  bucket = min(bucket_size, size)
  body = size - size % bucket
  parts = [flat[:body].reshape(-1, bucket)]
  if body < size:
    parts.append(flat[body:].reshape(1, -1))
  key = exchanges.worker_key(key, axis_name)
  return [
    _quantize_buckets(p, hashing.derive(key, i), levels) for i, p in enumerate(parts)
  ]


def _quantize_buckets(buckets, key, levels: int):
  """int8 codes and float32 scales (``norm / s``) of each bucket (last axis)."""
  # norm = p * root without overflow, and s / norm = (1 / p) (s / root). That
  # factor is below float32's normal range only when the norm is above
  # s * 2**126; it is then held there (codes saturate) instead of flushing
  # to 0. One factor per bucket keeps the pass over |x| a single multiply.
  p, root = numerics.scaled_norm(buckets, axis=-1, keepdims=True)
  factor = (1.0 / p) * (levels / jnp.where(root > 0, root, 1.0))
  scaled = jnp.abs(buckets) * jnp.maximum(factor, _TINY)
  u = hash_uniform(key, buckets.shape)
  # At most s: |x_i| = ||x_B|| may round to just above s.
  xi = jnp.minimum(jnp.floor(scaled + u), levels)
  codes = (jnp.sign(buckets) * xi).astype(jnp.int8)
  norms = jnp.minimum(p * root, numerics.FLOAT32_MAX)
  return codes, norms / levels


def _row_buckets(c: int, bucket_size: int) -> tuple[int, int, int]:
  """``(bucket, full, tail)``: buckets of a chunk of ``c`` values."""
  bucket = min(bucket_size, c)
  full = c // bucket
  return bucket, full, c - full * bucket


def qsgd_chunks(levels: int, bucket_size: int) -> scatter.ChunkCodec:
  """QSGD's scatter form: int8 codes and a norm per bucket, buckets inside chunks."""

  def encode(rows, counts, key):
    del counts
    m, c = rows.shape
    bucket, full, tail = _row_buckets(c, bucket_size)
    parts = [rows[:, : full * bucket].reshape(m, full, bucket)]
    if tail:
      parts.append(rows[:, full * bucket :].reshape(m, 1, tail))
    coded = [
      _quantize_buckets(p, hashing.derive(key, i), levels) for i, p in enumerate(parts)
    ]
    codes = jnp.concatenate([q.reshape(m, -1) for q, _ in coded], axis=1)
    scales = jnp.concatenate([s.reshape(m, -1) for _, s in coded], axis=1)
    return codes, scales

  def decode(payload, c):
    codes, scales = payload
    m = codes.shape[0]
    bucket, full, tail = _row_buckets(c, bucket_size)
    values = codes.astype(jnp.float32)
    body = values[:, : full * bucket].reshape(m, full, bucket) * scales[:, :full, None]
    pieces = [body.reshape(m, -1)]
    if tail:
      pieces.append(values[:, full * bucket :] * scales[:, full:])
    return jnp.concatenate(pieces, axis=1)

  def row_bytes(c):
    _, full, tail = _row_buckets(c, bucket_size)
    return c + 4 * (full + (tail > 0))

  return scatter.ChunkCodec(encode, decode, None, row_bytes)


@recorded
def terngrad(
  *, seed: int = 0, axis_name: exchanges.AxisName = None, exchange: str = "gather"
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

  ``exchange="scatter"`` (``scatter.two_stage``; the two-stage
  exchange of 1-bit Adam, Tang et al. 2021 §4, Alg. 1, and ZeRO++'s qgZ,
  Wang et al. 2023 §3): the flattened leaf is split into ``n`` chunks of
  ``ceil(d / n)`` values, each sent to its owner as 2-bit codes and its own
  scale ``max |chunk|`` (scales per chunk; all-to-all); the owner averages
  the decoded chunks and **re-ternarizes the mean with fresh randomness**
  (its own stream, independent of every worker's rounding) and a scale
  ``max |mean|``, and the owners' codes are all-gathered. Both roundings
  are unbiased and independent, so the output stays unbiased. Nothing is
  stored.

  Args:
    seed: seeds the rounding stream.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    exchange: ``"gather"`` (all-gather codes and scales) or ``"scatter"``
      (the two-stage exchange above; not with an ``exchange.Pattern`` axis).

  Returns:
    An ``optax.GradientTransformation``; the output is unbiased (in both
    forms).

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
    Wen et al., *TernGrad*, NeurIPS 2017 (paper 000 Table 1); Tang et al.,
    *1-bit Adam*, ICML 2021, §4 and Alg. 1, and Wang et al., *ZeRO++*,
    2023, §3 (qgZ) for the scatter form.
  """
  if scatter.check_form(exchange, axis_name) == "scatter":
    codec = scatter.scatter_codec(TERNARY_CHUNKS, axis_name, server_error=False)
    return leafwise(codec, seed=seed)

  def apply(x, state, key, step):
    del step
    size = x.size
    scale = numerics.max_abs(x)
    u = hash_uniform(exchanges.worker_key(key, axis_name), x.shape)
    keep = u * scale < jnp.abs(x)
    ternary = jnp.where(keep, jnp.sign(x), 0.0)
    packed = bits.pack_ternary(ternary)

    def decode(p, s):
      return bits.unpack_ternary(p, size) * s

    mean = exchanges.gathered_mean((packed, scale), decode, axis_name)
    return mean.reshape(x.shape), x - ternary * scale, state

  return leafwise(LeafCodec(stateless_init, apply), seed=seed)


_TERNARY_SHIFTS = np.array([0, 2, 4, 6], np.uint8)  # as kernels.bits.pack_ternary


def _ternary_encode(rows, counts, key):
  """2-bit codes of each row (``bits.pack_ternary``'s layout, per row) and ``max |row|``."""
  del counts
  m, c = rows.shape
  scale = numerics.max_abs(rows, axis=-1)
  u = hash_uniform(key, rows.shape)
  keep = u * scale[:, None] < jnp.abs(rows)
  codes = (jnp.where(keep, jnp.sign(rows), 0.0) + 1).astype(jnp.uint8)
  codes = jnp.pad(codes, ((0, 0), (0, -c % 4)), constant_values=1)
  packed = jnp.sum(codes.reshape(m, -1, 4) << _TERNARY_SHIFTS, axis=-1, dtype=jnp.uint8)
  return packed, scale


def _ternary_decode(payload, c):
  packed, scale = payload
  codes = (packed[..., None] >> _TERNARY_SHIFTS) & 3
  values = codes.reshape(packed.shape[0], -1)[:, :c].astype(jnp.float32) - 1.0
  return values * scale[:, None]


#: TernGrad's scatter form: 2-bit codes and ``max |chunk|`` per chunk.
TERNARY_CHUNKS = scatter.ChunkCodec(
  encode=_ternary_encode,
  decode=_ternary_decode,
  reduce=None,
  row_bytes=lambda c: -(-c // 4) + 4,
)
