"""The ``sizes`` and ``wire`` bench suites, end to end at a tiny size.

Results are checked against closed forms, not against the suites' own code:
top-k sends ``k = max(1, floor(0.01 d))`` float32 values and ``k`` int32
indices per compressed buffer (all-gathered), ``none`` all-reduces 4 bytes per
value, and an affine time curve has its fixed and proportional costs equal at
``c / b``.
"""

import json
import math

import jax
import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import sizes, wire_suite
from gradcomp.models import shapes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESNET20_SIZES = [math.prod(s) for _, s in shapes.resnet20_shapes()]


def topk_bytes(d: int) -> int:
  return 8 * max(1, math.floor(0.01 * d))


def test_sizes_suite_times_curves_and_counts_bytes(tmp_path, capsys):
  grid = (16, 2**18)
  sizes.run(["none", "topk"], grid, repeats=5, out_dir=str(tmp_path))
  saved = json.loads((tmp_path / "sizes.json").read_text())
  assert saved["sizes"] == list(grid) and saved["backend"].startswith("cpu")
  rows = {r["compressor"]: r for r in saved["rows"]}
  assert list(rows) == ["none", "topk"]
  for curve in [*rows.values(), saved["copy"]]:
    t = curve["seconds"]
    assert all(s > 0 for s in t)
    assert t[1] > t[0]  # 16384x more values
    o = curve["overhead"]
    slope = (t[1] - t[0]) / (grid[1] - grid[0])
    assert o["fixed_s"] == t[0] and o["per_value_s"] == pytest.approx(slope)
    assert o["crossover"] == pytest.approx(t[0] / slope)
    r20 = o["models"]["resnet20"]
    assert r20["tensors"] == 59
    assert r20["below"] == sum(d < o["crossover"] for d in RESNET20_SIZES)
    assert r20["layerwise_s"] == pytest.approx(
      sum(float(np.interp(d, grid, t)) for d in RESNET20_SIZES)
    )
    assert r20["fixed_share"] == pytest.approx(59 * t[0] / r20["layerwise_s"])
    per_call = sum(
      max(float(np.interp(d, grid, t)) - slope * d, 0.0) for d in RESNET20_SIZES
    )
    assert r20["per_call_share"] == pytest.approx(per_call / r20["layerwise_s"])
  assert rows["topk"]["wire_bytes"] == [topk_bytes(d) for d in grid]
  assert rows["none"]["wire_bytes"] == [4 * d for d in grid]
  assert (tmp_path / "sizes.png").read_bytes()[:8] == PNG_MAGIC
  out = capsys.readouterr().out
  assert "| topk |" in out and "| copy (x * -1) |" in out


def test_overhead_of_an_affine_curve():
  grid = (16, 2**10, 2**20)
  fixed, per_value = 5e-5, 2e-9
  o = sizes.overhead(grid, [fixed + per_value * s for s in grid])
  assert o["per_value_s"] == pytest.approx(per_value)
  assert o["crossover"] == pytest.approx(fixed / per_value + 16)
  assert o["growth_to_2^20"] == pytest.approx(
    (fixed + per_value * 2**20) / o["fixed_s"]
  )
  # Every ResNet-50 tensor has at least 16 values: the curve is exact on all.
  r50 = o["models"]["resnet50"]
  values = shapes.RESNET50_NUM_PARAMS
  assert r50["layerwise_s"] == pytest.approx(161 * fixed + per_value * values)
  assert r50["single_s"] == pytest.approx(fixed + per_value * values)
  assert r50["fixed_share"] == pytest.approx(
    161 * (fixed + 16 * per_value) / r50["layerwise_s"]
  )
  assert r50["per_call_share"] == pytest.approx(161 * fixed / r50["layerwise_s"])
  # GPT-2 small's smallest tensors (biases, LayerNorms) have 768 values.
  gpt = o["models"]["gpt2_small"]
  assert gpt["tensors"] == 148
  values = shapes.GPT2_SMALL_NUM_PARAMS
  assert gpt["layerwise_s"] == pytest.approx(148 * fixed + per_value * values)
  assert gpt["single_s"] == pytest.approx(fixed + per_value * values)
  flat = sizes.overhead(grid, [1e-4, 1e-4, 1e-4])
  assert flat["crossover"] is None and flat["models"]["resnet50"]["below"] == 0
  assert flat["models"]["resnet50"]["fixed_share"] == pytest.approx(1.0)


def test_wire_suite_matches_closed_forms(tmp_path, capsys):
  wire_suite.run(["resnet20"], ["none", "topk"], workers=8, out_dir=str(tmp_path))
  saved = json.loads((tmp_path / "wire.json").read_text())
  m = saved["models"]["resnet20"]
  values = sum(RESNET20_SIZES)
  assert m["values"] == values == 269_722 and m["dense_bytes"] == 4 * values
  rows = {r["compressor"]: r for r in m["rows"]}
  for layout in ("layerwise", "fused"):
    none = rows["none"][layout]
    assert none["bytes"] == 4 * values and none["per_kind"] == {
      "all-reduce": 4 * values
    }
    assert none["fraction"] == 1.0 and none["ring_fraction"] == pytest.approx(1.0)
  fused, layerwise = rows["topk"]["fused"], rows["topk"]["layerwise"]
  assert fused["source"] == "hlo" and fused["agree"] is True
  assert fused["per_kind"] == {"all-gather": topk_bytes(values)}
  assert fused["fraction"] == topk_bytes(values) / (4 * values)
  # A ring all-gather moves (n - 1) x its operand, an all-reduce 2 (n - 1) / n x.
  assert fused["ring_fraction"] == pytest.approx(
    7 * topk_bytes(values) / (2 * 7 / 8 * 4 * values)
  )
  assert layerwise["source"] == "traced" and layerwise["agree"] is None
  assert layerwise["per_kind"] == {
    "all-gather": sum(topk_bytes(d) for d in RESNET20_SIZES)
  }
  assert fused["collectives"] < layerwise["collectives"]
  assert (tmp_path / "wire.png").read_bytes()[:8] == PNG_MAGIC
  assert "| resnet20 | topk |" in capsys.readouterr().out


def test_wire_layerwise_compiled_agrees_with_trace():
  mesh = jax.make_mesh((8,), (wire_suite.AXIS,))
  tree = {
    "a": jax.ShapeDtypeStruct((150,), "float32"),
    "b": jax.ShapeDtypeStruct((7, 50), "float32"),
  }
  row = wire_suite.measure("topk", tree, mesh, compile_layerwise=True)
  layerwise = row["layerwise"]
  assert layerwise["source"] == "hlo" and layerwise["agree"] is True
  assert layerwise["bytes"] == topk_bytes(150) + topk_bytes(350)
  assert row["fused"]["bytes"] == topk_bytes(500)


@pytest.mark.parametrize(
  "argv",
  [
    ["sizes", "--full", "--sizes", "16"],
    ["sizes", "--sizes", "64,16"],
    ["sizes", "--only", "nope"],
    ["wire", "--models", "resnet21"],
    ["wire", "--devices", "1"],
  ],
)
def test_cli_rejects_bad_flags(argv):
  with pytest.raises(SystemExit):
    bench_main.main(argv)


def test_every_suite_is_a_command_of_python_m_bench():
  """``python -m bench SUITE --help`` parses for every suite (the package moved
  out of the library: its entry point, imports and paths must follow)."""
  import re
  import subprocess
  import sys
  from pathlib import Path

  done = subprocess.run(
    [sys.executable, "-m", "bench", "--help"],
    cwd=Path(__file__).resolve().parent.parent,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  names = re.search(r"\{([a-z0-9_,-]+)\}", done.stdout).group(1).split(",")
  assert {"compress", "transformer", "step", "sizes", "device-step"} <= set(names)
  for name in names:
    with pytest.raises(SystemExit) as exit_:
      bench_main.main([name, "--help"])
    assert exit_.value.code == 0
