r"""SparseLoCo: DiLoCo whose pseudo-gradients are chunked top-k in 2 bits with decayed EF.

Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM
Pre-training with SparseLoCo", 2025, arXiv 2508.15706 (Alg. 1), and Templar's
code (``tplr-ai/templar``, ``src/tplr/compress/topk.py``; read to cross-check).
The scheme is :func:`gradcomp.local_sgd` (not a copy of it): a round's
pseudo-gradient goes through ``gradcomp.topk(k / chunk**2, chunk=chunk,
value_bits=value_bits, ef_decay=ef_decay)``, and the outer optimizer is plain
SGD: the decayed error feedback takes the place of DiLoCo's outer momentum.
"""

from __future__ import annotations

import math

import optax

from gradcomp.compressors import checks, exchange, memory
from gradcomp.compressors import topk as topk_lib
from gradcomp.schemes import base
from gradcomp.schemes.local_sgd import local_sgd


def ratio(k: int, chunk: int) -> float:
  """The ``topk`` ratio that keeps exactly ``k`` of a ``chunk x chunk`` tile.

  ``k / chunk**2``, nudged up by float ulps where its product with
  ``chunk**2`` rounds below ``k`` (a ``chunk`` that is not a power of two),
  so that ``max(1, floor(ratio * chunk**2)) == k``.

  Examples:
    >>> from gradcomp.schemes.sparseloco import ratio
    >>> ratio(64, 64), int(ratio(7, 50) * 2500)
    (0.015625, 7)
  """
  tile = chunk * chunk
  r = k / tile
  while checks.keep_count(r, tile) < k:
    r = math.nextafter(r, 1.0)
  return r


def codec(
  k: int,
  chunk: int = 64,
  value_bits: int = 2,
  ef_decay: float = 0.95,
  axis_name: exchange.AxisName = None,
  mean: str = "workers",
):
  """The compressor a SparseLoCo round sends its pseudo-gradient through.

  ``gradcomp.topk(ratio(k, chunk), chunk=chunk, value_bits=value_bits,
  ef_decay=ef_decay, axis_name=axis_name, mean=mean)``, for pricing a round
  apart from the scheme (the training program does).
  """
  return topk_lib.topk(
    ratio(k, chunk),
    chunk=chunk,
    value_bits=value_bits,
    ef_decay=ef_decay,
    axis_name=axis_name,
    mean=mean,
  )


def sparseloco(
  inner: optax.GradientTransformation,
  *,
  every: int,
  outer_learning_rate: float,
  k: int,
  chunk: int = 64,
  value_bits: int = 2,
  ef_decay: float = 0.95,
  axis_name: exchange.AxisName = None,
  mean: str = "workers",
) -> optax.GradientTransformation:
  r"""SparseLoCo: local steps, then a sparse, quantised, error-fed outer SGD step.

  Worker :math:`r` of :math:`R` applies ``inner`` to its own gradients for
  ``every`` (:math:`H`) steps from the shared params :math:`\theta`, then a
  round (Alg. 1 of Sarfi et al. 2025):

  .. math::

    \Delta_r &= \theta - \theta_r \\
    e_r &\leftarrow \beta\, e_r + \Delta_r \\
    \hat\Delta_r &= Q\big(\operatorname{Top}_k(e_r)\big) \\
    e_r &\leftarrow e_r - \hat\Delta_r \\
    \theta &\leftarrow \theta - \alpha\, \tfrac{1}{R} \textstyle\sum_r \hat\Delta_r,
      \qquad \theta_r \leftarrow \theta

  with :math:`\beta` = ``ef_decay`` and :math:`\alpha` =
  ``outer_learning_rate``. :math:`\operatorname{Top}_k` keeps the ``k``
  largest magnitudes of each ``chunk x chunk`` tile of every leaf (tiles cut
  as DeMo cuts them: each axis by its largest divisor ``<= chunk``; a vector
  in chunks of ``chunk``, a leaf of more dimensions as the matrix
  ``(prod(shape[:-1]), shape[-1])``); a tile of ``P`` values that is not
  ``chunk**2`` keeps ``max(1, floor(k P / chunk**2))``, the same density.
  :math:`Q` codes each kept value in ``value_bits`` bits with a per-tile
  scale (``gradcomp.topk``'s *Values*; 32: float32 values).

  It is ``gradcomp.local_sgd(inner, every, outer=optax.sgd(alpha),
  compressor=codec(k, chunk, value_bits, ef_decay, axis_name))``: the state
  is a :class:`~gradcomp.schemes.local_sgd.LocalSGDState` whose compressor
  state holds each worker's :math:`e_r` (the error feedback's residual) and
  whose outer state is SGD's (empty). With ``k = chunk**2`` and
  ``value_bits=32`` everything is sent exactly, the residual stays 0, and
  this is DiLoCo with a plain-SGD outer step.

  **Wire.** A round sends, per worker and leaf, ``gradcomp.topk``'s payload
  (all-gathered): ``T k`` positions of ``ceil(log2(P))`` bits each (12 on a
  64 x 64 tile), ``T k`` codes of ``value_bits`` bits and ``T`` float32
  scales, bytes rounded up per leaf
  (:func:`gradcomp.compressors.topk.payload_bytes`); local steps send
  nothing. With the defaults a 64 x 64 tile of float32 (16 KiB) sends
  ``k (12 + 2) / 8 + 4`` bytes: 116 at ``k = 64`` (1.56 %), 141x less.

  **Defaults.** ``chunk=64`` and ``value_bits=2`` are the paper's; its
  densities are 1-3 % (``k`` of 41 to 123 per 4096), so ``k`` has no
  default. ``ef_decay=0.95`` is the project's choice (Templar's ``SparseLoCo``
  optimizer defaults to 0.999). The 8-bit codes of Templar's code are
  ``value_bits=8``.

  **Readings.** The mean divides by all :math:`R` workers (Alg. 1);
  ``mean="senders"`` divides each coordinate by the workers that sent it, as
  Templar's ``scatter_reduce("mean", include_self=False)`` does (the same
  wire: receivers count the senders from the positions). With 1-3 % sent
  per worker, a coordinate few workers send arrives at ``s/R`` of its
  senders' mean under Alg. 1 and whole under Templar's. The memory adds the
  raw pseudo-gradient (Alg. 1; Templar's optimizer adds ``lr * grad``, a
  constant factor top-k does not see); the per-tile
  statistics, decoding to bin centres and no mean shift are
  ``gradcomp.topk``'s (its docstring says why).

  Args:
    inner: the worker's local optimizer (the paper: AdamW).
    every: local steps per round :math:`H`, >= 1.
    outer_learning_rate: :math:`\alpha`, a finite number > 0.
    k: values kept per ``chunk x chunk`` tile, an integer in
      ``[1, chunk**2]``.
    chunk: the side of a tile, an integer >= 1.
    value_bits: bits per sent value, an integer in [1, 8], or 32 (float32).
    ef_decay: the error feedback's decay :math:`\beta`, in [0, 1].
    axis_name: the mapped axis of the workers, or ``None`` for one worker.
    mean: ``"workers"`` (Alg. 1: divide by :math:`R`) or ``"senders"``
      (Templar's code: divide each coordinate by the workers that sent it).

  Returns:
    An ``optax.GradientTransformation`` with
    :class:`~gradcomp.schemes.local_sgd.LocalSGDState`; its ``update``
    requires ``params``.

  Raises:
    ValueError: a hyper-parameter out of its range, naming it, its value and
      the range; an ``inner`` that is not an optax transformation.

  Examples:
    One worker, two local steps, a round: the 2 x 2 leaf is one tile, ``k =
    1`` keeps its largest pseudo-gradient value, in float32 here.

    >>> import jax.numpy as jnp, optax
    >>> from gradcomp.schemes.sparseloco import sparseloco
    >>> tx = sparseloco(optax.sgd(0.5), every=2, outer_learning_rate=1.0,
    ...                 k=1, chunk=2, value_bits=32, ef_decay=0.5)
    >>> params = {"w": jnp.zeros((2, 2))}
    >>> state = tx.init(params)
    >>> g = {"w": jnp.array([[1.0, -4.0], [2.0, 0.5]])}
    >>> for _ in range(2):
    ...   updates, state = tx.update(g, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"].tolist()  # Delta = 2 * 0.5 * g; only -4.0's entry moves
    [[0.0, 4.0], [0.0, 0.0]]
    >>> state.compressor_state.leaves["w"].residual.tolist()  # e - sent
    [[1.0, 0.0], [2.0, 0.5]]

  References:
    Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM
    Pre-training with SparseLoCo", 2025, arXiv 2508.15706, §3, Alg. 1;
    Templar, https://github.com/tplr-ai/templar (``src/tplr/compress/topk.py``);
    Douillard et al., "DiLoCo", 2023, arXiv 2311.08105, Alg. 1.
  """
  inner = base.transformation("inner", inner)
  every = checks.at_least("every", every, 1)
  outer_learning_rate = checks.positive("outer_learning_rate", outer_learning_rate)
  chunk = checks.at_least("chunk", chunk, 1)
  k = checks.at_least("k", k, 1, chunk * chunk)
  value_bits = topk_lib.check_value_bits(value_bits)
  ef_decay = memory.check_decay(ef_decay)
  mean = topk_lib.check_mean(mean, axis_name, chunk, value_bits)
  return local_sgd(
    inner,
    every,
    outer=optax.sgd(outer_learning_rate),
    compressor=codec(k, chunk, value_bits, ef_decay, axis_name, mean),
    axis_name=axis_name,
  )
