"""Fixed-point gradients: a static ``<IL, FL>`` format and dynamic fixed point.

Paper 004 §4.1 (low precision): Gupta et al. 2015 send ``<IL, FL>`` fixed-point
numbers rounded stochastically; Courbariaux et al. 2015 give each group of
values its own scaling factor (a shared exponent), moved by one bit whenever
the group's overflow rate says so. Both send ``bits``-bit two's complement codes
(``kernels.bits.pack_codes``: two 4-bit codes to a byte, two 12-bit codes to
three bytes, 8 and 16 bits as int8 / int16), all-gathered.

Stochastic rounding rounds up with probability ``(x - floor_eps(x)) / eps``
(the survey prints it inverted; paper 004 NOTES): with ``s = x / eps`` and a
uniform ``u`` in [0, 1) per value, the code is ``floor(s) + [u < s - floor(s)]``.
``s - floor(s)`` is exact in float32 (for ``-1 < s < 0`` it rounds to 24
bits) and ``u`` carries 24 random bits, so ``E[code] = s`` up to ``2^-24``
wherever ``s`` is not saturated. Uniforms are
counter-based hashes of a per-worker stream (``exchanges.worker_key``), as in
QSGD and TernGrad.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradcomp.compressors import checks, memory, scatter
from gradcomp.compressors import exchange as exchanges
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import bits as bitpack
from gradcomp.kernels import ordering
from gradcomp.kernels.hashing import hash_uniform

# The step eps = 2^e must be a normal float32 (CPUs flush subnormals) and the
# largest magnitude 2^(e + bits - 1) at most 2^127.
_MIN_EXPONENT = -126


def _max_exponent(bits: int) -> int:
  return 128 - bits


def _check_bits(bits) -> int:
  if (
    not isinstance(bits, int) or isinstance(bits, bool) or bits not in bitpack.CODE_BITS
  ):
    raise ValueError(f"bits must be one of {bitpack.CODE_BITS}, got {bits!r}")
  return bits


def _check_int_bits(int_bits, bits: int) -> int:
  """``int_bits`` such that ``eps = 2^(int_bits - bits)`` and the range are normal."""
  return checks.at_least("int_bits", int_bits, bits + _MIN_EXPONENT, 128)


def _pow2(e: jax.Array) -> jax.Array:
  """float32 ``2^e`` for integer ``e`` in [-126, 127], exactly (built from its bits)."""
  biased = (e.astype(jnp.int32) + 127).astype(jnp.uint32) << 23
  return lax.bitcast_convert_type(biased, jnp.float32)


def to_codes(s: jax.Array, bits: int, u: jax.Array | None) -> jax.Array:
  """int32 codes of the scaled values ``s = x / eps``: saturated, then rounded.

  ``s`` is clipped to the ``bits``-bit code range (+-Inf saturate), then
  rounded up with probability ``s - floor(s)`` given uniforms ``u``, or to the
  nearest integer (half to even) when ``u`` is ``None``. NaN becomes code 0.
  """
  low, high = bitpack.code_range(bits)
  c = jnp.clip(s, low, high)
  if u is None:
    r = jnp.round(c)
  else:
    f = jnp.floor(c)
    r = f + (u < c - f).astype(jnp.float32)
  return jnp.where(jnp.isnan(s), 0.0, r).astype(jnp.int32)


@recorded
def fixed_point(
  bits: int = 8,
  *,
  int_bits: int = 1,
  seed: int = 0,
  axis_name: exchanges.AxisName = None,
  error_feedback: bool = False,
  exchange: str = "gather",
) -> optax.GradientTransformation:
  """``<IL, FL>`` fixed point with stochastic rounding and saturation (Gupta et al.).

  A value is a ``bits``-bit two's complement integer times ``eps = 2^-FL``,
  with ``IL = int_bits`` integer bits **including the sign bit** and
  ``FL = bits - IL`` fractional bits (Gupta et al. §3: ``IL + FL`` is the word
  length). Each coordinate is saturated to the format's range, then rounded
  stochastically:

  .. math::
    \\operatorname{Convert}(x) = \\begin{cases}
      -2^{IL-1} & x \\le -2^{IL-1} \\\\
      2^{IL-1} - \\epsilon & x \\ge 2^{IL-1} - \\epsilon \\\\
      \\lfloor x \\rfloor_\\epsilon + \\epsilon\\,\\xi,\\
      \\xi \\sim \\operatorname{Bernoulli}\\big((x - \\lfloor x \\rfloor_\\epsilon)
      / \\epsilon\\big) & \\text{otherwise}
    \\end{cases}

  where ``floor_eps(x)`` is the largest multiple of ``eps`` at most ``x``: the
  output is unbiased inside the range and biased (clipped) outside it. The
  default ``int_bits=1`` gives the range [-1, 1) with ``eps = 2^(1 - bits)``
  (8 bits: steps of 1/128; 16 bits: 2^-15): per-coordinate gradients of a mean
  loss are mostly below 1. ``int_bits`` may be below 1 (``FL > bits``) to
  resolve smaller gradients, or above ``bits`` (``eps > 1``).

  Wire format: one code per coordinate, packed (``kernels.bits.pack_codes``):
  4 bits two to a byte, 8 bits int8, 12 bits two codes in three bytes, 16
  bits int16; nothing else (the format is static). Payloads are all-gathered.

  Bad input: outputs are always finite and within the range, whatever the
  input: +-Inf and huge finite values saturate, NaN is sent as code 0.
  Without error feedback nothing is stored. With ``error_feedback=True`` the
  memory keeps what saturation and rounding left out, and drops a NaN or Inf
  gradient (``memory.py``).

  ``exchange="scatter"`` (``scatter.two_stage``; the two-stage
  exchange of 1-bit Adam, Tang et al. 2021 §4, Alg. 1): the flattened leaf
  is split into ``n`` chunks of ``ceil(d / n)`` values, each sent to its
  owner as its packed codes (the format is static: no scale, per chunk or
  otherwise; all-to-all). The owner averages the decoded chunks and
  **re-encodes the mean in the same format with stochastic rounding** (its
  own stream, independent of the workers'), and the owners' codes are
  all-gathered. A mean of values inside the range is inside it, so the
  re-encode never saturates and the output stays unbiased inside the range
  (``E[out] = mean_w Convert(x_w)``). With ``error_feedback=True`` the
  worker keeps what its rounding and saturation lost, and the owner adds its
  server error (kept at the leaf's size, flattened, only its chunk in use)
  before re-encoding, where the sum *can* saturate; what saturation and
  rounding lose there stays in the server error.

  Args:
    bits: word length ``IL + FL``, one of 4, 8, 12, 16.
    int_bits: ``IL``, in ``[bits - 126, 128]`` (so that ``eps`` and ``2^(IL-1)``
      are normal float32).
    seed: seeds the rounding stream.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: add a memory of the rounding and saturation error (the
      paper has none).
    exchange: ``"gather"`` (all-gather the codes) or ``"scatter"`` (the
      two-stage exchange above; not with an ``exchange.Pattern`` axis).

  Returns:
    An ``optax.GradientTransformation``; unbiased inside the range when
    ``error_feedback=False`` (in both forms).

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.fixed_point import fixed_point
    >>> tx = fixed_point(4, int_bits=2)  # <2, 2>: steps of 1/4 in [-2, 1.75]
    >>> g = {"w": jnp.array([0.5, -1.25, 9.0, -9.0])}
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [0.5, -1.25, 1.75, -2.0]

  References:
    Gupta, Agrawal, Gopalakrishnan, Narayanan, *Deep Learning with Limited
    Numerical Precision*, ICML 2015, §3 (stochastic rounding, saturation);
    paper 004 §4.1 (with the rounding probability corrected, NOTES); Tang et
    al., *1-bit Adam*, ICML 2021, §4 and Alg. 1 (the scatter form).
  """
  bits = _check_bits(bits)
  int_bits = _check_int_bits(int_bits, bits)
  frac_bits = bits - int_bits
  eps = 2.0**-frac_bits
  scale = 2.0**frac_bits
  if scatter.check_form(exchange, axis_name) == "scatter":
    codec = scatter.scatter_codec(
      fixed_point_chunks(bits, frac_bits), axis_name, server_error=error_feedback
    )
    return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)

  def apply(x, state, key, step):
    del step
    size = x.size
    u = hash_uniform(exchanges.worker_key(key, axis_name), x.shape)
    codes = to_codes(x * scale, bits, u)
    packed = bitpack.pack_codes(codes, bits)

    def decode(p):
      c = bitpack.unpack_codes(p, bits, size).astype(jnp.float32)
      return (c * eps).reshape(x.shape)

    mean = exchanges.gathered_mean((packed,), decode, axis_name)
    return mean, x - codes.astype(jnp.float32) * eps, state

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)


class DynamicFixedPointState(NamedTuple):
  """Per-leaf state of :func:`dynamic_fixed_point` (per worker)."""

  # shape=(groups,), int8: E, each group's eps is 2**E.
  exponent: jax.Array
  # shape=(2, groups), float32: overflow rates summed since the last update,
  # at E (row 0) and at E - 1 (row 1).
  overflow: jax.Array


def _block_layout(size: int, block_size: int | None) -> list[tuple[int, int]]:
  """``(groups, length)`` of the full blocks, then of the ragged tail if any."""
  if size == 0:
    return []
  block = size if block_size is None else min(block_size, size)
  full, tail = divmod(size, block)
  return [(full, block)] + ([(1, tail)] if tail else [])


def num_groups(size: int, block_size: int | None) -> int:
  """Groups sharing an exponent in a leaf of ``size`` values (at least 1)."""
  return max(1, sum(g for g, _ in _block_layout(size, block_size)))


@recorded
def dynamic_fixed_point(
  bits: int = 12,
  *,
  block_size: int | None = None,
  max_overflow_rate: float = 1e-4,
  update_every: int = 1,
  int_bits: int | None = None,
  rounding: str = "stochastic",
  seed: int = 0,
  axis_name: exchanges.AxisName = None,
  error_feedback: bool = False,
  exchange: str = "gather",
) -> optax.GradientTransformation:
  """Dynamic fixed point: a shared, adaptive exponent per group (Courbariaux et al.).

  Each group (the whole leaf, or each run of ``block_size`` consecutive values
  of the flattened leaf, the last one shorter) sends ``bits``-bit two's
  complement codes ``c`` and one int8 exponent ``E``; a value is ``c * 2^E``,
  so the group's range is ``[-2^(E + bits - 1), 2^(E + bits - 1) - 2^E]``
  (``<IL, FL>`` of :func:`fixed_point` with ``IL = E + bits``). Values are
  saturated to the range and rounded (``rounding``).

  The exponent is the state's; it moves after the step that used it, by the
  rule of Courbariaux et al. (§3, dynamic fixed point; ``new_range`` in their
  code, ``format.py`` of deep-learning-multipliers). A
  value *overflows* at exponent ``E`` when it lies outside the range (it is
  clipped). Over ``update_every`` steps each group sums its overflow rate at
  ``E`` (``r``) and at ``E - 1`` (``r_1``, half the range), then, with the
  means over those steps,

  .. math::
    E \\leftarrow \\begin{cases} E + 1 & r > \\rho \\\\ E & r \\le \\rho < r_1
    \\\\ E - 1 & r_1 \\le \\rho \\end{cases}

  (``rho = max_overflow_rate``): the range doubles when too many values
  overflow and halves when even half the range would have been enough,
  which keeps ``2^E`` just above the magnitude the group needs, moving one
  bit per update. ``E`` stays in ``[-126, 128 - bits]``.
  The paper sets the initial scaling factors by training a few epochs in high
  precision; here ``int_bits=None`` does the same from the data: on the
  compressor's first step each group takes the smallest ``E`` whose range
  ``2^(E + bits - 1)`` exceeds its largest finite magnitude, and the rule
  runs from there. An ``int_bits`` sets ``E = int_bits - bits`` instead.

  Bit widths here include the sign; Courbariaux et al.'s exclude it (their
  "10 bits" are 11 here).

  Decisions: rounding is stochastic by default (unbiased inside the range,
  as :func:`fixed_point`; the paper rounds to nearest, ``rounding="nearest"``),
  and there is no error feedback by default (the paper has none). Exponents
  are per worker (each worker's own statistics), so each worker sends its
  own, one int8 per group, beside its codes.

  Bad input: outputs are finite and within each group's range: +-Inf saturate
  (and count as overflow), NaN is sent as code 0 (and is not counted); the
  state holds bounded integers and rates, so it stays finite. With
  ``error_feedback=True`` the memory drops a NaN or Inf gradient
  (``memory.py``).

  ``exchange="scatter"`` (``scatter.two_stage``; the two-stage
  exchange of 1-bit Adam, Tang et al. 2021 §4, Alg. 1, with ZeRO++'s
  per-block scales, Wang et al. 2023 §3): the flattened leaf is split into
  ``n`` chunks of ``ceil(d / n)`` values; each chunk's groups are its runs
  of ``min(block_size, chunk)`` values (the whole chunk for ``None``), so
  no group crosses a chunk and exponents are per chunk. A group's exponent
  is chosen from the data on every step by the calibration rule above (the
  smallest ``E`` whose range exceeds the group's largest finite magnitude):
  the overflow-driven update is not used, because its state would be shaped
  by the chunks, i.e. by the number of workers (``max_overflow_rate`` and
  ``update_every`` are then unused, ``int_bits`` must be ``None``, and the
  per-leaf state is the error feedback's alone). Each chunk travels to its
  owner as its packed codes and one int8 exponent per group (all-to-all);
  the owner averages the decoded chunks, **re-encodes the mean with a fresh
  exponent per group of its chunk** and ``rounding`` (stochastic: its own
  stream, independent of the workers'), and the owners' payloads are
  all-gathered. The calibrated range exceeds the group's largest magnitude,
  so only values within one code step of its top can saturate (by less than
  a step); elsewhere stochastic rounding stays unbiased. With
  ``error_feedback=True`` the worker keeps what its encoding lost and the
  owner what its re-encoding lost (server error, kept at the leaf's size,
  flattened, only its chunk in use).

  Args:
    bits: bits per code, sign included: one of 4, 8, 12, 16.
    block_size: values per group (>= 1), or ``None`` for one group per leaf
      (the paper groups by layer and by kind of value). Under LayerFusion a
      fused buffer is one leaf: set a block size there.
    max_overflow_rate: ``rho`` in [0, 1); the authors' example run uses 1e-4.
    update_every: steps between exponent updates (>= 1; the authors' code
      updates every 100 batches in its example run, from the summed rates).
    int_bits: the initial ``IL = E + bits`` of every group, in ``[bits -
      126, 128]``, or ``None`` to calibrate on the first step.
    rounding: ``"stochastic"`` or ``"nearest"`` (half to even).
    seed: seeds the rounding stream.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: add a memory of the rounding and saturation error.
    exchange: ``"gather"`` (all-gather codes and exponents) or ``"scatter"``
      (the two-stage exchange above; not with an ``exchange.Pattern`` axis).

  Returns:
    An ``optax.GradientTransformation`` whose per-leaf state is a
    :class:`DynamicFixedPointState` (inside an ``ErrorFeedbackState`` with
    ``error_feedback=True``); in the scatter form, nothing, or an
    ``ErrorFeedbackState`` around a ``scatter.ServerErrorState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.fixed_point import dynamic_fixed_point
    >>> tx = dynamic_fixed_point(8, rounding="nearest")
    >>> g = {"w": jnp.array([0.75, -0.5, 0.1])}
    >>> out, state = tx.update(g, tx.init(g))  # calibrated: E = -7, range [-1, 1)
    >>> out["w"].tolist()
    [0.75, -0.5, 0.1015625]
    >>> state.leaves["w"].exponent.tolist()  # 0.75 overflows half the range: kept
    [-7]

  References:
    Courbariaux, Bengio, David, *Training deep neural networks with low
    precision multiplications*, ICLR 2015 workshop (arXiv:1412.7024), §3
    (dynamic fixed point) and their code's ``format.new_range`` (the update
    rule); paper 004 §4.1; Tang et al., *1-bit Adam*, ICML 2021, §4 and
    Alg. 1, and Wang et al., *ZeRO++*, 2023, §3 (the scatter form).
  """
  bits = _check_bits(bits)
  if block_size is not None:
    block_size = checks.at_least("block_size", block_size, 1)
  rho = checks.in_range("max_overflow_rate", max_overflow_rate, 0.0, 1.0)
  update_every = checks.at_least("update_every", update_every, 1)
  if int_bits is not None:
    int_bits = _check_int_bits(int_bits, bits)
  if rounding not in ("stochastic", "nearest"):
    raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
  if scatter.check_form(exchange, axis_name) == "scatter":
    if int_bits is not None:
      raise ValueError(
        f"int_bits must be None with exchange='scatter' (its exponents are "
        f"calibrated on every step), got {int_bits!r}"
      )
    chunks = dynamic_chunks(bits, block_size, rounding == "stochastic")
    codec = scatter.scatter_codec(chunks, axis_name, server_error=error_feedback)
    return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)
  low, high = bitpack.code_range(bits)
  e_min, e_max = _MIN_EXPONENT, _max_exponent(bits)

  def init(leaf, key):
    del key
    groups = num_groups(leaf.size, block_size)
    start = 0 if int_bits is None else int_bits - bits
    return DynamicFixedPointState(
      exponent=jnp.full((groups,), start, jnp.int8),
      overflow=jnp.zeros((2, groups), jnp.float32),
    )

  def split(flat, layout):
    """``flat`` as one 2-D array per entry of ``layout``."""
    out, start = [], 0
    for groups, length in layout:
      out.append(flat[start : start + groups * length].reshape(groups, length))
      start += groups * length
    return out

  def per_part(values, layout):
    """Per-group ``values`` (groups,) as one column (groups, 1) per part."""
    out, start = [], 0
    for groups, _ in layout:
      out.append(values[start : start + groups, None])
      start += groups
    return out

  def calibrated(parts):
    """The smallest exponent whose range exceeds each group's largest finite |x|."""
    tops = []
    for p in parts:
      a = jnp.abs(p)
      tops.append(jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=1))
    k = jnp.frexp(jnp.concatenate(tops))[1]  # top < 2^k
    return jnp.clip(k - (bits - 1), e_min, e_max)

  def apply(x, state, key, step):
    size = x.size
    layout = _block_layout(size, block_size)
    parts = split(x.reshape(-1), layout)
    exponent = state.exponent.astype(jnp.int32)
    if int_bits is None:
      # Both branches typed alike under shard_map: varying wherever x or the
      # state is (a gossip codec's state starts replicated, its x does not).
      exponent = exchanges.vary_like(exponent, x)
      exponent = lax.cond(
        step == 0,
        lambda: exchanges.vary_like(calibrated(parts), exponent),
        lambda: exponent,
      )
    if rounding == "stochastic":
      u = hash_uniform(exchanges.worker_key(key, axis_name), (size,))
      uniforms = split(u, layout)
    else:
      uniforms = [None] * len(parts)
    codes, rates, rates_1 = [], [], []
    for p, e, u_p in zip(parts, per_part(exponent, layout), uniforms, strict=True):
      s = p * _pow2(-e)  # exact: a power of two, +-Inf where |s| overflows
      codes.append(to_codes(s, bits, u_p).reshape(-1))
      length = p.shape[1]
      rates.append(bitpack.row_counts((s > high) | (s < low)) / length)
      rates_1.append(bitpack.row_counts((2 * s > high) | (2 * s < low)) / length)
    codes = jnp.concatenate(codes)
    # The payload waits for both overflow counts, so the output (decoded
    # from it) is written over x's buffer only once they have read x;
    # without the order XLA copied x (kernels/ordering.py).
    after = ordering.zero_after(jnp.concatenate(rates) + jnp.concatenate(rates_1))
    sent_exponent = exponent + after.astype(jnp.int32)
    payload = (bitpack.pack_codes(codes, bits), sent_exponent.astype(jnp.int8))

    def decode(packed, exps):
      c = bitpack.unpack_codes(packed, bits, size).astype(jnp.float32)
      scales = per_part(_pow2(exps), layout)
      pieces = [
        (q * s).reshape(-1) for q, s in zip(split(c, layout), scales, strict=True)
      ]
      return jnp.concatenate(pieces).reshape(x.shape)

    mean = exchanges.gathered_mean(payload, decode, axis_name)
    remainder = x - decode(*payload)

    overflow = state.overflow + jnp.stack(
      [jnp.concatenate(rates), jnp.concatenate(rates_1)]
    )
    r, r_1 = overflow / update_every
    moved = jnp.where(r > rho, 1, jnp.where(r_1 > rho, 0, -1))
    due = (step + 1) % update_every == 0
    new_exponent = jnp.where(due, jnp.clip(exponent + moved, e_min, e_max), exponent)
    new_state = DynamicFixedPointState(
      exponent=new_exponent.astype(jnp.int8),
      overflow=jnp.where(due, 0.0, overflow),
    )
    return mean, remainder, new_state

  codec = LeafCodec(init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback), seed=seed)


# -- Chunk codecs of the scatter forms ------------------------------------------


def _even(c: int, bits: int) -> int:
  """Codes per packed row: ``c``, made even for the pair-packed 4 and 12 bits."""
  return c + c % 2 if bits in (4, 12) else c


def _pack_rows(codes: jax.Array, bits: int) -> jax.Array:
  """int32 codes ``(m, c)`` packed per row (rows never share a byte)."""
  m, c = codes.shape
  codes = jnp.pad(codes, ((0, 0), (0, _even(c, bits) - c)))
  return bitpack.pack_codes(codes, bits).reshape(m, -1)


def _unpack_rows(packed: jax.Array, bits: int, c: int) -> jax.Array:
  m = packed.shape[0]
  even = _even(c, bits)
  return bitpack.unpack_codes(packed.reshape(-1), bits, m * even).reshape(m, even)[
    :, :c
  ]


def fixed_point_chunks(bits: int, frac_bits: int) -> scatter.ChunkCodec:
  """:func:`fixed_point`'s scatter form: packed ``<IL, FL>`` codes, nothing else."""
  eps, scale = 2.0**-frac_bits, 2.0**frac_bits

  def encode(rows, counts, key):
    del counts
    codes = to_codes(rows * scale, bits, hash_uniform(key, rows.shape))
    return (_pack_rows(codes, bits),)

  def decode(payload, c):
    return _unpack_rows(payload[0], bits, c).astype(jnp.float32) * eps

  def row_bytes(c):
    return bitpack.packed_code_bytes(_even(c, bits), bits)

  return scatter.ChunkCodec(encode, decode, None, row_bytes)


def _row_groups(c: int, block_size: int | None) -> tuple[int, int, int]:
  """``(group, full, tail)``: the groups of a chunk of ``c`` values."""
  group = c if block_size is None else min(block_size, c)
  full = c // group
  return group, full, c - full * group


def dynamic_chunks(
  bits: int, block_size: int | None, stochastic: bool
) -> scatter.ChunkCodec:
  """:func:`dynamic_fixed_point`'s scatter form: codes and an int8 exponent per group.

  Each group's exponent is calibrated from its values (the smallest ``E``
  with ``max |x| < 2^(E + bits - 1)``, finite values only, in ``[-126,
  128 - bits]``).
  """
  e_min, e_max = _MIN_EXPONENT, _max_exponent(bits)

  def parts(rows, c):
    m = rows.shape[0]
    group, full, tail = _row_groups(c, block_size)
    out = [rows[:, : full * group].reshape(m, full, group)]
    if tail:
      out.append(rows[:, full * group :].reshape(m, 1, tail))
    return out

  def encode(rows, counts, key):
    del counts
    m, c = rows.shape
    u = hash_uniform(key, rows.shape) if stochastic else None
    pieces = parts(rows, c)
    uniforms = parts(u, c) if stochastic else [None] * len(pieces)
    codes, exponents = [], []
    for p, u_p in zip(pieces, uniforms, strict=True):
      a = jnp.abs(p)
      top = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=-1)
      e = jnp.clip(jnp.frexp(top)[1] - (bits - 1), e_min, e_max)
      s = p * _pow2(-e)[..., None]  # exact: a power of two
      codes.append(to_codes(s, bits, u_p).reshape(m, -1))
      exponents.append(e)
    codes = jnp.concatenate(codes, axis=1)
    exponents = jnp.concatenate(exponents, axis=1).astype(jnp.int8)
    return _pack_rows(codes, bits), exponents

  def decode(payload, c):
    packed, exponents = payload
    values = _unpack_rows(packed, bits, c).astype(jnp.float32)
    scales = _pow2(exponents.astype(jnp.int32))
    m = values.shape[0]
    group, full, tail = _row_groups(c, block_size)
    body = values[:, : full * group].reshape(m, full, group) * scales[:, :full, None]
    out = [body.reshape(m, -1)]
    if tail:
      out.append(values[:, full * group :] * scales[:, full:])
    return jnp.concatenate(out, axis=1)

  def row_bytes(c):
    _, full, tail = _row_groups(c, block_size)
    return bitpack.packed_code_bytes(_even(c, bits), bits) + full + (tail > 0)

  return scatter.ChunkCodec(encode, decode, None, row_bytes)
