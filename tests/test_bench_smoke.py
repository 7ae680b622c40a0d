"""The benchmark modules run end to end (on a small model; they are not tests of speed)."""

import json

from gradcomp.bench import compress


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
