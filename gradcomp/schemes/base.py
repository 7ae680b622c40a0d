"""What every scheme shares: the contract's checks and its state's copy of the params.

A scheme's ``update`` needs the worker's own params (``None`` is a
``ValueError``: the scheme cannot say where the params should go without
knowing where they are), its hyper-parameters are validated in the factory,
and a compressor or optimizer it wraps must be an optax transformation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def require_params(params, scheme: str):
  """``params``, or a ``ValueError`` saying why ``scheme`` needs them."""
  if params is None:
    raise ValueError(
      f"{scheme}.update needs the worker's own params: call "
      f"tx.update(grads, state, params); got params=None"
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


def stacked_copies(params, count: int):
  """``count`` copies of ``params`` on a new leading axis, as a state entry.

  Abstract params (``jax.ShapeDtypeStruct``) give abstract entries, as
  :func:`copy_params` does.
  """
  return jax.tree.map(
    lambda p: (
      jax.ShapeDtypeStruct((count, *p.shape), p.dtype)
      if isinstance(p, jax.ShapeDtypeStruct)
      else jnp.broadcast_to(jnp.asarray(p), (count, *p.shape))
    ),
    params,
  )


def nonnegative(name: str, value, *, integer: bool = False, optional: bool = False):
  """``value`` checked to be a finite number (or integer) >= 0, or ``None`` if allowed.

  Raises:
    ValueError: naming ``name``, the valid range and ``value``.
  """
  if value is None and optional:
    return None
  kinds = (int,) if integer else (int, float)
  if isinstance(value, bool) or not isinstance(value, kinds) or not value >= 0:
    what = "an integer" if integer else "a number"
    none = " or None" if optional else ""
    raise ValueError(f"{name} must be {what} in [0, inf){none}, got {value!r}")
  if not integer and not np.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return value if integer else float(value)


def seed(value) -> int:
  """``value`` checked to be an integer PRNG seed."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"seed must be an integer, got {value!r}")
  return value
