"""Validation of static hyper-parameters, done in the factories, outside jit."""

from __future__ import annotations

import math


def fraction(name: str, value) -> float:
  """A ratio in (0, 1]."""
  if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
    raise ValueError(f"{name} must be in (0, 1], got {value!r}")
  return float(value)


def at_least(name: str, value, low: int, high: int | None = None) -> int:
  """An integer in [low, high]."""
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
  if ok and high is not None:
    ok = value <= high
  if not ok:
    upper = "inf)" if high is None else f"{high}]"
    raise ValueError(f"{name} must be an integer in [{low}, {upper}, got {value!r}")
  return value


def positive(name: str, value) -> float:
  """A finite float > 0."""
  if not (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
    and value > 0
  ):
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
  return float(value)


def in_range(name: str, value, low: float, high: float) -> float:
  """A float in [low, high)."""
  if not (isinstance(value, (int, float)) and low <= value < high):
    raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
  return float(value)


def keep_count(ratio: float, size: int) -> int:
  """Number of coordinates a sparsifier keeps: ``max(1, floor(ratio * d))``."""
  return max(1, int(ratio * size))
