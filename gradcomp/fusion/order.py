"""The order in which backprop produces the gradients of the parameters.

LayerFusion groups leaves contiguously in *gradient-ready order* (paper 000
§4.1, Algorithm 2; §4.3: with wait-free backprop a group is exchanged while the
layers below it are still differentiating). Pytree key order is not that order:
flax (like ``jax.tree`` on any dict) sorts parameter dicts by name, so
``Dense_10`` comes before ``Dense_2`` and ``"out"`` before ``"hidden"``. The
order is read instead from the computation: the reverse-mode pass visits the
forward equations backwards, so the parameter used last in the forward pass
gets its gradient first.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jex_core

from gradcomp.models.shapes import PASS_THROUGH


class _FirstUse:
  """Walks a jaxpr in program order, recording each leaf's first real use."""

  def __init__(self):
    self.position = 0
    self.first: dict[int, int] = {}

  def use(self, leaf: int) -> None:
    self.first.setdefault(leaf, self.position)

  def walk(self, jaxpr, leaf_of: dict) -> dict:
    """Visits ``jaxpr``; ``leaf_of`` maps its vars to the leaf they carry.

    Returns the map for the jaxpr's outputs (an output that is a parameter
    passed through carries that parameter out of a ``jit`` or ``custom_jvp``).
    """
    leaf_of = dict(leaf_of)
    for eqn in jaxpr.eqns:
      self.position += 1
      inputs = [_leaf(leaf_of, v) for v in eqn.invars]
      if not any(i is not None for i in inputs):
        continue
      name = eqn.primitive.name
      if name in PASS_THROUGH and len(eqn.invars) == len(eqn.outvars):
        for i, out in zip(inputs, eqn.outvars, strict=True):
          if i is not None:
            leaf_of[out] = i
        continue
      inner = _sub_jaxprs(eqn)
      if inner is None:  # an opaque primitive uses all of its operands here
        for i in inputs:
          if i is not None:
            self.use(i)
        continue
      for sub, operands, passes_outputs in inner:
        sub_leaf_of = {}
        for var, operand in zip(sub.invars, operands, strict=True):
          i = _leaf(leaf_of, operand)
          if i is not None:
            sub_leaf_of[var] = i
        out_leaf_of = self.walk(sub, sub_leaf_of)
        if passes_outputs:
          for inner_out, out in zip(sub.outvars, eqn.outvars, strict=True):
            i = _leaf(out_leaf_of, inner_out)
            if i is not None:
              leaf_of[out] = i
    return leaf_of


def _leaf(leaf_of: dict, var):
  if isinstance(var, jex_core.Literal):
    return None
  return leaf_of.get(var)


def _open(jaxpr):
  return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def _sub_jaxprs(eqn):
  """``[(jaxpr, operand vars, outputs map 1:1)]`` for a higher-order eqn.

  Handles ``cond`` (the branches take the operands after the index),
  ``while`` (cond and body consts, then the carry) and every primitive with a
  single sub-jaxpr whose inputs are the equation's inputs (``jit``,
  ``custom_jvp_call``, ``custom_vjp_call``, ``scan``, ``remat``,
  ``shard_map``, ``closed_call``). Returns ``None`` for anything else, which
  is then treated as using its operands where it stands.
  """
  inputs = eqn.invars
  params = eqn.params
  name = eqn.primitive.name
  if name == "cond":
    return [(_open(b), inputs[1:], False) for b in params["branches"]]
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    carry = inputs[nc + nb :]
    return [
      (_open(params["cond_jaxpr"]), [*inputs[:nc], *carry], False),
      (_open(params["body_jaxpr"]), [*inputs[nc : nc + nb], *carry], False),
    ]
  subs = [
    _open(v)
    for v in params.values()
    if isinstance(v, jex_core.ClosedJaxpr | jex_core.Jaxpr)
  ]
  if len(subs) != 1 or len(subs[0].invars) != len(inputs):
    return None
  sub = subs[0]
  one_to_one = name != "scan" and len(sub.outvars) == len(eqn.outvars)
  return [(sub, inputs, one_to_one)]


def gradient_order(
  loss_fn: Callable[..., jax.Array], params, *batch
) -> tuple[int, ...]:
  """Leaf indices of ``params`` in the order backprop makes their gradients ready.

  Traces ``loss_fn(params, *batch)`` with ``jax.make_jaxpr`` and walks the
  forward jaxpr in program order, recursing into sub-jaxprs (``jit``,
  ``custom_jvp`` / ``custom_vjp``, ``scan``, ``while``, ``cond``, ``remat``,
  ``shard_map``), to find the first equation that uses each leaf of
  ``jax.tree.leaves(params)``. Casts, reshapes and other pass-through ops are
  followed to the op that consumes their result, so a mixed-precision cast of
  every parameter at the top of the model does not count as a use. Reverse
  mode visits the equations backwards, so the leaves are returned by
  *decreasing* first use: the parameter used last in the forward pass (the
  output layer) first. This is the order LayerFusion groups leaves in
  (paper 000 §4.1, Algorithm 2; §4.3: wait-free backprop).

  Tree order is not layer order: ``jax.tree`` and flax sort dict keys, so a
  model's parameters come out sorted by name (``Dense_10`` before
  ``Dense_2``), whatever the order of the layers.

  Args:
    loss_fn: ``loss_fn(params, *batch) -> scalar``; traced, never run.
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
    *batch: the remaining arguments of ``loss_fn`` (arrays or
      ``jax.ShapeDtypeStruct``).

  Returns:
    A permutation of ``range(len(jax.tree.leaves(params)))``. Leaves first
    used by the same equation keep their tree order; leaves the loss never
    uses come last, in tree order.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"a_in": jnp.ones((3, 4)), "b_out": jnp.ones((4, 1))}
    >>> loss = lambda p, x: jnp.sum((x @ p["a_in"]) @ p["b_out"])
    >>> gradient_order(loss, params, jnp.ones((2, 3)))
    (1, 0)
  """
  num_leaves = len(jax.tree.leaves(params))
  closed = jax.make_jaxpr(loss_fn)(params, *batch)
  jaxpr = closed.jaxpr
  walker = _FirstUse()
  leaf_of = {var: i for i, var in enumerate(jaxpr.invars[:num_leaves])}
  out_leaf_of = walker.walk(jaxpr, leaf_of)
  # A parameter returned as it is (after pass-through ops) is used at the end.
  walker.position += 1
  for var in jaxpr.outvars:
    i = _leaf(out_leaf_of, var)
    if i is not None:
      walker.use(i)
  used = sorted(walker.first, key=lambda i: (-walker.first[i], i))
  unused = [i for i in range(num_leaves) if i not in walker.first]
  return tuple(used + unused)
