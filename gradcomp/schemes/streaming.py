r"""Streaming DiLoCo and eager updates: the fragment schedule behind :func:`gradcomp.local_sgd`.

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"
(arXiv 2501.18512): the params are split into ``F`` fragments of layers whose
rounds are staggered over the ``H = every`` steps of a DiLoCo round, so a step
sends at most one fragment (peak bandwidth / F); a fragment's new global value
arrives ``tau`` inner steps after it was sent and is merged as
``alpha * local + (1 - alpha) * global``. Kale et al. 2025, "Eager Updates For
Overlapped Communication and Computation in DiLoCo" (arXiv 2502.12996,
Algorithm 3, against the naive delayed Algorithm 2): the worker's own, stale
contribution to the delayed average is replaced by its fresh one.

``local_sgd`` is the public entry point; this module holds the schedule, the
state and :func:`fragment_groups`. Cross-checked against two public
implementations of the same schedule (read, not copied): torchft's
``StreamingDiLoCo`` (``fragment_sync_delay < sync_every // F``, the merge
``lerp(global, local, fragment_update_alpha)``, the anchor set to the global
value before the merge) and MaxText's ``diloco.py`` (one ``lax.switch`` over
fragments, ``communication_overlapping_alpha``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.parallel.branches import varying_axes
from gradcomp.schemes import base

Groups = tuple[tuple[int, ...], ...]


class StreamingState(NamedTuple):
  """State of :func:`gradcomp.local_sgd` with fragments, overlap, alpha or eager.

  Attributes:
    count: shape=(), int32: local steps taken; replicated.
    inner_state: the local optimizer's state; per worker.
    anchor: the params tree: each fragment's global value after its last
      round (the initial params before its first); replicated, per worker
      with ``eager=True`` (each worker applies its own eager outer gradient).
    compressor_state: one compressor state per fragment, each made by
      ``compressor.init`` on the fragment's view (:func:`fragment_view`: the
      params tree with ``None`` at the other fragments' leaves, or with
      ``split_leaves`` the tuple of its flat pieces), so a round moves only
      its own fragment's error feedback; ``optax.EmptyState()`` entries
      without a compressor.
    outer_state: one outer-optimizer state per fragment, likewise;
      replicated (per worker with ``eager=True``).
    in_flight: the params tree: the pseudo-gradient each worker sent for the
      fragment now in flight, read when it arrives ``overlap`` steps later
      (one fragment at most is in flight); per worker.
      ``optax.EmptyState()`` with ``overlap=0``.
  """

  count: jax.Array
  inner_state: optax.OptState
  anchor: optax.Params
  compressor_state: tuple[optax.OptState, ...]
  outer_state: tuple[optax.OptState, ...]
  in_flight: optax.Params | optax.EmptyState


def fragment_groups(params, fragments, order: Sequence[int] | None = None) -> Groups:
  """The leaf indices of each fragment: layers assigned round-robin (strided).

  A *layer* is the set of leaves sharing a parent path (a leaf's key path
  minus its last key: a Dense's ``kernel`` and ``bias``; the top-level leaves
  of a dict are one layer). Layers are numbered by their first leaf in
  ``order`` (gradient-ready order, e.g. ``gradcomp.fusion.gradient_order``),
  or in tree order, and layer ``j`` goes to fragment ``j mod F``: Streaming
  DiLoCo's strided pattern, which spreads the layers of each depth over the
  fragments rather than giving each fragment a contiguous block.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    fragments: the number of fragments ``F`` (an integer in [1, number of
      layers]) or explicit groups: a sequence of non-empty sequences of leaf
      indices of ``jax.tree.leaves(params)`` that partition them.
    order: a permutation of the leaf indices, or ``None`` for tree order.

  Returns:
    ``F`` tuples of leaf indices, each sorted.

  Raises:
    ValueError: for an ``order`` that is not a permutation, ``F`` out of
      range, or groups that do not partition the leaves.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {f"l{i}": {"b": jnp.zeros(2), "w": jnp.zeros(3)} for i in range(4)}
    >>> fragment_groups(params, 2)  # layers l0 and l2, l1 and l3
    ((0, 1, 4, 5), (2, 3, 6, 7))
    >>> fragment_groups(params, 2, order=range(7, -1, -1))  # l3 first
    ((2, 3, 6, 7), (0, 1, 4, 5))
    >>> fragment_groups(params, [[0, 1, 2, 3], [4, 5, 6, 7]])
    ((0, 1, 2, 3), (4, 5, 6, 7))
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  n = len(paths)
  if not isinstance(fragments, int):
    return _partition(_explicit(fragments), n)
  order = _checked_order(order, n)
  layer_of: dict = {}
  for i in order:
    layer_of.setdefault(paths[int(i)][:-1], len(layer_of))
  layers = len(layer_of)
  if isinstance(fragments, bool) or not 1 <= fragments <= layers:
    raise ValueError(
      f"fragments must be an integer in [1, {layers}] (the number of layers: "
      f"leaves grouped by parent path), got {fragments!r}"
    )
  return tuple(
    tuple(i for i in range(n) if layer_of[paths[i][:-1]] % fragments == f)
    for f in range(fragments)
  )


Pieces = tuple[tuple[tuple[int, int, int], ...], ...]


def fragment_pieces(
  params, fragments: int, order: Sequence[int] | None = None
) -> Pieces:
  """Fragments of equal size that may split leaves: strided equal chunks.

  The leaves, flattened and laid end to end in ``order`` (gradient-ready
  order, or tree order), are cut into ``C = F ceil(L / F)`` chunks of equal
  size (``L`` layers, as :func:`fragment_groups` counts them) and chunk
  ``j`` goes to fragment ``j mod F``: the paper's strided pattern at the
  granularity of an average layer, with every fragment within ``C`` values
  of ``1/F`` of the params. Whole layers cannot do that when one leaf is
  large (GPT-2 small's tied embedding is 31 % of it), so the peak bytes of a
  step stay near ``1/F`` of a DiLoCo round.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    fragments: ``F``, an integer in [1, number of values].
    order: a permutation of the leaf indices, or ``None`` for tree order.

  Returns:
    ``F`` tuples of pieces ``(leaf, start, stop)``: the values ``start`` to
    ``stop`` of ``jax.tree.leaves(params)[leaf]`` flattened (row-major).

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"a": jnp.zeros(6), "b": jnp.zeros(2)}  # one layer
    >>> fragment_pieces(params, 2)  # chunks of 4: a[0:4] | a[4:6] b[0:2]
    (((0, 0, 4),), ((0, 4, 6), (1, 0, 2)))
  """
  leaves = jax.tree.leaves(params)
  sizes = [int(math.prod(x.shape)) for x in leaves]
  total = sum(sizes)
  if isinstance(fragments, bool) or not isinstance(fragments, int):
    raise ValueError(
      f"fragments must be an integer with split_leaves=True, got {fragments!r}"
    )
  if not 1 <= fragments <= total:
    raise ValueError(
      f"fragments must be an integer in [1, {total}] (the number of values) "
      f"with split_leaves=True, got {fragments!r}"
    )
  order = _checked_order(order, len(leaves))
  chunks = fragments * -(-_layers(params) // fragments)
  cuts = [round(j * total / chunks) for j in range(chunks + 1)]
  starts, offset = {}, 0  # each leaf's first value in the laid-out order
  for i in order:
    starts[i] = offset
    offset += sizes[i]
  pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(fragments)]
  for j in range(chunks):
    lo, hi = cuts[j], cuts[j + 1]
    for i in order:
      a, b = max(lo, starts[i]), min(hi, starts[i] + sizes[i])
      if a < b:
        pieces[j % fragments].append((i, a - starts[i], b - starts[i]))
  return tuple(tuple(p) for p in pieces)


def _checked_order(order, n: int) -> tuple[int, ...]:
  """``order`` as ints, a permutation of the ``n`` leaf indices (tree order if ``None``)."""
  order = tuple(range(n)) if order is None else tuple(order)
  if not all(map(_is_index, order)) or sorted(order) != list(range(n)):
    raise ValueError(
      f"order must be a permutation of the {n} leaf indices, got {order!r}"
    )
  return tuple(int(i) for i in order)


def _layers(params) -> int:
  """Layers: leaves grouped by parent path."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  return len({path[:-1] for path in paths})


def fragment_view(tree, fragment):
  """What a fragment's compressor and outer optimizer see of ``tree``.

  For a group of leaf indices, :func:`fragment_subtree`; for pieces
  (:func:`fragment_pieces`), the tuple of their flat slices (shapes only
  for ``jax.ShapeDtypeStruct`` leaves).
  """
  if _is_group(fragment):
    return fragment_subtree(tree, fragment)
  leaves = jax.tree.leaves(tree)

  def piece(i, a, b):
    x = leaves[i]
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((b - a,), x.dtype)
    return x.reshape(-1)[a:b]

  return tuple(piece(*p) for p in fragment)


def _put_view(tree, fragment, view):
  """``tree`` with the fragment's part replaced by ``view`` (:func:`fragment_view`'s form)."""
  if _is_group(fragment):
    return _put(tree, fragment, view)
  leaves, treedef = jax.tree.flatten(tree)
  for (i, a, b), x in zip(fragment, view, strict=True):
    # Concatenated, not ``.at[a:b].set``: XLA:CPU crashed (SIGSEGV, cold
    # compile only) on that in-place update inside the step's lax.switch.
    flat = leaves[i].reshape(-1)
    flat = jnp.concatenate([flat[:a], x.astype(flat.dtype), flat[b:]])
    leaves[i] = flat.reshape(leaves[i].shape)
  return treedef.unflatten(leaves)


def _is_group(fragment) -> bool:
  return all(map(_is_index, fragment))


def _is_index(i) -> bool:
  return isinstance(i, numbers.Integral) and not isinstance(i, bool)


def _explicit(fragments) -> Groups:
  """Explicit groups checked for form: non-empty sequences of integers."""
  ok = isinstance(fragments, Sequence) and not isinstance(fragments, str)
  ok = ok and len(fragments) > 0
  groups = []
  for group in fragments if ok else ():
    if not isinstance(group, Sequence) or isinstance(group, str) or not group:
      ok = False
      break
    if not all(map(_is_index, group)):
      ok = False
      break
    groups.append(tuple(sorted(int(i) for i in group)))
  if not ok:
    raise ValueError(
      "fragments must be an integer >= 1 or a non-empty sequence of non-empty "
      f"sequences of leaf indices, got {fragments!r}"
    )
  return tuple(groups)


def _partition(groups: Groups, n: int) -> Groups:
  flat = sorted(i for g in groups for i in g)
  if flat != list(range(n)):
    raise ValueError(
      f"fragments must partition the {n} leaf indices 0..{n - 1} (each in "
      f"exactly one group), got {[list(g) for g in groups]!r}"
    )
  return groups


def check(every: int, fragments, overlap, alpha, eager) -> tuple[int, int, float]:
  """The static streaming arguments validated: ``(F, overlap, alpha)``.

  Raises:
    ValueError: naming the argument, its value and the valid range.
  """
  count = len(_explicit(fragments)) if not isinstance(fragments, int) else fragments
  count = checks.at_least("fragments", count, 1)
  if every % count:
    raise ValueError(
      f"every must be a multiple of fragments (fragment f's rounds fall where "
      f"count % every == f * every / fragments): got every={every}, "
      f"fragments={count}"
    )
  spacing = every // count
  ok = isinstance(overlap, int) and not isinstance(overlap, bool)
  if not (ok and 0 <= overlap < spacing):
    raise ValueError(
      f"overlap must be an integer in [0, {spacing - 1}] (below every / fragments "
      f"= {every} / {count}: one round in flight, one event per step), got "
      f"{overlap!r}"
    )
  ok = isinstance(alpha, int | float) and not isinstance(alpha, bool)
  if not (ok and 0.0 <= alpha <= 1.0):
    raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
  if not isinstance(eager, bool):
    raise ValueError(f"eager must be True or False, got {eager!r}")
  return count, overlap, float(alpha)


def streams(
  fragments=1, overlap: int = 0, alpha: float = 0.0, eager: bool = False
) -> bool:
  """Whether these settings leave plain local SGD (then :func:`streaming` runs).

  Anything but one fragment (an int; explicit groups count), no overlap,
  ``alpha = 0`` and no eager updates.
  """
  one = isinstance(fragments, int) and fragments == 1
  return not one or bool(overlap) or bool(alpha) or bool(eager)


def fragment_subtree(tree, group: tuple[int, ...]):
  """``tree`` with ``None`` at every leaf outside ``group``: a fragment's subtree.

  What the fragment's compressor and outer optimizer see (``init`` and
  ``update``), and what the training program prices a fragment's round on.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keep = set(group)
  return treedef.unflatten([x if i in keep else None for i, x in enumerate(leaves)])


def _put(tree, group: tuple[int, ...], sub):
  """``tree`` with the leaves of ``group`` replaced by those of ``sub``."""
  leaves, treedef = jax.tree.flatten(tree)
  for i, x in zip(group, jax.tree.leaves(sub), strict=True):
    leaves[i] = x
  return treedef.unflatten(leaves)


def _vary(x, axes):
  """``x`` typed varying over the mesh ``axes`` too."""
  missing = tuple(sorted(axes - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _vary_like(x, like):
  """``x`` typed varying over every mesh axis ``like`` varies over."""
  return _vary(x, varying_axes(like))


def _joined_switch(index, branches, *operands):
  """``lax.switch`` whose branches may differ in the mesh axes their outputs vary over.

  Each output leaf is cast to the union of the axes it varies over in any
  branch, as ``gradcomp.parallel.branches.joined_cond`` does for two.
  """
  shapes = [jax.eval_shape(b, *operands) for b in branches]
  union = jax.tree.map(
    lambda *s: frozenset().union(*(varying_axes(x) for x in s)), *shapes
  )

  def joined(f):
    return lambda *ops: jax.tree.map(_vary, f(*ops), union)

  return jax.lax.switch(index, [joined(b) for b in branches], *operands)


def streaming(
  inner: optax.GradientTransformation,
  every: int,
  *,
  outer: optax.GradientTransformation | None,
  compressor: optax.GradientTransformation | None,
  axis_name,
  fragments,
  overlap: int,
  alpha: float,
  eager: bool,
  order: Sequence[int] | None,
  split_leaves: bool = False,
) -> optax.GradientTransformation:
  """Streaming DiLoCo; arguments as :func:`gradcomp.local_sgd`'s, already validated."""
  count_f = len(fragments) if not isinstance(fragments, int) else fragments
  spacing = every // count_f
  eager = eager and overlap > 0  # with tau = 0 the fresh gradient is the sent one

  def groups_of(params) -> Groups | Pieces:
    if split_leaves:
      return fragment_pieces(params, fragments, order)
    return fragment_groups(params, fragments, order)

  def init_fn(params):
    groups = groups_of(params)

    def zeros(p):
      return p if isinstance(p, jax.ShapeDtypeStruct) else jnp.zeros_like(p)

    def each(tx):
      if tx is None:
        return tuple(optax.EmptyState() for _ in groups)
      return tuple(tx.init(fragment_view(params, g)) for g in groups)

    return StreamingState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      anchor=base.copy_params(params),
      compressor_state=each(compressor),
      outer_state=each(outer),
      in_flight=jax.tree.map(zeros, params) if overlap else optax.EmptyState(),
    )

  def exchange_(f, group, sent, fresh, anchor, compressor_states, outer_states):
    """Fragment ``f``'s mean pseudo-gradient, outer step and new global value."""
    anchor_f = fragment_view(anchor, group)
    compressor_states, outer_states = list(compressor_states), list(outer_states)
    if compressor is None:
      mean = exchange.all_reduce_mean(sent, axis_name)
    else:
      # No params: see local_sgd (the compressors' axis check).
      mean, compressor_states[f] = compressor.update(sent, compressor_states[f], None)
    if eager:  # Kale et al. Alg. 3: own stale contribution -> own fresh one
      n = exchange.num_workers(axis_name)
      mean = jax.tree.map(lambda m, a, b: m + (a - b) / n, mean, fresh, sent)
    if outer is None:
      outer_updates = jax.tree.map(jnp.negative, mean)
    else:
      outer_updates, outer_states[f] = outer.update(mean, outer_states[f], anchor_f)
    global_f = optax.apply_updates(anchor_f, outer_updates)
    return global_f, tuple(compressor_states), tuple(outer_states)

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "local_sgd")
    groups = groups_of(params)
    inner_updates, inner_state = inner.update(grads, state.inner_state, params)
    local = optax.apply_updates(params, inner_updates)
    count = optax.safe_increment(state.count)

    def pseudo(anchor, group):
      return jax.tree.map(
        jnp.subtract, fragment_view(anchor, group), fragment_view(local, group)
      )

    def idle(params, anchor, compressor_states, outer_states, in_flight):
      del params
      return inner_updates, anchor, compressor_states, outer_states, in_flight

    def send(group, params, anchor, compressor_states, outer_states, in_flight):
      del params
      in_flight = _put_view(in_flight, group, pseudo(anchor, group))
      return inner_updates, anchor, compressor_states, outer_states, in_flight

    def arrive(f, group, params, anchor, compressor_states, outer_states, in_flight):
      # The round's operands: with overlap, the state alone (what was sent).
      fresh = pseudo(anchor, group) if eager or not overlap else None
      sent = fragment_view(in_flight, group) if overlap else fresh
      global_f, compressor_states, outer_states = exchange_(
        f, group, sent, fresh, anchor, compressor_states, outer_states
      )
      if alpha:
        merged = jax.tree.map(
          lambda x, g: alpha * x + (1 - alpha) * g,
          fragment_view(local, group),
          global_f,
        )
      else:
        merged = global_f
      moved = jax.tree.map(jnp.subtract, merged, fragment_view(params, group))
      updates = _put_view(inner_updates, group, moved)
      anchor = _put_view(anchor, group, global_f)
      return updates, anchor, compressor_states, outer_states, in_flight

    arrivals = [functools.partial(arrive, f, g) for f, g in enumerate(groups)]
    if overlap:
      sends = [functools.partial(send, g) for g in groups]
      branches = [idle, *sends, *arrivals]
    else:
      branches = [idle, *arrivals]
    index = _event(count, every, spacing, overlap, count_f)
    in_flight = state.in_flight
    if overlap:  # per worker, as what it holds: zeros from init are typed replicated
      in_flight = jax.tree.map(_vary_like, in_flight, local)
    updates, anchor, compressor_states, outer_states, in_flight = _joined_switch(
      index,
      branches,
      params,
      state.anchor,
      state.compressor_state,
      state.outer_state,
      in_flight,
    )
    return updates, StreamingState(
      count, inner_state, anchor, compressor_states, outer_states, in_flight
    )

  return optax.GradientTransformation(init_fn, update_fn)


def _event(count, every: int, spacing: int, overlap: int, fragments: int):
  """The branch due at step ``count``: 0 none, ``1 + f`` fragment f's send.

  With ``overlap = 0`` the send is the whole round. Otherwise ``1 + F + f`` is
  fragment f's arrival, ``overlap`` steps after its send at ``count % every ==
  f * spacing``; a send and an arrival never share a step (``0 < overlap <
  spacing``), and nothing arrives before the first send.
  """
  phase = count % every
  index = jnp.where(phase % spacing == 0, 1 + phase // spacing, 0)
  if overlap:
    sent_at = count - overlap
    phase = sent_at % every
    due = (sent_at >= 1) & (phase % spacing == 0)
    index = jnp.where(due, 1 + fragments + phase // spacing, index)
  return index
