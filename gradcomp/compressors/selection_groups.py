"""Per-leaf selection inside a fused group: the shared layout, selection and exchange.

The sparsifiers' published forms choose a budget per layer: random-k's
``k = ratio * d`` (Stich et al. 2018), DGC's sampled threshold and ``k`` per
layer (Lin et al. 2018, §3.1), Strom's slots, and top-k where a user asks for
per-layer selection. ``gradcomp.layerfusion`` hands their per-leaf forms
(``randomk_groups``, ``dgc_groups``, ``topk_groups``,
``sparse_quantize_groups``) a tuple of groups, each a tuple of leaves; this
module holds what they share:

* :class:`GroupLayout`: where each leaf sits in its group's fused buffer (the
  state keeps the fused layout, one buffer per group, the leaves raveled and
  concatenated; a group of one leaf keeps the leaf's shape, as the fused form
  does);
* :func:`pieces_of` and :func:`join`: the memory's update ``e = r + g`` leaf
  by leaf, from slices of the fused state, joined into the new state once;
* :func:`alone`: a group of one leaf runs the layer-wise codec itself;
* :func:`segmented_top_k`: each leaf's own top ``k_j`` of the group, by the
  layer-wise plan's own selection on the leaf's slice, so each leaf gets the
  set the layer-wise plan gets, ties broken as it breaks them;
* :func:`gathered_means`: the whole group's payload, every leaf's float32
  values and int32 leaf-local indices, all-gathered as one int32 array (one
  collective per group, the layer-wise plan's bytes), then each leaf's mean
  scatter-added in the layer-wise plan's order (worker by worker), so the
  float32 sums are the same bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import exchange, sparse
from gradcomp.kernels import ordering


class GroupLayout(NamedTuple):
  """Static description of a group: each leaf's shape, size and offset.

  ``shape`` is the shape of the group's fused buffer: the leaf's own for a
  group of one leaf, ``(total,)`` otherwise.
  """

  shapes: tuple[tuple[int, ...], ...]
  sizes: tuple[int, ...]
  offsets: tuple[int, ...]
  total: int
  shape: tuple[int, ...]


def layout_of(leaves: Sequence) -> GroupLayout:
  """The :class:`GroupLayout` of a group's leaves (arrays or shape structs)."""
  shapes = tuple(tuple(int(d) for d in jnp.shape(x)) for x in leaves)
  sizes = tuple(math.prod(s) for s in shapes)
  offsets = tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))
  total = sum(sizes)
  shape = shapes[0] if len(shapes) == 1 else (total,)
  return GroupLayout(shapes, sizes, offsets, total, shape)


def flat_leaves(leaves: Sequence[jax.Array]) -> list[jax.Array]:
  """Each leaf raveled, in float32."""
  return [jnp.ravel(x).astype(jnp.float32) for x in leaves]


def pieces_of(
  state: jax.Array, layout: GroupLayout, g: Sequence[jax.Array], combine
) -> list[jax.Array]:
  """``combine(state_j, g_j)`` leaf by leaf, ``state_j`` a slice of the buffer.

  Leaf by leaf rather than on the concatenation of the leaves: XLA:CPU fuses
  a concatenation of a group's leaves into its consumers, a select over every
  leaf per value (random-k on the ResNet-50 gradient: 343 ms against 184 ms
  per call), and into every later slice of the result.
  """
  flat = state.reshape(-1)
  return [combine(piece(flat, layout, j), x) for j, x in enumerate(g)]


def alone(codec, leaf: jax.Array, state, key: jax.Array, step: jax.Array):
  """A group of one leaf: ``([mean], state)`` of the layer-wise codec itself.

  As ``leafwise`` applies it (an empty leaf is passed through, its state
  kept), so a plan of single-leaf groups runs the layer-wise program.
  """
  if leaf.size == 0:
    return [jnp.zeros(leaf.shape, jnp.float32)], state
  mean, _, new_state = codec.apply(leaf.astype(jnp.float32), state, key, step)
  return [mean], new_state


def each_group(updates, state, key: jax.Array, one_group: Callable):
  """``(outputs, state)`` of a per-leaf form: ``one_group`` on every group.

  ``one_group(group, s, first)`` takes a group's tuple of leaves, its state
  and the plan index of its first leaf, and returns ``(outputs, new_s)``;
  each new state is typed as varying like the old one, and the step count
  advances once, with ``key`` the compressor's next key.
  """
  outputs, states, first = [], [], 0
  for group, s in zip(updates, state.leaves, strict=True):
    out, new_s = one_group(tuple(group), s, first)
    outputs.append(tuple(out))
    states.append(exchange.vary_like(new_s, s))
    first += len(group)
  new_state = state._replace(
    count=optax.safe_increment(state.count), key=key, leaves=tuple(states)
  )
  return tuple(outputs), new_state


def join(
  pieces: Sequence[jax.Array], layout: GroupLayout, after: jax.Array | None = None
) -> jax.Array:
  """The leaves' 1-D pieces as the group's buffer (shaped as :attr:`shape`).

  ``after``: something computed from the selections that read the pieces.
  The joined buffer (written over the donated state it was sliced from) then
  waits for them (``kernels.ordering``; an integer ``+ 0`` on the bits, so
  every value, ``-0.0`` included, is kept): without it XLA:CPU copied the
  whole fused state for each leaf's selection (top-k per leaf on the
  ResNet-50 gradient: 5.1 s a call against 1.2 s; compile 290 s against 51 s).
  """
  if after is not None:
    zero = ordering.zero_after(after).astype(jnp.int32)
    pieces = [
      jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(p, jnp.int32) + zero, jnp.float32
      )
      for p in pieces
    ]
  if len(pieces) == 1:
    return pieces[0].reshape(layout.shape)
  return jnp.concatenate(pieces)


def zeros(leaves: Sequence, layout: GroupLayout) -> jax.Array:
  """float32 zeros shaped as the group's buffer (a leaf's: sharded like it)."""
  if len(leaves) == 1:
    return jnp.zeros_like(leaves[0], jnp.float32)
  return jnp.zeros(layout.shape, jnp.float32)


def piece(flat: jax.Array, layout: GroupLayout, j: int) -> jax.Array:
  """Leaf ``j``'s values in a flat view of the group's buffer (1-D)."""
  start = layout.offsets[j]
  return flat[start : start + layout.sizes[j]]


def split(flat: jax.Array, layout: GroupLayout) -> list[jax.Array]:
  """The group's buffer cut back into its leaves' shapes."""
  flat = flat.reshape(-1)
  return [piece(flat, layout, j).reshape(s) for j, s in enumerate(layout.shapes)]


def slot_offsets(layout: GroupLayout, ks: Sequence[int]) -> tuple[int, ...]:
  """Where each leaf's ``k_j`` slots start in the group's payload."""
  return tuple(int(o) for o in np.cumsum((0,) + tuple(ks[:-1])))


def group_indices(
  local: jax.Array, layout: GroupLayout, ks: Sequence[int]
) -> jax.Array:
  """Flat positions in the group's buffer of the leaves' local indices.

  ``local`` holds each leaf's ``k_j`` indices in leaf order; an empty slot
  (local index ``d_j``) maps to ``total``, past the buffer, so scatters with
  ``mode="drop"`` skip it as they skip ``d_j`` in the leaf.
  """
  offsets = np.repeat(np.asarray(layout.offsets, np.int32), ks)
  sizes = np.repeat(np.asarray(layout.sizes, np.int32), ks)
  return jnp.where(local < sizes, local + offsets, layout.total).astype(jnp.int32)


def segmented_top_k(
  pieces: Sequence[jax.Array],
  layout: GroupLayout,
  ks: Sequence[int],
  select: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """Each leaf's top ``k_j`` by magnitude, from its 1-D piece of the group.

  Every leaf runs ``select`` (the layer-wise plan's own selection) on its
  own slice, so it gets the layer-wise plan's set, order and ties. Leaves of
  one size are not stacked into one batched ``lax.top_k``: XLA:CPU lowers a
  batched ``top_k`` of a fused operand to a full sort of every row, which
  took ResNet-50's per-leaf top-k from 0.11 to 1.7 s (BUILD_NOTES, "What
  fusion may change"); a 1-D ``top_k`` stays its TopK kernel. Empty leaves
  have no slot.

  Args:
    pieces: each leaf's values, 1-D float32.
    layout: its :class:`GroupLayout`.
    ks: each leaf's static ``k_j`` (0 for an empty leaf).
    select: the layer-wise selection ``(x, k) -> (values, indices)``.

  Returns:
    ``(values, indices)`` of ``sum(ks)`` slots, leaf after leaf: each leaf's
    selected values and its *leaf-local* int32 indices.
  """
  values, indices = [], []
  for x, d, k in zip(pieces, layout.sizes, ks, strict=True):
    if d == 0:
      values.append(x)
      indices.append(jnp.zeros((0,), jnp.int32))
    else:
      v, i = select(x, k)
      values.append(v)
      indices.append(i.astype(jnp.int32))
  return jnp.concatenate(values), jnp.concatenate(indices)


def gathered_means(
  values: jax.Array,
  indices: jax.Array,
  layout: GroupLayout,
  ks: Sequence[int],
  axis_name: exchange.AxisName,
) -> list[jax.Array]:
  """Each leaf's dense mean over workers of its ``(values, local indices)``.

  One all-gather per group: the float32 values (bit-cast to int32) and the
  int32 indices travel as one array of ``2 sum(k_j)`` words, 8 bytes a slot
  as the layer-wise plan sends them. Each leaf's mean is
  ``sparse.scatter_mean`` of its slots over the workers, in worker order.

  Returns:
    The leaves' means, shaped like the leaves, float32.
  """
  total_k = int(sum(ks))
  starts = slot_offsets(layout, ks)
  payload = jnp.concatenate(
    [jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32), indices]
  )

  def means(words: jax.Array, n: int) -> list[jax.Array]:
    """Each leaf's mean from ``(workers, 2 K)`` payload words."""
    out = []
    for j, (shape, k) in enumerate(zip(layout.shapes, ks, strict=True)):
      if k == 0:
        out.append(jnp.zeros(shape, jnp.float32))
        continue
      s = starts[j]
      v = jax.lax.bitcast_convert_type(words[:, s : s + k], jnp.float32)
      i = words[:, total_k + s : total_k + s + k]
      out.append(sparse.scatter_mean(v, i, shape, n))
    return out

  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver

    def decode(words):
      return jnp.concatenate([m.reshape(-1) for m in means(words[None], 1)])

    return split(exchange.gathered_sum((payload,), decode, axis_name), layout)
  gathered = exchange.all_gather(payload, axis_name)
  return means(gathered, exchange.num_workers(axis_name))
