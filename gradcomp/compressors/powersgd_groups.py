"""PowerSGD per leaf on fused groups: each leaf its own factors, one batch per shape.

PowerSGD's published form (Vogels, Karimireddy & Jaggi, NeurIPS
2019, Alg. 1-2) factorises each layer's own gradient matrix; a fused buffer of
many layers, reshaped to one near-square matrix, has no low-rank structure.
:func:`powersgd_per_leaf` is what ``gradcomp.layerfusion`` runs for
``powersgd``: it receives a tuple of *groups*, each a tuple of leaves (the
plan's groups), and for each group

* adds the error-feedback residual to the group's gradient in one fused
  buffer (the state is laid out as the seed's fused state: one residual per
  group, the leaves raveled and concatenated, so checkpoints and
  ``train/reshard.py`` see what they saw before);
* stacks the leaves of one matrix shape (:func:`~gradcomp.compressors.powersgd.
  matrix_shape`) and computes their ``P = M Q`` as one batched product and
  their orthogonalisation as one batched Householder QR in plain array ops
  (:func:`~gradcomp.compressors.powersgd.householder_columns`: LAPACK's
  batched QR deadlocks XLA:CPU's thread pool when several run at once)
  (PyTorch's PowerSGD hook,
  ``batch_tensors_with_same_shape``);
* all-reduces every ``P`` of the group together with its dense leaves (those
  :func:`~gradcomp.compressors.powersgd.goes_dense`) in one collective, then
  every ``Q`` of the group in a second;
* returns each leaf's ``P Q^T`` (or its dense mean) and keeps each leaf's ``Q``.

Leaf for leaf this is ``powersgd(rank)`` applied to the leaves on their own:
the same initial ``Q`` (leaf ``j`` of the plan's order draws from
``fold_in(init_key, j)``, as ``leafwise`` does for the layer-wise plan), the
same scalings and saturations; only the float32 summation order of the
batched products may differ (tests/test_fusion_semantics.py bounds it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState, corrected
from gradcomp.compressors.powersgd import (
  checked_vectors,
  factor_limit,
  goes_dense,
  headroom,
  householder_columns,
  matrix_shape,
  outer_product,
  transposed_product,
  unit_columns,
)
from gradcomp.kernels import numerics


class PowerSGDGroupState(NamedTuple):
  """The factors of one fused group.

  ``qs[c]``: ``(leaves, cols, rank)`` float32, the warm-start ``Q`` of every
  leaf of the group's ``c``-th matrix shape (in order of first appearance),
  identical on every worker.
  """

  qs: tuple[jax.Array, ...]


class _Layout(NamedTuple):
  """Static description of a group: which leaves share a matrix shape."""

  shapes: tuple[tuple[int, ...], ...]
  sizes: tuple[int, ...]
  offsets: tuple[int, ...]
  classes: tuple[tuple[tuple[int, int], tuple[int, ...]], ...]  # ((n, m), leaves)
  dense: tuple[int, ...]  # leaves all-reduced uncompressed


def _layout(shapes, rank: int, vectors: str) -> _Layout:
  shapes = tuple(tuple(int(d) for d in s) for s in shapes)
  sizes = tuple(math.prod(s) for s in shapes)
  offsets = tuple(sum(sizes[:k]) for k in range(len(sizes)))
  classes: dict[tuple[int, int], list[int]] = {}
  dense = []
  for k, shape in enumerate(shapes):
    if sizes[k] == 0:
      continue  # nothing to send; its output is empty
    if goes_dense(shape, rank, vectors):
      dense.append(k)
    else:
      classes.setdefault(matrix_shape(shape), []).append(k)
  return _Layout(
    shapes,
    sizes,
    offsets,
    tuple((nm, tuple(ks)) for nm, ks in classes.items()),
    tuple(dense),
  )


def _concat(parts: list[jax.Array]) -> jax.Array:
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _padded(x: jax.Array, size: int) -> jax.Array:
  return x if x.shape[0] == size else jnp.pad(x, (0, size - x.shape[0]))


def _split_flat(flat: jax.Array, arrays: list[jax.Array]) -> list[jax.Array]:
  """``flat`` cut into pieces shaped like ``arrays`` (inverse of raveling them)."""
  out, start = [], 0
  for a in arrays:
    out.append(flat[start : start + a.size].reshape(a.shape))
    start += a.size
  return out


def _transposed(matrix: jax.Array, p: jax.Array) -> jax.Array:
  """``M^T P`` of a ``(b, n, m)`` stack; a stack of one as its 2-D matrix.

  XLA:CPU runs the multiply-reduce of a batch of one 10-25x slower than the
  same reduction without the batch axis (GPT-2's 50257 x 768 embedding:
  916 vs 37 ms; BUILD_NOTES, "What fusion may change").
  """
  if matrix.shape[0] == 1:
    return transposed_product(matrix[0], p[0])[None]
  return transposed_product(matrix, p)


def _init_group(leaves, first: int, init_key, rank: int, vectors: str):
  layout = _layout([jnp.shape(x) for x in leaves], rank, vectors)
  qs = []
  for (_, m), ks in layout.classes:
    keys = [jax.random.fold_in(init_key, first + k) for k in ks]
    qs.append(
      jnp.stack([jax.random.normal(key, (m, rank), jnp.float32) for key in keys])
    )
  if len(leaves) == 1:
    residual = jnp.zeros_like(leaves[0], jnp.float32)  # sharded like the leaf
  else:
    residual = jnp.zeros((sum(layout.sizes),), jnp.float32)
  return ErrorFeedbackState(residual=residual, inner=PowerSGDGroupState(tuple(qs)))


def _update_group(leaves, state: ErrorFeedbackState, rank: int, vectors, axis_name):
  """One PowerSGD step of a group: ``(outputs per leaf, new state)``."""
  layout = _layout([x.shape for x in leaves], rank, vectors)
  # e = r + g leaf by leaf, from the slices of the fused residual: slicing a
  # concatenation of the group's leaves instead makes XLA:CPU fuse the
  # concatenation into every slice (a select over all the leaves per value).
  residual = state.residual.reshape(-1)
  pieces = [
    corrected(
      residual[layout.offsets[k] : layout.offsets[k] + layout.sizes[k]],
      jnp.ravel(x).astype(jnp.float32),
    )
    for k, x in enumerate(leaves)
  ]

  def piece(k):
    return pieces[k]

  # P = M Q per leaf, one batched product per matrix shape.
  matrices, ps = [], []
  for ((n, m), ks), q in zip(layout.classes, state.inner.qs, strict=True):
    # 1-D leaves of different sizes can share a near-square shape: each is
    # zero-padded to it on its own.
    if len(ks) == 1:  # a shape of its own: its matrix, no copy into a stack
      matrix = _padded(piece(ks[0]), n * m).reshape(1, n, m)
    else:
      rows = jnp.stack([_padded(piece(k), n * m) for k in ks])
      matrix = jax.lax.optimization_barrier(rows).reshape(len(ks), n, m)
    matrices.append(matrix)
    ps.append(matrix @ (unit_columns(q) * headroom(m)))
  dense = [piece(k) for k in layout.dense]
  # One all-reduce: every P of the group and its dense leaves.
  sent = [p.reshape(-1) for p in ps] + dense
  if not sent:
    return [jnp.zeros(x.shape, jnp.float32) for x in leaves], state
  reduced = _split_flat(exchange.all_reduce_mean(_concat(sent), axis_name), sent)
  ps, dense_means = reduced[: len(ps)], reduced[len(ps) :]
  # Q = M^T orth(P) per leaf, one batched Householder QR per matrix shape.
  p_hats, local_qs = [], []
  for ((n, _), _), matrix, p in zip(layout.classes, matrices, ps, strict=True):
    p_hat = householder_columns(p.reshape(matrix.shape[0], n, rank))
    p_hats.append(p_hat)
    local_qs.append(_transposed(matrix, p_hat * headroom(n)))
  new_qs = []
  if local_qs:
    flat_qs = [q.reshape(-1) for q in local_qs]
    reduced = exchange.all_reduce_mean(_concat(flat_qs), axis_name)
    limit = factor_limit(rank)
    for ((n, _), _), q in zip(
      layout.classes, _split_flat(reduced, local_qs), strict=True
    ):
      # Saturating the small factor bounds every entry of P Q^T by max / 2.
      new_qs.append(jnp.clip(q * (1.0 / headroom(n)), -limit, limit))
  # Each leaf's P Q^T, and its remainder e - P Q^T from its own e = r + g
  # (not from the stack: read from there, XLA:CPU stacked the leaves twice),
  # written into the group's residual in place; a dense leaf sent all of
  # itself (remainder 0).
  big = numerics.FLOAT32_MAX
  outputs: list[jax.Array | None] = [None] * len(leaves)
  kept: list[jax.Array | None] = [None] * len(leaves)
  for (_, ks), p_hat, q in zip(layout.classes, p_hats, new_qs, strict=True):
    for b, k in enumerate(ks):
      approx = outer_product(p_hat[b], q[b]).reshape(-1)[: layout.sizes[k]]
      outputs[k] = approx
      kept[k] = jnp.clip(pieces[k] - approx, -big, big)
  for k, mean in zip(layout.dense, dense_means, strict=True):
    outputs[k], kept[k] = mean, jnp.zeros_like(mean)
  for k, size in enumerate(layout.sizes):
    if size == 0:
      outputs[k] = kept[k] = jnp.zeros((0,), jnp.float32)
  if len(leaves) == 1:
    remainder = kept[0]
  else:
    # One in-place update per leaf: a concatenation of the group's leaves
    # makes XLA:CPU branch over all of them for every value it writes.
    remainder = residual
    for k, piece_k in enumerate(kept):
      if layout.sizes[k]:
        remainder = jax.lax.dynamic_update_slice(
          remainder, piece_k, (layout.offsets[k],)
        )
  new_state = ErrorFeedbackState(
    residual=remainder.reshape(state.residual.shape),
    inner=PowerSGDGroupState(tuple(new_qs)),
  )
  shaped = [o.reshape(s) for o, s in zip(outputs, layout.shapes, strict=True)]
  return shaped, new_state


def powersgd_per_leaf(
  rank: int = 4,
  *,
  seed: int = 0,
  axis_name: exchange.AxisName = None,
  vectors: str = "matrix",
) -> optax.GradientTransformation:
  """``powersgd(rank, ...)`` on a tuple of groups of leaves, batched per shape.

  The update tree is ``(group_1, ..., group_y)``, each group a tuple of leaves
  (LayerFusion's plan; any leaf shapes). For every leaf, seen as the matrix
  ``M`` of :func:`~gradcomp.compressors.powersgd.matrix_shape` with error
  feedback ``M = r + G``:

  .. math::
    P = \\overline{M Q},\\quad \\hat P = \\operatorname{orth}(P),\\quad
    Q = \\overline{M^\\top \\hat P},\\quad \\text{out} = \\hat P Q^\\top,
    \\quad r = M - \\hat P Q^\\top

  (Vogels et al. 2019, Alg. 1-2), the bars being means over workers. The
  leaves of a group with one matrix shape ``(n, m)`` are stacked to a
  ``(b, n, m)`` batch: ``M Q`` is one batched product, ``orth`` one batched
  Householder QR (:func:`~gradcomp.compressors.powersgd.householder_columns`)
  and ``M^T P`` one batched multiply-reduce. A group sends two all-reduces:
  its ``P``'s with its dense leaves, then its ``Q``'s. Hyper-parameters,
  scalings and bad-input behaviour are those of ``gradcomp.powersgd``.

  Args:
    rank: the rank ``r``, >= 1.
    seed: seeds the initial ``Q`` (leaf ``j`` of the flattened groups draws
      the ``Q`` that ``powersgd`` draws for leaf ``j`` of a layer-wise tree).
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    vectors: how 1-D leaves are sent (``powersgd``'s ``vectors``).

  Returns:
    An ``optax.GradientTransformation`` over a tuple of groups of leaves,
    returning float32 leaves in the same structure; its state is a
    :class:`~gradcomp.compressors.base.CompressorState` whose ``leaves`` hold
    one ``ErrorFeedbackState`` per group (the group's fused residual and a
    :class:`PowerSGDGroupState`).

  Raises:
    ValueError: ``rank`` below 1 or an unknown ``vectors``.

  Examples:
    Two 4 x 3 leaves of rank 1 and a bias in one group: the matrices share
    one batch and come back exactly, the bias goes dense:

    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors.powersgd_groups import powersgd_per_leaf
    >>> a = jnp.outer(jnp.arange(1.0, 5.0), jnp.array([1.0, -1.0, 2.0]))
    >>> groups = ((a, 2 * a, jnp.array([0.5, -0.5])),)
    >>> tx = powersgd_per_leaf(rank=1, vectors="dense")
    >>> out, state = tx.update(groups, tx.init(groups))
    >>> [q.shape for q in state.leaves[0].inner.qs]
    [(2, 3, 1)]
    >>> float(jnp.abs(out[0][1] - 2 * a).max()) < 1e-5, out[0][2].tolist()
    (True, [0.5, -0.5])

  References:
    Vogels et al., NeurIPS 2019, Alg. 1-2; PyTorch's
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``
    (``batch_tensors_with_same_shape``).
  """
  rank = checks.at_least("rank", rank, 1)
  vectors = checked_vectors(vectors)

  def init_fn(params):
    key = jax.random.PRNGKey(seed)
    init_key, key = jax.random.split(key)
    states, first = [], 0
    for group in params:
      states.append(_init_group(tuple(group), first, init_key, rank, vectors))
      first += len(group)
    return CompressorState(
      count=jnp.zeros([], jnp.int32), key=key, leaves=tuple(states)
    )

  def update_fn(updates, state, params=None):
    del params
    key, _ = jax.random.split(state.key)
    outputs, states = [], []
    for group, s in zip(updates, state.leaves, strict=True):
      out, new_s = _update_group(tuple(group), s, rank, vectors, axis_name)
      outputs.append(tuple(out))
      states.append(exchange.vary_like(new_s, s))
    new_state = CompressorState(
      count=optax.safe_increment(state.count), key=key, leaves=tuple(states)
    )
    return tuple(outputs), new_state

  return optax.GradientTransformation(init_fn, update_fn)
