"""The mechanism of LayerFusion: fuse groups of leaves, apply ``inner``, split back.

Paper 000 §4.1 (Algorithm 2). :func:`fusion_transform` applies ``inner`` to one
buffer per group of the plan a ``resolve`` function picks for the leaves it
sees; :func:`fused` is that for one fixed :class:`~gradcomp.fusion.plan.Plan`.
:func:`~gradcomp.fusion.layerfusion.layerfusion` builds on it (named and
``"auto"`` plans), and the profiler times fused buffers with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.fusion.plan import Plan
from gradcomp.kernels import numerics


class LayerFusionState(NamedTuple):
  """State of :func:`layerfusion`.

  Examples:
    ``inner`` sees the fused buffers, so its state is shaped like them: with
    ``"single"``, top-k's error-feedback residual is one buffer of 2 + 6
    values; layer-wise, one residual per leaf.

    >>> import jax.numpy as jnp, gradcomp
    >>> params = {"a": jnp.ones(2), "b": jnp.ones((2, 3))}
    >>> state = gradcomp.layerfusion(gradcomp.topk(0.5), "single").init(params)
    >>> type(state).__name__, [r.residual.shape for r in state.inner.leaves]
    ('LayerFusionState', [(8,)])
    >>> state = gradcomp.layerfusion(gradcomp.topk(0.5), "layerwise").init(params)
    >>> [r.residual.shape for r in state.inner.leaves]
    [(2,), (2, 3)]
  """

  inner: optax.OptState  # the inner transformation's state over the fused buffers.


def _fuse(leaves, plan: Plan) -> tuple:
  """One buffer per group of ``plan``, in the plan's (gradient-ready) order.

  A group of one leaf is that leaf as it is (shape and dtype kept); a larger
  group is the float32 concatenation of its raveled leaves. Leaves that are
  ``jax.ShapeDtypeStruct`` give ``jax.ShapeDtypeStruct`` buffers.
  """
  buffers = []
  for group in plan.groups:
    if len(group) == 1:
      buffers.append(leaves[group[0]])
      continue
    members = [leaves[i] for i in group]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in members):
      size = sum(int(x.size) for x in members)
      buffers.append(jax.ShapeDtypeStruct((size,), jnp.float32))
    else:
      buffers.append(
        jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in members])
      )
  return tuple(buffers)


def _split(buffers, plan: Plan, like) -> list:
  """Inverse of :func:`_fuse`: the leaves, with the shapes and dtypes of ``like``."""
  leaves = [None] * plan.num_leaves
  for group, buffer in zip(plan.groups, buffers, strict=True):
    start = 0
    for i in group:
      shape, dtype = jnp.shape(like[i]), like[i].dtype
      size = int(jnp.size(like[i]))
      piece = buffer if len(group) == 1 else buffer[start : start + size]
      # Saturating: a float32 value beyond a 16-bit leaf's range becomes its
      # largest finite value, not Inf (issue 11 §6).
      leaves[i] = numerics.saturate(jnp.reshape(piece, shape), dtype)
      start += size
  return leaves


def fusion_transform(
  inner: optax.GradientTransformation, resolve: Callable[[list], Plan]
) -> optax.GradientTransformation:
  """``inner`` on the fused buffers of the plan ``resolve(leaves)`` returns.

  ``resolve`` is static Python on the leaves (shapes only), so the wrapper
  works inside ``jit``, ``shard_map`` and ``pmap``, and ``init`` accepts
  ``jax.ShapeDtypeStruct`` params; ``params``, when given to ``update``, are
  fused the same way before ``inner`` sees them.
  """

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    return LayerFusionState(inner=inner.init(_fuse(leaves, resolve(leaves))))

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree.flatten(updates)
    fusion = resolve(leaves)
    fused_params = None
    if params is not None:
      fused_params = _fuse(treedef.flatten_up_to(params), fusion)
    buffers, inner_state = inner.update(
      _fuse(leaves, fusion), state.inner, fused_params
    )
    out = _split(buffers, fusion, leaves)
    return jax.tree.unflatten(treedef, out), LayerFusionState(inner=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def fused(
  inner: optax.GradientTransformation, plan: Plan
) -> optax.GradientTransformation:
  """``inner`` on the buffers of one fixed ``plan`` (for trees of its leaf count)."""

  def resolve(leaves) -> Plan:
    if plan.num_leaves != len(leaves):
      raise ValueError(
        f"the plan is for {plan.num_leaves} leaves, the tree has {len(leaves)}"
      )
    return plan

  return fusion_transform(inner, resolve)
