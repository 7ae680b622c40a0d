r"""Adam's warm-up, then a frozen variance and an exchanged momentum (Tang et al. 2021, Alg. 1).

The part 1-bit Adam (:func:`gradcomp.onebit_adam`) and compressed-momentum
Adam (:func:`gradcomp.compressed_adam`) share; each supplies how the
workers' momenta meet (a :class:`MomentumExchange`).

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021, Alg. 1.

**Warm-up** (updates ``1 .. freeze_step``): ``optax.adamw`` on the dense
mean gradient (its own chain, so a run that never leaves it equals it), or
on the mean a ``warmup_codec`` returns (its state in the optimizer's
``warmup`` field; what it still holds at the freeze is dropped).

**Frozen-variance phase** (updates ``freeze_step + 1 ..``), Alg. 1 lines
6-12: :math:`v` stays as it was after the warm-up; each worker updates the
momentum with its own gradient, :math:`m_w = \beta_1 m + (1 - \beta_1)
g_w`; the exchange returns the same :math:`m` on every worker (the
compressed mean of the :math:`m_w`, with the exchange's own error
compensation); the step is :math:`x \leftarrow x - \eta\,(\hat m /
(\sqrt{\hat v} + \epsilon) + \lambda x)` with :math:`\hat m = m / (1 -
\beta_1^t)` and :math:`\hat v = v_T / (1 - \beta_2^T)`, ``T`` the freeze
step (the readings are :mod:`gradcomp.optimizers.onebit_adam`'s).
Coordinates whose frozen variance is exactly zero (an exactly zero gradient
through the whole warm-up) keep zero momentum, send zero and take no Adam
step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.compressors import warmup as warmup_lib
from gradcomp.parallel import branches


def check_adam(learning_rate, b1, b2, eps, weight_decay, **counts: int) -> None:
  """Raises ``ValueError`` naming an Adam hyper-parameter outside its range.

  ``counts``: integer hyper-parameters, each ``>= 1``. A ``freeze_step``
  (``var_freeze_step``) of 0 would leave the variance at zero, its bias
  correction ``1 - b2**0`` at zero: every 1-bit Adam update NaN, every 0/1
  Adam update weight decay alone.
  """
  if not callable(learning_rate) and not learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0 or a schedule, got {learning_rate}")
  for name, value in counts.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  for name, value in (("b1", b1), ("b2", b2)):
    if not 0 <= value < 1:
      raise ValueError(f"{name} must be in [0, 1), got {value}")
  if not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps}")
  if not weight_decay >= 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def flat(tree) -> jax.Array:
  """Every leaf of ``tree`` raveled into one float32 buffer, in tree order."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def unflat(buffer: jax.Array, like):
  """:func:`flat`'s inverse: ``buffer`` cut into leaves shaped as ``like``'s."""
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for x in leaves:
    out.append(buffer[start : start + x.size].reshape(x.shape).astype(x.dtype))
    start += x.size
  return jax.tree.unflatten(treedef, out)


class MomentumExchange(NamedTuple):
  """How the workers' momenta meet in the frozen-variance phase.

  Attributes:
    init: ``init(zeros) -> {field: value}``: the exchange's fields of the
      optimizer's state, from float32 zeros shaped as the params.
    apply: ``apply(local, live, state) -> (mean, {field: value})``:
      ``local`` is this worker's momentum (float32, zero off ``live``),
      ``live`` a tree of bools (coordinates whose frozen variance is
      positive), ``state`` the optimizer's state; returns the momentum
      every worker takes (the same on each) and the exchange's new fields.
  """

  init: Callable[[Any], dict[str, Any]]
  apply: Callable[[Any, Any, Any], tuple[Any, dict[str, Any]]]


def frozen_variance_adam(
  learning_rate: optax.ScalarOrSchedule,
  momentum_exchange: MomentumExchange,
  state_type: type,
  *,
  name: str,
  freeze_step: int,
  b1: float,
  b2: float,
  eps: float,
  weight_decay: float,
  mask,
  axis_name: exchange.AxisName,
  warmup_codec: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """AdamW's warm-up, then the frozen-variance phase (module docstring).

  Args:
    learning_rate: a float or an optax schedule of the update count.
    momentum_exchange: how the momenta meet after the freeze.
    state_type: the optimizer's state, a ``NamedTuple`` whose fields are
      ``adam`` (``optax.adamw``'s state), ``warmup`` (the warm-up codec's,
      ``()`` without one) and the exchange's.
    name: the optimizer's name, for errors.
    freeze_step, b1, b2, eps, weight_decay, mask, axis_name: as
      :func:`gradcomp.onebit_adam`'s (validated by the caller).
    warmup_codec: as :func:`gradcomp.onebit_adam`'s; checked here.

  Returns:
    An ``optax.GradientTransformation`` (params required by ``update``).

  Raises:
    ValueError: a ``warmup_codec`` that is not a transformation over
      ``axis_name``.
  """
  if warmup_codec is not None:
    warmup_lib.check_compressor(warmup_codec, axis_name, "warmup_codec")
  adamw = optax.adamw(
    learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask
  )
  # optax.adamw's own chain: scale_by_adam, add_decayed_weights, scale_by_learning_rate.
  decay = optax.add_decayed_weights(weight_decay, mask)
  rate = optax.scale_by_learning_rate(learning_rate)

  def init_fn(params):
    # Zeros like the params (their sharding kept; shapes alone will do).
    zeros = jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32), params)
    return state_type(
      adam=adamw.init(zeros),
      warmup=() if warmup_codec is None else warmup_codec.init(zeros),
      **momentum_exchange.init(zeros),
    )

  def warmup(grads, state, params):
    if warmup_codec is None:
      mean, codec_state = exchange.all_reduce_mean(grads, axis_name), ()
    else:
      mean, codec_state = warmup_codec.update(grads, state.warmup)
    updates, adam = adamw.update(mean, state.adam, params)
    return updates, state._replace(adam=adam, warmup=codec_state)

  def compressed(grads, state, params):
    scaled, decayed, scheduled = state.adam
    count = optax.safe_increment(scaled.count)
    # The variance as bias-corrected at the freeze step.
    frozen = 1 - b2**freeze_step
    nu_hat = jax.tree.map(lambda v: v / frozen, scaled.nu)
    live = jax.tree.map(lambda v: v > 0, scaled.nu)  # Zero-gradient coordinates: off.
    local = jax.tree.map(
      lambda m, g, on: jnp.where(on, b1 * m + (1 - b1) * g, 0.0), scaled.mu, grads, live
    )
    mean, fields = momentum_exchange.apply(local, live, state)
    mu = jax.tree.map(lambda m, on: jnp.where(on, m, 0.0), mean, live)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    updates, decayed = decay.update(updates, decayed, params)
    updates, scheduled = rate.update(updates, scheduled, params)
    adam = (scaled._replace(count=count, mu=mu), decayed, scheduled)
    return updates, state._replace(adam=adam, **fields)

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError(f"{name} needs params (decoupled weight decay)")
    grads32 = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
    params32 = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    # The compressed branch's errors are per worker, the warm-up's as they
    # came in: the join types both alike (and the state as it came in).
    in_warmup = state.adam[0].count < freeze_step
    updates, new_state = branches.joined_cond(
      in_warmup,
      lambda s: warmup(grads32, s, params32),
      lambda s: compressed(grads32, s, params32),
      state,
    )
    updates = jax.tree.map(lambda u, p: u.astype(jnp.asarray(p).dtype), updates, params)
    return updates, exchange.vary_like(new_state, state)

  return optax.GradientTransformation(init_fn, update_fn)
