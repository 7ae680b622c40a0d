"""The transformer workload through the training program: gpt_tiny on bytes of text.

One short run of ``configs/gpt_tiny.py`` (a smaller context and batch, a
constant learning rate so a resumed run sees the same schedule) end to end,
and the same run stopped halfway and resumed, which must end bit for bit
where it ended (same windows, same optimizer state).
"""

import importlib
import json
import math

import jax
import numpy as np
import pytest

from train import logs, text, train

import harness

# One worker runs the module: its tests share the module's program run (``text_run``),
# built once.
pytestmark = pytest.mark.xdist_group("train_text")

STEPS = 12
SMALL = {
  "dataset.context": 32,
  # One narrow layer: the program's paths are the same, the compile is shorter.
  "model.num_layers": 1,
  "model.width": 32,
  "model.num_heads": 2,
  "dataset.max_eval_windows": 64,
  "global_batch_size": 16,
  "optimizer.schedule": "constant",
  "optimizer.learning_rate": 3e-3,
  "num_train_steps": STEPS,
  "log_every_steps": 6,
  "eval_every_steps": 6,
  "checkpoint_every_steps": 6,
  "eval_batch_size": 32,
}


def gpt_tiny(**overrides):
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.update_from_flattened_dict({**SMALL, **overrides})
  return config


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("gpt_tiny")
  return workdir, train.train_and_evaluate(gpt_tiny(), workdir)


def test_gpt_tiny_runs_and_logs_bits_per_byte(text_run):
  workdir, result = text_run
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train_rows] == [6, 12]
  for r in train_rows:
    assert r["tokens_per_sec"] == pytest.approx(r["samples_per_sec"] * 32)
    assert r["sim_seconds"] > 0 and r["wire_bytes_per_step"] > 0
  last = eval_rows[-1]
  assert last["eval_bits_per_byte"] == pytest.approx(last["eval_loss"] / math.log(2))
  # Twelve AdamW steps from a near-uniform init (ln 256 nats = 8 bits per byte)
  # already learn the byte frequencies' bulk: well below 8 bits.
  assert last["eval_bits_per_byte"] < 7.0, last
  assert np.isfinite(result.eval_metrics["eval_loss"])


def test_config_json_records_the_corpus(text_run):
  workdir, _ = text_run
  config = json.loads((workdir / "config.json").read_text())
  corpus = text.read_corpus()
  assert config["dataset_identity"]["sha256"] == corpus.sha256
  assert config["optimizer"]["name"] == "adamw"
  assert config["model"]["name"] == "gpt_tiny"


def test_resumed_run_ends_where_the_whole_run_ends(text_run, tmp_path):
  """Resumed from the whole run's checkpoint at step 6 (as after a preemption):
  the corpus's batch position and AdamW's state are in the checkpoint."""
  workdir, whole = text_run
  assert harness.preempted_copy(workdir, tmp_path) == STEPS // 2
  resumed = train.train_and_evaluate(gpt_tiny(), tmp_path)
  harness.assert_resumed_after(tmp_path, STEPS // 2)
  got, want = resumed.state["params"], whole.state["params"]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
