"""``python -m bench factors``: the table's arithmetic in closed form."""

import json

import pytest

from bench import __main__ as bench_main
from bench import factors


def dense(values: int, p: int) -> float:
  """Ring all-reduce: 2 (P-1)/P of the buffer, float32."""
  return 4 * 2 * (p - 1) / p * values


def gathered(rows: int, m: int, n: int, p: int) -> float:
  """All-gather of K (M + N) factor values from each of the P - 1 others."""
  return 4 * (p - 1) * rows * (m + n)


@pytest.mark.parametrize("p", factors.WORKERS)
def test_layer_rows_are_the_closed_forms(p):
  head = factors.Head(
    "h",
    (factors.Layer("a", (300, 200), 8), factors.Layer("b", (200, 3), 8)),
    (200, 3),
    8,
  )
  a, b = factors.layer_rows(head, p)
  for row, (m, n) in ((a, (300, 200)), (b, (200, 3))):
    assert row["dense_bytes"] == pytest.approx(dense(m * n, p), rel=1e-12)
    assert row["factor_bytes"] == gathered(8, m, n, p)
    want = "factors" if p * 8 * (m + n) < 2 * m * n else "dense"
    assert row["choice"] == want
    assert row["sent_bytes"] == min(row["dense_bytes"], row["factor_bytes"])
  summary = factors.head_summary(head, p)
  biases = dense(203, p)
  assert summary["dense_bytes"] == pytest.approx(dense(60_600, p) + biases, rel=1e-12)
  assert summary["hybrid_bytes"] == pytest.approx(
    a["sent_bytes"] + b["sent_bytes"] + biases, rel=1e-12
  )


def test_mlp_head_of_the_default_config():
  """64 -> 128 -> 10, batch 16 per worker: factors for hidden_0 on 4 workers
  only (P K (M+N) = 3,072 P < 2 M N = 16,384 for P <= 5), never for out."""
  head = factors.head("mlp")
  assert head.layers == (
    factors.Layer("hidden_0", (64, 128), 16),
    factors.Layer("out", (128, 10), 16),
  )
  assert head.biases == (128, 10)
  four = factors.head_summary(head, 4)
  # Dense: 1.5 x 9,610 values; hybrid: hidden_0's 3 x 16 x 192 factor values.
  assert four["dense_bytes"] == 4 * 1.5 * 9_610 == 57_660
  assert four["hybrid_bytes"] == 4 * (1.5 * (1_280 + 138) + 3 * 16 * 192) == 45_372
  assert four["factored"] == ["hidden_0"]
  assert [factors.head_summary(head, p)["factored"] for p in (8, 16, 64)] == [[]] * 3


def test_vgg16_heads():
  cifar = factors.head("vgg16_cifar")
  assert cifar.layers == (factors.Layer("classifier", (512, 10), 32),)
  # 32 x 522 factor values per worker against 5,120 kernel values: dense.
  assert all(factors.head_summary(cifar, p)["ratio"] == 1.0 for p in factors.WORKERS)
  imagenet = factors.head("vgg16_imagenet")
  assert [(x.name, x.kernel, x.rows) for x in imagenet.layers] == [
    ("fc6", (25088, 4096), 32),
    ("fc7", (4096, 4096), 32),
    ("fc8", (4096, 1000), 32),
  ]
  # fc8 stays factored while P x 32 x 5,096 < 2 x 4,096,000: up to 50 workers.
  assert factors.head_summary(imagenet, 16)["factored"] == ["fc6", "fc7", "fc8"]
  assert factors.head_summary(imagenet, 64)["factored"] == ["fc6", "fc7"]
  four = factors.head_summary(imagenet, 4)
  kernels = 25088 * 4096 + 4096 * 4096 + 4096 * 1000
  assert four["dense_bytes"] == pytest.approx(dense(kernels + 4096 + 4096 + 1000, 4))
  sent = gathered(32, 25088, 4096, 4) + gathered(32, 4096, 4096, 4)
  sent += gathered(32, 4096, 1000, 4) + dense(4096 + 4096 + 1000, 4)
  assert four["hybrid_bytes"] == pytest.approx(sent)


def test_run_without_measured_runs_writes_its_table(tmp_path, capsys):
  result = factors.run(
    workers=(4,), measure_workers=(), models=("mlp",), out_dir=str(tmp_path)
  )
  assert [e["layer"] for e in result["exactness"]] == ["hidden_0", "out"]
  # Same products, same float32 dot: at most a reordered sum of 16 rows.
  assert all(e["max_rel_diff"] < 1e-5 for e in result["exactness"])
  saved = json.loads((tmp_path / "factors.json").read_text())
  assert saved["summary"][0]["factored"] == ["hidden_0"]
  out = capsys.readouterr().out
  assert "| mlp | hidden_0 | 64 x 128 | 16 | 4 |" in out


def test_bad_arguments_exit_with_a_message():
  with pytest.raises(SystemExit, match="models must be among"):
    bench_main.main(["factors", "--models", "alexnet"])
  with pytest.raises(SystemExit, match="invalid literal"):
    bench_main.main(["factors", "--workers", "4,x"])
