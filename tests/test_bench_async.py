"""The async suite's reading of its runs (survey 004 §2; issue 16), without training."""

from __future__ import annotations

import numpy as np
import pytest

from bench import async_ps
from bench.__main__ import main


def test_staleness_statistics_of_a_histogram():
  rows = [
    {"step": 100, "staleness_histogram": [9, 9]},
    {"step": 200, "staleness_histogram": [2, 3, 0, 5]},  # the last row counts
  ]
  s = async_ps._staleness(rows)
  assert s["pushes"] == 10
  assert s["mean"] == pytest.approx((3 * 1 + 5 * 3) / 10)
  assert s["p90"] == 3 and s["max"] == 3  # 50 % of pushes are 3 late
  assert async_ps._staleness([{"step": 1, "loss": 0.1}]) is None


def test_methods_configure_their_scheme_and_cluster():
  config = async_ps.configure(
    async_ps.METHODS["dc_0.5"], async_ps.HETERO, seed=2, steps=30, eval_every=10
  )
  assert config.scheme.name == "async_ps" and config.scheme.delay_compensation == 0.5
  assert config.optimizer.learning_rate == async_ps.PUSH_LR
  assert config.optimizer.momentum == 0.0
  assert tuple(config.cluster.speeds) == async_ps.HETERO
  backup = async_ps.configure(
    async_ps.METHODS["backup_2"], async_ps.HETERO, seed=0, steps=30, eval_every=10
  )
  # A round on the mean gradient takes the step BSP's eight pushes take.
  assert backup.optimizer.learning_rate == pytest.approx(8 * async_ps.PUSH_LR)
  assert backup.scheme.backups == 2 and backup.scheme.jitter == async_ps.JITTER
  stale = [m for m in async_ps.METHODS.values() if m.scheme["name"] == "stale_sgd"]
  assert [m.scheme["staleness"] for m in stale] == list(async_ps.STALENESS)
  assert not any(m.timed for m in stale)


def test_time_to_target_is_the_first_eval_reaching_it():
  def run(accuracies, seconds):
    rows = [{"step": 10 * (i + 1), "loss": 0.5} for i in range(len(accuracies))]
    rows += [
      {"step": 10 * (i + 1), "eval_accuracy": a, "eval_loss": 0.1, "sim_seconds": s}
      for i, (a, s) in enumerate(zip(accuracies, seconds, strict=True))
    ]
    return {"rows": rows, "eval_steps": [10, 20, 30]}

  runs = [run([0.9, 0.96, 0.97], [1.0, 2.0, 3.0]), run([0.96, 0.97, 0.98], [1, 2, 3])]
  s = async_ps._summary(runs, steps=30)
  assert s["reached_target"] == 2
  np.testing.assert_allclose(s["time_to_target"]["values"], [2.0, 1.0])
  assert s["final_accuracy"]["mean"] == pytest.approx(0.975)
  never = async_ps._summary([run([0.5, 0.6, 0.7], [1, 2, 3])], steps=30)
  assert never["reached_target"] == 0 and never["time_to_target"] is None


def test_cli_rejects_unknown_methods():
  with pytest.raises(SystemExit, match="async"):
    main(["async", "--methods", "bsp,nope"])


def test_gpt_tiny_workload_sets_the_servers_adamw():
  """``--workload gpt_tiny``: AdamW at the workload's lr on the mean gradient
  (a push's is that over 8). No training here (suite time): the gpt_tiny
  path of a run is the convergence, schemes and gossip suites' smoke runs'."""
  workload = async_ps.workloads.GPT_TINY.with_overrides(async_ps.workloads.SMOKE)
  table = async_ps.methods_for(workload)
  assert table["bsp"].learning_rate == pytest.approx(3e-3 / 8)
  assert table["stale_2"].learning_rate == 3e-3
  config = async_ps.configure(
    table["stale_2"], (1.0,) * 8, seed=0, steps=4, eval_every=2, workload=workload
  )
  assert config.optimizer.name == "adamw" and config.model.num_layers == 1
