"""Training schemes on the program's side: one module per family, one registry.

``config.scheme.name`` picks a :class:`~train.schemes.base.Scheme` subclass
from :data:`REGISTRY`; the loop (``train/train.py``) calls only its hooks.
A new scheme is a subclass in a new module and a line here, or, without
touching ``train/``, a :func:`register` call in a module imported before the
run (its config file, say).
"""

from __future__ import annotations

from train import optimizer as optimizer_lib
from train.schemes.base import Scheme
from train.schemes.cdsgd import CDSGD
from train.schemes.edgegossip import EdgeGossip
from train.schemes.gossip import GoSGD, Gossip
from train.schemes.periodic import EASGD, LocalSGD, SparseLoCo, StaleSGD
from train.schemes.synchronous import Synchronous
from train.schemes.timed import AsyncPS, BackupWorkers

REGISTRY: dict[str, type[Scheme]] = {
  cls.name: cls
  for cls in (
    Synchronous,
    LocalSGD,
    SparseLoCo,
    EASGD,
    StaleSGD,
    CDSGD,
    Gossip,
    GoSGD,
    AsyncPS,
    BackupWorkers,
    EdgeGossip,
  )
}


def register(cls: type[Scheme]) -> type[Scheme]:
  """Adds ``cls`` under ``cls.name`` (usable as a class decorator)."""
  REGISTRY[cls.name] = cls
  return cls


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


def get(config) -> type[Scheme]:
  """The scheme class of ``config``.

  Raises:
    ValueError: an unknown name, listing the registered ones.
  """
  name = optimizer_lib.scheme_name(config)
  if name not in REGISTRY:
    raise ValueError(
      f"unknown scheme {name!r} (config.scheme.name); valid: {', '.join(REGISTRY)}"
    )
  return REGISTRY[name]


__all__ = ["REGISTRY", "Scheme", "build", "get", "names", "register"]


def build(
  config, order, total_steps: int, sizes=None, saved_plan=None, mask=None, like=None
):
  """``(tx, plan)`` of ``config`` without a run around it (benchmarks, tests).

  For a scheme whose optimizer needs no workload or mesh (synchronous
  training and the schemes without a speed table); see
  :func:`train.schemes.base.build_optimizer` for the arguments (``like``,
  the params' shapes, on an FSDP mesh).
  """
  cls = get(config)
  scheme = cls(cls.resolve(config), None, None, "shard_map")
  return scheme.optimizer(order, sizes, saved_plan, total_steps, mask, like)
