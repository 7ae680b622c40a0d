"""EdgeGossip's performance predictor (paper 002 §3.3, Table 4).

The fit against a known linear slowdown (closed form), the extended estimator
against its sum, one real ``psutil`` reading and a co-runner's life cycle
(each well under a second). No timing assertions.
"""

import os

import numpy as np
import psutil
import pytest
from sklearn.tree import DecisionTreeRegressor

from gradcomp import edgegossip as eg


def _load(rng, v):
  """``v`` usage samples on the scales a machine reports: fraction, B/s, B/s."""
  return np.column_stack(
    [rng.uniform(0, 1, v), rng.uniform(0, 1e8, v), rng.uniform(0, 5e8, v)]
  )


T0, SLOPES = 0.02, np.array([1.5, 2e-9, 4e-10])  # RG(U) = 1 + SLOPES . U


def test_fit_recovers_a_linear_slowdown():
  rng = np.random.default_rng(0)
  u_fit, u_held = _load(rng, 30), _load(rng, 10)
  t = lambda u: T0 * (1 + u @ SLOPES)
  p = eg.Predictor().fit(u_fit, t(u_fit))
  assert p.t0 == pytest.approx(T0, rel=1e-9)  # the fitted time at U = 0
  np.testing.assert_allclose(p.predict(u_held), t(u_held), rtol=1e-9)
  np.testing.assert_allclose(p.ratio(u_held), 1 + u_held @ SLOPES, rtol=1e-9)
  np.testing.assert_allclose(p.speed(u_held), 1 / (1 + u_held @ SLOPES), rtol=1e-9)
  assert p.error(u_held, t(u_held)) < 1e-9
  # A measurement 10 % slower than predicted: error 0.1 / 1.1.
  assert p.error(u_held, 1.1 * t(u_held)) == pytest.approx(0.1 / 1.1, rel=1e-9)
  # One Usage row works as a (3,) vector.
  usage = eg.Usage(core=0.5, network=0.0, disk=0.0)
  assert p.predict(usage) == pytest.approx([T0 * 1.75], rel=1e-9)
  # t0 changes with the machine's state (§3.3); RG does not.
  np.testing.assert_allclose(p.predict(u_held, t0=0.05), 0.05 * p.ratio(u_held))


def test_fit_with_a_measured_t0():
  rng = np.random.default_rng(1)
  u = _load(rng, 25)
  t = 0.03 * (1.2 + u @ SLOPES)  # interference-free runs are 1.2x slower than t0
  p = eg.Predictor().fit(u, t, t0=0.03)
  assert p.t0 == 0.03
  assert p.ratio(np.zeros(3)) == pytest.approx([1.2], rel=1e-9)
  np.testing.assert_allclose(p.predict(u), t, rtol=1e-9)
  ridge = eg.Predictor("ridge", alpha=1e-10).fit(u, t, t0=0.03)
  np.testing.assert_allclose(ridge.predict(u), t, rtol=1e-6)
  # Ridge shrinks: a large penalty pulls RG towards its mean.
  heavy = eg.Predictor("ridge", alpha=1e6).fit(u, t, t0=0.03)
  assert np.ptp(heavy.predict(u)) < 0.01 * np.ptp(t)


def test_platform_rate_sums_executors():
  assert eg.platform_rate([0.01, 0.02, 0.04]) == pytest.approx(100 + 50 + 25)
  rng = np.random.default_rng(2)
  u = _load(rng, 20)
  p = eg.Predictor().fit(u, T0 * (1 + u @ SLOPES))
  executors = u[:3]
  assert p.rate(executors) == pytest.approx(np.sum(1 / (T0 * (1 + executors @ SLOPES))))
  with pytest.raises(ValueError, match="times must be a non-empty 1-D array"):
    eg.platform_rate([0.01, 0.0])


def test_predictor_takes_a_regressor_and_checks_inputs():
  rng = np.random.default_rng(3)
  u = _load(rng, 10)
  t = T0 * (1 + u @ SLOPES)
  tree = DecisionTreeRegressor(random_state=0)
  p = eg.Predictor(tree).fit(u, t, t0=T0)
  np.testing.assert_allclose(p.predict(u), t)  # a full tree interpolates
  assert not hasattr(tree, "tree_")  # the template was cloned, not fitted
  with pytest.raises(ValueError, match="fitted first"):
    eg.Predictor().predict(u)
  with pytest.raises(ValueError, match=r"regression must be one of .* 'poly'"):
    eg.Predictor("poly")
  with pytest.raises(ValueError, match=r"alpha must be in \(0, inf\)"):
    eg.Predictor("ridge", alpha=0.0)
  with pytest.raises(ValueError, match=r"U must have shape \(V, 3\)"):
    eg.Predictor().fit(u[:, :2], t)
  with pytest.raises(ValueError, match="t must hold 10 finite times > 0"):
    eg.Predictor().fit(u, -t)
  with pytest.raises(ValueError, match=r"t0 must be in \(0, inf\)"):
    eg.Predictor().fit(u, t, t0=0)
  busy = u.copy()
  busy[:, 0] = 0.5 + 0.5 * u[:, 0]
  with pytest.raises(ValueError, match="fitted time at U = 0 must be > 0"):
    eg.Predictor().fit(busy, busy[:, 0] - 0.2)  # t(0) = -0.2: pass t0 instead


def test_sample_usage_reads_the_machine():
  for exclude_self in (True, False):
    usage = eg.sample_usage(0.05, exclude_self=exclude_self)
    assert isinstance(usage, eg.Usage)
    values = np.asarray(usage)
    assert values.shape == (3,) and np.all(np.isfinite(values)) and np.all(values >= 0)
    assert usage.core <= 1.0
  with pytest.raises(ValueError, match=r"interval must be in \(0, inf\)"):
    eg.sample_usage(0)


def test_co_runner_starts_and_stops():
  with eg.co_runner(0.5, 30.0, processes=2) as load:
    assert load.alive and len(load.pids) == 2
    assert all(psutil.pid_exists(pid) for pid in load.pids)
  assert not load.alive
  assert all(p.returncode is not None for p in load._children)
  with pytest.raises(RuntimeError, match="already started"):
    load.start()


def test_co_runner_ends_after_its_duration_and_cleans_up():
  load = eg.co_runner(1.0, 0.2, disk=True)
  directory = load._dir
  assert directory is not None and os.path.isdir(directory)
  load.wait(timeout=10)
  assert not load.alive and [p.returncode for p in load._children] == [0]
  assert not os.path.exists(directory)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(intensity=1.5), r"intensity must be in \[0, 1\], got 1.5"),
    (dict(duration=0), r"duration must be in \(0, inf\), got 0"),
    (dict(processes=0), r"processes must be an integer >= 1, got 0"),
    (dict(period=-1.0), r"period must be in \(0, inf\)"),
  ],
)
def test_co_runner_rejects_bad_inputs(kwargs, match):
  args = dict(intensity=0.5, duration=1.0) | kwargs
  with pytest.raises(ValueError, match=match):
    eg.CoRunner(args.pop("intensity"), args.pop("duration"), **args)
