r"""Synchronous Elastic Averaging SGD (EASGD).

Paper 004 §2.3, eq. 2: each worker minimises its loss plus an elastic
penalty :math:`\frac\rho2 \|x_w - \tilde x\|^2` tying it to a centre variable
:math:`\tilde x`. The update is the synchronous EASGD of Zhang, Choromanska
and LeCun (2015, "Deep learning with Elastic Averaging SGD", eqs. 5-6, with
the communication period :math:`\tau` of their Alg. 1), with
:math:`\alpha = \eta\rho`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.parallel.branches import joined_cond
from gradcomp.schemes import base


class EASGDState(NamedTuple):
  """State of :func:`easgd`.

  Attributes:
    count: shape=(), int32: steps taken; replicated.
    inner_state: the local optimizer's state; per worker.
    center: the centre variable :math:`\\tilde x` (the initial params at
      first); replicated.
  """

  count: jax.Array
  inner_state: optax.OptState
  center: optax.Params


def easgd(
  inner: optax.GradientTransformation,
  alpha: float,
  *,
  every: int = 1,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  r"""Synchronous EASGD: an elastic force between each worker and a centre variable.

  On an elastic step (``count % every == 0``, so the first step is one), with
  :math:`u_w` the update of ``inner`` at the worker's params :math:`x_w`:

  .. math::

    x_w \leftarrow x_w + u_w - \alpha (x_w - \tilde x), \qquad
    \tilde x \leftarrow \tilde x + \alpha \sum_{w=1}^n (x_w - \tilde x)

  both at the old :math:`x_w, \tilde x` (one all-reduce of the params); other
  steps are ``inner`` alone. The centre moves by :math:`\beta = n\alpha` of
  the way to the workers' mean, which must be at most 1 (Zhang et al. §3
  choose :math:`\beta = 0.9`): ``alpha`` lies in ``[0, 1/n]``, checked when
  ``n`` is known (at trace time).

  **Reductions.** ``alpha=0`` is independent local training (``inner`` on
  every worker, no exchange used); one worker (``axis_name=None``) with
  ``alpha=0`` is ``inner``. No setting is synchronous SGD on the mean
  gradient: the elastic force pulls workers towards a centre that lags their
  mean (with :math:`\beta = 1` the centre is last step's mean, but the workers
  move only :math:`\alpha = 1/n` of the way to it). The closest is local SGD
  (:func:`~gradcomp.local_sgd` with ``every=1``).

  **Wire.** One dense all-reduce of the params per elastic step.

  Args:
    inner: the worker's local optimizer.
    alpha: the moving rate :math:`\alpha = \eta\rho`, in ``[0, 1/n]``.
    every: steps between elastic steps (:math:`\tau`), >= 1.
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`EASGDState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for ``alpha`` outside ``[0, 1]`` (or ``[0, 1/n]`` on ``n``
      workers, at trace time), ``every < 1``, or an ``inner`` that is not an
      optax transformation.

  Examples:
    >>> import jax.numpy as jnp, optax, gradcomp
    >>> tx = gradcomp.easgd(optax.sgd(0.5), alpha=0.5)
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"].tolist()
    [-0.5, -0.5]

  References:
    Paper 004 §2.3, eq. 2; Zhang, Choromanska, LeCun, NeurIPS 2015,
    arXiv 1412.6651, eqs. 5-6 and Alg. 1.
  """
  inner = base.transformation("inner", inner)
  every = checks.at_least("every", every, 1)
  if (
    isinstance(alpha, bool)
    or not isinstance(alpha, (int, float))
    or not 0.0 <= alpha <= 1.0
  ):
    raise ValueError(
      f"alpha must be a number in [0, 1/workers] (at most [0, 1]), got {alpha!r}"
    )
  alpha = float(alpha)

  def init_fn(params):
    return EASGDState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      center=base.copy_params(params),
    )

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "easgd")
    n = exchange.num_workers(axis_name)
    if alpha * n > 1.0:
      raise ValueError(
        f"alpha must be in [0, 1/workers] = [0, {1 / n:.6g}] on {n} workers "
        f"(the centre moves n * alpha of the way to the mean), got {alpha!r}"
      )
    inner_updates, inner_state = inner.update(grads, state.inner_state, params)

    def elastic(params, center):
      diff = jax.tree.map(jnp.subtract, params, center)
      mean_diff = exchange.all_reduce_mean(diff, axis_name)
      updates = jax.tree.map(
        lambda u, d: (u - alpha * d).astype(u.dtype), inner_updates, diff
      )
      center = jax.tree.map(
        lambda c, m: (c + (alpha * n) * m).astype(c.dtype), center, mean_diff
      )
      return updates, center

    def local(params, center):
      del params
      return inner_updates, center

    updates, center = joined_cond(
      state.count % every == 0, elastic, local, params, state.center
    )
    return updates, EASGDState(optax.safe_increment(state.count), inner_state, center)

  return optax.GradientTransformation(init_fn, update_fn)
