"""What every scheme shares: the contract's checks and its state's copy of the params.

DESIGN §5: a scheme's ``update`` needs the worker's own params (``None`` is a
``ValueError``: the scheme cannot say where the params should go without
knowing where they are), its hyper-parameters are validated in the factory,
and a compressor or optimizer it wraps must be an optax transformation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def require_params(params, scheme: str):
  """``params``, or a ``ValueError`` saying why ``scheme`` needs them."""
  if params is None:
    raise ValueError(
      f"{scheme}.update needs the worker's own params: call "
      f"tx.update(grads, state, params) (DESIGN §5); got params=None"
    )
  return params


def transformation(name: str, value, *, optional: bool = False):
  """``value`` if it is an ``optax.GradientTransformation`` (or ``None`` if allowed)."""
  if value is None and optional:
    return None
  if not (
    isinstance(value, optax.GradientTransformation)
    or (
      callable(getattr(value, "init", None))
      and callable(getattr(value, "update", None))
    )
  ):
    allowed = "an optax.GradientTransformation" + (" or None" if optional else "")
    raise ValueError(f"{name} must be {allowed}, got {type(value).__name__}: {value!r}")
  return value


def copy_params(params):
  """``params`` as a state entry: arrays, or ``ShapeDtypeStruct`` kept as such.

  ``init`` on abstract params (``jax.ShapeDtypeStruct``, for sharding
  decisions before any array exists) returns abstract entries of the same
  shapes and dtypes, as the compressors' ``jnp.zeros`` states do. Arrays are
  copied: a state entry sharing the params' buffer would be donated twice by
  a training step that donates both.
  """
  return jax.tree.map(
    lambda p: p if isinstance(p, jax.ShapeDtypeStruct) else jnp.array(p, copy=True),
    params,
  )
