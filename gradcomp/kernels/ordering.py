"""Data dependencies that let XLA write a result into a dead buffer in place.

XLA decides whether an output may reuse an input's buffer (a donated
gradient, an error-feedback residual) from the data dependencies between the
operations alone: a buffer written by an operation that no dependency orders
after every read of the old contents gets a fresh copy first. On CPU a fresh
100 MB buffer costs a pass of copying plus first-touch page faults on every
call (BUILD_NOTES, issue 18): random-k on the ResNet-50 gradient spent 3 of
its 4 full-size passes on such copies. ``lax.optimization_barrier`` does not
help there: XLA:CPU expands it before it inserts copies.

:func:`zero_after` supplies the missing dependency: a scalar 0 that XLA can
compute only once ``x`` exists, to be added to, or broadcast as, the operand
of the operation that must come later (the zero fill of a sparse output after
the last read of the gradient it overwrites).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_after(x: jax.Array) -> jax.Array:
  """A float32 ``+0.0`` that depends on ``x`` (read at one element).

  ``min(|s|, 0)`` is ``+0.0`` for every non-NaN ``s`` (infinities included)
  and the select maps NaN to ``+0.0`` too, so the value is always ``+0.0``;
  XLA does not fold it (a float ``min`` and ``abs`` of an unknown value), so
  every user of the result is ordered after ``x`` is computed. Typing: the
  result varies over the mesh axes ``x`` varies over (use a replicated ``x``
  for a replicated result).
  """
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  s = x.reshape(-1)[0].astype(jnp.float32)
  return jnp.where(s == s, jnp.minimum(jnp.abs(s), 0.0), 0.0)
