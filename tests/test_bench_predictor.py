"""The predictor benchmark (paper 002 §3.3, §4.4): structure, clean-up, fit, speeds.

One tiny real run (a CPU and a disk co-runner, 0.3 s windows: a few seconds)
checks the result's structure, that its co-runners are gone, and that the
reported fit and errors are the ones its samples give; :func:`speeds_for`,
the coefficients and the errors are checked against a closed form on
synthetic samples. No timing assertions.
"""

import json

import numpy as np
import psutil
import pytest

from bench import predictor as bench
from gradcomp.edgegossip import predictor as eg
from gradcomp.sim import Cluster

# Starts co-runner processes: keep its tests on one xdist worker.
pytestmark = pytest.mark.xdist_group("bench_predictor")

T0, SLOPES = 1e-6, np.array([2.0, 0.0, 4e-10])


def _linear(u):
  """RG(U) = 1 + SLOPES . U."""
  return 1 + u @ SLOPES


def _inverse_idle(u):
  """RG(U) = 0.5 + 0.5 / (1 - U_core) + 4e-10 U_disk (1 at U = 0)."""
  return 0.5 + 0.5 / (1 - u[:, 0]) + 4e-10 * u[:, 2]


def _synthetic(rg=_linear) -> dict:
  """Samples whose times are ``T0 * rg(U)`` exactly; every 4th held out."""
  rng = np.random.default_rng(0)
  u = np.column_stack([rng.uniform(0, 0.95, 12), np.zeros(12), rng.uniform(0, 5e8, 12)])
  t = T0 * rg(u)
  samples = [
    {
      "label": f"s{i % 4}",
      "held_out": i % 4 == 3,
      "usage": dict(zip(eg.FEATURES, map(float, row), strict=True)),
      "t": float(ti),
      "t_median": float(ti),
      "corunner_cores": 0.0,
    }
    for i, (row, ti) in enumerate(zip(u, t, strict=True))
  ]
  return {"samples": samples, "t0": T0, "regression": "linear"}


USAGES = np.array([[0.0, 0.0, 0.0], [0.5, 0.0, 1e8], [0.9, 3e6, 5e8]])


def test_speeds_and_fit_match_the_closed_form():
  result = _synthetic()
  usages = USAGES
  expected = 1 / _linear(usages)
  np.testing.assert_allclose(bench.speeds_for(result, usages), expected, rtol=1e-9)
  base = np.array([1.0, 2.0, 0.5])
  speeds = bench.speeds_for(result, usages, base=base)
  np.testing.assert_allclose(speeds, base * expected, rtol=1e-9)
  assert Cluster(3, speeds=tuple(speeds)).speeds == tuple(speeds)
  # A platform's rate (§3.3) is its executors' speeds over t0.
  p = bench.predictor_from(result)
  np.testing.assert_allclose(p.rate(usages), expected.sum() / T0, rtol=1e-9)

  summary = bench.summarise(result)
  c = summary["fit"]["coefficients"]
  np.testing.assert_allclose(
    [c["intercept"], c["core"], c["network_per_MBps"], c["disk_per_MBps"]],
    [1.0, 2.0, 0.0, 4e-4],
    rtol=1e-7,
    atol=1e-10,
  )
  e = summary["error"]
  assert e["held_out"] < 1e-9 and e["in_sample"] < 1e-9 and e["paper"] == 0.043
  t = np.array([s["t"] for s in result["samples"]])[3::4]
  np.testing.assert_allclose(e["held_out_constant"], np.mean(np.abs(T0 - t) / t))
  assert summary["fit"]["train_windows"] == 9
  assert summary["fit"]["held_out_windows"] == 3
  assert [r["label"] for r in summary["rows"]] == ["s0", "s1", "s2", "s3"]
  assert [r["held_out"] for r in summary["rows"]] == [False, False, False, True]
  assert set(summary["regressions"]) == set(bench.REGRESSIONS)
  assert summary["regressions"]["linear"]["held_out"] == e["held_out"]


def test_inverse_idle_matches_its_closed_form():
  result = _synthetic(_inverse_idle)
  expected = 1 / _inverse_idle(USAGES)
  speeds = bench.speeds_for(result, USAGES, regression="inverse_idle")
  np.testing.assert_allclose(speeds, expected, rtol=1e-9)
  fit = bench.summarise(result)["regressions"]["inverse_idle"]
  c = fit["coefficients"]
  np.testing.assert_allclose(
    [c["intercept"], c["inverse_idle"], c["network_per_MBps"], c["disk_per_MBps"]],
    [0.5, 0.5, 0.0, 4e-4],
    rtol=1e-7,
    atol=1e-10,
  )
  assert fit["held_out"] < 1e-9 and fit["in_sample"] < 1e-9
  # The linear form cannot follow 1 / (1 - U_core).
  assert bench.summarise(result)["error"]["in_sample"] > 1e-3


def test_speeds_for_rejects_extrapolated_and_bad_inputs():
  result = _synthetic()
  with pytest.raises(ValueError, match="RG"):
    bench.speeds_for(result, [-10.0, 0.0, 0.0])  # RG = 1 - 20 < 0
  with pytest.raises(ValueError, match="base"):
    bench.speeds_for(result, [0.5, 0.0, 0.0], base=0.0)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"held_out": (0.3,)}, "held_out"),
    ({"intensities": (1.5,)}, "intensities"),
    ({"disk": (-0.1,)}, "disk"),
    ({"processes": (0,)}, "processes"),
    ({"repeats": 0}, r"repeats must be an integer in \[1, inf\), got 0"),
    ({"batch": True}, r"batch must be an integer in \[1, inf\), got True"),
    ({"sample_seconds": 0.0}, "sample_seconds"),
    ({"regression": "cubic"}, "regression"),
  ],
)
def test_run_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    bench.run(**kwargs, log=None)


def test_tiny_run_is_consistent_and_cleans_up(tmp_path):
  result = bench.run(
    intensities=(0.0, 1.0),
    held_out=(1.0,),
    processes=(1,),
    disk=(1.0,),
    repeats=1,
    sample_seconds=0.3,
    settle=0.05,
    out_dir=str(tmp_path),
    log=None,
  )
  samples = result["samples"]
  assert sorted(s["label"] for s in samples) == [
    "cpu 0.00",
    "cpu 1.00",
    "disk 1.00",
    "none",
  ]
  held = {s["label"] for s in samples if s["held_out"]}
  assert held == {"cpu 1.00", "disk 1.00"}
  for s in samples:
    u = np.array([s["usage"][f] for f in eg.FEATURES])
    assert np.all(np.isfinite(u)) and np.all(u >= 0) and u[0] <= 1
    assert s["t"] > 0 and s["t_median"] > 0 and s["steps"] >= 1
    assert len(s["pids"]) == s["setting"]["processes"]

  # Every co-runner was stopped and reaped.
  pids = {pid for s in samples for pid in s["pids"]}
  assert len(pids) == 3
  assert not pids & {c.pid for c in psutil.Process().children(recursive=True)}

  # The reported fit and errors are the ones the samples give.
  assert result["t0"] == next(s["t"] for s in samples if s["label"] == "none")
  p = bench.predictor_from(result)
  assert p.t0 == result["t0"]

  def split(is_held):
    rows = [s for s in samples if s["held_out"] == is_held]
    u = [[s["usage"][f] for f in eg.FEATURES] for s in rows]
    return u, [s["t"] for s in rows]

  np.testing.assert_allclose(result["error"]["held_out"], p.error(*split(True)))
  np.testing.assert_allclose(result["error"]["in_sample"], p.error(*split(False)))
  usages = [[r["usage"][f] for f in eg.FEATURES] for r in result["rows"]]
  np.testing.assert_allclose(
    [r["speed_pred"] for r in result["rows"]],
    1 / p.ratio(usages),  # one window per setting: the mean is the value
  )

  # The outputs on disk are the result and its table.
  assert json.loads((tmp_path / "predictor.json").read_text()) == result
  table = (tmp_path / "predictor.md").read_text()
  assert table == bench.render(result) + "\n"
  assert "4.30 %" in table and "held out" in table
