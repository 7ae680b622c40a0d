r"""ZeRO++'s qgZ: a block-int4 reduce-scatter in two all-to-all hops, requantized between.

Wang et al. 2023, *ZeRO++*, §3.3 (qgZ): the gradient reduce-scatter of ZeRO
sends block-quantized int4 codes instead of 16-bit values, and, so that
quantization errors do not pile up over a ring's ``n - 1`` steps, runs it as
all-to-alls: one inside the node (fast axis), where each device receives the
codes of the chunk it owns on its node, dequantizes, averages and
*requantizes* them, and one across nodes (slow axis, between devices of equal
local index), where the owner dequantizes and averages again. Cross-node
volume is the int4 codes of ``1/g`` of the gradient: 4x below a 16-bit
reduce-scatter (§3.3: "4x less cross-node volume"). LoCo (Xie et al. 2024)
keeps the error of each hop and feeds it back (``error_feedback=True``).

DeepSpeed's layout (``all_to_all_quant_reduce``) reorders the tensor so the
final placement is right; here the padded flat leaf is viewed as
``(s, g, c)`` (slow index, fast index, chunk) and device ``(i, j)`` of the
slow and fast axes ends with chunk ``i g + j``: the device order of a mesh
laid out ``(slow, fast)``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import axes, checks, exchange, memory
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import blockq


class QgzState(NamedTuple):
  """Per-leaf state of :func:`qgz` with ``error_feedback``, per device.

  The errors of the second hop and of the gather; the first hop's (the
  worker's) is the ``memory.ErrorFeedbackState`` residual around it. ``c =
  ceil(d / (g s))`` for a ``d``-value leaf on ``g`` fast and ``s`` slow
  devices (``s = 1`` with one axis, ``g = s = 1`` with none).
  """

  # shape=(s * c,), float32: what this device's requantization of its node's
  # average (the second hop's payload) lost; () with one axis.
  hop: jax.Array | tuple
  # shape=(c,), float32: what the quantization of this device's final chunk
  # for the all-gather lost; () with gather=False.
  gather: jax.Array | tuple


def _blocks(m: int, block_size: int) -> int:
  """Values per block of a row of ``m``: at most ``block_size``, as even as possible.

  ``ceil(m / ceil(m / block_size))``: a row is padded by fewer values than it
  has blocks, so a chunk shorter than ``block_size`` is one block with no
  padding, and one just above it is two half blocks, not two full ones.
  """
  return -(-m // blockq.num_blocks(m, block_size)) if m else 1


def _row_bytes(m: int, bits: int, block_size: int) -> int:
  """Bytes of one quantized row of ``m`` values: packed codes and float32 scales."""
  b = _blocks(m, block_size)
  return blockq.code_bytes(m, bits, b) + 4 * blockq.num_blocks(m, b)


def _quantize(rows, bits: int, block_size: int):
  """``(codes, scales, decoded)`` of each row of ``rows`` (r, m)."""
  return blockq.quantize_dequantize(rows, bits, _blocks(rows.shape[-1], block_size))


def _dequantize(codes, scales, bits: int, block_size: int, m: int):
  return blockq.dequantize(codes, scales, bits, _blocks(m, block_size), m)


def _mean_rows(rows: jax.Array) -> jax.Array:
  """Mean of the rows of (k, m): each divided by k before unrolled adds.

  Dividing first keeps finite rows' mean finite; unrolled adds rather than
  ``jnp.sum(axis=0)`` (``exchange.gathered_sum`` says why).
  """
  k = rows.shape[0]
  total = rows[0] / k
  for w in range(1, k):
    total = total + rows[w] / k
  return total


def _fed_back(values, error):
  """``values + error`` where finite, else ``values`` (and the error is kept)."""
  z = values + error
  fits = jnp.isfinite(z)
  return jnp.where(fits, z, values), fits


def _kept(z, decoded, fits, error):
  """The new error of a hop: ``z - decoded`` where it was fed back and finite."""
  lost = jnp.where(fits, z - decoded, error)
  return jnp.where(jnp.isfinite(lost), lost, error)


def _all_to_all(x, axis):
  return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def qgz_wire(d: int, bits: int, block_size: int, g: int, s: int = 1, gather=True):
  """``[(kind, axis, operand bytes)]`` one device's :func:`qgz` of ``d`` values sends.

  ``axis`` is ``"fast"`` or ``"slow"``: the first hop's all-to-all (``g``
  rows of ``s c`` values), the second's (``s`` rows of ``c``), and with
  ``gather`` the all-gathers of the final chunk's codes, over the slow axis
  (one row of ``c``), then the fast one (``s`` rows). One axis: ``s = 1``
  and no second hop.
  """
  c = -(-d // (g * s))
  out = [("all-to-all", "fast", g * _row_bytes(s * c, bits, block_size))]
  if s > 1:
    out.append(("all-to-all", "slow", s * _row_bytes(c, bits, block_size)))
  if gather:
    row = _row_bytes(c, bits, block_size)
    if s > 1:
      out.append(("all-gather", "slow", row))
    out.append(("all-gather", "fast", s * row))
  return out


@recorded
def qgz(
  *,
  bits: int = 4,
  block_size: int = 512,
  axis_name: exchange.AxisName = None,
  gather: bool = True,
  error_feedback: bool = False,
) -> optax.GradientTransformation:
  r"""ZeRO++'s qgZ: block-int4 all-to-all inside the node, requantized, then across nodes.

  With ``axis_name=(fast, slow)`` (``g`` and ``s`` devices), each leaf of
  ``d`` values is flattened, zero-padded to ``g s c`` values (``c = ceil(d /
  (g s))``) and viewed as ``x[i, j]``, chunks of ``c`` values, ``i`` a slow
  index and ``j`` a fast one. On device ``(i', j')``:

  1. **hop 1, inside the node**: the ``s c`` values ``x[:, j]`` bound for fast
     peer ``j`` are quantized (symmetric blocks, ``kernels.blockq``) and one
     ``all_to_all`` over ``fast`` delivers them; the device dequantizes the
     ``g`` payloads it received and averages them:
     :math:`y = \frac1g \sum_{l} Q(x_l[:, j'])`, the node's mean of its ``s``
     chunks;
  2. **hop 2, across nodes**: ``y`` is requantized, row ``i`` (``c``
     values) bound for slow peer ``i``, one ``all_to_all`` over ``slow``
     (devices of equal local index) delivers them, and the device averages
     the ``s`` dequantized rows:
     :math:`z = \frac1s \sum_{m} Q(y_m[i'])`, the mean over all ``g s``
     devices of chunk ``(i', j')``, up to two quantizations.

  ``gather=False`` returns ``z``: each leaf becomes this device's chunk,
  shape ``(c,)`` in the leaf's dtype, chunk ``i' g + j'`` of the raveled,
  zero-padded mean (ZeRO's partitioned gradient; ``gradcomp.fusion.unshard``
  reassembles it, with ``fast_axis=(slow, fast)`` inside ``shard_map`` or
  from the chunks concatenated in device order). ``gather=True`` returns the
  full mean on every device: ``z`` is quantized once more and its codes are
  all-gathered, first over ``slow`` (one chunk's codes cross the slow
  links) and then over ``fast`` (``s`` chunks' codes), and every device
  decodes all of them. A quantized gather keeps the slow axis at int4 (a
  float32 gather of the chunk would send 8x its codes across nodes, more
  than the two hops); gathering the slow axis first sends one chunk, not
  ``g``, across nodes; the price is a third quantization, whose error
  ``error_feedback`` keeps too.

  With one axis (a ``str``, or a tuple of one) there is one hop, over it
  (``s = 1``); this is the form to use as the inner of
  ``gradcomp.hierarchical``, which reduce-scatters inside the node in
  float32 first. With ``axis_name=None`` the exchange is the identity:
  quantized and dequantized on one device.

  Error: for each hop, every value is within half a quantization step of
  what was quantized (``|x - Q(x)| <= s_B / 2`` with ``s_B = max_B |x| /
  q``, ``q = 2^{b-1} - 1``; ``kernels.blockq``), so the chunk ``z`` is within
  the mean of the first hop's half-steps plus the mean of the second's of
  the exact mean, and the gathered output within one more half-step.
  ``error_feedback`` (LoCo, Xie et al. 2024) keeps each hop's error (worker:
  ``x + r - Q(x + r)``; the second hop's and the gather's at the device that
  quantized them) and adds it before the next quantization; the memory
  holds ``d + s c + c`` values per device (float32; LoCo stores 8 bits).

  Blocks: a row of ``m`` values is quantized in blocks of at most
  ``block_size`` values, as equal as possible (``ceil(m / ceil(m /
  block_size))``), so small chunks are never padded to a whole block.

  Bad input: outputs are always finite. ``kernels.blockq`` takes each block's
  scale from its finite values, saturates +-Inf at it and sends NaN as 0;
  decoded payloads are divided by the number of rows before they are
  added. With ``error_feedback`` the worker's memory drops non-finite
  gradient coordinates (``memory.py``) and a hop whose value plus error
  overflows sends the value alone and keeps its error.

  Args:
    bits: 4 (ZeRO++'s int4, two codes to a byte) or 8.
    block_size: values per scale, at least 1.
    axis_name: ``(fast, slow)`` mesh axes for the two hops, one axis for one
      hop, or ``None`` for one device.
    gather: return the full mean (``True``) or this device's chunk.
    error_feedback: keep each hop's quantization error and send it later.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: bad ``bits``, ``block_size``, ``gather`` or
      ``error_feedback``; an ``axis_name`` of more than two axes, of the
      same axis twice, or an exchange pattern (gossip neighbours, a
      server's pushes), which has no all-to-all.

  Examples:
    On one device: int4 codes of one block, scale ``0.7 / 7 = 0.1``.

    >>> import jax.numpy as jnp, gradcomp
    >>> tx = gradcomp.qgz()
    >>> g = {"w": jnp.array([0.7, -0.26, 0.04, 0.0])}
    >>> [round(v, 4) for v in tx.update(g, tx.init(g))[0]["w"].tolist()]
    [0.7, -0.3, 0.0, 0.0]

    On a ``(2, 4)`` mesh: hop 1 over ``"local"``, hop 2 over ``"node"``.
    Per device, 1024 values give int4 codes of 128-value chunks: hop 1 sends
    4 rows of 256 codes (128 bytes and one scale each), hop 2 two rows of
    128 (64 bytes and a scale), the gather one row over ``"node"`` and two
    over ``"local"``.

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
    >>> tx = gradcomp.qgz(axis_name=("local", "node"))
    >>> spec = P(("node", "local"))
    >>> step = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
    ...   in_specs=spec, out_specs=P())
    >>> g = jax.ShapeDtypeStruct((8 * 1024,), jnp.float32, sharding=NamedSharding(mesh, spec))
    >>> sorted((c.axes, c.kind, c.operand_bytes)
    ...        for c in gradcomp.axis_wire(step, g, mesh=mesh))
    ... # doctest: +NORMALIZE_WHITESPACE
    [(('local',), 'all-gather', 8), (('local',), 'all-gather', 128),
     (('local',), 'all-to-all', 16), (('local',), 'all-to-all', 512),
     (('node',), 'all-gather', 4), (('node',), 'all-gather', 64),
     (('node',), 'all-to-all', 8), (('node',), 'all-to-all', 128)]

  References:
    Wang et al., *ZeRO++: Extremely Efficient Collective Communication for
    Giant Model Training*, 2023, §3.3 (qgZ: hierarchical all-to-all of
    block-quantized int4 gradients) and §3.1 (block quantization); Xie et
    al., *LoCo: Low-Bit Communication Adaptor for Large-scale Model
    Training*, 2024 (error feedback at each hop); DeepSpeed
    ``all_to_all_quant_reduce``;
  """
  if not isinstance(bits, int) or isinstance(bits, bool) or bits not in blockq.BITS:
    raise ValueError(f"bits must be one of {blockq.BITS}, got {bits!r}")
  block_size = checks.at_least("block_size", block_size, 1)
  for name, value in (("gather", gather), ("error_feedback", error_feedback)):
    if not isinstance(value, bool):
      raise ValueError(f"{name} must be True or False, got {value!r}")
  if isinstance(axis_name, exchange.Pattern):
    raise ValueError(
      f"qgz needs all-to-alls over all workers, which {axis_name.what} "
      f"({axis_name!r}) cannot provide"
    )
  hops = axes.group_axes(axis_name)
  if len(hops) > 2 or len(set(hops)) != len(hops):
    raise ValueError(
      f"axis_name must be None, one mesh axis or two distinct ones (fast, "
      f"slow), got {axis_name!r}"
    )
  fast = hops[0] if hops else None
  slow = hops[1] if len(hops) == 2 else None

  def sizes(tree=None) -> tuple[int, int]:
    g = 1 if fast is None else axes.axis_size(fast, tree)
    s = 1 if slow is None else axes.axis_size(slow, tree)
    return g, s

  def init(leaf, key):
    del key
    if not error_feedback:
      return ()
    g, s = sizes(leaf)
    c = -(-_size(leaf) // (g * s))
    return QgzState(
      hop=jnp.zeros((s * c,), jnp.float32) if slow is not None else (),
      gather=jnp.zeros((c,), jnp.float32) if gather else (),
    )

  def apply(x, state, key, step):
    del key, step
    d = x.size
    g, s = sizes()
    c = -(-d // (g * s))
    flat = jnp.pad(x.reshape(-1), (0, g * s * c - d))
    new_state = state
    # Hop 1: the s chunks bound for each fast peer j, x[:, j], as one row.
    rows = flat.reshape(s, g, c).transpose(1, 0, 2).reshape(g, s * c)
    codes, scales, decoded = _quantize(rows, bits, block_size)
    sent = decoded.reshape(g, s, c).transpose(1, 0, 2).reshape(-1)[:d]
    if fast is not None:
      codes, scales = _all_to_all(codes, fast), _all_to_all(scales, fast)
    else:
      codes, scales = exchange._on_one_device((codes, scales))
    y = _mean_rows(_dequantize(codes, scales, bits, block_size, s * c))
    # Hop 2: row i of the node's mean to slow peer i.
    if slow is not None:
      if error_feedback:
        y, fits = _fed_back(y, state.hop)
      codes, scales, decoded = _quantize(y.reshape(s, c), bits, block_size)
      if error_feedback:
        new_state = new_state._replace(
          hop=_kept(y, decoded.reshape(-1), fits, state.hop)
        )
      codes, scales = _all_to_all(codes, slow), _all_to_all(scales, slow)
      z = _mean_rows(_dequantize(codes, scales, bits, block_size, c))
    else:
      z = y
    if not gather:
      return z, (x.reshape(-1) - sent).reshape(x.shape), new_state
    # The gather: z's codes, over the slow axis first, then the fast one.
    if error_feedback:
      z, fits = _fed_back(z, state.gather)
    codes, scales, decoded = _quantize(z[None], bits, block_size)
    if error_feedback:
      new_state = new_state._replace(gather=_kept(z, decoded[0], fits, state.gather))
    payload = (codes[0], scales[0])
    if slow is not None:
      payload = jax.tree.map(
        lambda a: jax.lax.all_gather(a, slow, to="invarying"), payload
      )
    else:
      payload = jax.tree.map(lambda a: a[None], payload)
    payload = exchange.all_gather(payload, fast)  # (g, s, ...)
    chunks = _dequantize(*payload, bits, block_size, c)  # (g, s, c)
    mean = chunks.transpose(1, 0, 2).reshape(-1)[:d].reshape(x.shape)
    return mean, (x.reshape(-1) - sent).reshape(x.shape), new_state

  codec = LeafCodec(init if error_feedback else stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback))


def _size(leaf) -> int:
  size = 1
  for n in leaf.shape:
    size *= int(n)
  return size
