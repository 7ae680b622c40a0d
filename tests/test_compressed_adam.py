"""Compressed-momentum Adam against a NumPy float64 transcription (Tang et al. 2021, Alg. 1).

The reference is written here from Alg. 1 and the module's readings, with
the 1-bit compressor replaced by top-k with error feedback (each worker
keeps the ``max(1, floor(ratio d))`` largest ``|m_w + r_w|`` of each leaf,
the rest stays in ``r_w``; the mean of the sent values is every worker's
momentum). Invariants: before the freeze it is ``optax.adamw``; the codec's
error feedback conserves mass across the switch (nothing in it before,
everything sent or kept after); on one worker with the dense codec it is
Adam with a frozen variance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from test_onebit_adam import AXIS, N, mesh, put, run_sharded, split

import gradcomp
from gradcomp.compressors import axes, scatter
from gradcomp.optimizers.compressed_adam import CompressedAdamState, compressed_adam
from gradcomp.parallel.wire import collective_bytes
from gradcomp.parallel.workers import add_worker_axis, drop_worker_axis

__all__ = ["mesh"]  # The shared fixture.

SHAPES = {"b": (7,), "w": (5, 3)}  # Tree order: "b" then "w"; d = 22.
RATIO = 0.25  # k = 1 of 7, 3 of 15.
LR, FREEZE, B1, B2, EPS, WD = 0.01, 2, 0.9, 0.999, 1e-8, 0.01
STEPS = 6


def np_topk_ef(x, residual, ratio):
  """Per worker, top-k with error feedback of one leaf. ``x``: (n, d)."""
  e = x + residual
  k = max(1, int(np.floor(ratio * e.shape[1])))
  sent = np.zeros_like(e)
  for w in range(e.shape[0]):
    keep = np.argsort(-np.abs(e[w]), kind="stable")[:k]
    sent[w, keep] = e[w, keep]
  return sent.mean(axis=0), e - sent


def np_compressed_adam(params, grads, codec, *, lr=LR, freeze=FREEZE, wd=WD):
  """Alg. 1 with ``codec`` for C. ``grads``: (steps, n, d); returns p, m, residuals.

  ``codec(x, residual) -> (mean (d,), residual (n, d))`` on the flat buffer.
  """
  steps, n, d = grads.shape
  p = params.astype(float).copy()
  m, v = np.zeros(d), np.zeros(d)
  r = np.zeros((n, d))
  for t in range(1, steps + 1):
    g = grads[t - 1].astype(float)
    if t <= freeze:  # AdamW on the mean gradient.
      gbar = g.mean(axis=0)
      m = B1 * m + (1 - B1) * gbar
      v = B2 * v + (1 - B2) * gbar**2
      step = (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
    else:  # Lines 6-12: local momenta through C, the variance frozen.
      live = v > 0
      local = np.where(live, B1 * m + (1 - B1) * g, 0.0)
      m, r = codec(local, r)
      m = np.where(live, m, 0.0)
      step = (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**freeze)) + EPS)
    p = p - lr * (step + wd * p)
  return p, m, r


def leafwise_topk(x, r):
  """``np_topk_ef`` on each leaf of the flat buffer (the codec is leafwise)."""
  means, residuals, start = [], [], 0
  for shape in SHAPES.values():
    size = int(np.prod(shape))
    mean, res = np_topk_ef(
      x[:, start : start + size], r[:, start : start + size], RATIO
    )
    means.append(mean)
    residuals.append(res)
    start += size
  return np.concatenate(means), np.concatenate(residuals, axis=1)


def flat_of(tree, lead=0):
  return np.concatenate(
    [np.asarray(tree[k]).reshape(*np.shape(tree[k])[:lead], -1) for k in SHAPES],
    axis=-1,
  )


def draws(seed, steps=STEPS):
  rng = np.random.default_rng(seed)
  params = rng.normal(size=22).astype(np.float32)
  grads = rng.normal(size=(steps, N, 22)).astype(np.float32)
  return params, grads


def test_it_is_the_papers_algorithm_with_topk_on_four_workers(mesh):
  flat_params, flat_grads = draws(0)
  tx = compressed_adam(
    LR,
    gradcomp.topk(RATIO, axis_name=AXIS),
    freeze_step=FREEZE,
    b1=B1,
    b2=B2,
    eps=EPS,
    weight_decay=WD,
    axis_name=AXIS,
  )
  params, state = run_sharded(
    mesh, tx, split(flat_params, SHAPES), split(flat_grads, SHAPES)
  )
  want_p, want_m, want_r = np_compressed_adam(flat_params, flat_grads, leafwise_topk)
  # Updates are lr x O(1), each a few float32 roundings of float64's; top-k
  # sends values exactly: 6 steps stay well under 1e-5 x lr on params ~1.
  np.testing.assert_allclose(flat_of(params), want_p, atol=1e-6)
  got_m = flat_of(state.adam[0].mu, lead=1)
  np.testing.assert_allclose(got_m, np.broadcast_to(want_m, got_m.shape), atol=1e-6)
  residual = {k: state.codec.leaves[k].residual for k in SHAPES}
  np.testing.assert_allclose(flat_of(residual, lead=1), want_r, atol=1e-6)
  assert np.all(np.asarray(state.codec.count) == STEPS - FREEZE)
  assert np.any(want_r)  # Top-k left something behind.


def test_before_the_freeze_it_is_adamw():
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

  ours = run(
    compressed_adam(schedule, gradcomp.topk(0.1), freeze_step=10, weight_decay=0.1)
  )
  ref = run(optax.adamw(schedule, weight_decay=0.1))
  # optax.adamw's own chain, on the one device's gradient; XLA compiles it
  # inside the phase's conditional, where it may contract a multiply and an
  # add into one rounding differently: at most a few ulp.
  np.testing.assert_array_max_ulp(np.asarray(ours), np.asarray(ref), maxulp=4)


def test_before_the_freeze_on_four_workers_it_is_adamw_on_the_mean(mesh):
  flat_params, flat_grads = draws(3, steps=3)
  tx = compressed_adam(
    LR,
    gradcomp.topk(RATIO, axis_name=AXIS),
    freeze_step=3,
    weight_decay=WD,
    axis_name=AXIS,
  )
  params, state = run_sharded(
    mesh, tx, split(flat_params, SHAPES), split(flat_grads, SHAPES)
  )
  ref = optax.adamw(LR, weight_decay=WD)
  p = split(flat_params, SHAPES)
  s = ref.init(p)
  for t in range(3):
    mean = split(
      flat_grads[t].mean(axis=0, dtype=np.float64).astype(np.float32), SHAPES
    )
    u, s = ref.update(mean, s, p)
    p = optax.apply_updates(p, u)
  # The mean is psum(g / 4) there, a float64 mean rounded here: one ulp of
  # the gradient, a relative 1e-7 of an Adam step of lr: 1e-8 absolute.
  np.testing.assert_allclose(flat_of(params), flat_of(p), atol=1e-7)
  # The codec's state is untouched by the warm-up.
  assert not np.any(np.asarray(state.codec.count))
  for leaf in jax.tree.leaves(state.codec.leaves):
    assert not np.any(leaf)


def test_one_worker_with_the_dense_codec_is_adam_with_a_frozen_variance():
  flat_params, flat_grads = draws(4)
  grads1 = flat_grads[:, :1]  # One worker.
  tx = compressed_adam(
    LR, gradcomp.none(), freeze_step=FREEZE, b1=B1, b2=B2, eps=EPS, weight_decay=WD
  )

  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  p0 = split(flat_params, SHAPES)
  (got, _), _ = jax.jit(lambda p, g: lax.scan(step, (p, tx.init(p)), g))(
    p0, split(grads1[:, 0], SHAPES)
  )
  identity = lambda x, r: (x[0], r)
  want, _, _ = np_compressed_adam(flat_params, grads1, identity)
  np.testing.assert_allclose(flat_of(got), want, atol=1e-6)


def test_error_feedback_conserves_mass_across_the_switch(mesh):
  # Per worker, what went into the codec (its local momenta) is what came
  # out (the mean it sent, averaged over workers) plus what it kept: with
  # nothing kept at the switch, sum_t m_t + mean_w r_w = sum_t mean_w m_w,t.
  flat_params, flat_grads = draws(5, steps=8)
  tx = compressed_adam(
    LR, gradcomp.topk(RATIO, axis_name=AXIS), freeze_step=3, axis_name=AXIS
  )
  params = split(flat_params, SHAPES)

  def body(grads, params):
    grads = jax.tree.map(lambda g: g[:, 0], grads)
    params = jax.tree.map(lambda x: lax.pcast(x, AXIS, to="varying"), params)

    def step(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      r = {k: s.codec.leaves[k].residual for k in SHAPES}
      return (optax.apply_updates(p, u), s), (s.adam[0].mu, r)

    state = tx.init(params)
    _, (mus, rs) = lax.scan(step, (params, state), grads)
    return add_worker_axis((mus, rs))

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(None, AXIS), P()), out_specs=P(AXIS))
  )
  mus, rs = f(
    put(mesh, split(flat_grads, SHAPES), P(None, AXIS)), put(mesh, params, P())
  )
  mu = flat_of(jax.tree.map(np.asarray, mus), lead=2)[0]  # (steps, d): every worker's
  r = flat_of(jax.tree.map(np.asarray, rs), lead=2)  # (N, steps, d)
  g = flat_grads.astype(float)
  assert not np.any(r[:, :3])  # Nothing in the codec through the warm-up.
  inputs = np.stack([B1 * mu[t - 1] + (1 - B1) * g[t] for t in range(3, 8)], axis=1)
  went_in = inputs.mean(axis=0).sum(axis=0)
  came_out = mu[3:].sum(axis=0) + r[:, -1].mean(axis=0)
  # Top-k moves values exactly; the residual is one float32 subtraction:
  # sums of 5 values ~0.1, a few ulps.
  np.testing.assert_allclose(came_out, went_in, atol=1e-7)
  assert np.any(r[:, -1])


def test_the_compiled_step_sends_dense_then_the_codecs_payload(mesh):
  d = 4096
  params = {"w": jnp.zeros((d,), jnp.float32)}
  codec = gradcomp.topk(0.01, axis_name=AXIS)
  tx = compressed_adam(0.1, codec, freeze_step=1, axis_name=AXIS)
  state = add_worker_axis(tx.init(params), N)

  def body(g, p, s):
    return add_worker_axis(tx.update({"w": g[0]}, drop_worker_axis(s), p))

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS)), out_specs=P(AXIS))
  )
  grads = jnp.zeros((N, d), jnp.float32)
  args = (put(mesh, grads, P(AXIS)), put(mesh, params, P()), put(mesh, state, P(AXIS)))
  wire = collective_bytes(f.lower(*args).compile().as_text())
  # The warm-up's all-reduce of 4 d bytes; the codec's all-gather of k = 40
  # float32 values and int32 indices.
  assert wire["all-reduce"] >= 4 * d
  assert wire["all-gather"] == 40 * (4 + 4)


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ({"freeze_step": 0}, "freeze_step must be an integer >= 1, got 0"),
    ({"freeze_step": -2}, "freeze_step must be an integer >= 1, got -2"),
    ({"freeze_step": 2.0}, "freeze_step must be an integer >= 1, got 2.0"),
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
    ({"b2": -0.1}, r"b2 must be in \[0, 1\), got -0.1"),
    ({"eps": 0.0}, "eps must be > 0, got 0.0"),
    ({"weight_decay": -1.0}, "weight_decay must be >= 0, got -1.0"),
    ({"codec": "topk"}, "codec must be an optax.GradientTransformation.*got str"),
    (
      {"codec": gradcomp.topk(0.1, axis_name="other")},
      r"codec must average over axis_name 'data'.*\('other',\)",
    ),
    ({"codec": gradcomp.topk(0.1)}, "axis_name 'data'.*no axis"),
    (
      {"warmup_codec": gradcomp.int_quantize(8)},
      "warmup_codec must average over axis_name 'data'.*no axis",
    ),
  ],
)
def test_bad_hyperparameters_are_named(kwargs, message):
  args = {
    "learning_rate": 0.1,
    "codec": gradcomp.topk(0.1, axis_name=AXIS),
    "freeze_step": 10,
    "axis_name": AXIS,
    **kwargs,
  }
  lr, codec = args.pop("learning_rate"), args.pop("codec")
  with pytest.raises(ValueError, match=message):
    compressed_adam(lr, codec, **args)


def test_state_and_dtypes(mesh):
  # bf16 params: float32 state, bf16 updates; the state's type is stable.
  rng = np.random.default_rng(6)
  params = {"w": jnp.asarray(rng.normal(size=16), jnp.bfloat16)}
  grads = {"w": jnp.asarray(rng.normal(size=(4, N, 16)), jnp.bfloat16)}
  tx = compressed_adam(
    LR, gradcomp.topk(0.25, axis_name=AXIS), freeze_step=1, axis_name=AXIS
  )
  out, state = run_sharded(mesh, tx, params, grads)
  assert out["w"].dtype == jnp.bfloat16 and isinstance(state, CompressedAdamState)
  assert state.codec.leaves["w"].residual.dtype == np.float32
  assert np.all(np.isfinite(np.asarray(out["w"], np.float32)))


def test_with_the_two_stage_one_bit_codec_it_is_onebit_adam(mesh):
  # DESIGN §11: onebit_adam is compressed_adam whose codec is the two-stage
  # scaled-sign exchange (worker error as error feedback, server error in
  # the codec) of one flat buffer; here one leaf, so one buffer either way.
  rng = np.random.default_rng(7)
  params = {"w": rng.normal(size=22).astype(np.float32)}
  grads = {"w": rng.normal(size=(STEPS, N, 22)).astype(np.float32)}
  leaf = scatter.scatter_codec(scatter.ONEBIT, AXIS, server_error=True)
  codec = axes.record(gradcomp.leafwise(gradcomp.error_feedback(leaf)), AXIS)
  hyper = {"freeze_step": FREEZE, "weight_decay": WD, "axis_name": AXIS}
  got, state = run_sharded(mesh, compressed_adam(LR, codec, **hyper), params, grads)
  want, onebit_state = run_sharded(
    mesh, gradcomp.onebit_adam(LR, **hyper), params, grads
  )
  np.testing.assert_array_equal(got["w"], want["w"])
  np.testing.assert_array_equal(
    state.codec.leaves["w"].residual, onebit_state.worker_error
  )
  np.testing.assert_array_equal(
    state.codec.leaves["w"].inner.error, onebit_state.server_error
  )
