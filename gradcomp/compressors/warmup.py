r"""A dense warm-up before any compressor: the first updates are the float32 mean.

Compression from the first step hurts most while the gradients change
fastest; published methods start dense. Deep Gradient Compression warms its
sparsity up over the first epochs (Lin et al. 2018, §3.3, "warm-up
training"); PyTorch's PowerSGD communication hook (Vogels et al. 2019)
runs plain all-reduce for ``start_powerSGD_iter`` steps (``PowerSGDState``,
default 1,000, ``torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py``); 1-bit Adam runs dense Adam until its
``freeze_step`` (Tang et al. 2021, Alg. 1). :func:`dense_warmup` gives any
gradcomp compressor that knob:

.. math::
  \operatorname{out}_t =
  \begin{cases}
    \frac{1}{n} \sum_w g_{t,w} & t \le N \quad\text{(all-reduce, float32)}\\
    \operatorname{compressor}(g_{t,w};\ s_{t-N-1}) & t > N,
  \end{cases}

where :math:`s_0` is ``compressor.init``'s state: the compressor's state
(error-feedback residuals, PowerSGD's warm-started Q, a PRNG stream) is
left untouched through the warm-up, so update :math:`N + 1` is exactly the
compressor's first update on a fresh state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import axes, exchange
from gradcomp.kernels import numerics
from gradcomp.parallel import branches


class DenseWarmupState(NamedTuple):
  """State of :func:`dense_warmup`.

  Attributes:
    count: dense updates done so far, at most ``steps``; shape ``()``, int32
      (replicated: every worker counts alike).
    inner: the compressor's state, as its ``init`` made it until update
      ``steps + 1`` (per worker where the compressor's is).
  """

  count: jax.Array
  inner: Any


def check_compressor(compressor, axis_name, what: str) -> None:
  """Raises ``ValueError`` unless ``compressor`` is a transformation over ``axis_name``.

  ``what`` names the argument in the message (``"compressor"``, ``"codec"``).
  """
  if not isinstance(compressor, optax.GradientTransformation):
    raise ValueError(
      f"{what} must be an optax.GradientTransformation built by a gradcomp "
      f"factory (e.g. gradcomp.topk(0.01, axis_name=...)), got "
      f"{type(compressor).__name__}"
    )
  want, got = axes.group_axes(axis_name), axes.group_of(compressor)
  if got != want:
    raise ValueError(
      f"{what} must average over axis_name {axis_name!r} (build it with "
      f"axis_name={axis_name!r}); it averages over "
      f"{got if got else 'no axis (one device, or an unrecorded transformation)'}"
    )


def dense_mean(updates, axis_name: exchange.AxisName):
  """The float32 mean over workers of ``updates``, cast back to each leaf's dtype.

  ``gradcomp.none``'s exchange: each worker sends ``g / n`` as float32.
  """

  def mean(g):
    out = exchange.all_reduce_mean(jnp.asarray(g, jnp.float32), axis_name)
    return numerics.saturate(out, jnp.asarray(g).dtype)

  return jax.tree.map(mean, updates)


def dense_warmup(
  compressor: optax.GradientTransformation,
  steps: int,
  *,
  axis_name: exchange.AxisName = None,
) -> optax.GradientTransformation:
  """``compressor`` after ``steps`` updates of the dense float32 mean (module docstring).

  Args:
    compressor: a gradcomp compressor (any factory's, or a ``layerfusion``
      of one) built over ``axis_name``.
    steps: updates of the dense mean before the compressor's first, ``>= 0``
      (0: the compressor from the first update).
    axis_name: the workers' mesh axis, or ``None`` on one device; the
      compressor's own.

  Returns:
    An ``optax.GradientTransformation`` returning the same mean on every
    worker; its state is a :class:`DenseWarmupState`. Its compiled update
    holds both exchanges (a conditional runs one): price a run's bytes by
    phase, ``steps`` all-reduces of ``4 d`` bytes, then the compressor's.

  Raises:
    ValueError: ``steps`` not an integer ``>= 0``, or a ``compressor`` that
      is not a transformation over ``axis_name``, named.

  Examples:
    Two dense updates, then top-1 of 3 starting fresh (nothing kept from
    the warm-up):

    >>> import jax.numpy as jnp, gradcomp
    >>> tx = gradcomp.dense_warmup(gradcomp.topk(0.34), 2)
    >>> g = {"w": jnp.array([0.5, -3.0, 1.0])}
    >>> state = tx.init(g)
    >>> for _ in range(3):
    ...   out, state = tx.update(g, state)
    ...   print(out["w"].tolist(), int(state.count))
    [0.5, -3.0, 1.0] 1
    [0.5, -3.0, 1.0] 2
    [0.0, -3.0, 0.0] 2
    >>> state.inner.leaves["w"].residual.tolist()
    [0.5, 0.0, 1.0]
  """
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
  check_compressor(compressor, axis_name, "compressor")

  def init_fn(params):
    return DenseWarmupState(
      count=jnp.zeros([], jnp.int32), inner=compressor.init(params)
    )

  def compressed(updates, state, params):
    out, inner = compressor.update(updates, state.inner, params)
    return out, state._replace(inner=inner)

  def update_fn(updates, state, params=None):
    if steps == 0:
      return compressed(updates, state, params)
    in_warmup = state.count < steps

    def dense(s):
      return dense_mean(updates, axis_name), s._replace(count=s.count + 1)

    out, new_state = branches.joined_cond(
      in_warmup, dense, lambda s: compressed(updates, s, params), state
    )
    return out, exchange.vary_like(new_state, state)

  # Its axes filed, as every compressor's (hierarchical(), layerfusion).
  return axes.record(optax.GradientTransformation(init_fn, update_fn), axis_name)
