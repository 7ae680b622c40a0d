"""The Gossip training balancer (paper 002 §3.3, Algorithm 1).

Before each epoch, from each platform's predicted throughput ``p_i`` (samples
per second, :mod:`gradcomp.edgegossip.predictor`) and its data size
``|X_i|``:

.. math::

  T_i = \\frac{|X_i|}{p_i}, \\qquad
  r_i = \\frac{T_{\\min}}{T_i} \\quad (T_{\\min} = \\min_{\\text{live } j} T_j),

so every live platform needs the same time, ``r_i |X_i| / p_i = T_min``, to
process its share ``r_i`` of its own data; the fastest keeps ``r = 1``. A
platform with ``p_i < p_threshold`` (0.001 in §3.3) has failed: ``T_i =
inf``, ``r_i = 0``. When the failed share ``sum_i F_i / E`` exceeds
``f_threshold`` (10 % in §3.3) the algorithm halts and triggers an exception
handling (lines 10-12).

Readings (what the paper leaves open):

* **Halting.** :func:`balance` raises :class:`BalancerHalted` (the failed
  platforms and the would-be result attached) by default; with
  ``on_halt="flag"`` it returns the result with ``halted=True`` and the
  ratios of the live platforms, for a caller that reassigns the failed
  platforms' work itself. Algorithm 1 tests the share inside its loop; the
  share only grows along the loop, so testing it once at the end halts on
  exactly the same inputs.
* **Comparisons** are the printed ones: failed when ``p_i <
  speed_threshold``, halt when the share ``> failure_threshold`` (strict).
* **Order.** Line 14 sorts the platforms only to find ``T[1] = T_min``; after
  the sort, lines 15-19's ``r_1 ... r_E`` index the sorted list. We return
  ``r_i`` in the caller's platform order, with ``T_min`` from a minimum
  (``O(E)`` instead of ``O(E log E)``).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
from numpy.typing import ArrayLike

#: §3.3: "If platform i's performance p_i is smaller than a threshold (e.g., 0.001)".
DEFAULT_SPEED_THRESHOLD = 1e-3
#: §3.3: "larger than a threshold f_threshold (e.g., 10 percent)".
DEFAULT_FAILURE_THRESHOLD = 0.1
ON_HALT = ("raise", "flag")


@dataclasses.dataclass(frozen=True, eq=False)
class Balance:
  """Algorithm 1's result for one epoch (paper 002 §3.3).

  Attributes:
    ratios: ``(E,)`` float64 ``r_i`` in ``[0, 1]``; 0 for failed platforms, 1
      for the fastest live one.
    times: ``(E,)`` float64 ``T_i = |X_i| / p_i`` seconds; ``inf`` if failed.
    failed: ``(E,)`` bool ``F[i]``.
    halted: whether the failed share exceeded ``failure_threshold``.

  Examples:
    Platform 1 has failed (speed 0); platform 2 takes twice as long as
    platform 0, so it keeps half its data. One failure in three exceeds the
    default 10 %: ``on_halt="flag"`` returns instead of raising.

    >>> b = balance([100, 100, 100], [10.0, 0.0, 5.0], on_halt="flag")
    >>> b.ratios.tolist(), b.times.tolist(), b.failed.tolist(), b.halted
    ([1.0, 0.0, 0.5], [10.0, inf, 20.0], [False, True, False], True)
    >>> b.epoch_seconds, b.budgets([100, 100, 100]).tolist()
    (10.0, [100.0, 0.0, 50.0])
  """

  ratios: np.ndarray
  times: np.ndarray
  failed: np.ndarray
  halted: bool

  @property
  def failed_share(self) -> float:
    """``sum_i F[i] / E``."""
    return float(self.failed.mean())

  @property
  def epoch_seconds(self) -> float:
    """``T_min``: every live platform's predicted time for its share; inf if none."""
    return float(self.times.min())

  def budgets(self, sizes: ArrayLike) -> np.ndarray:
    """``r_i |X_i|``: the samples each platform processes this epoch (float64)."""
    return self.ratios * np.asarray(sizes, dtype=np.float64)


class BalancerHalted(RuntimeError):
  """Algorithm 1, lines 10-12: too many platforms failed to balance the epoch.

  Attributes:
    balance: the :class:`Balance` computed over the live platforms.
    failed: indices of the failed platforms.
  """

  def __init__(self, balance: Balance, failure_threshold: float):
    self.balance = balance
    self.failed = np.flatnonzero(balance.failed)
    super().__init__(
      f"{self.failed.size} of {balance.failed.size} platforms failed (share "
      f"{balance.failed_share:.3g} > failure_threshold {failure_threshold:.3g}): "
      f"platforms {self.failed.tolist()}"
    )


def _check_vector(name: str, value: ArrayLike) -> np.ndarray:
  a = np.asarray(value)
  if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iuf":
    raise ValueError(
      f"{name} must be a non-empty 1-D real array, got {a.dtype} {a.shape}"
    )
  a = a.astype(np.float64)
  if not np.all(np.isfinite(a)):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return a


def _check_real(name: str, value, interval: str) -> float:
  """``value`` in ``interval``, written ``"(0, inf)"`` or ``"[0, 1)"``."""
  low, high = (float(v) for v in interval[1:-1].split(", "))
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if ok:
    v = float(value)
    ok = (low < v if interval[0] == "(" else low <= v) and (
      v < high if interval[-1] == ")" else v <= high
    )
  if not ok:
    raise ValueError(f"{name} must be in {interval}, got {value!r}")
  return float(value)


def balance(
  sizes: ArrayLike,
  speeds: ArrayLike,
  *,
  speed_threshold: float = DEFAULT_SPEED_THRESHOLD,
  failure_threshold: float = DEFAULT_FAILURE_THRESHOLD,
  on_halt: str = "raise",
) -> Balance:
  """Algorithm 1: each platform's ratio of kept data for the next epoch.

  Args:
    sizes: ``(E,)`` ``|X_i|``, each platform's number of samples, >= 1.
    speeds: ``(E,)`` ``p_i``, predicted samples per second, >= 0.
    speed_threshold: ``p_threshold`` > 0: a platform with ``p_i`` below it has
      failed (§3.3: 0.001); live platforms thus have ``p_i > 0``.
    failure_threshold: ``f_threshold`` in ``[0, 1)``: halt when the failed
      share exceeds it (§3.3: 0.1).
    on_halt: ``"raise"`` (:class:`BalancerHalted`) or ``"flag"`` (return with
      ``halted=True``).

  Returns:
    The :class:`Balance`, ratios in the order of ``sizes``.

  Raises:
    BalancerHalted: the failed share exceeds ``failure_threshold`` and
      ``on_halt == "raise"``.

  Examples:
    >>> b = balance([100, 100, 50], [10.0, 5.0, 10.0])
    >>> b.ratios.tolist(), b.epoch_seconds
    ([0.5, 0.25, 1.0], 5.0)
  """
  sizes = _check_vector("sizes", sizes)
  speeds = _check_vector("speeds", speeds)
  if sizes.shape != speeds.shape:
    raise ValueError(
      f"sizes and speeds must have the same length, got {sizes.size} and {speeds.size}"
    )
  if np.any(sizes < 1):
    raise ValueError(f"sizes must be >= 1, got {sizes.tolist()}")
  if np.any(speeds < 0):
    raise ValueError(f"speeds must be >= 0, got {speeds.tolist()}")
  speed_threshold = _check_real("speed_threshold", speed_threshold, "(0, inf)")
  failure_threshold = _check_real("failure_threshold", failure_threshold, "[0, 1)")
  if on_halt not in ON_HALT:
    raise ValueError(f"on_halt must be one of {ON_HALT}, got {on_halt!r}")

  failed = speeds < speed_threshold  # lines 3-5
  times = np.where(failed, np.inf, sizes / np.where(failed, 1.0, speeds))  # 6-8
  live = ~failed
  ratios = np.zeros_like(times)
  if live.any():
    t_min = times[live].min()  # line 14: T[1] after the sort
    ratios[live] = t_min / times[live]  # lines 15-18
  halted = bool(failed.mean() > failure_threshold)  # lines 10-12
  result = Balance(ratios=ratios, times=times, failed=failed, halted=halted)
  if halted and on_halt == "raise":
    raise BalancerHalted(result, failure_threshold)
  return result
