r"""1-bit Adam: Adam's warm-up, then a frozen variance and 1-bit momentum (Tang et al. 2021).

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021, Alg. 1; DeepSpeed ``runtime/fp16/onebit/adam.py``.

**Warm-up** (updates ``1 .. freeze_step``): ``optax.adamw`` on the dense
mean gradient, bias correction and decoupled weight decay included; it *is*
``optax.adamw``'s chain, so a run that never leaves it equals it exactly.

**Compressed phase** (updates ``freeze_step + 1 ..``), Alg. 1 lines 6-12:
the variance :math:`v` is frozen at its value after the warm-up; each worker
updates the momentum with its own gradient,
:math:`m_w = \beta_1 m + (1 - \beta_1) g_w`, and the momenta go through the
two-stage error-compensated 1-bit all-reduce
(:func:`gradcomp.compressors.scatter.onebit_allreduce`: the worker's error,
:math:`C[x] = \operatorname{sign}(x) \|x\| / \sqrt{d}` per chunk, an
all-to-all to each chunk's owner, the owner's average plus its server error
compressed again, an all-gather). Every worker then holds the same decoded
momentum :math:`m`, and takes the step
:math:`x \leftarrow x - \eta\,(\hat m / (\sqrt{\hat v} + \epsilon) + \lambda x)`.

Readings the paper and DeepSpeed leave open, and the choices here:

* **Bias correction.** DeepSpeed's 1-bit Adam has none; Alg. 1 writes none
  either. The warm-up here is ``optax.adamw``'s, with it. The compressed
  phase keeps the step continuous at the switch: :math:`\hat m = m / (1 -
  \beta_1^t)` with the running count ``t`` (1 within float32 for any
  realistic ``freeze_step``), and :math:`\hat v = v_T / (1 - \beta_2^T)`,
  the variance as bias-corrected at the freeze step ``T``. Without the
  latter, a short warm-up (``T`` = 100, :math:`\beta_2` = 0.999) would
  shrink the denominator by :math:`\sqrt{1 - 0.999^{100}}` = 0.31 at the
  switch and triple the steps.
* **Zero-gradient coordinates** (DeepSpeed's momentum mask problem, e.g.
  positions a sequence never reaches): a coordinate whose frozen variance is
  exactly zero had an exactly zero gradient through the whole warm-up. Its
  momentum is kept at zero and it takes no Adam step (a 1-bit code cannot
  send a zero, and :math:`m / (0 + \epsilon)` would be huge); DeepSpeed asks
  the user for a mask instead. Every worker agrees, since :math:`v` is
  replicated.
* **One buffer.** The momentum of every leaf is flattened into one float32
  buffer for the exchange (as DeepSpeed's flattened fp32 groups); the
  all-to-all's chunks cross leaf boundaries. Error buffers are float32 and
  full-size, kept in the state (DeepSpeed resets them on checkpoint load).
* bf16 params and gradients: the state is float32 and the updates take the
  params' dtype.

The first ``freeze_step`` exchanges are dense all-reduces (4 bytes a
value); the rest send one bit a value in the all-to-all and ``1/n`` bit in
the all-gather (plus a float32 scale per chunk). Per worker that is
:math:`32 n / (n + 1)` times fewer operand bytes than the all-reduce's,
about 1/28 on 8 workers (1/25.6 on 4), and 32 times fewer link bytes on
rings (the all-reduce puts :math:`2 (n - 1) / n` of its 32 bits a value on
links, the all-to-all and the all-gather :math:`(n - 1) / n` of one bit
each). Read from the compiled step with :func:`gradcomp.axis_wire`
(:math:`d = 2^{20}`, 8 workers): 4,194,304 operand bytes dense, 147,492
compressed (1/28.4); link bytes 7,340,032 and 229,432 (1/32.0).

**A compressed warm-up** (``warmup_codec``, not in the paper). The dense
warm-up is most of a short run's bytes: 100 of 600 steps at 4 bytes a value
are 85 % of them, so the whole run sends about 5x fewer bytes than dense
AdamW however few the 1-bit phase sends. With ``warmup_codec`` the warm-up's
AdamW steps on the codec's mean of the workers' gradients instead, its
error feedback keeping what the codec did not send for the next step, e.g.
ZeRO++'s quantized reduce-scatter (Wang et al. 2023, §3.3) with LoCo's
error feedback at each hop (Xie et al. 2024): int8 codes in blocks of 64
send 3.35x fewer bytes than the all-reduce. The variance frozen at the end
of the warm-up is then of those means, the codec's rounding included, and
every later step divides by it: on gpt_tiny int8 in blocks of 64 kept 1-bit
Adam's final loss, blocks of 512 lost 2.4 % and int4 lost the model
(docs/adaptive.md). At the freeze the codec's residual (at most one step's
rounding per coordinate) is dropped; its state stays as the warm-up left it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import axes, exchange, scatter
from gradcomp.optimizers import frozen_variance
from gradcomp.optimizers.frozen_variance import check_adam as check_adam


class OneBitAdamState(NamedTuple):
  """State of :func:`onebit_adam`.

  Attributes:
    adam: ``optax.adamw``'s state (its ``ScaleByAdamState`` holds the
      count, the momentum and the variance, frozen after the warm-up).
    warmup: ``warmup_codec``'s state (per worker: its errors), ``()``
      with the dense warm-up.
    worker_error: this worker's compression error, flat float32.
    server_error: this worker's error as the owner of its chunk, flat
      float32 (only its chunk's entries are used).
  """

  adam: Any
  warmup: Any
  worker_error: jax.Array
  server_error: jax.Array


def onebit_exchange(axis_name: exchange.AxisName) -> frozen_variance.MomentumExchange:
  """The two-stage 1-bit all-reduce of the momenta, flattened into one buffer.

  Its fields are :class:`OneBitAdamState`'s errors; every error entry off
  the live coordinates is kept at zero (nothing to send there).
  """

  def init(zeros):
    size = sum(x.size for x in jax.tree.leaves(zeros))
    return {
      "worker_error": jnp.zeros((size,), jnp.float32),
      "server_error": jnp.zeros((size,), jnp.float32),
    }

  def apply(local, live, state):
    mean, worker_error, server_error = scatter.onebit_allreduce(
      frozen_variance.flat(local), state.worker_error, state.server_error, axis_name
    )
    on = frozen_variance.flat(live) > 0
    return frozen_variance.unflat(mean, local), {
      "worker_error": jnp.where(on, worker_error, 0.0),
      "server_error": jnp.where(on, server_error, 0.0),
    }

  return frozen_variance.MomentumExchange(init, apply)


def onebit_adam(
  learning_rate: optax.ScalarOrSchedule,
  *,
  freeze_step: int,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  mask=None,
  axis_name: exchange.AxisName = None,
  warmup_codec: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """1-bit Adam (module docstring): AdamW's warm-up, then 1-bit momentum.

  Args:
    learning_rate: a float or an optax schedule of the update count.
    freeze_step: updates of dense AdamW before the variance freezes and the
      momentum is compressed (update ``freeze_step + 1`` is the first
      compressed one).
    b1, b2, eps: Adam's.
    weight_decay: decoupled weight decay, as ``optax.adamw``'s.
    mask: ``optax.adamw``'s weight-decay mask (a tree of bools, or a
      function of the params).
    axis_name: the workers' mesh axis, or ``None`` on one device.
    warmup_codec: ``None`` (the paper's dense float32 all-reduce through
      the warm-up), or a gradcomp compressor over ``axis_name`` whose mean
      of the workers' gradients AdamW takes instead (module docstring,
      "A compressed warm-up"), e.g. ``gradcomp.int_quantize(8, 64,
      exchange="scatter", axis_name=...)``.

  Returns:
    An ``optax.GradientTransformation`` whose ``update(grads, state,
    params)`` takes each worker's own gradient and returns the same update
    on every worker. ``params`` are required.

  Raises:
    ValueError: a hyper-parameter outside its range, or a ``warmup_codec``
      that is not a transformation over ``axis_name``, named.

  Examples:
    With ``freeze_step`` past the last update it is ``optax.adamw`` (on one
    device, the dense mean is the gradient itself):

    >>> import jax.numpy as jnp, optax
    >>> from gradcomp.optimizers.onebit_adam import onebit_adam
    >>> p, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 0.25])}
    >>> tx = onebit_adam(0.1, freeze_step=10)
    >>> ref = optax.adamw(0.1, weight_decay=0.0)
    >>> u, _ = tx.update(g, tx.init(p), p)
    >>> v, _ = ref.update(g, ref.init(p), p)
    >>> bool(jnp.array_equal(u["w"], v["w"]))
    True
  """
  check_adam(learning_rate, b1, b2, eps, weight_decay, freeze_step=freeze_step)
  tx = frozen_variance.frozen_variance_adam(
    learning_rate,
    onebit_exchange(axis_name),
    OneBitAdamState,
    name="onebit_adam",
    freeze_step=freeze_step,
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=weight_decay,
    mask=mask,
    axis_name=axis_name,
    warmup_codec=warmup_codec,
  )
  # Its axes filed so hierarchical() can take it as its inner;
  # params that are shards of a partition across axis_name are refused.
  return axes.checked(tx, axis_name, strict=False)
