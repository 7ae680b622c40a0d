r"""SGD on gradients of a fixed staleness: the experiment behind survey 004 Fig. 2.

Survey 004 §2.3, Fig. 2 ("training error increases with staleness s; the
working node receives parameters s iterations ago", after Chen et al. 2017):
every step's gradient is taken at the params of ``s`` steps before, so

.. math::

  W_{t+1} = W_t + \text{inner}\Big(\tfrac1n \sum_w g_w(W_{t-s})\Big),
  \qquad W_{t-s} = W_0 \text{ for } t < s.

Unlike :func:`~gradcomp.schemes.async_ps.async_ps`, whose staleness comes out
of the workers' speeds, here it is injected and exactly ``s`` for every
step, so its effect on training can be read alone. The workers' params are
:math:`W_{t-s}` (all the same); the state keeps the server's :math:`W_t` and
the last ``s`` versions. The mean gradient is one dense all-reduce.
``staleness=0`` is synchronous SGD on the mean gradient; one worker with
``staleness=0`` is ``inner``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.schemes import base


class StaleState(NamedTuple):
  """State of :func:`stale_sgd`.

  Attributes:
    count: shape=(), int32: steps taken.
    inner_state: ``inner``'s state.
    server: :math:`W_t`, the params with every update applied.
    history: :math:`W_{t-s+1}, \\dots, W_t`, leaves of shape
      ``(staleness, *param.shape)`` (oldest first; :math:`W_0` before the
      start); ``optax.EmptyState()`` for ``staleness=0``.
  """

  count: jax.Array
  inner_state: optax.OptState
  server: optax.Params
  history: optax.Params


def stale_sgd(
  inner: optax.GradientTransformation,
  staleness: int,
  *,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  """Synchronous SGD whose gradients are taken ``staleness`` steps late.

  Args:
    inner: the server's optimizer, applied to the mean gradient.
    staleness: ``s``, an integer >= 0.
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`StaleState`; its
    ``update`` requires ``params`` (they must be :math:`W_{t-s}`, as the
    previous update left them).

  Raises:
    ValueError: for a bad ``inner`` or a ``staleness`` that is not an
      integer >= 0.

  Examples:
    With ``staleness=2`` the worker's params are the server's of two steps
    before: the gradients 1, 10, 100, 1000 move the server to -1, -11, -111,
    -1111, and the worker sees each value two steps later.

    >>> import jax.numpy as jnp, optax, gradcomp
    >>> tx = gradcomp.stale_sgd(optax.sgd(1.0), staleness=2)
    >>> w = jnp.zeros(1)
    >>> state = tx.init(w)
    >>> for g in (1.0, 10.0, 100.0, 1000.0):
    ...   u, state = tx.update(jnp.array([g]), state, w)
    ...   w = w + u
    ...   print(state.server.item(), w.item())
    -1.0 0.0
    -11.0 0.0
    -111.0 -1.0
    -1111.0 -11.0

  References:
    Survey 004 §2.3, Fig. 2.
  """
  inner = base.transformation("inner", inner)
  base.nonnegative("staleness", staleness, integer=True)

  def init_fn(params):
    if staleness == 0:
      history = optax.EmptyState()
    else:
      history = base.stacked_copies(params, staleness)
    return StaleState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      server=base.copy_params(params),
      history=history,
    )

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "stale_sgd")
    mean = exchange.all_reduce_mean(grads, axis_name)
    u, inner_state = inner.update(mean, state.inner_state, state.server)
    server = optax.apply_updates(state.server, u)
    if staleness == 0:
      new, history = server, state.history
    else:
      new = jax.tree.map(lambda h: h[0], state.history)
      history = jax.tree.map(
        lambda h, w: jnp.concatenate([h[1:], w[None].astype(h.dtype)]),
        state.history,
        server,
      )
    updates = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new, params)
    count = optax.safe_increment(state.count)
    return updates, StaleState(count, inner_state, server, history)

  return optax.GradientTransformation(init_fn, update_fn)
