"""Sufficient factors (survey 004 §2.5): exact gradients, their exchange, the rule.

Error bound used throughout: the kernel gradient ``sum_j u_j^T v_j`` over
``K`` rows, summed in float32 in any order (blocked, pairwise, with or
without FMA), is within ``gamma_K |U|^T |V|`` of the exact sum of the same
float32 factors, ``gamma_K = K u / (1 - K u)``, ``u = 2^-24`` (Higham,
*Accuracy and Stability of Numerical Algorithms*, §3.1); two such sums differ
by at most twice that.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import exchange
from gradcomp.models import sufficient_factors as sf
from gradcomp.models import zoo
from gradcomp.parallel import wire

import harness

AXIS, N = harness.AXIS, harness.WORKERS
U = 2.0**-24


def gamma(k: int) -> float:
  return k * U / (1 - k * U)


def kernel_bound(u, v, rows: int) -> np.ndarray:
  """``2 gamma_K |U|^T |V|``: two float32 sums of the same K products."""
  u, v = np.abs(np.asarray(u, np.float64)), np.abs(np.asarray(v, np.float64))
  return 2 * gamma(rows) * (u.T @ v)


def exact(u, v) -> np.ndarray:
  return np.asarray(u, np.float64).T @ np.asarray(v, np.float64)


def assert_within(got, want, bound, what):
  err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  assert np.all(err <= bound), f"{what}: error {err.max():.3g}, bound {bound.max():.3g}"


def get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


# -- the factors of the models' Dense layers --------------------------------


class _Shared(nn.Module):
  """One Dense applied twice (shared weights), then a classifier."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape(x.shape[0], -1)
    shared = nn.Dense(x.shape[-1], name="shared")
    x = shared(nn.tanh(shared(x)))
    return nn.Dense(3, name="out")(x)


def _classifier_case(name):
  rng = np.random.default_rng(0)
  if name == "lstm":  # decoder on (batch, time, hidden): rows = batch * time
    model = zoo.LSTM(num_classes=11, hidden=8, layers=1)
    x = jnp.asarray(rng.integers(0, 11, (4, 5)))
    y = jnp.asarray(rng.integers(0, 11, (4, 5)))
  else:
    model = {
      "mlp": zoo.MLP(num_classes=10, features=(32, 16)),
      "cnn": zoo.CNN(num_classes=10, features=(4, 8)),
      "shared": _Shared(),
    }[name]
    x = jnp.asarray(rng.standard_normal((20, 8, 8, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3 if name == "shared" else 10, 20))
  params = model.init(jax.random.key(1), x)["params"]

  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return params, loss, x, y


EXPECTED_LAYERS = {
  "mlp": {("hidden_0",): 20, ("hidden_1",): 20, ("out",): 20},
  "cnn": {("out",): 20},
  "lstm": {("decoder",): 20},
  "shared": {("shared",): 40, ("out",): 20},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_LAYERS))
def test_rebuilt_kernel_gradient_equals_the_dense_one(name):
  """``U^T V`` is the kernel gradient and ``1^T V`` the bias gradient.

  Against the dense gradient of the same program (same float32 U and V): the
  bound of the module docstring, 2 gamma_K |U|^T |V|. Against ``jax.grad``'s
  own program, whose backward pass XLA may fuse and round differently
  (the softmax's cotangent, then every layer below it), a further 64 u of
  the same magnitude. Measured on CPU: equal bit for bit in both.
  """
  params, loss, x, y = _classifier_case(name)
  reference = jax.jit(jax.grad(loss))(params, x, y)
  value, grads, factors = jax.jit(sf.value_grad_and_factors(loss))(params, x, y)
  np.testing.assert_allclose(value, jax.jit(loss)(params, x, y), rtol=1e-6)
  assert {p: f.u.shape[0] for p, f in factors.items()} == EXPECTED_LAYERS[name]
  for path, f in factors.items():
    kernel = get(params, path)["kernel"]
    rows = f.u.shape[0]
    assert f.u.shape == (rows, kernel.shape[0]) and f.v.shape == (rows, kernel.shape[1])
    rebuilt = sf.rebuild(f.u, f.v)
    bound = kernel_bound(f.u, f.v, rows)
    assert_within(rebuilt, get(grads, path)["kernel"], bound, f"{path} in-program")
    assert_within(
      rebuilt,
      get(reference, path)["kernel"],
      bound + 64 * U * exact(np.abs(f.u), np.abs(f.v)),
      f"{path} vs jax.grad",
    )
    ones = np.ones((rows, 1))
    bias_bound = 2 * gamma(rows) * exact(ones, np.abs(f.v))[0]
    assert_within(f.v.sum(0), get(grads, path)["bias"], bias_bound, f"{path} bias")
  # The perturbations change no gradient (an added zero).
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_has_aux_and_mutable_batch_statistics_pass_through():
  model = zoo.ResNet20(num_classes=10, blocks_per_stage=1)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8, 8, 3)), jnp.float32)
  variables = model.init(jax.random.key(0), x)

  def loss(p, x):
    out, state = model.apply(
      {"params": p, "batch_stats": variables["batch_stats"]},
      x,
      train=True,
      mutable=["batch_stats"],
    )
    return jnp.mean(out**2), state

  (value, state), grads, factors = jax.jit(
    sf.value_grad_and_factors(loss, has_aux=True)
  )(variables["params"], x)
  (want_value, want_state), want = jax.jit(jax.value_and_grad(loss, has_aux=True))(
    variables["params"], x
  )
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), state, want_state
  )
  (f,) = factors.values()
  assert list(factors) == [("fc",)] and f.u.shape == (4, 64) and f.v.shape == (4, 10)
  bound = kernel_bound(f.u, f.v, 4)
  assert_within(sf.rebuild(f.u, f.v), grads["fc"]["kernel"], bound, "fc")


def test_vgg16_classifier_head_factors_by_shape():
  """The VGG-16 head of the zoo: factors (K, 512) and (K, 10), traced only."""
  model = zoo.VGG16(num_classes=10)
  x = jax.ShapeDtypeStruct((128, 32, 32, 3), jnp.float32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  loss = lambda p, s, x: jnp.sum(model.apply({"params": p, "batch_stats": s}, x))
  _, _, factors = jax.eval_shape(
    sf.value_grad_and_factors(loss), variables["params"], variables["batch_stats"], x
  )
  (f,) = factors.values()
  assert list(factors) == [("classifier",)]
  assert (f.u.shape, f.v.shape) == ((128, 512), (128, 10))
  # 128 x (512 + 10) factor values against 5,120 kernel values: dense wins.
  assert sf.choose((512, 10), 128, N) == "dense"


# -- the exchange on 8 workers ----------------------------------------------


def _sharded(tree):
  return jax.device_put(tree, NamedSharding(harness.mesh(), P(AXIS)))


def test_mean_over_workers_of_rebuilt_factors_is_the_all_reduced_mean():
  """Each worker's factors are its own batch's (no sum over workers sneaks in
  through the perturbations' types), and the gathered rebuild is the mean."""
  params, loss, _, _ = _classifier_case("mlp")
  rng = np.random.default_rng(3)
  xs = jnp.asarray(rng.standard_normal((N, 20, 8, 8, 1)), jnp.float32)
  ys = jnp.asarray(rng.integers(0, 10, (N, 20)))

  def step(params, x, y):
    local = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
    _, grads, factors = sf.value_grad_and_factors(loss)(local, x[0], y[0])
    means = {p: sf.sufficient_factor_mean(f.u, f.v, AXIS) for p, f in factors.items()}
    dense = jax.lax.pmean(grads, AXIS)
    return means, dense, jax.tree.map(lambda a: a[None], factors)

  f = jax.jit(
    jax.shard_map(
      step,
      mesh=harness.mesh(),
      in_specs=(P(), P(AXIS), P(AXIS)),
      out_specs=(P(), P(), P(AXIS)),
    )
  )
  means, dense, factors = jax.device_get(f(params, _sharded(xs), _sharded(ys)))
  single = jax.jit(sf.value_grad_and_factors(loss))
  for w in (0, 5):
    _, _, own = single(params, xs[w], ys[w])
    for p, fw in own.items():
      np.testing.assert_array_equal(factors[p].u[w], fw.u)
      np.testing.assert_allclose(factors[p].v[w], fw.v, rtol=1e-6, atol=1e-9)
  for p, mean in means.items():
    u = np.asarray(factors[p].u, np.float64).reshape(-1, factors[p].u.shape[-1])
    v = np.asarray(factors[p].v, np.float64).reshape(-1, factors[p].v.shape[-1])
    rows = u.shape[0]
    # One float32 sum of N K products, each scaled by 1/8 (exact).
    assert_within(mean, u.T @ v / N, gamma(rows) * (np.abs(u).T @ np.abs(v)) / N, p)
    # The all-reduced dense mean: N sums of K, then a sum of N (the factor 2
    # covers the second-order terms).
    bound = 2 * (gamma(rows) + gamma(20) + gamma(N)) * (np.abs(u).T @ np.abs(v)) / N
    assert_within(mean, get(dense, p)["kernel"], bound, f"{p} vs all-reduce")


def test_wire_carries_the_factors_and_the_rule_counts_what_the_hlo_sends():
  k, m, n = 16, 40, 30

  def factor_step(u, v):
    return sf.sufficient_factor_mean(u[0], v[0], AXIS)

  def dense_step(u, v):
    return jax.lax.pmean(sf.rebuild(u[0], v[0]), AXIS)

  u = _sharded(jnp.ones((N, k, m)))
  v = _sharded(jnp.ones((N, k, n)))
  totals = {}
  for name, step in (("factors", factor_step), ("dense", dense_step)):
    f = jax.jit(
      jax.shard_map(
        step, mesh=harness.mesh(), in_specs=(P(AXIS), P(AXIS)), out_specs=P()
      )
    )
    totals[name] = wire.collective_bytes(f.lower(u, v).compile().as_text())
    np.testing.assert_allclose(f(u, v), np.full((m, n), k), rtol=1e-6)
  assert totals["factors"]["all-gather"] == 4 * k * (m + n)
  assert sum(totals["factors"].values()) == 4 * k * (m + n)
  assert totals["dense"]["all-reduce"] == 4 * m * n
  assert sf.ring_link_bytes(totals["factors"], N) == sf.factor_bytes((m, n), k, N)
  assert sf.ring_link_bytes(totals["dense"], N) == sf.dense_bytes((m, n), N)


def test_gossip_pattern_mixes_the_rebuilt_matrices():
  """With ``exchange.Neighbours`` the factors go to the ring neighbours."""
  rng = np.random.default_rng(4)
  u = rng.standard_normal((N, 6, 5)).astype(np.float32)
  v = rng.standard_normal((N, 6, 4)).astype(np.float32)

  def step(u, v):
    pattern = exchange.Neighbours(gradcomp.topology.ring(N), jnp.int32(0), AXIS)
    return sf.sufficient_factor_mean(u[0], v[0], pattern)[None]

  f = jax.jit(
    jax.shard_map(
      step, mesh=harness.mesh(), in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)
    )
  )
  text = f.lower(_sharded(jnp.asarray(u)), _sharded(jnp.asarray(v))).compile().as_text()
  assert wire.collective_bytes(text)["collective-permute"] == 2 * 4 * 6 * (5 + 4)
  got = np.asarray(f(_sharded(jnp.asarray(u)), _sharded(jnp.asarray(v))), np.float64)
  rebuilt = np.einsum("wkm,wkn->wmn", u.astype(np.float64), v.astype(np.float64))
  for i in range(N):
    want = sum(rebuilt[j % N] for j in (i - 1, i, i + 1)) / 3
    np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-5)


def test_a_step_exchanges_factors_for_the_layers_the_rule_picks():
  """The pattern a training step follows: ``choose`` per layer, the factors'
  mean for those layers' kernels (``replace_kernels``), a compressor on the
  other leaves (``optax.masked``). The chosen kernel's dense all-reduce is
  gone from the compiled program; the result is the all-reduced mean."""
  model = zoo.MLP(num_classes=10, features=(64,))
  rng = np.random.default_rng(5)
  xs = jnp.asarray(rng.standard_normal((N, 4, 8, 8)), jnp.float32)
  ys = jnp.asarray(rng.integers(0, 10, (N, 4)))
  params = model.init(jax.random.key(0), xs[0])["params"]

  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  # hidden_0 (64, 64): P K (M+N) = 8 x 4 x 128 < 2 M N = 8192; out (64, 10): not.
  plan = {(k,): sf.choose(v["kernel"].shape, 4, N) for k, v in params.items()}
  assert plan == {("hidden_0",): "factors", ("out",): "dense"}
  factored = {p for p, c in plan.items() if c == "factors"}
  mask = {
    k: {"kernel": (k,) not in factored, "bias": True} for k in params
  }  # True: through the compressor
  tx = optax.masked(gradcomp.none(axis_name=AXIS), mask)

  def step(params, x, y):
    local = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)
    _, grads, factors = sf.value_grad_and_factors(loss)(local, x[0], y[0])
    updates, _ = tx.update(grads, tx.init(params))
    means = {p: sf.sufficient_factor_mean(*factors[p], AXIS) for p in factored}
    dense = jax.lax.pmean(grads, AXIS)
    hidden = jax.tree.map(lambda a: a[None], factors[("hidden_0",)])
    return sf.replace_kernels(updates, means), dense, hidden

  f = jax.jit(
    jax.shard_map(
      step,
      mesh=harness.mesh(),
      in_specs=(P(), P(AXIS), P(AXIS)),
      out_specs=(P(), P(), P(AXIS)),
    )
  )
  args = (params, _sharded(xs), _sharded(ys))
  # What the step alone sends (the reference's pmean of all grads left out).
  only_step = jax.jit(
    jax.shard_map(
      lambda *a: step(*a)[0],
      mesh=harness.mesh(),
      in_specs=(P(), P(AXIS), P(AXIS)),
      out_specs=P(),
    )
  )
  totals = wire.collective_bytes(only_step.lower(*args).compile().as_text())
  assert totals["all-gather"] == 4 * 4 * (64 + 64)  # hidden_0's factors
  assert totals["all-reduce"] == 4 * (64 + 64 * 10 + 10)  # the rest, not 64 x 64
  got, dense, hidden = jax.device_get(f(*args))
  # Leaves through the compressor: the reference's all-reduce (psum(g / 8) is
  # psum(g) / 8 bit for bit, 8 a power of two).
  for leaf in (("hidden_0", "bias"), ("out", "bias"), ("out", "kernel")):
    np.testing.assert_array_equal(get(got, leaf), get(dense, leaf))
  # hidden_0's kernel: one sum of 8 x 4 rows against 8 sums of 4, then 8.
  u, v = (a.reshape(-1, a.shape[-1]) for a in hidden)
  bound = 2 * (gamma(N * 4) + gamma(4) + gamma(N)) * exact(np.abs(u), np.abs(v)) / N
  assert_within(
    got["hidden_0"]["kernel"], dense["hidden_0"]["kernel"], bound, "hidden_0"
  )
  with pytest.raises(KeyError, match="no kernel"):
    sf.replace_kernels(got, {("nope",): jnp.zeros((1, 1))})


# -- the rule ---------------------------------------------------------------


def test_costs_are_the_documented_formulas():
  # (P-1) K (M+N) values and 2 (P-1)/P M N values, 4 bytes each.
  assert sf.factor_bytes((100, 50), 8, 4) == 4 * 3 * 8 * 150
  assert sf.dense_bytes((100, 50), 4) == 4 * 2 * 3 / 4 * 5000
  assert sf.factor_bytes((100, 50), 8, 1) == sf.dense_bytes((100, 50), 1) == 0
  assert sf.dense_bytes((100, 50), 4, value_bytes=2) == 2 * 1.5 * 5000
  assert sf.ring_link_bytes({"all-gather": 10, "all-reduce": 8}, 4) == 30 + 12


@pytest.mark.parametrize(
  "shape, batch, workers, alternative, want",
  [
    ((4096, 4096), 256, 4, None, "factors"),  # AlexNet fc7
    ((16, 16), 32, 4, None, "dense"),  # a small layer
    ((4096, 4096), 256, 1, None, "dense"),  # nothing crosses the wire
    ((8, 8), 3, 2, None, "factors"),  # P K (M+N) = 96 < 2 M N = 128
    ((8, 8), 4, 2, None, "dense"),  # 128 = 128: a tie keeps the matrix
    # Per-worker operands would choose factors (K (M+N) = 2.1M < MN = 16.8M),
    # but 64 workers each receive the other 63 workers' factors.
    ((4096, 4096), 256, 64, None, "dense"),
    ((16, 16), 32, 4, 100.0, "alternative"),  # e.g. a top-k payload
    # fc7's factors: 3 x 256 x 8192 x 4 = 25,165,824 bytes per worker; the
    # all-reduce 100,663,296.
    ((4096, 4096), 256, 4, 1e8, "factors"),
    ((4096, 4096), 256, 4, 2e7, "alternative"),
  ],
)
def test_choose(shape, batch, workers, alternative, want):
  assert sf.choose(shape, batch, workers, alternative) == want


@pytest.mark.parametrize(
  "args, message",
  [
    (((10,), 4, 2), "shape"),
    (((10, 0), 4, 2), "shape"),
    (((10, 10), 0, 2), "batch"),
    (((10, 10), 4, 0), "workers"),
    (((10, 10), 4, 2, -1.0), "alternative_bytes"),
    (((10, 10), 4, 2, float("nan")), "alternative_bytes"),
  ],
)
def test_choose_rejects_bad_arguments(args, message):
  with pytest.raises(ValueError, match=message):
    sf.choose(*args)


# -- the survey's AlexNet number --------------------------------------------


class _AlexNetHead(nn.Module):
  """AlexNet's classifier (Krizhevsky et al. 2012): pool5 (6 x 6 x 256) -> fc6-8."""

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(4096, name="fc6")(x))
    x = nn.relu(nn.Dense(4096, name="fc7")(x))
    return nn.Dense(1000, name="fc8")(x)


@functools.cache
def _alexnet_factor_shapes(batch):
  model = _AlexNetHead()
  x = jax.ShapeDtypeStruct((batch, 6, 6, 256), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  loss = lambda p, x: jnp.sum(model.apply({"params": p}, x))
  _, _, factors = jax.eval_shape(sf.value_grad_and_factors(loss), params, x)
  kernels = {k: v["kernel"].shape for k, v in params.items()}
  return kernels, {p[0]: (f.u.shape, f.v.shape) for p, f in factors.items()}


def test_survey_alexnet_number():
  """Survey 004 §2.5: "AlexNet on 4 GPU nodes with batchsize 256, ... from
  134.2M to 18.9M". Both numbers are fc7 (4096 x 4096) alone, counted over
  the whole cluster: 2 P M N = 8 x 4096^2 = 134,217,728 is every worker
  pushing its gradient to a parameter server and pulling the matrix back;
  18,874,368 = (P - 1)^2 K (M + N) = 9 x 256 x 8192. Each of the P workers
  sending its K (M + N) factors to the P - 1 others is P (P - 1) K (M + N)
  = 25,165,824 values, so the survey's SFB count holds 3 senders where there
  are 4 (a 5.3x saving, not 7.1x). No other subset of fc6-8 and no other
  small multiple of these terms gives either number."""
  p, k = 4, 256
  kernels, factors = _alexnet_factor_shapes(k)
  assert kernels == {"fc6": (9216, 4096), "fc7": (4096, 4096), "fc8": (4096, 1000)}
  assert factors == {
    name: ((k, m), (k, n)) for name, (m, n) in kernels.items()
  }  # U and V of each layer, one row per example
  m, n = kernels["fc7"]
  assert 2 * p * m * n == 134_217_728 and round(2 * p * m * n / 1e6, 1) == 134.2
  assert (p - 1) ** 2 * k * (m + n) == 18_874_368
  assert round((p - 1) ** 2 * k * (m + n) / 1e6, 1) == 18.9
  assert p * (p - 1) * k * (m + n) == 25_165_824
  # The whole fully connected stack, in the same cluster-wide counts.
  assert 2 * p * sum(a * b for a, b in kernels.values()) == 468_975_616
  assert p * (p - 1) * k * sum(a + b for a, b in kernels.values()) == 81_715_200
  # The rule sends factors for all three layers at 4 workers, batch 256 ...
  assert {sf.choose(s, k, p) for s in kernels.values()} == {"factors"}
  # ... per worker fc7: 6.3M factor values against 25.2M of the all-reduce.
  assert sf.factor_bytes((m, n), k, p) / 4 == 6_291_456
  assert sf.dense_bytes((m, n), p) / 4 == 25_165_824
  # ... and keeps fc8 dense from 7 workers on: P K (M+N) = 7 x 1,304,576
  # >= 2 M N = 8,192,000.
  assert [sf.choose(kernels["fc8"], k, w) for w in (6, 7)] == ["factors", "dense"]
