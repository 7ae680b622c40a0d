r"""Local SGD (periodic model averaging) and DiLoCo, with compressed pseudo-gradients.

Paper 004 §2.3 (model averaging: workers train alone and average their params
every few steps) and DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models", Alg. 1: the average
*pseudo-gradient* ``anchor - params`` feeds an outer optimizer, Nesterov SGD
in the paper). MaxText's ``diloco.py`` averages the pseudo-gradients in full
precision; here they go through any gradcomp compressor, whose error feedback
is kept across rounds, so what crosses the wire is the compressor's payload.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.parallel.branches import joined_cond
from gradcomp.schemes import base


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

  Returns:
    An ``optax.GradientTransformation`` with :class:`LocalSGDState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for ``every < 1`` or an ``inner``, ``outer`` or
      ``compressor`` that is not an optax transformation.

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
    Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020.
  """
  inner = base.transformation("inner", inner)
  every = checks.at_least("every", every, 1)
  outer = base.transformation("outer", outer, optional=True)
  compressor = base.transformation("compressor", compressor, optional=True)

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
      mean, compressor_state = compressor.update(pseudo_grads, compressor_state, anchor)
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
