"""The sparse payload shared by the sparsifiers: (values, int32 indices).

Top-k and DGC choose different coordinates on every worker, so their payloads
are all-gathered and scatter-added (paper 004 §4, sparsification); random-k
shares its indices and all-reduces the values instead (``randomk.py``).

Indices are flat (row-major) positions in a leaf; index ``size`` marks an
empty slot. The gathers and scatters here work on the leaf's own shape
(:func:`unravel`) rather than on a flat view: when a multi-dimensional
residual or output was written through a reshape, XLA:CPU copied the whole
buffer into the donated one it aliases (one gradient-sized copy a call in
random-k, two in top-k and DGC; BUILD_NOTES, issue 18).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from gradcomp.compressors import exchange
from gradcomp.kernels import ordering


def unravel(indices: jax.Array, shape: Sequence[int]) -> tuple[jax.Array, ...]:
  """Row-major leaf coordinates of flat ``indices``.

  Unlike ``jnp.unravel_index`` nothing is clipped: an empty slot (flat index
  ``prod(shape)``) lands past the first axis, so gathers fill it and scatters
  drop it as on a flat view. A scalar leaf has no axis to index: callers view
  it as shape ``(1,)`` (:func:`_indexable`).
  """
  coordinates = []
  for extent in reversed(shape[1:]):
    coordinates.append(indices % extent)
    indices = indices // extent
  coordinates.append(indices)
  return tuple(reversed(coordinates))


def gather_mean(
  values: jax.Array,
  indices: jax.Array,
  shape: Sequence[int],
  axis_name: exchange.AxisName,
) -> jax.Array:
  """Dense mean over workers of ``scatter(values, indices)``, of ``shape``."""
  if isinstance(axis_name, exchange.Pattern):  # decoded by each receiver
    return exchange.gathered_sum(
      (values, indices),
      lambda v, i: scatter_mean(v, i, shape, 1),
      axis_name,
    )
  n = exchange.num_workers(axis_name)
  all_values, all_indices = exchange.all_gather((values, indices), axis_name)
  return scatter_mean(all_values, all_indices, shape, n)


def scatter_mean(values, indices, shape: Sequence[int], n: int) -> jax.Array:
  """Dense mean of gathered sparse payloads: ``sum_w scatter(values_w) / n``.

  The ``1 / n`` is applied to the ``n * k`` values, not to the dense output.
  """
  scaled = values.reshape(-1).astype(jnp.float32) * (1.0 / n)
  zeros = _indexable(_zeros_after(scaled, shape))
  at = unravel(indices.reshape(-1), zeros.shape)
  return zeros.at[at].add(scaled, mode="drop").reshape(shape)


def all_reduce_mean_at(
  x: jax.Array, indices: jax.Array, axis_name: exchange.AxisName
) -> jax.Array:
  """Dense mean over workers of ``x`` at ``indices`` shared by all workers.

  The indices are the same on every worker, so only the ``k`` values cross
  the wire (all-reduce).
  """
  values = exchange.all_reduce_mean(gather_at(x, indices), axis_name)
  return scatter_into_zeros(values, indices, x.shape)


def gather_at(x: jax.Array, indices: jax.Array) -> jax.Array:
  """``x.reshape(-1)[indices]``, 0 at an empty slot, materialised.

  The buffer gathered from is usually overwritten in place next (a residual
  zeroed at the sent slots). XLA:GPU otherwise fuses the gather into each
  later consumer of the values, reading ``x`` after it was overwritten, and
  copies all of ``x`` to keep that read valid (random-k on an H200: two
  gradient-sized copies, 0.66 against 0.42 ms; BUILD_NOTES, issue 18). The
  barrier keeps the k values in memory; XLA:CPU removes it and orders the
  reads through ``kernels/ordering.py``'s dependencies.
  """
  x = _indexable(x)
  values = x.at[unravel(indices, x.shape)].get(mode="fill", fill_value=0.0)
  return jax.lax.optimization_barrier(values)


def scatter_into_zeros(
  values: jax.Array, indices: jax.Array, shape: Sequence[int]
) -> jax.Array:
  """Dense float32 zeros of ``shape`` with ``values`` at ``indices``.

  Replicated ``values`` (an all-reduced mean) give a replicated result.
  """
  zeros = _indexable(_zeros_after(values, shape))
  at = unravel(indices, zeros.shape)
  return zeros.at[at].set(values, mode="drop").reshape(shape)


def _zeros_after(values: jax.Array, shape: Sequence[int]) -> jax.Array:
  """float32 zeros of ``shape``, filled once ``values`` exist.

  The dependency (``kernels/ordering.py``) lets XLA write the zeros into a
  buffer whose last read comes before ``values`` (the gradient's) rather
  than into fresh memory.
  """
  return jnp.full(shape, ordering.zero_after(values), jnp.float32)


def zero_at(
  x: jax.Array, indices: jax.Array, *, after: jax.Array | None = None
) -> jax.Array:
  """``x`` with the flat coordinates ``indices`` set to zero.

  ``after``: the values gathered from ``x`` at ``indices``, or anything
  computed from them (their mean). The in-place zeroing then waits for that
  gather (``kernels/ordering.py``); without the dependency XLA copies ``x``
  first (top-k: one gradient-sized copy a call).
  """
  if after is not None:
    indices = indices + ordering.zero_after(after).astype(indices.dtype)
  view = _indexable(x)
  return view.at[unravel(indices, view.shape)].set(0.0, mode="drop").reshape(x.shape)


def add_at(x: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
  """``x`` plus ``values`` at distinct flat ``indices``, in place."""
  view = _indexable(x)
  return view.at[unravel(indices, view.shape)].add(values, mode="drop").reshape(x.shape)


def _indexable(x: jax.Array) -> jax.Array:
  """``x``, or a scalar as shape ``(1,)``: a 0-d array takes no index."""
  return x.reshape(1) if x.ndim == 0 else x
