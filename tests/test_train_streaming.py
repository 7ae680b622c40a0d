"""Streaming DiLoCo in the training program: fragments, overlap and eager updates end to end.

Checked against what is independent of the pricing code: a fragment's dense
round is the float32 all-reduce of its own parameters (4 bytes each), the
fragments' rounds add up to DiLoCo's whole round, and an overlapped clock is
never slower than the same rounds behind a barrier.
"""

import json

import jax
import numpy as np
import pytest

import gradcomp
from configs import default
from train import logs, optimizer, train

# One worker runs the module: its tests share the module's program run
# (``streaming_run``), built once.
pytestmark = pytest.mark.xdist_group("train_streaming")

# The MLP on digits with 16 hidden units, two layers, so two fragments of one
# layer each: DiLoCo every 8 steps, fragment 1 sends 4 steps after fragment 0,
# one step of overlap, eager updates (each worker's anchor its own).
STREAMING = {
  "model.features": (16,),
  "compressor.name": "none",
  "fusion.plan": "single",
  "global_batch_size": 64,
  "num_train_steps": 48,
  "log_every_steps": 16,
  "eval_every_steps": 48,
  "checkpoint_every_steps": 48,
  "scheme.name": "local_sgd",
  "scheme.every": 8,
  "scheme.outer_learning_rate": 0.7,
  "scheme.fragments": 2,
  "scheme.overlap": 1,
  "scheme.eager": True,
}


@pytest.fixture(scope="module")
def streaming_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("streaming")
  return workdir, train.train_and_evaluate(_config(), workdir)


def _config():
  config = default.get_config()
  config.update_from_flattened_dict(STREAMING)
  return config


def test_each_fragment_sends_its_own_parameters_and_the_peak_is_the_largest(
  streaming_run,
):
  workdir, result = streaming_run
  sim = json.loads((workdir / "sim.json").read_text())
  params = result.state["params"]  # One row per worker.
  sizes = [int(np.prod(x.shape[1:])) for x in jax.tree.leaves(params)]
  assert sim["fragments"] == 2 and sim["fragment_leaves"] == [2, 2]
  sent = [w["all-reduce"] for w in sim["fragment_wire"]]
  # Dense fp32 all-reduces: fragment bytes are 4 per parameter, in all one
  # DiLoCo round's, split by layer (output layer first: gradient-ready order).
  assert sum(sent) == 4 * sum(sizes)
  assert sorted(sent) == sorted(4 * (k.size // k.shape[0]) for k in _layers(params))
  every_step = sim["wire_bytes_per_step"] - sum(sent) * (48 // 4 // 2) / 48
  assert sim["peak_bytes_per_step"] == pytest.approx(every_step + max(sent))
  rows = [r for r in logs.read_metrics(workdir / "metrics.jsonl") if "loss" in r]
  assert {r["peak_wire_bytes_per_step"] for r in rows} == {sim["peak_bytes_per_step"]}
  assert all(r["wire_bytes_per_step"] < r["peak_wire_bytes_per_step"] for r in rows)


def _layers(params):
  """Each layer's kernel and bias as one flat array per worker."""
  return [
    np.concatenate(
      [np.asarray(x).reshape(x.shape[0], -1) for x in jax.tree.leaves(v)], 1
    )
    for v in params.values()
  ]


def test_the_overlapped_clock_is_never_slower_than_a_barrier(streaming_run):
  workdir, result = streaming_run
  sim = json.loads((workdir / "sim.json").read_text())
  rows = [r for r in logs.read_metrics(workdir / "metrics.jsonl") if "loss" in r]
  wires = sim["fragment_wire"]
  cluster = optimizer.cluster_of(_config(), jax.device_count())
  barrier = gradcomp.sim.simulate_rounds(
    cluster,
    sim["flops_per_step"],
    lambda step: step % 4 == 0,
    lambda step: wires[(step % 8) // 4],
    48,
  )
  for row in rows:
    assert 0 < row["sim_seconds"] <= barrier[row["step"]]


def test_eager_workers_keep_their_own_anchor_and_the_run_learns(streaming_run):
  _, result = streaming_run
  state = result.state["opt_state"].inner_state
  assert isinstance(state, gradcomp.schemes.streaming.StreamingState)
  anchors = jax.tree.leaves(state.anchor)
  assert all(a.shape[0] == jax.device_count() for a in anchors)
  assert result.eval_metrics["eval_accuracy"] > 0.5  # 10 classes.


def test_split_leaves_fragments_send_half_each(tmp_path):
  """Whole layers of the MLP are 1,040 and 170 values; cut, 605 and 605."""
  config = _config()
  config.update_from_flattened_dict(
    {"scheme.split_leaves": True, "scheme.eager": False, "num_train_steps": 16}
  )
  result = train.train_and_evaluate(config, tmp_path)
  sim = json.loads((tmp_path / "sim.json").read_text())
  sizes = [int(np.prod(x.shape[1:])) for x in jax.tree.leaves(result.state["params"])]
  assert sim["fragment_values"] == [sum(sizes) // 2] * 2
  sent = [w["all-reduce"] for w in sim["fragment_wire"]]
  assert sent == [4 * sum(sizes) // 2] * 2
  every_step = sim["wire_bytes_per_step"] - sum(sent) * (16 // 4 // 2) / 16
  assert sim["peak_bytes_per_step"] == pytest.approx(every_step + sent[0])
  assert np.isfinite(result.eval_metrics["eval_loss"])
