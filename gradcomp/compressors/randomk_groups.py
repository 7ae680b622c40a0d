"""Random-k per leaf on fused groups: each leaf its own k and its own draw.

Random-k's published form (Stich, Cordonnier & Jaggi, NeurIPS 2018) keeps
``k = ratio * d`` coordinates of each layer; on a fused buffer the budget
becomes one per group and the draw one per group, another algorithm.
:func:`randomk_per_leaf` is what ``gradcomp.layerfusion`` runs for
``randomk``: it receives a tuple of groups, each a tuple of leaves, and for
each group

* draws every leaf's ``k_j`` indices in one pass over the group's slots, leaf
  ``j`` of the plan's order from ``hashing.derive(step_key, j)`` as
  ``leafwise`` derives it for the layer-wise plan
  (:func:`group_shared_indices`: ``randomk.shared_indices`` of each leaf,
  integer for integer);
* gathers the group's ``sum_j k_j`` values of ``e = r + g`` and all-reduces
  them in one collective (the indices are shared: none cross the wire);
* keeps the rest in the group's fused residual.

Leaf for leaf this is ``randomk(ratio)`` applied to the leaves on their own,
bit for bit, with the same bytes on the wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors import selection_groups as groups
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.randomk import randomk_codec
from gradcomp.kernels import hashing, ordering


def group_shared_indices(
  step_key: jax.Array, layout: groups.GroupLayout, ks, first: int
) -> jax.Array:
  """Every leaf's ``randomk.shared_indices``, leaf after leaf, local to the leaf.

  Leaf ``j`` of the group is leaf ``first + j`` of the plan and draws from
  ``hashing.derive(step_key, first + j)``: one uniform offset in each of its
  ``k_j`` blocks of ``d_j // k_j``, the pattern rotated by a uniform shift.
  The hashes of all slots are one elementwise pass.
  """
  live = [j for j, k in enumerate(ks) if k]
  if not live:
    return jnp.zeros((0,), jnp.int32)
  counts = np.asarray([ks[j] for j in live])
  sizes = np.asarray([layout.sizes[j] for j in live])
  numbers = np.asarray([first + j for j in live], np.uint32)
  keys = hashing.derive(step_key[None, :], numbers[:, None])  # (leaves, 2)
  # Static gathers (each slot's leaf): jnp.repeat's running sum of the counts
  # was constant-folded by XLA, 30 s of compile on the ResNet-50 gradient.
  leaf_of_slot = np.repeat(np.arange(len(live), dtype=np.int32), counts)
  slot_keys = keys[leaf_of_slot]
  counter = np.concatenate([np.arange(k, dtype=np.uint32) for k in counts])
  blocks = np.repeat(sizes // counts, counts).astype(np.uint32)
  words = hashing.fmix32(
    hashing.fmix32(jnp.asarray(counter) ^ slot_keys[:, 0]) + slot_keys[:, 1]
  )
  offsets = (words % jnp.asarray(blocks)).astype(jnp.int32)
  shift_keys = hashing.derive(keys, 0)
  shift_words = hashing.fmix32(
    hashing.fmix32(jnp.uint32(0) ^ shift_keys[:, 0]) + shift_keys[:, 1]
  )
  shifts = (shift_words % jnp.asarray(sizes.astype(np.uint32))).astype(jnp.int32)
  slot_shifts = shifts[leaf_of_slot]
  starts = np.concatenate(
    [
      np.arange(k, dtype=np.int32) * np.int32(d // k)
      for k, d in zip(counts, sizes, strict=True)
    ]
  )
  slot_sizes = np.repeat(sizes, counts).astype(np.int32)
  return (jnp.asarray(starts) + offsets + slot_shifts) % jnp.asarray(slot_sizes)


def _group(leaves, state, first, step_key, step, ratio, error_feedback, axis_name):
  """One step of a group: ``(outputs per leaf, new state)``."""
  if len(leaves) == 1:
    codec = randomk_codec(ratio, axis_name, error_feedback)
    key = hashing.derive(step_key, first)
    return groups.alone(codec, leaves[0], state, key, step)
  layout = groups.layout_of(leaves)
  if layout.total == 0:
    return [jnp.zeros(x, jnp.float32) for x in layout.shapes], state
  ks = [checks.keep_count(ratio, d) if d else 0 for d in layout.sizes]
  local = group_shared_indices(step_key, layout, ks, first)
  starts = groups.slot_offsets(layout, ks)
  mine = [local[s : s + k] for s, k in zip(starts, ks, strict=True)]
  g = groups.flat_leaves(leaves)
  picked = jnp.concatenate(
    [sparse.gather_at(x, i) for x, i in zip(g, mine, strict=True)]
  )
  if error_feedback:
    # randomk's in-place policy (randomk.py), on the group's buffer: e = r + g
    # leaf by leaf from slices of the fused residual (groups.pieces_of).
    at = groups.group_indices(local, layout, ks)
    r = state.residual
    picked = memory.corrected(sparse.gather_at(r, at), picked)
    after = ordering.zero_after(picked)
    pieces = groups.pieces_of(
      r, layout, g, lambda rj, gj: memory.corrected(rj + after, gj)
    )
    residual = sparse.zero_at(groups.join(pieces, layout), at)
    picked = picked + ordering.zero_after(residual)
    state = memory.ErrorFeedbackState(residual, ())
  mean = exchange.all_reduce_mean(picked, axis_name)
  outputs = [
    sparse.scatter_into_zeros(mean[s : s + k], i, shape)
    for s, k, i, shape in zip(starts, ks, mine, layout.shapes, strict=True)
  ]
  return outputs, state


def randomk_per_leaf(
  ratio: float,
  *,
  seed: int = 0,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
) -> optax.GradientTransformation:
  """``randomk(ratio, ...)`` on a tuple of groups of leaves, each leaf its own k.

  The update tree is ``(group_1, ..., group_y)``, each group a tuple of
  leaves (LayerFusion's plan). For leaf ``j`` (of the plan's order) of ``d_j``
  values, with ``e = r + g``:

  .. math::
    S_j \\sim \\text{shared}(\\text{key}_j),\\ |S_j| = k_j = \\max(1,
    \\lfloor \\rho d_j \\rfloor),\\quad \\bar g_{S_j} = \\tfrac1n
    \\textstyle\\sum_w e_{w,S_j},\\quad r_j = e_j \\odot 1_{\\bar S_j}

  (Stich et al. 2018; paper 000 Table 1). A group sends one all-reduce of
  ``4 sum_j k_j`` bytes per worker. Hyper-parameters and bad-input behaviour
  are those of ``gradcomp.randomk``.

  Args:
    ratio: fraction of each leaf's coordinates kept, in (0, 1].
    seed: seeds the index stream (leaf ``j`` of the flattened groups draws
      what ``randomk`` draws for leaf ``j`` of a layer-wise tree).
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: keep the unsent coordinates for later steps.

  Returns:
    An ``optax.GradientTransformation`` over a tuple of groups of leaves,
    returning float32 leaves in the same structure; its state is a
    :class:`~gradcomp.compressors.base.CompressorState` whose ``leaves`` hold
    one ``ErrorFeedbackState`` per group (the group's fused residual), or
    ``()`` per group without error feedback.

  Raises:
    ValueError: ``ratio`` out of (0, 1].

  Examples:
    Two leaves in one group: each sends half of itself, as ``randomk`` sends
    from each leaf of a tree:

    >>> import jax.numpy as jnp, gradcomp
    >>> from gradcomp.compressors.randomk_groups import randomk_per_leaf
    >>> a, b = jnp.arange(1.0, 7.0), jnp.arange(10.0, 14.0)
    >>> tx = randomk_per_leaf(0.5)
    >>> out, _ = tx.update(((a, b),), tx.init(((a, b),)))
    >>> ref = gradcomp.randomk(0.5)
    >>> want, _ = ref.update((a, b), ref.init((a, b)))
    >>> [o.tolist() for o in out[0]] == [w.tolist() for w in want]
    True

  References:
    Stich, Cordonnier & Jaggi, *Sparsified SGD with memory*, NeurIPS 2018;
    paper 000 Table 1.
  """
  ratio = checks.fraction("ratio", ratio)

  def init_fn(params):
    key = jax.random.PRNGKey(seed)
    _, key = jax.random.split(key)
    states = []
    for group in params:
      layout = groups.layout_of(group)
      if error_feedback:
        zeros = groups.zeros(tuple(group), layout)
        states.append(memory.ErrorFeedbackState(zeros, ()))
      else:
        states.append(())
    return CompressorState(
      count=jnp.zeros([], jnp.int32), key=key, leaves=tuple(states)
    )

  def update_fn(updates, state, params=None):
    del params
    key, step_key = jax.random.split(state.key)
    if axis_name is not None:
      exchange._global_only(axis_name, "a key agreed (pmax)")
      step_key = jax.lax.pmax(step_key, axis_name)

    def one_group(group, s, first):
      return _group(
        group, s, first, step_key, state.count, ratio, error_feedback, axis_name
      )

    return groups.each_group(updates, state, key, one_group)

  return optax.GradientTransformation(init_fn, update_fn)
