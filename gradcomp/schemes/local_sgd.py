r"""Local SGD (periodic model averaging) and DiLoCo, with compressed pseudo-gradients.

Paper 004 §2.3 (model averaging: workers train alone and average their params
every few steps) and DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models", Alg. 1: the average
*pseudo-gradient* ``anchor - params`` feeds an outer optimizer, Nesterov SGD
in the paper). MaxText's ``diloco.py`` averages the pseudo-gradients in full
precision; here they go through any gradcomp compressor, whose error feedback
is kept across rounds, so what crosses the wire is the compressor's payload.
Its streaming form (fragments, overlap, eager updates) lives in
``streaming.py``; ``local_sgd`` stays the one entry point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.parallel.branches import joined_cond
from gradcomp.schemes import base, streaming
from gradcomp.schemes.streaming import StreamingState as StreamingState
from gradcomp.schemes.streaming import fragment_groups as fragment_groups


class LocalSGDState(NamedTuple):
  """State of :func:`local_sgd`.

  Attributes:
    count: shape=(), int32: local steps taken; replicated.
    inner_state: the local optimizer's state; per worker (it sees local
      gradients).
    anchor: the params every worker restarted from at the last round (the
      initial params before the first); replicated.
    compressor_state: the pseudo-gradient compressor's state (error-feedback
      residuals: per worker); ``optax.EmptyState()`` without a compressor.
    outer_state: the outer optimizer's state; replicated.
  """

  count: jax.Array
  inner_state: optax.OptState
  anchor: optax.Params
  compressor_state: optax.OptState
  outer_state: optax.OptState


def local_sgd(
  inner: optax.GradientTransformation,
  every: int,
  *,
  outer: optax.GradientTransformation | None = None,
  compressor: optax.GradientTransformation | None = None,
  axis_name: str | None = None,
  fragments: int | Sequence[Sequence[int]] = 1,
  overlap: int = 0,
  alpha: float = 0.0,
  eager: bool = False,
  order: Sequence[int] | None = None,
  split_leaves: bool = False,
) -> optax.GradientTransformation:
  r"""Local SGD: ``every`` local steps, then a round that restarts every worker from one anchor.

  Worker :math:`w` applies ``inner`` to its own gradients. After every
  ``every``-th step it sends its pseudo-gradient through ``compressor`` (the
  mean over workers of the decoded payloads) and ``outer``:

  .. math::

    \Delta_w = a - x_w, \qquad
    \bar\Delta = \mathrm{C}(\Delta_1, \dots, \Delta_n), \qquad
    a \leftarrow a + \mathrm{outer}(\bar\Delta), \qquad x_w \leftarrow a

  With ``outer=None`` the anchor moves by :math:`-\bar\Delta`; with
  ``compressor=None`` too that is the mean of the workers' params (periodic
  model averaging). With ``outer=optax.sgd(lr, momentum=0.9, nesterov=True)``
  it is DiLoCo (Alg. 1; the paper's outer learning rate is 0.7).

  **Reductions.** ``every=1`` without ``outer`` and ``compressor`` is
  synchronous SGD on the mean gradient, for any linear ``inner`` (plain or
  momentum SGD: the mean of the workers' momentum traces is the trace of the
  mean gradient): each step's params are :math:`\frac1n\sum_w (x + u_w) = x +
  \bar u`. One worker (``axis_name=None``) without ``outer`` and
  ``compressor`` is ``inner`` for any ``every`` (averaging one worker is the
  identity); ``outer=optax.sgd(1.0)`` is the same as ``outer=None``. On one
  worker, a non-trivial ``outer`` still acts (DiLoCo on one worker is
  Lookahead, Zhang et al. 2019) and so does a lossy compressor.

  **Exactness.** A round's update is ``anchor - params``, so the params after
  it equal the anchor up to the rounding of ``params + (anchor - params)``;
  the anchor itself is kept exactly in the state, so that rounding never
  accumulates.

  **Wire.** A round sends what ``compressor`` sends for the params' tree (the
  dense float mean without one); local steps send nothing. Amortised per
  step that is one ``every``-th of a round.

  **Streaming DiLoCo** (Douillard et al. 2025, arXiv 2501.18512).
  ``fragments=F`` splits the leaves into ``F`` groups of layers (see
  :func:`gradcomp.schemes.local_sgd.fragment_groups`: layer ``j`` in
  gradient-ready ``order`` goes to fragment ``j mod F``, the paper's strided
  pattern). Fragment :math:`f` sends at the steps where ``count % every ==
  f * every / F``; its round is the one above on its own leaves, with its
  own anchor entries, compressor state (error feedback) and outer state.
  ``overlap=tau`` applies what fragment :math:`f` sent at step :math:`t` at
  step :math:`t + \tau`, after :math:`\tau` more local steps, merged as

  .. math::

    \Delta_{w} = a_f - x_{w,f}(t), \qquad
    g_f = a_f + \mathrm{outer}(\mathrm{C}(\Delta_1, \dots, \Delta_n)), \qquad
    a_f \leftarrow g_f, \qquad
    x_{w,f}(t + \tau) \leftarrow \alpha\, x_{w,f}(t + \tau) + (1 - \alpha)\, g_f

  ``eager=True`` is Kale et al. 2025 (arXiv 2502.12996, Algorithm 3, the
  eager variant of the naive delayed Algorithm 2): at arrival each worker
  swaps its own stale term in the mean for its fresh pseudo-gradient,

  .. math::

    \tilde\Delta_w = \mathrm{C}(\Delta_1, \dots, \Delta_n)
      + \tfrac{1}{n}\big(\Delta_w^{\mathrm{fresh}} - \Delta_w\big), \qquad
    \Delta_w^{\mathrm{fresh}} = a_f - x_{w,f}(t + \tau),

  and applies ``outer`` to :math:`\tilde\Delta_w`. A step holds at most
  one event (a fragment's send, or its arrival), chosen by one
  ``lax.switch`` over ``1 + F`` branches (``1 + 2F`` with overlap), so
  each branch's collectives carry one fragment's leaves. With ``overlap >
  0`` the exchange runs at arrival on the pseudo-gradient kept in the
  state since the send: no operand of the collective depends on the
  arrival step's gradients or params, so it may run under that step's
  forward and backward pass (the paper's overlap, one step's compute deep).

  **Peak vs mean.** A step sends at most the largest fragment's payload, about
  ``1/F`` of a DiLoCo round; the mean per step is unchanged, one round's
  payload per ``every`` steps.

  **Readings of what the papers leave open.**

  - Steps count from 1: fragment 0 sends at multiples of ``every``, fragment
    :math:`f > 0` first at step :math:`f\,\mathrm{every}/F`; a send whose
    arrival falls after the last step never arrives.
  - ``overlap`` lies in :math:`[0, \mathrm{every}/F)`: one round of a
    fragment in flight at a time, and no step with two events (at
    :math:`\tau = \mathrm{every}/F` fragment :math:`f`'s arrival would
    meet fragment :math:`f+1`'s send). torchft's ``StreamingDiLoCo`` has the
    same bound.
  - After a merge with :math:`\alpha > 0` the anchor is the global value
    :math:`g_f`, not the merged params (as torchft and MaxText do): the next
    pseudo-gradient counts the local part the merge kept.
  - ``alpha`` applies whatever ``overlap`` is; with ``overlap=0`` and
    :math:`\alpha > 0` the round keeps :math:`\alpha` of the worker's params.
  - Kale et al. overlap a whole outer step; here the delay is ``overlap``
    inner steps within a round, and the fresh term is the pseudo-gradient
    at arrival. With ``overlap=0`` it equals the sent one, so ``eager`` does
    nothing (the code skips it). With eager updates the global values, and
    so the anchor and the outer state, differ between workers: each applies
    its own :math:`\tilde\Delta_w` to its own copy. The worker's own stale term is taken before compression
    (:math:`\Delta_w/n`), since a compressor returns only the mean; error
    feedback carries what its own payload missed.
  - ``order`` only orders the layers for the strided assignment; the
    rounds' schedule is by fragment index.
  - Memory: ``overlap > 0`` keeps one params-sized buffer per worker for the
    pseudo-gradient in flight.

  ``fragments=1, overlap=0, alpha=0.0, eager=False`` (the defaults) run the
  plain DiLoCo code above, bit for bit, with :class:`LocalSGDState`; any
  other setting (explicit groups included) uses
  :class:`gradcomp.schemes.streaming.StreamingState`.

  Args:
    inner: the worker's local optimizer (e.g. ``optax.sgd(0.1, momentum=0.9)``).
    every: local steps per round, >= 1.
    outer: optimizer applied to the mean pseudo-gradient at the anchor, or
      ``None`` for plain averaging.
    compressor: a gradcomp compressor built with the same ``axis_name``
      (``gradcomp.topk(0.01, axis_name="data")``); it receives each worker's
      pseudo-gradient and returns the mean of the decoded payloads, keeping
      its error feedback across rounds. ``None``: the dense mean.
    axis_name: the mapped axis of the workers, or ``None`` for one worker.
    fragments: the number of fragments ``F``, >= 1, dividing ``every``, at
      most the number of layers (checked at ``init``); or explicit groups of
      leaf indices that partition ``jax.tree.leaves(params)``.
    overlap: inner steps between a fragment's send and its arrival, an
      integer in ``[0, every / F)``.
    alpha: the local share of a merge, in [0, 1]; 0 replaces the fragment by
      its global value.
    eager: Kale et al.'s eager updates (only acts with ``overlap > 0``).
    order: leaf indices in gradient-ready order (e.g. from
      ``gradcomp.fusion.gradient_order``) for the strided assignment;
      ``None``: tree order.
    split_leaves: fragments of equal size that may split leaves
      (:func:`gradcomp.schemes.streaming.fragment_pieces`: the flattened
      params in ``order`` cut into equal chunks, strided over the
      fragments) instead of whole layers, so every step's peak bytes are
      ``1/F`` of a round even when one leaf is large. A fragment's
      compressor and outer optimizer then see a tuple of flat slices.
      Needs ``fragments`` an integer.

  Returns:
    An ``optax.GradientTransformation`` with :class:`LocalSGDState` (with
    the defaults) or ``StreamingState``; its ``update`` requires ``params``.

  Raises:
    ValueError: for ``every < 1``; an ``inner``, ``outer`` or
      ``compressor`` that is not an optax transformation; ``every`` not a
      multiple of ``fragments``; ``overlap``, ``alpha`` or ``eager`` out of
      range; at ``init``, ``fragments`` above the number of layers, groups
      that do not partition the leaves, or an ``order`` that is not a
      permutation of them.

  Examples:
    >>> import jax.numpy as jnp, optax, gradcomp
    >>> tx = gradcomp.local_sgd(optax.sgd(0.5), every=4)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> updates["w"].tolist()
    [-0.5, -0.5]

  References:
    Paper 004 §2.3; Douillard et al., 2023, arXiv 2311.08105, Alg. 1;
    Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020;
    Douillard et al., "Streaming DiLoCo with overlapping communication",
    2025, arXiv 2501.18512; Kale et al., "Eager Updates For Overlapped
    Communication and Computation in DiLoCo", 2025, arXiv 2502.12996,
    Algorithms 2-3.
  """
  inner = base.transformation("inner", inner)
  every = checks.at_least("every", every, 1)
  outer = base.transformation("outer", outer, optional=True)
  compressor = base.transformation("compressor", compressor, optional=True)
  _, overlap, alpha = streaming.check(every, fragments, overlap, alpha, eager)
  if not isinstance(split_leaves, bool):
    raise ValueError(f"split_leaves must be True or False, got {split_leaves!r}")
  if split_leaves and not isinstance(fragments, int):
    raise ValueError(
      "split_leaves=True needs fragments as an integer (the pieces are "
      f"computed), got explicit groups {fragments!r}"
    )
  if streaming.streams(fragments, overlap, alpha, eager):
    return streaming.streaming(
      inner,
      every,
      outer=outer,
      compressor=compressor,
      axis_name=axis_name,
      fragments=fragments,
      overlap=overlap,
      alpha=alpha,
      eager=eager,
      order=order,
      split_leaves=split_leaves,
    )

  def init_fn(params):
    return LocalSGDState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      anchor=base.copy_params(params),
      compressor_state=optax.EmptyState()
      if compressor is None
      else compressor.init(params),
      outer_state=optax.EmptyState() if outer is None else outer.init(params),
    )

  def round_(params, local, anchor, compressor_state, outer_state):
    pseudo_grads = jax.tree.map(jnp.subtract, anchor, local)
    if compressor is None:
      mean = exchange.all_reduce_mean(pseudo_grads, axis_name)
    else:
      # No params: a compressor reads none, and a per-worker anchor would look
      # like shards to its axis check (compressors/axes.py).
      mean, compressor_state = compressor.update(pseudo_grads, compressor_state, None)
    if outer is None:
      outer_updates = jax.tree.map(jnp.negative, mean)
    else:
      outer_updates, outer_state = outer.update(mean, outer_state, anchor)
    anchor = optax.apply_updates(anchor, outer_updates)
    updates = jax.tree.map(jnp.subtract, anchor, params)
    return updates, anchor, compressor_state, outer_state

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "local_sgd")
    inner_updates, inner_state = inner.update(grads, state.inner_state, params)
    local = optax.apply_updates(params, inner_updates)
    count = optax.safe_increment(state.count)

    def local_step(params, local, anchor, compressor_state, outer_state):
      del params, local
      return inner_updates, anchor, compressor_state, outer_state

    updates, anchor, compressor_state, outer_state = joined_cond(
      count % every == 0,
      round_,
      local_step,
      params,
      local,
      state.anchor,
      state.compressor_state,
      state.outer_state,
    )
    return updates, LocalSGDState(
      count, inner_state, anchor, compressor_state, outer_state
    )

  return optax.GradientTransformation(init_fn, update_fn)
