"""The floor suite (bench/floor.py, issue 43 item 4) on tiny shapes.

It must run every codec of issue 43 against the floor in one process and write
a JSON record whose multiple is the codec's median over the floor's, both
timed in the same interleaved rounds.
"""

import json
import statistics

import pytest

from bench import floor

# One worker builds the run once for both tests.
pytestmark = pytest.mark.xdist_group("bench_floor")

_SHAPES = [("conv/kernel", (3, 3, 4, 8)), ("conv/bias", (8,)), ("dense", (40, 10))]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("floor")
  res = floor.run(
    model="tiny",
    repeats=2,
    warmup=0,
    out_dir=str(out),
    with_peers=False,
    shape_list=_SHAPES,
  )
  return res, json.loads((out / "floor.json").read_text())


def test_every_codec_row_is_written_with_its_fields(result):
  res, written = result
  assert [r["label"] for r in written["rows"]] == list(floor.CODECS)
  assert written["num_params"] == 3 * 3 * 4 * 8 + 8 + 40 * 10
  assert written["floor_bytes"] == 8 * written["num_params"]
  for row in written["rows"]:
    assert row["fused"]["finite"], row["label"]
    assert len(row["fused"]["times_ms"]) == len(row["floor"]["times_ms"]) == 2
    assert row["multiple"] == pytest.approx(
      row["fused"]["median_ms"] / row["floor"]["median_ms"]
    )
  assert res["rows"][0]["label"] == written["rows"][0]["label"]


def test_the_floor_is_positive_and_its_median(result):
  _, written = result
  floors = [r["floor"]["median_ms"] for r in written["rows"]]
  assert min(floors) > 0
  assert written["floor_ms"] == pytest.approx(statistics.median(floors))


def test_a_peer_row_has_its_ratio(tmp_path):
  res = floor.run(
    model="tiny",
    repeats=1,
    warmup=0,
    out_dir=str(tmp_path),
    only="randomk",
    shape_list=_SHAPES,
  )
  (row,) = res["rows"]
  best = row["best_peer"]
  assert best.startswith(("jax_", "torch_"))
  assert row["vs_best_peer"] == pytest.approx(
    row["fused"]["median_ms"] / row[best]["median_ms"]
  )


def test_unknown_labels_are_refused():
  with pytest.raises(ValueError, match="unknown codec label"):
    floor.run(only="topk", shape_list=_SHAPES)
