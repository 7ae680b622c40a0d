"""Compressors by name, for configs and command lines: ``gradcomp.get("topk", ratio=0.01)``."""

from __future__ import annotations

from collections.abc import Callable

import optax

from gradcomp.compressors.dense import fp16, none
from gradcomp.compressors.dgc import dgc
from gradcomp.compressors.fixed_point import dynamic_fixed_point, fixed_point
from gradcomp.compressors.onebit import onebit_sgd
from gradcomp.compressors.powersgd import powersgd
from gradcomp.compressors.quantizers import qsgd, terngrad
from gradcomp.compressors.randomk import randomk
from gradcomp.compressors.signs import ef_signsgd, signsgd
from gradcomp.compressors.sketch_topk import sketch_topk
from gradcomp.compressors.sparse_quantize import sparse_quantize
from gradcomp.compressors.threshold import threshold_quantize
from gradcomp.compressors.topk import topk

_REGISTRY: dict[str, Callable[..., optax.GradientTransformation]] = {}


def register(name: str, factory: Callable[..., optax.GradientTransformation]) -> None:
  """Makes ``factory`` available as ``gradcomp.get(name, ...)``."""
  if name in _REGISTRY:
    raise ValueError(f"a compressor named {name!r} is already registered")
  _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
  """The registered compressor names, sorted."""
  return tuple(sorted(_REGISTRY))


def get(name: str, **kwargs) -> optax.GradientTransformation:
  """Builds the compressor registered as ``name`` with keyword arguments.

  Raises:
    ValueError: for an unknown name (the message lists the valid ones) or, from
      the factory, for invalid hyper-parameters.
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
):
  register(_factory.__name__, _factory)
