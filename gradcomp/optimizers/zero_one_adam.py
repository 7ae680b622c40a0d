r"""0/1 Adam: variance updates at growing intervals, 1-bit rounds, then local steps (Lu et al. 2022).

Lu, Li, Zhang and He, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", ICLR 2023 (arXiv 2202.06009), Alg. 1; DeepSpeed
``runtime/fp16/onebit/zoadam.py`` (its defaults are this factory's).

Two phases, by the update count ``t``:

* **Adaptive variance** (``t <= var_freeze_step``). The variance is updated
  only on the steps of a growing set: every step at first, and after
  ``var_update_scaler`` updates at one interval the interval doubles. On
  those steps the gradient is all-reduced densely and feeds both moments;
  on the others each worker's gradient goes through the two-stage 1-bit
  all-reduce (:func:`gradcomp.compressors.scatter.onebit_allreduce`) and
  feeds the momentum only. Every worker then takes the same Adam step.
* **Local steps** (``t > var_freeze_step``). The variance is frozen. Each
  worker steps with its own gradient and momentum, and accumulates its
  steps, scaled back to momentum units by :math:`\sqrt{\hat v} + \epsilon`.
  On a synchronisation step (``t`` a multiple of the local interval, which
  doubles every ``local_step_scaler`` steps up to ``local_step_clipper``),
  each worker undoes its local steps, the accumulators go through the 1-bit
  all-reduce, and every worker applies the average; the momentum becomes
  the average accumulated momentum, :math:`-u / \sum \eta` (times
  :math:`1 - \beta_1^t`, back to uncorrected units). Other steps send
  nothing.

Readings, each a choice:

* **Bias correction.** DeepSpeed's 0/1 Adam has none (its
  ``bias_correction`` flag is unused by the step). Here the momentum is
  corrected with the step count and the variance with the number of its
  updates :math:`k` (:math:`\hat v = v / (1 - \beta_2^k)`: an average of
  :math:`k` squared gradients), so the first steps are Adam's, not
  :math:`\sqrt{1 - \beta_2} / (1 - \beta_1)` = 3.2x larger.
* **Weight decay outside the accumulated update.** A local step is
  AdamW's, :math:`x \leftarrow (1 - \eta\lambda) x - \eta \hat m /
  (\sqrt{\hat v} + \epsilon)`; the accumulator :math:`u` takes the
  moment part only and decays with the params, :math:`u \leftarrow (1 -
  \eta\lambda) u - \eta \hat m / (\sqrt{\hat v} + \epsilon)`, so the
  local params are :math:`P x_s + u` with :math:`P = \prod (1 -
  \eta\lambda)` the same on every worker. A synchronisation replaces
  :math:`u` by the workers' average, and the momentum
  :math:`m = -u / \sum \eta` carries no decay. DeepSpeed's ``zoadam.py``
  puts the decay inside the update it accumulates
  (``update = exp_avg / (exp_avg_sq.sqrt() + eps) + weight_decay * p``,
  then ``comm_buffer.add_(-lr * update)``, the buffer being its
  ``momentum_accumulator``): the momentum rebuilt
  from it carries :math:`\lambda x`, which every later step applies again
  through :math:`\hat m / (\sqrt{\hat v} + \epsilon)`, an effective
  decay 1.85x (interval 16) to 10x (interval 1) the set one. Here, with
  zero gradients, the params decay exactly as AdamW's (the tests check the
  closed form :math:`x_0 \prod_t (1 - \eta_t \lambda)`).
* **Errors at the freeze.** The error buffers hold gradient residuals
  before the freeze and accumulated-momentum residuals after; DeepSpeed
  zeroes them once at the switch, and so does this (it is the algorithm's,
  not a checkpoint's, reset: both are kept in the state and checkpointed).
* **Zero-gradient coordinates**: as in :func:`~gradcomp.onebit_adam`, a
  coordinate whose variance is exactly zero keeps zero momentum and takes
  no step; DeepSpeed's ``exp_avg_mask`` asks the user for them.
* **Params per worker.** Between synchronisations the workers' params
  differ (local steps): under ``shard_map`` they come out typed varying,
  and the training program lays them out per worker, as local SGD's.

:func:`exchange_schedule` gives, from the hyper-parameters alone, what each
step sends (``"dense"``, ``"onebit"`` or nothing), for pricing a run.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import axes, exchange, scatter
from gradcomp.optimizers.frozen_variance import check_adam
from gradcomp.optimizers.frozen_variance import flat as _flat
from gradcomp.optimizers.frozen_variance import unflat as _unflat
from gradcomp.parallel import branches

#: What a step sends (:func:`exchange_schedule`).
DENSE, ONEBIT, NONE = "dense", "onebit", "none"


class ZeroOneAdamState(NamedTuple):
  """State of :func:`zero_one_adam` (every counter an int32 scalar).

  Attributes:
    count: updates so far.
    mu: the momentum (per worker between synchronisations).
    nu: the variance (replicated).
    var_updates: updates of the variance so far (its bias correction).
    var_interval: steps between variance updates, and ``var_counter`` the
      updates made at this interval.
    local_interval: steps between synchronisations after the freeze, and
      ``local_counter`` the steps made at this interval.
    accumulator: this worker's local steps since the last synchronisation
      (DeepSpeed's ``momentum_accumulator``), and ``lr_sum`` their learning
      rates.
    worker_error, server_error: the 1-bit all-reduce's errors, flat float32.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  var_updates: jax.Array
  var_interval: jax.Array
  var_counter: jax.Array
  local_interval: jax.Array
  local_counter: jax.Array
  accumulator: optax.Updates
  lr_sum: jax.Array
  worker_error: jax.Array
  server_error: jax.Array


def exchange_schedule(
  num_steps: int,
  *,
  var_freeze_step: int = 100000,
  var_update_scaler: int = 16,
  local_step_scaler: int = 32678,
  local_step_clipper: int = 16,
) -> list[str]:
  """What each step, ``1`` to ``num_steps``, sends: ``"dense"``, ``"onebit"`` or ``"none"``.

  The optimizer's own counters, replayed in Python (the tests check the two
  agree).

  Examples:
    Variance every step 4 times, then every 2nd step; local steps after 10
    steps, synchronising every step, then every 2nd after 2 of them:

    >>> from gradcomp.optimizers.zero_one_adam import exchange_schedule
    >>> " ".join(s[0] for s in exchange_schedule(
    ...   16, var_freeze_step=10, var_update_scaler=4, local_step_scaler=2,
    ...   local_step_clipper=4))
    'd d d d o d o d o d o o n o n o'
  """
  kinds = []
  var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
  for t in range(1, num_steps + 1):
    if t <= var_freeze_step:
      var_step = t % var_interval == 0
      kinds.append(DENSE if var_step else ONEBIT)
      if var_step:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    else:
      kinds.append(ONEBIT if t % local_interval == 0 else NONE)
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter = 0
        local_interval = min(local_step_clipper, local_interval * 2)
  return kinds


def zero_one_adam(
  learning_rate: optax.ScalarOrSchedule,
  *,
  var_freeze_step: int = 100000,
  var_update_scaler: int = 16,
  local_step_scaler: int = 32678,
  local_step_clipper: int = 16,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  mask=None,
  axis_name: exchange.AxisName = None,
) -> optax.GradientTransformation:
  """0/1 Adam (module docstring); the defaults are DeepSpeed's.

  Args:
    learning_rate: a float or an optax schedule of the update count.
    var_freeze_step: the last update of the adaptive-variance phase.
    var_update_scaler: variance updates at one interval before it doubles.
    local_step_scaler: steps at one synchronisation interval before it
      doubles, after the freeze.
    local_step_clipper: the largest synchronisation interval.
    b1, b2, eps: Adam's.
    weight_decay: decoupled weight decay, as ``optax.adamw``'s.
    mask: the weight-decay mask (a tree of bools, or a function of params).
    axis_name: the workers' mesh axis, or ``None`` on one device.

  Raises:
    ValueError: a hyper-parameter outside its range, named.

  Examples:
    The first update is Adam's on the mean gradient (one device here):
    every coordinate moves by the learning rate.

    >>> import jax.numpy as jnp
    >>> from gradcomp.optimizers.zero_one_adam import zero_one_adam
    >>> tx = zero_one_adam(0.1)
    >>> p, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, -0.25])}
    >>> u, state = tx.update(g, tx.init(p), p)
    >>> [round(float(x), 4) for x in u["w"]], int(state.var_updates)
    ([-0.1, 0.1], 1)
  """
  check_adam(
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    var_freeze_step=var_freeze_step,
    var_update_scaler=var_update_scaler,
    local_step_scaler=local_step_scaler,
    local_step_clipper=local_step_clipper,
  )
  decay = optax.add_decayed_weights(weight_decay, mask)

  def lr_at(count):
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.asarray(lr, jnp.float32)

  def init_fn(params):
    zeros = lambda: jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32), params)
    size = sum(x.size for x in jax.tree.leaves(params))
    # A fresh array per counter: a training step donates its state, and one
    # buffer donated twice is an error.
    one = lambda: jnp.ones([], jnp.int32)
    zero = lambda: jnp.zeros([], jnp.int32)
    return ZeroOneAdamState(
      count=zero(),
      mu=zeros(),
      nu=zeros(),
      var_updates=zero(),
      var_interval=one(),
      var_counter=zero(),
      local_interval=one(),
      local_counter=zero(),
      accumulator=zeros(),
      lr_sum=jnp.zeros([], jnp.float32),
      worker_error=jnp.zeros((size,), jnp.float32),
      server_error=jnp.zeros((size,), jnp.float32),
    )

  def decayed(tree):
    """``wd * tree`` on the leaves the mask decays, 0 elsewhere."""
    zeros = jax.tree.map(jnp.zeros_like, tree)
    return decay.update(zeros, decay.init(tree), tree)[0]

  def moment_step(mu, nu_hat, live, t):
    """Adam's step from the moments alone (``-lr m_hat / (sqrt(v_hat) + eps)``)."""
    mu_hat = optax.tree.bias_correction(mu, b1, t)
    return jax.tree.map(
      lambda m, v, on: jnp.where(on, -lr_at(t - 1) * (m / (jnp.sqrt(v) + eps)), 0.0),
      mu_hat,
      nu_hat,
      live,
    )

  def adam_step(mu, nu_hat, live, t, params):
    """AdamW's step from the moments (``-lr (m_hat / (sqrt(v_hat) + eps) + wd p)``)."""
    step = moment_step(mu, nu_hat, live, t)
    lr = lr_at(t - 1)
    return jax.tree.map(lambda s, d: s - lr * d, step, decayed(params))

  def corrected(nu, k):
    k = jnp.maximum(k, 1)
    return jax.tree.map(lambda v: v / (1 - b2 ** k.astype(jnp.float32)), nu)

  def live_of(nu):
    return jax.tree.map(lambda v: v > 0, nu)

  def onebit(tree, state):
    mean, we, se = scatter.onebit_allreduce(
      _flat(tree), state.worker_error, state.server_error, axis_name
    )
    return _unflat(mean, tree), we, se

  def variance_step(grads, state, params):
    """A variance step: the dense mean gradient feeds both moments."""
    g = exchange.all_reduce_mean(grads, axis_name)
    t, k = state.count + 1, state.var_updates + 1
    mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
    nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu, g)
    updates = adam_step(mu, corrected(nu, k), live_of(nu), t, params)
    counter = state.var_counter + 1
    grow = counter == var_update_scaler
    return updates, state._replace(
      count=t,
      mu=mu,
      nu=nu,
      var_updates=k,
      var_counter=jnp.where(grow, 0, counter),
      var_interval=jnp.where(grow, state.var_interval * 2, state.var_interval),
    )

  def onebit_step(grads, state, params):
    """Between variance steps: the 1-bit average gradient feeds the momentum."""
    t = state.count + 1
    live = live_of(state.nu)
    local = jax.tree.map(lambda g, on: jnp.where(on, g, 0.0), grads, live)
    g, we, se = onebit(local, state)
    mu = jax.tree.map(
      lambda m, x, on: jnp.where(on, b1 * m + (1 - b1) * x, 0.0), state.mu, g, live
    )
    updates = adam_step(mu, corrected(state.nu, state.var_updates), live, t, params)
    return updates, state._replace(count=t, mu=mu, worker_error=we, server_error=se)

  def local_step(grads, state, params, sync: bool):
    """After the freeze: a local step; on a synchronisation, the averaged accumulation."""
    t = state.count + 1
    live = live_of(state.nu)
    nu_hat = corrected(state.nu, state.var_updates)
    scale = jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu_hat)
    mu = jax.tree.map(
      lambda m, g, on: jnp.where(on, b1 * m + (1 - b1) * g, 0.0), state.mu, grads, live
    )
    # AdamW's local step; the accumulator takes its moment part and decays
    # as the params do (module docstring, weight decay): then the local
    # params are P x_s + accumulator, P the product of (1 - lr wd) since
    # the last synchronisation x_s, the same on every worker.
    lr = lr_at(t - 1)
    moments = moment_step(mu, nu_hat, live, t)
    updates = jax.tree.map(lambda s, d: s - lr * d, moments, decayed(params))
    accumulator = jax.tree.map(
      lambda a, s, d: a + s - lr * d,
      state.accumulator,
      moments,
      decayed(state.accumulator),
    )
    lr_sum = state.lr_sum + lr
    counter = state.local_counter + 1
    grow = counter == local_step_scaler
    state = state._replace(
      count=t,
      mu=mu,
      local_counter=jnp.where(grow, 0, counter),
      local_interval=jnp.where(
        grow,
        jnp.minimum(local_step_clipper, state.local_interval * 2),
        state.local_interval,
      ),
    )
    if not sync:
      return updates, state._replace(accumulator=accumulator, lr_sum=lr_sum)
    # Undo the local steps' moment parts (the params return to the last
    # synchronisation, decayed), then apply the workers' average accumulation.
    sent = jax.tree.map(
      lambda u, s, on: jnp.where(on, u * s, 0.0), accumulator, scale, live
    )
    mean, we, se = onebit(sent, state)
    mean = jax.tree.map(lambda m, on: jnp.where(on, m, 0.0), mean, live)
    step = jax.tree.map(
      lambda u, a, m, s: u - a + m / s, updates, accumulator, mean, scale
    )
    # The average accumulated momentum, back in raw (uncorrected) units.
    keep = 1 - b1 ** t.astype(jnp.float32)
    mu = jax.tree.map(lambda m: -keep * m / lr_sum, mean)
    zeros = jax.tree.map(jnp.zeros_like, accumulator)
    return step, state._replace(
      mu=mu,
      accumulator=zeros,
      lr_sum=jnp.zeros([], jnp.float32),
      worker_error=we,
      server_error=se,
    )

  def at_freeze(state):
    """The errors change meaning at the freeze (module docstring): zeroed once."""
    first = state.count == var_freeze_step
    return state._replace(
      worker_error=jnp.where(first, 0.0, state.worker_error),
      server_error=jnp.where(first, 0.0, state.server_error),
    )

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("zero_one_adam needs params (decoupled weight decay)")
    grads32 = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
    params32 = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    t = state.count + 1

    def adaptive(s):
      return branches.joined_cond(
        t % s.var_interval == 0,
        lambda s: variance_step(grads32, s, params32),
        lambda s: onebit_step(grads32, s, params32),
        s,
      )

    def local(s):
      s = at_freeze(s)
      return branches.joined_cond(
        t % s.local_interval == 0,
        lambda s: local_step(grads32, s, params32, sync=True),
        lambda s: local_step(grads32, s, params32, sync=False),
        s,
      )

    updates, new_state = branches.joined_cond(
      t <= var_freeze_step, adaptive, local, state
    )
    updates = jax.tree.map(lambda u, p: u.astype(jnp.asarray(p).dtype), updates, params)
    return updates, exchange.vary_like(new_state, state)

  # Its axes filed so hierarchical() can take it as its inner;
  # params that are shards of a partition across axis_name are refused.
  return axes.checked(
    optax.GradientTransformation(init_fn, update_fn), axis_name, strict=False
  )
