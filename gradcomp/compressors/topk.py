"""Top-k sparsification: send the k coordinates of largest magnitude.

Paper 000 Table 1 (Top-K 1%); paper 004 §4 (drop-ratio sparsification with
error feedback, Aji & Heafield 2017). With ``chunk`` and ``value_bits``, the
chunked, quantised top-k of SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706):
the top k of each tile, positions sent within the tile, values in a few bits
(:func:`topk`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import bitfields, tiles
from gradcomp.kernels.selection import top_k_magnitude

#: ``value_bits`` that quantise (1 to 8 bits per value), and 32: float32 values.
VALUE_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 32)
#: Half-width of the value quantiser's range, in units of the tile's RMS of the
#: kept values: ``2**b`` bins over ``[-3 rms, 3 rms]``, 6 sigma wide, as Templar's
#: ``TopKCompressor`` (``quantization_range=6`` over ``quantization_bins``).
SIGMAS = 3.0
#: How a coordinate's sum over the workers becomes their mean: divided by all
#: ``n`` workers (SparseLoCo's Alg. 1) or by the workers that sent it
#: (Templar's ``scatter_reduce("mean", include_self=False)``).
MEANS = ("workers", "senders")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
  chunk: int | None = None,
  value_bits: int = 32,
  ef_decay: float = 1.0,
  per_leaf: bool = False,
  mean: str = "workers",
) -> optax.GradientTransformation:
  """Magnitude top-k with error feedback; payloads are all-gathered.

  Each worker keeps ``k = max(1, floor(ratio * d))`` coordinates of each leaf
  (exactly the k largest ``|e_i|``) and sends them as float32 values and int32
  indices; every worker scatter-adds all ``n * k`` pairs and divides by ``n``.

  .. math::
    e = \\beta r + g,\\quad S = \\operatorname{argtop}_k |e|,\\quad
    \\bar g = \\tfrac{1}{n}\\sum_w Q(e_w \\odot 1_{S_w}),\\quad
    r = e - Q(e \\odot 1_S)

  with :math:`\\beta` = ``ef_decay`` (1: today's error feedback) and
  :math:`Q` the identity unless ``value_bits`` quantises.

  **Chunks** (``chunk=C``; SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706,
  §3; Templar's ``src/tplr/compress/topk.py``). The leaf is cut into tiles as
  DeMo cuts it (``gradcomp.kernels.tiles``): viewed as a matrix (a vector is
  one row, a leaf of more dimensions ``(prod(shape[:-1]), shape[-1])``), each
  axis is cut by its largest divisor ``<= C``, so 64 x 64 tiles on a 2-D leaf
  with ``C = 64`` and chunks of 64 on a vector. Each tile keeps
  ``k = max(1, floor(ratio * tile size))`` values, and their positions
  travel within the tile as ``ceil(log2(tile size))``-bit codes packed end to
  end (``gradcomp.kernels.bitfields``): 12 bits on a 64 x 64 tile.
  ``chunk=None`` with quantised values is one tile per leaf.

  **Values** (``value_bits=b``, 1 to 8; 32: float32 as they are). Per tile,
  the kept values ``v`` are coded in ``2**b`` uniform bins over
  ``[-3 s, 3 s]``, ``s = sqrt(mean(v**2))`` (their RMS): with step
  ``h = 6 s / 2**b`` the code is ``clip(floor(v / h) + 2**(b-1), 0,
  2**b - 1)`` and decodes to the bin's centre ``(code - 2**(b-1) + 1/2) h``
  (values beyond 3 s go to the outer bins' centres). Every decoded value has
  the sign of its value. On the wire per tile: the ``k`` codes packed, and
  ``h`` as one float32 (the per-tile scale). With error feedback what the
  code missed stays in the memory (``r = e - Q(...)``). The paper's runs
  use 2 bits; Templar's code 8 bits (256 bins over 6 sigma). Both are
  ``value_bits`` here, with the same 6-sigma range; the readings of ours:
  statistics per tile (Templar: per tensor), about 0 (Templar subtracts the
  mean and sends it; top-k values of both signs have a mean near 0, and a
  code symmetric about 0 keeps every value's sign), decoded to bin centres
  (Templar sends a codebook of per-bin means: 256 floats per tensor at 8 bits).
  ``topk`` defaults to 32 (exact values, today's wire);
  ``gradcomp.schemes.sparseloco`` to 2, the paper's.

  **Mean.** Each worker's decoded payload counts ``1/n`` (the paper's Alg. 1,
  :math:`\\frac1R \\sum_r \\hat\\Delta_r`), also where fewer than ``n``
  workers sent a coordinate. ``mean="senders"`` is Templar's code instead
  (``scatter_reduce("mean", include_self=False)``): a coordinate's values
  are averaged over the workers that sent it, so one sent by a single worker
  arrives whole rather than at ``1/n``. The wire is the same; each receiver
  counts the senders from the positions it decodes. It is the tiled codec's
  (``chunk`` or quantised values), with the payloads gathered.

  **Wire** (bytes a worker sends per leaf, :func:`payload_bytes`): without
  ``chunk`` and ``value_bits``, ``k * (4 + 4)``; with them, for ``T`` tiles
  of ``P`` values, ``ceil(T k ceil(log2 P) / 8)`` bytes of positions and
  ``T k 4`` of float32 values, or ``ceil(T k b / 8) + 4 T`` quantised.

  Bad input: with error feedback NaN or Inf gradient coordinates are dropped
  by the memory (``memory.py``), so state and output stay finite; without it NaN or
  Inf coordinates can be selected and reach that step's output (nothing is
  stored). Finite values are sent exactly and divided by ``n`` before the
  workers' values are added, so their mean is finite. Quantised values
  decode to at most ``3 s`` in magnitude, saturated at the float32 maximum.

  Args:
    ratio: fraction of coordinates kept (of each tile with ``chunk``), in
      (0, 1].
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: keep what was not sent and add it to the next gradient.
    chunk: the side of a tile (the length of a vector's chunk), an integer
      >= 1, or ``None``: no tiles (the whole leaf).
    value_bits: bits per sent value, 1 to 8 (quantised with a per-tile
      scale), or 32 (float32).
    ef_decay: the error-feedback memory's decay :math:`\\beta` in [0, 1]
      (1: nothing forgotten); must be 1 without error feedback.
    per_leaf: select per layer under ``gradcomp.layerfusion`` too: each
      leaf of a fused group keeps its own ``k`` (and its own tiles), bit for
      bit as the layer-wise plan
      (``gradcomp.compressors.topk_groups.topk_per_leaf``, one segmented
      selection and one all-gather per group). ``False``: a fused group is
      one unit, its top ``k`` chosen across its leaves (the seed's fused
      top-k), unless ``chunk`` is set (tiles never straddle two leaves).
      Leaf by leaf, without fusion, both are the same compressor.
    mean: ``"workers"`` (divide by all ``n``) or ``"senders"`` (divide each
      coordinate by the workers that sent it; needs ``chunk`` or
      ``value_bits < 32`` and a named axis, not a server's pattern).

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: a hyper-parameter out of its range, naming it.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.topk(0.5)  # k = 2 of 4
    >>> update = jax.jit(tx.update)
    >>> g = {"w": jnp.array([0.5, -3.0, 1.5, 2.0])}
    >>> out, state = update(g, tx.init(g))
    >>> out["w"].tolist(), state.leaves["w"].residual.tolist()
    ([0.0, -3.0, 0.0, 2.0], [0.5, 0.0, 1.5, 0.0])
    >>> update(g, state)[0]["w"].tolist()  # e = r + g: 1.5 + 1.5 now beats 2.0
    [0.0, -3.0, 3.0, 0.0]

    Chunks of 2: the larger of each pair is kept.

    >>> tx = gradcomp.topk(0.5, chunk=2)
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [0.0, -3.0, 0.0, 2.0]

    On the wire, 8 workers each sending k = 16 of 64 coordinates as a float32
    value and an int32 index:

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = gradcomp.topk(0.25, axis_name="data")
    >>> step = jax.shard_map(
    ...   lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("data"), out_specs=P()
    ... )
    >>> g = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    >>> gradcomp.wire_bytes(step, g)  # bytes each worker sends: 16 * (4 + 4)
    128

    A 128 x 128 leaf in four 64 x 64 tiles, 64 values of each (1.56 %) in
    2 bits, positions in 12 bits, and a float32 scale per tile:

    >>> tx = gradcomp.topk(64 / 4096, chunk=64, value_bits=2, axis_name="data")
    >>> step = jax.shard_map(
    ...   lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("data"), out_specs=P()
    ... )
    >>> g = jax.ShapeDtypeStruct((8 * 128, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    >>> gradcomp.wire_bytes(step, g)  # 4 * 64 * 12 / 8 + 4 * 64 * 2 / 8 + 4 * 4
    464

  References:
    Paper 000 Table 1; Aji & Heafield, *Sparse communication for distributed
    gradient descent*, 2017 (paper 004 §4); Sarfi, Thérien, Lidin and
    Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
    2025, arXiv 2508.15706, §3 and Alg. 1; Templar,
    https://github.com/tplr-ai/templar (``src/tplr/compress/topk.py``).
  """
  if per_leaf is not True and per_leaf is not False:
    raise ValueError(f"per_leaf must be True or False, got {per_leaf!r}")
  if mean != "workers":  # recorded with ``mean``; the default's label is today's
    return _sender_mean_topk(
      ratio,
      axis_name=axis_name,
      error_feedback=error_feedback,
      chunk=chunk,
      value_bits=value_bits,
      ef_decay=ef_decay,
      per_leaf=per_leaf,
      mean=mean,
    )
  if per_leaf:
    return _per_leaf_topk(
      ratio,
      axis_name=axis_name,
      error_feedback=error_feedback,
      chunk=chunk,
      value_bits=value_bits,
      ef_decay=ef_decay,
      per_leaf=True,
    )
  if chunk is None and value_bits == 32 and ef_decay == 1.0:
    # Today's compressor, recorded with today's arguments (its label, which
    # profiles and plans carry, stays "topk(error_feedback=..., ratio=...)").
    return _flat_topk(ratio, axis_name=axis_name, error_feedback=error_feedback)
  return _tiled_topk(
    ratio,
    axis_name=axis_name,
    error_feedback=error_feedback,
    chunk=chunk,
    value_bits=value_bits,
    ef_decay=ef_decay,
  )


def _flat_topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
) -> optax.GradientTransformation:
  """:func:`topk` without tiles, quantisation or decay (its label is today's)."""
  return _build(ratio, axis_name, error_feedback, None, 32, 1.0)


def _tiled_topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
  chunk: int | None = None,
  value_bits: int = 32,
  ef_decay: float = 1.0,
) -> optax.GradientTransformation:
  """:func:`topk` with every argument."""
  return _build(ratio, axis_name, error_feedback, chunk, value_bits, ef_decay)


def _per_leaf_topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
  chunk: int | None = None,
  value_bits: int = 32,
  ef_decay: float = 1.0,
  per_leaf: bool = True,
) -> optax.GradientTransformation:
  """:func:`topk` with ``per_leaf=True``: recorded with it (the scope it declares)."""
  del per_leaf
  return _build(ratio, axis_name, error_feedback, chunk, value_bits, ef_decay)


def _sender_mean_topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
  chunk: int | None = None,
  value_bits: int = 32,
  ef_decay: float = 1.0,
  per_leaf: bool = False,
  mean: str = "senders",
) -> optax.GradientTransformation:
  """:func:`topk` with a ``mean`` other than the default: recorded with it."""
  del per_leaf  # layer-wise, per leaf either way; LayerFusion reads it back
  mean = check_mean(mean, axis_name, chunk, value_bits)
  return _build(ratio, axis_name, error_feedback, chunk, value_bits, ef_decay, mean)


# All recorded under the public name: spec_of(tx).name is "topk" either way,
# and spec_of(tx).build(axis_name=...) rebuilds through the same one.
_flat_topk.__name__ = _flat_topk.__qualname__ = "topk"
_tiled_topk.__name__ = _tiled_topk.__qualname__ = "topk"
_per_leaf_topk.__name__ = _per_leaf_topk.__qualname__ = "topk"
_sender_mean_topk.__name__ = _sender_mean_topk.__qualname__ = "topk"
_flat_topk = recorded(_flat_topk)
_tiled_topk = recorded(_tiled_topk)
_per_leaf_topk = recorded(_per_leaf_topk)
_sender_mean_topk = recorded(_sender_mean_topk)


def check_mean(mean, axis_name, chunk, value_bits) -> str:
  """``mean`` checked to be one of :data:`MEANS` that this codec can take.

  Raises:
    ValueError: another value; ``"senders"`` without tiles or quantised
      values, or with a server's pattern (whose receivers sum one payload at
      a time, so they cannot count a coordinate's senders).
  """
  if mean not in MEANS:
    raise ValueError(f"mean must be 'workers' or 'senders', got {mean!r}")
  if mean == "senders" and chunk is None and value_bits == 32:
    raise ValueError(
      "mean='senders' is the tiled codec's: set chunk or value_bits < 32 "
      "(got chunk=None, value_bits=32)"
    )
  if mean == "senders" and isinstance(axis_name, exchange.Pattern):
    raise ValueError(
      f"mean='senders' needs the workers' payloads gathered, got the pattern "
      f"{axis_name!r}"
    )
  return mean


def checked_arguments(ratio, error_feedback, chunk, value_bits, ef_decay):
  """``(ratio, chunk, value_bits, ef_decay)`` checked as :func:`topk` checks them.

  Raises:
    ValueError: a hyper-parameter out of its range, naming it.
  """
  ratio = checks.fraction("ratio", ratio)
  if chunk is not None:
    chunk = checks.at_least("chunk", chunk, 1)
  value_bits = check_value_bits(value_bits)
  ef_decay = memory.check_decay(ef_decay)
  if not error_feedback and ef_decay != 1.0:
    raise ValueError(
      f"ef_decay decays the error-feedback memory: it must be 1.0 with "
      f"error_feedback=False, got {ef_decay!r}"
    )
  return ratio, chunk, value_bits, ef_decay


def _build(
  ratio, axis_name, error_feedback, chunk, value_bits, ef_decay, mean="workers"
):
  """Validates the arguments and builds the transformation."""
  ratio, chunk, value_bits, ef_decay = checked_arguments(
    ratio, error_feedback, chunk, value_bits, ef_decay
  )
  return leafwise(
    topk_codec(ratio, axis_name, error_feedback, chunk, value_bits, ef_decay, mean)
  )


def topk_codec(
  ratio, axis_name, error_feedback, chunk, value_bits, ef_decay, mean="workers"
):
  """Top-k's codec of one leaf (checked arguments), with its memory when asked."""
  if chunk is None and value_bits == 32:
    apply = _flat_apply(ratio, axis_name)
  else:
    apply = _tiled_apply(ratio, axis_name, chunk, value_bits, mean)
  codec = LeafCodec(stateless_init, apply)
  return memory.maybe_error_feedback(codec, error_feedback, ef_decay)


def check_value_bits(value_bits) -> int:
  """``value_bits`` checked to be one of :data:`VALUE_BITS`."""
  if isinstance(value_bits, bool) or value_bits not in VALUE_BITS:
    raise ValueError(
      f"value_bits must be an integer in [1, 8] (quantised) or 32 (float32), "
      f"got {value_bits!r}"
    )
  return int(value_bits)


def index_bits(tile: int) -> int:
  """Bits of a position within a tile of ``tile`` values: ``ceil(log2(tile))``.

  Examples:
    >>> from gradcomp.compressors.topk import index_bits
    >>> index_bits(4096), index_bits(64), index_bits(50), index_bits(1)
    (12, 6, 6, 0)
  """
  return (tile - 1).bit_length()


def payload_bytes(
  shape: Sequence[int], ratio: float, chunk: int | None = None, value_bits: int = 32
) -> int:
  """Bytes one worker sends for a leaf of ``shape`` (see :func:`topk`'s *Wire*).

  Examples:
    A 128 x 128 matrix in four 64 x 64 tiles, 64 values of each: 12-bit
    positions and 2-bit codes, with a float32 scale per tile; the flat
    top-k of the same 256 values with int32 indices and float32 values:

    >>> from gradcomp.compressors.topk import payload_bytes
    >>> payload_bytes((128, 128), 64 / 4096, 64, 2), payload_bytes((128, 128), 64 / 4096)
    (464, 2048)
  """
  size = math.prod(shape)
  if size == 0:
    return 0
  if chunk is None and value_bits == 32:
    return checks.keep_count(ratio, size) * (4 + 4)
  h, w = tiles.tile_shape(shape, chunk)
  num = tiles.num_tiles(shape, chunk)
  count = num * checks.keep_count(ratio, h * w)
  positions = bitfields.packed_bytes(count, index_bits(h * w))
  if value_bits == 32:
    return positions + 4 * count
  return positions + bitfields.packed_bytes(count, value_bits) + 4 * num


def _flat_apply(ratio, axis_name):
  """Today's codec: the k largest of the whole leaf, float32 values, int32 indices."""

  def apply(x, state, key, step):
    del key, step
    flat = x.reshape(-1)
    k = checks.keep_count(ratio, flat.shape[0])
    values, indices = top_k_magnitude(flat, k)
    mean = sparse.gather_mean(values, indices, x.shape, axis_name)
    return mean, sparse.zero_at(x, indices, after=values), state

  return apply


def quantize(values: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """``(codes, step)``: each row of ``values`` in ``bits``-bit codes, its step.

  Row ``i``'s codes are ``clip(floor(v / h_i) + 2**(bits-1), 0, 2**bits - 1)``
  with ``h_i = 2 * SIGMAS * rms_i / 2**bits``. A row whose RMS is below
  float32's smallest normal number (zeros) has step 0 and codes
  ``2**(bits-1)``. Rows with values above ``2**60`` are scaled by ``2**-66``
  (exactly) for the RMS and the codes, so no finite row overflows a square
  or underflows a reciprocal (XLA:CPU flushes subnormals to zero).
  """
  levels = 2**bits
  per_rms = levels / (2 * SIGMAS)  # codes per RMS
  m = jnp.max(jnp.abs(values), axis=-1, keepdims=True)
  c = jnp.where(m > 2.0**60, 2.0**-66, 1.0)
  scaled = values * c
  rms = jnp.sqrt(jnp.mean(jnp.square(scaled), axis=-1, keepdims=True))  # times c
  ok = rms >= float(np.finfo(np.float32).tiny)
  z = jnp.where(ok, scaled / jnp.where(ok, rms, 1.0) * per_rms, 0.0)
  codes = jnp.clip(jnp.floor(z) + levels // 2, 0, levels - 1).astype(jnp.uint32)
  step = jnp.minimum(rms * (1.0 / per_rms) / c, _FLOAT32_MAX)
  step = jnp.where(ok, step, 0.0)[..., 0]
  return codes, step.astype(jnp.float32)


def dequantize(codes: jax.Array, step: jax.Array, bits: int) -> jax.Array:
  """Bin centres of :func:`quantize`'s codes: ``(code - 2**(bits-1) + 1/2) * step``."""
  centred = codes.astype(jnp.float32) - (2 ** (bits - 1) - 0.5)
  out = centred * step[..., None]
  return jnp.clip(out, -_FLOAT32_MAX, _FLOAT32_MAX)


def tiled_payload(t: jax.Array, positions: jax.Array, value_bits: int):
  """``(payload, sent)`` of one leaf's tiles ``t`` and chosen ``positions``.

  ``payload``: the packed positions (``index_bits`` each) and the float32
  values, or the packed ``value_bits`` codes and each tile's step; ``sent``:
  the values as the receivers decode them.
  """
  values = jnp.take_along_axis(t, positions, axis=-1)
  packed_positions = bitfields.pack(positions, index_bits(t.shape[1]))
  if value_bits == 32:
    return (packed_positions, values), values
  codes, steps = quantize(values, value_bits)
  sent = dequantize(codes, steps, value_bits)
  return (packed_positions, bitfields.pack(codes, value_bits), steps), sent


def tiled_decode(payload, num: int, size: int, k: int, value_bits: int):
  """``(flat positions in the tiled leaf, values)`` of one worker's payload."""
  where = bitfields.unpack(payload[0], index_bits(size), num * k)
  where = where.reshape(num, k).astype(jnp.int32)
  if value_bits == 32:
    got = payload[1]
  else:
    got = dequantize(
      bitfields.unpack(payload[1], value_bits, num * k).reshape(num, k),
      payload[2],
      value_bits,
    )
  flat = jnp.arange(num, dtype=jnp.int32)[:, None] * size + where
  return flat.reshape(-1), got.reshape(-1)


def tiled_dense(
  flat, got, n: int, shape, chunk, num: int, size: int, mean: str = "workers"
) -> jax.Array:
  """The leaf's dense sum of decoded ``(flat, got)`` pairs, each divided by ``n``.

  ``mean="senders"``: each divided by the number of pairs at its position
  instead (the workers that sent it; a worker's positions are distinct).
  Dividing before adding keeps the sum of finite values finite either way.
  """
  zeros = jnp.zeros((num * size,), jnp.float32)
  if mean == "senders":
    senders = zeros.at[flat].add(1.0)
    return tiles.from_tiles(zeros.at[flat].add(got / senders[flat]), shape, chunk)
  return tiles.from_tiles(zeros.at[flat].add(got * (1.0 / n)), shape, chunk)


def tiled_mean(
  payload, shape, chunk, num, size, k, value_bits, axis_name, mean="workers"
):
  """The leaf's mean over workers of their tiled payloads (gathered, decoded)."""

  def decode(*p):
    return tiled_decode(p, num, size, k, value_bits)

  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver
    return exchange.gathered_sum(
      payload,
      lambda *p: tiled_dense(*decode(*p), 1, shape, chunk, num, size),
      axis_name,
    )
  n = exchange.num_workers(axis_name)
  gathered = exchange.all_gather(payload, axis_name)
  flat, got = jax.vmap(decode)(*gathered)
  return tiled_dense(
    flat.reshape(-1), got.reshape(-1), n, shape, chunk, num, size, mean
  )


def _tiled_apply(ratio, axis_name, chunk, value_bits, mean="workers"):
  """The chunked codec: per tile, the top k, positions and values packed."""

  def apply(x, state, key, step):
    del key, step
    shape = x.shape
    t = tiles.to_tiles(x, chunk)
    num, size = t.shape
    k = checks.keep_count(ratio, size)
    if chunk is None:  # one tile: the fast exact selection over the leaf
      _, positions = top_k_magnitude(t[0], k)
      positions = positions[None]
    else:
      _, positions = jax.lax.top_k(jnp.abs(t), k)
    payload, sent = tiled_payload(t, positions, value_bits)
    out = tiled_mean(payload, shape, chunk, num, size, k, value_bits, axis_name, mean)
    rows = jnp.arange(num)[:, None]
    remainder = tiles.from_tiles(t.at[rows, positions].add(-sent), shape, chunk)
    return out, remainder, state

  return apply
