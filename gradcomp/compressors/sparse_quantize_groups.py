"""Strom's threshold sparsification per leaf on fused groups: each leaf its slots.

``sparse_quantize`` (Strom 2015) gives each layer ``k = max(1, floor(
max_ratio * d))`` slots; on a fused buffer the slots become one budget per
group, shared by its leaves, another algorithm. :func:`sparse_quantize_per_leaf`
is what ``gradcomp.layerfusion`` runs for ``sparse_quantize``: for each group
it adds the residual in one fused buffer, selects each leaf's ``k_j``
candidates of largest ``|e|`` (``selection_groups.segmented_top_k``), codes
them as ``sparse_quantize.encode`` codes them (index, the sign in the top
bit, ``d_j`` for an empty slot), all-gathers the whole group's int32 codes in
one collective and scatter-adds each leaf's ``+-t / n``. Leaf for leaf this is
``sparse_quantize`` applied to the leaves on their own, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors import selection_groups as groups
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.sparse_quantize import (
  MAX_SIZE,
  decode_slots,
  sparse_quantize_codec,
)
from gradcomp.kernels.selection import top_k_magnitude


def _group(leaves, state, t, max_ratio, axis_name):
  """One step of a group: ``(outputs per leaf, new state)``."""
  layout = groups.layout_of(leaves)
  if layout.total == 0:
    return [jnp.zeros(s, jnp.float32) for s in layout.shapes], state
  for d in layout.sizes:
    if d > MAX_SIZE:
      raise ValueError(
        f"sparse_quantize encodes indices in 31 bits: a leaf of {d} elements "
        f"is larger than {MAX_SIZE}; split it"
      )
  pieces = groups.pieces_of(
    state.residual, layout, groups.flat_leaves(leaves), memory.corrected
  )
  ks = [checks.keep_count(max_ratio, d) if d else 0 for d in layout.sizes]
  values, local = groups.segmented_top_k(pieces, layout, ks, top_k_magnitude)
  empty = np.repeat(np.asarray(layout.sizes, np.int32), ks)
  codes = jnp.where(values < 0, ~local, local)
  codes = jnp.where(jnp.abs(values) >= t, codes, empty).astype(jnp.int32)
  starts = groups.slot_offsets(layout, ks)

  def means(gathered: jax.Array, n: int) -> list[jax.Array]:
    """Each leaf's mean from ``(workers, sum k_j)`` codes."""
    out = []
    for j, (shape, k) in enumerate(zip(layout.shapes, ks, strict=True)):
      if k == 0:
        out.append(jnp.zeros(shape, jnp.float32))
        continue
      v, i = decode_slots(gathered[:, starts[j] : starts[j] + k], t)
      out.append(sparse.scatter_mean(v, i, shape, n))
    return out

  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver

    def decode(row):
      return jnp.concatenate([m.reshape(-1) for m in means(row[None], 1)])

    dense = exchange.gathered_sum((codes,), decode, axis_name)
    outputs = groups.split(dense, layout)
  else:
    gathered = exchange.all_gather(codes, axis_name)
    outputs = means(gathered, exchange.num_workers(axis_name))
  # r = e - q at the slots only, in place (sparse_quantize's order).
  sent, at = decode_slots(codes, t)
  e = groups.join(pieces, layout, codes)
  remainder = sparse.add_at(e, groups.group_indices(at, layout, ks), -sent)
  return outputs, memory.ErrorFeedbackState(remainder, ())


def sparse_quantize_per_leaf(
  threshold: float,
  *,
  max_ratio: float = 0.01,
  axis_name: exchange.AxisName = None,
) -> optax.GradientTransformation:
  """``sparse_quantize(threshold, ...)`` on a tuple of groups, each leaf its slots.

  The update tree is ``(group_1, ..., group_y)``, each group a tuple of
  leaves (LayerFusion's plan). For leaf ``j``, with ``e = r + g``:

  .. math::
    S_j = \\{i : |e_i| \\ge t\\} \\cap \\operatorname{argtop}_{k_j} |e_j|,
    \\quad q_j = t \\operatorname{sign}(e_j) \\odot 1_{S_j},\\quad
    r_j = e_j - q_j,\\quad \\bar g_j = \\tfrac1n \\textstyle\\sum_w q_{w,j}

  with ``k_j = max(1, floor(max_ratio * d_j))`` (Strom 2015). A group sends
  one all-gather of ``4 sum_j k_j`` bytes per worker.

  Args:
    threshold: ``t > 0``.
    max_ratio: fraction of each leaf's coordinates that fit in its slots, in
      (0, 1].
    axis_name: the mapped axis of the workers, or ``None`` for one device.

  Returns:
    An ``optax.GradientTransformation`` over a tuple of groups of leaves; its
    state is a :class:`~gradcomp.compressors.base.CompressorState` whose
    ``leaves`` hold one ``ErrorFeedbackState`` per group (its fused residual).

  Raises:
    ValueError: ``threshold`` or ``max_ratio`` out of range (here), and at
      trace time a leaf of more than ``MAX_SIZE`` elements.

  Examples:
    One slot per leaf: the group's two largest would both be the first
    leaf's; per leaf, each sends its own:

    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.sparse_quantize_groups import (
    ...   sparse_quantize_per_leaf)
    >>> groups = ((jnp.array([2.5, -1.5]), jnp.array([0.25, -1.25])),)
    >>> tx = sparse_quantize_per_leaf(1.0, max_ratio=0.5)
    >>> out, state = tx.update(groups, tx.init(groups))
    >>> [o.tolist() for o in out[0]], state.leaves[0].residual.tolist()
    ([[1.0, 0.0], [0.0, -1.0]], [1.5, -1.5, 0.25, -0.25])

  References:
    Strom, Interspeech 2015 (survey 004 §4.2).
  """
  t = checks.positive("threshold", threshold)
  max_ratio = checks.fraction("max_ratio", max_ratio)
  codec = sparse_quantize_codec(t, max_ratio, axis_name)

  def init_fn(params):
    key = jax.random.PRNGKey(0)
    _, key = jax.random.split(key)
    states = []
    for group in params:
      zeros = groups.zeros(tuple(group), groups.layout_of(group))
      states.append(memory.ErrorFeedbackState(zeros, ()))
    return CompressorState(
      count=jnp.zeros([], jnp.int32), key=key, leaves=tuple(states)
    )

  def update_fn(updates, state, params=None):
    del params
    key, _ = jax.random.split(state.key)

    def one_group(group, s, first):
      del first
      if len(group) == 1:  # the layer-wise codec itself
        return groups.alone(codec, group[0], s, key, state.count)
      return _group(group, s, t, max_ratio, axis_name)

    return groups.each_group(updates, state, key, one_group)

  return optax.GradientTransformation(init_fn, update_fn)
