"""The edgegossip suite: its arithmetic against hand-computed cases, and one
tiny run through its code path (paper 002; issue 15)."""

import json
import math

import numpy as np
import pytest

import gradcomp
from bench import edgegossip as eg
from train import logs

# One pytest-xdist worker runs the module, so its module fixture is built once.
pytestmark = pytest.mark.xdist_group("bench_edgegossip")


def test_time_to_target_is_the_first_eval_at_or_above_it():
  acc, secs = [0.5, 0.9, 0.95, 0.97], [1.0, 2.0, 3.0, 4.0]
  assert eg.time_to_target(acc, secs, 0.95) == 3.0  # equality counts
  assert eg.time_to_target(acc, secs, 0.91) == 3.0
  assert eg.time_to_target(acc, secs, 0.1) == 1.0
  assert eg.time_to_target(acc, secs, 0.99) is None
  # A dip after reaching it does not matter: the first crossing counts.
  assert eg.time_to_target([0.96, 0.90, 0.97], [1.0, 2.0, 3.0], 0.95) == 1.0


def test_reach_averages_the_seeds_that_reach_and_speedup_divides_means():
  r = eg.reach([2.0, None, 4.0])
  assert (r["reached"], r["seeds"], r["mean"]) == (2, 3, 3.0)
  assert r["values"] == [2.0, None, 4.0]
  never = eg.reach([None, None])
  assert never["reached"] == 0 and never["mean"] is None
  # GoSGD 4 and 6 s (mean 5), EdgeGossip 1 and 1.5 s (mean 1.25): 4x.
  assert eg.speedup(eg.reach([4.0, 6.0]), eg.reach([1.0, 1.5])) == pytest.approx(4.0)
  assert eg.speedup(eg.reach([4.0]), never) is None
  assert eg.speedup(never, eg.reach([1.0])) is None


def test_imbalance_summary_skips_missing_epochs():
  s = eg.imbalance_summary([1.0, None, 2.0, math.inf, 3.0])
  assert s == {"mean": 2.0, "max": 3.0, "min": 1.0, "epochs": 3}
  assert eg.imbalance_summary([None]) is None


def test_speeds_steps_and_the_digits_split():
  assert eg.speeds(8, 10) == (1.0,) * 4 + (0.1,) * 4
  assert eg.speeds(4, 1) == (1.0,) * 4
  with pytest.raises(ValueError):
    eg.speeds(4, 0.5)
  from train import data

  # The program's digits split: 1437 training images, shards of 360 / 180.
  assert len(data.load_digits().y_train) == eg.DIGITS_TRAIN
  assert eg.steps_per_epoch(eg.DIGITS_TRAIN, 4, 64) == 6  # ceil(360 / 64)
  assert eg.steps_per_epoch(eg.DIGITS_TRAIN, 8, 64) == 3  # ceil(180 / 64)
  # Ratio 20 on 180-image shards: about one subset per class, no K-means.
  assert 0 < eg.generation_ms(8, 20, seeds=1, repeats=1) < 5e3


def test_packed_rows_fill_whole_batches_in_order():
  rows = eg.packed_rows([130, 64, 0, 5], 64, 3)
  assert rows.tolist() == [[64, 64, 0, 5], [64, 0, 0, 0], [2, 0, 0, 0]]
  with pytest.raises(ValueError):
    eg.packed_rows([193], 64, 3)


def _fake_run(selection, epochs):
  """Two workers, b = 4, 3 steps per epoch, 10 FLOPs forward per sample."""
  batch, forward = 4, 10.0
  return {
    "batch": batch,
    "selection": selection,
    "sim": {
      "flops_per_step": gradcomp.sim.training_flops(forward, batch),  # 120
      "push_seconds": 0.5,
      "aggregated_points": [2, 1],
      "steps_per_epoch": 3,
      "shard_sizes": [12, 12],
    },
    "epochs": [{"epoch": e + 1, "samples": s} for e, s in enumerate(epochs)],
  }


def test_reprice_is_the_closed_form_of_a_masked_epoch():
  """Speeds (1, 0.5) at 30 FLOP/s: a sample is 30 FLOPs, 1 s and 2 s; a point's
  forward 10 FLOPs; each trained step adds a 0.5 s push; a barrier per epoch."""
  run = _fake_run("loss", [[12, 6], [12, 12]])
  out = eg.reprice(run, [1.0, 0.5], flops_per_second=30.0)
  # Epoch 1: worker 0: 2 points (20/30 s) + 12 s + 3 pushes; worker 1: 1
  # point (10/15 s) + 6 x 2 s + 2 pushes (4 + 2 samples).
  w0 = 20 / 30 + 12 + 1.5
  w1 = 10 / 15 + 12 + 1.0
  e1 = max(w0, w1)
  w0b, w1b = 20 / 30 + 12 + 1.5, 10 / 15 + 24 + 1.5
  np.testing.assert_allclose(out["seconds"], [e1, e1 + max(w0b, w1b)], rtol=1e-6)
  np.testing.assert_allclose(out["compute_imbalance"], [1.0, 2.0])
  np.testing.assert_allclose(out["busy_imbalance"], [w0 / w1, w1b / w0b])
  assert out["overhead_share"][0] == pytest.approx((10 / 15) / e1, rel=1e-6)
  assert out["fast_overhead_share"][0] == pytest.approx((20 / 30) / w0)
  # Without the loss ranking there is no evaluation to pay.
  plain = eg.reprice(
    _fake_run("shuffle", [[12, 12]]), [1.0, 0.5], flops_per_second=30.0
  )
  assert plain["seconds"] == pytest.approx([24 + 1.5])
  assert plain["overhead_share"] == [0.0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = tmp_path_factory.mktemp("edgegossip")
  return out, eg.run(quick=True, out_dir=str(out))


def _rows(out, label):
  return logs.read_metrics(
    out / "edgegossip_runs" / label / "seed0" / logs.METRICS_FILE
  )


def test_tiny_run_writes_its_tables_and_figure(tiny):
  out, result = tiny
  saved = json.loads((out / "edgegossip.json").read_text())
  assert set(saved["grid"]) == {"w4_r3"}
  setting = saved["grid"]["w4_r3"]
  assert setting["speeds"] == [1.0, 1.0, 1 / 3, 1 / 3]
  assert set(setting["methods"]) == {"gosgd", "edgegossip"}
  for m in setting["methods"].values():
    assert len(m["accuracy_mean"]) == len(m["seconds_mean"]) == 2  # one per epoch
    assert m["final_accuracy"]["values"][0] == m["accuracy_mean"][-1]
  gosgd = setting["methods"]["gosgd"]
  assert setting["target"] == pytest.approx(
    gosgd["final_accuracy"]["mean"] - eg.TARGET_PP / 100
  )
  assert gosgd["gap_pp"] == 0.0 and gosgd["speedup"] in (None, 1.0)
  # Every run's clock, replayed, is the program's own.
  assert result["checks"]["runs"] == 2
  assert result["checks"]["clock_max_rel_diff"] < 1e-6
  text = (out / "edgegossip.md").read_text()
  assert "| 4 | 3 |" in text and "#### Claims" in text
  assert (out / "edgegossip.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gosgd_trains_every_sample_and_edgegossip_balances(tiny):
  out, result = tiny
  gosgd = [r for r in _rows(out, "w4/gosgd_r1") if "epoch" in r]
  edge = [r for r in _rows(out, "w4/edgegossip_r3") if "epoch" in r]
  assert [r["epoch"] for r in gosgd] == [r["epoch"] for r in edge] == [1, 2]
  for r in gosgd:
    assert r["ratios"] == [1.0] * 4 and r["samples"] == [360, 359, 359, 359]
  setting = result["grid"]["w4_r3"]["methods"]
  # GoSGD re-priced at 3x: a slow worker's 359 samples at 1/3 over 359 at 1.
  assert setting["gosgd"]["compute_imbalance"]["mean"] == pytest.approx(3.0)
  for r in edge:
    # Alg. 1: T_i = |X_i| / p_i, r_i = T_min / T_i; T_min is worker 1's 359.
    assert r["ratios"] == pytest.approx([359 / 360, 1.0, 1 / 3, 1 / 3], abs=1e-6)
    assert r["compute_imbalance"] <= setting["gosgd"]["compute_imbalance"]["min"]
    assert sum(r["samples"][2:]) < sum(r["samples"][:2])
  logged = setting["edgegossip"]["logged_compute_imbalance"]
  assert setting["edgegossip"]["compute_imbalance"]["mean"] == pytest.approx(
    logged["mean"]
  )


def test_gosgd_does_not_read_the_speeds(tiny, tmp_path):
  """What lets the suite train GoSGD once and re-price it: at 3x it trains
  the same models as at 1x, and its clock is the 1x run's replayed at 3x."""
  out, _ = tiny
  config = eg.configure(
    eg.METHODS["gosgd"], workers=4, speeds=eg.speeds(4, 1), seed=0, epochs=2
  )
  runner = eg._Runner(tmp_path, epochs=2)
  runner.gosgd[(4, 0)] = eg.load_run(config, out / "edgegossip_runs/w4/gosgd_r1/seed0")
  check = eg._real_check(runner, 4, 3)
  assert check["accuracy_max_abs_diff"] == 0.0
  assert check["clock_max_rel_diff"] < 1e-6
