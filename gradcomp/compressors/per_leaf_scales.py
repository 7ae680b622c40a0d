"""Per-leaf scales inside fused groups: the quantizers and sign codecs as published.

EF-signSGD's ``||e||_1 / d``, TernGrad's ``max |g|``, QSGD's bucket norms and
the integer block scales are computed per layer in their papers; on a fused
buffer they become one per buffer (or buckets straddling two layers), another
algorithm (``gradcomp.compressors.scopes``). The forms here are what
``gradcomp.layerfusion`` runs for these codecs instead: each receives a tuple of
*groups*, each a tuple of leaves (the plan's groups), and for every group

* builds each leaf's ``e = r + g`` from its slice of the group's fused
  residual (the state is laid out as the seed's fused state: one residual per
  group, the leaves raveled and concatenated, a one-leaf group's in the leaf's
  shape), and encodes it exactly as the layer-wise codec does: the same scale,
  buckets or blocks inside the leaf, the same random draws (leaf ``j`` of the
  plan's order rounds with ``derive(step_key, j)`` and its worker's stream, as
  ``leafwise`` gives leaf ``j`` of the layer-wise plan);
* sends the whole group's payload (every leaf's codes and scales, byte for byte
  the layer-wise payloads, concatenated into one ``uint8`` buffer) in **one**
  all-gather, where the layer-wise plan sends two per leaf;
* decodes each leaf from its slice of every worker's buffer and averages as
  ``exchange.gathered_mean`` does (each decoded payload divided by ``n``, the
  workers added in order).

Every floating-point operation is the layer-wise codec's, on the same values
and shapes, so the outputs and residuals equal the layer-wise plan's bit for
bit, and the wire carries the same bytes in fewer collectives.

Why per-leaf slices rather than one pass with a per-value scale: on XLA:CPU a
per-value scale built from per-leaf scalars (a concatenation of broadcasts, a
``jnp.repeat`` or a binary search over the leaf offsets) costs more than the
quantization itself on the ResNet-50 buffer (BUILD_NOTES, "Per-leaf scales
inside a fused buffer"); each leaf's elementwise pass is one loop over its own
values, so the group's work is one pass over its values either way.

EF-signSGD, TernGrad, QSGD and int_quantize are written out here, split at
the wire (:class:`_LeafEncoding`). FP8, FP4 and 1-bit SGD run their own
layer-wise program on the plan's leaves with a recording exchange
(:class:`_Recorder`, an ``exchange.Pattern``) that keeps each leaf's payload
and decoder; the group's payloads then go in one all-gather the same way.

The exchange-pattern axes (``exchanges.Pattern``), the scatter forms and
LoCo's 8-bit residuals have no per-leaf form here: their factories return
``None`` and LayerFusion keeps fused buffers for them. Nor do
dynamic_fixed_point (its exponent state per leaf has no place in the fused
state) and qgZ (not written yet).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, lowp, onebit
from gradcomp.compressors import exchange as exchanges
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.intq import decode_rows, encode_rows
from gradcomp.compressors.memory import ErrorFeedbackState, corrected
from gradcomp.compressors.quantizers import bucket_codes
from gradcomp.kernels import bits, blockq, hashing, numerics, ordering
from gradcomp.kernels.hashing import hash_uniform


class _LeafEncoding(NamedTuple):
  """One leaf's codec, split at the wire.

  ``encode(x, key) -> (parts, own)``: the payload arrays of ``x`` (float32, the
  leaf's shape) and its own decoded payload; ``decode(parts, shape)``: the
  float32 values of a payload, shaped ``shape``. ``key`` is the leaf's step key
  (shared by the workers), ``None`` for a deterministic codec.
  """

  encode: Callable
  decode: Callable


# -- The codecs, operation for operation those of signs.py, quantizers.py, intq.py


def _scaled_sign() -> _LeafEncoding:
  """EF-signSGD's ``(||x||_1 / d) sign(x)`` (``signs.scaled_sign_codec``)."""

  def encode(x, key):
    del key
    size = x.size
    k = (size - 1).bit_length()
    shrink = 2.0**-k + ordering.zero_after(x)
    total = jnp.sum(jnp.abs(x) * shrink)
    scale = jnp.minimum(total * (2.0**k / size), numerics.FLOAT32_MAX)
    packed = jnp.packbits(x.reshape(-1) >= 0)
    return (packed, scale), jnp.where(x >= 0, scale, -scale)

  def decode(parts, shape):
    packed, scale = parts
    return bits.unpack_signs(packed, math.prod(shape)).reshape(shape) * scale

  return _LeafEncoding(encode, decode)


def _ternary(axis_name) -> _LeafEncoding:
  """TernGrad's ``max |x| sign(x_i) b_i`` (``quantizers.terngrad``)."""

  def encode(x, key):
    scale = numerics.max_abs(x)
    u = hash_uniform(exchanges.worker_key(key, axis_name), x.shape)
    keep = u * scale < jnp.abs(x)
    ternary = jnp.where(keep, jnp.sign(x), 0.0)
    return (bits.pack_ternary(ternary), scale), ternary * scale

  def decode(parts, shape):
    packed, scale = parts
    return (bits.unpack_ternary(packed, math.prod(shape)) * scale).reshape(shape)

  return _LeafEncoding(encode, decode)


def _qsgd_buckets(levels: int, bucket_size: int, axis_name) -> _LeafEncoding:
  """QSGD's int8 codes and a norm per bucket of the leaf (``quantizers.qsgd``)."""

  def encode(x, key):
    coded = bucket_codes(x, key, levels, bucket_size, axis_name)
    payload = tuple(a for pair in coded for a in pair)
    return payload, decode(payload, x.shape)

  def decode(parts, shape):
    pairs = zip(parts[::2], parts[1::2], strict=True)
    return jnp.concatenate(
      [(c.astype(jnp.float32) * s).reshape(-1) for c, s in pairs]
    ).reshape(shape)

  return _LeafEncoding(encode, decode)


def _int_blocks(bits_: int, block_size: int) -> _LeafEncoding:
  """ZeRO++'s codes and a scale per block of the leaf (``intq.int_quantize``)."""

  def encode(x, key):
    del key
    codes, scales, decoded = encode_rows(x.reshape(1, -1), bits_, block_size)
    return (codes[0], scales[0]), decoded.reshape(x.shape)

  def decode(parts, shape):
    codes, scales = parts
    size = math.prod(shape)
    return decode_rows(codes[None], scales[None], bits_, block_size, size).reshape(
      shape
    )

  return _LeafEncoding(encode, decode)


# -- The group's one payload --------------------------------------------------------


def _to_bytes(a: jax.Array) -> jax.Array:
  """``a``'s bytes, raveled (uint8); :func:`_from_bytes` inverts it."""
  a = a.reshape(-1)
  if a.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(a, jnp.uint8)
  return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
  if like.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(b, like.dtype).reshape(like.shape)
  words = b.reshape(-1, like.dtype.itemsize)
  return jax.lax.bitcast_convert_type(words, like.dtype).reshape(like.shape)


def _update_group(
  leaves, state, first: int, step_key, codec, error_feedback, axis_name
):
  """One step of a group: ``(float32 outputs per leaf, new state)``."""
  shapes = [tuple(x.shape) for x in leaves]
  sizes = [math.prod(s) for s in shapes]
  if error_feedback:
    flat_residual = state.residual.reshape(-1)
  es, owns, parts, offset = [], [], [], 0
  for k, (x, shape, size) in enumerate(zip(leaves, shapes, sizes, strict=True)):
    g = x.astype(jnp.float32)
    if error_feedback:
      r = flat_residual[offset : offset + size].reshape(shape)
      g = corrected(r, g)
    offset += size
    es.append(g)
    if size == 0:  # nothing to send (leafwise passes it through)
      owns.append(g)
      parts.append(())
      continue
    leaf_parts, own = codec.encode(g, hashing.derive(step_key, first + k))
    owns.append(own)
    parts.append(tuple(leaf_parts))
  # One payload for the group: every leaf's codes and scales, as bytes.
  likes = [[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in ps] for ps in parts]
  flat = [_to_bytes(p) for ps in parts for p in ps]
  outputs = [jnp.zeros(s, jnp.float32) for s in shapes]
  if flat:
    payload = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
    gathered = exchanges.all_gather(payload, axis_name)
    n = gathered.shape[0]
    totals: list[jax.Array | None] = [None] * len(leaves)
    for w in range(n):
      start = 0
      for k, like in enumerate(likes):
        if not like:
          continue
        leaf_parts = []
        for part in like:
          nbytes = math.prod(part.shape) * part.dtype.itemsize
          leaf_parts.append(_from_bytes(gathered[w, start : start + nbytes], part))
          start += nbytes
        # As exchange.gathered_mean: each decoded payload divided by n first.
        value = codec.decode(tuple(leaf_parts), shapes[k]) / n
        totals[k] = value if totals[k] is None else totals[k] + value
    outputs = [o if t is None else t for o, t in zip(outputs, totals, strict=True)]
  if not error_feedback:
    return outputs, state
  kept = [(e - own).reshape(-1) for e, own in zip(es, owns, strict=True)]
  # Materialised first: a concatenation fused with what computes its pieces
  # makes XLA:CPU pick the piece per value from all of them (20 % of
  # EF-signSGD's call on the ResNet-50 gradient).
  kept = jax.lax.optimization_barrier(kept)
  remainder = kept[0] if len(kept) == 1 else jnp.concatenate(kept)
  return outputs, ErrorFeedbackState(remainder.reshape(state.residual.shape), ())


def _per_leaf(
  codec: _LeafEncoding, *, seed: int, axis_name, error_feedback: bool
) -> optax.GradientTransformation:
  """``codec`` per leaf on a tuple of groups of leaves, one all-gather per group."""

  def init_fn(params):
    key = jax.random.PRNGKey(seed)
    _, key = jax.random.split(key)  # as leafwise: the first half seeds init
    states = []
    for group in params:
      group = tuple(group)
      if not error_feedback:
        states.append(())
        continue
      if len(group) == 1:
        residual = jnp.zeros_like(group[0], jnp.float32)  # sharded like the leaf
      else:
        size = sum(math.prod(x.shape) for x in group)
        residual = jnp.zeros((size,), jnp.float32)
      states.append(ErrorFeedbackState(residual=residual, inner=()))
    return CompressorState(
      count=jnp.zeros([], jnp.int32), key=key, leaves=tuple(states)
    )

  def update_fn(updates, state, params=None):
    del params
    key, step_key = jax.random.split(state.key)
    outputs, states, first = [], [], 0
    for group, s in zip(updates, state.leaves, strict=True):
      group = tuple(group)
      out, new_s = _update_group(
        group, s, first, step_key, codec, error_feedback, axis_name
      )
      first += len(group)
      outputs.append(tuple(out))
      states.append(exchanges.vary_like(new_s, s))
    new_state = CompressorState(
      count=optax.safe_increment(state.count), key=key, leaves=tuple(states)
    )
    return tuple(outputs), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _has_form(axis_name, exchange_form: str) -> bool:
  """Gathered codecs on a plain axis (or none) have a per-leaf form here."""
  return exchange_form == "gather" and not isinstance(axis_name, exchanges.Pattern)


# -- The forms, one per registered codec (scopes._PER_LEAF_FORMS) -------------------


def ef_signsgd_per_leaf(
  *, axis_name: exchanges.AxisName = None, exchange: str = "gather"
) -> optax.GradientTransformation | None:
  """``ef_signsgd(...)`` per leaf on a tuple of groups of leaves.

  For every leaf, with error feedback (Karimireddy et al., ICML 2019, Alg. 1):

  .. math::
    e = r + g,\\quad p = \\tfrac{\\|e\\|_1}{d}\\operatorname{sign}(e),
    \\quad r = e - p

  ``d`` and ``||e||_1`` of the leaf, not of its group; a group's sign bits and
  scales travel in one all-gather (``ceil(d / 8) + 4`` bytes per leaf, as
  layer-wise). ``None`` for ``exchange="scatter"`` or a ``Pattern`` axis.

  Examples:
    One group of two leaves, each with its own scale:

    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.per_leaf_scales import ef_signsgd_per_leaf
    >>> groups = ((jnp.array([1.0, -3.0]), jnp.array([0.5, 0.5, -0.5, 0.5])),)
    >>> tx = ef_signsgd_per_leaf()
    >>> out, state = tx.update(groups, tx.init(groups))
    >>> out[0][0].tolist(), out[0][1].tolist()
    ([2.0, -2.0], [0.5, 0.5, -0.5, 0.5])
    >>> state.leaves[0].residual.tolist()  # one fused residual per group
    [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
  """
  if not _has_form(axis_name, exchange):
    return None
  return _per_leaf(_scaled_sign(), seed=0, axis_name=axis_name, error_feedback=True)


def terngrad_per_leaf(
  *, seed: int = 0, axis_name: exchanges.AxisName = None, exchange: str = "gather"
) -> optax.GradientTransformation | None:
  """``terngrad(...)`` per leaf: ``s = max |g|`` of each leaf (Wen et al. 2017).

  .. math::
    Q(g_i) = s \\operatorname{sign}(g_i) b_i,\\quad
    b_i \\sim \\operatorname{Bernoulli}(|g_i| / s),\\quad s = \\max_{j \\in
    \\text{leaf}} |g_j|

  The uniforms are the layer-wise plan's: leaf ``j`` of the plan's order
  draws from ``derive(step_key, j)`` and its worker's stream, so the result
  equals it bit for bit. ``None`` for ``exchange="scatter"`` or a ``Pattern``
  axis.
  """
  if not _has_form(axis_name, exchange):
    return None
  return _per_leaf(
    _ternary(axis_name), seed=seed, axis_name=axis_name, error_feedback=False
  )


def qsgd_per_leaf(
  levels: int = 4,
  *,
  bucket_size: int = 512,
  seed: int = 0,
  axis_name: exchanges.AxisName = None,
  error_feedback: bool = False,
  exchange: str = "gather",
) -> optax.GradientTransformation | None:
  """``qsgd(...)`` per leaf: buckets inside each leaf, never across two.

  .. math::
    Q(x_i) = \\|x_B\\|_2 \\operatorname{sign}(x_i) \\lfloor s|x_i| /
    \\|x_B\\|_2 + u_i \\rfloor / s

  with ``B`` a bucket of ``min(bucket_size, d)`` values of the leaf, the
  last one shorter (Alistarh et al., NeurIPS 2017, §3 and §5), and the
  layer-wise plan's uniforms ``u_i``. ``None`` for ``exchange="scatter"``
  or a ``Pattern`` axis.
  """
  levels = checks.at_least("levels", levels, 1, 127)
  bucket_size = checks.at_least("bucket_size", bucket_size, 1)
  if not _has_form(axis_name, exchange):
    return None
  return _per_leaf(
    _qsgd_buckets(levels, bucket_size, axis_name),
    seed=seed,
    axis_name=axis_name,
    error_feedback=error_feedback,
  )


def int_quantize_per_leaf(
  bits: int = 8,
  block_size: int = 512,
  *,
  exchange: str = "gather",
  error_feedback: bool = True,
  residual_bits: int = 32,
  axis_name: exchanges.AxisName = None,
) -> optax.GradientTransformation | None:
  """``int_quantize(...)`` per leaf: blocks inside each leaf (ZeRO++ §3).

  .. math::
    s_B = \\max_{i \\in B} |x_i| / q,\\quad c_i = \\operatorname{round}(x_i /
    s_B),\\quad q = 2^{b-1} - 1

  ``B`` a block of ``min(block_size, d)`` values of the leaf, the last one
  shorter. ``None`` for ``exchange="scatter"``, ``residual_bits=8`` or a
  ``Pattern`` axis.
  """
  if not isinstance(bits, int) or isinstance(bits, bool) or bits not in blockq.BITS:
    raise ValueError(f"bits must be one of {blockq.BITS}, got {bits!r}")
  block_size = checks.at_least("block_size", block_size, 1)
  if residual_bits != 32 or not _has_form(axis_name, exchange):
    return None
  return _per_leaf(
    _int_blocks(bits, block_size),
    seed=0,
    axis_name=axis_name,
    error_feedback=error_feedback,
  )


# -- The other gathered codecs: their own per-leaf program, exchanges batched ------


class _Recorder(exchanges.Pattern):
  """An exchange that records each leaf's payload and decoder, and sends nothing.

  Passed as a codec's ``axis_name``, it keeps ``(payload, decode)`` of every
  ``exchange.gathered_mean`` in call order (one per non-empty leaf) and gives
  the codec its own decoded payload; :func:`_batched_exchange` then sends the
  group's payloads in one all-gather. ``worker_key`` reads ``axis``, so the
  worker streams are those of the real axis.
  """

  what = "a per-leaf form's recorded exchange"

  def __init__(self, axis):
    self.axis = axis
    self.sent: list[tuple[tuple, Callable]] = []

  def exchange(self, payload, decode):
    parts, tree = jax.tree.flatten(tuple(payload))
    self.sent.append((parts, lambda *p: decode(*jax.tree.unflatten(tree, p))))
    return decode(*payload)


def _flat_states(groups, states) -> list:
  """Each leaf's layer-wise state from its group's fused one (EF or nothing)."""
  out = []
  for group, s in zip(groups, states, strict=True):
    if s == ():
      out.extend(() for _ in group)
      continue
    flat, start = s.residual.reshape(-1), 0
    for x in group:
      size = math.prod(x.shape)
      out.append(ErrorFeedbackState(flat[start : start + size].reshape(x.shape), ()))
      start += size
  return out


def _group_states(groups, leaf_states, like) -> tuple:
  """Inverse of :func:`_flat_states`: one fused residual per group."""
  out, first = [], 0
  for group, s in zip(groups, like, strict=True):
    mine = leaf_states[first : first + len(group)]
    first += len(group)
    if s == ():
      out.append(())
      continue
    kept = [m.residual.reshape(-1) for m in mine]
    kept = jax.lax.optimization_barrier(kept)  # as in _update_group
    joined = kept[0] if len(kept) == 1 else jnp.concatenate(kept)
    out.append(ErrorFeedbackState(joined.reshape(s.residual.shape), ()))
  return tuple(out)


def _batched_exchange(groups, sent, axis_name) -> list:
  """The workers' mean of each leaf, one all-gather of each group's payloads."""
  outputs, k = [], 0
  for group in groups:
    mine = []
    for x in group:
      if math.prod(x.shape) == 0:
        mine.append(None)
      else:
        mine.append(sent[k])
        k += 1
    parts = [p for entry in mine if entry is not None for p in entry[0]]
    if not parts:
      outputs.extend(jnp.zeros(x.shape, jnp.float32) for x in group)
      continue
    likes = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts]
    flat = [_to_bytes(p) for p in parts]
    payload = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
    gathered = exchanges.all_gather(payload, axis_name)
    n = gathered.shape[0]
    totals: list[jax.Array | None] = [None] * len(group)
    for w in range(n):
      start, p = 0, 0
      for j, entry in enumerate(mine):
        if entry is None:
          continue
        values = []
        for _ in entry[0]:
          nbytes = math.prod(likes[p].shape) * likes[p].dtype.itemsize
          values.append(_from_bytes(gathered[w, start : start + nbytes], likes[p]))
          start, p = start + nbytes, p + 1
        # The recorded decoder divides by the recorder's 1 worker; then by n.
        value = entry[1](*values) / n
        totals[j] = value if totals[j] is None else totals[j] + value
    outputs.extend(
      jnp.zeros(x.shape, jnp.float32) if t is None else t.reshape(x.shape)
      for x, t in zip(group, totals, strict=True)
    )
  return outputs


def _gathered_form(factory, arguments: dict) -> optax.GradientTransformation | None:
  """``factory(**arguments)`` per leaf on groups, each group's exchange batched.

  The layer-wise codec runs on the plan's leaves in order (the same keys,
  scales and remainders), its exchanges recorded (:class:`_Recorder`); each
  group's payloads then travel in one all-gather and are decoded per leaf.
  For a codec whose leaves keep nothing or an error-feedback residual only.
  """
  axis_name = arguments.get("axis_name")
  if arguments.get("exchange", "gather") != "gather" or isinstance(
    axis_name, exchanges.Pattern
  ):
    return None
  plain = factory(**arguments)
  probe = plain.init((jax.ShapeDtypeStruct((2,), jnp.float32),)).leaves[0]
  if probe != () and not (isinstance(probe, ErrorFeedbackState) and probe.inner == ()):
    return None  # a per-leaf state the fused layout cannot hold

  def init_fn(params):
    groups = [tuple(group) for group in params]
    states = []
    for group in groups:
      if probe == ():
        states.append(())
      elif len(group) == 1:
        states.append(ErrorFeedbackState(jnp.zeros_like(group[0], jnp.float32), ()))
      else:
        size = sum(math.prod(x.shape) for x in group)
        states.append(ErrorFeedbackState(jnp.zeros((size,), jnp.float32), ()))
    key = plain.init(()).key
    return CompressorState(
      count=jnp.zeros([], jnp.int32), key=key, leaves=tuple(states)
    )

  def update_fn(updates, state, params=None):
    del params
    groups = [tuple(group) for group in updates]
    leaves = tuple(x for group in groups for x in group)
    inner = CompressorState(
      count=state.count,
      key=state.key,
      leaves=tuple(_flat_states(groups, state.leaves)),
    )
    if axis_name is None:
      outputs, new = plain.update(leaves, inner)
    else:
      recorder = _Recorder(axis_name)
      tx = factory(**{**arguments, "axis_name": recorder})
      _, new = tx.update(leaves, inner)
      outputs = _batched_exchange(groups, recorder.sent, axis_name)
    grouped_out, first = [], 0
    for group in groups:
      grouped_out.append(tuple(outputs[first : first + len(group)]))
      first += len(group)
    states = _group_states(groups, list(new.leaves), state.leaves)
    states = exchanges.vary_like(states, state.leaves)
    return tuple(grouped_out), CompressorState(new.count, new.key, states)

  return optax.GradientTransformation(init_fn, update_fn)


def fp8_per_leaf(**arguments) -> optax.GradientTransformation | None:
  """``fp8(...)`` per leaf: a scale per leaf or per block of the leaf."""
  return _gathered_form(lowp.fp8, arguments)


def fp4_per_leaf(**arguments) -> optax.GradientTransformation | None:
  """``fp4(...)`` per leaf: a shared exponent per block of the leaf (MX)."""
  return _gathered_form(lowp.fp4, arguments)


def onebit_sgd_per_leaf(**arguments) -> optax.GradientTransformation | None:
  """``onebit_sgd(...)`` per leaf: two means per column of each leaf's matrix."""
  return _gathered_form(onebit.onebit_sgd, arguments)
