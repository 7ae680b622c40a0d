"""The training program end to end, on tiny configs (DESIGN §3, STYLE 15).

Checked against independent references: with ``none`` the 8-worker step is
plain full-batch SGD with momentum written here in a few lines; a run killed
with SIGKILL and resumed ends bit for bit where an uninterrupted run ends.
"""

import dataclasses
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import gradcomp
from configs import default
from gradcomp.models import zoo as models
from train import data, launch, logs, schemes, train, workload
from train import step as step_lib

import harness

# One worker runs the module: its tests share the module's program runs (``tiny_run``,
# ``*_run``), built once.
pytestmark = pytest.mark.xdist_group("train")

ROOT = Path(__file__).resolve().parents[1]

# A tiny run: short enough for a test, long enough (~1 s of steps) that a
# SIGKILL after the first checkpoint lands mid-run.
TINY = {
  "model.features": (16,),
  "compressor.ratio": 0.1,
  # Not the default "auto": a plan from a profile measured in each process
  # could differ between the runs the resume test compares.
  "fusion.plan": "single",
  "global_batch_size": 64,
  "num_train_steps": 240,
  "log_every_steps": 40,
  "eval_every_steps": 120,
  "checkpoint_every_steps": 40,
}


def tiny_config(**overrides):
  config = default.get_config()
  config.update_from_flattened_dict({**TINY, **overrides})
  return config


def command_line(workdir, **overrides):
  flags = [f"--config.{k}={v}" for k, v in {**TINY, **overrides}.items()]
  return [
    sys.executable,
    "-m",
    "train",
    f"--config={ROOT / 'configs' / 'default.py'}",
    f"--workdir={workdir}",
    *flags,
  ]


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """The tiny default (sketch_topk, single plan) trained once for the module."""
  workdir = tmp_path_factory.mktemp("tiny")
  return workdir, train.train_and_evaluate(tiny_config(), workdir)


def test_tiny_run_learns(tiny_run):
  _, result = tiny_run
  assert result.eval_metrics["eval_accuracy"] > 0.8, result.eval_metrics


def test_metrics_and_run_files(tiny_run):
  workdir, result = tiny_run
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train_rows] == list(range(40, 241, 40))
  assert [r["step"] for r in eval_rows] == [120, 240]
  for r in train_rows:
    assert {"loss", "samples_per_sec", "wire_bytes_per_step", "l2_grads"} <= set(r)
    assert r["nonfinite_steps"] == 0
  assert eval_rows[-1]["eval_accuracy"] == pytest.approx(
    result.eval_metrics["eval_accuracy"]
  )
  # Sketch (4.75 k floats) + k exact values, k = 10% of the coordinates:
  # below the dense fp32 all-reduce of every parameter.
  params = result.state["params"]
  dense = 4 * sum(x.size for x in jax.tree.leaves(params))
  assert 0 < train_rows[0]["wire_bytes_per_step"] < 0.7 * dense
  config = json.loads((workdir / "config.json").read_text())
  assert config["compressor"]["name"] == "sketch_topk"
  assert config["model"]["features"] == [16]
  plan = gradcomp.Plan.from_json((workdir / "plan.json").read_text())
  assert plan.num_leaves == len(jax.tree.leaves(params))
  assert len(plan.groups) == 1
  # Gradient-ready order: the output layer's leaves first.
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(params)]
  assert all("out" in names[i] for i in plan.order[:2]), (names, plan.order)


# DiLoCo with top-k pseudo-gradients, a round every 7 steps: 240 = 34 * 7 + 2,
# so the run ends two local steps after its last round.
SCHEME = {
  "scheme.name": "local_sgd",
  "scheme.every": 7,
  "scheme.outer_learning_rate": 0.7,
  "compressor.name": "topk",
}


@pytest.fixture(scope="module")
def scheme_run(tmp_path_factory):
  """The tiny config under local SGD (DiLoCo, top-k), trained once for the module."""
  workdir = tmp_path_factory.mktemp("scheme")
  return workdir, train.train_and_evaluate(tiny_config(**SCHEME), workdir)


def test_scheme_params_are_per_worker(scheme_run):
  workdir, result = scheme_run
  workers = jax.device_count()
  params = leaves(result.state["params"])
  assert all(p.shape[0] == workers for p in params)
  # Two local steps after the round: the workers differ, by little.
  assert not np.array_equal(params[0][0], params[0][1])
  local_sgd = result.state["opt_state"].inner_state
  # The anchor is agreed, so the layout keeps it replicated: no worker axis.
  anchors = leaves(local_sgd.anchor)
  assert [a.shape for a in anchors] == [p.shape[1:] for p in params]
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  train_rows = [r for r in rows if "loss" in r]
  distance = [r["consensus_distance"] for r in train_rows]
  assert all(d >= 0 for d in distance) and max(distance) > 0
  # 40 = 5 * 7 + 5 local steps since the round: the distance of step 40 is
  # not a round's, which is zero up to the rounding of params + (anchor - params).
  assert distance[0] > 1e-9
  seconds = [r["sim_seconds"] for r in train_rows]
  assert seconds == sorted(seconds) and seconds[0] > 0
  evals = [r for r in rows if "eval_accuracy" in r]
  last = evals[-1]
  assert last["eval_worker_accuracy_min"] <= last["eval_worker_accuracy_mean"] <= 1
  assert last["eval_accuracy"] > 0.5  # It learned (10 classes).


# CD-SGD (paper 001): 2-bit codes, a full-precision message every 3rd step,
# 20 synchronous warm-up steps.
CDSGD = {
  "scheme.name": "cdsgd",
  "scheme.local_learning_rate": 0.1,
  "scheme.warmup_steps": 20,
  "scheme.k": 3,
  "compressor.name": "threshold_quantize",
  "compressor.threshold": 0.01,
}


@pytest.fixture(scope="module")
def cdsgd_run(tmp_path_factory):
  """The tiny config under CD-SGD, trained once for the module."""
  workdir = tmp_path_factory.mktemp("cdsgd")
  return workdir, train.train_and_evaluate(tiny_config(**CDSGD), workdir)


def test_cdsgd_run_reports_both_weights_and_its_wire(cdsgd_run):
  workdir, result = cdsgd_run
  params = leaves(result.state["params"])
  cd = result.state["opt_state"].inner_state
  # The global weights are agreed (no worker axis); the local ones are not.
  assert [w.shape for w in leaves(cd.global_params)] == [p.shape[1:] for p in params]
  assert not np.array_equal(params[0][0], params[0][1])
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  last = [r for r in rows if "eval_accuracy" in r][-1]
  assert last["eval_global_accuracy"] > 0.5 and last["eval_accuracy"] > 0.5
  # Wire, from the compiled HLO: the full message is the dense fp32
  # all-reduce; the compressed one all-gathers 2-bit codes (a quarter byte
  # per value, padded to whole 32-bit words per leaf).
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  values = sum(p[0].size for p in params)
  assert sim["full_wire"] == {"all-reduce": 4 * values}
  assert values / 4 <= sim["compressed_wire"]["all-gather"] <= values / 4 + 16
  # Steps 1..19 and one message in 3 after them are full precision.
  steps = TINY["num_train_steps"]
  full = 19 + len(range(20, steps, 3))
  expected = (
    full * 4 * values + (steps - full) * sim["compressed_wire"]["all-gather"]
  ) / steps
  per_step = [r["wire_bytes_per_step"] for r in rows if "loss" in r][-1]
  assert expected <= per_step <= expected + 64  # + logged means and the finite check
  seconds = [r["sim_seconds"] for r in rows if "loss" in r]
  assert seconds == sorted(seconds) and seconds[0] > 0


# CHOCO-SGD on a ring with top-k 10 % (DESIGN §5): per-worker params, public
# copies and neighbourhood sums; the payload on collective-permute.
GOSSIP = {
  "scheme.name": "gossip",
  "scheme.topology": "ring",
  "scheme.gamma": 0.2,
  "compressor.name": "topk",
}


@pytest.fixture(scope="module")
def gossip_run(tmp_path_factory):
  """The tiny config under CHOCO-SGD, trained once for the module."""
  workdir = tmp_path_factory.mktemp("gossip")
  return workdir, train.train_and_evaluate(tiny_config(**GOSSIP), workdir)


def test_gossip_run_sends_the_codec_to_neighbours_only(gossip_run):
  workdir, result = gossip_run
  params = leaves(result.state["params"])
  assert all(p.shape[0] == jax.device_count() for p in params)
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  # Top-k 10 % of each leaf, (float32 value, int32 index) pairs, per message.
  k = sum(max(1, int(0.1 * p[0].size)) for p in params)
  assert sim["message_bytes"] == 8 * k
  assert sim["topology"]["name"] == "ring" and sim["overlap"] is False
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  train_rows = [r for r in rows if "loss" in r]
  # Two messages a step (a ring), plus the logged means and the finite check.
  per_step = train_rows[-1]["wire_bytes_per_step"]
  assert 2 * 8 * k <= per_step <= 2 * 8 * k + 64
  seconds = [r["sim_seconds"] for r in train_rows]
  assert seconds == sorted(seconds) and seconds[0] > 0
  assert all(r["consensus_distance"] > 0 for r in train_rows)
  last = [r for r in rows if "eval_accuracy" in r][-1]
  assert last["eval_accuracy"] > 0.5 and last["eval_worker_accuracy_min"] > 0.5


# The asynchronous server (survey 004 §2.3) with DC-ASGD and top-k 10 %
# pushes on the speeds: the server replicated, params and
# error-feedback memories per worker.
ASYNC = {
  "scheme.name": "async_ps",
  "scheme.delay_compensation": 0.04,
  "compressor.name": "topk",
  "cluster.speeds": (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0),
  "optimizer.learning_rate": 0.0125,
}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
  """The tiny config on the asynchronous server, trained once for the module."""
  workdir = tmp_path_factory.mktemp("async")
  return workdir, train.train_and_evaluate(tiny_config(**ASYNC), workdir)


def test_async_run_logs_staleness_and_prices_the_fastest_cycle(async_run):
  workdir, result = async_run
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  steps = TINY["num_train_steps"]
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  param_bytes = sum(p[0].nbytes for p in leaves(result.state["params"]))
  # Cycles: compute at 8 TFLOP/s x speed, then a push and a pull of the dense
  # params at 20 Gbps, 25 us each (pricing.speed_table).
  transfer = 2 * (25e-6 + 8 * param_bytes / 20e9)
  speeds = np.asarray(ASYNC["cluster.speeds"])
  cycles = sim["flops_per_step"] / (8e12 * speeds) + transfer
  # Worker w pushes once per cycles[w] / min(cycles) steps (up to one push
  # each at the run's end, where float32 rounding may fall either way).
  (last,) = [r["staleness_histogram"] for r in rows if "staleness_histogram" in r][-1:]
  expected = np.floor(steps * cycles.min() / cycles).sum()
  assert abs(sum(last) - expected) <= len(speeds), (sum(last), expected)
  train_rows = [r for r in rows if "loss" in r]
  assert train_rows[-1]["staleness_mean"] == pytest.approx(
    np.arange(len(last)) @ np.asarray(last) / sum(last)
  )
  # The step is the fastest worker's cycle.
  assert train_rows[-1]["sim_seconds"] == pytest.approx(steps * cycles.min(), rel=1e-12)
  assert [r for r in rows if "eval_accuracy" in r][-1]["eval_accuracy"] > 0.5


# EdgeGossip (paper 002): GoSGD on per-worker shards, balanced and loss-ranked
# epochs of 3 steps (180 samples per worker, the paper's 64 per step: batches
# of whole single-class subsets of ~10 need room for several, BUILD_NOTES);
# checkpoints every 40 steps land mid-epoch.
EDGE = {
  "global_batch_size": 512,
  "scheme.name": "edgegossip",
  "scheme.p": 0.5,
  "compressor.name": "none",
  "fusion.plan": "none",
  "cluster.speeds": (1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25),
  "cluster.flops_per_second": 1e9,
}


@pytest.fixture(scope="module")
def edgegossip_run(tmp_path_factory):
  """The tiny config as EdgeGossip, trained once for the module."""
  workdir = tmp_path_factory.mktemp("edgegossip")
  return workdir, train.train_and_evaluate(tiny_config(**EDGE), workdir)


def test_edgegossip_run_balances_epochs_and_charges_processed_samples(edgegossip_run):
  """Alg. 1's shares against the closed form ``r_i = min_j T_j / T_i``; Alg.
  2's whole subsets overshoot a budget by less than one subset; each epoch's
  simulated time is the slowest worker's loss evaluation, samples and pushes
  at its own speed (train/edgegossip.py), recomputed here from the logs."""
  workdir, result = edgegossip_run
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  sizes = np.asarray(sim["shard_sizes"], float)
  points = np.asarray(sim["aggregated_points"], float)
  assert sizes.sum() == 1437 and np.ptp(sizes) <= 1
  speeds = np.asarray(EDGE["cluster.speeds"])
  batch = EDGE["global_batch_size"] // 8
  assert sim["steps_per_epoch"] == -(-sizes.max() // batch)
  times = sizes / speeds
  ratios = times.min() / times
  forward = sim["flops_per_step"] / (3 * batch)
  epochs = [r for r in rows if "epoch" in r]
  per_epoch = sim["steps_per_epoch"]
  assert [r["epoch"] for r in epochs] == list(range(1, 240 // per_epoch + 1))
  clock = 0.0
  for row in epochs:
    np.testing.assert_allclose(row["ratios"], ratios, rtol=1e-5)
    samples = np.asarray(row["samples"], float)
    budget = ratios * sizes
    # Whole subsets of ~10 (ratio 10): the last one crosses the budget.
    assert np.all(samples >= budget - 1e-9) and np.all(samples < budget + 40)
    steps = np.ceil(samples / batch)  # packed rows: full but the last
    seconds = (points * forward + samples * 3 * forward) / (1e9 * speeds)
    seconds = seconds + steps * sim["push_seconds"]
    clock = float(np.float32(clock + seconds.max()))
    np.testing.assert_allclose(row["sim_epoch_seconds"], seconds.max(), rtol=1e-5)
    np.testing.assert_allclose(row["sim_seconds"], clock, rtol=1e-6)
    assert row["compute_imbalance"] < 1.5  # unbalanced: 4
  assert [r for r in rows if "eval_accuracy" in r][-1]["eval_accuracy"] > 0.5


@pytest.mark.parametrize(
  "scheme", [SCHEME, CDSGD, GOSSIP], ids=["local_sgd", "cdsgd", "gossip"]
)
def test_scheme_pmap_matches_shard_map(tmp_path, scheme):
  overrides = {**scheme, "num_train_steps": 25, "eval_every_steps": 25}
  by_shard_map = train.train_and_evaluate(tiny_config(**overrides), tmp_path / "s")
  by_pmap = train.train_and_evaluate(
    tiny_config(**overrides, step="pmap"), tmp_path / "p"
  )
  # The same program per worker; only the order of the all-reduced sums may
  # differ (see test_multihost's bound).
  harness.assert_states_close(by_pmap.state, by_shard_map.state, rel=1e-5)


def test_residuals_are_per_worker_and_momentum_replicated(tiny_run):
  _, result = tiny_run
  opt_state = result.state["opt_state"]
  fusion, (trace, _) = opt_state.inner_state
  (residual,) = [np.asarray(leaf.residual) for leaf in fusion.inner.leaves]
  workers = jax.device_count()
  assert residual.shape[0] == workers
  assert not np.allclose(residual[0], residual[1])
  params = result.state["params"]
  assert jax.tree.map(jnp.shape, trace.trace) == jax.tree.map(jnp.shape, params)


@pytest.mark.parametrize(
  "scheme",
  [{}, {"scheme.name": "local_sgd", "scheme.every": 1}],
  ids=["none", "local_sgd_every_1"],
)
def test_none_equals_single_device_full_batch_sgd(tmp_path, scheme):
  """Synchronous SGD, and local SGD averaging every step (DESIGN §5's reduction)."""
  steps, lr = 30, 0.1
  config = tiny_config(num_train_steps=steps, eval_every_steps=steps, **scheme)
  config.compressor.name = "none"
  config.compressor.ratio = None
  result = train.train_and_evaluate(config, tmp_path)

  # Reference: one device, whole batch, optax.sgd; nothing from train.step.
  ds = data.load("digits")
  model = models.create("mlp", 10, features=(16,))
  init_rng, _ = jax.random.split(jax.random.PRNGKey(config.seed))
  params = model.init(init_rng, jnp.zeros((1, 8, 8, 1)))["params"]
  tx = optax.sgd(lr, momentum=0.9)
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    def loss(p):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    updates, state = tx.update(jax.grad(loss)(params), state)
    return optax.apply_updates(params, updates), state

  it = data.batches(ds.x_train, ds.y_train, config.global_batch_size, config.seed)
  for _ in range(steps):
    params, state = step(params, state, *next(it))
  got_params = result.state["params"]
  if scheme:  # Per-worker params, every worker the same.
    harness.assert_same_on_workers(jax.tree.map(np.asarray, got_params))
    got_params = jax.tree.map(lambda p: np.asarray(p)[0], got_params)
  for got, want in zip(leaves(got_params), leaves(params), strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _final_state(workdir, like):
  from train import checkpoint

  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", 3)
  try:
    step = ckpt.latest_step()
    return step, ckpt.restore(step, like)
  finally:
    ckpt.close()


# A process killed mid-run: the synchronous default and EdgeGossip (whose
# epoch plan and clocks are checkpointed mid-epoch). CD-SGD's and the
# asynchronous server's state resumes in-process below (suite time).
@pytest.mark.parametrize("run", ["tiny_run", "edgegossip_run"])
def test_sigkill_then_resume_is_bit_exact(run, request, tmp_path):
  reference_dir, reference = request.getfixturevalue(run)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", launch.ENV_CPU_DEVICES: "8"}
  overrides = {
    "tiny_run": {},
    "scheme_run": SCHEME,
    "cdsgd_run": CDSGD,
    "gossip_run": GOSSIP,
    "async_run": ASYNC,
    "edgegossip_run": EDGE,
  }[run]
  cmd = command_line(tmp_path, **overrides)
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
  )
  checkpoints = tmp_path / "checkpoints"
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and proc.poll() is None:
    if checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
      break
    time.sleep(0.005)
  assert proc.poll() is None, "the run ended before it could be killed"
  proc.send_signal(signal.SIGKILL)
  _, stderr = proc.communicate()
  killed_at = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  assert killed_at < TINY["num_train_steps"], stderr.decode()[-2000:]

  resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from its checkpoint" in resumed.stderr

  like = reference.state
  step_a, want = _final_state(reference_dir, like)
  step_b, got = _final_state(tmp_path, like)
  assert step_a == step_b == TINY["num_train_steps"]
  for a, b in zip(leaves(got), leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  # The resumed run rewrote the rows past its checkpoint: one per step.
  rows = [r for r in logs.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in rows] == list(range(40, 241, 40))
  # The simulated clock continues where it was: replayed, not restarted.
  want_rows = [
    r for r in logs.read_metrics(reference_dir / "metrics.jsonl") if "loss" in r
  ]
  assert [r["sim_seconds"] for r in rows] == [r["sim_seconds"] for r in want_rows]


@pytest.mark.parametrize(
  ("run", "overrides"), [("cdsgd_run", CDSGD), ("async_run", ASYNC)]
)
def test_preempted_then_resumed_is_bit_exact(run, overrides, request, tmp_path):
  """Per-worker params, residuals and replicated state (CD-SGD's global
  weights and messages; the server's per-worker memories and staleness
  clock) resume where the whole run is: a run of the same config continues
  from the whole run's checkpoint at step 200, as after a preemption."""
  reference_dir, reference = request.getfixturevalue(run)
  step = harness.preempted_copy(reference_dir, tmp_path)
  assert step == TINY["num_train_steps"] - TINY["checkpoint_every_steps"]
  resumed = train.train_and_evaluate(tiny_config(**overrides), tmp_path)
  harness.assert_resumed_after(tmp_path, step)
  for a, b in zip(leaves(resumed.state), leaves(reference.state), strict=True):
    np.testing.assert_array_equal(a, b)
  # The simulated clock continues where it was: replayed, not restarted.
  rows = [r for r in logs.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  want = [r for r in logs.read_metrics(reference_dir / "metrics.jsonl") if "loss" in r]
  want = [r for r in want if r["step"] > step]
  assert [r["sim_seconds"] for r in rows] == [r["sim_seconds"] for r in want]


def poisoned_digits(rows):
  """Digits whose training images ``rows`` are NaN."""
  ds = data.load("digits")
  x = ds.x_train.copy()
  x[rows] = np.nan
  return dataclasses.replace(ds, x_train=x)


def test_nonfinite_steps_are_skipped(tmp_path, monkeypatch):
  # One NaN image: the one step per epoch whose batch holds it is skipped on
  # every worker, and training goes on.
  monkeypatch.setattr(workload, "load_dataset", lambda config: poisoned_digits([0]))
  config = tiny_config(num_train_steps=50, log_every_steps=50, eval_every_steps=50)
  result = train.train_and_evaluate(config, tmp_path)
  (row,) = [r for r in logs.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  rows = np.arange(len(data.load("digits").y_train))
  batches = data.batches(rows, rows, 64, config.seed)
  expected = sum(0 in next(batches)[0] for _ in range(50))
  assert expected > 0 and row["nonfinite_steps"] == expected
  assert row["loss"] is not None and np.isfinite(row["loss"])
  for leaf in leaves(result.state):
    if np.issubdtype(leaf.dtype, np.floating):
      assert np.isfinite(leaf).all()


def test_run_stops_after_consecutive_nonfinite_steps(tmp_path, monkeypatch):
  monkeypatch.setattr(
    workload, "load_dataset", lambda config: poisoned_digits(slice(None))
  )
  config = tiny_config(checkpoint_every_steps=1, max_consecutive_nonfinite=3)
  with pytest.raises(train.NonFiniteError, match="non-finite in 3 consecutive steps"):
    train.train_and_evaluate(config, tmp_path)
  rows = logs.read_metrics(tmp_path / "metrics.jsonl")
  last = {k: v for k, v in rows[-1].items() if k != "wall_time"}
  assert last == {"step": 3, "nonfinite_steps": 3, "stopped": True}
  # Skipped steps leave the state as it was: every checkpoint is finite.
  saved = sorted(p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved
  restored = ocp.StandardCheckpointer().restore(saved[-1] / "default")
  for leaf in leaves(restored):
    if np.issubdtype(leaf.dtype, np.floating):
      assert np.isfinite(leaf).all()


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    ({"compressor.name": "gzip"}, "unknown compressor 'gzip'.*sketch_topk"),
    ({"model.name": "transformer"}, "unknown model 'transformer'.*mlp"),
    ({"global_batch_size": 60}, "60 is not divisible by the 8 devices"),
    ({"fusion.plan": "greedy"}, "unknown fusion plan 'greedy'"),
    ({"workers": 9}, r"config.workers must be in \[1, 8\]"),
    ({**EDGE, "scheme.selection": "best"}, "config.scheme.selection must be one of"),
    ({**EDGE, "scheme.method": "pca"}, "config.scheme.method must be one of"),
    ({**EDGE, "step": "pmap"}, "edgegossip runs under config.step=shard_map"),
  ],
)
def test_bad_config_is_a_clear_error(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(tiny_config(**overrides), tmp_path)


def test_edgegossip_halts_when_too_many_workers_failed(tmp_path):
  """Alg. 1 lines 10-12: two of eight below the paper's 0.001 samples/s (about
  3e-5 samples/s here) have failed, a share of 0.25 > 0.1: the run halts."""
  speeds = (1e-9, 1e-9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
  config = tiny_config(**{**EDGE, "cluster.speeds": speeds, "num_train_steps": 3})
  with pytest.raises(gradcomp.edgegossip.BalancerHalted, match=r"2 of 8 .*\[0, 1\]"):
    train.train_and_evaluate(config, tmp_path)


def test_device_count_is_kept_once_jax_runs():
  launch.configure_cpu_devices(jax.device_count())
  launch.configure_cpu_devices(3)  # Already initialised: a warning, no error.
  assert jax.device_count() == 8


def test_a_multi_process_run_is_warned_of_the_persistent_cache():
  """conftest.py turns the cache on for the suite: the hazard is named, with
  its directory; with the cache off or without a directory, nothing."""
  directory = jax.config.jax_compilation_cache_dir
  assert directory and directory in launch.persistent_cache_hazard()
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    assert launch.persistent_cache_hazard() is None
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)


def test_layout_names_the_per_worker_leaves():
  mesh = jax.make_mesh((jax.device_count(),), (step_lib.AXIS,))
  model = models.create("mlp", 10, features=(4,))
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
  config = tiny_config()
  tx, _ = schemes.build(config, range(4), 10)
  batch = (
    jax.ShapeDtypeStruct((64, 8, 8, 1), jnp.float32),
    jax.ShapeDtypeStruct((64,), jnp.int32),
  )
  layout = step_lib.infer_layout(model, tx, mesh, params, {}, tx.init(params), batch)
  per_worker = [
    jax.tree_util.keystr(path)
    for path, w in jax.tree.leaves_with_path(layout.per_worker)
    if w
  ]
  assert len(per_worker) == 1 and "residual" in per_worker[0], per_worker


@pytest.mark.parametrize(
  ("name", "model", "epochs", "batch", "lr"),
  [
    ("resnet20_cifar10", "resnet20", 140, 128, 0.1),
    ("vgg16_cifar10", "vgg16", 140, 128, 0.1),
    ("resnet50_imagenet", "resnet50", 140, 128, 0.01),
    ("lstm_ptb", "lstm", 65, 32, 0.01),
  ],
)
def test_paper_configs_carry_table_3(tmp_path, name, model, epochs, batch, lr):
  config = importlib.import_module(f"configs.{name}").get_config()
  assert (config.model.name, config.num_epochs) == (model, epochs)
  assert (config.global_batch_size, config.optimizer.learning_rate) == (batch, lr)
  assert config.num_train_steps is None
  config.dataset.data_dir = str(tmp_path)  # Empty: a clear error, not a crash.
  with pytest.raises(data.DatasetNotFoundError, match="not found: expected"):
    train.train_and_evaluate(config, tmp_path / "workdir")


def test_auto_plan_is_chosen_saved_and_reused_on_resume(tmp_path):
  config = tiny_config(**{"fusion.plan": "auto", "num_train_steps": 2})
  first = train.train_and_evaluate(config, tmp_path)
  plan = gradcomp.Plan.from_json((tmp_path / "plan.json").read_text())
  assert plan.num_leaves == len(jax.tree.leaves(first.state["params"]))
  # A resumed run keeps the saved plan (its checkpoint is shaped by it), even
  # one a fresh profile would not choose.
  forced = gradcomp.Plan.layerwise(plan.order)
  (tmp_path / "plan.json").write_text(forced.to_json())
  for path in (tmp_path / "checkpoints").iterdir():
    shutil.rmtree(path)
  config.num_train_steps = 4
  train.train_and_evaluate(config, tmp_path)
  assert gradcomp.Plan.from_json((tmp_path / "plan.json").read_text()) == forced


@pytest.mark.parametrize("each_worker", [True, False])
def test_each_worker_s_own_eval_is_optional(each_worker, monkeypatch):
  """Per-worker params are scored as the workers' average, and each worker's
  own model only when ``each_worker`` (``config.eval_each_worker`` unset or
  true). The parts of a run are stand-ins: this checks the branch, the run
  tests check the metrics themselves."""
  from train import evaluation

  calls = []
  monkeypatch.setattr(
    evaluation,
    "evaluate_workers",
    lambda *a: calls.append("workers") or {"eval_worker_accuracy_mean": 0.5},
  )
  ev = object.__new__(evaluation.Evaluator)
  ev.each_worker = each_worker
  ev.layout = type("L", (), {"params_per_worker": True, "mesh": None})()
  ev.workload = type(
    "W",
    (),
    {"dataset": type("D", (), {"x_test": 0, "y_test": 0})(), "eval_metrics": dict},
  )()
  ev.scheme = type("S", (), {"evaluate": lambda self, *a: {}})()
  ev.averager, ev.worker_eval = (lambda tree: tree), None
  ev._score = lambda params, state, variant=None: {"eval_loss": 1.0}
  metrics = ev(None, None, lambda: ("params", "state", "opt"))
  assert ("eval_worker_accuracy_mean" in metrics) == each_worker
  assert calls == (["workers"] if each_worker else [])
