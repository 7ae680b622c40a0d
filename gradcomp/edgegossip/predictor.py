"""The performance predictor (paper 002 §3.3, Table 4; evaluated in §4.4).

A training task's time per unit of data under co-running load is

.. math::

  t = t_0 \\cdot RG(\\vec U), \\qquad
  \\vec U = (U^{core}, U^{networkBW}, U^{diskBW}),

``t0`` the time without interference and ``RG`` a regression fitted on
profiled samples ``(U_v, t_v)`` (the "performance deprecation ratio", > 1
under load). A platform of ``I`` executors processes ``p = sum_i 1 / t_i``
samples per second (the "extended" estimator), the ``p_i`` the balancer
(:mod:`gradcomp.edgegossip.balancer`) needs.

* :func:`sample_usage` reads ``U`` from the OS with ``psutil`` (Table 4: core
  usage, bytes sent + received per second, bytes read + written per second).
* :class:`Predictor` fits ``RG`` (scikit-learn) and predicts ``t``, the
  relative speed ``t0 / t`` and a platform's rate.
* :func:`co_runner` starts a co-running load of known CPU (and disk)
  intensity in child processes, so a benchmark can profile a real training
  step under it (§4.4 co-runs MapReduce jobs of 13 input sizes).

Readings (what the paper leaves open):

* **The regression's form** is not stated ("a regression model"): linear
  least squares (scikit-learn's ``LinearRegression``) by default, ridge, or
  any scikit-learn regressor, as a keyword. ``U``'s columns are standardised
  first: bytes per second (up to ~1e9) beside a core fraction (<= 1) make
  ``LinearRegression``'s least squares (``cond=tol``, 1e-6 relative to the
  largest singular value) drop the core column as numerically null.
* **``t0``.** Given (a profiled run without co-runner), ``RG`` is fitted to
  ``t / t0``; otherwise ``t0`` is the fitted time at ``U = 0`` and ``RG =
  fit / t0``. For a linear fit both give ``t = b0 + b . U``. ``t0`` can be
  changed afterwards (§3.3: "dynamically changing t0 according to the machine
  status").
* **Whose usage.** ``U`` is the co-running jobs' (§3.3). :func:`sample_usage`
  reads the whole machine and, by default, subtracts the calling process's
  own CPU time (the training task); its network and disk traffic cannot be
  told apart and stay in. Core usage is a fraction of all cores, in ``[0,
  1]``. The paper averages 1-second samples over a minute; the interval is a
  keyword.
* **The co-runner** is a ``subprocess`` running a small ``python -c`` loop,
  not ``multiprocessing``: a spawned ``multiprocessing`` child would import
  this package (and JAX) before loading anything, and forking a process that
  runs JAX's threads is unsafe.
"""

from __future__ import annotations

import numbers
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from sklearn.base import clone
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

#: Table 4's contention features, in ``U``'s column order.
FEATURES = ("core", "network", "disk")
REGRESSIONS = ("linear", "ridge")


class Usage(NamedTuple):
  """Co-running load ``U`` (paper 002 Table 4), one sample.

  ``np.asarray(usage)`` is the ``(3,)`` feature vector :class:`Predictor` takes.

  Examples:
    >>> import numpy as np
    >>> u = Usage(core=0.5, network=2e6, disk=0.0)
    >>> u._fields, np.asarray(u).tolist()
    (('core', 'network', 'disk'), [0.5, 2000000.0, 0.0])
  """

  core: float  # fraction of all cores busy, in [0, 1]
  network: float  # bytes sent + received per second
  disk: float  # bytes read + written per second


def _cpu_seconds(times) -> tuple[float, float]:
  """(all, busy) CPU seconds; Linux's guest times are already in user and nice."""
  total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
  return total, total - times.idle - getattr(times, "iowait", 0.0)


def _io_bytes() -> tuple[float, float]:
  import psutil

  net = psutil.net_io_counters()
  disk = psutil.disk_io_counters()
  net_bytes = 0.0 if net is None else float(net.bytes_sent + net.bytes_recv)
  disk_bytes = 0.0 if disk is None else float(disk.read_bytes + disk.write_bytes)
  return net_bytes, disk_bytes


def sample_usage(interval: float = 1.0, *, exclude_self: bool = True) -> Usage:
  """Read ``U`` over ``interval`` seconds from the OS (paper 002 §3.3, Table 4).

  Differences of ``psutil``'s counters (``/proc`` on Linux, as §3.3's
  monitor): busy CPU time over all cores, network bytes sent + received, disk
  bytes read + written. Blocks for ``interval`` seconds. A machine without
  network or disk counters reads 0 for them.

  Args:
    interval: seconds to average over, > 0 (§3.3 samples every second).
    exclude_self: subtract this process's own CPU time (the training task), so
      that ``core`` is the co-runners' usage.

  Returns:
    The :class:`Usage`, every field finite and >= 0.

  Examples:
    The values are this machine's load; their kinds and ranges are fixed.

    >>> u = sample_usage(0.01)
    >>> type(u).__name__, [type(v).__name__ for v in u], 0.0 <= u.core <= 1.0
    ('Usage', ['float', 'float', 'float'], True)
  """
  # psutil is imported on use: only this monitor needs it, and a library
  # import must not load it (tests/test_package.py).
  import psutil

  interval = _check_positive("interval", interval)
  me = psutil.Process()
  cpu0, own0, io0 = psutil.cpu_times(), me.cpu_times(), _io_bytes()
  t0 = time.perf_counter()
  time.sleep(interval)
  cpu1, own1, io1 = psutil.cpu_times(), me.cpu_times(), _io_bytes()
  elapsed = time.perf_counter() - t0
  (total0, busy0), (total1, busy1) = _cpu_seconds(cpu0), _cpu_seconds(cpu1)
  total, busy = total1 - total0, busy1 - busy0
  if exclude_self:
    busy -= (own1.user + own1.system) - (own0.user + own0.system)
  core = min(1.0, max(0.0, busy / total)) if total > 0 else 0.0
  net, disk = (max(0.0, (b - a) / elapsed) for a, b in zip(io0, io1, strict=True))
  return Usage(core=core, network=net, disk=disk)


def _check_usage(u: ArrayLike) -> np.ndarray:
  a = np.asarray(u, dtype=np.float64)
  if a.ndim == 1:
    a = a[None]
  if a.ndim != 2 or a.shape[1] != len(FEATURES) or a.shape[0] == 0:
    raise ValueError(f"U must have shape (V, 3) or (3,) = {FEATURES}, got {a.shape}")
  if not np.all(np.isfinite(a)):
    raise ValueError("U must be finite, got NaN or inf")
  return a


def _check_positive(name: str, value) -> float:
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if not ok or not 0 < float(value) < np.inf:
    raise ValueError(f"{name} must be in (0, inf), got {value!r}")
  return float(value)


def platform_rate(times: ArrayLike) -> float:
  """The extended estimator (§3.3): ``p = sum_i 1 / t_i`` over a platform's executors.

  Args:
    times: ``(I,)`` seconds per sample of each executor, each > 0.

  Returns:
    Samples per second.

  Examples:
    >>> platform_rate([0.01, 0.02])
    150.0
  """
  t = np.asarray(times, dtype=np.float64)
  if t.ndim != 1 or t.size == 0 or not np.all((t > 0) & np.isfinite(t)):
    raise ValueError(f"times must be a non-empty 1-D array of finite t > 0, got {t!r}")
  return float(np.sum(1.0 / t))


class Predictor:
  """``t = t0 * RG(U)``, fitted on profiled samples (paper 002 §3.3).

  Args:
    regression: ``"linear"`` (least squares) or ``"ridge"`` (penalty
      ``alpha``), both on standardised ``U``, or a scikit-learn regressor (it
      is cloned, and sees ``U`` as given).
    alpha: the ridge penalty, > 0.

  Examples:
    >>> U = np.array([[0.0, 0, 0], [0.5, 0, 0], [1.0, 0, 0], [0.0, 0, 1e6]])
    >>> t = 0.02 * (1 + 2 * U[:, 0] + 1e-7 * U[:, 2])
    >>> p = Predictor().fit(U, t)
    >>> round(p.t0, 6), p.speed([[0.5, 0, 0]]).round(6).tolist()
    (0.02, [0.5])
  """

  def __init__(self, regression="linear", *, alpha: float = 1.0):
    if isinstance(regression, str):
      if regression not in REGRESSIONS:
        raise ValueError(
          f"regression must be one of {REGRESSIONS} or a regressor, got {regression!r}"
        )
      alpha = _check_positive("alpha", alpha)
      model = LinearRegression() if regression == "linear" else Ridge(alpha=alpha)
      regression = make_pipeline(StandardScaler(), model)
    elif not (hasattr(regression, "fit") and hasattr(regression, "predict")):
      raise ValueError(
        f"regression must be one of {REGRESSIONS} or a regressor, got {regression!r}"
      )
    self._template = regression
    self._model = None
    self.t0: float | None = None

  def fit(self, U: ArrayLike, t: ArrayLike, *, t0: float | None = None) -> Predictor:
    """Fit ``RG`` on ``V`` profiled samples ``(U_v, t_v)``.

    Args:
      U: ``(V, 3)`` co-running usage (:class:`Usage` rows).
      t: ``(V,)`` measured seconds per unit of data, each > 0.
      t0: the task's time without interference, > 0; ``None`` takes the
        fitted time at ``U = 0``.

    Returns:
      ``self``.
    """
    u = _check_usage(U)
    times = np.asarray(t, dtype=np.float64)
    if times.shape != (u.shape[0],) or not np.all((times > 0) & np.isfinite(times)):
      raise ValueError(
        f"t must hold {u.shape[0]} finite times > 0 (one per row of U), got {times!r}"
      )
    model = clone(self._template)
    if t0 is None:
      model.fit(u, times)
      base = float(model.predict(np.zeros((1, len(FEATURES))))[0])
      if not 0 < base < np.inf:
        raise ValueError(
          f"the fitted time at U = 0 must be > 0 to serve as t0, got {base!r}; pass t0"
        )
      self._model, self._scale, self.t0 = model, base, base
    else:
      t0 = _check_positive("t0", t0)
      model.fit(u, times / t0)
      self._model, self._scale, self.t0 = model, 1.0, t0
    return self

  def _fitted(self):
    if self._model is None:
      raise ValueError("the predictor must be fitted first: call fit(U, t)")
    return self._model

  def ratio(self, U: ArrayLike) -> np.ndarray:
    """``RG(U)``, the slowdown ratio (1 at ``U = 0`` when ``t0`` was fitted)."""
    model = self._fitted()
    return np.asarray(model.predict(_check_usage(U)), dtype=np.float64) / self._scale

  def predict(self, U: ArrayLike, *, t0: float | None = None) -> np.ndarray:
    """``t = t0 * RG(U)`` seconds per unit of data, ``(V,)``; ``t0`` overrides."""
    base = self.t0 if t0 is None else _check_positive("t0", t0)
    self._fitted()
    return base * self.ratio(U)

  def speed(self, U: ArrayLike) -> np.ndarray:
    """Relative speed ``t0 / t = 1 / RG(U)``, ``(V,)``: the simulator's speed factor."""
    return 1.0 / self.ratio(U)

  def rate(self, U: ArrayLike, *, t0: float | None = None) -> float:
    """A platform's samples per second, one row of ``U`` per executor (§3.3)."""
    return platform_rate(self.predict(U, t0=t0))

  def error(self, U: ArrayLike, t: ArrayLike) -> float:
    """Mean relative error ``mean |t_pred - t| / t`` (§4.4 reports 4.30 %)."""
    times = np.asarray(t, dtype=np.float64)
    pred = self.predict(U)
    if times.shape != pred.shape or not np.all(times > 0):
      raise ValueError(f"t must hold {pred.size} times > 0, got {times!r}")
    return float(np.mean(np.abs(pred - times) / times))


_CO_RUNNER = r"""
import os, sys, time
intensity, duration, period, path, chunk = (
  float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4],
  int(sys.argv[5]))
end = time.perf_counter() + duration
block = os.urandom(chunk) if path else b""
f = open(path, "wb") if path else None
written = 0
while True:
  start = time.perf_counter()
  if start >= end:
    break
  busy_until = start + intensity * period
  while time.perf_counter() < busy_until:
    if f is not None:
      f.write(block)
      f.flush()
      os.fsync(f.fileno())
      written += chunk
      if written >= 64 * chunk:
        f.seek(0)
        f.truncate()
        written = 0
  idle = start + period - time.perf_counter()
  if idle > 0:
    time.sleep(idle)
"""


class CoRunner:
  """A co-running load of known intensity in child processes (paper 002 §4.4).

  Each of ``processes`` children alternates, every ``period`` seconds, busy
  work for ``intensity * period`` and sleep for the rest, until ``duration``
  has passed or :meth:`stop`. The busy work is a CPU spin, or with
  ``disk=True`` 1 MiB writes, each flushed to disk (``fsync``) into a
  temporary file. Use as a context manager, or :meth:`start` / :meth:`stop`.

  Args:
    intensity: the busy fraction of each period, in ``[0, 1]``.
    duration: seconds before the children exit by themselves, > 0.
    processes: child processes (cores loaded), >= 1.
    disk: write to disk instead of spinning.
    period: the duty cycle's period, seconds, > 0.

  Examples:
    One child spinning half of every 10 ms, stopped on leaving the block:

    >>> load = CoRunner(0.5, duration=5.0)
    >>> with load:
    ...   print(load.alive, len(load.pids))
    True 1
    >>> load.alive
    False
  """

  def __init__(
    self,
    intensity: float,
    duration: float,
    *,
    processes: int = 1,
    disk: bool = False,
    period: float = 0.01,
  ):
    ok = isinstance(intensity, numbers.Real) and 0.0 <= float(intensity) <= 1.0
    if not ok:
      raise ValueError(f"intensity must be in [0, 1], got {intensity!r}")
    if (
      not isinstance(processes, numbers.Integral)
      or isinstance(processes, bool)
      or processes < 1
    ):
      raise ValueError(f"processes must be an integer >= 1, got {processes!r}")
    self.intensity = float(intensity)
    self.duration = _check_positive("duration", duration)
    self.period = _check_positive("period", period)
    self.processes = int(processes)
    self.disk = bool(disk)
    self._children: list[subprocess.Popen] = []
    self._dir: str | None = None

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self._children]

  @property
  def alive(self) -> bool:
    """Whether any child is still running."""
    return any(p.poll() is None for p in self._children)

  def start(self) -> CoRunner:
    """Start the children (once)."""
    if self._children:
      raise RuntimeError("this CoRunner was already started")
    if self.disk:
      self._dir = tempfile.mkdtemp(prefix="gradcomp-corunner-")
    for k in range(self.processes):
      path = os.path.join(self._dir, f"load{k}") if self.disk else ""
      args = [self.intensity, self.duration, self.period, path, 1 << 20]
      self._children.append(
        subprocess.Popen(
          [sys.executable, "-c", _CO_RUNNER, *map(str, args)],
          stdin=subprocess.DEVNULL,
          stdout=subprocess.DEVNULL,
          stderr=subprocess.DEVNULL,
        )
      )
    return self

  def wait(self, timeout: float | None = None) -> None:
    """Wait for the children to finish their ``duration``."""
    for p in self._children:
      p.wait(timeout)
    self._cleanup()

  def stop(self, timeout: float = 5.0) -> None:
    """Terminate the children that still run, wait for them, remove the files."""
    for p in self._children:
      if p.poll() is None:
        p.terminate()
    for p in self._children:
      try:
        p.wait(timeout)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    self._cleanup()

  def _cleanup(self) -> None:
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)
      self._dir = None

  def __enter__(self) -> CoRunner:
    return self if self._children else self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def co_runner(
  intensity: float,
  duration: float,
  *,
  processes: int = 1,
  disk: bool = False,
  period: float = 0.01,
) -> CoRunner:
  """Start a :class:`CoRunner` (its arguments); stop it, or use ``with``.

  Examples:
    >>> with co_runner(0.5, 0.2) as load:
    ...   load.alive
    True
  """
  return CoRunner(
    intensity, duration, processes=processes, disk=disk, period=period
  ).start()
