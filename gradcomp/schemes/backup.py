r"""Synchronous SGD with backup workers: the server keeps the first n - b gradients.

Survey 004 §2.2 (stragglers; Chen, Pan, Monga, Bengio, Jozefowicz,
"Revisiting Distributed Synchronous SGD", 2017 (arXiv 1604.00981), §3): each
round, all ``n`` workers compute a gradient at the same params; the server
averages the first ``n - b`` to arrive, applies the step, and every worker
pulls it, the ``b`` stragglers abandoning their gradient. The round takes
the ``(n - b)``-th shortest of the workers' times instead of the longest.

**Simulated arrival.** Worker :math:`w`'s time in step ``t`` is
:func:`~gradcomp.schemes.async_ps.task_durations` of the step (its speed's
inverse, relative to the fastest, times :math:`1 + \text{jitter} \cdot E`,
:math:`E \sim \text{Exp}(1)`): all workers draw from a shared key, so all
agree on who arrives first; ties go to the lower index. Without jitter the
same slowest workers are dropped every round (their data never counts): the
random tail is what Chen et al. measured. The state accumulates the round
times (``clock``, in units of the fastest worker's gradient) and how often
each worker was dropped.

**Wire.** The accepted gradients' mean is one dense all-reduce of the
masked gradients (a dropped worker contributes zeros, as its abandoned push
would not arrive); every worker then applies the same update, so the params
stay equal. A round in which fewer than ``n - b`` workers can finish
(more failures than backups) applies nothing and its time is ``inf``.

**Reductions.** ``backups=0`` is synchronous SGD on the mean gradient; one
worker is ``inner``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.schemes import base
from gradcomp.schemes.async_ps import speed_table, task_durations


class BackupState(NamedTuple):
  """State of :func:`backup_workers`; all replicated but ``inner_state``'s origin.

  Attributes:
    count: shape=(), int32: rounds taken.
    inner_state: ``inner``'s state (the same on every worker).
    clock: shape=(), float32: simulated time of the rounds so far, in units
      of the fastest worker's gradient.
    dropped: shape=(workers,), int32: rounds in which each worker's gradient
      was dropped.
    key: the PRNG key of the duration jitter.
  """

  count: jax.Array
  inner_state: optax.OptState
  clock: jax.Array
  dropped: jax.Array
  key: jax.Array


def accepted_workers(durations: jax.Array, keep: int) -> tuple[jax.Array, jax.Array]:
  """The ``keep`` workers that finish first, and the round's time.

  Args:
    durations: shape=(workers,), each worker's time (``inf``: never).
    keep: ``n - b``.

  Returns:
    ``(accepted, time)``: a bool mask of the ``keep`` shortest durations
    (ties to the lower index), and the ``keep``-th shortest duration.
  """
  order = jnp.argsort(durations, stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  accepted = (rank < keep) & jnp.isfinite(durations)
  return accepted, jnp.sort(durations)[keep - 1]


def backup_workers(
  inner: optax.GradientTransformation,
  backups: int,
  *,
  speeds,
  jitter: float = 0.0,
  seed: int = 0,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  r"""Synchronous SGD that drops each round's ``backups`` slowest gradients.

  Args:
    inner: the optimizer applied to the accepted gradients' mean.
    backups: ``b``, an integer in ``[0, workers - 1]``.
    speeds: each worker's relative speed, or a ``(steps, workers)`` table
      (as :func:`gradcomp.async_ps`); their number must equal the size of
      ``axis_name`` (1 without it).
    jitter: scale of an Exp(1) straggler tail on every gradient's time, >= 0.
    seed: seeds the jitter's draws.
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`BackupState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for a bad ``inner``, speeds, ``backups`` outside ``[0,
      workers - 1]``, a negative ``jitter``, or (at trace time) a worker count
      other than ``len(speeds)``.

  Examples:
    Eight workers, the last two slower (speeds 0.5 and 0.25), two backups:
    the server averages the gradients 0, ..., 5 of the six that arrive first
    and drops workers 6 and 7; the round takes the sixth arrival's time, 1.

    >>> import jax, jax.numpy as jnp, optax, gradcomp
    >>> from jax.sharding import PartitionSpec as P
    >>> speeds = [1, 1, 1, 1, 1, 1, 0.5, 0.25]
    >>> tx = gradcomp.backup_workers(
    ...   optax.sgd(1.0), 2, speeds=speeds, axis_name="w")
    >>> def step(g, p):
    ...   u, s = tx.update(g, tx.init(p), p)
    ...   return u, s.clock, s.dropped
    >>> mesh = jax.make_mesh((8,), ("w",))
    >>> f = jax.jit(
    ...   jax.shard_map(step, mesh=mesh, in_specs=(P("w"), P()), out_specs=P()))
    >>> grads = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("w")))
    >>> u, clock, dropped = f(grads, jnp.zeros(1))
    >>> u.tolist(), clock.item(), dropped.tolist()
    ([-2.5], 1.0, [0, 0, 0, 0, 0, 0, 1, 1])

  References:
    Survey 004 §2.2; Chen et al., "Revisiting Distributed Synchronous SGD",
    2017.
  """
  inner = base.transformation("inner", inner)
  table = speed_table(speeds)
  workers = table.shape[1]
  if isinstance(backups, bool) or not isinstance(backups, int):
    raise ValueError(
      f"backups must be an integer in [0, {workers - 1}], got {backups!r}"
    )
  if not 0 <= backups <= workers - 1:
    raise ValueError(
      f"backups must be in [0, {workers - 1}] for {workers} workers, got {backups}"
    )
  jitter = base.nonnegative("jitter", jitter)
  base.seed(seed)
  keep = workers - backups

  def init_fn(params):
    return BackupState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      clock=jnp.zeros([], jnp.float32),
      dropped=jnp.zeros([workers], jnp.int32),
      key=jax.random.PRNGKey(seed),
    )

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "backup_workers")
    n = exchange.num_workers(axis_name)
    if n != workers:
      raise ValueError(f"speeds has {workers} workers, but axis {axis_name!r} has {n}")
    # The round's gradients start at its beginning: row = rounds so far.
    durations = task_durations(state.key, state.count, table, jitter)
    accepted, time = accepted_workers(durations, keep)
    complete = jnp.sum(accepted) == keep
    me = 0 if axis_name is None else jax.lax.axis_index(axis_name)
    mine = accepted[me]
    masked = jax.tree.map(lambda g: jnp.where(mine, g, jnp.zeros_like(g)), grads)
    total = exchange.all_reduce_sum(masked, axis_name)
    mean = jax.tree.map(lambda s, g: (s / keep).astype(g.dtype), total, grads)
    updates, inner_state = inner.update(mean, state.inner_state, params)
    updates = jax.tree.map(lambda u: jnp.where(complete, u, jnp.zeros_like(u)), updates)
    inner_state = jax.tree.map(
      lambda a, b: jnp.where(complete, a, b), inner_state, state.inner_state
    )
    return updates, BackupState(
      count=optax.safe_increment(state.count),
      inner_state=inner_state,
      clock=state.clock + jnp.where(complete, time, jnp.inf),
      dropped=state.dropped + (~accepted).astype(jnp.int32),
      key=state.key,
    )

  return optax.GradientTransformation(init_fn, update_fn)
