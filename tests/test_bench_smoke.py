"""The benchmark modules run end to end (on a small model; they are not tests of speed)."""

import json

import pytest

from bench import compress, sketch


def test_compress_suite_writes_its_table_and_json(tmp_path, capsys):
  result = compress.run(
    model="resnet20", repeats=1, only="none,signsgd", out_dir=str(tmp_path)
  )
  assert [row["label"] for row in result["rows"]] == ["none", "signsgd"]
  for row in result["rows"]:
    for layout in ("layerwise", "fused"):
      assert row[layout]["finite"] and row[layout]["median_ms"] > 0
  saved = json.loads((tmp_path / "compress.json").read_text())
  assert saved["num_params"] == 269_722
  assert "| signsgd |" in capsys.readouterr().out


def test_sketch_suite_reports_every_stage(tmp_path):
  result = sketch.run(repeats=1, out_dir=str(tmp_path), model="resnet20")
  assert len(result["stages"]) == 4
  for stage in result["stages"]:
    assert stage["median_ms"] > 0 and stage["peak_over_gradient"] >= 1.0
  assert json.loads((tmp_path / "sketch.json").read_text())["d"] == 269_722


def test_fusion_check_predicts_and_measures_three_plans(tmp_path, capsys):
  from bench import fusion

  result = fusion.run(
    models=("resnet20",),
    compressor="signsgd",
    hyperparameters={},
    repeats=1,
    out_dir=str(tmp_path),
    sizes=(16, 4096),
    # The default's smallest size and a middle one: the chains of 16
    # collectives at 2^20 and 2^22 values per device (up to 128 MiB gathered
    # per device) took most of this test's time.
    calibration_sizes=(2**8, 2**16),
  )
  assert [(c["kind"], c["values"]) for c in result["collectives"]] == [
    ("all-reduce", 2**8),
    ("all-reduce", 2**16),
    ("all-gather", 2**8),
    ("all-gather", 2**16),
  ]
  plans = result["models"]["resnet20"]["plans"]
  assert set(plans) == {"layerwise", "single", "heuristic"}
  assert plans["layerwise"]["groups"] == 59 and plans["single"]["groups"] == 1
  for row in plans.values():
    assert row["predicted_ms"] > 0 and row["measured_ms"] > 0
  assert (tmp_path / "fusion_check.json").exists()
  assert "| resnet20 | order |" in capsys.readouterr().out


def test_ring_calibration_needs_two_sizes():
  import jax

  from bench import fusion

  mesh = jax.make_mesh((8,), (fusion.AXIS,))
  for sizes in ((2**8,), (2**8, 2**8), (0, 2**8)):
    with pytest.raises(ValueError, match="at least two distinct positive sizes"):
      fusion.calibrate_cluster(mesh, 0.0, 1, sizes)


def test_ring_fit_recovers_latency_and_bandwidth():
  import numpy as np

  from bench.fusion import _fit_ring

  rows = [[14, 4e3], [14, 4e6], [7, 8e3], [7, 8e6]]
  targets = [r[0] * 2e-5 + r[1] * 1e-9 for r in rows]
  np.testing.assert_allclose(_fit_ring(rows, targets), (2e-5, 1e-9))
  # A negative intercept is refitted through the origin, not clamped.
  alpha, per_byte = _fit_ring([[1, 1.0], [1, 3.0]], [0.5, 3.5])
  assert alpha == 0 and per_byte == (0.5 + 10.5) / 10


def test_device_step_times_dense_and_each_compressed_step(tmp_path):
  from bench import device_step

  setup = device_step.Setup(
    size="tiny",
    vocab_size=64,
    batch=2,
    length=8,
    dtype="float32",
    overrides=(("num_layers", 1), ("width", 16), ("num_heads", 2), ("context", 8)),
  )
  result = device_step.run(("signsgd:single",), setup, repeats=1, out_dir=str(tmp_path))
  # 64 x 16 tokens + 8 x 16 positions + one block (12 d^2 + 13 d) + ln_f (2 d).
  assert result["params"] == 64 * 16 + 8 * 16 + 12 * 16**2 + 13 * 16 + 2 * 16
  dense, row = result["rows"]
  assert (dense["compressor"], row["compressor"], row["plan"]) == (
    "none (dense AdamW)",
    "signsgd",
    "single",
  )
  assert row["step_s"] > 0 and row["alone_s"] > 0
  assert row["step_share"] == pytest.approx(1 - dense["step_s"] / row["step_s"])
  assert "| signsgd | single |" in (tmp_path / "device_step.md").read_text()
  with pytest.raises(ValueError, match="plan must be"):
    device_step.parse("topk:fused")
  with pytest.raises(ValueError, match="unknown compressor 'top_k'"):
    device_step.parse("top_k")
