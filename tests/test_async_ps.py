"""The simulated asynchronous parameter server against an event-driven NumPy server.

Survey 004 §2.1-2.3; DC-ASGD (Zheng et al. 2017). The reference below is
written from the algorithm's description, not from the scheme: a heap of
(finishing time, worker) events in float64 absolute time, a server that
applies each push as it pops, a bounded-delay gate on the pull. The schedule
(who pushes when, the staleness of every push) must agree exactly; params to
float32 rounding.
"""

from __future__ import annotations

import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel import wire
from gradcomp.schemes.async_ps import STALENESS_BINS, speed_table, task_durations

import harness

N = harness.WORKERS
D = 6
LR, MOMENTUM = 0.05, 0.5
EPS32 = float(np.finfo(np.float32).eps)


def _run(tx, x0, targets, noise):
  """Each worker's params and the state after ``T`` steps of ``g = x - c_w + e_t``.

  The gradient is taken at the worker's own params (the copy it pulled), so
  staleness changes the trajectory.
  """

  def steps(x0, targets, noise):
    c, e = targets[0], noise[:, 0]
    state = tx.init({"x": x0})

    def body(carry, e_t):
      params, state = carry
      grads = {"x": params["x"] - c + e_t}
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    carry, _ = body(({"x": x0}, state), e[0])
    (params, state), _ = jax.lax.scan(body, carry, e[1:])
    return gradcomp.add_worker_axis((params["x"], state))

  f = jax.shard_map(
    steps,
    mesh=harness.mesh(),
    in_specs=(P(), P(harness.AXIS), P(None, harness.AXIS)),
    out_specs=P(harness.AXIS),
  )
  out = jax.jit(f)(
    jnp.asarray(x0), harness.shard(targets), harness.shard(noise, P(None, harness.AXIS))
  )
  return jax.tree.map(np.asarray, out)


def _topk_ref(acc, ratio):
  k = max(1, math.floor(ratio * acc.size))
  keep = np.argsort(-np.abs(acc), kind="stable")[:k]
  sent = np.zeros_like(acc)
  sent[keep] = acc[keep]
  return sent


def reference(x0, targets, noise, speeds, *, bound=None, lam=0.0, jitter=0.0,
              topk=None):  # fmt: skip
  """The event-driven server: float64, SGD with momentum, one push at a time."""
  table = speed_table(speeds)
  key = jax.random.PRNGKey(0)
  steps = noise.shape[0]

  def durations(step):
    return np.asarray(task_durations(key, step, table, jitter), np.float64)

  server = np.float64(x0).copy()
  velocity = np.zeros_like(server)
  params = [server.copy() for _ in range(N)]
  backup = [server.copy() for _ in range(N)]
  residual = [np.zeros_like(server) for _ in range(N)]
  version, pulled, pushes = 0, [0] * N, [0] * N
  staleness = np.zeros(STALENESS_BINS, np.int64)
  d0 = durations(0)
  events = [(d0[w], w) for w in range(N) if np.isfinite(d0[w])]
  heapq.heapify(events)
  waiting = set()
  while events and events[0][0] <= steps:
    time, w = heapq.heappop(events)
    step = max(1, math.ceil(time))  # the step (t - 1, t] the push falls in
    g = params[w] - targets[w] + noise[step - 1, w]
    if topk is not None:
      acc = g + residual[w]
      g = _topk_ref(acc, topk)
      residual[w] = acc - g
    if lam > 0:
      g = g + lam * g * g * (server - backup[w])
    staleness[min(version - pulled[w], STALENESS_BINS - 1)] += 1
    velocity = MOMENTUM * velocity + g
    server = server - LR * velocity
    version += 1
    pushes[w] += 1
    waiting.add(w)
    for v in sorted(waiting):
      if bound is None or pushes[v] - min(pushes) <= bound:
        waiting.discard(v)
        pulled[v] = version
        params[v] = server.copy()
        backup[v] = server.copy()
        done = time + durations(step)[v]
        if np.isfinite(done):
          heapq.heappush(events, (done, v))
  return np.stack(params), staleness, np.array(pushes)


def _problem(steps, seed=0):
  rng = np.random.default_rng(seed)
  x0 = rng.standard_normal(D).astype(np.float32)
  targets = rng.standard_normal((N, D)).astype(np.float32)
  noise = (0.1 * rng.standard_normal((steps, N, D))).astype(np.float32)
  return x0, targets, noise


HETERO = (1.0, 1.5, 2.0, 3.0, 1.0, 1.5, 2.0, 3.0)  # durations 3, 2, 1.5, 1: exact
ISSUE = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
FAILING = np.array([ISSUE] * 6 + [(1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 4.0, 4.0)])
CASES = {
  "asgd": dict(speeds=HETERO),
  "asgd_equal": dict(speeds=(1.0,) * N),
  "ssp_1": dict(speeds=ISSUE, bound=1),
  "ssp_0": dict(speeds=HETERO, bound=0),
  "ssp_0_equal": dict(speeds=(2.0,) * N, bound=0),
  "dc_asgd": dict(speeds=HETERO, lam=0.5),
  "jitter": dict(speeds=ISSUE, jitter=0.7),
  "failure": dict(speeds=FAILING),
  "topk_pushes": dict(speeds=ISSUE, topk=0.34),
}
T = 24


@pytest.mark.parametrize("case", sorted(CASES))
def test_trajectory_equals_event_driven_reference(case):
  kw = CASES[case]
  x0, targets, noise = _problem(T)
  tx = gradcomp.async_ps(
    optax.sgd(LR, momentum=MOMENTUM),
    speeds=kw["speeds"],
    staleness_bound=kw.get("bound"),
    delay_compensation=kw.get("lam", 0.0),
    jitter=kw.get("jitter", 0.0),
    compressor=None if "topk" not in kw else gradcomp.topk(kw["topk"]),
    axis_name=harness.AXIS,
  )
  got, state = _run(tx, x0, targets, noise)
  want, staleness, pushes = reference(
    x0,
    np.float64(targets),
    np.float64(noise),
    kw["speeds"],
    bound=kw.get("bound"),
    lam=kw.get("lam", 0.0),
    jitter=kw.get("jitter", 0.0),
    topk=kw.get("topk"),
  )
  np.testing.assert_array_equal(state.pushes[0], pushes)
  np.testing.assert_array_equal(state.staleness[0], staleness)
  assert state.version[0] == pushes.sum()
  # Each push adds a float32 rounding of the server (|x| <= scale) and of the
  # velocity; momentum 0.5 sums a velocity's roundings to at most 2x.
  scale = max(1.0, np.abs(want).max(), np.abs(targets).max() + 1.0)
  bound = 8 * EPS32 * scale * (pushes.sum() + T)
  np.testing.assert_allclose(got, want, rtol=0, atol=bound)

  if case == "asgd_equal":  # after round 1 (0 .. n-1 late), every push n - 1 late
    np.testing.assert_array_equal(pushes, [T] * N)
    np.testing.assert_array_equal(staleness[:N], [1] * (N - 1) + [N * (T - 1) + 1])
  if case == "ssp_0_equal":  # rounds at one params; push i of a round is i late
    np.testing.assert_array_equal(pushes, [T] * N)
    np.testing.assert_array_equal(staleness[:N], [T] * N)
  if case.startswith("ssp"):
    assert pushes.max() - pushes.min() <= kw["bound"] + 1
  if case == "asgd":  # pushes in proportion to speed (durations 3, 2, 1.5, 1)
    np.testing.assert_array_equal(pushes[:4], [T // 3, T // 2, T * 2 // 3, T])
  if case == "failure":  # worker 3 stops; the others carry on
    assert pushes[3] < pushes[2] and pushes[0] == T // 4


def _fixed_point_run(speeds, bound, steps, lr):
  """Noise-free quadratics from x = 0: worker w pulls towards its target c_w.

  Targets +1 for the slow workers, 0 for the middle ones, -1 for the fast.
  """
  targets = np.repeat(np.array([1.0] * 4 + [0.0] * 2 + [-1.0] * 2)[:, None], D, 1)
  x0 = np.zeros(D, np.float32)
  noise = np.zeros((steps, N, D), np.float32)
  tx = gradcomp.async_ps(
    optax.sgd(lr), speeds=speeds, staleness_bound=bound, axis_name=harness.AXIS
  )
  _, state = _run(tx, x0, targets.astype(np.float32), noise)
  return state, targets


@pytest.mark.parametrize("bound", [None, 0])
def test_fixed_point_is_the_push_rate_weighted_optimum(bound):
  """ASGD settles where its pushes balance: the push-count-weighted mean.

  The schedule repeats every 4 steps (durations 4, 2, 1). On the limit
  cycle the server returns to itself after a period, so the period's pushes
  sum to zero: sum_p (x_p - c_w(p)) = 0, x_p the params push p's worker
  pulled. Every x_p is within ``drift`` (the period's pushes, <= 22, times
  lr times max |x - c| <= 2: x stays in the targets' hull [-1, 1]) of the
  period's mean x-bar, so x-bar is within ``drift`` of the push-weighted mean
  of the targets, and the server within 2 ``drift``. Without a bound the
  pushes go as the speeds; with bound 0 every worker pushes once a round.
  """
  lr, steps = 0.002, 800  # contraction ~(1 - 22 lr)^200 ~ 1e-4 of the start
  state, targets = _fixed_point_run(ISSUE, bound, steps, lr)
  server = state.server["x"][0]
  speeds = np.asarray(ISSUE)
  weights, other = (speeds, np.ones(N)) if bound is None else (np.ones(N), speeds)
  want = weights @ targets / weights.sum()
  drift = 22 * lr * 2
  settle = 1e-3
  assert np.abs(server - want).max() <= 2 * drift + settle, (server, want)
  # The other weighting's optimum is farther than that: the test tells them apart.
  assert np.abs(want - other @ targets / other.sum()).min() > 2 * (2 * drift + settle)
  if bound == 0:
    np.testing.assert_array_equal(state.pushes[0], [steps // 4] * N)


def test_one_worker_is_the_inner_optimizer():
  inner = optax.sgd(LR, momentum=0.9)
  tx = gradcomp.async_ps(inner, speeds=[3.0], delay_compensation=0.3)
  params = {"x": jnp.asarray(np.linspace(-1, 1, D, dtype=np.float32))}
  grads = jnp.asarray(np.random.default_rng(0).standard_normal((T, D)), jnp.float32)

  def run(tx):
    def body(carry, g):
      p, s = carry
      u, s = tx.update({"x": g}, s, p)
      return (optax.apply_updates(p, u), s), None

    return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), grads)[0][0])(params)

  got, want = run(tx)["x"], run(inner)["x"]
  # One worker is never stale, so DC's term is 0; (x + u) - x rounds once per
  # step, and the rounding carries into the next step's params.
  scale = max(1.0, float(jnp.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=0, atol=2 * T * EPS32 * scale)


def test_compressed_pushes_carry_the_payload():
  """From the compiled HLO: top-k 1 % pushes all-gather (values, int32 indices)."""
  params = {"w": jnp.zeros((100, 100)), "b": jnp.zeros(100)}
  grads = jax.tree.map(lambda p: jnp.zeros((1, N, *p.shape)), params)
  sharded = harness.shard(grads, P(None, harness.AXIS))

  def gathered(**kw):
    tx = gradcomp.async_ps(optax.sgd(LR), speeds=ISSUE, axis_name=harness.AXIS, **kw)
    text = harness.scheme_steps(tx).lower(params, sharded).compile().as_text()
    return wire.collective_bytes(text)

  dense = gathered()
  topk = gathered(compressor=gradcomp.topk(0.01))
  assert dense["all-gather"] == 4 * (100 * 100 + 100)
  assert topk["all-gather"] == 8 * (100 + 1)
  assert topk["all-reduce"] == topk["collective-permute"] == 0


@pytest.mark.parametrize(
  ("kw", "message"),
  [
    (dict(speeds=[]), "speeds"),
    (dict(speeds=[1.0, -1.0]), "speeds must be finite and >= 0"),
    (dict(speeds=[0.0, 0.0]), "at least one > 0"),
    (dict(speeds=[[[1.0]]]), "speeds"),
    (dict(speeds=[1.0], staleness_bound=-1), r"staleness_bound must be an integer"),
    (dict(speeds=[1.0], staleness_bound=1.5), "staleness_bound"),
    (dict(speeds=[1.0], delay_compensation=-0.1), r"delay_compensation .* got -0.1"),
    (dict(speeds=[1.0], jitter=float("inf")), "jitter must be finite"),
    (dict(speeds=[1.0], compressor="topk"), "compressor must be"),
    (dict(speeds=[1.0], compressor=optax.sgd(1.0)), "gradcomp factory"),
  ],
)
def test_bad_hyper_parameters_name_the_argument(kw, message):
  with pytest.raises(ValueError, match=message):
    gradcomp.async_ps(optax.sgd(LR), **kw)


def test_speeds_must_match_the_workers():
  tx = gradcomp.async_ps(optax.sgd(LR), speeds=(1.0,) * 4, axis_name=harness.AXIS)
  x0, targets, noise = _problem(2)
  with pytest.raises(ValueError, match="speeds has 4 workers, but axis 'data' has 8"):
    _run(tx, x0, targets, noise)


def test_global_codecs_are_refused_for_pushes():
  tx = gradcomp.async_ps(
    optax.sgd(LR), speeds=ISSUE, compressor=gradcomp.powersgd(2),
    axis_name=harness.AXIS,
  )  # fmt: skip
  x0, targets, noise = _problem(2)
  with pytest.raises(ValueError, match="a parameter server's pushes cannot provide"):
    _run(tx, x0, targets, noise)


@pytest.mark.parametrize("staleness", [0, 3])
def test_stale_sgd_takes_every_gradient_s_steps_late(staleness):
  """Survey Fig. 2's setting against NumPy: W_{t+1} = W_t - lr v(mean g(W_{t-s}))."""
  x0, targets, noise = _problem(T)
  tx = gradcomp.stale_sgd(
    optax.sgd(LR, momentum=MOMENTUM), staleness, axis_name=harness.AXIS
  )
  got, state = _run(tx, x0, targets, noise)
  versions = [np.float64(x0)]
  velocity = np.zeros(D)
  for t in range(T):
    at = versions[max(t - staleness, 0)]
    g = np.mean(at - np.float64(targets) + np.float64(noise[t]), axis=0)
    velocity = MOMENTUM * velocity + g
    versions.append(versions[-1] - LR * velocity)
  want = versions[max(T - staleness, 0)]
  bound = 16 * EPS32 * T * max(1.0, np.abs(versions).max() + np.abs(targets).max())
  for w in range(N):
    np.testing.assert_allclose(got[w], want, rtol=0, atol=bound)
  np.testing.assert_allclose(state.server["x"][0], versions[-1], rtol=0, atol=bound)


def test_stale_sgd_rejects_a_negative_staleness():
  with pytest.raises(
    ValueError, match=r"staleness must be an integer in \[0, inf\), got -1"
  ):
    gradcomp.stale_sgd(optax.sgd(LR), -1)
