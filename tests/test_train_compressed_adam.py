"""Compressed-momentum Adam and a compressor's dense warm-up through the training program.

``--config.optimizer.name=compressed_adam`` with the codec from
``config.compressor``, and ``--config.compressor.warmup_steps=N`` before a
compressor: the bytes per step are the two phases' (the float32
all-reduce through the warm-up, the codec's exchange traced alone after
it), a run resumed from the whole run's mid-run checkpoint ends bit for
bit where the whole run ends (the codec's residuals and the warm-up's count
are in the checkpoint), and a config the program cannot run is a one-line
error. On the tiny digits MLP, as ``test_train_adaptive.py``.
"""

import json

import jax
import numpy as np
import pytest
from test_elastic_resume import assert_mass_conserved
from test_train_adaptive import STEPS, tiny

from train import logs, train

import harness

FREEZE = 4
ADAM = {
  "optimizer.name": "compressed_adam",
  "optimizer.freeze_step": FREEZE,
  "compressor.name": "topk",
  "compressor.ratio": 0.05,
}
# The warm-up ends after the checkpoint the resumed run starts from (step 6):
# the switch happens in the resumed half.
WARMUP = 8
WARMED = {
  "optimizer.name": "adamw",
  "compressor.name": "topk",
  "compressor.ratio": 0.05,
  "compressor.warmup_steps": WARMUP,
}


def topk_bytes(params, ratio=0.05) -> int:
  """Top-k's all-gather per leaf: k float32 values and k int32 indices."""
  return sum(
    8 * max(1, int(np.floor(ratio * np.size(x)))) for x in jax.tree.leaves(params)
  )


def whole_and_resumed(overrides, tmp_path):
  """The whole run, and the same config resumed from its checkpoint at step 6."""
  whole = train.train_and_evaluate(tiny(**overrides), tmp_path / "whole")
  resumed_dir = tmp_path / "resumed"
  assert harness.preempted_copy(tmp_path / "whole", resumed_dir) == STEPS // 2
  resumed = train.train_and_evaluate(tiny(**overrides), resumed_dir)
  harness.assert_resumed_after(resumed_dir, STEPS // 2)
  return whole, resumed


def assert_same_state(got, want):
  for part in ("params", "opt_state"):
    leaves = zip(jax.tree.leaves(got[part]), jax.tree.leaves(want[part]), strict=True)
    for a, b in leaves:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  ("overrides", "dense_steps"), [(ADAM, FREEZE), (WARMED, WARMUP)], ids=["adam", "warm"]
)
def test_two_phases_priced_and_resumed_bit_for_bit(overrides, dense_steps, tmp_path):
  whole, resumed = whole_and_resumed(overrides, tmp_path)
  sim = json.loads((tmp_path / "whole" / train.SIM_FILE).read_text())
  params = whole.state["params"]
  d = sum(np.size(x) for x in jax.tree.leaves(params))
  dense, compressed = 4 * d, topk_bytes(params)
  assert sim["phases"] == {"dense": dense_steps, "compressed": STEPS - dense_steps}
  assert sim["phase_wire"]["dense"] == {"all-reduce": dense}
  assert sim["phase_wire"]["compressed"] == {"all-gather": compressed}
  rounds = (dense_steps * dense + (STEPS - dense_steps) * compressed) / STEPS
  # Besides the exchange: the logged means and the finite-step agreement.
  assert 0 < sim["wire_bytes_per_step"] - rounds < 64
  rows = [r for r in logs.read_metrics(tmp_path / "whole" / logs.METRICS_FILE)]
  assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
  assert_same_state(resumed.state, whole.state)
  # The compressed phase ran and left residuals to carry over.
  residuals = [
    np.asarray(x)
    for path, x in jax.tree_util.tree_leaves_with_path(whole.state["opt_state"])
    if "residual" in jax.tree_util.keystr(path)
  ]
  assert residuals and any(np.any(r) for r in residuals)

  # Elastic: the 8-worker checkpoint resumed on 4 workers at its last step
  # (the state moved, untrained): the replicated Adam moments and the
  # warm-up's count kept, the codec's residuals re-partitioned with their
  # mass (what mean aggregation still owes) conserved.
  four = train.train_and_evaluate(tiny(**overrides, workers=4), tmp_path / "whole")
  moved = [
    r["elastic"]
    for r in logs.read_metrics(tmp_path / "whole" / "metrics.jsonl")
    if "elastic" in r
  ]
  assert moved and moved[-1]["from_workers"] == 8 and moved[-1]["to_workers"] == 4
  after = [
    np.asarray(x)
    for path, x in jax.tree_util.tree_leaves_with_path(four.state["opt_state"])
    if "residual" in jax.tree_util.keystr(path)
  ]
  for b, a in zip(residuals, after, strict=True):
    assert b.shape[0] == 8 and a.shape[0] == 4
    assert_mass_conserved(b.reshape(8, -1), a.reshape(4, -1))


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    (
      {**WARMED, "scheme.name": "local_sgd", "scheme.every": 4},
      "warmup_steps=8 warms up synchronous training only .*not 'local_sgd'",
    ),
    (
      {**ADAM, "compressor.warmup_steps": 2},
      "does not apply to config.optimizer.name=compressed_adam; its dense "
      "warm-up is config.optimizer.freeze_step",
    ),
    (
      {**WARMED, "compressor.warmup_steps": -1},
      "config.compressor.warmup_steps must be an integer >= 0, got -1",
    ),
    (
      {"optimizer.name": "compressed_adam", "compressor.name": "topk"},
      "compressed_adam needs config.optimizer.freeze_step",
    ),
    (
      {**ADAM, "optimizer.freeze_step": 0},
      "config.optimizer.freeze_step must be an integer >= 1, got 0",
    ),
  ],
)
def test_a_config_the_program_cannot_run_is_one_line(overrides, message):
  with pytest.raises(ValueError, match=message) as error:
    train.validate(tiny(**overrides))
  assert "\n" not in str(error.value)
