"""The step suite (``python -m bench step``) on a tiny setting.

Not a test of speed: the suite runs end to end and writes its outputs, its
arithmetic holds (samples/s = batch / step time; the calibration step is
predicted exactly), and the step it times is the data-parallel SGD step,
checked against a reference written here without ``train.step``.

The suite runs on ResNet-8 (``depth=8``: ResNet-20's blocks, one per stage
instead of three), whose step programs compile in a fraction of ResNet-20's
time; the default model, ResNet-20, is checked against the shape tables.
"""

import json

import jax
import numpy as np
import optax
import pytest

import gradcomp
from bench import step

# One pytest-xdist worker runs the module, so its module fixture is built once.
pytestmark = pytest.mark.xdist_group("bench_step")


BATCH = 16
DEPTH = 8
#: ResNet-8's param leaves: conv1, bn1 (scale, bias), three basic blocks of
#: two convs and two batch norms each, fc (kernel, bias).
DEPTH_LEAVES = 1 + 2 + 3 * (2 + 2 * 2) + 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """The suite's result, and every step program it compiled, in compile order.

  ``step.compile_step`` is wrapped to keep each compiled step with its
  arguments: the initial carry (to the host, before the timed calls donate
  it) and the sharded batch, so the program the suite timed is checked
  against the reference below instead of a second, separately compiled one.
  """
  out = tmp_path_factory.mktemp("step")
  compiled_steps = []
  compile_step = step.compile_step

  def kept(train_step, carry, batch):
    compiled, info = compile_step(train_step, carry, batch)
    compiled_steps.append(
      {
        "compiled": compiled,
        "info": info,
        "carry": jax.device_get(carry),
        "shardings": jax.tree.map(lambda a: a.sharding, carry),
        "batch": batch,
      }
    )
    return compiled, info

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(step, "compile_step", kept)
    result = step.run(
      compressors=("none", "topk"),
      plans=("single",),
      batch=BATCH,
      repeats=1,
      out_dir=str(out),
      profile_sizes=(16, 4096),
      cluster=gradcomp.sim.Cluster(8, bandwidth_gbps=10.0, latency_us=10.0),
      depth=DEPTH,
    )
  return out, result, compiled_steps


def test_suite_writes_json_table_and_chart(tiny):
  out, result, _ = tiny
  saved = json.loads((out / "step.json").read_text())
  assert saved == json.loads(json.dumps(result))
  assert [(r["compressor"], r["plan"]) for r in saved["rows"]] == [
    ("none", "single"),
    ("topk", "single"),
  ]
  assert saved["model"] == "resnet8" and saved["num_leaves"] == DEPTH_LEAVES
  assert saved["devices"] == 8
  table = (out / "step.md").read_text()
  assert table.startswith("ResNet-8, synthetic CIFAR-10, global batch 16 ")
  assert "| topk | single | 1 |" in table and "| samples/s | single |" in table
  assert (out / "step.png").read_bytes()[:4] == b"\x89PNG"


def test_times_and_throughput(tiny):
  _, result, _ = tiny
  calibration = result["calibration"]
  for r in result["rows"]:
    assert r["groups"] == 1
    assert r["compile_s"] > 0 and r["measured_ms"] > 0 and r["predicted_ms"] > 0
    assert r["samples_per_s"] == pytest.approx(BATCH / (r["measured_ms"] / 1e3))
  none, topk = result["rows"]
  # The dense single step calibrates the compute time, so it is predicted
  # exactly, unless the model's launch, compression and exchange alone
  # exceed it (on a loaded machine the profile can read high): compute is
  # then 0 and the prediction is that overhead, above the measurement.
  assert none["calibration"] and not topk["calibration"]
  if calibration["compute_ms"] > 0:
    assert none["predicted_ms"] == pytest.approx(none["measured_ms"], rel=1e-9)
  else:
    assert none["predicted_ms"] > none["measured_ms"]
  # Top-k (1%) sends far fewer bytes than the dense all-reduce.
  assert topk["wire_bytes"] < none["wire_bytes"] / 10


def test_leaf_flops_match_the_shape_tables():
  from gradcomp.models import shapes

  setup = step.build(BATCH)
  # The trained model is the one the tables are derived from: same leaves.
  assert len(setup.flops) == 59 and sum(setup.sizes) == shapes.RESNET20_NUM_PARAMS
  named = sorted(
    zip(shapes.resnet20_shapes(), shapes.forward_flops("resnet20"), strict=True)
  )
  assert list(setup.flops) == [flops for _, flops in named]  # tree = sorted names


def test_depth_is_validated():
  for depth in (7, 9, 2, 20.0):
    with pytest.raises(ValueError, match="depth must be 6n \\+ 2"):
      step.validate(("none",), ("single",), BATCH, 8, depth)


def test_timed_step_is_data_parallel_sgd(tiny):
  """The timed step of ``none``: per-worker gradients averaged, SGD momentum."""
  _, result, compiled_steps = tiny
  # The suite compiled one program per row (none, then topk; none / single,
  # the calibration, first): these are the programs whose times it reports.
  assert len(compiled_steps) == len(result["rows"]) == 2
  for kept, row in zip(compiled_steps, result["rows"], strict=True):
    assert kept["info"]["compile_s"] == row["compile_s"] > 0
    assert kept["info"]["wire_bytes"] == row["wire_bytes"]
  kept = compiled_steps[0]
  compiled, batch = kept["compiled"], kept["batch"]
  initial = lambda: jax.device_put(kept["carry"], kept["shardings"])
  setup = step.build(BATCH, depth=DEPTH)  # cached: the suite's own setup
  # The kept carry is the suite's initial state: the reference starts there.
  start_params, start_stats, _ = kept["carry"]
  jax.tree.map(np.testing.assert_array_equal, start_params, setup.params)
  jax.tree.map(np.testing.assert_array_equal, start_stats, setup.model_state)
  config = step.config_for("none", {}, "single", BATCH)
  calls = []

  def counted(*args):
    calls.append(1)
    return compiled(*args)

  seconds, _, metrics = step.step_seconds(counted, initial(), batch, repeats=1)
  assert seconds > 0 and len(calls) >= 2 and not metrics["skipped"]

  # One step from the initial state (the timed carry was donated), against a
  # reference that runs each worker's shard through the model in training mode
  # (its own batch statistics), averages the gradients and applies optax.sgd;
  # nothing from train.step. One step, not the timed several: a randomly
  # initialised ResNet with batch norm over 2 examples per worker amplifies
  # float32 rounding step after step (3 steps: up to 2 % of the move on an
  # AVX-512 machine and on an AVX2 one), while a single step is well
  # conditioned (measured 5e-6 of the move). Those measurements were of
  # ResNet-20; ResNet-8 is the same network with fewer blocks per stage.
  got_params, got_stats, got_opt, _ = compiled(*initial(), batch)
  model, (x, y) = setup.model, setup.batch
  lr, momentum = config.optimizer.learning_rate, config.optimizer.momentum
  tx = optax.sgd(lr, momentum=momentum)

  @jax.jit
  def shard_grad(params, stats, x, y):
    def loss(p):
      logits, new = model.apply(
        {"params": p, **stats}, x, train=True, mutable=["batch_stats"]
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

    return jax.grad(loss, has_aux=True)(params)

  params, stats = setup.params, setup.model_state
  shards = [
    shard_grad(params, stats, xs, ys)
    for xs, ys in zip(np.split(x, 8), np.split(y, 8), strict=True)
  ]
  mean = lambda *t: sum(t) / len(t)
  grads = jax.tree.map(mean, *[g for g, _ in shards])
  stats = jax.tree.map(mean, *[s for _, s in shards])
  updates, state = tx.update(grads, tx.init(params))
  params = optax.apply_updates(params, updates)

  # Tolerance: 1e-3 of each leaf's move. The step's longest float32 sums (a
  # 3x3 conv's weight gradient: 2 examples x 32 x 32 pixels per worker, then 8
  # workers) carry a worst-case relative error of n * u = 2048 * 6e-8 = 1.2e-4
  # before the sums are reordered by vector width; 1e-3 leaves a factor of 8
  # over that bound, while every wrong semantics (global batch statistics, one
  # worker's gradient, a missing 1/8) moves the params by tens of percent.
  for got, want, start in zip(
    jax.tree.leaves(got_params),
    jax.tree.leaves(params),
    jax.tree.leaves(setup.params),
    strict=True,
  ):
    moved = np.max(np.abs(np.asarray(want) - np.asarray(start)))
    assert moved > 0
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) <= 1e-3 * moved
  # The momentum trace is kept (after one step it is the mean gradient).
  got_trace = optax.tree_utils.tree_get(got_opt, "trace")
  want_trace = optax.tree_utils.tree_get(state, "trace")
  for got, want in zip(
    jax.tree.leaves(got_trace), jax.tree.leaves(want_trace), strict=True
  ):
    got = np.asarray(got).reshape((-1, *np.shape(want)))  # replicated per worker
    scale = np.max(np.abs(np.asarray(want)))
    assert np.max(np.abs(got - np.asarray(want))) <= 1e-3 * scale
  # Running statistics: means of 8 workers' batch statistics, one float32
  # average each, so a few units in the last place.
  for got, want in zip(jax.tree.leaves(got_stats), jax.tree.leaves(stats), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
