"""``python -m bench hierarchy`` on a small buffer: its figures against closed forms.

One buffer of ``D`` values per device on the (2, 4) mesh; a few exchanges,
two simulated node counts. The bytes crossing nodes follow from the
algorithms: the dense all-reduce over all 8 sends ``2 (8 - 1) / 8`` of its
buffer; hierarchical dense sends a quarter of it across the 2 nodes
(``2 (2 - 1) / 2`` of ``D / 4``); hierarchical top-k gathers ``k`` values
and ``k`` int32 indices of the ``D / 4`` shard to the other node.
"""

import json

import pytest

from bench import hierarchy

pytestmark = pytest.mark.xdist_group("bench_hierarchy")

D = 4096


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("hierarchy")
  return out, hierarchy.run(
    models=("resnet50",),
    nodes=(2, 16),
    exchanges=("dense", "topk", "hier_dense", "hier_topk", "qgz"),
    out_dir=str(out),
    sizes={"resnet50": D},
  )


def test_bytes_crossing_nodes_follow_the_algorithms(result):
  _, r = result
  rows = r["models"]["resnet50"]["exchanges"]
  cross = {k: hierarchy.cross_node(v["2x4"]["per_axis"]) for k, v in rows.items()}
  assert cross["dense"] == 4 * D * 2 * 7 / 8
  assert cross["hier_dense"] == 4 * (D // 4) * 2 * 1 / 2
  k = int(hierarchy.TOPK_RATIO * D // 4) or 1
  assert cross["hier_topk"] == 8 * k  # one peer node: (2 - 1) x (k floats + k ints)
  fast = rows["hier_dense"]["2x4"]["per_axis"]["local"]
  # Reduce-scatter (3/4 of D floats) and all-gather (3 peers x D/4) inside.
  assert fast["link"] == 4 * D * 3 / 4 + 3 * 4 * D / 4
  assert all(v["2x4"]["traced_agrees"] for v in rows.values())
  assert "8" in rows["topk"] and "8" not in rows["qgz"]


def test_simulated_times_are_priced_per_link_class(result):
  _, r = result
  rows = r["models"]["resnet50"]["exchanges"]
  for row in rows.values():
    for sim in row["simulated"].values():
      fast, slow = (sim["seconds"][str(g)]["comm"] for g in hierarchy.INTER_GBPS)
      assert 0 < fast <= slow  # 100 Gbit/s before 25 between nodes
  # 16 nodes: hierarchical dense crosses nodes with a quarter of dense's buffer.
  big = {
    k: hierarchy.cross_node(v["simulated"]["16"]["per_axis"]) for k, v in rows.items()
  }
  assert big["hier_dense"] == pytest.approx(4 * D / 8 * 2 * 15 / 16)


def test_writes_its_tables(result):
  out, r = result
  saved = json.loads((out / "hierarchy.json").read_text())
  assert saved["models"]["resnet50"]["size"] == D
  table = (out / "hierarchy.md").read_text()
  assert "hier_topk" in table and "ZeRO++" in table


def test_bad_arguments_are_value_errors():
  with pytest.raises(ValueError, match="unknown models"):
    hierarchy.check(("vgg99",), (4,), ("dense",))
  with pytest.raises(ValueError, match="nodes must be integers >= 2"):
    hierarchy.check(("resnet50",), (1,), ("dense",))
  with pytest.raises(ValueError, match="must include 'dense'"):
    hierarchy.check(("resnet50",), (4,), ("topk",))
