"""Compressors by name, for configs and command lines: ``gradcomp.get("topk", ratio=0.01)``."""

from __future__ import annotations

from collections.abc import Callable

import optax

from gradcomp.compressors.dense import fp16, none
from gradcomp.compressors.dgc import dgc
from gradcomp.compressors.fixed_point import dynamic_fixed_point, fixed_point
from gradcomp.compressors.intq import int_quantize
from gradcomp.compressors.lowp import fp4, fp8
from gradcomp.compressors.onebit import onebit_sgd
from gradcomp.compressors.powersgd import powersgd
from gradcomp.compressors.qgz import qgz
from gradcomp.compressors.quantizers import qsgd, terngrad
from gradcomp.compressors.randomk import randomk
from gradcomp.compressors.signs import ef_signsgd, signsgd
from gradcomp.compressors.sketch_topk import sketch_topk
from gradcomp.compressors.sparse_quantize import sparse_quantize
from gradcomp.compressors.threshold import threshold_quantize
from gradcomp.compressors.topk import topk

_REGISTRY: dict[str, Callable[..., optax.GradientTransformation]] = {}


def register(name: str, factory: Callable[..., optax.GradientTransformation]) -> None:
  """Makes ``factory`` available as ``gradcomp.get(name, ...)``.

  Args:
    name: the new name; names are never removed or replaced.
    factory: builds the transformation from keyword arguments.

  Raises:
    ValueError: ``name`` is already registered.

  Examples:
    >>> import gradcomp
    >>> gradcomp.register("topk", gradcomp.topk)
    Traceback (most recent call last):
      ...
    ValueError: a compressor named 'topk' is already registered
  """
  if name in _REGISTRY:
    raise ValueError(f"a compressor named {name!r} is already registered")
  _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
  """The registered compressor names, sorted.

  Examples:
    >>> import gradcomp
    >>> print(", ".join(gradcomp.names()))  # doctest: +NORMALIZE_WHITESPACE
    dgc, dynamic_fixed_point, ef_signsgd, fixed_point, fp16, fp4, fp8,
    int_quantize, none, onebit_sgd, powersgd, qgz, qsgd, randomk, signsgd,
    sketch_topk, sparse_quantize, terngrad, threshold_quantize, topk
  """
  return tuple(sorted(_REGISTRY))


def get(name: str, **kwargs) -> optax.GradientTransformation:
  """Builds the compressor registered as ``name`` with keyword arguments.

  Raises:
    ValueError: for an unknown name (the message lists the valid ones) or, from
      the factory, for invalid hyper-parameters.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.get("topk", ratio=0.5)  # gradcomp.topk(ratio=0.5)
    >>> g = {"w": jnp.array([0.5, -3.0, 1.0, 2.0])}
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [0.0, -3.0, 0.0, 2.0]
    >>> gradcomp.get("top_k", ratio=0.5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    ValueError: unknown compressor 'top_k'; valid names: dgc, ..., topk
    >>> gradcomp.get("topk", ratio=2.0)
    Traceback (most recent call last):
      ...
    ValueError: ratio must be in (0, 1], got 2.0
  """
  try:
    factory = _REGISTRY[name]
  except KeyError:
    raise ValueError(
      f"unknown compressor {name!r}; valid names: {', '.join(names())}"
    ) from None
  return factory(**kwargs)


for _factory in (
  none,
  fp16,
  topk,
  randomk,
  dgc,
  qsgd,
  terngrad,
  signsgd,
  ef_signsgd,
  powersgd,
  threshold_quantize,
  sketch_topk,
  onebit_sgd,
  fixed_point,
  dynamic_fixed_point,
  sparse_quantize,
  fp8,
  fp4,
  int_quantize,
  qgz,
):
  register(_factory.__name__, _factory)
