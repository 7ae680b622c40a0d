"""What a compressor is: its factory and arguments, recorded when it is built.

An ``optax.GradientTransformation`` is two closures; nothing in it says which
algorithm it runs. LayerFusion's planner (paper 000 §4.3) needs to know: it
times the compressor alone on one device (``axis_name=None``) and traces it on
an abstract mesh to count its wire bytes, and it must refuse a profile measured
for another compressor. Every public factory is therefore wrapped by
:func:`recorded`, which files a :class:`CompressorSpec` under the returned
transformation's ``update`` function (weakly, so nothing is kept alive).

Being the one place every public factory goes through, :func:`recorded` also
guards ``axis_name`` against params sharded across it (``axes.checked``;
a no-op unless ``axis_name`` names several mesh axes).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import optax

from gradcomp.compressors import axes

_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
  """A compressor's factory and the arguments it was called with.

  Attributes:
    factory: the public factory (e.g. ``gradcomp.topk``).
    arguments: every argument by name, defaults filled in.
  """

  factory: Callable[..., optax.GradientTransformation]
  arguments: tuple[tuple[str, Any], ...]

  @property
  def name(self) -> str:
    return self.factory.__name__

  @property
  def axis_name(self):
    return dict(self.arguments).get("axis_name")

  @property
  def hyperparameters(self) -> dict[str, Any]:
    """The arguments that define the algorithm: all but ``axis_name``."""
    return {k: v for k, v in self.arguments if k != "axis_name"}

  def label(self) -> str:
    """``"topk(error_feedback=True, ratio=0.01)"``: the identity a profile records."""
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.hyperparameters.items()))
    return f"{self.name}({args})"

  def build(self, **overrides) -> optax.GradientTransformation:
    """The same compressor, with some arguments replaced (e.g. ``axis_name``)."""
    return self.factory(**{**dict(self.arguments), **overrides})


def recorded(factory):
  """Decorates a compressor factory so that :func:`spec_of` can describe its results.

  The result's ``init`` and ``update`` also refuse params that are different
  shards across the factory's ``axis_name`` (:func:`axes.checked`).
  """
  signature = inspect.signature(factory)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    tx = factory(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    tx = axes.checked(tx, bound.arguments.get("axis_name"))
    _SPECS[tx.update] = CompressorSpec(build, tuple(bound.arguments.items()))
    return tx

  return build


def spec_of(tx: optax.GradientTransformation) -> CompressorSpec | None:
  """The spec of a transformation built by a gradcomp factory, else ``None``."""
  try:
    return _SPECS.get(tx.update)
  except TypeError:  # an update that cannot be weakly referenced
    return None
