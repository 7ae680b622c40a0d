"""``config.islands``, read and checked once (DESIGN §12).

Fields: ``count`` (islands started), ``devices_per_island`` (virtual CPU
devices each island's JAX program runs on), ``rounds`` (outer rounds of the
run), ``min_quorum``, ``grace_seconds``, ``round_timeout_seconds`` (a round
with fewer than ``min_quorum`` payloads after this long stops the run),
``checkpoint_every_rounds`` (0: never), ``address`` (``None``: a local Ray
started in-process on 127.0.0.1; else the address of a running cluster,
``"auto"`` or ``"HOST:6379"``), ``inject`` (a failure plan,
``train/islands/plan.py``), ``max_restarts`` (Ray restarts of one island,
-1: unbounded), ``eval_every_rounds``, ``compilation_cache`` (a directory for JAX's
persistent compilation cache shared by the islands; ``None``:
``$JAX_COMPILATION_CACHE_DIR`` if set, else ``workdir/xla_cache``).
"""

from __future__ import annotations

import dataclasses
import math

from train.islands import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class Settings:
  """The checked fields of ``config.islands`` (see the module docstring)."""

  count: int
  devices_per_island: int
  rounds: int
  min_quorum: int
  grace_seconds: float
  round_timeout_seconds: float
  checkpoint_every_rounds: int
  address: str | None
  inject: tuple[plan_lib.Fault, ...]
  max_restarts: int
  eval_every_rounds: int
  compilation_cache: str | None


def _integer(name: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(
      f"config.islands.{name} must be an integer >= {low}, got {value!r}"
    )
  return value


def _seconds(name: str, value, positive: bool) -> float:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  ok = ok and math.isfinite(value) and (value > 0 if positive else value >= 0)
  if not ok:
    bound = "> 0" if positive else ">= 0"
    raise ValueError(
      f"config.islands.{name} must be a finite number {bound}, got {value!r}"
    )
  return float(value)


def read(cfg) -> Settings:
  """:class:`Settings` from ``config.islands`` (a ``ConfigDict`` or a mapping).

  Raises:
    ValueError: naming the field, its value and the valid range.
  """
  get = cfg.get
  count = _integer("count", get("count", 3), 1)
  min_quorum = _integer("min_quorum", get("min_quorum", 1), 1)
  if min_quorum > count:
    raise ValueError(
      f"config.islands.min_quorum must be in [1, {count}] (islands.count), got "
      f"{min_quorum}"
    )
  restarts = get("max_restarts", -1)
  if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < -1:
    raise ValueError(
      f"config.islands.max_restarts must be an integer >= -1 (-1: unbounded), got "
      f"{restarts!r}"
    )
  address = get("address", None)
  if address is not None and (not isinstance(address, str) or not address):
    raise ValueError(
      f"config.islands.address must be None (a local Ray on 127.0.0.1), 'auto' or "
      f"'HOST:PORT', got {address!r}"
    )
  return Settings(
    count=count,
    devices_per_island=_integer("devices_per_island", get("devices_per_island", 2), 1),
    rounds=_integer("rounds", get("rounds", 40), 1),
    min_quorum=min_quorum,
    grace_seconds=_seconds("grace_seconds", get("grace_seconds", 1.0), False),
    round_timeout_seconds=_seconds(
      "round_timeout_seconds", get("round_timeout_seconds", 120.0), True
    ),
    checkpoint_every_rounds=_integer(
      "checkpoint_every_rounds", get("checkpoint_every_rounds", 0), 0
    ),
    address=address,
    inject=plan_lib.parse(get("inject", None), count),
    max_restarts=restarts,
    eval_every_rounds=_integer("eval_every_rounds", get("eval_every_rounds", 0), 0),
    compilation_cache=get("compilation_cache", None),
  )
