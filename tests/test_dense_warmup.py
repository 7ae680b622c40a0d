"""``dense_warmup``: the dense mean for the first updates, then the compressor started fresh.

References: ``gradcomp.none`` (the float32 mean, for the warm-up) and the
bare compressor run from its own ``init`` on the updates after the warm-up
(for the rest), both on 4 workers under ``shard_map``; the compiled step's
collectives are the two branches' (the dense all-reduce of ``4 d`` bytes,
the compressor's own).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors.warmup import DenseWarmupState, dense_warmup
from gradcomp.parallel.wire import collective_bytes
from gradcomp.parallel.workers import add_worker_axis, drop_worker_axis

AXIS, N = "data", 4
SHAPES = {"b": (6,), "w": (8, 5)}
WARMUP, STEPS = 3, 6


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])


def compiled(mesh, tx, grads):
  """The jitted ``shard_map`` of ``len(grads)`` updates, and its arguments.

  ``grads``: leaves (steps, N, ...). Returns ``(f, args)``; ``f(*args)``
  gives every step's output and the final state, each with a leading
  worker axis.
  """
  one = jax.tree.map(lambda g: g[0, 0], grads)
  state = add_worker_axis(tx.init(one), N)

  def body(grads, state):
    grads = jax.tree.map(lambda g: g[:, 0], grads)

    def step(s, g):
      out, s = tx.update(g, s)
      return s, out

    state, outs = lax.scan(step, drop_worker_axis(state), grads)
    return add_worker_axis((outs, state))

  f = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS)), out_specs=P(AXIS))
  )
  put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
  return f, (put(grads, P(None, AXIS)), put(state, P(AXIS)))


def run(mesh, tx, grads):
  """Every step's output (the same on every worker: checked) and every worker's state."""
  f, args = compiled(mesh, tx, grads)
  outs, state = jax.tree.map(np.asarray, f(*args))
  for leaf in jax.tree.leaves(outs):
    for w in range(N):
      np.testing.assert_array_equal(leaf[w], leaf[0])
  return jax.tree.map(lambda x: x[0], outs), state


def draws(seed, steps=STEPS):
  rng = np.random.default_rng(seed)
  return {
    k: rng.normal(size=(steps, N, *shape)).astype(np.float32)
    for k, shape in SHAPES.items()
  }


COMPRESSORS = {
  "topk": lambda: gradcomp.topk(0.1, axis_name=AXIS),
  "powersgd": lambda: gradcomp.powersgd(rank=2, axis_name=AXIS),
  "ef_signsgd_scatter": lambda: gradcomp.ef_signsgd(exchange="scatter", axis_name=AXIS),
}


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_dense_then_the_compressor_started_fresh(mesh, name):
  grads = draws(0)
  bare = COMPRESSORS[name]()
  outs, state = run(mesh, dense_warmup(bare, WARMUP, axis_name=AXIS), grads)
  dense, _ = run(mesh, gradcomp.none(AXIS), {k: g[:WARMUP] for k, g in grads.items()})
  after, bare_state = run(mesh, bare, {k: g[WARMUP:] for k, g in grads.items()})
  # Then the compressor's own updates from its init: bit for bit, except that
  # XLA:CPU may compile PowerSGD's products and orthogonalisation inside the
  # warm-up's conditional differently from the bare program (FMA contraction,
  # summation order). Its steps are products of length <= 8 and the QR of a
  # well-conditioned 8 x 2 P, three times: a few roundings of the largest
  # value each; 64 u is that argument with a margin. A state not started
  # fresh differs by O(1).
  same = np.testing.assert_array_equal
  if name == "powersgd":

    def same(got, want):
      tol = 64 * np.finfo(np.float32).eps * max(1.0, float(np.abs(want).max()))
      np.testing.assert_allclose(got, want, rtol=0, atol=tol)

  for k in SHAPES:
    # The warm-up is gradcomp.none's float32 mean, bit for bit.
    np.testing.assert_array_equal(outs[k][:WARMUP], dense[k])
    same(outs[k][WARMUP:], after[k])
  assert isinstance(state, DenseWarmupState)
  assert np.all(state.count == WARMUP)
  for got, want in zip(
    jax.tree.leaves(state.inner), jax.tree.leaves(bare_state), strict=True
  ):
    same(got, want)


def test_the_compressor_state_is_untouched_through_the_warmup(mesh):
  grads = draws(1, steps=WARMUP)
  bare = gradcomp.topk(0.1, axis_name=AXIS)
  outs, state = run(mesh, dense_warmup(bare, WARMUP, axis_name=AXIS), grads)
  for k in SHAPES:  # The dense mean, checked against NumPy's too.
    np.testing.assert_allclose(outs[k], grads[k].mean(axis=1), rtol=0, atol=1e-6)
  fresh = bare.init(jax.tree.map(lambda g: g[0, 0], grads))
  for got, want in zip(
    jax.tree.leaves(state.inner), jax.tree.leaves(fresh), strict=True
  ):
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


def test_the_step_holds_the_dense_all_reduce_and_the_compressors_exchange(mesh):
  grads = draws(2, steps=1)
  d = sum(int(np.prod(s)) for s in SHAPES.values())
  bare = gradcomp.topk(0.1, axis_name=AXIS)

  def wire(tx):
    f, args = compiled(mesh, tx, grads)
    return collective_bytes(f.lower(*args).compile().as_text())

  alone, warmed = wire(bare), wire(dense_warmup(bare, WARMUP, axis_name=AXIS))
  # Both branches are compiled (a conditional runs one): the float32 mean's
  # all-reduce of 4 d bytes beside top-k's all-gather of k values and
  # indices per leaf (k = 1 of 6, 4 of 40: 5 pairs of 8 bytes).
  assert alone["all-gather"] == 5 * 8 and alone["all-reduce"] == 0
  assert warmed == {**alone, "all-reduce": 4 * d}
  # With no warm-up, the compressor's exchange alone.
  assert wire(dense_warmup(bare, 0, axis_name=AXIS)) == alone


def test_one_device_and_bfloat16():
  tx = dense_warmup(gradcomp.topk(0.5), 1)
  g = {"w": jnp.array([1.5, -0.25], jnp.bfloat16)}
  out, state = tx.update(g, tx.init(g))
  assert out["w"].dtype == jnp.bfloat16 and out["w"].tolist() == [1.5, -0.25]
  out, state = tx.update(g, state)
  assert out["w"].tolist() == [1.5, 0.0] and int(state.count) == 1


@pytest.mark.parametrize(
  ("args", "message"),
  [
    ({"steps": -1}, "steps must be an integer >= 0, got -1"),
    ({"steps": 1.5}, "steps must be an integer >= 0, got 1.5"),
    ({"steps": True}, "steps must be an integer >= 0, got True"),
    (
      {"compressor": lambda g, s: g},
      "compressor must be an optax.GradientTransformation.*got function",
    ),
    (
      {"compressor": gradcomp.topk(0.1, axis_name="other")},
      r"compressor must average over axis_name 'data'.*\('other',\)",
    ),
    ({"compressor": gradcomp.topk(0.1)}, "axis_name 'data'.*no axis"),
  ],
)
def test_bad_arguments_are_named(args, message):
  args = {"compressor": gradcomp.topk(0.1, axis_name=AXIS), "steps": 2, **args}
  with pytest.raises(ValueError, match=message):
    dense_warmup(args["compressor"], args["steps"], axis_name=AXIS)
