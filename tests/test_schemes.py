"""The scheme contract (DESIGN §5) and NumPy references for local SGD, DiLoCo and EASGD.

Each scheme runs on 8 workers for a few steps (one compile each, a ``scan``
over the steps) on given per-worker gradients, and is compared with a
float64 NumPy replay of the paper's update. Error bound: every step's
float32 arithmetic (an 8-term mean, a few adds and multiplies) errs by at
most ``(n + 4) u`` of the largest magnitude ``M`` it touches (Higham §4.2);
momentum carries an error forward with gain at most ``1 / (1 - mu)``; over
``T`` steps the errors add: ``T (n + 4) u M / (1 - mu)``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomp

import harness

pytestmark = pytest.mark.xdist_group("schemes")

N = harness.WORKERS
T = 7
LR = 0.1
SHAPES = {"kernel": (6, 5), "bias": (5,)}
U = float(jnp.finfo(jnp.float32).eps) / 2


def _grads(seed=0, steps=T):
  return harness.scheme_grads(SHAPES, steps, seed)


def _params(seed=1):
  return harness.scheme_params(SHAPES, seed)


def _bound(reference, grads, mu=0.0):
  magnitude = max(
    max(np.abs(v).max() for v in jax.tree.leaves(reference)),
    LR * max(np.abs(g).max() for g in jax.tree.leaves(grads)) / (1 - mu),
    1.0,
  )
  return T * (N + 4) * U * magnitude / (1 - mu)


_run = harness.run_scheme


# --- NumPy references -------------------------------------------------------


def local_sgd_reference(params, grads, every, mu=0.0, outer=None):
  """Paper 004 §2.3 model averaging / DiLoCo Alg. 1 in float64.

  ``outer=(lr, momentum)``: optax's Nesterov SGD at the anchor.
  """
  x = {k: np.repeat(np.float64(v)[None], N, 0) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in x.items()}
  anchor = {k: np.float64(v) for k, v in params.items()}
  trace = {k: np.zeros_like(v) for k, v in anchor.items()}
  for t in range(T):
    for k in x:
      m[k] = mu * m[k] + grads[k][t]
      x[k] = x[k] - LR * m[k]
    if (t + 1) % every:
      continue
    for k in x:
      delta = (anchor[k] - x[k]).mean(0)
      if outer is None:
        anchor[k] = anchor[k] - delta
      else:
        lr, mom = outer
        trace[k] = mom * trace[k] + delta
        anchor[k] = anchor[k] - lr * (delta + mom * trace[k])
      x[k] = np.repeat(anchor[k][None], N, 0)
  return x


def easgd_reference(params, grads, alpha, every):
  """Zhang et al. 2015 eqs. 5-6 (period tau = ``every``) in float64."""
  x = {k: np.repeat(np.float64(v)[None], N, 0) for k, v in params.items()}
  center = {k: np.float64(v) for k, v in params.items()}
  for t in range(T):
    for k in x:
      u = -LR * grads[k][t]
      if t % every == 0:
        diff = x[k] - center[k]
        x[k] = x[k] + u - alpha * diff
        center[k] = center[k] + alpha * diff.sum(0)
      else:
        x[k] = x[k] + u
  return x


# --- Reductions and references on 8 workers ----------------------------------


def test_local_sgd_every_1_is_synchronous_momentum_sgd():
  """The documented reduction: every=1, no outer, no compressor."""
  params, grads = _params(), _grads()
  tx = gradcomp.local_sgd(optax.sgd(LR, momentum=0.9), 1, axis_name=harness.AXIS)
  got, _ = _run(tx, params, grads)
  # Synchronous momentum SGD on the mean gradient, every worker the same.
  mean = {
    k: g.astype(np.float64).mean(1, keepdims=True).repeat(N, 1)
    for k, g in grads.items()
  }
  want = local_sgd_reference(params, mean, every=T + 1, mu=0.9)
  harness.assert_within(got, want, _bound(want, grads, mu=0.9))


def test_local_sgd_averages_every_period():
  params, grads = _params(), _grads(seed=2)
  tx = gradcomp.local_sgd(optax.sgd(LR, momentum=0.5), 3, axis_name=harness.AXIS)
  got, state = _run(tx, params, grads)
  want = local_sgd_reference(params, grads, every=3, mu=0.5)
  harness.assert_within(got, want, _bound(want, grads, mu=0.5))
  # After 7 steps (last round at step 6) the workers differ by one local step.
  assert not np.allclose(got["kernel"][0], got["kernel"][1])
  np.testing.assert_array_equal(state.count, T)


def test_diloco_outer_nesterov():
  params, grads = _params(), _grads(seed=3)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  tx = gradcomp.local_sgd(optax.sgd(LR), 2, outer=outer, axis_name=harness.AXIS)
  got, state = _run(tx, params, grads)
  want = local_sgd_reference(params, grads, every=2, outer=(0.7, 0.9))
  harness.assert_within(got, want, _bound(want, grads, mu=0.9))
  # The anchor is replicated and is where the last round put every worker.
  harness.assert_same_on_workers(state.anchor)


def test_compressed_pseudo_gradients_conserve_mass():
  """Error feedback across rounds: anchor - mean residual = dense averaging.

  A round sends part of each worker's ``delta + residual`` and keeps the rest
  as the new residual, and the anchor moves by the decoded mean, so
  ``anchor - mean(residual)`` moves by exactly ``-mean(delta)``. With given
  gradients a round's delta is ``LR`` times the worker's gradients of the
  round whatever the anchor, so after the rounds of steps 1-6 the balance is
  ``x0 - LR sum_{t<=6} mean_w g_t``, dense synchronous SGD.
  """
  params, grads = _params(), _grads(seed=4)
  topk = gradcomp.topk(0.2, axis_name=harness.AXIS)
  tx = gradcomp.local_sgd(optax.sgd(LR), 2, compressor=topk, axis_name=harness.AXIS)
  _, state = _run(tx, params, grads)
  leaves = state.compressor_state.leaves
  for k in SHAPES:
    residual = np.asarray(leaves[k].residual, np.float64)
    assert np.any(residual != 0)  # top-k left something behind
    anchor = np.asarray(state.anchor[k][0], np.float64)
    dense = params[k] - LR * grads[k][: T - 1].astype(np.float64).mean(1).sum(0)
    want = {k: dense}
    harness.assert_within({k: anchor - residual.mean(0)}, want, _bound(want, grads))


def test_easgd_matches_reference():
  params, grads = _params(), _grads(seed=5)
  tx = gradcomp.easgd(optax.sgd(LR), 0.1, every=2, axis_name=harness.AXIS)
  got, state = _run(tx, params, grads)
  want = easgd_reference(params, grads, alpha=0.1, every=2)
  harness.assert_within(got, want, _bound(want, grads))
  harness.assert_same_on_workers(state.center)


def test_easgd_alpha_0_is_independent_local_training():
  params, grads = _params(), _grads(seed=6)
  tx = gradcomp.easgd(optax.sgd(LR), 0.0, axis_name=harness.AXIS)
  got, _ = _run(tx, params, grads)
  want = easgd_reference(params, grads, alpha=0.0, every=1)
  harness.assert_within(got, want, _bound(want, grads))


# --- One worker ----------------------------------------------------------------


@pytest.mark.parametrize(
  "make",
  [
    lambda inner: gradcomp.local_sgd(inner, 3),
    lambda inner: gradcomp.local_sgd(inner, 2, outer=optax.sgd(1.0)),
    lambda inner: gradcomp.easgd(inner, 0.0, every=2),
  ],
  ids=["local_sgd", "local_sgd_outer_sgd_1", "easgd_alpha_0"],
)
def test_one_worker_is_the_inner_optimizer(make):
  inner = optax.sgd(LR, momentum=0.9)
  tx = make(inner)
  params = jax.tree.map(jnp.asarray, _params())
  grads = _grads(seed=7, steps=T)

  def run(tx):
    def body(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    g = jax.tree.map(lambda a: a[:, 0], grads)
    return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), g)[0][0])(params)

  got, want = run(tx), run(inner)
  # One rounding of params + (anchor - params) per round at most.
  bound = _bound(want, grads, mu=0.9)
  harness.assert_within(got, jax.tree.map(np.asarray, want), bound)


# --- The contract (DESIGN §5) and conformance ---------------------------------

SCHEMES = {
  "local_sgd": lambda axis=None: gradcomp.local_sgd(
    optax.sgd(LR, momentum=0.9), 2, axis_name=axis
  ),
  "diloco_topk": lambda axis=None: gradcomp.local_sgd(
    optax.sgd(LR),
    2,
    outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    compressor=gradcomp.topk(0.3, axis_name=axis),
    axis_name=axis,
  ),
  "easgd": lambda axis=None: gradcomp.easgd(
    optax.sgd(LR), 0.1, every=2, axis_name=axis
  ),
  "cdsgd": lambda axis=None: gradcomp.cdsgd(
    optax.sgd(LR),
    gradcomp.threshold_quantize(0.1, axis_name=axis),
    local_learning_rate=LR,
    warmup_steps=2,
    axis_name=axis,
  ),
  "dpsgd": lambda axis=None: gradcomp.gossip(optax.sgd(LR), "ring", axis_name=axis),
  "choco_topk": lambda axis=None: gradcomp.gossip(
    optax.sgd(LR),
    "ring",
    compressor=gradcomp.topk(0.3),
    gamma=0.5,
    axis_name=axis,
  ),
  "gosgd": lambda axis=None: gradcomp.gosgd(optax.sgd(LR), 0.5, axis_name=axis),
  "async_ps_dc_topk": lambda axis=None: gradcomp.async_ps(
    optax.sgd(LR, momentum=0.9),
    speeds=(1.0,),
    delay_compensation=0.1,
    compressor=gradcomp.topk(0.3),
    axis_name=axis,
  ),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_contract_on_mixed_dtypes(name):
  """jit = no jit, abstract init, stable state type, one trace, finite, params required."""
  chex.clear_trace_counter()
  tx = SCHEMES[name]()
  params = harness.grads_like(harness.MIXED_PARAMS, seed=11)
  state = tx.init(params)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  chex.assert_trees_all_equal_shapes_and_dtypes(tx.init(abstract), state)
  with pytest.raises(ValueError, match="params"):
    tx.update(params, state)
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))
  eager_state = state
  for seed in range(3):  # a round on the second step
    grads = harness.grads_like(params, seed)
    updates, new_state = update(grads, state, params)
    eager_updates, eager_state = tx.update(grads, eager_state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    chex.assert_tree_all_finite(updates)
    assert type(new_state) is type(state)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    # XLA may keep a fused half-precision expression in float32 under jit:
    # one rounding of the leaf's dtype apart, relative to the leaf's scale.
    for a, b, p in zip(
      jax.tree.leaves(updates),
      jax.tree.leaves(eager_updates),
      jax.tree.leaves(params),
      strict=True,
    ):
      ulp = float(jnp.finfo(p.dtype).eps)
      scale = max(float(np.max(np.abs(np.asarray(b, np.float64)), initial=0)), 1.0)
      err = np.max(
        np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0
      )
      assert err <= 2 * ulp * scale, (p.dtype, err)
    state = new_state
    params = optax.apply_updates(params, updates)


@pytest.mark.parametrize(
  ("make", "message"),
  [
    (
      lambda: gradcomp.local_sgd(optax.sgd(LR), 0),
      "every must be an integer in \\[1, inf\\), got 0",
    ),
    (lambda: gradcomp.local_sgd(optax.sgd(LR), 2.5), "every"),
    (
      lambda: gradcomp.local_sgd("sgd", 2),
      "inner must be an optax.GradientTransformation",
    ),
    (lambda: gradcomp.local_sgd(optax.sgd(LR), 2, outer=0.7), "outer must be"),
    (
      lambda: gradcomp.local_sgd(optax.sgd(LR), 2, compressor="topk"),
      "compressor must be",
    ),
    (
      lambda: gradcomp.easgd(optax.sgd(LR), -0.1),
      "alpha must be a number in \\[0, 1/workers\\]",
    ),
    (lambda: gradcomp.easgd(optax.sgd(LR), 1.5), "alpha"),
    (lambda: gradcomp.easgd(optax.sgd(LR), 0.1, every=0), "every"),
  ],
)
def test_bad_hyper_parameters_name_the_argument(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_easgd_alpha_above_one_over_n_is_an_error_on_8_workers():
  tx = gradcomp.easgd(optax.sgd(LR), 0.2, axis_name=harness.AXIS)
  with pytest.raises(ValueError, match=r"\[0, 0.125\] on 8 workers"):
    _run(tx, _params(), _grads(steps=2))


def test_shard_map_without_jit_matches_jit():
  tx = SCHEMES["diloco_topk"](harness.AXIS)
  params, grads = _params(), _grads(seed=8, steps=3)
  sharded = harness.shard(grads, jax.sharding.PartitionSpec(None, harness.AXIS))
  params = jax.tree.map(jnp.asarray, params)
  jitted = harness.scheme_steps(tx)(params, sharded)
  eager = harness.scheme_steps(tx, jit=False)(params, sharded)
  chex.assert_trees_all_close(jitted, eager, rtol=1e-6, atol=1e-6)


def test_compressed_round_sends_the_compressors_payload():
  """Wire bytes from the compiled HLO (DESIGN §4): a local SGD step with
  top-k 1 % pseudo-gradients sends exactly what top-k's own synchronous step
  sends (its all-gathered values and int32 indices, in the round's
  conditional), and at most 0.05 of the dense round."""
  params = {"w": jnp.zeros((100, 100)), "b": jnp.zeros(100)}
  grads = jax.tree.map(lambda p: jnp.zeros((1, harness.WORKERS, *p.shape)), params)
  sharded = harness.shard(grads, jax.sharding.PartitionSpec(None, harness.AXIS))

  def scheme_bytes(compressor):
    tx = gradcomp.local_sgd(
      optax.sgd(LR), 4, compressor=compressor, axis_name=harness.AXIS
    )
    return gradcomp.wire_bytes(harness.scheme_steps(tx), params, sharded)

  topk = gradcomp.topk(0.01, axis_name=harness.AXIS)
  sync = harness.sharded_update(topk)
  own = gradcomp.wire_bytes(
    sync,
    harness.shard(jax.tree.map(lambda g: g[0], grads)),
    harness.worker_state(topk, params),
  )
  compressed, dense = scheme_bytes(topk), scheme_bytes(None)
  assert compressed == own > 0
  assert dense == 4 * (100 * 100 + 100)
  assert compressed <= 0.05 * dense
