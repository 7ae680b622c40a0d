"""CD-SGD (paper 001): a NumPy replay of Algorithm 1, the reductions, the overlap by construction.

Each case runs on 8 workers for ``T`` steps (one compile, a ``scan``) on given
per-worker gradients and is compared with a float32 NumPy replay of Alg. 1
written in the paper's own order (iteration ``i`` pushes ``g_i`` and updates
``W`` within the iteration; the scheme exchanges it one step later, so the
replay checks the pipelining too). The replay quantizes in float32 with the
same operations, so the 2-bit codes agree exactly; what differs is the order
of the 8-term mean and the rounding of ``params + (local - params)``: per
step at most ``(n + 4) u M`` (Higham §4.2) of the largest magnitude ``M``,
carried forward with gain ``1 / (1 - mu)`` by momentum, summed over ``T``
steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomp
from gradcomp.parallel import traced, wire

import harness

pytestmark = pytest.mark.xdist_group("schemes")

N = harness.WORKERS
T = 8
LR_G, LR_L = 0.1, 0.3
THRESHOLD = 0.5
SHAPES = {"kernel": (6, 5), "bias": (5,)}
U = float(jnp.finfo(jnp.float32).eps) / 2
ONE = {k: jnp.zeros(s) for k, s in SHAPES.items()}


def _grads(seed=0, steps=T):
  return harness.scheme_grads(SHAPES, steps, seed)


def _params(seed=1):
  return harness.scheme_params(SHAPES, seed)


_run = harness.run_scheme


def _bound(reference, grads, mu=0.0):
  magnitude = max(
    max(np.abs(v).max() for v in jax.tree.leaves(reference)),
    max(LR_G, LR_L) * max(np.abs(g).max() for g in jax.tree.leaves(grads)) / (1 - mu),
    1.0,
  )
  return T * (N + 4) * U * magnitude / (1 - mu)


def cdsgd_reference(
  params, grads, *, k, warmup, threshold=None, mu=0.0, flush=False, steps=T
):
  """Paper 001 Alg. 1 for ``N`` workers, iteration by iteration (float32).

  Returns every worker's local weights after ``steps`` iterations and the
  global weights after ``steps - 1`` (the scheme's ``W`` holds the messages
  of the steps before the last: the last one's is still on the wire).
  """
  out_local, out_global = {}, {}
  for key, w0 in params.items():
    w = np.float32(w0)
    local = np.repeat(w[None], N, 0)
    residual = np.zeros_like(local)
    trace = np.zeros_like(w)
    history = [w]

    def server(mean):  # optax.sgd(LR_G, momentum=mu) on W
      nonlocal w, trace
      trace = mean + np.float32(mu) * trace
      w = w - np.float32(LR_G) * trace

    for i in range(1, steps + 1):
      g = grads[key][i - 1]
      if i <= warmup - 1:  # lines 2-10: synchronous, at the global weights
        server(g.mean(0))
        local = np.repeat(w[None], N, 0)
      else:
        local = w[None] - np.float32(LR_L) * g  # line 22 / line 6, eq. 11
        if threshold is None or (i - warmup) % k == 0:  # lines 28-29
          message = g + residual if flush else g
          if flush:
            residual = np.zeros_like(residual)
        else:  # lines 24-26: 2-bit codes, residual kept on the worker
          e = residual + g
          q = np.float32(threshold) * (
            (e >= threshold).astype(np.float32) - (e <= -threshold).astype(np.float32)
          )
          residual, message = e - q, q
        server(message.mean(0))  # eq. 10
      history.append(w)
    out_local[key], out_global[key] = local, history[steps - 1]
  return out_local, out_global


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


CASES = {
  "dense_k1_warmup3": dict(k=1, warmup=3, threshold=None),
  "bit_k2_warmup3_momentum": dict(k=2, warmup=3, threshold=THRESHOLD, mu=0.9),
  "bit_k3_no_warmup": dict(k=3, warmup=0, threshold=THRESHOLD),
  "bit_k2_warmup1_flush": dict(k=2, warmup=1, threshold=THRESHOLD, flush=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_algorithm_1(case):
  c = CASES[case]
  compressor = (
    None
    if c["threshold"] is None
    else gradcomp.threshold_quantize(c["threshold"], axis_name=harness.AXIS)
  )
  tx = gradcomp.cdsgd(
    optax.sgd(LR_G, momentum=c.get("mu") or None),
    compressor,
    local_learning_rate=LR_L,
    k=c["k"],
    warmup_steps=c["warmup"],
    flush_residual=c.get("flush", False),
    axis_name=harness.AXIS,
  )
  params, grads = _params(), _grads(seed=len(case))
  local, state = _run(tx, params, grads)
  want_local, want_global = cdsgd_reference(params, grads, **c)
  bound = _bound(want_local, grads, c.get("mu", 0.0))
  harness.assert_within(local, want_local, bound)
  harness.assert_within(
    jax.tree.map(lambda x: x[0], state.global_params), want_global, bound
  )
  harness.assert_same_on_workers(state.global_params)
  assert int(state.count[0]) == T


def test_message_scale_is_the_threshold_in_batch_summed_units():
  """MXNet's pushes are batch sums: scaling the message by s (a power of two)
  with threshold s t is the same arithmetic as threshold t on means."""
  params, grads = _params(), _grads(seed=3)

  def run(threshold, scale):
    tx = gradcomp.cdsgd(
      optax.sgd(LR_G),
      gradcomp.threshold_quantize(threshold, axis_name=harness.AXIS),
      local_learning_rate=LR_L,
      k=4,
      warmup_steps=2,
      message_scale=scale,
      axis_name=harness.AXIS,
    )
    return _run(tx, params, grads)[0]

  _equal(run(THRESHOLD * 32, 32.0), run(THRESHOLD, 1.0))


# --- Reductions ----------------------------------------------------------------


def _quadratic_run(tx, steps=12):
  """One worker on ``0.5 |A x - b|^2``: gradients taken at the params."""
  a = jnp.asarray(np.random.default_rng(5).standard_normal((4, 4)), jnp.float32)
  b = jnp.arange(4.0)
  grad = jax.grad(lambda x: 0.5 * jnp.sum((a @ x - b) ** 2))

  def body(carry, _):
    x, s = carry
    u, s = tx.update(grad(x), s, x)
    return (optax.apply_updates(x, u), s), x

  x0 = jnp.ones(4)
  return jax.jit(lambda: jax.lax.scan(body, (x0, tx.init(x0)), None, steps)[1])()


@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("compressor", [None, "k1"])
def test_one_worker_equal_rates_no_compression_is_sgd(warmup, compressor):
  c = None if compressor is None else gradcomp.threshold_quantize(0.01)
  tx = gradcomp.cdsgd(
    optax.sgd(0.05), c, local_learning_rate=0.05, k=1, warmup_steps=warmup
  )
  got, want = _quadratic_run(tx), _quadratic_run(optax.sgd(0.05))
  # Per step one rounding of W - lr g and of x + (local - x): 4 u |x|.
  bound = 12 * 4 * U * max(float(jnp.max(jnp.abs(want))), 1.0)
  np.testing.assert_allclose(got, want, rtol=0, atol=bound)


def test_k1_never_compresses_od_sgd():
  params, grads = _params(), _grads(seed=4)
  make = lambda c: gradcomp.cdsgd(
    optax.sgd(LR_G), c, local_learning_rate=LR_L, k=1, warmup_steps=2,
    axis_name=harness.AXIS,
  )  # fmt: skip
  quantized = _run(
    make(gradcomp.threshold_quantize(0.01, axis_name=harness.AXIS)), params, grads
  )
  dense = _run(make(None), params, grads)
  _equal(quantized[0], dense[0])
  # The residual never moved: no message went through the compressor.
  assert all(
    np.all(r == 0) for r in jax.tree.leaves(quantized[1].compressor_state.leaves)
  )


def bit_sgd_reference(params, grads, threshold):
  """BIT-SGD (paper 001 §2.3, eq. 5): 2-bit codes with residual, then SGD on the mean."""
  out = {}
  for key, w in params.items():
    w, residual = np.float32(w), np.zeros((N, *w.shape), np.float32)
    for t in range(T):
      e = residual + grads[key][t]
      q = np.float32(threshold) * (
        (e >= threshold).astype(np.float32) - (e <= -threshold).astype(np.float32)
      )
      residual = e - q
      w = w - np.float32(LR_G) * q.mean(0)
    out[key] = w
  return out


def test_bit_sgd_is_threshold_quantize_then_sgd():
  params, grads = _params(), _grads(seed=6)
  tx = optax.chain(
    gradcomp.threshold_quantize(THRESHOLD, axis_name=harness.AXIS), optax.sgd(LR_G)
  )
  updates, _ = harness.sharded_steps(tx)(
    harness.shard(grads, jax.sharding.PartitionSpec(None, harness.AXIS)),
    harness.worker_state(tx, params),
  )
  got = {k: params[k] + np.cumsum(np.asarray(updates[k]), 0)[-1] for k in params}
  want = bit_sgd_reference(params, grads, THRESHOLD)
  harness.assert_within(got, want, _bound(want, grads))


# --- The overlap, by construction (DESIGN §5) ---------------------------------


def _collectives(warmup_steps, k=3):
  tx = gradcomp.cdsgd(
    optax.sgd(LR_G),
    gradcomp.threshold_quantize(0.1, axis_name=harness.AXIS),
    local_learning_rate=LR_L,
    k=k,
    warmup_steps=warmup_steps,
    axis_name=harness.AXIS,
  )
  params = harness.shard({k: jnp.zeros((N, *s)) for k, s in SHAPES.items()})
  state = harness.worker_state(tx, ONE)

  def update(grads, state, params):
    one = gradcomp.drop_worker_axis((grads, state, params))
    return gradcomp.add_worker_axis(tx.update(*one))

  f = jax.shard_map(
    update,
    mesh=harness.mesh(),
    in_specs=jax.sharding.PartitionSpec(harness.AXIS),
    out_specs=jax.sharding.PartitionSpec(harness.AXIS),
  )
  return (
    traced.collectives_depending_on(f, (params, state, params), argnums=0),
    f,
    (params, state, params),
  )


def test_no_collective_operand_depends_on_the_steps_gradient():
  """After warm-up the collective carries last step's message (paper 001
  §3.1): nothing on the wire waits for this step's backward pass. With
  ``warmup_steps=0`` the program has no synchronous branch at all."""
  found, _, _ = _collectives(warmup_steps=0)
  kinds = {name for name, _ in found}
  assert {"psum_invariant", "all_gather_invariant"} <= kinds, found
  assert not any(depends for _, depends in found), found


def test_warmup_branch_is_found_synchronous():
  """The walk can fail: the warm-up's all-reduce of ``grads`` is tainted."""
  found, _, _ = _collectives(warmup_steps=5)
  assert any(depends for _, depends in found), found
  assert any(not depends for _, depends in found), found


def test_compressed_steps_send_the_2_bit_payload():
  """Wire bytes from the compiled HLO: the compressed exchange is the
  threshold quantizer's own all-gather of 2-bit codes, the correction the
  dense fp32 all-reduce."""
  _, f, args = _collectives(warmup_steps=0)
  got = wire.collective_bytes(jax.jit(f).lower(*args).compile().as_text())
  tq = gradcomp.threshold_quantize(0.1, axis_name=harness.AXIS)
  grads = args[0]
  own = wire.collective_bytes(
    harness.sharded_update(tq)
    .lower(grads, harness.worker_state(tq, ONE))
    .compile()
    .as_text()
  )
  values = sum(int(np.prod(s)) for s in SHAPES.values())
  assert got["all-gather"] == own["all-gather"] > 0
  assert own["all-gather"] <= sum(-(-int(np.prod(s)) // 4) + 4 for s in SHAPES.values())
  assert got["all-reduce"] == 4 * values


# --- Bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    (dict(k=0), r"k must be an integer in \[1, inf\), got 0"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(local_learning_rate=0.0), "local_learning_rate"),
    (dict(message_scale=-1.0), "message_scale"),
    (dict(flush_residual="yes"), "flush_residual"),
  ],
)
def test_bad_hyper_parameters_name_the_argument(kwargs, message):
  args = dict(local_learning_rate=0.1, k=2, warmup_steps=0) | kwargs
  with pytest.raises(ValueError, match=message):
    gradcomp.cdsgd(optax.sgd(0.1), gradcomp.threshold_quantize(0.5), **args)


def test_flush_needs_a_residual_and_update_needs_params():
  params = {"w": jnp.ones(3)}
  tx = gradcomp.cdsgd(
    optax.sgd(0.1), gradcomp.signsgd(), local_learning_rate=0.1, k=1,
    warmup_steps=0, flush_residual=True,
  )  # fmt: skip
  with pytest.raises(ValueError, match="error feedback"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match="params"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match="global_optimizer"):
    gradcomp.cdsgd("sgd", None, local_learning_rate=0.1, warmup_steps=0)


# --- Convergence (paper 001 §3.4, Theorem 2) --------------------------------------


def test_averaged_global_iterate_converges_as_one_over_sqrt_k():
  """Theorem 2's corollary: with eta_l = eta_g = c / sqrt(K), the
  suboptimality of the averaged global weights is O(1 / sqrt(K)). On a convex
  quadratic whose curvatures span 1e-3..1 (nearly the non-strongly convex
  case the bound is about) with gradient noise and the 2-bit quantizer, 8
  seeds: ``sqrt(K) * gap`` must not grow from K = 100 to 6400 (a fixed step
  would plateau, and the product would grow 8x), and the gap must fall."""
  d = 16
  curv = jnp.asarray(np.logspace(-3, 0, d), jnp.float32)
  optimum = jnp.asarray(np.random.default_rng(0).standard_normal(d), jnp.float32)

  def gap(steps, seed):
    eta = 0.5 / np.sqrt(steps)
    tx = gradcomp.cdsgd(
      optax.sgd(eta),
      gradcomp.threshold_quantize(0.05),
      local_learning_rate=eta,
      k=2,
      warmup_steps=0,
    )

    def body(carry, key):
      x, s, total = carry
      g = curv * (x - optimum) + 0.5 * jax.random.normal(key, (d,))
      u, s = tx.update(g, s, x)
      return (optax.apply_updates(x, u), s, total + s.global_params), None

    x0 = jnp.zeros(d)
    keys = jax.random.split(jax.random.PRNGKey(seed), steps)
    (_, _, total), _ = jax.lax.scan(body, (x0, tx.init(x0), jnp.zeros(d)), keys)
    average = total / steps
    return 0.5 * jnp.sum(curv * (average - optimum) ** 2)

  scaled = {
    steps: float(jnp.mean(jax.jit(jax.vmap(lambda s: gap(steps, s)))(jnp.arange(8))))
    * np.sqrt(steps)
    for steps in (100, 6400)
  }
  assert scaled[6400] <= scaled[100], scaled
  assert scaled[6400] / np.sqrt(6400) < scaled[100] / np.sqrt(100) / 4, scaled
