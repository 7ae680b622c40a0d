"""The sparse payload shared by the sparsifiers: (values, int32 indices).

Top-k and DGC choose different coordinates on every worker, so their payloads
are all-gathered and scatter-added (paper 004 §4, sparsification); random-k
shares its indices and all-reduces the values instead (``randomk.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gradcomp.compressors import exchange
from gradcomp.kernels import ordering


def gather_mean(
  values: jax.Array, indices: jax.Array, size: int, axis_name: exchange.AxisName
) -> jax.Array:
  """Dense flat mean over workers of ``scatter(values, indices)``.

  Index ``size`` marks an empty slot (dropped).
  """
  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver
    return exchange.gathered_sum(
      (values, indices),
      lambda v, i: jnp.zeros((size,), jnp.float32).at[i].add(v, mode="drop"),
      axis_name,
    )
  n = exchange.num_workers(axis_name)
  all_values, all_indices = exchange.all_gather((values, indices), axis_name)
  return exchange.scatter_mean(all_values, all_indices, size, n)


def all_reduce_mean_at(
  flat: jax.Array, indices: jax.Array, axis_name: exchange.AxisName
) -> jax.Array:
  """Dense flat mean over workers of ``flat`` at ``indices`` shared by all workers.

  The indices are the same on every worker, so only the ``k`` values cross
  the wire (all-reduce). Index ``flat.size`` marks an empty slot (dropped).
  """
  values = exchange.all_reduce_mean(gather_at(flat, indices), axis_name)
  return scatter_into_zeros(values, indices, flat.shape[0])


def gather_at(flat: jax.Array, indices: jax.Array) -> jax.Array:
  """``flat[indices]``, 0 at an empty slot (index ``flat.size``)."""
  return flat.at[indices].get(mode="fill", fill_value=0.0)


def scatter_into_zeros(values: jax.Array, indices: jax.Array, size: int) -> jax.Array:
  """Dense float32 ``size`` zeros with ``values`` at ``indices`` (empty slots dropped).

  The zero fill depends on ``values`` (``kernels/ordering.py``), so XLA can
  write it into a buffer whose last read comes before ``values`` (the
  gradient's) rather than fresh memory. Replicated ``values`` (an all-reduced
  mean) give a replicated result.
  """
  zeros = jnp.full((size,), ordering.zero_after(values), jnp.float32)
  return zeros.at[indices].set(values, mode="drop")


def zero_at(
  x: jax.Array, indices: jax.Array, *, after: jax.Array | None = None
) -> jax.Array:
  """``x`` with the coordinates ``indices`` of its flat view set to zero.

  ``after``: the values gathered from ``x`` at ``indices``. The in-place
  zeroing then waits for that gather (``kernels/ordering.py``); without the
  dependency XLA copies ``x`` first (top-k: one gradient-sized copy a call).
  """
  if after is not None:
    indices = indices + ordering.zero_after(after).astype(indices.dtype)
  return x.reshape(-1).at[indices].set(0.0, mode="drop").reshape(x.shape)
