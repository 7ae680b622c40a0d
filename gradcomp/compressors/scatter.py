r"""Reduce-scatter exchanges: each worker owns a chunk, so link bytes stay ~2x the payload.

The all-gather exchange of a compressed payload sends it to ``n - 1`` peers;
a reduce-scatter form sends each peer only the chunk it owns, lets the owner
reduce and re-compress its chunk, and gathers the owners' results
(*exchanges that scale with workers*):

1. each worker splits its (error-compensated) flat values into ``n`` chunks
   of ``ceil(d / n)`` values (:func:`chunk_size`; the last padded with
   zeros), encodes each with its own scales, and keeps what the encoding
   lost (worker error);
2. one ``all_to_all`` delivers chunk ``j`` of every worker to worker ``j``;
3. the owner decodes and averages them (or sums a vote), adds its own server
   error, encodes the result again and keeps what that lost (server error);
4. one ``all_gather`` returns every owner's encoded chunk to everyone, who
   decode it.

:func:`two_stage` is that exchange for any :class:`ChunkCodec` (an encoding
of rows of chunks); :func:`scatter_codec` lifts it to a ``LeafCodec`` whose
state holds the server error (:class:`ServerErrorState`), the worker error
being the usual error-feedback memory around it (``memory.py``). Per-worker
payload bytes: the all-to-all's operand is ``n`` encoded chunks, the
all-gather's one, so a worker's *link* bytes are about ``(n - 1) / n`` of
its payload plus ``n - 1`` chunks, about twice the payload whatever ``n``
(an all-gathered payload crosses ``n - 1`` links).

:func:`onebit_allreduce` is this exchange with the scaled sign of 1-bit Adam
(Tang et al. 2021, "1-bit Adam", §4 and Alg. 1; DeepSpeed's
``compressed_allreduce``): :math:`C[x] = \operatorname{sign}(x)\,\|x\|_2 /
\sqrt{d}`, one bit per value and one float32 scale per chunk. The
compressors' ``exchange="scatter"`` forms (signSGD, EF-signSGD, 1-bit SGD,
QSGD, TernGrad, fixed point, dynamic fixed point, ``int_quantize``: ZeRO++'s
qgZ, Wang et al. 2023 §3) take the same path with their own codecs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gradcomp.compressors import exchange
from gradcomp.compressors.base import LeafCodec
from gradcomp.kernels import bits, hashing

#: The exchange forms a quantizing codec may take (its ``exchange=`` keyword).
FORMS = ("gather", "scatter")
#: Registered compressors with an ``exchange="scatter"`` form.
SCATTERED = (
  "dynamic_fixed_point",
  "ef_signsgd",
  "fixed_point",
  "int_quantize",
  "onebit_sgd",
  "qsgd",
  "signsgd",
  "terngrad",
)


def chunk_size(d: int, n: int) -> int:
  """Values per owner's chunk: ``ceil(d / n)`` (the last chunk padded)."""
  return -(-d // n)


def check_form(form, axis_name) -> str:
  """A factory's ``exchange`` argument, validated (a ``ValueError`` otherwise).

  The scatter form needs the whole group of workers (an ``all_to_all`` and an
  ``all_gather`` over ``axis_name``): a :class:`exchange.Pattern` (gossip
  neighbours, a server's pushes) cannot run it.
  """
  if form not in FORMS:
    raise ValueError(f"exchange must be one of {FORMS}, got {form!r}")
  if form == "scatter" and isinstance(axis_name, exchange.Pattern):
    raise ValueError(
      f"exchange='scatter' needs an all-to-all and an all-gather over all "
      f"workers, which {axis_name.what} ({axis_name!r}) cannot provide; use "
      f"exchange='gather' with it"
    )
  return form


class ChunkCodec(NamedTuple):
  """An encoding of rows of chunks, for :func:`two_stage`.

  Attributes:
    encode: ``encode(rows, counts, key) -> payload``. ``rows``: float32
      ``(m, c)``, each row a chunk whose first ``counts[i]`` values are real
      and the rest zero padding (``counts``: int32 ``(m,)``, at least 1);
      ``key``: a raw PRNG key for stochastic rounding. The payload is a
      tuple of arrays, each with the leading axis ``m`` (a row's payload is
      what crosses the wire for its chunk).
    decode: ``decode(payload, c) -> (m, c)`` float32 values.
    reduce: how the owner combines the ``n`` decoded chunks it received,
      ``(n, c) -> (c,)``; ``None`` for their mean (each divided by ``n``
      before the sum, so finite chunks have a finite mean).
    row_bytes: ``row_bytes(c) -> int``, the payload bytes of one chunk of
      ``c`` values (for wire-byte formulas, :func:`scatter_wire`).
  """

  encode: Callable[..., tuple]
  decode: Callable[..., jax.Array]
  reduce: Callable[[jax.Array], jax.Array] | None
  row_bytes: Callable[[int], int]


def _mean(decoded: jax.Array) -> jax.Array:
  # Unrolled adds of (c,) rows, each divided by n first (exchange.gathered_sum
  # says why not jnp.sum(axis=0)).
  n = decoded.shape[0]
  total = decoded[0] / n
  for w in range(1, n):
    total = total + decoded[w] / n
  return total


def _counts(d: int, n: int, c: int) -> jax.Array:
  """int32 real values in each of the ``n`` chunks (at least 1: a count divides)."""
  return jnp.asarray([max(min(c, d - j * c), 1) for j in range(n)], jnp.int32)


def stage_keys(key: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
  """``(worker's key, owner's key)``: independent streams for the two encodings.

  Both are derived from the worker's own stream (``exchange.worker_key``),
  so they differ between workers, and every owner re-encodes with
  randomness independent of every worker's first encoding.
  """
  own = exchange.worker_key(key, axis_name)
  return hashing.derive(own, 0), hashing.derive(own, 1)


def two_stage(
  y: jax.Array,
  server_error: jax.Array | None,
  codec: ChunkCodec,
  axis_name: exchange.AxisName,
  key: jax.Array | None = None,
):
  """The two-stage exchange of flat values ``y`` (module docstring).

  Args:
    y: this worker's flat float32 values, ``(d,)`` (error-compensated by
      the caller, if it keeps a worker error).
    server_error: what this worker's encoding *as an owner* lost last
      time, ``(d,)``, only its own chunk's entries in use; or ``None`` to
      keep no server error.
    codec: how chunks are encoded.
    axis_name: the workers' axis, or ``None`` on one device (``n = 1``: the
      worker is the owner of the one chunk).
    key: the step's PRNG key shared by all workers (stochastic codecs),
      or ``None``.

  Returns:
    ``(mean, sent, server_error)``: the decoded owners' chunks, ``(d,)``,
    the same on every worker; what this worker's own encoding decodes to,
    ``(d,)`` (``y - sent`` is the worker error); and the new server error
    (``None`` when none is kept). Where the owner's sum ``average +
    server_error`` is not finite (float32 overflow), the average is sent
    alone and the server error is kept as it was there.
  """
  d = y.shape[0]
  n = exchange.num_workers(axis_name)
  c = chunk_size(d, n)
  pad = n * c - d
  counts = _counts(d, n, c)
  if key is None:
    worker_key = owner_key = None
  else:
    worker_key, owner_key = stage_keys(key, axis_name)
  rows = jnp.pad(y, (0, pad)).reshape(n, c)
  payload = codec.encode(rows, counts, worker_key)
  sent = codec.decode(payload, c).reshape(-1)[:d]

  # Stage 2: the owner of chunk j gets every worker's chunk j.
  if axis_name is None:
    mine = 0
    received = exchange._on_one_device(payload)
  else:
    mine = jax.lax.axis_index(axis_name)
    received = jax.tree.map(
      lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True), payload
    )
  decoded = codec.decode(received, c)
  combined = _mean(decoded) if codec.reduce is None else codec.reduce(decoded)
  start = mine * c
  valid = start + jnp.arange(c) < d
  if server_error is None:
    z = jnp.where(valid, combined, 0.0)
  else:
    padded_error = jnp.pad(server_error, (0, pad))
    own_error = jax.lax.dynamic_slice(padded_error, (start,), (c,))
    z = combined + own_error
    fits = jnp.isfinite(z)
    z = jnp.where(valid, jnp.where(fits, z, combined), 0.0)
  own_count = jnp.minimum(c, jnp.maximum(d - start, 1))
  own_payload = codec.encode(z[None], own_count[None], owner_key)
  own_sent = codec.decode(own_payload, c)[0]
  if server_error is None:
    new_server_error = None
  else:
    lost = jnp.where(fits, z - own_sent, own_error)
    lost = jnp.where(jnp.isfinite(lost), lost, own_error)
    padded_error = jax.lax.dynamic_update_slice(padded_error, lost, (start,))
    new_server_error = padded_error[:d]

  # Stage 3: every owner's encoded chunk to everyone.
  gathered = exchange.all_gather(jax.tree.map(lambda a: a[0], own_payload), axis_name)
  mean = codec.decode(gathered, c).reshape(-1)[:d]
  return mean, sent, new_server_error


class ServerErrorState(NamedTuple):
  """Per-leaf state of a scatter form with server error feedback (per worker)."""

  # shape=(d,), float32 (d: the leaf's size): what this worker's re-encoding
  # of its owned chunk lost, kept at full size so the state's shape does not
  # depend on the number of workers; only the owned chunk's entries are in
  # use (train/elastic.py moves each to its chunk's new owner).
  error: jax.Array


def scatter_codec(
  codec: ChunkCodec, axis_name: exchange.AxisName, *, server_error: bool
) -> LeafCodec:
  """A ``LeafCodec`` exchanging each leaf, flattened, through :func:`two_stage`.

  Its remainder is the worker error (``x - sent``), which
  ``memory.error_feedback`` around it keeps; its own state is a
  :class:`ServerErrorState` when ``server_error``, else ``()``.
  """

  def init(leaf, key):
    del key
    if not server_error:
      return ()
    return ServerErrorState(jnp.zeros((math.prod(leaf.shape),), jnp.float32))

  def apply(x, state, key, step):
    del step
    flat = x.reshape(-1)
    error = state.error if server_error else None
    mean, sent, new_error = two_stage(flat, error, codec, axis_name, key)
    new_state = ServerErrorState(new_error) if server_error else state
    return mean.reshape(x.shape), (flat - sent).reshape(x.shape), new_state

  return LeafCodec(init, apply)


def scatter_wire(codec: ChunkCodec, d: int, n: int) -> dict[str, int]:
  """``{kind: bytes}`` one worker's :func:`two_stage` of ``d`` values puts on the wire.

  The all-to-all's operands (``n`` encoded chunks) and the all-gather's (the
  owner's one). On one worker XLA compiles the all-to-all away and keeps the
  (trivial) all-gather.
  """
  row = codec.row_bytes(chunk_size(d, n))
  return {"all-to-all": 0 if n == 1 else n * row, "all-gather": row}


def link_bytes(wire: dict[str, int], n: int) -> float:
  """Bytes one worker sends over links for ``wire`` (``gradcomp.sim``'s volumes).

  A ring all-gather forwards ``n - 1`` pieces, an all-to-all sends ``(n - 1)
  / n`` of its operand, an all-reduce ``2 (n - 1) / n`` of it
  (``sim.Cluster.exchange_seconds``).
  """
  factor = {
    "all-gather": n - 1,
    "all-to-all": (n - 1) / n,
    "reduce-scatter": (n - 1) / n,
    "all-reduce": 2 * (n - 1) / n,
    "collective-permute": 1,
  }
  return float(sum(factor[k] * b for k, b in wire.items()))


# -- 1-bit Adam's scaled sign ---------------------------------------------------


def sign_row_bytes(c: int) -> int:
  """Bytes of a chunk's sign words: ``4 ceil(c / 32)``."""
  return 4 * math.ceil(c / bits.WORD)


def sign_decode(words: jax.Array, c: int) -> jax.Array:
  """``(m, c)`` signs, +1.0 where a bit is set, -1.0 elsewhere."""
  return jnp.where(bits.unpack_words(words, c), 1.0, -1.0)


def _rms_encode(rows: jax.Array, counts, key):
  """Rows as ``(sign words, scale)``: ``sign(x) ||x|| / sqrt(count)`` per row.

  ``counts``: the real values per row (padding is zero and not counted). A
  value ``>= 0`` decodes to ``+scale``, a negative one to ``-scale``.
  """
  del key
  count = counts.astype(jnp.float32)
  words = bits.pack_words(rows >= 0)
  # Scale before the sum: each square is at most max|x|^2 / count after it.
  peak = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)
  safe = jnp.where(peak > 0, peak, 1.0)
  rms = jnp.sqrt(jnp.sum(jnp.square(rows / safe), axis=-1) / count) * safe[..., 0]
  return words, jnp.where(peak[..., 0] > 0, rms, 0.0)


def _scaled_sign_decode(payload, c: int) -> jax.Array:
  words, scale = payload
  return sign_decode(words, c) * scale[..., None]


#: 1-bit Adam's compression (Tang et al. 2021, §4): one bit per value, one
#: float32 scale ``||x||_2 / sqrt(count)`` per chunk.
ONEBIT = ChunkCodec(
  encode=_rms_encode,
  decode=_scaled_sign_decode,
  reduce=None,
  row_bytes=lambda c: sign_row_bytes(c) + 4,
)


def onebit_allreduce(x, worker_error, server_error, axis_name: exchange.AxisName):
  """The two-stage error-compensated 1-bit all-reduce of 1-bit Adam.

  :func:`two_stage` with :data:`ONEBIT`, the worker error added here.

  Args:
    x: this worker's flat float32 values, shape ``(d,)``.
    worker_error: what this worker's compression lost last time, ``(d,)``.
    server_error: what this worker's compression *as an owner* lost last
      time. Kept at full size ``(d,)``, only its chunk's entries in use, so
      the state's shape does not depend on the number of workers (and a
      run can move to another worker count with the errors where they are).
    axis_name: the workers' axis, or ``None`` on one device.

  Returns:
    ``(mean, worker_error, server_error)``: the decoded average, the same on
    every worker, and the new errors. Mass is conserved: the average over
    workers of ``x + worker_error``, plus the owners' ``server_error``
    (each on its own chunk), equals ``mean`` plus the same sums of the new
    errors, up to rounding.

  Scales are per chunk (an owner's re-compressed chunk, and each worker's
  chunk for each owner): DeepSpeed takes one scale per worker for the whole
  buffer; per chunk costs ``n`` floats more and follows each chunk's size.
  """
  y = x + worker_error
  mean, sent, new_server_error = two_stage(y, server_error, ONEBIT, axis_name)
  return mean, y - sent, new_server_error


def onebit_wire(d: int, n: int) -> dict[str, int]:
  """``{kind: bytes}`` one worker's :func:`onebit_allreduce` of ``d`` values puts on the wire.

  The all-to-all's operands (``n`` chunks of sign words and ``n`` scales)
  and the all-gather's (the owner's words and scale). On one worker XLA
  compiles the all-to-all away and keeps the (trivial) all-gather.
  """
  return scatter_wire(ONEBIT, d, n)


def onebit_payload_bytes(d: int, n: int) -> int:
  """Bytes one worker puts on the wire per exchange (:func:`onebit_wire`, summed)."""
  return sum(onebit_wire(d, n).values())
