"""Sufficient-factor broadcasting in the training program (train/factors.py).

The tiny config of ``test_train`` with a wider hidden layer and 3 examples per
worker, so that on 8 workers Poseidon's rule sends ``hidden_0``'s factors
(``P K (M + N) = 8 x 3 x 320 = 7,680 < 2 M N = 32,768``) and keeps ``out``
dense (``8 x 3 x 266 = 6,384 >= 2 x 256 x 10 = 5,120``): both paths of the
step run. Error bounds as in ``test_sufficient_factors``: a float32 sum of
``K`` products in any order is within ``gamma_K |U|^T |V|`` of the exact sum
(Higham §3.1).
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train import leaves, poisoned_digits, tiny_config

from gradcomp.models import sufficient_factors as sf
from gradcomp.models import zoo as models
from train import data, logs, train, workload
from train import factors as factors_lib
from train import step as step_lib

import harness

# One pytest-xdist worker runs the module, so its module fixtures are built once.
pytestmark = pytest.mark.xdist_group("train_factors")

U = 2.0**-24
WORKERS = 8
ROWS = 3  # examples per worker
STEPS = 30
LR = 0.1
WIDE = {
  "model.features": (256,),
  "global_batch_size": WORKERS * ROWS,
  "compressor.name": "none",
  "compressor.ratio": None,
  "log_every_steps": 10,
  "eval_every_steps": STEPS,
  "checkpoint_every_steps": STEPS,
}


def gamma(k: int) -> float:
  return k * U / (1 - k * U)


def config(**overrides):
  return tiny_config(**{**WIDE, "num_train_steps": STEPS, **overrides})


def run(tmp_path_factory, name, **overrides):
  workdir = tmp_path_factory.mktemp(name)
  return workdir, train.train_and_evaluate(config(**overrides), workdir)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
  return run(tmp_path_factory, "dense")


@pytest.fixture(scope="module")
def factored_run(tmp_path_factory):
  return run(tmp_path_factory, "factored", sufficient_factors=True)


def test_the_rule_picks_the_hidden_layer(factored_run):
  workdir, _ = factored_run
  sim = json.loads((workdir / train.SIM_FILE).read_text())
  hidden, out = sim["sufficient_factors"]
  assert (hidden["path"], hidden["kernel"], hidden["rows"]) == (
    "hidden_0",
    [64, 256],
    3,
  )
  assert (hidden["choice"], out["choice"]) == ("factors", "dense")
  # Per-worker link bytes, (P-1) K (M+N) and 2 (P-1)/P M N values of 4 bytes.
  assert hidden["factor_bytes"] == 4 * 7 * 3 * 320
  assert hidden["dense_bytes"] == 4 * 2 * 7 / 8 * 64 * 256
  assert out["factor_bytes"] == 4 * 7 * 3 * 266 > out["dense_bytes"]
  assert hidden["alternative_bytes"] is None  # compressor "none": dense only
  # LayerFusion's "single" plan covers the three compressed leaves only.
  plan = json.loads((workdir / train.PLAN_FILE).read_text())
  assert sorted(plan["groups"][0]) == [0, 1, 2]


def test_the_step_all_gathers_factors_instead_of_the_kernels_all_reduce(
  dense_run, factored_run
):
  """``round_wire`` of a synchronous run is the compiled step's
  ``collective_bytes`` (train.py's ``step_wire``): hidden_0's 64 x 256
  kernel leaves the all-reduce, its 3 x (64 + 256) factors join an
  all-gather; everything else (out, biases, metrics, the finite check) is as
  in the dense run."""
  wire = {}
  for name, (workdir, _) in (("dense", dense_run), ("factored", factored_run)):
    wire[name] = json.loads((workdir / train.SIM_FILE).read_text())["round_wire"]
  assert "all-gather" not in wire["dense"]
  assert wire["factored"]["all-gather"] == 4 * ROWS * (64 + 256)
  assert wire["factored"]["all-reduce"] == wire["dense"]["all-reduce"] - 4 * 64 * 256
  assert set(wire["factored"]) == {"all-reduce", "all-gather"}
  rows = logs.read_metrics(factored_run[0] / "metrics.jsonl")
  per_step = [r["wire_bytes_per_step"] for r in rows if "loss" in r]
  assert per_step and set(per_step) == {sum(wire["factored"].values())}


def _worker_factors(params, x, y):
  """Every layer's factors, per worker, as the 8-worker step sees them."""
  model = models.create("mlp", 10, features=(256,))

  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  f = jax.jit(sf.value_grad_and_factors(loss))
  per_worker = [
    f(params, x[w * ROWS : (w + 1) * ROWS], y[w * ROWS : (w + 1) * ROWS])[2]
    for w in range(WORKERS)
  ]
  return {
    p[0]: tuple(
      np.concatenate([np.asarray(fw[p][i], np.float64) for fw in per_worker])
      for i in (0, 1)
    )
    for p in per_worker[0]
  }


def test_one_step_equals_the_dense_step_up_to_summation_order(tmp_path):
  """After one step (momentum 0: params - lr g) every leaf of the factored
  run is the dense run's up to the order of float32 sums. hidden_0's kernel:
  one sum of 8 x 3 gathered rows against 8 sums of 3 then a sum of 8, each
  term scaled by 1/8 (exact), so ``|dg| <= 2 (gamma_24 + gamma_3 + gamma_8)
  |U|^T |V| / 8``; the other leaves take the same path in both runs, except
  the local sums of 3 rows, which XLA may order differently: ``2 gamma_3``.
  ``-lr g`` and ``p + u`` are two roundings: ``u lr |g|`` and ``u |p|``."""
  one = {"num_train_steps": 1, "eval_every_steps": 1, "checkpoint_every_steps": 1}
  got = train.train_and_evaluate(config(**one, sufficient_factors=True), tmp_path / "f")
  want = train.train_and_evaluate(config(**one), tmp_path / "d")
  # The first batch and initial params, as the program makes them.
  ds = data.load("digits")
  x, y = next(data.batches(ds.x_train, ds.y_train, WORKERS * ROWS, 0))
  model = models.create("mlp", 10, features=(256,))
  init_rng, _ = jax.random.split(jax.random.PRNGKey(0))
  params = model.init(init_rng, jnp.zeros((1, 8, 8, 1)))["params"]
  factors = _worker_factors(params, jnp.asarray(x), jnp.asarray(y))
  for layer, (u, v) in factors.items():
    mean = u.T @ v / WORKERS  # exact mean gradient (float64 of float32 factors)
    g = 2 * gamma(ROWS)
    if layer == "hidden_0":
      g = 2 * (gamma(WORKERS * ROWS) + gamma(ROWS) + gamma(WORKERS))
    bounds = {
      "kernel": (mean, g * np.abs(u).T @ np.abs(v) / WORKERS),
      "bias": (v.sum(0), 2 * gamma(ROWS) * np.abs(v).sum(0) / WORKERS),
    }
    for leaf, (grad, gbound) in bounds.items():
      a = np.asarray(got.state["params"][layer][leaf], np.float64)
      b = np.asarray(want.state["params"][layer][leaf], np.float64)
      bound = LR * (gbound + 2 * U * (np.abs(grad) + gbound)) + U * (
        np.abs(a) + np.abs(b)
      )
      err = np.abs(a - b)
      assert np.all(err <= 1.01 * bound), (layer, leaf, err.max(), bound.max())
      # Tight enough to catch a wrong mean (one worker's share is 1/8 of it).
      assert bound.max() < 1e-4 * LR * np.abs(grad).max(), (layer, leaf)


def test_factored_run_equals_the_dense_run(dense_run, factored_run):
  """30 steps: each step's gradient differs from the dense one by the
  summation order of hidden_0's kernel only (the one-step test's bound,
  ~70 units of roundoff of the summed magnitudes). ``test_train`` allows
  rtol 2e-5, atol 2e-6 after 30 steps for the same kind of difference on
  every leaf (8 workers' all-reduce against one device's batch sum)."""
  got, want = factored_run[1].state, dense_run[1].state
  for a, b in zip(leaves(got["params"]), leaves(want["params"]), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
  # The momentum too: hidden_0's kernel is exchanged outside the compressor,
  # and its trace is replicated (no worker axis) like the others.
  compressor, (trace, _) = got["opt_state"].inner_state
  _, (want_trace, _) = want["opt_state"].inner_state
  for a, b in zip(leaves(trace), leaves(want_trace), strict=True):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
  # The compressor (none, in LayerFusion's single buffer) behind optax.masked.
  assert isinstance(compressor, optax.MaskedState)


@pytest.mark.parametrize("plan", ["none"])  # auto: test_restrict_reindexes_...
def test_a_compressor_runs_on_the_other_leaves_under_any_fusion_plan(tmp_path, plan):
  """Top-k 10 %: hidden_0's factors (3,840 bytes) beside top-k's (value,
  index) pairs of the three other leaves; LayerFusion plans those three only
  (``auto``: from their sizes, profiled), or is left out (``none``: top-k
  sees the masked tree itself, 25 + 256 + 1 pairs)."""
  overrides = {"compressor.name": "topk", "compressor.ratio": 0.1, "fusion.plan": plan}
  short = {"num_train_steps": 2, "eval_every_steps": 2, "checkpoint_every_steps": 2}
  train.train_and_evaluate(
    config(sufficient_factors=True, **short, **overrides), tmp_path
  )
  sim = json.loads((tmp_path / train.SIM_FILE).read_text())
  assert [x["choice"] for x in sim["sufficient_factors"]] == ["factors", "alternative"]
  gathered = sim["round_wire"]["all-gather"]
  if plan == "none":
    assert gathered == 4 * ROWS * (64 + 256) + 8 * (25 + 256 + 1)
  else:
    saved = json.loads((tmp_path / train.PLAN_FILE).read_text())
    assert saved["num_leaves"] == 3
    assert gathered > 4 * ROWS * (64 + 256)
  assert sim["round_wire"]["all-reduce"] == 16  # logged means, finite check


def test_pmap_matches_shard_map(factored_run, tmp_path):
  by_pmap = train.train_and_evaluate(
    config(sufficient_factors=True, step="pmap"), tmp_path
  )
  harness.assert_states_close(by_pmap.state, factored_run[1].state, rel=1e-5)


def test_resume_is_bit_exact(factored_run, tmp_path):
  """The masked optimizer state checkpoints and restores: 20 steps, then a
  resumed run to 30, ends where the uninterrupted run ends."""
  train.train_and_evaluate(
    config(sufficient_factors=True, num_train_steps=20), tmp_path
  )
  resumed = train.train_and_evaluate(config(sufficient_factors=True), tmp_path)
  for a, b in zip(leaves(resumed.state), leaves(factored_run[1].state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_nonfinite_steps_are_skipped_on_every_worker(tmp_path, monkeypatch):
  """NaN images: hidden_0's factors (its inputs U) carry the NaN, its mean is
  NaN on every worker, and the agreed guard skips the step."""
  steps = 20
  rows = np.arange(len(data.load("digits").y_train))
  order = data.batches(rows, rows, WORKERS * ROWS, 0)
  batches = [next(order) for _ in range(steps)]
  # One image of step 3 (worker 0) and one of step 10 (worker 5).
  poisoned = [int(batches[2][0][0]), int(batches[9][0][5 * ROWS])]
  monkeypatch.setattr(
    workload, "load_dataset", lambda config: poisoned_digits(poisoned)
  )
  result = train.train_and_evaluate(
    config(sufficient_factors=True, num_train_steps=steps, log_every_steps=steps),
    tmp_path,
  )
  (row,) = [r for r in logs.read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
  expected = sum(bool(set(b[0]) & set(poisoned)) for b in batches)
  assert expected == 2 and row["nonfinite_steps"] == expected
  for leaf in leaves(result.state):
    if np.issubdtype(leaf.dtype, np.floating):
      assert np.isfinite(leaf).all()


def _plan(cfg):
  mesh = jax.make_mesh((WORKERS,), (step_lib.AXIS,))
  model = models.create("mlp", 10, features=cfg.model.features)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
  batch = (
    jax.ShapeDtypeStruct((cfg.global_batch_size, 8, 8, 1), jnp.float32),
    jax.ShapeDtypeStruct((cfg.global_batch_size,), jnp.int32),
  )
  return factors_lib.plan(cfg, model, mesh, params["params"], {}, batch)


def test_the_rule_compares_with_the_configured_compressor():
  """With a compressor, the alternative is its link bytes on the kernel alone:
  top-k at 0.1 % sends 16 (value, index) pairs of hidden_0's 16,384 values,
  all-gathered: 7 x 16 x 8 = 896 bytes per worker, below its factors'."""
  cfg = config(
    sufficient_factors=True,
    **{"compressor.name": "topk", "compressor.ratio": 0.001},
  )
  hidden, out = _plan(cfg).layers
  assert hidden.alternative_bytes == 7 * 16 * 8
  assert hidden.choice == "alternative" and out.choice == "alternative"
  assert not _plan(cfg).active


def test_the_tiny_default_sends_no_factors_on_8_workers():
  """``test_train``'s tiny config (16 hidden units, 8 rows per worker): the
  rule keeps every layer dense, and the run is the plain step."""
  plan = _plan(tiny_config(sufficient_factors=True, **{"compressor.name": "none"}))
  assert [x.choice for x in plan.layers] == ["dense", "dense"] and not plan.active
  assert "no Dense layer sends factors" in plan.summary()


def test_restrict_reindexes_the_gradient_order():
  layer = factors_lib.Layer(("a",), (2, 2), 1, 0.0, 0.0, None, "factors")
  plan = factors_lib.Factored((layer,), WORKERS)
  params = {"a": {"bias": 0, "kernel": 0}, "b": {"bias": 0, "kernel": 0}}
  assert plan.compressed(params) == [True, False, True, True]
  # Leaves in tree order: a/bias 0, a/kernel 1, b/bias 2, b/kernel 3.
  order, sizes = plan.restrict(params, [3, 2, 1, 0], [5, 6, 7, 8])
  assert (order, sizes) == ([2, 1, 0], [5, 7, 8])


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    (
      {"scheme.name": "local_sgd", "scheme.every": 2},
      "sufficient_factors=True needs synchronous training.*'local_sgd'",
    ),
    (
      {"scheme.name": "gossip", "scheme.topology": "ring"},
      "sufficient_factors=True needs synchronous training.*'gossip'",
    ),
  ],
)
def test_bad_config_is_a_clear_error(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config(sufficient_factors=True, **overrides), tmp_path)


def test_a_model_without_dense_layers_is_a_clear_error():
  class NoDense(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      del train
      return x.reshape(x.shape[0], -1)[:, :10] * self.param(
        "s", nn.initializers.ones, ()
      )

  cfg = config(sufficient_factors=True)
  mesh = jax.make_mesh((WORKERS,), (step_lib.AXIS,))
  model = NoDense()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
  batch = (
    jax.ShapeDtypeStruct((24, 8, 8, 1), jnp.float32),
    jax.ShapeDtypeStruct((24,), jnp.int32),
  )
  with pytest.raises(ValueError, match="calls no flax nn.Dense"):
    factors_lib.plan(cfg, model, mesh, params, {}, batch)
