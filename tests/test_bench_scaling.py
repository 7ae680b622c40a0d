"""The scaling suite: paper-calibrated profiles, the simulated table and the claims."""

import json

import numpy as np
import pytest

from bench import paper, scaling
from gradcomp.models import shapes

# Comp is affine, so a coarse grid is exact; it keeps the wire tracing cheap.
SIZES = (16, 1024, 65536)


def _resnet50_sizes():
  return [int(np.prod(s)) for _, s in shapes.resnet50_shapes()]


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_paper_profile_reproduces_table1_in_closed_form(name):
  p = paper.v100_profile(name, scaling.SEARCH_COMPRESSORS[name], sizes=SIZES)
  sizes = _resnet50_sizes()
  total = paper.TABLE1_MS[name] * 1e-3
  # Layer-wise: 161 calls, one per tensor, sum to Table 1's time.
  assert len(sizes) == 161
  np.testing.assert_allclose(p.comp_seconds(sizes).sum(), total, rtol=1e-9)
  # §3.1's split: Comp(2^20) = 2 Comp(2^4).
  np.testing.assert_allclose(p.comp_seconds(2**20) / p.comp_seconds(16), 2.0)
  # One call on the whole gradient: c + s D with s / c = 1 / (2^20 - 32),
  # 161 c + s D = total; fused pieces add two copies of 4 D bytes at 900 GB/s.
  d = sum(sizes)
  per_call = total / (161 + d / (2**20 - 32))
  single = per_call * (1 + d / (2**20 - 32))
  np.testing.assert_allclose(p.comp_seconds(d), single, rtol=1e-9)
  np.testing.assert_allclose(
    p.comp_seconds(d, fused=True), single + 16 * d / 900e9, rtol=1e-9
  )
  assert p.compressor.startswith(name)


def test_proxies_scale_a_table1_row_and_none_costs_nothing():
  total, origin = paper.table1_ms("ef_signsgd", {})
  # Sign bits with a residual read and write twice the bytes of plain signs.
  assert origin.startswith("Table 1 signsgd") and 1.9 < total / 13.0 < 2.1
  assert paper.table1_ms("none", {}) == (0.0, "no compression")
  with pytest.raises(ValueError, match="growth"):
    paper.calibrate(100.0, growth=0.5)


def test_suite_end_to_end_on_paper_costs(tmp_path, capsys):
  from bench.__main__ import main

  main([
    "scaling", "--sources", "paper", "--models", "resnet20",
    "--only", "none,topk", "--workers", "1,2,4", "--out", str(tmp_path),
  ])  # fmt: skip
  result = json.loads((tmp_path / "scaling.json").read_text())
  assert (tmp_path / "scaling_paper.png").stat().st_size > 0
  assert "### Claims (paper)" in (tmp_path / "scaling.md").read_text()
  assert "1. LayerFusion improves every compressor" in capsys.readouterr().out
  rows = result["rows"]
  assert len(rows) == 2 * 3 * 2  # compressors x workers x plans
  # T_1 of ResNet-20 at the V100 throughput: 3 forward FLOPs x batch 128.
  t1 = 3 * sum(shapes.forward_flops("resnet20")) * 128 / (paper.v100_tflops() * 1e12)
  for r in rows:
    np.testing.assert_allclose(r["single_worker_ms"], t1 * 1e3, rtol=1e-9)
    assert 0 < r["scaling_factor"] <= 1 + 1e-12
    np.testing.assert_allclose(
      r["scaling_factor"], r["single_worker_ms"] / r["iteration_ms"]
    )
    np.testing.assert_allclose(
      r["throughput"], r["workers"] * 128 / (r["iteration_ms"] * 1e-3)
    )
    # T_n = T_1 + Comp + the exchange that backprop does not hide.
    np.testing.assert_allclose(
      r["iteration_ms"], r["single_worker_ms"] + r["comp_ms"] + r["exposed_comm_ms"]
    )
  by = {(r["compressor"], r["workers"], r["plan"]): r for r in rows}
  # One worker, nothing to compress or exchange: eq. 1 gives exactly 1.
  for plan in scaling.PLANS:
    assert by["none", 1, plan]["scaling_factor"] == pytest.approx(1.0, abs=1e-12)
  for name in ("none", "topk"):
    lw = [by[name, n, "layerwise"]["scaling_factor"] for n in (1, 2, 4)]
    assert lw == sorted(lw, reverse=True)  # a fixed plan only slows with n
    for n in (1, 2, 4):
      assert by[name, n, "layerfusion"]["scaling_factor"] >= by[name, n, "layerwise"][
        "scaling_factor"
      ] * (1 - 1e-3)  # the search's eps
  claims = result["claims"]["paper"]
  assert claims["improves_every_compressor"]["holds"] is True
  assert claims["improves_every_compressor"]["workers"] == 4
  # Neither sketch_topk nor powersgd ran: those claims are not evaluated.
  assert claims["sketch_fusion_best"]["holds"] is None
  assert claims["powersgd_gains_little"]["holds"] is None


def _row(model, name, plan, sf, comp=0.0, comm=0.0):
  return {
    "model": model,
    "compressor": name,
    "plan": plan,
    "workers": 16,
    "scaling_factor": sf,
    "comp_ms": comp,
    "exposed_comm_ms": comm,
  }


def test_claims_read_the_numbers():
  table = {  # compressor: (layer-wise, LayerFusion) scaling factors
    "none": (0.5, 0.5),
    "topk": (0.4, 0.6),
    "dgc": (0.3, 0.45),
    "powersgd": (0.5, 0.52),
    "sketch_topk": (0.5, 0.7),
  }
  rows = [
    _row("m", name, plan, sf)
    for name, sfs in table.items()
    for plan, sf in zip(scaling.PLANS, sfs, strict=True)
  ]
  c = scaling.claims(rows)
  assert c["improves_every_compressor"]["holds"] is True
  assert c["sketch_fusion_best"]["holds"] is True
  assert c["sketch_fusion_best"]["models"]["m"]["rank"] == 1
  # PowerSGD +4 %, the others +50 %, +50 %, +40 %: little.
  assert c["powersgd_gains_little"]["holds"] is True
  np.testing.assert_allclose(c["powersgd_gains_little"]["models"]["m"]["gain"], 0.04)

  rows[-1] = _row("m", "sketch_topk", "layerfusion", 0.55, comp=9.0, comm=1.0)
  rows[1] = _row("m", "none", "layerfusion", 0.4, comp=0.0, comm=5.0)
  c = scaling.claims(rows)
  best = c["sketch_fusion_best"]["models"]["m"]
  assert best["holds"] is False and best["best"] == "topk layerfusion"
  worse = c["improves_every_compressor"]["models"]["m"]
  assert worse["holds"] is False and worse["reason"].startswith("none:")


def test_paper_compute_is_a_v100_at_its_measured_resnet50_throughput():
  work = scaling.workload("resnet50", "paper").workload
  # 128 images per T_1: the published single-V100 fp32 rate, 356 img/s.
  np.testing.assert_allclose(128 / work.single_worker_seconds, 356.0, rtol=1e-9)
  assert 0.5 < paper.v100_tflops() / paper.V100_FP32_PEAK_TFLOPS < 0.6


def test_gpt2_small_runs_at_8_sequences_per_worker():
  """``--models gpt2_small``: not in Table 3, so the batch of
  ``model_workload.BATCH_SIZES`` (8 sequences of 1,024 tokens); T_1 is its
  training FLOPs (3 x forward, attention included) at the V100 rate."""
  assert scaling.batch_size("gpt2_small") == 8
  assert scaling.batch_size("resnet50") == 128
  work = scaling.workload("gpt2_small", "paper").workload
  flops = 3 * sum(shapes.forward_flops("gpt2_small")) * 8
  np.testing.assert_allclose(
    work.single_worker_seconds, flops / (paper.v100_tflops() * 1e12), rtol=1e-9
  )
  with pytest.raises(ValueError, match="no batch size"):
    scaling.batch_size("alexnet")
