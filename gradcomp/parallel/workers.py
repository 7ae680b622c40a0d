"""Per-worker state under ``shard_map``.

Compressor state is per worker (residuals differ between workers). The
faithful layout outside the step gives every state leaf a leading worker axis
sharded over the data axis; inside ``shard_map`` each worker sees a block of
size 1 on that axis, which the step drops before ``tx.update`` and restores
after. Under ``pmap`` the mapped axis plays that role and needs none of this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def add_worker_axis(tree, num_workers: int = 1):
  """Every leaf repeated ``num_workers`` times along a new leading axis.

  Examples:
    A compressor state laid out for 8 workers, ready to be split over them:

    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> state = gradcomp.topk(0.5).init({"w": jnp.zeros(3)})
    >>> stacked = gradcomp.add_worker_axis(state, 8)
    >>> stacked.count.shape, stacked.key.shape, stacked.leaves["w"].residual.shape
    ((8,), (8, 2), (8, 3))
  """
  return jax.tree.map(
    lambda x: jnp.broadcast_to(x[None], (num_workers, *jnp.shape(x))), tree
  )


def drop_worker_axis(tree):
  """Inverse of ``add_worker_axis(tree, 1)``: each leaf's (size-1) axis 0 removed.

  Examples:
    What a worker does with its block of a per-worker tree inside ``shard_map``:

    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> block = gradcomp.add_worker_axis({"w": jnp.arange(3.0)})
    >>> block["w"].shape, gradcomp.drop_worker_axis(block)["w"].tolist()
    ((1, 3), [0.0, 1.0, 2.0])
  """
  return jax.tree.map(lambda x: x[0], tree)


def sharded_update(tx, mesh, axis_name: str):
  """``shard_map`` of one ``tx.update`` over the workers of ``mesh``.

  Returns ``f(grads, state) -> (updates, state)``, every tree with a leading
  worker axis split over ``axis_name``: each worker updates its own block.
  ``mesh`` may be an ``AbstractMesh`` (for tracing without devices).
  """

  def step(grads, state):
    updates, state = tx.update(drop_worker_axis(grads), drop_worker_axis(state))
    return add_worker_axis((updates, state))

  return jax.shard_map(step, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name))
