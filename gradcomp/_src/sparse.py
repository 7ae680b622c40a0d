"""The sparse payload shared by the sparsifiers: (values, int32 indices).

Top-k and DGC choose different coordinates on every worker, so their payloads
are all-gathered and scatter-added (paper 004 §4, sparsification); random-k
shares its indices and all-reduces the values instead (``randomk.py``).
"""

from __future__ import annotations

import jax

from gradcomp._src import exchange


def gather_mean(
  values: jax.Array, indices: jax.Array, size: int, axis_name: exchange.AxisName
) -> jax.Array:
  """Dense flat mean over workers of ``scatter(values, indices)``.

  Index ``size`` marks an empty slot (dropped).
  """
  n = exchange.num_workers(axis_name)
  all_values, all_indices = exchange.all_gather((values, indices), axis_name)
  return exchange.scatter_mean(all_values, all_indices, size, n)


def zero_at(x: jax.Array, indices: jax.Array) -> jax.Array:
  """``x`` with the coordinates ``indices`` of its flat view set to zero."""
  return x.reshape(-1).at[indices].set(0.0, mode="drop").reshape(x.shape)
