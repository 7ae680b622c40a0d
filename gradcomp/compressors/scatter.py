r"""Reduce-scatter exchanges: each worker owns a chunk, so link bytes stay ~2x the payload.

The all-gather exchange of a compressed payload sends it to ``n - 1`` peers;
a reduce-scatter form sends each peer only the chunk it owns, lets the owner
reduce and re-compress its chunk, and gathers the owners' results:

1. each worker splits its (error-compensated) values into ``n`` chunks,
   compresses each, and keeps what the compression lost (worker error);
2. one ``all_to_all`` delivers chunk ``j`` of every worker to worker ``j``;
3. the owner decodes and averages them, adds its own server error,
   compresses the average again and keeps what that lost (server error);
4. one ``all_gather`` returns every owner's compressed chunk to everyone.

:func:`onebit_allreduce` is this exchange with the scaled sign of 1-bit Adam
(Tang et al. 2021, "1-bit Adam", §4 and Alg. 1; DeepSpeed's
``compressed_allreduce``): :math:`C[x] = \operatorname{sign}(x)\,\|x\|_2 /
\sqrt{d}`, one bit per value and one float32 scale per chunk. Shared here so
the other compressors' scatter forms (DESIGN §7) can take the same path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gradcomp.compressors import exchange
from gradcomp.kernels import bits


def chunk_size(d: int, n: int) -> int:
  """Values per owner's chunk: ``ceil(d / n)`` (the last chunk padded)."""
  return -(-d // n)


def _encode(x: jax.Array, count: jax.Array):
  """Rows of ``x`` as ``(sign words, scale)``: ``sign(x) ||x|| / sqrt(count)`` per row.

  ``count``: the real values per row (padding is zero and not counted). A
  value ``>= 0`` decodes to ``+scale``, a negative one to ``-scale``.
  """
  words = bits.pack_words(x >= 0)
  # Scale before the sum: each square is at most max|x|^2 / count after it.
  peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  safe = jnp.where(peak > 0, peak, 1.0)
  rms = jnp.sqrt(jnp.sum(jnp.square(x / safe), axis=-1) / count) * safe[..., 0]
  return words, jnp.where(peak[..., 0] > 0, rms, 0.0)


def _decode(words: jax.Array, scale: jax.Array, size: int) -> jax.Array:
  signs = jnp.where(bits.unpack_words(words, size), 1.0, -1.0)
  return signs * scale[..., None]


def onebit_allreduce(x, worker_error, server_error, axis_name: exchange.AxisName):
  """The two-stage error-compensated 1-bit all-reduce of 1-bit Adam.

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
  d = x.shape[0]
  n = exchange.num_workers(axis_name)
  c = chunk_size(d, n)
  pad = n * c - d
  counts = jnp.asarray([min(c, max(d - j * c, 0)) for j in range(n)], jnp.float32)
  counts = jnp.maximum(counts, 1.0)
  y = x + worker_error
  rows = jnp.pad(y, (0, pad)).reshape(n, c)
  words, scales = _encode(rows, counts)
  sent = _decode(words, scales, c).reshape(-1)[:d]
  new_worker_error = y - sent

  # Stage 2: the owner of chunk j gets every worker's chunk j.
  if axis_name is None:
    mine = 0
    words_in, scales_in = exchange._on_one_device((words, scales))
  else:
    mine = jax.lax.axis_index(axis_name)
    words_in = jax.lax.all_to_all(words, axis_name, 0, 0, tiled=True)
    scales_in = jax.lax.all_to_all(scales, axis_name, 0, 0, tiled=True)
  decoded = _decode(words_in, scales_in, c)
  average = decoded[0] / n
  for w in range(1, n):
    average = average + decoded[w] / n
  start = mine * c
  padded_error = jnp.pad(server_error, (0, pad))
  own_error = jax.lax.dynamic_slice(padded_error, (start,), (c,))
  valid = start + jnp.arange(c) < d
  z = jnp.where(valid, average + own_error, 0.0)
  own_count = jnp.maximum(jnp.minimum(c, d - start), 1).astype(jnp.float32)
  own_words, own_scale = _encode(z[None], own_count[None])
  own_sent = _decode(own_words, own_scale, c)[0]
  padded_error = jax.lax.dynamic_update_slice(padded_error, z - own_sent, (start,))
  new_server_error = padded_error[:d]

  # Stage 3: every owner's compressed chunk to everyone.
  gathered_words, gathered_scales = exchange.all_gather(
    (own_words[0], own_scale[0]), axis_name
  )
  mean = _decode(gathered_words, gathered_scales, c).reshape(-1)[:d]
  return mean, new_worker_error, new_server_error


def onebit_wire(d: int, n: int) -> dict[str, int]:
  """``{kind: bytes}`` one worker's :func:`onebit_allreduce` of ``d`` values puts on the wire.

  The all-to-all's operands (``n`` chunks of sign words and ``n`` scales)
  and the all-gather's (the owner's words and scale). On one worker XLA
  compiles the all-to-all away and keeps the (trivial) all-gather.
  """
  words = math.ceil(chunk_size(d, n) / bits.WORD)
  all_to_all = 0 if n == 1 else 4 * (n * words + n)
  return {"all-to-all": all_to_all, "all-gather": 4 * (words + 1)}


def onebit_payload_bytes(d: int, n: int) -> int:
  """Bytes one worker puts on the wire per exchange (:func:`onebit_wire`, summed)."""
  return sum(onebit_wire(d, n).values())
