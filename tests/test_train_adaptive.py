"""1-bit Adam, 0/1 Adam and DeMo through the training program, on the tiny digits MLP.

``--config.optimizer.name=onebit_adam | zero_one_adam | demo`` trains with
the optimizer alone on each worker's gradient. Checked: the bytes per step
are the phases' closed form (1-bit Adam: dense, or int8 codes with
``warmup_bits``, through the warm-up, then its 1-bit exchange; 0/1 Adam:
dense, 1-bit or nothing by its schedule; DeMo: its top-k payload every
step), a run stopped in the warm-up or the compressed phase and resumed
ends bit for bit where the whole run ends (the error buffers are in the
checkpoint), and a config the optimizers cannot run is a one-line error. Digits, not gpt_tiny: the program's paths
are the same, the compiles far shorter (suite time).
"""

import json

import jax
import numpy as np
import pytest

from configs import default
from gradcomp.compressors import intq, scatter
from gradcomp.optimizers import demo as demo_lib
from train import logs, train

import harness

# One worker runs the module: its tests share the module's program run (``onebit_run``),
# built once.
pytestmark = pytest.mark.xdist_group("train_adaptive")

STEPS, FREEZE = 12, 4
SMALL = {
  "model.features": (16,),
  "compressor.name": "none",
  "fusion.plan": "none",
  "global_batch_size": 64,
  "optimizer.learning_rate": 1e-2,
  "num_train_steps": STEPS,
  "log_every_steps": 6,
  "eval_every_steps": 6,
  "checkpoint_every_steps": 6,
}


def tiny(**overrides):
  """The digits MLP, one hidden layer of 16, for ``STEPS`` steps."""
  config = default.get_config()
  config.update_from_flattened_dict({**SMALL, **overrides})
  return config


ONEBIT = {"optimizer.name": "onebit_adam", "optimizer.freeze_step": FREEZE}


@pytest.fixture(scope="module")
def onebit_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("onebit")
  return workdir, train.train_and_evaluate(tiny(**ONEBIT), workdir)


def every_step_bytes(sim, rounds) -> float:
  """What each step sends besides its exchange (metrics, the finite-step agreement)."""
  return sim["wire_bytes_per_step"] - rounds


def assert_resumes_where_the_whole_run_ends(whole_dir, whole, workdir, overrides):
  """A copy of the whole run preempted at step 6, resumed, ends bit for bit as it."""
  assert harness.preempted_copy(whole_dir, workdir) == STEPS // 2
  resumed = train.train_and_evaluate(tiny(**overrides), workdir)
  harness.assert_resumed_after(workdir, STEPS // 2)
  for part in ("params", "opt_state"):
    got, want = resumed.state[part], whole.state[part]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_onebit_adam_prices_its_two_phases(onebit_run):
  workdir, result = onebit_run
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  d = sum(np.size(x) for x in jax.tree.leaves(result.state["params"]))
  dense, compressed = 4 * d, scatter.onebit_payload_bytes(d, 8)
  assert sim["phase_wire"]["dense"] == {"all-reduce": dense}
  assert sum(sim["phase_wire"]["onebit"].values()) == compressed
  assert sim["phases"] == {"dense": FREEZE, "onebit": STEPS - FREEZE}
  rounds = (FREEZE * dense + (STEPS - FREEZE) * compressed) / STEPS
  # Besides the exchange: the logged means and the finite-step agreement.
  assert 0 < every_step_bytes(sim, rounds) < 64
  rows = [r for r in logs.read_metrics(workdir / logs.METRICS_FILE) if "loss" in r]
  assert all(r["wire_bytes_per_step"] == sim["wire_bytes_per_step"] for r in rows)
  # The simulated clock's rounds are dearer in the warm-up (a 4-byte value
  # each) than after it (about a bit).
  assert rows[-1]["sim_seconds"] > rows[0]["sim_seconds"] > 0
  assert np.isfinite(result.eval_metrics["eval_loss"])


def test_onebit_adam_resumes_its_errors_bit_for_bit(onebit_run, tmp_path):
  workdir, whole = onebit_run
  # Preempted after the checkpoint at step 6, in the compressed phase.
  assert_resumes_where_the_whole_run_ends(workdir, whole, tmp_path, ONEBIT)
  # The compressed phase ran, and left errors to carry over.
  errors = whole.state["opt_state"].inner_state[-1].worker_error
  assert np.any(np.asarray(errors))


# A warm-up through int8 codes in blocks of 64 (the study's), long enough that
# the resume below starts in it.
WARM_FREEZE = 8
QUANTIZED = {
  **ONEBIT,
  "optimizer.freeze_step": WARM_FREEZE,
  "optimizer.warmup_bits": 8,
  "optimizer.warmup_block_size": 64,
}


def test_a_quantized_warmup_is_priced_by_its_codec_and_resumes_bit_for_bit(tmp_path):
  whole_dir, part_dir = tmp_path / "whole", tmp_path / "resumed"
  whole = train.train_and_evaluate(tiny(**QUANTIZED), whole_dir)
  sim = json.loads((whole_dir / train.SIM_FILE).read_text())
  d = sum(np.size(x) for x in jax.tree.leaves(whole.state["params"]))
  # int_quantize's reduce-scatter of one fused buffer: each of the 8 chunks
  # of ceil(d / 8) values as int8 codes and a scale per block of 64, to its
  # owner (all-to-all); the owner's requantized chunk to all (all-gather).
  row = intq.row_bytes(-(-d // 8), 8, 64)
  assert row != intq.row_bytes(-(-d // 8), 8, 512)  # The block size reached it.
  assert sim["phase_wire"]["warmup"] == {"all-to-all": 8 * row, "all-gather": row}
  assert sim["phases"] == {"warmup": WARM_FREEZE, "onebit": STEPS - WARM_FREEZE}
  onebit = scatter.onebit_payload_bytes(d, 8)
  rounds = (WARM_FREEZE * 9 * row + (STEPS - WARM_FREEZE) * onebit) / STEPS
  assert 0 < every_step_bytes(sim, rounds) < 64
  assert np.isfinite(whole.eval_metrics["eval_loss"])
  # Preempted at step 6, inside the warm-up: the codec's residuals resume.
  assert_resumes_where_the_whole_run_ends(whole_dir, whole, part_dir, QUANTIZED)
  warm = whole.state["opt_state"].inner_state[-1].warmup
  assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(warm))


def test_demo_sends_its_payload_every_step(tmp_path):
  result = train.train_and_evaluate(
    tiny(**{"optimizer.name": "demo", "optimizer.topk": 8}), tmp_path
  )
  sim = json.loads((tmp_path / train.SIM_FILE).read_text())
  payload = sum(
    demo_lib.payload_bytes(np.shape(x), 64, 8)
    for x in jax.tree.leaves(result.state["params"])
  )
  assert sim["round_wire"]["all-gather"] == payload
  assert 0 < every_step_bytes(sim, payload) < 64
  assert np.isfinite(result.eval_metrics["eval_loss"])


ZERO_ONE = {
  "optimizer.name": "zero_one_adam",
  "optimizer.var_freeze_step": 6,
  "optimizer.var_update_scaler": 2,
  "optimizer.local_step_scaler": 2,
  "optimizer.local_step_clipper": 4,
}


def test_zero_one_adam_skips_rounds_and_its_bytes_show_it(tmp_path):
  result = train.train_and_evaluate(tiny(**ZERO_ONE), tmp_path)
  sim = json.loads((tmp_path / train.SIM_FILE).read_text())
  # Steps 1-12: d d o d o d | o o n o n o (variance steps, 1-bit rounds,
  # then local steps synchronising at growing intervals).
  assert sim["phases"] == {"dense": 4, "onebit": 6, "none": 2}
  d = sum(np.size(x) for x in jax.tree.leaves(result.state["params"])) // 8
  rounds = (4 * 4 * d + 6 * scatter.onebit_payload_bytes(d, 8)) / STEPS
  assert 0 < every_step_bytes(sim, rounds) < 64
  # Local steps: the workers' params are laid out per worker.
  assert np.shape(jax.tree.leaves(result.state["params"])[0])[0] == 8
  assert np.isfinite(result.eval_metrics["eval_loss"])


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    (
      {**ONEBIT, "compressor.name": "topk"},
      "onebit_adam compresses its own exchange: set config.compressor.name=none",
    ),
    (
      {**ONEBIT, "scheme.name": "local_sgd"},
      "synchronous training only .*not 'local_sgd'",
    ),
    (
      {"optimizer.name": "onebit_adam"},
      "needs config.optimizer.freeze_step.*--config.optimizer.freeze_step=",
    ),
    (
      {**ONEBIT, "optimizer.warmup_bits": 2},
      r"warmup_bits must be one of \(4, 8\) .*got 2",
    ),
    (
      {"optimizer.name": "adamw", "optimizer.warmup_bits": 8},
      "warmup_bits is the warm-up of onebit_adam and compressed_adam, not of adamw",
    ),
    (
      {**ONEBIT, "optimizer.warmup_block_size": 64},
      "warmup_block_size is the quantized warm-up's: set config.optimizer.warmup_bits",
    ),
    (
      {**QUANTIZED, "optimizer.warmup_block_size": 0},
      "warmup_block_size must be an integer >= 1, got 0",
    ),
  ],
)
def test_a_config_the_optimizer_cannot_run_is_one_line(overrides, message):
  with pytest.raises(ValueError, match=message) as error:
    train.validate(tiny(**overrides))
  assert "\n" not in str(error.value)
