"""Deep Gradient Compression (Lin et al., ICLR 2018).

Paper 000 Table 1 (DGC 1%) and ref. [30]; paper 004 §4 (momentum correction and
momentum factor masking). DGC is top-k-like sparsification with its own memory:
momentum is accumulated *before* sparsification (momentum correction), the
accumulated velocity is what is sent, and both buffers are cleared where a
coordinate was sent (factor masking). The threshold is estimated from a sample
instead of an exact top-k of the whole tensor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors.base import LeafCodec, leafwise
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import numerics
from gradcomp.kernels.selection import threshold_top_k

MIN_SAMPLE = 1024

# DGC's exponential warm-up of the density: 25%, 6.25%, 1.5625%, 0.4% (§3.3).
WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)


class DGCLeafState(NamedTuple):
  momentum: jax.Array  # leaf shape, float32: u, momentum-corrected gradient.
  velocity: jax.Array  # leaf shape, float32: v, accumulated and not yet sent.


def warmup_schedule(ratio: float, warmup_steps: int) -> tuple[list[float], int]:
  """``(densities, steps per stage)`` of the exponential warm-up (§3.3).

  The :data:`WARMUP_DENSITIES` above ``ratio``, then ``ratio``; each stage
  lasts ``warmup_steps // (stages - 1)`` steps (at least 1). Without a
  warm-up, ``([ratio], 1)``.
  """
  densities = [d for d in WARMUP_DENSITIES if d > ratio] if warmup_steps else []
  densities.append(ratio)
  return densities, max(1, warmup_steps // max(1, len(densities) - 1))


def sample_size(sample_ratio: float, size: int) -> int:
  """Positions sampled for a leaf's threshold: at least :data:`MIN_SAMPLE` (or all).

  A tiny sample's quantile is noise.
  """
  return max(MIN_SAMPLE, math.ceil(sample_ratio * size))


def clipped(g: jax.Array, clip_norm: float | None, n: int) -> jax.Array:
  """Local clipping of a leaf to ``clip_norm / sqrt(n)`` (§3.4), overflow-free.

  With ``||g|| = p * root``, ``g * c / ||g|| = (g / p) * (c / root)``.
  """
  if clip_norm is None:
    return g
  c = clip_norm / math.sqrt(n)
  p, root = numerics.scaled_norm(g)
  return jnp.where(root > c / p, g / p * (c / root), g)


def dgc_codec(
  ratio: float,
  momentum: float,
  clip_norm: float | None,
  warmup_steps: int,
  sample_ratio: float,
  axis_name: exchange.AxisName,
) -> LeafCodec:
  """The DGC memory and sparsifier of one leaf."""
  densities, stage_steps = warmup_schedule(ratio, warmup_steps)

  def init(leaf, key):
    del key
    # Two distinct buffers, so that the state can be donated.
    return DGCLeafState(
      momentum=jnp.zeros_like(leaf, jnp.float32),  # sharded as the params
      velocity=jnp.zeros_like(leaf, jnp.float32),
    )

  def apply(g, state, key, step):
    shape, size = g.shape, g.size
    n = exchange.num_workers(axis_name)
    # Local clipping: each worker's share of the global norm (§3.4).
    g = clipped(g, clip_norm, n)
    old_u, old_v = state.momentum, state.velocity
    # memory.py's per-coordinate policy: a gradient coordinate that would
    # make the momentum non-finite counts as 0, and a velocity coordinate
    # that would overflow keeps its value; decided inside each pass, so no
    # pass reads the buffers only to check them. u is written over the old
    # momentum, then v = old_v + u over the old velocity, both in place (each
    # pass is the last to read what it overwrites); XLA wrote u, v and the
    # output to fresh memory when v was computed from the old momentum too
    # (77 of 96 ms on the ResNet-50 buffer, BUILD_NOTES issue 18).
    u = memory.corrected(momentum * old_u, g)
    v = memory.corrected(old_v, u)
    sampled = sample_size(sample_ratio, size)

    def exchange_at(density):
      def run(v):
        k = checks.keep_count(density, size)
        values, indices = threshold_top_k(v.reshape(-1), k, sampled)
        return sparse.gather_mean(values, indices, shape, axis_name), indices

      return run

    if len(densities) == 1:
      mean, indices = exchange_at(densities[0])(v)

      def clear(a):
        return sparse.zero_at(a, indices)

    else:
      # Each warm-up stage has its own static payload size; the stage index is
      # the same on every worker, so all take the same branch.
      def with_unsent_mask(density):
        def run(v):
          mean, indices = exchange_at(density)(v)
          return mean, sparse.zero_at(jnp.ones_like(v), indices)

        return run

      which = jnp.minimum(step // stage_steps, len(densities) - 1)
      branches = [with_unsent_mask(d) for d in densities]
      mean, unsent = jax.lax.switch(which, branches, v)

      def clear(a):
        return a * unsent

    # Momentum factor masking: what was sent stops accumulating momentum.
    remainder = clear(v)
    new_state = DGCLeafState(momentum=clear(u), velocity=remainder)
    return mean, remainder, new_state

  return LeafCodec(init, apply)


@recorded
def dgc(
  ratio: float,
  *,
  momentum: float = 0.9,
  axis_name: exchange.AxisName = None,
  clip_norm: float | None = None,
  warmup_steps: int = 0,
  sample_ratio: float = 0.01,
) -> optax.GradientTransformation:
  """Deep Gradient Compression.

  .. math::
    u = m u + g,\\quad v = v + u,\\quad S = \\{i : |v_i| \\ge \\theta\\},\\quad
    \\bar g = \\tfrac{1}{n}\\textstyle\\sum_w v_w \\odot 1_{S_w},\\quad
    u \\leftarrow u \\odot 1_{\\bar S},\\ v \\leftarrow v \\odot 1_{\\bar S}

  ``theta`` is the ``(1 - density)`` quantile of ``|v|`` estimated on a
  systematic sample (every ``1 / sample_ratio``-th coordinate); at most ``k = floor(density *
  d)`` coordinates are sent (values + int32 indices, all-gathered), the largest
  when more pass the threshold. Momentum is applied here, so chain DGC with
  plain ``optax.sgd(lr)`` (no momentum).

  Bad input, per coordinate (the policy of ``memory.py``): a gradient
  coordinate that is NaN or Inf, or that overflows ``m u + g``, counts as 0
  (``u = m u``), and a velocity coordinate that would overflow keeps its
  value, so state and output stay finite; a wholly non-finite gradient is
  dropped whole and ``v`` is sent as usual. The clipping
  norm is computed overflow-free. An output beyond a 16-bit leaf's range
  (its velocity keeps growing while unsent) saturates at the leaf dtype's
  maximum (``leafwise``).

  Args:
    ratio: final density (fraction of coordinates sent), in (0, 1].
    momentum: ``m`` in [0, 1).
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    clip_norm: if set, local gradient clipping of each leaf to
      ``clip_norm / sqrt(n)`` (§3.4; applied per compressed leaf or buffer).
    warmup_steps: length of the exponential sparsity warm-up (densities 25%,
      6.25%, 1.5625%, 0.4% down to ``ratio``, in equal stages); 0 disables it.
    sample_ratio: fraction of coordinates sampled for the threshold, in (0, 1].

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.dgc(0.25, momentum=0.5)  # 1 of 4 coordinates per step
    >>> update = jax.jit(tx.update)
    >>> g = {"w": jnp.array([1.0, -4.0, 2.0, 0.5])}
    >>> out, state = update(g, tx.init(g))  # u = v = g
    >>> out["w"].tolist()
    [0.0, -4.0, 0.0, 0.0]
    >>> out, state = update(g, state)  # u = 0.5 u + g, v = v + u
    >>> out["w"].tolist(), state.leaves["w"].velocity.tolist()
    ([0.0, 0.0, 5.0, 0.0], [2.5, -4.0, 0.0, 1.25])

  References:
    Lin et al., *Deep Gradient Compression*, ICLR 2018, §3; paper 000 Table 1.
  """
  ratio = checks.fraction("ratio", ratio)
  momentum = checks.in_range("momentum", momentum, 0.0, 1.0)
  if clip_norm is not None:
    clip_norm = checks.positive("clip_norm", clip_norm)
  warmup_steps = checks.at_least("warmup_steps", warmup_steps, 0)
  sample_ratio = checks.fraction("sample_ratio", sample_ratio)
  codec = dgc_codec(ratio, momentum, clip_norm, warmup_steps, sample_ratio, axis_name)
  return leafwise(codec)
