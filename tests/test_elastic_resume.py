"""Elastic resume (DESIGN §9): a run checkpointed on n workers resumes on m.

End to end on digits: top-k's error feedback 8 -> 4 -> 8 conserves the mass
not yet sent and keeps training; ``none`` with SGD resumed 8 -> 8 is today's
exact resume. Each rule of ``train/elastic.py`` is checked on small NumPy
arrays against what it must conserve, and a state of no known kind is a
``ValueError`` naming it.
"""

import shutil
from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
import pytest

from configs import default
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.compressors.scatter import chunk_size
from gradcomp.schemes.async_ps import AsyncPSState
from gradcomp.schemes.gosgd import GoSGDState
from gradcomp.schemes.streaming import StreamingState
from train import elastic, logs, train
from train.schemes.base import Scheme

import harness

# One worker runs the module: its tests share the module's 8-worker run (``eight``),
# built once.
pytestmark = pytest.mark.xdist_group("elastic_resume")

TINY = {
  "model.features": (16,),
  "compressor.name": "topk",
  "compressor.ratio": 0.1,
  "fusion.plan": "single",
  "global_batch_size": 64,
  "num_train_steps": 16,
  "log_every_steps": 8,
  "eval_every_steps": 16,
  "checkpoint_every_steps": 8,
}
U32, U64 = 2.0**-24, 2.0**-53  # Unit roundoffs of float32 and float64.


def config(**overrides):
  c = default.get_config()
  c.update_from_flattened_dict({**TINY, **overrides})
  return c


def residual(state) -> np.ndarray:
  """The fused top-k residual, ``(workers, values)``."""
  (leaf,) = jax.tree.leaves(state["opt_state"].inner_state[0].inner.leaves)
  return np.asarray(leaf)


def mass(rows) -> np.ndarray:
  """What mean aggregation still owes: ``(1/n) sum_w e_w``, in float64."""
  return np.mean(np.asarray(rows, np.float64), axis=0)


def assert_mass_conserved(before: np.ndarray, after: np.ndarray) -> None:
  """``mass(after) == mass(before)`` up to the rounding of the additions.

  The move sums n float32 rows in float64 (n - 1 additions and a division:
  at most ``n u64`` of ``mean |e_w|``) and rounds the mean to float32 once
  (``u32 |mass|``); this test's own float64 mean errs as much again. The n
  equal rows after sum exactly in float64 (m <= 8 needs 3 more bits).
  """
  n = before.shape[0]
  scale = np.mean(np.abs(np.asarray(before, np.float64)), axis=0)
  bound = U32 * np.abs(mass(before)) + (2 * n + 1) * U64 * scale
  error = np.abs(mass(after) - mass(before))
  assert np.all(error <= bound), np.max(error - bound)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
  """16 steps of top-k on 8 workers, checkpointed at 8 and 16."""
  workdir = tmp_path_factory.mktemp("eight")
  return workdir, train.train_and_evaluate(config(workers=8), workdir)


def test_eight_to_four_to_eight_conserves_the_residual_mass(eight, tmp_path):
  source, saved = eight
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  # Resumed at its last step: the moved state, untrained.
  four = train.train_and_evaluate(config(workers=4), workdir).state
  before, after = residual(saved.state), residual(four)
  assert before.shape[0] == 8 and after.shape[0] == 4
  assert np.any(before != before[:1])  # The workers' residuals differ.
  np.testing.assert_array_equal(after, np.broadcast_to(after[0], after.shape))
  assert_mass_conserved(before, after)
  for a, b in zip(
    jax.tree.leaves(four["params"]), jax.tree.leaves(saved.state["params"]), strict=True
  ):
    np.testing.assert_array_equal(a, b)  # Replicated: kept.

  trained = train.train_and_evaluate(config(workers=4, num_train_steps=32), workdir)
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  moved = [r["elastic"] for r in rows if "elastic" in r]
  assert moved[-1] == {
    "from_workers": 8,
    "to_workers": 4,
    "rules": {"replicated": 15, "residual_mean": 1},
  }
  losses = [r["loss"] for r in rows if "loss" in r]
  assert all(np.isfinite(losses)) and losses[-1] < losses[1], losses  # 32 < 16
  assert trained.eval_metrics["eval_accuracy"] > 0.3  # Chance: 0.1.

  eight_again = train.train_and_evaluate(config(workers=8, num_train_steps=32), workdir)
  assert_mass_conserved(residual(trained.state), residual(eight_again.state))
  resumed = train.train_and_evaluate(config(workers=8, num_train_steps=40), workdir)
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  assert rows[-3]["elastic"]["from_workers"] == 4  # Then training rows.
  assert np.isfinite(rows[-1]["eval_loss"]) and np.isfinite(rows[-2]["loss"])
  assert resumed.eval_metrics["eval_accuracy"] > 0.3


def test_none_sgd_eight_to_eight_is_an_exact_resume(tmp_path):
  overrides = {"compressor.name": "none", "compressor.ratio": None}
  reference = train.train_and_evaluate(config(**overrides), tmp_path / "whole")
  # Preempted after the whole run's checkpoint at step 8.
  assert harness.preempted_copy(tmp_path / "whole", tmp_path / "half") == 8
  resumed = train.train_and_evaluate(config(**overrides), tmp_path / "half")
  harness.assert_resumed_after(tmp_path / "half", 8)
  for a, b in zip(
    jax.tree.leaves(resumed.state), jax.tree.leaves(reference.state), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  rows = logs.read_metrics(tmp_path / "half" / "metrics.jsonl")
  assert not any("elastic" in r for r in rows)


# -- A state no rule covers ---------------------------------------------------


class Mystery(NamedTuple):
  memory: np.ndarray


def core(opt_state, workers: int, params_rows: bool = False):
  params = {"w": np.zeros((workers, 3) if params_rows else (3,), np.float32)}
  return {
    "params": params,
    "model_state": {},
    "opt_state": opt_state,
    "step": np.int32(5),
    "rng": np.zeros(2, np.uint32),
  }


def test_a_per_worker_state_of_unknown_kind_is_a_value_error():
  saved = core(Mystery(np.ones((8, 3), np.float32)), 8)
  like = core(Mystery(np.ones((4, 3), np.float32)), 4)
  with pytest.raises(
    ValueError, match=r"8 to 4 workers: no rule for state\['opt_state'\]\.memory"
  ):
    elastic.resize(saved, like, Mystery(True), False, 8, 4)


def test_a_scheme_entry_without_a_rule_is_a_value_error():
  scheme = Scheme.__new__(Scheme)
  scheme.mesh = SimpleNamespace(size=4)
  with pytest.raises(ValueError, match=r"no rule for state\['mystery'\]"):
    scheme.elastic({"mystery": {"clock": np.zeros(8)}}, 8)
  assert scheme.elastic({}, 8) == {}


# EdgeGossip without speeds (8 speeds describe no 4-worker cluster); epochs of
# 3 steps on 8 workers and on 4, so the checkpoint at step 8 is mid-epoch.
EDGE = {
  "compressor.name": "none",
  "fusion.plan": "none",
  "scheme.name": "edgegossip",
  "scheme.p": 0.5,
  "global_batch_size": 512,
}


def test_edgegossip_re_plans_the_interrupted_epoch_on_the_new_workers(tmp_path):
  saved = train.train_and_evaluate(config(workers=8, **EDGE), tmp_path)
  entry = jax.device_get(saved.state["edgegossip"])
  assert int(entry["epoch"]) == 5 and entry["rows"].shape == (3, 512)  # Steps 16-18.
  resumed = train.train_and_evaluate(
    config(workers=4, num_train_steps=24, **EDGE), tmp_path
  )
  rows = logs.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["elastic"]["to_workers"] for r in rows if "elastic" in r] == [4]
  epochs = [r for r in rows if "epoch" in r]
  # Epoch 6 (steps 16-18) is re-planned at step 17, for its last 2 steps.
  assert [e["epoch"] for e in epochs][-3:] == [6, 7, 8]
  assert all(len(e["samples"]) == 4 for e in epochs[-3:])
  partial, whole = sum(epochs[-3]["samples"]), sum(epochs[-2]["samples"])
  assert 0 < partial < whole
  sim = [r["sim_seconds"] for r in rows if "sim_seconds" in r and r["step"] > 16]
  assert np.all(np.diff(sim) >= 0) and sim[0] >= entry["clock"].max()
  assert np.isfinite(rows[-1]["eval_loss"])
  after = jax.device_get(resumed.state["edgegossip"])
  assert after["rows"].shape == (3, 512) and int(after["epoch"]) == 7


# -- Each rule, on NumPy arrays -------------------------------------------------


def test_average_gives_every_new_worker_the_mean():
  rows = np.array([[1.0, 2.0], [3.0, 6.0], [5.0, 1.0]], np.float32)
  np.testing.assert_array_equal(elastic.average(rows, 2), [[3.0, 3.0], [3.0, 3.0]])
  exponents = np.array([[-3], [-4], [-4]], np.int8)  # Integers: the nearest.
  np.testing.assert_array_equal(elastic.average(exponents, 2), [[-4], [-4]])


@pytest.mark.parametrize(("n", "m"), [(8, 4), (4, 8), (3, 5), (8, 1)])
def test_residual_repartition_conserves_the_mass_not_yet_sent(n, m):
  e = np.random.default_rng(n * m).normal(size=(n, 100)).astype(np.float32)
  moved = elastic.repartition_mean(e, m)
  assert moved.shape == (m, 100) and moved.dtype == np.float32
  assert_mass_conserved(e, moved)
  summed = elastic.repartition_sum(e, m)  # The asynchronous server's sum.
  total = np.sum(e, axis=0, dtype=np.float64)
  bound = (U32 + 2 * n * U64) * np.sum(np.abs(e), axis=0, dtype=np.float64) * m
  assert np.all(np.abs(np.sum(summed, axis=0, dtype=np.float64) - total) <= bound)


def test_owner_residual_moves_each_value_to_its_new_owner():
  n, m, d = 4, 3, 10
  owner = np.arange(d) // chunk_size(d, n)  # 0 0 0 1 1 1 2 2 2 3
  errors = np.zeros((n, d), np.float32)
  errors[owner, np.arange(d)] = np.arange(1.0, d + 1)
  moved = elastic.owner_residual(errors, m)
  new_owner = np.arange(d) // chunk_size(d, m)  # 0 0 0 0 1 1 1 1 2 2
  np.testing.assert_array_equal(moved[new_owner, np.arange(d)], np.arange(1.0, d + 1))
  assert moved.sum() == errors.sum()  # Nothing else is set.


def test_params_restart_from_the_anchor():
  anchor = np.array([[1.0, 2.0]], np.float32)
  np.testing.assert_array_equal(
    elastic.from_anchor(anchor, 3), np.repeat(anchor[None], 3, 0)
  )


def test_gossip_weights_are_renormalised_and_the_weighted_average_kept():
  x = np.array([[0.0, 4.0], [2.0, 0.0], [8.0, 8.0], [1.0, 1.0]])
  w = np.array([0.5, 1.5, 1.0, 1.0], np.float32)  # Units of 1/4: sum 4.
  moved_x, moved_w = elastic.gossip_average(x, w, 3), elastic.gossip_weights(w, 3)
  assert moved_w.shape == (3,) and moved_w.sum() / 3 == w.sum() / 4  # Total kept.
  want = (w[:, None] * x).sum(0) / w.sum()
  got = (moved_w[:, None] * moved_x).sum(0) / moved_w.sum()
  np.testing.assert_allclose(got, want, rtol=1e-15)


def test_prng_streams_are_rederived_per_new_worker():
  start = np.asarray(jax.random.split(jax.random.PRNGKey(3), 4))  # A fresh run's.
  keys = elastic.rederive_keys(start, 40)
  assert keys.shape == (4, 2) and keys.dtype == np.uint32
  assert len({tuple(k) for k in keys}) == 4  # Each worker its own stream.
  for j, k in enumerate(keys):  # The typed-key API as the reference.
    key = jax.random.wrap_key_data(start[j])
    want = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, 40), j))
    np.testing.assert_array_equal(k, want)
  np.testing.assert_array_equal(elastic.rederive_keys(start, 40), keys)  # Reproducible.
  assert np.any(elastic.rederive_keys(start, 41) != keys)  # Not replayed.


# -- Kinds read from gradcomp's states -----------------------------------------


def test_kinds_are_read_from_the_state_structure():
  ef = CompressorState(
    np.zeros((8,), np.int32),
    np.zeros((8, 2), np.uint32),
    [ErrorFeedbackState(np.ones((8, 3)), ())],
  )
  server = AsyncPSState(*[None] * len(AsyncPSState._fields))._replace(
    compressor_state=ef, pulled=np.zeros(8, np.int32), version=np.int32(7)
  )
  kinds = {
    jax.tree_util.keystr(path): elastic.kind_of(
      server, path, x.ndim > 1 or x.size == 8
    )[0]
    for path, x in jax.tree_util.tree_flatten_with_path(server)[0]
  }
  assert kinds == {
    ".version": None,  # Replicated: kept.
    ".pulled": "async_pulled",
    ".compressor_state.count": "local",
    ".compressor_state.key": "prng",
    ".compressor_state.leaves[0].residual": "residual_sum",  # Each push alone.
  }


def test_gosgd_state_moves_by_its_weights():
  weights = np.array([0.5, 1.5, 1.0, 1.0], np.float32)
  params = np.array([[0.0], [2.0], [8.0], [1.0]], np.float32)

  def gosgd(w, count):
    return GoSGDState(
      np.int32(3), {"m": np.ones((count, 1))}, w, np.zeros(2, np.uint32)
    )

  saved = core(gosgd(weights, 4), 4, params_rows=True)
  saved["params"]["w"] = params
  like = core(gosgd(np.ones(2, np.float32), 2), 2, params_rows=True)
  like["params"]["w"] = np.zeros((2, 1), np.float32)
  per_worker = GoSGDState(False, {"m": True}, True, False)
  state, counts = elastic.resize(saved, like, per_worker, True, 4, 2)
  np.testing.assert_array_equal(state["params"]["w"], [[3.0], [3.0]])  # (3 + 8 + 1) / 4
  np.testing.assert_array_equal(state["opt_state"].weight, [1.0, 1.0])
  assert counts == {
    "gossip_weight": 1,
    "local": 1,
    "params_gossip_average": 1,
    "replicated": 4,
  }


def test_streaming_eager_params_restart_from_the_averaged_anchor():
  def streaming(rows):
    return StreamingState(
      np.int32(3),
      (),
      {
        "w": np.arange(3 * rows, dtype=np.float32).reshape(rows, 3)
      },  # Eager: per worker.
      (),
      (),
      {"w": np.full((rows, 3), rows, np.float32)},
    )

  saved, like = core(streaming(4), 4, True), core(streaming(2), 2, True)
  per_worker = StreamingState(False, (), {"w": True}, (), (), {"w": True})
  state, counts = elastic.resize(saved, like, per_worker, True, 4, 2)
  np.testing.assert_array_equal(state["params"]["w"], [[4.5, 5.5, 6.5]] * 2)
  np.testing.assert_array_equal(state["opt_state"].anchor["w"], [[4.5, 5.5, 6.5]] * 2)
  np.testing.assert_array_equal(state["opt_state"].in_flight["w"], np.full((2, 3), 4.0))
  assert counts["params_from_anchor"] == 1 and counts["residual_mean"] == 1
