"""The benchmark modules run end to end (on a small model; they are not tests of speed)."""

import json

from gradcomp.bench import compress, sketch


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
