r"""An asynchronous parameter server, simulated exactly: ASGD, bounded delay, DC-ASGD.

Survey 004 §2.1 (the parameter server: workers push gradients and pull
params), §2.3 (asynchronous SGD and its stale gradients; *bounded delay*;
delay-compensated ASGD, whose reference the survey omits: Zheng et al.,
"Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML
2017, arXiv 1609.08326).

**What is simulated.** Every worker replicates the server: its params, the
server optimizer's (``inner``'s) state, and the bookkeeping below. The
workers run in lockstep SPMD steps, but a worker's *gradient* takes as long
as its speed says, on a simulated clock whose unit is one step, the time the
fastest worker (the largest speed anywhere in ``speeds``) takes for one
gradient. Worker :math:`w`'s gradient started at time :math:`s` is done at
:math:`s + d_w`, :math:`d_w = v_{max} / v_w \ge 1` steps (times
:math:`1 + \text{jitter} \cdot E`, :math:`E \sim \text{Exp}(1)`, for a
random straggler tail). In step :math:`t` (the interval
:math:`(t-1, t]`) the workers whose gradient is done *push* it; the server
applies the pushes **one at a time in order of finishing time, ties broken
by worker index**, each through ``inner`` at the server's current params;
right after its own push a worker *pulls* the server's params, becomes its
params, and starts its next gradient at that instant. A worker still
computing keeps its params.

**One gradient per worker per step.** The SPMD program computes every
worker's gradient at every step, at the worker's current params (the copy
it pulled) on that step's batch. A worker that finishes in step :math:`t`
pushes step :math:`t`'s gradient; the gradients of steps in which it was
still "computing" are discarded. The params it was taken at are the ones
the worker really pulled, so staleness is exact; only the batch is the
finishing step's rather than the starting step's. The simulation therefore
spends ``workers`` gradients per step however few are pushed: a worker with
speed 1/4 of the fastest discards three of every four.

**Bounded delay** (``staleness_bound=s``; survey §2.3: "when a worker
requests parameters, the PS inspects whether all tasks issued :math:`\tau`
ago are completed; if not, it waits", Li et al. 2014; Ho et al. 2013's SSP).
A worker that has pushed :math:`c` gradients may pull (and start its next)
only once every worker has pushed at least :math:`c - s`; until then it waits,
and it pulls at the instant the push that releases it is applied. ``s=0`` is
synchronous: every worker's gradient of a round is taken at the same params,
and with equal speeds every worker pushes every step (the server still
applies the round's pushes one at a time, so with ``inner = sgd(lr)`` a round
is synchronous SGD on the *sum* of the gradients: ``sgd(n lr)`` on their
mean). A failed worker (speed 0: never done) stalls a bounded server, as it
stalls synchronous SGD; an unbounded one carries on (survey §2.3).

**DC-ASGD** (``delay_compensation=lambda``; Zheng et al. 2017 eq. 8 / Alg. 2,
the constant-lambda form): the server applies
:math:`g + \lambda\, g \odot g \odot (W - W_{bak}(w))` instead of
:math:`g`, with :math:`W_{bak}(w)` the params worker :math:`w` last pulled.
The server keeps every worker's backup, as in the paper: ``workers`` copies
of the params in the state of every replica.

**Compressed pushes** (``compressor``): each worker encodes its gradient
with its own error-feedback memory, and the payload in the codec's wire
format is all-gathered (``exchange.Pushes``) and decoded per worker by every
replica; pulls are dense. A worker's compressor state advances only at the
steps it pushes (the discarded gradients never reach its memory). Under SPMD
every worker's payload crosses the wire every step; the simulated clock
charges only the pushes.

**Staleness** of an applied push is the number of pushes the server applied
between the worker's pull and this push (``version - pulled[w]``); the state
keeps their histogram. With ``n`` equal-speed workers and no bound it is
``n - 1`` for every push after the first round (a test).

**Reductions.** One worker is ``inner`` (up to the rounding of
``(params + u) - params``); with equal speeds and ``staleness_bound=0``
every worker pushes every step at the same params.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import exchange
from gradcomp.compressors.spec import spec_of
from gradcomp.parallel import branches
from gradcomp.schemes import base

#: Bins of :attr:`AsyncPSState.staleness`: staleness 0 .. 62, and >= 63 in the last.
STALENESS_BINS = 64


class AsyncPSState(NamedTuple):
  """State of :func:`async_ps`. All fields but two are the server's, replicated.

  Attributes:
    count: shape=(), int32: steps taken.
    server: the server's params.
    server_state: ``inner``'s state at the server.
    version: shape=(), int32: pushes the server has applied.
    pulled: shape=(workers,), int32: the ``version`` each worker last pulled.
    pushes: shape=(workers,), int32: pushes applied from each worker.
    left: shape=(workers,), float32: steps until each worker's gradient is
      done, counted from the start of the next step (done in it when <= 1);
      meaningless while the worker waits.
    waiting: shape=(workers,), bool: pushed, and held by the staleness bound.
    backups: DC-ASGD's :math:`W_{bak}`, the params each worker last pulled,
      leaves of shape ``(workers, *param.shape)``; ``optax.EmptyState()``
      without delay compensation.
    compressor_state: the worker's compressor state (per worker);
      ``optax.EmptyState()`` without a compressor.
    staleness: shape=(STALENESS_BINS,), int32: how many applied pushes had
      each staleness (the last bin counts ``>= STALENESS_BINS - 1``).
    key: the PRNG key of the duration jitter.
  """

  count: jax.Array
  server: optax.Params
  server_state: optax.OptState
  version: jax.Array
  pulled: jax.Array
  pushes: jax.Array
  left: jax.Array
  waiting: jax.Array
  backups: optax.Params
  compressor_state: optax.OptState
  staleness: jax.Array
  key: jax.Array


def speed_table(speeds) -> np.ndarray:
  """``speeds`` as a float32 ``(rows, workers)`` table, validated.

  A sequence of ``workers`` speeds is one row; a 2-D table gives in row
  ``r`` the speeds of the gradients started in step ``r`` (0: at the start),
  which run from step ``r + 1`` on (the last row holds on): a described
  cluster's slowdowns and failures are ``Cluster.speeds_at(r + 1)``. Speeds are finite and >= 0 (0: a failed worker), with one > 0.
  """
  try:
    table = np.asarray(speeds, np.float64)
  except (TypeError, ValueError):
    raise ValueError(
      f"speeds must be a sequence of per-worker speeds or a (steps, workers) "
      f"table, got {speeds!r}"
    ) from None
  if table.ndim == 1:
    table = table[None]
  if table.ndim != 2 or table.size == 0:
    raise ValueError(
      f"speeds must be a sequence of per-worker speeds or a (steps, workers) "
      f"table, got shape {table.shape}"
    )
  if not np.all(np.isfinite(table)) or np.any(table < 0) or not np.any(table > 0):
    raise ValueError(
      f"speeds must be finite and >= 0 with at least one > 0, got {speeds!r}"
    )
  return table.astype(np.float32)


def task_durations(key, step, speeds, jitter: float) -> jax.Array:
  r"""Steps each worker's gradient takes if started in step ``step``.

  :math:`d_w = v_{max} / v_w(\text{step})` times :math:`1 + \text{jitter}
  \cdot E_w`, :math:`E_w \sim \text{Exp}(1)` drawn from
  ``fold_in(fold_in(key, step), w)``; ``inf`` for speed 0. Step 0 is the
  state's ``init``. Public so that a reference simulation can replay the
  same draws.

  Args:
    key: the scheme's jitter key.
    step: int32, the step in which the gradients start (0: ``init``).
    speeds: the :func:`speed_table`.
    jitter: the straggler tail's scale, >= 0.

  Returns:
    float32, shape=(workers,).
  """
  table = jnp.asarray(speeds)
  row = table[jnp.minimum(step, table.shape[0] - 1)]
  base_time = jnp.float32(table.max()) / row  # inf where the speed is 0
  if jitter == 0.0:
    return base_time
  step_key = jax.random.fold_in(key, step)
  draws = jax.vmap(lambda w: jax.random.exponential(jax.random.fold_in(step_key, w)))(
    jnp.arange(table.shape[1])
  )
  return base_time * (1.0 + jnp.float32(jitter) * draws)


def _varying(tree, axis_name):
  """``tree`` typed as varying over ``axis_name`` (a scan carry that becomes so)."""
  if axis_name is None:
    return tree

  def cast(x):
    if axis_name in branches.varying_axes(x):
      return x
    return jax.lax.pcast(x, (axis_name,), to="varying")

  return jax.tree.map(cast, tree)


def _select(flag, new, old):
  return jax.tree.map(lambda n, o: jnp.where(flag, n, o), new, old)


def async_ps(
  inner: optax.GradientTransformation,
  *,
  speeds,
  staleness_bound: int | None = None,
  delay_compensation: float = 0.0,
  compressor: optax.GradientTransformation | None = None,
  jitter: float = 0.0,
  seed: int = 0,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  r"""A simulated asynchronous parameter server (see the module docstring).

  Args:
    inner: the server's optimizer, applied to each push on its own.
    speeds: each worker's relative speed (gradients per unit time; the
      fastest finishes one per step), ``workers`` values, or a
      ``(steps, workers)`` table (:func:`speed_table`). Their number must
      equal the size of ``axis_name`` (1 without it).
    staleness_bound: bounded delay ``s`` (an integer >= 0): a worker more
      than ``s`` pushes ahead of the slowest waits to pull; ``0`` is
      synchronous; ``None``: fully asynchronous.
    delay_compensation: DC-ASGD's ``lambda`` >= 0; ``0``: plain ASGD (no
      backups kept).
    compressor: a gradcomp compressor whose payload each push carries (its
      error feedback per worker); it must gather its payloads (top-k, DGC,
      QSGD, TernGrad, the sign and fixed-point codecs, ...). ``None``: dense
      pushes.
    jitter: scale of an Exp(1) straggler tail on every gradient's duration,
      >= 0.
    seed: seeds the jitter's draws.
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`AsyncPSState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for a bad ``inner`` or ``compressor``, bad speeds, a
      negative or non-integer ``staleness_bound``, a negative
      ``delay_compensation`` or ``jitter``, or (at trace time) a worker
      count other than ``len(speeds)``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from gradcomp.schemes.async_ps import async_ps
    >>> tx = async_ps(optax.sgd(0.5), speeds=[1.0])
    >>> params = {"w": jnp.ones(2)}
    >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"].tolist()  # one worker: the inner optimizer
    [-0.5, -0.5]

  References:
    Survey 004 §2.1, §2.3; Zheng et al., ICML 2017 (DC-ASGD); Li et al.,
    OSDI 2014 (bounded delay); Ho et al., NIPS 2013 (SSP).
  """
  inner = base.transformation("inner", inner)
  compressor = base.transformation("compressor", compressor, optional=True)
  if compressor is not None and spec_of(compressor) is None:
    raise ValueError(
      "compressor must be built by a gradcomp factory (its codec is rebuilt "
      "for the server's pushes)"
    )
  table = speed_table(speeds)
  workers = table.shape[1]
  bound = base.nonnegative(
    "staleness_bound", staleness_bound, integer=True, optional=True
  )
  lam = base.nonnegative("delay_compensation", delay_compensation)
  jitter = base.nonnegative("jitter", jitter)
  base.seed(seed)

  def init_fn(params):
    key = jax.random.PRNGKey(seed)
    server = base.copy_params(params)
    if lam > 0:
      backups = base.stacked_copies(params, workers)
    else:
      backups = optax.EmptyState()
    return AsyncPSState(
      count=jnp.zeros([], jnp.int32),
      server=server,
      server_state=inner.init(params),
      version=jnp.zeros([], jnp.int32),
      pulled=jnp.zeros([workers], jnp.int32),
      pushes=jnp.zeros([workers], jnp.int32),
      left=task_durations(key, jnp.zeros([], jnp.int32), table, jitter),
      waiting=jnp.zeros([workers], bool),
      backups=backups,
      compressor_state=(
        optax.EmptyState() if compressor is None else compressor.init(params)
      ),
      staleness=jnp.zeros([STALENESS_BINS], jnp.int32),
      key=key,
    )

  def gathered(grads, state, params, me, finishing):
    """Every worker's (decoded) gradient, leaves ``(workers, ...)``; compressor state."""
    if compressor is None:
      if axis_name is None:
        return jax.tree.map(lambda g: g[None], grads), state.compressor_state
      return exchange.all_gather(grads, axis_name), state.compressor_state
    leaves, treedef = jax.tree.flatten(grads)
    if axis_name is None:
      codec = spec_of(compressor).build(axis_name=None)
      decoded, cstate = codec.update(grads, state.compressor_state, params)
      stacked = jax.tree.map(lambda d: d[None], decoded)
    else:
      pattern = exchange.Pushes(axis_name)
      codec = spec_of(compressor).build(axis_name=pattern)
      _, cstate = codec.update(grads, state.compressor_state, params)
      sent = iter(pattern.decoded)
      out = []
      for leaf in leaves:
        if leaf.size == 0:
          out.append(jnp.zeros((workers, *leaf.shape), leaf.dtype))
          continue
        out.append(next(sent).reshape(workers, *leaf.shape).astype(leaf.dtype))
      stacked = treedef.unflatten(out)
    # A worker still computing discards its gradient: its memory stays.
    cstate = _select(finishing[me], cstate, state.compressor_state)
    return stacked, cstate

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "async_ps")
    n = exchange.num_workers(axis_name)
    if n != workers:
      raise ValueError(f"speeds has {workers} workers, but axis {axis_name!r} has {n}")
    me = 0 if axis_name is None else jax.lax.axis_index(axis_name)
    finishing = ~state.waiting & (state.left <= 1.0)
    # Arrival order: finishing time, then worker index (a stable sort).
    order = jnp.argsort(jnp.where(finishing, state.left, jnp.inf), stable=True)
    grads_all, compressor_state = gathered(grads, state, params, me, finishing)
    count = optax.safe_increment(state.count)
    durations = task_durations(state.key, count, table, jitter)

    def push(carry, w):
      (server, server_state, version, pulled, pushes, left, waiting, backups,
       mine, hist) = carry  # fmt: skip
      active = finishing[w]
      at = state.left[w]  # the push's time within the step
      g = jax.tree.map(lambda a: a[w], grads_all)
      if lam > 0:

        def compensate(g, x, bak):
          g32 = g.astype(jnp.float32)
          diff = x.astype(jnp.float32) - bak[w].astype(jnp.float32)
          return (g32 + lam * g32 * g32 * diff).astype(g.dtype)

        g = jax.tree.map(compensate, g, server, backups)
      u, new_state = inner.update(g, server_state, server)
      server = _select(active, optax.apply_updates(server, u), server)
      server_state = _select(active, new_state, server_state)
      stale = version - pulled[w]
      hist = hist.at[jnp.minimum(stale, STALENESS_BINS - 1)].add(
        active.astype(jnp.int32)
      )
      version = version + active.astype(jnp.int32)
      pushes = pushes.at[w].add(active.astype(jnp.int32))
      waiting = waiting.at[w].set(waiting[w] | active)
      release = waiting & active
      if bound is not None:
        release = release & (pushes - jnp.min(pushes) <= bound)
      pulled = jnp.where(release, version, pulled)
      left = jnp.where(release, at + durations, left)
      waiting = waiting & ~release
      if lam > 0:
        backups = jax.tree.map(
          lambda b, x: jnp.where(
            release.reshape((-1,) + (1,) * x.ndim), x[None].astype(b.dtype), b
          ),
          backups,
          server,
        )
      mine = _select(release[me], server, mine)
      carry = (server, server_state, version, pulled, pushes, left, waiting,
               backups, mine, hist)  # fmt: skip
      return carry, None

    carry = (
      state.server,
      state.server_state,
      state.version,
      state.pulled,
      state.pushes,
      state.left,
      state.waiting,
      state.backups,
      _varying(params, axis_name),
      state.staleness,
    )
    carry, _ = jax.lax.scan(push, carry, order)
    (server, server_state, version, pulled, pushes, left, waiting, backups,
     mine, hist) = carry  # fmt: skip
    left = jnp.where(waiting, left, left - 1.0)
    updates = jax.tree.map(lambda m, p: (m - p).astype(p.dtype), mine, params)
    return updates, AsyncPSState(
      count=count,
      server=server,
      server_state=server_state,
      version=version,
      pulled=pulled,
      pushes=pushes,
      left=left,
      waiting=waiting,
      backups=backups,
      compressor_state=compressor_state,
      staleness=hist,
      key=state.key,
    )

  return optax.GradientTransformation(init_fn, update_fn)
