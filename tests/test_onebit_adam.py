"""1-bit Adam and its two-stage 1-bit all-reduce, against NumPy float64 transcriptions.

References written here from Tang et al. 2021 (Alg. 1) and the module's
stated readings: the exchange's worker and server errors (per-chunk scales
``||x|| / sqrt(d)``), AdamW's warm-up with bias correction, the frozen
variance bias-corrected at the freeze step, zero momentum where the frozen
variance is zero. Invariants: the errors conserve mass; a run that never
leaves the warm-up is ``optax.adamw``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_dense_warmup import run as run_codec

import gradcomp
from gradcomp.compressors import scatter
from gradcomp.optimizers.onebit_adam import onebit_adam
from gradcomp.parallel.wire import collective_bytes
from gradcomp.parallel.workers import add_worker_axis, drop_worker_axis

AXIS = "data"
N = 4


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])


# -- NumPy references ----------------------------------------------------------


def np_encode(rows, counts):
  """Per row: sign (>= 0 is +) times ||row|| / sqrt(count)."""
  scale = np.sqrt(np.sum(rows**2, axis=-1) / counts)
  return np.where(rows >= 0, 1.0, -1.0) * scale[..., None]


def np_onebit_allreduce(x, worker_error, server_error):
  """``x``, errors: (n, d) float64. Returns (mean (d,), worker errors, server errors)."""
  n, d = x.shape
  c = -(-d // n)
  counts = np.array([max(min(c, d - j * c), 1) for j in range(n)], float)
  y = x + worker_error
  rows = np.pad(y, ((0, 0), (0, n * c - d))).reshape(n, n, c)
  decoded = np_encode(rows, counts)  # (worker, owner, c)
  new_worker_error = y - decoded.reshape(n, -1)[:, :d]
  mean = np.zeros(n * c)
  new_server_error = server_error.copy()
  for j in range(n):
    valid = j * c + np.arange(c) < d
    own = np.pad(server_error[j], (0, n * c - d))[j * c : (j + 1) * c]
    z = np.where(valid, decoded[:, j].mean(axis=0) + own, 0.0)
    sent = np_encode(z[None], counts[j : j + 1])[0]
    mean[j * c : (j + 1) * c] = sent
    new_server_error[j, j * c : min((j + 1) * c, d)] = (z - sent)[valid]
  return mean[:d], new_worker_error, new_server_error


def np_onebit_adam(params, grads, *, lr, freeze, b1, b2, eps, wd, warmup_means=None):
  """Alg. 1 with the module's readings. ``grads``: (steps, n, d); params (d,).

  ``warmup_means``: (freeze, d), the mean AdamW takes at each warm-up step
  (a warm-up codec's); ``None``: the workers' exact mean.
  """
  steps, n, d = grads.shape
  p = params.astype(float).copy()
  m, v = np.zeros(d), np.zeros(d)
  we, se = np.zeros((n, d)), np.zeros((n, d))
  for t in range(1, steps + 1):
    g = grads[t - 1].astype(float)
    if t <= freeze:
      gbar = g.mean(axis=0) if warmup_means is None else warmup_means[t - 1]
      m = b1 * m + (1 - b1) * gbar
      v = b2 * v + (1 - b2) * gbar**2
      step = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    else:
      live = v > 0
      local = np.where(live, b1 * m + (1 - b1) * g, 0.0)
      m, we, se = np_onebit_allreduce(local, we, se)
      m = np.where(live, m, 0.0)
      we, se = np.where(live, we, 0.0), np.where(live, se, 0.0)
      step = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**freeze)) + eps)
    p = p - lr * (step + wd * p)
  return p, m, we, se


# -- JAX under shard_map ----------------------------------------------------------


def put(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


def run_sharded(mesh, tx, params, grads, *, atol=0.0):
  """``len(grads)`` updates of ``tx`` on N workers (one scan, one compile).

  ``grads``: a tree whose leaves are (steps, N, ...): worker w's gradient.
  Returns worker 0's final params, after checking every worker's agree
  within ``atol`` (exactly by default), and every worker's state (leading
  worker axis).
  """

  def body(grads, params, state):
    grads = jax.tree.map(lambda g: g[:, 0], grads)  # This worker's sequence.
    state = drop_worker_axis(state)
    # Every leaf enters per worker (varying); each worker's params come back
    # so the test sees that they agree.
    params = jax.tree.map(lambda x: lax.pcast(x, AXIS, to="varying"), params)

    def step(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (params, state), _ = lax.scan(step, (params, state), grads)
    return add_worker_axis((params, state))

  state = add_worker_axis(tx.init(params), N)
  f = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(None, AXIS), P(), P(AXIS)),
      out_specs=P(AXIS),
    )
  )
  params, state = f(
    put(mesh, grads, P(None, AXIS)), put(mesh, params, P()), put(mesh, state, P(AXIS))
  )
  params, state = jax.tree.map(np.asarray, (params, state))
  for leaf in jax.tree.leaves(params):  # The same params on every worker.
    for w in range(N):
      np.testing.assert_allclose(leaf[w], leaf[0], rtol=0, atol=atol)
  return jax.tree.map(lambda x: x[0], params), state


def split(flat, like):
  out, start = {}, 0
  for k, shape in like.items():
    size = math.prod(shape)
    out[k] = flat[..., start : start + size].reshape(*flat.shape[:-1], *shape)
    start += size
  return out


SHAPES = {"b": (7,), "w": (5, 3)}  # d = 22: four chunks of 6, the last padded.


def test_the_exchange_matches_numpy_and_conserves_mass(mesh):
  rng = np.random.default_rng(0)
  d, rounds = 22, 3
  x = rng.normal(size=(rounds, N, d)).astype(np.float32)

  def body(x):
    x = x[:, 0]
    we = se = jnp.zeros(d, jnp.float32)
    out = []
    for r in range(rounds):
      mean, we, se = scatter.onebit_allreduce(x[r], we, se, AXIS)
      out.append((mean, we, se))
    means = jnp.stack([o[0] for o in out])
    errors = jnp.stack([jnp.stack(o[1:]) for o in out])
    return means, errors[:, None]

  f = jax.shard_map(
    body, mesh=mesh, in_specs=P(None, AXIS), out_specs=(P(), P(None, AXIS))
  )
  means, errors = jax.jit(f)(put(mesh, x, P(None, AXIS)))
  we, se = np.zeros((N, d)), np.zeros((N, d))
  for r in range(rounds):
    old = x[r].astype(float).mean(axis=0) + we.mean(axis=0) + se.sum(axis=0)
    want, we, se = np_onebit_allreduce(x[r].astype(float), we, se)
    got_we, got_se = np.asarray(errors[r, :, 0]), np.asarray(errors[r, :, 1])
    # Each value is a few float32 roundings of O(1) numbers from float64's:
    # 1e-5 absolute leaves a factor of ~20 (a sign flipped by rounding would
    # differ by 2 scales, ~1: probability ~1e-7 per value for these draws).
    np.testing.assert_allclose(np.asarray(means[r]), want, atol=1e-5)
    np.testing.assert_allclose(got_we, we, atol=1e-5)
    np.testing.assert_allclose(got_se, se, atol=1e-5)
    # Mass: what went in (values, old errors) is what came out (mean, new
    # errors): each owner's server error on its own chunk only.
    new = want + we.mean(axis=0) + se.sum(axis=0)
    np.testing.assert_allclose(new, old, atol=1e-9)
    got_new = np.asarray(means[r]) + got_we.mean(axis=0) + got_se.sum(axis=0)
    np.testing.assert_allclose(got_new, old, atol=1e-5)


HYPER = {"lr": 0.01, "freeze": 2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "wd": 0.01}


def onebit(warmup_codec=None, **overrides):
  h = {**HYPER, **overrides}
  return onebit_adam(
    h["lr"],
    freeze_step=h["freeze"],
    b1=h["b1"],
    b2=h["b2"],
    eps=h["eps"],
    weight_decay=h["wd"],
    axis_name=AXIS,
    warmup_codec=warmup_codec,
  )


def test_onebit_adam_matches_the_papers_algorithm(mesh):
  rng = np.random.default_rng(1)
  steps, d = 6, 22
  flat_params = rng.normal(size=d).astype(np.float32)
  flat_grads = rng.normal(size=(steps, N, d)).astype(np.float32)
  params, state = run_sharded(
    mesh, onebit(), split(flat_params, SHAPES), split(flat_grads, SHAPES)
  )
  want_p, want_m, want_we, want_se = np_onebit_adam(flat_params, flat_grads, **HYPER)
  got_p = np.concatenate([np.ravel(params[k]) for k in SHAPES])
  scaled = state.adam[0]
  got_m = np.concatenate([np.ravel(scaled.mu[k][0]) for k in SHAPES])
  # Updates are lr x O(1) (m / sqrt(v) with v from the same gradients), each a
  # few float32 roundings from float64's: 6 steps stay well under 1e-5 x lr.
  np.testing.assert_allclose(got_p, want_p, atol=1e-6)
  np.testing.assert_allclose(got_m, want_m, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.worker_error), want_we, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.server_error), want_se, atol=1e-5)
  # Every worker holds the same momentum after the exchange.
  assert all(np.array_equal(scaled.mu["w"][0], scaled.mu["w"][i]) for i in range(N))


def test_a_warmup_codec_feeds_adamw_its_means(mesh):
  """The warm-up's AdamW steps on the codec's means; the 1-bit phase is Alg. 1's."""
  rng = np.random.default_rng(5)
  steps, d, freeze = 6, 22, 3
  flat_params = rng.normal(size=d).astype(np.float32)
  flat_grads = rng.normal(size=(steps, N, d)).astype(np.float32)
  grads = split(flat_grads, SHAPES)
  # Blocks of 2 within chunks of 6 values: int4 rounds visibly.
  codec = gradcomp.int_quantize(4, 2, exchange="scatter", axis_name=AXIS)
  # The codec alone on the warm-up's gradients (the same on every worker).
  means, _ = run_codec(mesh, codec, jax.tree.map(lambda g: g[:freeze], grads))
  warm = np.concatenate([means[k].reshape(freeze, -1) for k in SHAPES], axis=1)
  # The codec's means are not the exact ones (else this test could not fail).
  assert np.abs(warm - flat_grads[:freeze].mean(axis=1)).max() > 1e-3
  params, state = run_sharded(
    mesh, onebit(codec, freeze=freeze), split(flat_params, SHAPES), grads
  )
  want_p, want_m, want_we, want_se = np_onebit_adam(
    flat_params, flat_grads, **{**HYPER, "freeze": freeze}, warmup_means=warm
  )
  got_p = np.concatenate([np.ravel(params[k]) for k in SHAPES])
  # The tolerances of the dense warm-up's test: the codec's means enter both
  # sides as the same float32 values.
  np.testing.assert_allclose(got_p, want_p, atol=1e-6)
  np.testing.assert_allclose(np.asarray(state.worker_error[0]), want_we[0], atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.server_error[0]), want_se[0], atol=1e-5)
  # The codec's residuals stay as the warm-up left them: non-zero.
  residuals = jax.tree.leaves(state.warmup)
  assert any(np.any(np.asarray(r)) for r in residuals)


def test_a_warmup_codec_over_another_axis_is_named():
  with pytest.raises(
    ValueError, match="warmup_codec must average over axis_name 'data'"
  ):
    onebit_adam(
      0.1, freeze_step=2, axis_name=AXIS, warmup_codec=gradcomp.int_quantize(8)
    )
  with pytest.raises(
    ValueError, match="warmup_codec must be an optax.GradientTransformation"
  ):
    onebit_adam(0.1, freeze_step=2, warmup_codec=lambda g: g)


def test_a_run_that_never_leaves_the_warmup_is_adamw():
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  grads = jnp.asarray(rng.normal(size=(5, 4, 3)), jnp.float32)
  schedule = optax.linear_schedule(0.1, 0.01, 5)

  def run(tx):
    def step(carry, g):
      p, s = carry
      u, s = tx.update({"w": g}, s, p)
      return (optax.apply_updates(p, u), s), u["w"]

    return jax.jit(lambda p: lax.scan(step, (p, tx.init(p)), grads)[1])(params)

  ours = run(onebit_adam(schedule, freeze_step=10, weight_decay=0.1))
  ref = run(optax.adamw(schedule, weight_decay=0.1))
  # The warm-up is optax.adamw's own chain, on the one device's gradient;
  # XLA compiles it inside the phase's conditional, where it may contract a
  # multiply and an add into one rounding differently: at most a few ulp.
  np.testing.assert_array_max_ulp(np.asarray(ours), np.asarray(ref), maxulp=4)


def test_coordinates_whose_gradient_is_always_zero_keep_zero_momentum(mesh):
  rng = np.random.default_rng(3)
  steps = 6
  params = {
    "used": jnp.asarray(rng.normal(size=8), jnp.float32),
    "unused": jnp.asarray(rng.normal(size=8), jnp.float32),
  }
  grads = {
    "used": jnp.asarray(rng.normal(size=(steps, N, 8)), jnp.float32),
    "unused": jnp.zeros((steps, N, 8), jnp.float32),
  }
  # Part of a leaf, too: the used leaf's first coordinate never moves.
  grads["used"] = grads["used"].at[:, :, 0].set(0.0)
  out, state = run_sharded(mesh, onebit(wd=0.0), params, grads)
  mu = state.adam[0].mu
  assert not np.any(np.asarray(mu["unused"]))
  assert not np.any(np.asarray(mu["used"])[:, 0])
  np.testing.assert_array_equal(out["unused"], params["unused"])
  assert out["used"][0] == params["used"][0]
  # The flat buffer holds the leaves in tree order: "unused", then "used".
  errors = np.concatenate([state.worker_error, state.server_error], axis=1)
  assert not np.any(errors[:, :8]) and not np.any(errors[:, 8])
  assert not np.any(errors[:, 16:24]) and not np.any(errors[:, 24])
  assert np.any(np.asarray(mu["used"])[:, 1:])  # The rest did move.


def test_after_the_freeze_the_wire_carries_packed_bits(mesh):
  d = 65536
  params = {"w": jnp.zeros((d,), jnp.float32)}
  tx = onebit(freeze=1)
  state = add_worker_axis(tx.init(params), N)

  def body(g, p, s):
    return add_worker_axis(tx.update({"w": g[0]}, drop_worker_axis(s), p))

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS)), out_specs=P(AXIS))
  )
  grads = jnp.zeros((N, d), jnp.float32)
  args = (put(mesh, grads, P(AXIS)), put(mesh, params, P()), put(mesh, state, P(AXIS)))
  text = f.lower(*args).compile().as_text()
  wire = collective_bytes(text)
  dense = 4 * d
  compressed = wire["all-to-all"] + wire["all-gather"]
  assert compressed == scatter.onebit_payload_bytes(d, N)
  # One bit a value in the all-to-all, 1/N bit in the all-gather, plus one
  # float32 scale per chunk in each: dense / compressed = 32 N / (N + 1).
  assert compressed == d // 8 + d // (8 * N) + 4 * (N + 1)
  # The scales cost 4 (N + 1) bytes of 10,260 here: within 1 % of the ratio.
  assert 0.99 * 32 * N / (N + 1) < dense / compressed < 32 * N / (N + 1)
  assert wire["all-reduce"] >= dense  # The warm-up's dense all-reduce, in its branch.
  assert "u32[" in text.split("all-to-all(")[0].splitlines()[-1]


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ({"freeze_step": -1}, "freeze_step must be an integer >= 1, got -1"),
    ({"freeze_step": 0}, "freeze_step must be an integer >= 1, got 0"),
    ({"freeze_step": 1.5}, "freeze_step must be an integer"),
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
    ({"b2": -0.1}, r"b2 must be in \[0, 1\)"),
    ({"eps": 0.0}, "eps must be > 0"),
    ({"weight_decay": -1.0}, "weight_decay must be >= 0"),
  ],
)
def test_bad_hyperparameters_are_named(kwargs, message):
  args = {"learning_rate": 0.1, "freeze_step": 10, **kwargs}
  lr = args.pop("learning_rate")
  with pytest.raises(ValueError, match=message):
    onebit_adam(lr, **args)


def test_bfloat16_params_keep_float32_state(mesh):
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=16), jnp.bfloat16)}
  grads = {"w": jnp.asarray(rng.normal(size=(4, N, 16)), jnp.bfloat16)}
  out, state = run_sharded(mesh, onebit(freeze=1), params, grads)
  assert out["w"].dtype == jnp.bfloat16
  assert state.worker_error.dtype == jnp.float32
  assert state.adam[0].mu["w"].dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(out["w"], np.float32)))
  assert not np.array_equal(np.asarray(out["w"]), np.asarray(params["w"]))


def test_under_pmap_it_is_the_shard_map_result(mesh):
  rng = np.random.default_rng(6)
  steps, d = 4, 22
  flat_params = rng.normal(size=d).astype(np.float32)
  flat_grads = rng.normal(size=(steps, N, d)).astype(np.float32)
  tx = onebit(freeze=1)
  params, grads = split(flat_params, SHAPES), split(flat_grads, SHAPES)
  want, _ = run_sharded(mesh, tx, params, grads)

  def body(g_seq, p):
    def step(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (p, _), _ = lax.scan(step, (p, tx.init(p)), g_seq)
    return p

  devices = jax.devices()[:N]
  per_device = jax.tree.map(lambda g: np.swapaxes(g, 0, 1), grads)  # (N, steps, ...)
  replicated = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), params)
  got = jax.pmap(body, AXIS, devices=devices)(per_device, replicated)
  # The same arithmetic under another transform: XLA may order a sum or
  # contract a multiply-add differently; a few ulps of values ~1.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    for w in range(N):
      np.testing.assert_allclose(np.asarray(a[w]), b, rtol=0, atol=1e-6)
