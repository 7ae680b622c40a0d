"""Decentralized SGD (survey 004 §2.3): D-PSGD and CHOCO-SGD against NumPy, and their invariants.

Runs on 8 workers for a few steps (one compile per case, a ``scan``) on
given per-worker gradients. References are float64 NumPy replays with the
mixing matrix written out by hand (ring: 1/3 on i-1, i, i+1). Error bound as
in ``test_schemes.py``: per step at most ``(deg + 4) u M`` of the largest
magnitude ``M`` (a weighted sum of ``deg + 1`` terms and a few adds),
``T`` steps adding up.
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
T = 6
LR = 0.1
SHAPES = {"kernel": (6, 5), "bias": (5,)}
U = float(jnp.finfo(jnp.float32).eps) / 2


def _grads(seed=0, steps=T):
  return harness.scheme_grads(SHAPES, steps, seed)


def _params(seed=1):
  return harness.scheme_params(SHAPES, seed)


_run = harness.run_scheme


def _ring_matrix():
  w = np.zeros((N, N))
  for i in range(N):
    for j in (i - 1, i, i + 1):
      w[i, j % N] += 1 / 3
  return w


def _bound(reference, steps=T, degree=2):
  magnitude = max(max(np.abs(v).max() for v in reference.values()), 1.0)
  return steps * (degree + 5) * U * magnitude


def dpsgd_reference(params, grads, w):
  """Lian et al. 2017 Alg. 1: x <- W x - lr g(x) (the gradient given)."""
  out = {}
  for k, p in params.items():
    x = np.repeat(np.float64(p)[None], N, 0)
    for t in range(T):
      x = np.einsum("ij,j...->i...", w, x) - LR * grads[k][t]
    out[k] = x
  return out


def test_dpsgd_ring_matches_numpy():
  tx = gradcomp.gossip(optax.sgd(LR), "ring", axis_name=harness.AXIS)
  params, grads = _params(), _grads()
  got, _ = _run(tx, params, grads)
  want = dpsgd_reference(params, grads, _ring_matrix())
  harness.assert_within(got, want, _bound(want))


@pytest.mark.parametrize(
  "topology", ["ring", "torus", "exponential", "one_peer_exponential", "complete"]
)
def test_doubly_stochastic_mixing_keeps_the_average(topology):
  """The workers' mean moves by the mean update alone: x̄_{t+1} = x̄_t - lr ḡ_t."""
  tx = gradcomp.gossip(optax.sgd(LR), topology, axis_name=harness.AXIS)
  params, grads = _params(), _grads(seed=2)
  got, _ = _run(tx, params, grads)
  for k, p in params.items():
    want = np.float64(p) - LR * grads[k].astype(np.float64).mean(1).sum(0)
    err = np.max(np.abs(got[k].astype(np.float64).mean(0) - want))
    assert err <= _bound({k: want}, degree=N), (topology, k, err)


def test_complete_with_equal_updates_is_synchronous_sgd():
  tx = gradcomp.gossip(optax.sgd(LR, momentum=0.9), "complete", axis_name=harness.AXIS)
  params = _params()
  same = {k: np.repeat(v[:, :1], N, 1) for k, v in _grads(seed=3).items()}
  got, _ = _run(tx, params, same)
  sgd = optax.sgd(LR, momentum=0.9)
  p, s = jax.tree.map(jnp.asarray, params), sgd.init(params)
  for t in range(T):
    u, s = sgd.update({k: v[t, 0] for k, v in same.items()}, s, p)
    p = optax.apply_updates(p, u)
  for k in params:
    np.testing.assert_allclose(
      got[k], np.repeat(np.asarray(p[k])[None], N, 0), atol=_bound(params) * 10, rtol=0
    )


def test_one_peer_exponential_averages_exactly_in_log2_n_steps():
  """Ying et al. 2021: with n = 8, three one-peer steps give the exact mean.
  Workers start apart (their first gradients differ), then receive none."""
  tx = gradcomp.gossip(optax.sgd(1.0), "one_peer_exponential", axis_name=harness.AXIS)
  params, grads = _params(), _grads(seed=4, steps=4)
  for k in grads:
    grads[k][1:] = 0.0
  got, _ = _run(tx, params, grads)
  for k in params:
    spread = got[k] - got[k].mean(0)
    # Step 1 mixes equal params (x_0 replicated); steps 2-4 are the three phases.
    assert np.max(np.abs(spread)) <= 8 * U * np.max(np.abs(got[k])) * 3, k


# --- CHOCO-SGD -------------------------------------------------------------------


def _topk_np(x, k):
  flat = x.reshape(-1)
  keep = np.argsort(-np.abs(flat), kind="stable")[:k]
  out = np.zeros_like(flat)
  out[keep] = flat[keep]
  return out.reshape(x.shape)


def choco_reference(params, grads, w, gamma, ratio, steps=T):
  """Koloskova et al. 2019 Alg. 2 with top-k Q, in float64 NumPy."""
  out, pub = {}, {}
  for key, p in params.items():
    x = np.repeat(np.float64(p)[None], N, 0)
    hat = np.zeros_like(x)
    size = x[0].size
    k = max(1, int(np.floor(ratio * size)))
    for t in range(steps):
      half = x - LR * grads[key][t]
      q = np.stack([_topk_np(half[i] - hat[i], k) for i in range(N)])
      hat = hat + q
      x = half + gamma * (np.einsum("ij,j...->i...", w, hat) - hat)
    out[key], pub[key] = x, hat
  return out, pub


def test_choco_topk_matches_numpy():
  gamma, ratio = 0.4, 0.3
  tx = gradcomp.gossip(
    optax.sgd(LR),
    "ring",
    compressor=gradcomp.topk(ratio),
    gamma=gamma,
    axis_name=harness.AXIS,
  )
  params, grads = _params(), _grads(seed=5)
  got, state = _run(tx, params, grads)
  want, public = choco_reference(params, grads, _ring_matrix(), gamma, ratio)
  harness.assert_within(got, want, _bound(want) * 4)
  harness.assert_within(state.public, public, _bound(public) * 4)
  # s_i = sum_j W_ij x̂_j is kept incrementally: it matches the public copies.
  w = _ring_matrix()
  for k in params:
    np.testing.assert_allclose(
      state.neighbourhood[k],
      np.einsum("ij,j...->i...", w, public[k]),
      atol=_bound(public) * 4,
      rtol=0,
    )


@pytest.mark.parametrize(
  ("compressor", "gamma", "steps"),
  [(lambda: gradcomp.topk(0.2), 0.2, 120), (lambda: gradcomp.ef_signsgd(), 0.1, 400)],
  ids=["topk", "scaled_sign"],
)
def test_choco_reaches_consensus_and_keeps_the_average(compressor, gamma, steps):
  """Workers start apart (one step of different gradients), then gossip only:
  the average never moves (doubly stochastic), the spread falls below 1e-3 of
  its start (Koloskova et al. 2019, Thm. 2: a linear rate, about gamma delta
  rho per step: ~0.03 for the scaled sign, delta ~ 2/pi, hence 400 steps)."""
  tx = gradcomp.gossip(
    optax.sgd(LR),
    "exponential",
    compressor=compressor(),
    gamma=gamma,
    axis_name=harness.AXIS,
  )
  params, grads = _params(), _grads(seed=6, steps=steps)
  for k in grads:
    grads[k][1:] = 0.0
  got, _ = _run(tx, params, grads)
  for k, p in params.items():
    start = np.float64(p)[None] - LR * grads[k][0]
    spread0 = np.linalg.norm(start - start.mean(0))
    spread = np.linalg.norm(got[k] - got[k].mean(0))
    assert spread <= 1e-3 * spread0, (k, spread, spread0)
    err = np.max(np.abs(got[k].mean(0) - start.mean(0)))
    assert err <= _bound({k: start}, steps=steps, degree=4), (k, err)


def test_without_public_copies_compressed_gossip_stalls():
  """The scheme CHOCO fixes (Carli et al. 2007's Q2 gossip on top-k params):
  what top-k drops is never exchanged, so the spread plateaus far above
  CHOCO's (same codec, topology, gamma and steps as the CHOCO case above)."""
  steps = 120
  tx = gradcomp.gossip(
    optax.sgd(LR),
    "exponential",
    compressor=gradcomp.topk(0.2),
    gamma=0.2,
    public_copies=False,
    axis_name=harness.AXIS,
  )
  params, grads = _params(), _grads(seed=6, steps=steps)
  for k in grads:
    grads[k][1:] = 0.0
  got, _ = _run(tx, params, grads)
  start = np.float64(params["kernel"])[None] - LR * grads["kernel"][0]
  spread0 = np.linalg.norm(start - start.mean(0))
  spread = np.linalg.norm(got["kernel"] - got["kernel"].mean(0))
  assert spread >= 0.05 * spread0, (spread, spread0)


def test_choco_payload_on_collective_permute_is_the_codecs():
  """From the compiled HLO: CHOCO with top-k 1 % puts (values, int32 indices)
  on the collective-permutes, at most 0.05 of dense D-PSGD's bytes."""
  params = {"w": jnp.zeros((100, 100)), "b": jnp.zeros(100)}
  grads = jax.tree.map(lambda p: jnp.zeros((1, N, *p.shape)), params)
  sharded = harness.shard(grads, jax.sharding.PartitionSpec(None, harness.AXIS))

  def permute_bytes(**kw):
    tx = gradcomp.gossip(optax.sgd(LR), "ring", axis_name=harness.AXIS, **kw)
    f = harness.scheme_steps(tx)
    text = f.lower(params, sharded).compile().as_text()
    return wire.collective_bytes(text)

  dense = permute_bytes()
  choco = permute_bytes(compressor=gradcomp.topk(0.01), gamma=0.5)
  assert dense["collective-permute"] == 2 * 4 * (100 * 100 + 100)  # two edges
  k_w, k_b = 100, 1
  assert choco["collective-permute"] == 2 * 8 * (k_w + k_b)
  assert choco["collective-permute"] <= 0.05 * dense["collective-permute"]
  assert choco["all-gather"] == choco["all-reduce"] == 0


def test_dpsgd_exchange_does_not_wait_for_the_gradient():
  """D-PSGD mixes the params the gradient was taken at: no ppermute operand
  depends on ``grads`` (the CD-SGD issue's structural test); CHOCO's does
  (it sends the compressed move, which includes this step's update)."""

  def found(**kw):
    tx = gradcomp.gossip(optax.sgd(LR), "ring", axis_name=harness.AXIS, **kw)
    one = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    params = harness.shard({k: jnp.zeros((N, *s)) for k, s in SHAPES.items()})
    state = harness.worker_state(tx, one)
    spec = jax.sharding.PartitionSpec(harness.AXIS)

    def update(g, s, p):
      return gradcomp.add_worker_axis(tx.update(*gradcomp.drop_worker_axis((g, s, p))))

    f = jax.shard_map(update, mesh=harness.mesh(), in_specs=spec, out_specs=spec)
    return traced.collectives_depending_on(f, (params, state, params), argnums=0)

  dense = found()
  assert dense and all(name == "ppermute" and not d for name, d in dense), dense
  choco = found(compressor=gradcomp.topk(0.3), gamma=0.5)
  assert any(d for name, d in choco if name == "ppermute"), choco


@pytest.mark.parametrize(
  ("make", "message"),
  [
    (
      lambda: gradcomp.gossip(optax.sgd(LR), "ring", compressor=gradcomp.topk(0.1)),
      "gamma must be in",
    ),
    (lambda: gradcomp.gossip(optax.sgd(LR), "ring", gamma=0.5), "needs a compressor"),
    (lambda: gradcomp.gossip(optax.sgd(LR), "star"), "star"),
    (lambda: gradcomp.gossip(optax.sgd(LR), 3), "topology must be"),
  ],
)
def test_bad_hyper_parameters_name_the_argument(make, message):
  with pytest.raises(ValueError, match=message):
    make()


@pytest.mark.parametrize(
  ("compressor", "topology", "message"),
  [
    (lambda: gradcomp.powersgd(2), "ring", "global|all workers"),
    (lambda: gradcomp.randomk(0.1), "ring", "global|all workers"),
    (lambda: gradcomp.topk(0.1), "one_peer_exponential", "static topology"),
  ],
)
def test_choco_refuses_what_it_cannot_do(compressor, topology, message):
  tx = gradcomp.gossip(
    optax.sgd(LR), topology, compressor=compressor(), gamma=0.5, axis_name=harness.AXIS
  )
  with pytest.raises(ValueError, match=message):
    _run(tx, _params(), _grads(steps=2))
