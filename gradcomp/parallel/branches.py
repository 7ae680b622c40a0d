"""``lax.cond`` whose branches may differ in which mesh axes their outputs vary over.

Under ``shard_map`` every value is typed varying or invariant over each mesh
axis, and ``lax.cond`` requires both branches to return the same types. A
scheme's synchronisation round (a collective) and its local step (none) do
not: the round may turn an invariant input (a residual still zero at
``init``) into a varying output, the local branch passes it through. The
join casts each output leaf of both branches to the union of the axes it
varies over in either branch, which is what the value is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def varying_axes(x) -> frozenset:
  """The mesh axes ``x`` (a traced value or a ``ShapeDtypeStruct``) is typed varying over.

  Empty outside ``shard_map`` (``pmap`` and one device type nothing).
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def joined_cond(pred, true_fun: Callable, false_fun: Callable, *operands):
  """``lax.cond(pred, true_fun, false_fun, *operands)`` with output types joined.

  Outside ``shard_map`` (``pmap``, one device) no value is typed varying and
  this is ``lax.cond``. Each branch is traced once more by ``eval_shape`` to
  learn its output types.
  """
  shapes = [jax.eval_shape(f, *operands) for f in (true_fun, false_fun)]
  union = jax.tree.map(
    lambda a, b: varying_axes(a) | varying_axes(b), shapes[0], shapes[1]
  )

  def cast(x, axes):
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  def joined(f):
    return lambda *ops: jax.tree.map(cast, f(*ops), union)

  return jax.lax.cond(pred, joined(true_fun), joined(false_fun), *operands)
