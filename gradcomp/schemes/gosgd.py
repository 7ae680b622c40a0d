r"""GoSGD: sum-weight push gossip (Blot, Picard, Cord, Thome 2016).

Paper 002 §2.1 (EdgeGossip's base, its [18], [26]): "Gossip training for deep
learning" (Blot et al. 2016, arXiv 1611.09726). Every worker trains its own
params and keeps a *sum-weight* :math:`\alpha_w`; now and then it halves its
weight and pushes its params with the other half to a random peer, which
merges them by weights (NOTES.md, paper 002):

.. math::

  \alpha_s \leftarrow \tfrac12 \alpha_s, \qquad
  x_r \leftarrow \frac{\alpha_r x_r + \alpha_s x_s}{\alpha_r + \alpha_s}, \qquad
  \alpha_r \leftarrow \alpha_r + \alpha_s

The weights sum to 1 and every exchange keeps :math:`\sum_w \alpha_w x_w`,
so the gossip moves the workers towards one model without moving their
weighted average (only the local steps move it).

**Order** (paper 002 §2.1: "first ... updates the parameters using the
gradients. Second, it sends weights to other participants ... Finally, it
receives weights ... and merges them with the local weights"): the local step of ``inner`` comes first, then the gossip of
the *new* params. The payload therefore depends on this step's gradient: the
exchange cannot run under the backward pass, unlike D-PSGD's mixing of the
params the gradient was taken at.

**Synchronous reading of an asynchronous algorithm.** Blot's workers run
without a common clock; after a local step each pushes with probability p to
a uniformly random peer. Here every step is one round: worker :math:`w` pushes with
probability ``p`` (its own draw), and all pushes of the round go the same
*shift* :math:`s`, uniform in :math:`[1, n-1]` and common to all workers:
:math:`w` pushes to :math:`(w + s) \bmod n`. Each worker's peer is still
uniform over the others, and each worker receives at most one push per round,
so a round is one ``ppermute``. Draws come from a PRNG key that all workers
share (in the state, split every step): the pushes and the shift of a step are
:func:`gossip_draws` of that step's key, so a run is reproducible and a
reference can replay it. A worker that pushes and receives in the same round
merges with its halved weight, which is what conserves the weighted average.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.parallel import branches
from gradcomp.schemes import base


class GoSGDState(NamedTuple):
  """State of :func:`gosgd`.

  Attributes:
    count: shape=(), int32: steps taken; replicated.
    inner_state: the local optimizer's state; per worker.
    weight: shape=(), float32: the worker's sum-weight in units of ``1 / n``,
      :math:`n \\alpha_w`. ``1.0`` at ``init`` (:math:`\\alpha_w = 1/n`; ``init``
      runs outside the mapped axis and cannot know ``n``), so the ``n``
      workers' weights sum to ``n``. Replicated at ``init``, per worker after
      the first step that gossips (``p > 0`` on more than one worker).
    key: shape=(2,), uint32: the PRNG stream shared by all workers; replicated.
  """

  count: jax.Array
  inner_state: optax.OptState
  weight: jax.Array
  key: jax.Array


def gossip_draws(
  key: jax.Array, num_workers: int, p: float
) -> tuple[jax.Array, jax.Array]:
  """The pushes and the shift of one gossip round, from the key all workers share.

  Every worker computes the same values (nothing here depends on which
  worker runs it), so each knows who pushes and where.

  Args:
    key: the step's raw uint32[2] key (``jax.random.split(state.key)[1]``).
    num_workers: ``n``, static.
    p: the push probability.

  Returns:
    ``(pushes, shift)``: ``pushes``, shape=(n,), bool, worker ``w``'s draw
    ``jax.random.bernoulli(jax.random.fold_in(push_key, w), p)``; ``shift``,
    shape=(), int32, uniform in ``[1, n - 1]`` (``0`` for one worker): worker
    ``w`` pushes to ``(w + shift) % n``.
  """
  push_key, shift_key = jax.random.split(key)
  pushes = jax.vmap(lambda w: jax.random.bernoulli(jax.random.fold_in(push_key, w), p))(
    jnp.arange(num_workers)
  )
  if num_workers < 2:
    return pushes, jnp.zeros([], jnp.int32)
  shift = jax.random.randint(shift_key, (), 1, num_workers, dtype=jnp.int32)
  return pushes, shift


def _probability(p) -> float:
  if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
    raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
  return float(p)


def gosgd(
  inner: optax.GradientTransformation,
  p: float,
  *,
  seed: int = 0,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  r"""GoSGD: local steps, then each worker pushes (params, half its weight) with probability p.

  At every step, with :math:`u_w` the update of ``inner`` at the worker's
  params, :math:`\pi_w \in \{0, 1\}` its push draw and :math:`s` the step's
  shift (:func:`gossip_draws`; see the module docstring):

  .. math::

    x_w &\leftarrow x_w + u_w \\
    \alpha_w^- &= (1 - \tfrac12 \pi_w)\, \alpha_w, \qquad
    m_w = \tfrac12 \pi_{w-s}\, \alpha_{w-s} \\
    x_w &\leftarrow x_w + \frac{m_w}{\alpha_w^- + m_w} (x_{w-s} - x_w), \qquad
    \alpha_w \leftarrow \alpha_w^- + m_w

  (indices mod ``n``; everything on the right at the values after the local
  step). :math:`\sum_w \alpha_w` and :math:`\sum_w \alpha_w x_w` are unchanged
  by the gossip. The weights are kept in units of :math:`1/n`
  (:attr:`GoSGDState.weight` is :math:`n \alpha_w`, 1 at ``init``): the
  merge depends only on ratios of weights, and halving and adding
  power-of-two fractions of 1 is exact in float32, so the weights sum to
  ``n`` exactly (until a weight spans more than 24 binary orders below
  another). The consensus model is :math:`\sum_w \alpha_w x_w`, that is
  ``sum_w weight_w x_w / n``.

  **Wire.** One ``collective-permute`` per step, from each worker ``w`` to
  ``(w + s) % n``, carrying every params leaf in its own dtype and the
  float32 weight: the ``lax.switch`` over the ``n - 1`` static shifts holds
  one ``ppermute`` per branch and runs one. A worker that does not push sends
  zeros and weight 0, so the receiver keeps its params and weight; under SPMD
  those zeros still cross the wire, so a round costs the params' bytes (+4)
  per worker whether one worker pushes or all do. A round where no worker
  pushes (probability :math:`(1-p)^n`, known to all from the shared key)
  takes a switch branch with no collective and sends nothing. Expected bytes
  per worker and step: :math:`(1 - (1-p)^n)` (params bytes + 4). The key
  is replicated as ``init`` makes it; a state passed typed per worker whole
  (``shard_map`` with the state split over the workers) first agrees on one
  key with an 8-byte ``pmax``, so every worker takes the same branch.

  **Reductions.** One worker (``axis_name=None``, or an axis of size 1) is
  ``inner``, for any ``p``; ``p=0`` is independent local training, ``inner``
  on every worker, with no collective in the program (the weights stay 1 and
  replicated). ``p=1`` makes every worker push every step; each then
  receives exactly one push, so the weights stay 1 and
  :math:`x_w \leftarrow \frac12 (x_w + x_{w-s})`. No setting is synchronous
  SGD on the mean gradient: a round averages pairs, never all workers.

  **Masked steps** (paper 002 Alg. 2 on SPMD workers): ``update(grads,
  state, params, active=a)`` with a per-worker boolean ``a``. A worker with
  ``a = False`` has no batch this step (it has used its epoch's budget,
  ``gradcomp.edgegossip``): ``inner``'s update is zero and its state is kept,
  and the worker does not push (in Blot's protocol a push follows a local
  step), though the shared draws are still consumed, so the other workers'
  pushes and shifts are those of the unmasked run. It still merges a push it
  receives: refusing it would lose the sender's halved weight and break the
  invariant :math:`\sum_w \alpha_w x_w`; in time, the masked worker is still
  computing its slower steps and merges on receipt. ``active=None`` (or
  ``True`` everywhere) is the plain scheme.

  **Precision.** The merge runs in float32 and is cast to each leaf's dtype;
  the update of a worker that receives nothing is ``inner``'s update as it
  is.

  Args:
    inner: the worker's local optimizer.
    p: the probability that a worker pushes at a step, in ``[0, 1]``.
    seed: seeds the PRNG stream that all workers share (the pushes and the
      shifts).
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`GoSGDState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for ``p`` outside ``[0, 1]``, a ``seed`` that is not an
      integer, or an ``inner`` that is not an optax transformation.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from gradcomp.schemes.gosgd import gosgd
    >>> tx = gosgd(optax.sgd(0.5), p=0.1)
    >>> params = {"w": jnp.ones(2)}
    >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"].tolist()  # one worker: the inner optimizer
    [-0.5, -0.5]
    >>> float(state.weight)
    1.0

  References:
    Paper 002 §2.1; Blot, Picard, Cord, Thome, "Gossip training for deep
    learning", arXiv 1611.09726 (2016); the sum-weight (push-sum) protocol of
    Kempe, Dobra, Gehrke, FOCS 2003.
  """
  inner = base.transformation("inner", inner)
  p = _probability(p)
  base.seed(seed)

  def init_fn(params):
    return GoSGDState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      weight=jnp.ones([], jnp.float32),
      key=jax.random.PRNGKey(seed),
    )

  def permute(payload, shift, n):
    perm = [(w, (w + shift) % n) for w in range(n)]
    return jax.lax.ppermute(payload, axis_name, perm)

  def update_fn(grads, state, params=None, *, active=None):
    params = base.require_params(params, "gosgd")
    inner_updates, inner_state = inner.update(grads, state.inner_state, params)
    if active is not None:  # A masked worker: no local step, no push.
      active = jnp.asarray(active, bool)
      inner_updates = jax.tree.map(
        lambda u: jnp.where(active, u, jnp.zeros_like(u)), inner_updates
      )
      inner_state = jax.tree.map(
        lambda new, old: jnp.where(active, new, old), inner_state, state.inner_state
      )
    count = optax.safe_increment(state.count)
    n = exchange.num_workers(axis_name)
    if n == 1 or p == 0.0:  # Nothing is ever pushed: no collective at all.
      key = jax.random.split(state.key)[0]
      return inner_updates, GoSGDState(count, inner_state, state.weight, key)
    key = state.key
    if axis_name in branches.varying_axes(key):
      # A key typed per worker (a state sharded whole over the workers):
      # agree on one (8 bytes), so every worker takes the same switch branch.
      key = jax.lax.pmax(key, axis_name)
    key, step_key = jax.random.split(key)
    pushes, shift = gossip_draws(step_key, n, p)
    push = pushes[jax.lax.axis_index(axis_name)]
    if active is not None:
      push = push & active
    local = optax.apply_updates(params, inner_updates)
    sent_weight = jnp.where(push, state.weight / 2, jnp.zeros([], jnp.float32))
    kept = state.weight - sent_weight  # Exact: halving and its complement.
    payload = (
      jax.tree.map(lambda x: jnp.where(push, x, jnp.zeros_like(x)), local),
      sent_weight,
    )
    # Branch 0: nobody pushes (the payload is all zeros); branch s: shift s.
    rounds = [lambda payload: payload] + [
      functools.partial(permute, shift=s, n=n) for s in range(1, n)
    ]
    index = jnp.where(jnp.any(pushes), shift, 0)
    received, got_weight = jax.lax.switch(index, rounds, payload)
    weight = kept + got_weight
    got = got_weight > 0
    share = got_weight / jnp.where(got, weight, 1.0)  # 0 when nothing came

    def update(x, r, old, u):
      x32 = x.astype(jnp.float32)
      merged = (x32 + share * (r.astype(jnp.float32) - x32)).astype(x.dtype)
      return jnp.where(got, (merged - old).astype(u.dtype), u)

    updates = jax.tree.map(update, local, received, params, inner_updates)
    return updates, GoSGDState(count, inner_state, weight, key)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
