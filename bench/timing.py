"""Wall-clock timing helpers for the benchmarks.

Everything here blocks on the results (:func:`jax.block_until_ready`), reports
medians, and separates the first call (tracing + compilation + one run) from the
steady state. Absolute times on a shared CPU drift between processes (up to 2.5x,
``PERFORMANCE_NOTES.md``), so suites report ratios against a floor measured in the
same run (:func:`copy_bandwidth_gbps`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Timing:
  """Times of one benchmarked callable, in milliseconds.

  Attributes:
    first_ms: the first call: tracing, compilation and one run.
    times_ms: the timed calls after warm-up.
  """

  first_ms: float
  times_ms: tuple[float, ...]

  @property
  def median_ms(self) -> float:
    return statistics.median(self.times_ms)

  @property
  def min_ms(self) -> float:
    return min(self.times_ms)


def _timed_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
  t0 = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  elapsed = (time.perf_counter() - t0) * 1e3
  # Released after the clock stops: returning a 100 MB buffer to glibc is an
  # munmap of 25K pages (~7 ms on this CPU), the caller's cost, not the call's.
  del result
  return elapsed


def time_calls(
  fn: Callable[..., Any], *args: Any, repeats: int = 7, warmup: int = 1
) -> Timing:
  """Times ``fn(*args)``: one first call, ``warmup`` untimed calls, ``repeats`` timed.

  ``fn`` may be a stateful closure (e.g. one that feeds a donated state back into
  the next call); every call's result is blocked on before the clock stops.

  Args:
    fn: the callable, typically a jitted function.
    *args: its arguments, the same for every call.
    repeats: number of timed calls (at least 1).
    warmup: number of untimed calls after the first one.

  Returns:
    A :class:`Timing`.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  first = _timed_call(fn, args)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = tuple(_timed_call(fn, args) for _ in range(repeats))
  return Timing(first_ms=first, times_ms=times)


def interleaved(
  contenders: Sequence[tuple[Callable[[], Any], Callable[[Any], Any]]], repeats: int
) -> list[list[float]]:
  """Times each ``(prepare, call)`` once per round, for ``repeats`` rounds.

  For ratios between implementations on a shared machine: its speed drifts by
  tens of percent over seconds, so timing one contender's calls after
  another's compares two moments as much as two programs. Here every round
  times each contender once, in an order rotated by one each round, and a
  round's inputs are all prepared (untimed) before its first timed call, so
  each input was written several calls earlier, as when each call had its own
  copy made up front.

  Args:
    contenders: ``prepare() -> inputs`` and ``call(inputs) -> result``, timed
      as :func:`time_calls` times a call (blocked on, released after the clock
      stops); a result that is not a JAX value (PyTorch's) must be complete
      when ``call`` returns.
    repeats: rounds (at least 1).

  Returns:
    Per contender, its ``repeats`` times in ms.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  times: list[list[float]] = [[] for _ in contenders]
  n = len(contenders)
  for r in range(repeats):
    inputs = [prepare() for prepare, _ in contenders]
    for j in range(n):
      i = (j + r) % n
      times[i].append(_timed_call(contenders[i][1], (inputs[i],)))
      inputs[i] = None
  return times


def median_ms(
  fn: Callable[..., Any], *args: Any, repeats: int = 7, warmup: int = 1
) -> float:
  """Median wall time of ``fn(*args)`` in ms, after a first call and ``warmup`` calls.

  Args:
    fn: the callable; its result is passed to :func:`jax.block_until_ready`.
    *args: its arguments.
    repeats: number of timed calls.
    warmup: number of untimed calls after the first (compiling) one.

  Returns:
    The median of the ``repeats`` timed calls, in milliseconds.
  """
  return time_calls(fn, *args, repeats=repeats, warmup=warmup).median_ms


def copy_bandwidth_gbps(
  nbytes: int = 100 * 2**20, repeats: int = 15, warmup: int = 3
) -> float:
  """XLA's streaming read + write bandwidth on this device, in GB/s (1e9 bytes).

  Times ``x * c`` on a float32 buffer of ``nbytes`` jitted with ``donate_argnums=0``
  and fed its own output, so steady-state calls write into the donated buffer (no
  fresh allocation, whose first touch is several times slower on CPU). Each call
  reads and writes ``nbytes``; the bandwidth is ``2 * nbytes`` over the median time.
  ``c = -1`` keeps the values finite and away from denormals, and XLA cannot fold
  the multiply away as it could for ``c = 1``.

  Args:
    nbytes: buffer size in bytes (default 100 MiB, about a ResNet-50 gradient).
    repeats: number of timed calls.
    warmup: untimed calls after the first one.

  Returns:
    ``2 * nbytes / median_seconds / 1e9``.
  """
  n = nbytes // 4
  scale = jax.jit(lambda x: x * jnp.float32(-1.0), donate_argnums=0)
  buf = [jnp.ones((n,), jnp.float32)]

  def step():
    buf[0] = scale(buf[0])
    return buf[0]

  ms = median_ms(step, repeats=repeats, warmup=warmup)
  return 2 * n * 4 / (ms * 1e-3) / 1e9
