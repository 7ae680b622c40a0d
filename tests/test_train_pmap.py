"""The ``pmap`` variant of the training step (``config.step="pmap"``).

Checked against the default ``shard_map`` step: the same run (seed, data,
compressor) ends with the same state; checkpoints hold the same layout under
either variant, and a ``pmap`` run resumes bit for bit.
"""

import shutil

import jax
import numpy as np
import pytest
from test_train import leaves, tiny_config

from train import checkpoint, logs, train

import harness

# One pytest-xdist worker runs the module, so its module fixture is built once.
pytestmark = pytest.mark.xdist_group("train_pmap")


STEPS = 20  # Two checkpoints: the resume tests restart from the first.
SHORT = {
  "num_train_steps": STEPS,
  "log_every_steps": 10,
  "eval_every_steps": STEPS,
  "checkpoint_every_steps": STEPS // 2,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``{variant: (workdir, result)}`` of the same short run under each step."""
  out = {}
  for variant in ("shard_map", "pmap"):
    workdir = tmp_path_factory.mktemp(variant)
    result = train.train_and_evaluate(tiny_config(step=variant, **SHORT), workdir)
    out[variant] = workdir, result
  return out


def assert_close(got, want):
  # pmap and shard_map compile the step separately; today both give the same
  # bits, but nothing promises the same order of float32 sums. A reordered
  # sum seeds differences of ~u = 6e-8 of a leaf's size that the run
  # amplifies about 2x every 10 steps (sketch_topk with momentum; a 1-ulp
  # change of the initial params: <= 5e-7 of each leaf's largest value after
  # 20 steps, ~2e-5 after 80). 1e-5 of the leaf's largest value: a factor of
  # 20 over that; updates 8/7 too large (a mean over 7 workers) or two
  # workers' residual rows swapped differ by tens of percents.
  harness.assert_states_close(got, want, rel=1e-5)


def test_pmap_equals_shard_map(runs):
  _, want = runs["shard_map"]
  workdir, got = runs["pmap"]
  # Whole state in the shard_map layout: params, residuals, momentum, counters.
  assert jax.tree.structure(got.state) == jax.tree.structure(want.state)
  assert_close(got.state, want.state)
  assert got.eval_metrics == pytest.approx(want.eval_metrics, rel=1e-5)
  fusion, _ = got.state["opt_state"].inner_state
  (residual,) = [np.asarray(leaf.residual) for leaf in fusion.inner.leaves]
  assert residual.shape[0] == jax.device_count()
  assert not np.allclose(residual[0], residual[1])  # Still one per worker.
  rows = [r for r in logs.read_metrics(workdir / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in rows] == [10, 20]
  assert rows[0]["wire_bytes_per_step"] > 0


def resume_from_half(source, workdir, variant):
  """Trains ``variant`` to STEPS from ``source``'s checkpoint at STEPS / 2."""
  shutil.copytree(source, workdir)
  shutil.rmtree(workdir / "checkpoints" / str(STEPS))
  return train.train_and_evaluate(tiny_config(step=variant, **SHORT), workdir)


def test_pmap_resumes_its_own_checkpoint_exactly(runs, tmp_path):
  source, want = runs["pmap"]
  got = resume_from_half(source, tmp_path / "run", "pmap")
  for a, b in zip(leaves(got.state), leaves(want.state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_checkpoints_hold_the_same_layout_under_both_steps(runs):
  # So either variant resumes the other's checkpoint.
  like = runs["shard_map"][1].state
  saved = []
  for variant in ("shard_map", "pmap"):
    ckpt = checkpoint.Checkpointer(runs[variant][0] / "checkpoints", 3)
    try:
      saved.append(ckpt.restore(STEPS // 2, like))
    finally:
      ckpt.close()
  assert_close(*saved)


def test_unknown_step_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="unknown step 'vmap'.*shard_map, pmap"):
    train.train_and_evaluate(tiny_config(step="vmap"), tmp_path)
