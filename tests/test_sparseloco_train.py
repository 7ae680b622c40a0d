"""SparseLoCo in the training program: ``--config.scheme.name=sparseloco``.

A run resumed from the whole run's mid-run checkpoint (as after a
preemption) ends bit for bit where the whole run ends (the error-feedback
memory and the anchor are in the checkpoint); a
round sends the codec's packed payload, every ``every``-th step; a missing
field is a one-line error. Digits with 16 hidden units and 16 steps: the
program's paths are the same as a long run's, the compiles short.
"""

import json

import jax
import numpy as np
import pytest

from configs import sparseloco as recipe
from gradcomp.compressors import spec as spec_lib
from gradcomp.compressors import topk as topk_lib
from gradcomp.schemes.sparseloco import ratio
from train import logs, train
from train import schemes as schemes_lib

import harness

# One worker runs the module: its tests share the module's program run (``whole``),
# built once.
pytestmark = pytest.mark.xdist_group("sparseloco_train")

STEPS, EVERY, CHUNK, K = 16, 4, 8, 8
SMALL = {
  "model.features": (16,),
  "global_batch_size": 64,
  "num_train_steps": STEPS,
  "log_every_steps": 8,
  "eval_every_steps": 8,
  "checkpoint_every_steps": 8,
  "scheme.every": EVERY,
  "scheme.k": K,
  "scheme.chunk": CHUNK,
  "scheme.outer_learning_rate": 1.0,
}


def tiny(**overrides):
  config = recipe.get_config()
  config.update_from_flattened_dict({**SMALL, **overrides})
  return config


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sparseloco")
  return workdir, train.train_and_evaluate(tiny(), workdir)


def test_resumes_bit_for_bit(whole, tmp_path):
  workdir, want = whole
  # Preempted after the whole run's checkpoint at step 8: rounds 3 and 4 rerun.
  assert harness.preempted_copy(workdir, tmp_path) == STEPS // 2
  got = train.train_and_evaluate(tiny(), tmp_path)
  harness.assert_resumed_after(tmp_path, STEPS // 2)
  for part in ("params", "opt_state"):
    for a, b in zip(
      jax.tree.leaves(got.state[part]), jax.tree.leaves(want.state[part]), strict=True
    ):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Rounds ran and left a memory to carry over the checkpoint.
  residuals = want.state["opt_state"].inner_state.compressor_state.leaves
  assert any(
    np.any(np.asarray(r.residual))
    for r in jax.tree.leaves(residuals, is_leaf=lambda x: hasattr(x, "residual"))
  )


def test_a_round_sends_the_packed_payload_every_every_steps(whole):
  workdir, result = whole
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  # params carry the worker axis: one worker's shapes.
  shapes = [np.shape(x)[1:] for x in jax.tree.leaves(result.state["params"])]
  payload = sum(topk_lib.payload_bytes(s, ratio(K, CHUNK), CHUNK, 2) for s in shapes)
  assert sim["round_wire"] == {"all-gather": payload}
  besides = sim["wire_bytes_per_step"] - payload / EVERY  # metrics, agreement
  assert 0 < besides < 64
  assert sim["peak_bytes_per_step"] == pytest.approx(besides + payload)
  rows = [r for r in logs.read_metrics(workdir / logs.METRICS_FILE) if "loss" in r]
  assert all(r["wire_bytes_per_step"] == sim["wire_bytes_per_step"] for r in rows)
  assert np.isfinite(result.eval_metrics["eval_loss"])


def test_a_missing_field_is_named():
  config = tiny()
  config.scheme.k = None
  with pytest.raises(ValueError, match=r"needs config.scheme.k .*--config.scheme.k="):
    schemes_lib.get(config).resolve(config)


def test_the_recipe_sends_its_own_codec():
  """A compressor or fusion plan left in the config is replaced, not run."""
  config = tiny(**{"compressor.name": "topk", "compressor.ratio": 0.01})
  config.fusion.plan = "auto"
  resolved = schemes_lib.get(config).resolve(config)
  assert resolved.compressor.name == "none" and resolved.compressor.ratio is None
  assert resolved.fusion.plan == "none"


def test_the_mean_field_reaches_the_codec():
  """``scheme.mean=senders`` builds Templar's reading; unset keeps Alg. 1's."""

  def round_tx(config):  # the codec a round sends; it reads only the config
    return schemes_lib.get(config)(config, None, None, "shard_map").round_tx(None)

  senders = spec_lib.spec_of(round_tx(tiny(**{"scheme.mean": "senders"})))
  assert dict(senders.arguments)["mean"] == "senders"
  assert "mean" not in dict(spec_lib.spec_of(round_tx(tiny())).arguments)
  with pytest.raises(ValueError, match=r"mean must be 'workers' or 'senders'"):
    round_tx(tiny(**{"scheme.mean": "all"}))
