"""The CD-SGD suite's arithmetic (paper 001): claims, the measured-vs-model
table, and the training program's exchange schedule against the time model."""

import pytest

import gradcomp
from bench import __main__ as bench_main
from bench import cdsgd, workloads
from configs import default
from train import optimizer


def _summary(mean):
  return {"final_accuracy": {"mean": mean, "std": 0.0}}


def test_claims_hold_and_fail_by_their_rules():
  good = {
    "ssgd": _summary(0.980),
    "bitsgd": _summary(0.950),
    "cdsgd_k2": _summary(0.978),
    "cdsgd_k5": _summary(0.970),
    "cdsgd_k10": _summary(0.970),
  }
  assert [c["holds"] for c in cdsgd.accuracy_checks(good)] == [True, True, True]
  bad = {**good, "cdsgd_k2": _summary(0.940), "cdsgd_k10": _summary(0.975)}
  checks = cdsgd.accuracy_checks(bad)
  assert [c["holds"] for c in checks] == [False, False, False]
  assert checks[1]["difference_pp"] == pytest.approx(-4.0)
  assert checks[2]["largest_rise_pp"] == pytest.approx(3.0)  # k=2 -> 5


def test_measured_vs_model_is_eqs_2_to_7():
  """tau = 1, phi = 2, delta + psi = 0.5 (ms): OD-SGD max(tau, phi) = 2;
  CD-SGD k=2 averages one full and one compressed step: (2 + 1) / 2."""
  rows = cdsgd.measured_vs_model(
    {
      "compute_only": 1e-3,
      "ssgd": 3e-3,
      "bitsgd": 1.5e-3,
      "odsgd": 2e-3,
      "cdsgd_k2": 2e-3,
    }
  )
  got = {
    r["method"]: (r["model_overlapped_ms"], r["model_sequential_ms"]) for r in rows
  }
  assert got["ssgd"] == pytest.approx((3.0, 3.0))
  assert got["bitsgd"] == pytest.approx((1.5, 1.5))
  assert got["odsgd"] == pytest.approx((2.0, 3.0))
  assert got["cdsgd_k2"] == pytest.approx((1.5, 2.25))


@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_program_schedule_agrees_with_the_time_model(warmup, k):
  """What the training program counts on the wire each step
  (``optimizer.cdsgd_exchanges``) is what ``sim.delayed_exchange`` prices,
  except at the switch, where the program exchanges a zero message."""
  config = default.get_config()
  config.scheme = default.scheme("cdsgd", warmup_steps=warmup, k=k)
  config.compressor.name = "threshold_quantize"
  program = optimizer.cdsgd_exchanges(config)
  for step in range(1, 16):
    model = gradcomp.sim.delayed_exchange(step, k=k, warmup_steps=warmup)
    if model != "none":
      assert program(step) == {"synchronous": "full"}.get(model, model), step


def test_unknown_method_is_a_clear_error():
  with pytest.raises(SystemExit, match="unknown --methods"):
    bench_main.main(["cdsgd", "--methods", "cdsgd_k3"])


def test_prediction_for_a_described_cluster_is_the_closed_form():
  """S-SGD = tau + phi, BIT-SGD = tau + delta + psi, OD-SGD = max(tau, phi),
  CD-SGD k = ((k - 1) max(tau, delta + psi) + max(tau, phi)) / k."""
  from bench import cdsgd_time

  cluster = gradcomp.sim.Cluster(4, bandwidth_gbps=1.0, flops_per_second=1e12)
  rows = {
    r["method"]: r for r in cdsgd_time.predict("resnet20", cluster, batch_per_worker=8)
  }
  t = rows["S-SGD"]
  tau, phi, psi, delta = (t[f"{x}_ms"] for x in ("tau", "phi", "psi", "delta"))
  assert rows["S-SGD"]["step_ms"] == pytest.approx(tau + phi)
  assert rows["BIT-SGD"]["step_ms"] == pytest.approx(tau + delta + psi)
  assert rows["OD-SGD"]["step_ms"] == pytest.approx(max(tau, phi))
  cd5 = (4 * max(tau, delta + psi) + max(tau, phi)) / 5
  assert rows["CD-SGD k=5"]["step_ms"] == pytest.approx(cd5)
  assert phi > tau  # 1 Gbit/s: exchange-bound, so k matters
  with pytest.raises(SystemExit, match="unknown --model"):
    bench_main.main(["cdsgd-model", "--model", "alexnet"])


def test_gpt_tiny_workload_rebuilds_the_methods():
  """``--workload gpt_tiny``: the methods rebuilt for AdamW's lr and gpt_tiny's
  threshold. No training here (suite time): the gpt_tiny path of a run is
  the convergence, schemes and gossip suites' smoke runs'."""
  workload = workloads.GPT_TINY.with_overrides(workloads.SMOKE)
  per_worker = 16 // 8  # The smoke run's global batch over 8 workers.
  methods = cdsgd.methods_for(workload, per_worker)
  cd2 = methods["cdsgd_k2"]
  assert cd2.scheme["local_learning_rate"] == 3e-3
  assert cd2.scheme["message_scale"] == per_worker
  assert cd2.hyperparameters["threshold"] == pytest.approx(1.5e-3 * per_worker)
  assert methods["bitsgd"].hyperparameters["threshold"] == pytest.approx(1.5e-3)
