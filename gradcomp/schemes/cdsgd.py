r"""CD-SGD: local update, a one-step-delayed compressed exchange, k-step correction.

Paper 001 (Yu et al. 2021, "CD-SGD: Distributed Stochastic Gradient Descent
with Compression and Delay Compensation"), Alg. 1 and eqs. 10-11. Each worker
keeps two sets of weights: the *global* weights :math:`W` (the server's,
replicated here) and its *local* weights :math:`W^{loc}` (the params, where
its gradient is taken). After warm-up, iteration :math:`i` of worker
:math:`j` is

.. math::

  g_{j,i} = \nabla L(W^{loc}_{j,i}; D_j), \qquad
  W^{loc}_{j,i+1} = W_i - \eta_l\, g_{j,i}, \qquad
  W_{i+1} = W_i - \frac{\eta_g}{N} \sum_j m_{j,i}

with :math:`m_{j,i}` the compressed :math:`Q(g_{j,i})` (2-bit threshold codes
with a residual, MXNet's ``2bit``) on :math:`k-1` of every :math:`k`
iterations and the raw :math:`g_{j,i}` on the :math:`k`-th (*k-step
correction*). :math:`W_{i+1}` is needed only for :math:`W^{loc}_{j,i+2}`, so
the exchange of :math:`m_{j,i}` runs while iteration :math:`i+1` computes
(§3.1, Fig. 2): this is what hides both the compression (:math:`\delta`) and
the communication (:math:`\psi`, :math:`\varphi`) behind the next step's
forward and backward pass, ``T = max(tau, phi_i)`` (eqs. 6-7).

**As an optax transformation.** ``update(g_t, state, params)`` at training
step ``t`` (1-based, ``params`` the local weights :math:`g_t` was taken at)

1. exchanges the *message* kept from step ``t - 1`` (never ``g_t``): the
   compressor's payload, or the dense all-reduce on a correction step;
2. applies ``global_optimizer`` to :math:`W` with the mean
   (:math:`W_{t-1} \to W_t`; ``optax.sgd(eta_g)`` is eq. 10);
3. returns the update that makes the params :math:`W_t - \eta_l g_t`
   (eq. 11) and keeps :math:`g_t` as the next step's message.

No operand of a formal step's collectives depends on ``grads``, so XLA may
run the collective under the step's forward and backward pass; the
``lax.cond`` choosing between the compressed and the full-precision exchange
takes only the message and the compressor's state.

**Warm-up** (Alg. 1 lines 1-16): steps ``1 .. warmup_steps - 1`` are
synchronous full-precision steps at the global weights (the gradient's
dense mean goes through ``global_optimizer`` at once, and the params become
:math:`W`). Step ``warmup_steps`` is the switch (lines 5-6, 11-12): the params
are seeded as :math:`W_n - \eta_l g_n` and :math:`g_n` is sent in full
precision. The paper exchanges it synchronously within step ``n``; here it is
exchanged under step ``n + 1``'s compute, which gives the same values (no
weight reads :math:`W_{n+1}` before step ``n + 1`` ends) without a bubble.
With ``warmup_steps=0`` the program has no synchronous branch at all; step 1
is a formal step with no message yet, and so is step 1 with
``warmup_steps=1``: the two differ only in whether :math:`g_1` is sent in
full precision.

**Which messages are full precision.** Formal steps are counted from the
switch, ``c = t - warmup_steps``; the message built at step ``t`` is sent in
full precision when ``c % k == 0`` (the switch step's, ``c = 0``, and every
``k``-th after it) and compressed otherwise: after warm-up, ``k - 1``
compressed messages, then a full one (Fig. 2 with k=4). ``k=1`` never
compresses: OD-SGD (Xu et al. 2020, the paper's [38]).

**Left open by the paper, and the reading taken** (NOTES.md, paper 001):

* *threshold units*: MXNet pushes batch-*summed* gradients, so the paper's
  threshold 0.5 acts on sums over a worker's batch. ``message_scale`` scales
  what the compressor sees (``message_scale * g``; the mean is divided back),
  so ``message_scale=B`` (the per-worker batch) reproduces MXNet's units with
  the paper's threshold. The default ``1.0`` compresses the mean gradient as
  it is; for the threshold quantizer ``message_scale=s`` with threshold
  ``t`` equals threshold ``t / s`` (exactly, for ``s`` a power of two).
* *residual on correction steps*: read literally, the full-precision push
  leaves the compressor's residual untouched (``flush_residual=False``, the
  default); ``flush_residual=True`` sends ``g + residual`` in full precision
  and clears the residual, so a correction also delivers what earlier
  compressed steps withheld.
* *which weights to evaluate*: the params are the local weights; the global
  weights are ``state.global_params`` (one step behind). The training
  program reports both.

**Reductions** (each is a test): with one worker, no compressor (or
``k=1``) and ``local_learning_rate`` equal to the global SGD learning rate,
the params follow plain SGD (:math:`W_t = W^{loc}_t`, so :math:`W^{loc}_{t+1}
= W^{loc}_t - \eta g_t`) whatever ``warmup_steps``; ``k=1`` is OD-SGD; BIT-SGD
(2-bit quantization without the local update, eq. 5) is not this scheme but
``optax.chain(gradcomp.threshold_quantize(t), optax.sgd(eta))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.parallel.branches import joined_cond
from gradcomp.schemes import base


class CDSGDState(NamedTuple):
  """State of :func:`cdsgd`.

  Attributes:
    count: shape=(), int32: steps taken; replicated.
    global_params: the global weights :math:`W` (the initial params at
      first); replicated. After step ``t`` they hold the messages of steps
      ``1 .. t - 1``.
    global_state: ``global_optimizer``'s state; replicated.
    compressor_state: the compressor's state (its residuals: per worker);
      ``optax.EmptyState()`` without a compressor.
    message: the gradient of the last step, to be exchanged by the next one
      (zeros before the first formal step); per worker.
  """

  count: jax.Array
  global_params: optax.Params
  global_state: optax.OptState
  compressor_state: optax.OptState
  message: optax.Params


def _residuals(compressor_state, like):
  """The error-feedback residual of every leaf of ``like``, or a ``ValueError``."""
  states = None
  if isinstance(compressor_state, CompressorState):
    states = jax.tree.structure(like).flatten_up_to(compressor_state.leaves)
  if states is None or not all(isinstance(s, ErrorFeedbackState) for s in states):
    raise ValueError(
      "cdsgd(flush_residual=True) needs a layer-wise compressor with error "
      "feedback (threshold_quantize, topk, ef_signsgd, ...): its state has no "
      f"per-leaf residual, got {type(compressor_state).__name__}"
    )
  return jax.tree.unflatten(jax.tree.structure(like), [s.residual for s in states])


def _clear_residuals(compressor_state):
  is_ef = lambda s: isinstance(s, ErrorFeedbackState)
  leaves = jax.tree.map(
    lambda s: s._replace(residual=jnp.zeros_like(s.residual)),
    compressor_state.leaves,
    is_leaf=is_ef,
  )
  return compressor_state._replace(leaves=leaves)


def cdsgd(
  global_optimizer: optax.GradientTransformation,
  compressor: optax.GradientTransformation | None,
  *,
  local_learning_rate: float | Callable[[jax.Array], jax.Array],
  k: int = 2,
  warmup_steps: int,
  message_scale: float = 1.0,
  flush_residual: bool = False,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  r"""CD-SGD (paper 001, Alg. 1): the exchange of step t runs under step t+1.

  See the module docstring for the algorithm, the warm-up and the readings
  of what the paper leaves open.

  Args:
    global_optimizer: applied to the global weights with the mean message
      (``optax.sgd(eta_g)`` is eq. 10; momentum or weight decay chained in
      act on :math:`W`, as MXNet's server optimizer does).
    compressor: a gradcomp compressor built with the same ``axis_name``
      (``gradcomp.threshold_quantize(t, axis_name="data")`` is the paper's);
      its residual is per worker. ``None``: every message in full precision
      (OD-SGD, whatever ``k``).
    local_learning_rate: :math:`\eta_l` of eq. 11 (> 0), or a schedule of
      the step count.
    k: one message in ``k`` is full precision (k-step correction), >= 1;
      ``k=1`` is OD-SGD.
    warmup_steps: synchronous full-precision steps before the switch, >= 0
      (the paper does not give its value; OD-SGD's code uses 200).
    message_scale: the compressor sees ``message_scale * g`` (> 0); the
      per-worker batch size reproduces MXNet's batch-summed pushes.
    flush_residual: on a full-precision step, send ``g + residual`` and clear
      the compressor's residual (needs a layer-wise compressor with error
      feedback).
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`CDSGDState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for ``k < 1``, ``warmup_steps < 0``, a non-positive learning
      rate or ``message_scale``, or a ``global_optimizer`` or ``compressor``
      that is not an optax transformation.

  Examples:
    >>> import jax.numpy as jnp, optax, gradcomp
    >>> tx = gradcomp.cdsgd(optax.sgd(0.5), None, local_learning_rate=0.5,
    ...                     warmup_steps=0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> updates["w"].tolist()  # W - 0.5 g - params
    [-0.5, -0.5]

  References:
    Paper 001 Alg. 1, eqs. 6-7 and 10-11; OD-SGD (Xu et al., TACO 2020).
  """
  global_optimizer = base.transformation("global_optimizer", global_optimizer)
  compressor = base.transformation("compressor", compressor, optional=True)
  if not callable(local_learning_rate):
    local_learning_rate = checks.positive("local_learning_rate", local_learning_rate)
  k = checks.at_least("k", k, 1)
  warmup_steps = checks.at_least("warmup_steps", warmup_steps, 0)
  message_scale = checks.positive("message_scale", message_scale)
  if not isinstance(flush_residual, bool):
    raise ValueError(f"flush_residual must be True or False, got {flush_residual!r}")
  compressed = compressor is not None and k > 1
  # The first formal step: no message is waiting yet.
  first_formal = max(warmup_steps, 1)

  def init_fn(params):
    return CDSGDState(
      count=jnp.zeros([], jnp.int32),
      global_params=base.copy_params(params),
      global_state=global_optimizer.init(params),
      compressor_state=optax.EmptyState()
      if compressor is None
      else compressor.init(params),
      message=jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
    )

  def apply_global(mean, global_params, global_state):
    updates, global_state = global_optimizer.update(mean, global_state, global_params)
    return optax.apply_updates(global_params, updates), global_state

  def full_exchange(message, compressor_state):
    if flush_residual and compressor is not None:
      residual = _residuals(compressor_state, message)
      message = jax.tree.map(
        lambda m, r: m + (r / message_scale).astype(m.dtype), message, residual
      )
      compressor_state = _clear_residuals(compressor_state)
    return exchange.all_reduce_mean(message, axis_name), compressor_state

  def compressed_exchange(message, compressor_state):
    scaled = jax.tree.map(lambda m: m * message_scale, message)
    # No params: the message differs between workers by design, which the
    # compressors' axis check (compressors/axes.py) would take for shards.
    mean, compressor_state = compressor.update(scaled, compressor_state, None)
    return jax.tree.map(lambda m: m / message_scale, mean), compressor_state

  def formal_step(grads, state, params, count):
    """Exchange of the last step's message; the params from the new W."""
    # Typed per worker, as ``grads`` are, from the first step on (the zeros
    # of ``init`` are typed replicated under ``shard_map``).
    message = exchange.vary_like(state.message, grads)
    if compressed:
      correction = (count - 1 - warmup_steps) % k == 0
      mean, compressor_state = joined_cond(
        correction,
        full_exchange,
        compressed_exchange,
        message,
        state.compressor_state,
      )
    else:
      mean, compressor_state = full_exchange(message, state.compressor_state)

    def advance(mean, global_params, global_state, compressor_state, old):
      del old
      return (*apply_global(mean, global_params, global_state), compressor_state)

    def hold(mean, global_params, global_state, compressor_state, old):
      del mean, compressor_state
      return global_params, global_state, old

    global_params, global_state, compressor_state = joined_cond(
      count > first_formal,
      advance,
      hold,
      mean,
      state.global_params,
      state.global_state,
      compressor_state,
      state.compressor_state,
    )
    lr = local_learning_rate
    if callable(lr):  # An optax schedule, of the count before this step.
      lr = lr(state.count)
    local = jax.tree.map(lambda w, g: w - lr * g, global_params, grads)
    updates = jax.tree.map(jnp.subtract, local, params)
    return updates, CDSGDState(
      count, global_params, global_state, compressor_state, grads
    )

  def warmup_step(grads, state, params, count):
    """Synchronous SGD at the global weights (Alg. 1 lines 2-10)."""
    mean = exchange.all_reduce_mean(grads, axis_name)
    global_params, global_state = apply_global(
      mean, state.global_params, state.global_state
    )
    updates = jax.tree.map(jnp.subtract, global_params, params)
    return updates, state._replace(
      count=count, global_params=global_params, global_state=global_state
    )

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "cdsgd")
    count = optax.safe_increment(state.count)
    if warmup_steps <= 1:  # No synchronous step: no branch for one.
      return formal_step(grads, state, params, count)
    return joined_cond(
      count < warmup_steps,
      lambda g, s, p: warmup_step(g, s, p, count),
      lambda g, s, p: formal_step(g, s, p, count),
      grads,
      state,
      params,
    )

  return optax.GradientTransformation(init_fn, update_fn)
