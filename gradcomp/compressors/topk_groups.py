"""Top-k per leaf on fused groups: each leaf its own k, one exchange per group.

``gradcomp.topk`` on a fused buffer selects the group's top ``k`` globally
(the seed's fused top-k, paper 000; a per-buffer codec by design). A user
who asks for per-layer selection, ``topk(ratio, per_leaf=True)`` (Aji &
Heafield 2017 select per layer; so does the layer-wise plan), gets
:func:`topk_per_leaf` under ``gradcomp.layerfusion``: for each group it

* adds the error-feedback residual, one fused buffer per group (the state is
  laid out as the fused form's: one residual per group, the leaves raveled
  and concatenated);
* selects each leaf's ``k_j = max(1, floor(ratio * d_j))`` largest
  ``|e_i|`` from that buffer (``selection_groups.segmented_top_k``: each
  leaf by ``kernels.selection.top_k_magnitude`` on its slice);
* all-gathers the whole group's values and indices as one array and
  scatter-adds each leaf's mean (``selection_groups.gathered_means``).

Leaf for leaf this is ``topk(ratio)`` applied to the leaves on their own,
bit for bit (outputs, residuals and bytes on the wire): the same selected set
(ties broken as ``lax.top_k`` breaks them), the same values, and the same
float32 sums in the same order.

With ``chunk`` (SparseLoCo's tiles) or quantised ``value_bits``, each leaf is
tiled on its own (``kernels.tiles``), as the layer-wise plan tiles it: tiles
never straddle two leaves. Those forms run leaf by leaf inside the group's
program (their payload is per leaf: its packed positions and codes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors import selection_groups as groups
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.compressors.topk import (
  check_mean,
  checked_arguments,
  tiled_decode,
  tiled_dense,
  tiled_payload,
  topk_codec,
)
from gradcomp.kernels import hashing, tiles
from gradcomp.kernels.selection import top_k_magnitude


def _flat_group(leaves, state, ratio, decay, error_feedback, axis_name):
  """One step of a group of leaves: ``(outputs per leaf, new state)``."""
  layout = groups.layout_of(leaves)
  if layout.total == 0:
    return [jnp.zeros(x, jnp.float32) for x in layout.shapes], state
  pieces = groups.flat_leaves(leaves)
  if error_feedback:  # e = beta r + g leaf by leaf (groups.pieces_of)
    pieces = groups.pieces_of(
      state.residual,
      layout,
      pieces,
      lambda r, g: memory.corrected(r, g, decay),
    )
  ks = [checks.keep_count(ratio, d) if d else 0 for d in layout.sizes]
  values, local = groups.segmented_top_k(pieces, layout, ks, top_k_magnitude)
  means = groups.gathered_means(values, local, layout, ks, axis_name)
  if not error_feedback:
    return means, state
  at = groups.group_indices(local, layout, ks)
  remainder = sparse.zero_at(groups.join(pieces, layout, values), at, after=values)
  return means, ErrorFeedbackState(remainder, ())


def _tile_positions(tiled, ks, chunk):
  """Each leaf's chosen positions ``(tiles, k_j)`` in its tiles.

  With ``chunk``, a ``lax.top_k`` over each leaf's own tiles, the layer-wise
  call; without, each leaf is one tile selected by ``top_k_magnitude``. The
  tiles of several leaves are not concatenated into one call: XLA:CPU
  lowers a ``top_k`` of a concatenation to a full sort of every row (16x the
  layer-wise time on two 2048-wide matrices; BUILD_NOTES, "What fusion may
  change").
  """
  positions = [None] * len(tiled)
  for j, t in enumerate(tiled):
    if t is None:
      continue
    if chunk is None:
      positions[j] = top_k_magnitude(t[0], ks[j])[1][None]
    else:
      positions[j] = jax.lax.top_k(jnp.abs(t), ks[j])[1]
  return positions


def _to_bytes(a: jax.Array) -> jax.Array:
  """``a``'s bytes, raveled (uint8 as it is)."""
  if a.dtype == jnp.uint8:
    return a.reshape(-1)
  return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, like) -> jax.Array:
  """Inverse of :func:`_to_bytes` for ``like``'s shape and dtype, per worker row."""
  if like.dtype == jnp.uint8:
    return b.reshape(b.shape[0], *like.shape)
  width = jnp.dtype(like.dtype).itemsize
  words = b.reshape(b.shape[0], *like.shape, width)
  return jax.lax.bitcast_convert_type(words, like.dtype)


def _tiled_group(
  leaves, state, ratio, chunk, value_bits, decay, error_feedback, axis_name, mean
):
  """One step of a group, each leaf tiled on its own: ``(outputs, new state)``."""
  layout = groups.layout_of(leaves)
  if layout.total == 0:
    return [jnp.zeros(x, jnp.float32) for x in layout.shapes], state
  pieces = groups.flat_leaves(leaves)
  if error_feedback:
    pieces = groups.pieces_of(
      state.residual,
      layout,
      pieces,
      lambda r, g: memory.corrected(r, g, decay),
    )
  tiled = [
    tiles.to_tiles(x.reshape(shape), chunk) if x.size else None
    for x, shape in zip(pieces, layout.shapes, strict=True)
  ]
  ks = [0 if t is None else checks.keep_count(ratio, t.shape[1]) for t in tiled]
  positions = _tile_positions(tiled, ks, chunk)
  payloads, sents = [None] * len(tiled), [None] * len(tiled)
  for j, t in enumerate(tiled):
    if t is not None:
      payloads[j], sents[j] = tiled_payload(t, positions[j], value_bits)
  live = [j for j, t in enumerate(tiled) if t is not None]
  parts = [part for j in live for part in payloads[j]]
  sizes = [math.prod(p.shape) * jnp.dtype(p.dtype).itemsize for p in parts]
  starts = [int(x) for x in np.cumsum([0] + sizes)]
  words = jnp.concatenate([_to_bytes(p) for p in parts])

  def means(gathered: jax.Array, n: int) -> list[jax.Array]:
    """Each leaf's mean from ``(workers, bytes)`` (one collective's rows)."""
    out, at = [jnp.zeros(s, jnp.float32) for s in layout.shapes], 0
    for j in live:
      num, size = tiled[j].shape
      got = []
      for part in payloads[j]:
        got.append(_from_bytes(gathered[:, starts[at] : starts[at + 1]], part))
        at += 1
      pairs = jax.vmap(
        lambda *p, num=num, size=size, k=ks[j]: tiled_decode(
          p, num, size, k, value_bits
        )
      )(*got)
      where, values = (x.reshape(-1) for x in pairs)
      out[j] = tiled_dense(where, values, n, layout.shapes[j], chunk, num, size, mean)
    return out

  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver

    def decode(row):
      return jnp.concatenate([m.reshape(-1) for m in means(row[None], 1)])

    dense = exchange.gathered_sum((words,), decode, axis_name)
    outputs = groups.split(dense, layout)
  else:
    gathered = exchange.all_gather(words, axis_name)
    outputs = means(gathered, exchange.num_workers(axis_name))
  if not error_feedback:
    return outputs, state
  kept = []
  for j, t in enumerate(tiled):
    if t is None:
      continue
    rows = jnp.arange(t.shape[0])[:, None]
    left = t.at[rows, positions[j]].add(-sents[j])
    kept.append(tiles.from_tiles(left, layout.shapes[j], chunk).reshape(-1))
  remainder = groups.join(kept, layout, words)
  return outputs, ErrorFeedbackState(remainder, ())


def topk_per_leaf(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
  chunk: int | None = None,
  value_bits: int = 32,
  ef_decay: float = 1.0,
  per_leaf: bool = True,
  mean: str = "workers",
) -> optax.GradientTransformation:
  """``topk(ratio, ...)`` on a tuple of groups of leaves, each leaf its own k.

  The update tree is ``(group_1, ..., group_y)``, each group a tuple of
  leaves (LayerFusion's plan). For every leaf ``j`` of a group, with
  ``e = beta r + g`` (error feedback):

  .. math::
    S_j = \\operatorname{argtop}_{k_j} |e_j|,\\quad k_j = \\max(1,
    \\lfloor \\rho d_j \\rfloor),\\quad \\bar g_j = \\tfrac1n \\sum_w
    e_{w,j} \\odot 1_{S_{w,j}},\\quad r_j = e_j - e_j \\odot 1_{S_j}

  (paper 000 Table 1; Aji & Heafield 2017, per layer). A group sends one
  all-gather of ``8 sum_j k_j`` bytes per worker. Hyper-parameters and
  bad-input behaviour are those of ``gradcomp.topk``.

  Args:
    ratio: fraction of each leaf's coordinates kept, in (0, 1].
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: keep what was not sent and add it to the next gradient.
    chunk: ``topk``'s tile side (tiles of each leaf on its own), or ``None``.
    value_bits: ``topk``'s bits per sent value (32: float32).
    ef_decay: the memory's decay in [0, 1].
    per_leaf: recorded by ``topk``; the form is per leaf whatever its value.
    mean: ``topk``'s ``"workers"`` or ``"senders"`` (tiled codecs only).

  Returns:
    An ``optax.GradientTransformation`` over a tuple of groups of leaves,
    returning float32 leaves in the same structure; its state is a
    :class:`~gradcomp.compressors.base.CompressorState` whose ``leaves`` hold
    one ``ErrorFeedbackState`` per group (the group's fused residual), or
    ``()`` per group without error feedback.

  Raises:
    ValueError: a hyper-parameter out of its range, naming it.

  Examples:
    Two leaves in one group, half of each kept: the global top-2 of the
    group would take 4.0 and -3.0 from the first leaf; per leaf, each sends
    its own largest:

    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.topk_groups import topk_per_leaf
    >>> groups = ((jnp.array([4.0, -3.0]), jnp.array([0.5, -1.0])),)
    >>> tx = topk_per_leaf(0.5)
    >>> out, state = tx.update(groups, tx.init(groups))
    >>> [o.tolist() for o in out[0]], state.leaves[0].residual.tolist()
    ([[4.0, 0.0], [0.0, -1.0]], [0.0, -3.0, 0.5, 0.0])

  References:
    Paper 000 Table 1; Aji & Heafield, *Sparse communication for distributed
    gradient descent*, 2017; Sarfi et al. 2025, arXiv 2508.15706 (tiles).
  """
  ratio, chunk, value_bits, decay = checked_arguments(
    ratio, error_feedback, chunk, value_bits, ef_decay
  )
  mean = check_mean(mean, axis_name, chunk, value_bits)
  tiled = chunk is not None or value_bits != 32

  def init_fn(params):
    key = jax.random.PRNGKey(0)
    _, key = jax.random.split(key)
    states = []
    for group in params:
      layout = groups.layout_of(group)
      if error_feedback:
        states.append(ErrorFeedbackState(groups.zeros(tuple(group), layout), ()))
      else:
        states.append(())
    return CompressorState(
      count=jnp.zeros([], jnp.int32), key=key, leaves=tuple(states)
    )

  codec = topk_codec(ratio, axis_name, error_feedback, chunk, value_bits, decay, mean)

  def update_fn(updates, state, params=None):
    del params
    key, step_key = jax.random.split(state.key)

    def one_group(group, s, first):
      if len(group) == 1:  # the layer-wise codec itself
        key_j = hashing.derive(step_key, first)
        return groups.alone(codec, group[0], s, key_j, state.count)
      if tiled:
        return _tiled_group(
          group, s, ratio, chunk, value_bits, decay, error_feedback, axis_name, mean
        )
      return _flat_group(group, s, ratio, decay, error_feedback, axis_name)

    return groups.each_group(updates, state, key, one_group)

  return optax.GradientTransformation(init_fn, update_fn)
