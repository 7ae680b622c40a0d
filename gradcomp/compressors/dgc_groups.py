"""Deep Gradient Compression per leaf on fused groups: one exchange per group.

DGC (Lin et al., ICLR 2018, §3) samples each layer's threshold and sends at
most ``k = density * d`` of the layer's coordinates; on a fused buffer the
threshold and the budget become one per group, another algorithm.
:func:`dgc_per_leaf` is what ``gradcomp.layerfusion`` runs for ``dgc``: it
receives a tuple of groups, each a tuple of leaves, and for each group

* clips each leaf on its own (§3.4, when ``clip_norm`` is set), then updates
  the momentum ``u`` and the velocity ``v`` of the whole group in one
  elementwise pass each (the state is laid out as the fused form's: one
  ``u`` and one ``v`` per group, the leaves raveled and concatenated);
* selects each leaf's coordinates from ``v`` with the leaf's own sampled
  threshold and ``k_j`` (``selection_groups.segmented_top_k``: each leaf by
  ``kernels.selection.threshold_top_k`` on its slice);
* all-gathers the whole group's values and indices as one array, scatter-adds
  each leaf's mean, and clears ``u`` and ``v`` where a coordinate was sent
  (momentum factor masking). Warm-up stages switch once per group.

Leaf for leaf this is ``dgc(ratio, ...)`` applied to the leaves on their own,
bit for bit, with the same bytes on the wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors import selection_groups as groups
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.dgc import (
  DGCLeafState,
  clipped,
  dgc_codec,
  sample_size,
  warmup_schedule,
)
from gradcomp.kernels.selection import threshold_top_k


def _group(leaves, state, step, hyper, axis_name):
  """One step of a group of leaves: ``(outputs per leaf, new state)``."""
  ratio, momentum, clip_norm, warmup_steps, sample_ratio = hyper
  layout = groups.layout_of(leaves)
  if layout.total == 0:
    return [jnp.zeros(s, jnp.float32) for s in layout.shapes], state
  n = exchange.num_workers(axis_name)
  g = [
    clipped(x.astype(jnp.float32), clip_norm, n).reshape(-1)
    if x.size
    else x.reshape(-1).astype(jnp.float32)
    for x in leaves
  ]
  # dgc.py's per-coordinate policy: u = m u + g, then v = v + u, leaf by leaf
  # from slices of the fused state (groups.pieces_of).
  u_pieces = groups.pieces_of(
    state.momentum, layout, g, lambda u, g: memory.corrected(momentum * u, g)
  )
  v_pieces = groups.pieces_of(state.velocity, layout, u_pieces, memory.corrected)
  densities, stage_steps = warmup_schedule(ratio, warmup_steps)

  def select(x, k):
    return threshold_top_k(x, k, sample_size(sample_ratio, x.shape[0]))

  def exchange_at(density):
    ks = [checks.keep_count(density, d) if d else 0 for d in layout.sizes]
    values, local = groups.segmented_top_k(v_pieces, layout, ks, select)
    means = groups.gathered_means(values, local, layout, ks, axis_name)
    return means, groups.group_indices(local, layout, ks)

  if len(densities) == 1:
    means, at = exchange_at(densities[0])
    after = at

    def clear(a):
      return sparse.zero_at(a, at)

  else:
    # Each stage has its own static payload; the stage is the same on every
    # worker and for every leaf, so the group takes one branch.
    def with_unsent_mask(density):
      def run():
        means, at = exchange_at(density)
        ones = jnp.ones(layout.shape, jnp.float32)
        return means, sparse.zero_at(ones, at)

      return run

    which = jnp.minimum(step // stage_steps, len(densities) - 1)
    means, unsent = jax.lax.switch(which, [with_unsent_mask(d) for d in densities])
    after = unsent

    def clear(a):
      return a * unsent

  # The new state waits for the selections that read the old (groups.join).
  u = groups.join(u_pieces, layout, after)
  v = groups.join(v_pieces, layout, after)
  remainder = clear(v)
  return means, DGCLeafState(momentum=clear(u), velocity=remainder)


def dgc_per_leaf(
  ratio: float,
  *,
  momentum: float = 0.9,
  axis_name: exchange.AxisName = None,
  clip_norm: float | None = None,
  warmup_steps: int = 0,
  sample_ratio: float = 0.01,
) -> optax.GradientTransformation:
  """``dgc(ratio, ...)`` on a tuple of groups of leaves, each leaf its own k.

  The update tree is ``(group_1, ..., group_y)``, each group a tuple of
  leaves (LayerFusion's plan). For leaf ``j`` of ``d_j`` values:

  .. math::
    u = m u + g,\\quad v = v + u,\\quad S_j = \\{i : |v_i| \\ge
    \\theta_j\\},\\ |S_j| \\le k_j,\\quad \\bar g_j = \\tfrac1n
    \\textstyle\\sum_w v_{w,j} \\odot 1_{S_{w,j}},\\quad u, v \\leftarrow
    u, v \\odot 1_{\\bar S}

  with ``theta_j`` the ``(1 - density)`` quantile of ``|v_j|`` on a
  systematic sample of the leaf and ``k_j = max(1, floor(density * d_j))``
  (Lin et al. 2018, §3.1-3.3). A group sends one all-gather of
  ``8 sum_j k_j`` bytes per worker. Hyper-parameters and bad-input behaviour
  are those of ``gradcomp.dgc``.

  Args:
    ratio: final density of each leaf, in (0, 1].
    momentum: ``m`` in [0, 1).
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    clip_norm: if set, each leaf clipped to ``clip_norm / sqrt(n)`` (§3.4).
    warmup_steps: the exponential warm-up's length (``dgc``'s), 0 for none.
    sample_ratio: fraction of each leaf sampled for its threshold, in (0, 1].

  Returns:
    An ``optax.GradientTransformation`` over a tuple of groups of leaves,
    returning float32 leaves in the same structure; its state is a
    :class:`~gradcomp.compressors.base.CompressorState` whose ``leaves`` hold
    one :class:`~gradcomp.compressors.dgc.DGCLeafState` per group (the
    group's fused ``u`` and ``v``).

  Raises:
    ValueError: a hyper-parameter out of its range, naming it.

  Examples:
    Two leaves in one group, one coordinate of each sent; the group's own
    top-2 would send 4.0 and -3.0:

    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.dgc_groups import dgc_per_leaf
    >>> groups = ((jnp.array([4.0, -3.0]), jnp.array([0.5, -1.0])),)
    >>> tx = dgc_per_leaf(0.5, momentum=0.5)
    >>> out, state = tx.update(groups, tx.init(groups))
    >>> [o.tolist() for o in out[0]], state.leaves[0].velocity.tolist()
    ([[4.0, 0.0], [0.0, -1.0]], [0.0, -3.0, 0.5, 0.0])

  References:
    Lin et al., *Deep Gradient Compression*, ICLR 2018, §3; paper 000 Table 1.
  """
  ratio = checks.fraction("ratio", ratio)
  momentum = checks.in_range("momentum", momentum, 0.0, 1.0)
  if clip_norm is not None:
    clip_norm = checks.positive("clip_norm", clip_norm)
  warmup_steps = checks.at_least("warmup_steps", warmup_steps, 0)
  sample_ratio = checks.fraction("sample_ratio", sample_ratio)
  hyper = (ratio, momentum, clip_norm, warmup_steps, sample_ratio)
  codec = dgc_codec(ratio, momentum, clip_norm, warmup_steps, sample_ratio, axis_name)

  def init_fn(params):
    key = jax.random.PRNGKey(0)
    _, key = jax.random.split(key)
    states = []
    for group in params:
      layout = groups.layout_of(group)
      # Two distinct buffers, so that the state can be donated.
      states.append(
        DGCLeafState(
          momentum=groups.zeros(tuple(group), layout),
          velocity=groups.zeros(tuple(group), layout),
        )
      )
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
      return _group(group, s, state.count, hyper, axis_name)

    return groups.each_group(updates, state, key, one_group)

  return optax.GradientTransformation(init_fn, update_fn)
