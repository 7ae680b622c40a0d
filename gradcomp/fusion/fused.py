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

  # The inner state over the fused buffers; ``{form: state}`` for a plan with forms.
  inner: optax.OptState


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


def _groups_of(leaves, plan: Plan) -> tuple:
  """The leaves of each group of ``plan``, as a tuple of tuples (not fused)."""
  return tuple(tuple(leaves[i] for i in group) for group in plan.groups)


def _ungroup(groups, plan: Plan, like) -> list:
  """Inverse of :func:`_groups_of`, each leaf cast back to the dtype of ``like``."""
  leaves = [None] * plan.num_leaves
  for group, outputs in zip(plan.groups, groups, strict=True):
    for i, out in zip(group, outputs, strict=True):
      leaves[i] = numerics.saturate(jnp.reshape(out, jnp.shape(like[i])), like[i].dtype)
  return leaves


def _groups_by_form(plan: Plan) -> dict[str, list[int]]:
  """``{form: positions of its groups}``, the forms in order of first use."""
  positions: dict[str, list[int]] = {}
  for g, form in enumerate(plan.forms):
    positions.setdefault(form, []).append(g)
  return positions


def fusion_transform(
  inner: optax.GradientTransformation,
  resolve: Callable[[list], Plan],
  in_form: Callable[[str], optax.GradientTransformation] | None = None,
  per_leaf: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """``inner`` on the fused buffers of the plan ``resolve(leaves)`` returns.

  ``resolve`` is static Python on the leaves (shapes only), so the wrapper
  works inside ``jit``, ``shard_map`` and ``pmap``, and ``init`` accepts
  ``jax.ShapeDtypeStruct`` params; ``params``, when given to ``update``, are
  fused the same way before ``inner`` sees them.

  A plan with :attr:`Plan.forms` hands the buffers of each form, as one
  tuple in group order, to ``in_form(form)`` (``inner`` built with that
  ``exchange=``); the state is then ``{form: its state}``.

  ``per_leaf``, for a plan without forms: ``inner``'s per-leaf
  form (``gradcomp.compressors.scopes.per_leaf_form``). It is handed the
  tuple of groups, each the tuple of its leaves in plan order, rather than
  their concatenations, so that each leaf keeps ``inner``'s per-leaf
  semantics inside the group's program; its state replaces ``inner``'s.
  """
  built: dict[str, optax.GradientTransformation] = {}

  def for_form(form: str) -> optax.GradientTransformation:
    if in_form is None:
      raise ValueError(
        "the plan gives its groups exchange forms; pass a compressor with an "
        "exchange= keyword to layerfusion, which builds one per form"
      )
    if form not in built:
      built[form] = in_form(form)
    return built[form]

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    plan = resolve(leaves)
    if per_leaf is not None and plan.forms is None:
      return LayerFusionState(inner=per_leaf.init(_groups_of(leaves, plan)))
    buffers = _fuse(leaves, plan)
    if plan.forms is None:
      return LayerFusionState(inner=inner.init(buffers))
    return LayerFusionState(
      inner={
        form: for_form(form).init(tuple(buffers[g] for g in groups))
        for form, groups in _groups_by_form(plan).items()
      }
    )

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree.flatten(updates)
    fusion = resolve(leaves)
    if per_leaf is not None and fusion.forms is None:
      grouped_params = None
      if params is not None:
        grouped_params = _groups_of(treedef.flatten_up_to(params), fusion)
      groups, inner_state = per_leaf.update(
        _groups_of(leaves, fusion), state.inner, grouped_params
      )
      out = _ungroup(groups, fusion, leaves)
      return jax.tree.unflatten(treedef, out), LayerFusionState(inner=inner_state)
    fused_params = None
    if params is not None:
      fused_params = _fuse(treedef.flatten_up_to(params), fusion)
    fused_updates = _fuse(leaves, fusion)
    if fusion.forms is None:
      buffers, inner_state = inner.update(fused_updates, state.inner, fused_params)
    else:
      buffers, inner_state = [None] * len(fused_updates), {}
      for form, groups in _groups_by_form(fusion).items():
        part = None if fused_params is None else tuple(fused_params[g] for g in groups)
        out, inner_state[form] = for_form(form).update(
          tuple(fused_updates[g] for g in groups), state.inner[form], part
        )
        for g, buffer in zip(groups, out, strict=True):
          buffers[g] = buffer
    out = _split(buffers, fusion, leaves)
    return jax.tree.unflatten(treedef, out), LayerFusionState(inner=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def fused(
  inner: optax.GradientTransformation,
  plan: Plan,
  in_form: Callable[[str], optax.GradientTransformation] | None = None,
  per_leaf: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """``inner`` on the buffers of one fixed ``plan`` (for trees of its leaf count).

  ``in_form``: for a plan with :attr:`Plan.forms`, ``inner`` in each form;
  ``per_leaf``: ``inner``'s per-leaf form (:func:`fusion_transform`).
  """

  def resolve(leaves) -> Plan:
    if plan.num_leaves != len(leaves):
      raise ValueError(
        f"the plan is for {plan.num_leaves} leaves, the tree has {len(leaves)}"
      )
    return plan

  return fusion_transform(inner, resolve, in_form, per_leaf)
