r"""Block integer quantization on the wire: ZeRO++'s int8 / int4 codes (issue 32).

Each block of ``block_size`` consecutive values gets one float32 scale,
``max |block| / q`` with ``q = 2^(bits - 1) - 1``, and its values are rounded
to the nearest integer code (``kernels/blockq.py``): the symmetric block
quantization of ZeRO++ (Wang et al. 2023, §3: qwZ for weights, qgZ for
gradients). Gathered, every worker's codes and scales are all-gathered and
averaged; with ``exchange="scatter"`` they take the two-stage exchange of
``scatter.py``, qgZ's reduce-scatter of quantized chunks, requantized by
their owner, with error feedback at both stages (LoCo, Xie et al. 2024).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, memory, scatter
from gradcomp.compressors import exchange as exchanges
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import blockq

#: Bits a stored residual may have: float32, or LoCo's 8-bit codes.
RESIDUAL_BITS = (8, 32)


def _layout(size: int, block_size: int) -> tuple[int, int, int]:
  """``(block, full, tail)`` of ``size`` values: full blocks, then a shorter one."""
  block = min(block_size, size)
  full = size // block
  return block, full, size - full * block


def encode_rows(rows: jax.Array, bits: int, block_size: int):
  """``(codes, scales, decoded)`` of each row of ``rows`` (m, c), blocks inside rows.

  Blocks of ``min(block_size, c)`` values, the last one of each row shorter
  rather than padded (so the wire holds no padding codes): the full blocks'
  codes, then the tail's, concatenated per row.
  """
  m, c = rows.shape
  block, full, tail = _layout(c, block_size)
  out = [blockq.quantize_dequantize(rows[:, : full * block], bits, block)]
  if tail:
    out.append(blockq.quantize_dequantize(rows[:, full * block :], bits, tail))
  codes = jnp.concatenate([q for q, _, _ in out], axis=1)
  scales = jnp.concatenate([s for _, s, _ in out], axis=1)
  decoded = jnp.concatenate([v for _, _, v in out], axis=1)
  return codes, scales, decoded


def decode_rows(codes: jax.Array, scales: jax.Array, bits: int, block_size: int, c):
  """``(m, c)`` values of :func:`encode_rows`' codes and scales."""
  block, full, tail = _layout(c, block_size)
  split = blockq.code_bytes(full * block, bits, block)
  out = [
    blockq.dequantize(codes[:, :split], scales[:, :full], bits, block, full * block)
  ]
  if tail:
    out.append(blockq.dequantize(codes[:, split:], scales[:, full:], bits, tail, tail))
  return jnp.concatenate(out, axis=1)


def row_bytes(c: int, bits: int, block_size: int) -> int:
  """Payload bytes of :func:`encode_rows` for one row of ``c`` values."""
  block, full, tail = _layout(c, block_size)
  codes = blockq.code_bytes(full * block, bits, block)
  if tail:
    codes += blockq.code_bytes(tail, bits, tail)
  return codes + 4 * (full + (tail > 0))


def int_chunks(bits: int, block_size: int) -> scatter.ChunkCodec:
  """:func:`int_quantize`'s scatter form: codes and a scale per block, inside chunks."""

  def encode(rows, counts, key):
    del counts, key
    codes, scales, _ = encode_rows(rows, bits, block_size)
    return codes, scales

  def decode(payload, c):
    return decode_rows(*payload, bits, block_size, c)

  return scatter.ChunkCodec(
    encode, decode, None, lambda c: row_bytes(c, bits, block_size)
  )


# -- LoCo's 8-bit residuals ------------------------------------------------------

#: Values per float32 scale of a residual stored in 8 bits. Fixed (not the
#: codec's ``block_size``), so a stored residual's layout follows from its
#: length alone, and an elastic resume can decode and re-encode it.
RESIDUAL_BLOCK = 128


def load_int8(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """float32 values of residuals stored in 8 bits, shape ``codes.shape`` (..., d).

  ``codes``: int8 ``(..., d)``; ``scales``: float32 ``(..., ceil(d /
  RESIDUAL_BLOCK))`` (``kernels.blockq`` with 8 bits and blocks of
  :data:`RESIDUAL_BLOCK`).
  """
  d = codes.shape[-1]
  pad = scales.shape[-1] * RESIDUAL_BLOCK - d
  codes = jnp.pad(jnp.asarray(codes), [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
  return blockq.dequantize(codes, jnp.asarray(scales), 8, RESIDUAL_BLOCK, d)


def store_int8(values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(codes, scales)`` of float32 ``values`` (..., d): :func:`load_int8`'s inverse, to nearest."""
  d = values.shape[-1]
  codes, scales = blockq.quantize(jnp.asarray(values, jnp.float32), 8, RESIDUAL_BLOCK)
  return codes[..., :d], scales


class Int8Residual(NamedTuple):
  """A worker's error-feedback residual stored in 8 bits (LoCo), per worker."""

  codes: jax.Array  # shape=(d,), int8: the flattened residual's codes.
  scales: jax.Array  # shape=(ceil(d / RESIDUAL_BLOCK),), float32: one per block.


class Int8ServerError(NamedTuple):
  """An owner's server error stored in 8 bits (LoCo), full size, per worker.

  As ``scatter.ServerErrorState``: only the owned chunk's entries in use.
  """

  codes: jax.Array  # shape=(d,), int8: the flattened server error's codes.
  scales: jax.Array  # shape=(ceil(d / RESIDUAL_BLOCK),), float32: one per block.


def _zeros8(cls, size: int):
  blocks = blockq.num_blocks(size, RESIDUAL_BLOCK)
  return cls(jnp.zeros((size,), jnp.int8), jnp.zeros((blocks,), jnp.float32))


class Int8ErrorFeedbackState(NamedTuple):
  """Per-leaf state of :func:`int_quantize` with ``residual_bits=8`` (per worker)."""

  residual: Int8Residual  # the worker error, in 8 bits.
  server: Int8ServerError | tuple  # the server error (scatter form), or ().


def _loco_codec(
  inner: scatter.ChunkCodec | None, gather_codec: LeafCodec | None, axis_name
) -> LeafCodec:
  """Error feedback whose residuals (worker, and server in the scatter form) are int8.

  As ``memory.error_feedback`` (same non-finite policy), the residual read
  from and written back to 8-bit storage: :math:`r_t = Q_8(e_t - D(p_t))`.
  """

  def init(leaf, key):
    del key
    size = 1
    for s in leaf.shape:
      size *= s
    server = _zeros8(Int8ServerError, size) if inner is not None else ()
    return Int8ErrorFeedbackState(_zeros8(Int8Residual, size), server)

  def apply(g, state, key, step):
    stored = load_int8(*state.residual).reshape(g.shape)
    e = memory.corrected(stored, g)
    if inner is None:
      mean, remainder, _ = gather_codec.apply(e, (), key, step)
      residual = Int8Residual(*store_int8(remainder.reshape(-1)))
      return mean, remainder, Int8ErrorFeedbackState(residual, ())
    flat = e.reshape(-1)
    mean, sent, server = scatter.two_stage(
      flat, load_int8(*state.server), inner, axis_name, key
    )
    remainder = flat - sent
    new_state = Int8ErrorFeedbackState(
      Int8Residual(*store_int8(remainder)), Int8ServerError(*store_int8(server))
    )
    return mean.reshape(g.shape), remainder.reshape(g.shape), new_state

  return LeafCodec(init, apply)


@recorded
def int_quantize(
  bits: int = 8,
  block_size: int = 512,
  *,
  exchange: str = "gather",
  error_feedback: bool = True,
  residual_bits: int = 32,
  axis_name: exchanges.AxisName = None,
) -> optax.GradientTransformation:
  r"""Symmetric block int8 / int4 quantization (ZeRO++), gathered or reduce-scattered.

  Each block ``B`` of ``block_size`` consecutive values of the flattened
  leaf (the last one shorter) sends ``bits``-bit codes and one float32
  scale:

  .. math::
    s_B = \max_{i \in B} |x_i| / q,\quad q = 2^{b-1} - 1,\qquad
    c_i = \operatorname{round}(x_i / s_B),\qquad \hat x_i = c_i s_B

  (``kernels.blockq``): codes in ``[-q, q]`` (127 for int8, 7 for int4, two
  codes to a byte), rounded to nearest, so ``|x_i - \hat x_i| <= s_B / 2``
  up to float32 rounding. With ``error_feedback`` (the default; rounding
  to nearest is biased) each worker keeps ``e - \hat e`` and adds it to the
  next gradient (``memory.py``).

  ``exchange="gather"``: every worker's codes and scales are all-gathered
  and the decoded payloads averaged (``ceil(d b / 8) + 4 ceil(d /
  block_size)`` bytes per worker, crossing ``n - 1`` links).

  ``exchange="scatter"``: ZeRO++'s qgZ (Wang et al. 2023, §3: a
  quantized reduce-scatter, requantized between its hops) in the two-stage
  form of 1-bit Adam (Tang et al. 2021, §4, Alg. 1; ``scatter.two_stage``).
  The flattened leaf is split into ``n`` chunks of ``ceil(d / n)`` values,
  quantized in blocks of ``min(block_size, chunk)`` that never cross a chunk
  (scales per chunk), and chunk ``j`` goes to worker ``j`` (all-to-all); the
  owner averages the decoded chunks, adds its server error, requantizes the
  sum in the same blocks, and the owners' codes are all-gathered. With
  ``error_feedback`` both hops keep their error, as LoCo does (Xie et al.
  2024, error feedback at each hop of qgZ): the worker error ``r`` and the
  server error ``s`` (kept at the leaf's size, flattened, only the owned
  chunk's entries in use, so the state's shape does not depend on ``n``):

  .. math::
    z_j = \tfrac1n \textstyle\sum_w \hat e_{w,j} + s_j,\qquad
    s_j \leftarrow z_j - Q(z_j),\qquad \text{output}_j = Q(z_j)

  ``residual_bits=8`` stores both residuals in 8 bits, as LoCo does, about
  a quarter of the memory of float32 residuals: int8 codes with a float32
  scale per block of :data:`RESIDUAL_BLOCK` values of the flattened leaf
  (:class:`Int8Residual`, :class:`Int8ServerError`),
  rounded to nearest, read back before each step (``r_t = Q_8(e_t -
  \hat e_t)``). What that storage rounds away (at most half a step of the
  residual's block, per value and step) is lost, not fed back; LoCo's
  moving average of errors and periodic reset are not implemented.

  Bad input: outputs are always finite. Scales come from each block's
  finite values (``kernels.blockq``): +-Inf saturate at the block's largest
  finite magnitude, NaN is sent as 0; with ``error_feedback`` the memory
  drops a NaN or Inf gradient coordinate (``memory.py``) and keeps its
  residuals finite; without it nothing is stored. Each decoded payload is
  divided by ``n`` before the workers' are added; an owner whose sum with
  its server error overflows float32 sends the average there and keeps its
  error (``scatter.two_stage``).

  Args:
    bits: 8 (int8 codes) or 4 (two codes to a byte).
    block_size: values per scale, >= 1.
    exchange: ``"gather"`` or ``"scatter"`` (qgZ's reduce-scatter form; not
      with an ``exchange.Pattern`` axis).
    error_feedback: keep what quantization lost and send it later (worker
      error; in the scatter form also the owner's server error).
    residual_bits: 32 (float32 residuals) or 8 (LoCo's 8-bit residuals);
      8 needs ``error_feedback``.
    axis_name: the mapped axis of the workers, or ``None`` for one device.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.int_quantize(8, block_size=4)  # scale 1.27 / 127 = 0.01
    >>> g = {"w": jnp.array([1.27, -0.5, 0.004, 0.0])}
    >>> out, state = tx.update(g, tx.init(g))
    >>> [round(v, 4) for v in out["w"].tolist()]  # 0.004 / 0.01 rounds to 0
    [1.27, -0.5, 0.0, 0.0]
    >>> [round(v, 4) for v in state.leaves["w"].residual.tolist()]
    [0.0, 0.0, 0.004, 0.0]
    >>> gradcomp.int_quantize(bits=2)
    Traceback (most recent call last):
      ...
    ValueError: bits must be one of (4, 8), got 2

  References:
    Wang et al., *ZeRO++: Extremely Efficient Collective Communication for
    Giant Model Training*, 2023, §3 (block quantization, qgZ); Tang et al.,
    *1-bit Adam*, ICML 2021, §4 and Alg. 1 (the two-stage exchange with
    worker and server error); Xie et al., *LoCo: Low-Bit Communication
    Adaptor for Large-scale Model Training*, 2024 (error feedback at each
    hop, 8-bit residuals).
  """
  if not isinstance(bits, int) or isinstance(bits, bool) or bits not in blockq.BITS:
    raise ValueError(f"bits must be one of {blockq.BITS}, got {bits!r}")
  block_size = checks.at_least("block_size", block_size, 1)
  form = scatter.check_form(exchange, axis_name)
  if not isinstance(error_feedback, bool):
    raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
  if residual_bits not in RESIDUAL_BITS or isinstance(residual_bits, bool):
    raise ValueError(
      f"residual_bits must be one of {RESIDUAL_BITS}, got {residual_bits!r}"
    )
  if residual_bits == 8 and not error_feedback:
    raise ValueError(
      "residual_bits=8 stores error feedback: it needs error_feedback=True"
    )

  if form == "scatter":
    chunks = int_chunks(bits, block_size)
    if residual_bits == 8:
      return leafwise(_loco_codec(chunks, None, axis_name))
    codec = scatter.scatter_codec(chunks, axis_name, server_error=error_feedback)
    return leafwise(memory.maybe_error_feedback(codec, error_feedback))

  def apply(x, state, key, step):
    del key, step
    size = x.size
    codes, scales, decoded = encode_rows(x.reshape(1, -1), bits, block_size)

    def decode(codes, scales):
      return decode_rows(codes[None], scales[None], bits, block_size, size).reshape(
        x.shape
      )

    mean = exchanges.gathered_mean((codes[0], scales[0]), decode, axis_name)
    return mean, x - decoded.reshape(x.shape), state

  codec = LeafCodec(stateless_init, apply)
  if residual_bits == 8:
    return leafwise(_loco_codec(None, codec, axis_name))
  return leafwise(memory.maybe_error_feedback(codec, error_feedback))
