"""GoSGD (paper 002 §2.1; Blot et al. 2016): a NumPy replay, conservation, reductions, wire.

Each case runs on 8 workers for ``T`` steps (one compile, a ``scan``) on given
per-worker gradients. The NumPy replay re-derives each step's pushes and
shift with the same ``jax.random`` calls from the shared key and applies the
paper's merge ``x_r = (a_r x_r + a_s x_s) / (a_r + a_s)`` in float64.

Weights are sums of powers of two of 1 (halving is exact, and so is adding
such fractions while they span fewer than 24 binary orders, which ``T = 8``
steps cannot exceed): they must match exactly. Params: a step's float32
arithmetic (the local step's add, the merge's difference, product and add,
and ``params + (merged - params)``) errs by at most a few ``u`` of the
largest magnitude ``M`` it touches; the merge is a convex combination, so
earlier errors are carried with gain at most 1 (``1 / (1 - mu)`` through
momentum); over ``T`` steps the project's ``T (n + 4) u M / (1 - mu)``
covers it.
"""

import doctest

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel import wire
from gradcomp.schemes import gosgd as gosgd_module
from gradcomp.schemes.gosgd import GoSGDState, gosgd, gossip_draws

import harness

pytestmark = pytest.mark.xdist_group("schemes")

N = harness.WORKERS
T = 8
LR = 0.1
SHAPES = {"kernel": (6, 5), "bias": (5,)}
U = float(jnp.finfo(jnp.float32).eps) / 2


def _grads(seed=0, steps=T):
  return harness.scheme_grads(SHAPES, steps, seed)


def _params(seed=1):
  return harness.scheme_params(SHAPES, seed)


_run = harness.run_scheme


def _bound(reference, grads, mu=0.0, steps=T):
  magnitude = max(
    max(np.abs(v).max() for v in jax.tree.leaves(reference)),
    LR * max(np.abs(g).max() for g in jax.tree.leaves(grads)) / (1 - mu),
    1.0,
  )
  return steps * (N + 4) * U * magnitude / (1 - mu)


# --- NumPy reference ------------------------------------------------------------


def draws(seed, p, steps=T):
  """Every step's (pushes, shift), re-derived with the scheme's jax.random calls.

  The state's key starts as ``PRNGKey(seed)`` and is split every step; the
  step key splits into a push key (folded with each worker's index, one
  Bernoulli(p) each) and a shift key (one integer in [1, n - 1]).
  """
  key, out = jax.random.PRNGKey(seed), []
  for _ in range(steps):
    key, step_key = jax.random.split(key)
    push_key, shift_key = jax.random.split(step_key)
    pushes = [
      bool(jax.random.bernoulli(jax.random.fold_in(push_key, w), p)) for w in range(N)
    ]
    out.append((np.array(pushes), int(jax.random.randint(shift_key, (), 1, N))))
  return out


def gosgd_reference(params, grads, rounds, mu=0.0, active=None):
  """Blot et al.'s rule, one synchronous round per step (float64).

  Local step ``inner = optax.sgd(LR, momentum=mu)`` first; then each pushing
  worker halves its weight and sends (params, half) to ``(w + s) % n``, which
  merges by weights. With ``active`` (``(T, n)`` bool, EdgeGossip's masked
  steps), an inactive worker takes no local step (its momentum kept) and
  does not push, but merges what it receives. Returns every worker's params
  and weights (in units of ``1 / n``: 1 at the start).
  """
  x = {k: np.repeat(np.float64(v)[None], N, 0) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in x.items()}
  a = np.ones(N)
  for t, (pushes, s) in enumerate(rounds):
    on = np.ones(N, bool) if active is None else active[t]
    for k in x:
      step = on.reshape((N,) + (1,) * (x[k].ndim - 1))
      m[k] = np.where(step, mu * m[k] + grads[k][t], m[k])
      x[k] = np.where(step, x[k] - LR * m[k], x[k])
    pushes = pushes & on
    sent = np.where(pushes, a / 2, 0.0)
    kept = a - sent
    new_a = kept.copy()
    new_x = {k: v.copy() for k, v in x.items()}
    for w in np.flatnonzero(pushes):
      r = (w + s) % N
      new_a[r] = kept[r] + sent[w]
      for k in x:
        new_x[k][r] = (kept[r] * x[k][r] + sent[w] * x[k][w]) / new_a[r]
    x, a = new_x, new_a
  return x, a


CASES = {
  "p_0.3": dict(p=0.3, seed=0),
  "p_0.6_momentum_seed_3": dict(p=0.6, seed=3, mu=0.5),
  "p_1": dict(p=1.0, seed=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_replay_of_the_pushes(case):
  c = CASES[case]
  mu = c.get("mu", 0.0)
  tx = gosgd(
    optax.sgd(LR, momentum=mu or None), c["p"], seed=c["seed"], axis_name=harness.AXIS
  )
  params, grads = _params(), _grads(seed=len(case))
  rounds = draws(c["seed"], c["p"])
  got, state = _run(tx, params, grads)
  want, weights = gosgd_reference(params, grads, rounds, mu)
  harness.assert_within(got, want, _bound(want, grads, mu))
  np.testing.assert_array_equal(state.weight, weights.astype(np.float32))
  np.testing.assert_array_equal(state.count, T)
  harness.assert_same_on_workers(state.key)
  assert state.weight.sum() == N
  pushed = sum(int(pushes.sum()) for pushes, _ in rounds)
  if c["p"] == 1.0:
    # Every worker pushes every step and receives exactly one push: the
    # weights stay 1, and each step averages pairs.
    assert pushed == N * T
    np.testing.assert_array_equal(state.weight, 1.0)
  else:
    assert 0 < pushed < N * T  # the case exercises both kinds of worker
    assert np.any(state.weight != 1.0)


def test_gossip_draws_is_the_replayed_draw():
  key = jax.random.split(jax.random.PRNGKey(4))[1]
  pushes, shift = gossip_draws(key, N, 0.5)
  push_key, shift_key = jax.random.split(key)
  np.testing.assert_array_equal(
    pushes,
    [
      bool(jax.random.bernoulli(jax.random.fold_in(push_key, w), 0.5)) for w in range(N)
    ],
  )
  assert int(shift) == int(jax.random.randint(shift_key, (), 1, N))


def test_draws_have_the_stated_distribution():
  """Pushes are Bernoulli(p) per worker, the shift uniform on [1, n - 1]."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4000)
  pushes, shifts = jax.jit(jax.vmap(lambda k: gossip_draws(k, N, 0.3)))(keys)
  pushes, shifts = np.asarray(pushes), np.asarray(shifts)
  draws_, rate = pushes.size, pushes.mean()
  assert abs(rate - 0.3) < 5 * np.sqrt(0.3 * 0.7 / draws_), rate
  # Workers draw independently: the flags of workers 0 and 1 are uncorrelated.
  assert abs(np.corrcoef(pushes[:, 0], pushes[:, 1])[0, 1]) < 5 / np.sqrt(len(keys))
  counts = np.bincount(shifts, minlength=N)
  assert counts[0] == 0 and counts.sum() == len(keys)
  expected = len(keys) / (N - 1)
  assert np.all(np.abs(counts[1:] - expected) < 5 * np.sqrt(expected)), counts
  for p, want in ((0.0, False), (1.0, True)):
    np.testing.assert_array_equal(gossip_draws(keys[0], N, p)[0], want)


# --- Invariants -------------------------------------------------------------------


def _masked(tx):
  """``tx`` fed GoSGD's ``active`` from the gradient tree's ``"active"`` leaf."""

  def update(grads, state, params=None):
    grads = dict(grads)
    active = grads.pop("active") > 0.5
    return tx.update(grads, state, params, active=active)

  return optax.GradientTransformation(tx.init, update)


def test_masked_steps_match_numpy_replay():
  """EdgeGossip's masked steps (``active``): a masked worker keeps its params'
  local step and momentum, does not push, and still merges what it receives;
  the weights still sum to n. Workers 5-7 are masked from step 3 on, as a
  balanced slow worker is past its budget; worker 0 in step 2 only."""
  p, seed, mu = 0.6, 4, 0.5
  active = np.ones((T, N), bool)
  active[3:, 5:] = False
  active[2, 0] = False
  params, grads = _params(), _grads(seed=11)
  rounds = draws(seed, p)
  fed = dict(grads, active=active.astype(np.float32).reshape(T, N))
  tx = gosgd(optax.sgd(LR, momentum=mu), p, seed=seed, axis_name=harness.AXIS)
  got, state = _run(_masked(tx), params, fed)
  want, weights = gosgd_reference(params, grads, rounds, mu, active)
  harness.assert_within(got, want, _bound(want, grads, mu))
  np.testing.assert_array_equal(state.weight, weights.astype(np.float32))
  assert state.weight.sum() == N
  # The case exercises a masked worker receiving a push, and a push drawn
  # for a masked worker (not sent).
  assert any(
    not active[t, (w + s) % N]
    for t, (pushes, s) in enumerate(rounds)
    for w in np.flatnonzero(pushes & active[t])
  )
  assert any((pushes & ~active[t]).any() for t, (pushes, _) in enumerate(rounds))
  # The masked workers' momentum is that of step 3 (their last step).
  trace = state.inner_state[0].trace
  _, early = _run(
    gosgd(optax.sgd(LR, momentum=mu), p, seed=seed, axis_name=harness.AXIS),
    params,
    {k: g[:3] for k, g in grads.items()},
  )
  for k in SHAPES:
    np.testing.assert_array_equal(trace[k][5:], early.inner_state[0].trace[k][5:])


def test_gossip_conserves_weights_and_the_weighted_average():
  """With zero gradients after step 1, steps 2..T are pure gossip: the weights
  sum to n exactly, ``sum_w a_w x_w`` does not move, and every worker stays in
  the convex hull of the params after step 1 while the spread shrinks."""
  p, seed = 0.5, 2
  params, grads = _params(), _grads(seed=9)
  grads = {k: np.concatenate([g[:1], np.zeros_like(g[1:])]) for k, g in grads.items()}
  tx = gosgd(optax.sgd(LR), p, seed=seed, axis_name=harness.AXIS)
  first, first_state = _run(tx, params, {k: g[:1] for k, g in grads.items()})
  last, state = _run(tx, params, grads)
  assert first_state.weight.sum() == N and state.weight.sum() == N
  assert np.all(state.weight > 0)
  assert len(set(state.weight.tolist())) > 1  # the gossip did move weights
  for k in SHAPES:
    before = np.einsum("w,w...->...", first_state.weight.astype(np.float64), first[k])
    after = np.einsum("w,w...->...", state.weight.astype(np.float64), last[k])
    bound = T * (N + 4) * U * max(np.abs(first[k]).max(), 1.0)
    err = np.max(np.abs(after - before)) / N
    assert err <= bound, f"{k}: weighted average moved by {err:.3g} > {bound:.3g}"
    low, high = first[k].min(0), first[k].max(0)
    assert np.all(last[k] >= low - bound) and np.all(last[k] <= high + bound)
    assert np.ptp(last[k], axis=0).max() < np.ptp(first[k], axis=0).max()


# --- Reductions ---------------------------------------------------------------------


def test_p_0_is_independent_local_sgd():
  """No push ever: the update is ``inner``'s, bit for bit, on every worker, the
  weights stay 1 (replicated), and the program has no collective."""
  params, grads = _params(), _grads(seed=5)
  inner = optax.sgd(LR, momentum=0.9)
  got, state = _run(gosgd(inner, 0.0, axis_name=harness.AXIS), params, grads)
  alone, _ = _run(inner, params, grads)  # each worker on its own gradients
  for k in SHAPES:
    np.testing.assert_array_equal(got[k], alone[k])
  np.testing.assert_array_equal(state.weight, 1.0)
  assert not np.allclose(got["kernel"][0], got["kernel"][1])


def test_one_worker_is_the_inner_optimizer():
  inner = optax.sgd(LR, momentum=0.9)
  params = jax.tree.map(jnp.asarray, _params())
  grads = jax.tree.map(lambda g: g[:, 0], _grads(seed=7))

  def run(tx):
    def body(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), grads)[0])(params)

  (got, state), (want, _) = run(gosgd(inner, 0.7)), run(inner)
  chex.assert_trees_all_equal(got, want)
  assert float(state.weight) == 1.0 and int(state.count) == T


# --- The wire ----------------------------------------------------------------------


def _step_wire(tx, state_spec):
  """Collective bytes of one compiled update; per-worker grads, replicated
  params, and the state replicated (``P()``, as ``init`` makes it) or split
  over the workers whole (``P(AXIS)``)."""
  params = jax.tree.map(jnp.asarray, _params())
  grads = harness.shard({k: jnp.zeros((N, *s)) for k, s in SHAPES.items()})
  state = tx.init(params)
  if state_spec == P(harness.AXIS):
    state = harness.shard(gradcomp.add_worker_axis(state, N))

  def update(grads, state, params):
    if state_spec == P(harness.AXIS):
      state = gradcomp.drop_worker_axis(state)
    updates, state = tx.update(gradcomp.drop_worker_axis(grads), state, params)
    return gradcomp.add_worker_axis((updates, state))

  f = jax.shard_map(
    update,
    mesh=harness.mesh(),
    in_specs=(P(harness.AXIS), state_spec, P()),
    out_specs=P(harness.AXIS),
  )
  text = jax.jit(f).lower(grads, state, params).compile().as_text()
  return wire.collective_bytes(text)


def test_one_collective_permute_of_the_params_and_weight_per_shift():
  """From the compiled HLO: each of the ``n - 1`` switch branches is one
  ``collective-permute`` of every params leaf (float32 here) and the float32
  weight, and nothing else crosses the wire; ``p=0`` sends nothing."""
  payload = 4 * sum(int(np.prod(s)) for s in SHAPES.values()) + 4
  got = _step_wire(gosgd(optax.sgd(LR), 0.3, axis_name=harness.AXIS), P())
  assert got == dict.fromkeys(wire.COLLECTIVES, 0) | {
    "collective-permute": (N - 1) * payload
  }
  # A key typed per worker is agreed first: one 8-byte all-reduce.
  split = _step_wire(gosgd(optax.sgd(LR), 0.3, axis_name=harness.AXIS), P(harness.AXIS))
  assert split["all-reduce"] == 8
  assert split["collective-permute"] == (N - 1) * payload
  none = _step_wire(gosgd(optax.sgd(LR), 0.0, axis_name=harness.AXIS), P())
  assert sum(none.values()) == 0


# --- The contract (DESIGN §5) ------------------------------------------------------


def test_contract_on_mixed_dtypes():
  """jit = no jit, abstract init, stable state type, one trace, finite, params required."""
  chex.clear_trace_counter()
  tx = gosgd(optax.sgd(LR, momentum=0.9), 0.5)
  params = harness.grads_like(harness.MIXED_PARAMS, seed=11)
  state = tx.init(params)
  assert isinstance(state, GoSGDState)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  chex.assert_trees_all_equal_shapes_and_dtypes(tx.init(abstract), state)
  with pytest.raises(ValueError, match="params"):
    tx.update(params, state)
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))
  eager_state = state
  for seed in range(3):
    grads = harness.grads_like(params, seed)
    updates, new_state = update(grads, state, params)
    eager_updates, eager_state = tx.update(grads, eager_state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    chex.assert_tree_all_finite(updates)
    assert type(new_state) is type(state)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    _assert_within_ulps(updates, eager_updates, params)
    state = new_state
    params = optax.apply_updates(params, updates)


def _assert_within_ulps(got, want, like):
  """XLA may keep a fused half-precision expression in float32 under jit: one
  or two roundings of the leaf's dtype apart, relative to the leaf's scale."""
  for a, b, p in zip(
    jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(like), strict=True
  ):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ulp = float(jnp.finfo(p.dtype).eps)
    scale = max(float(np.max(np.abs(b), initial=0)), 1.0)
    err = np.max(np.abs(a - b), initial=0)
    assert err <= 2 * ulp * scale, (p.dtype, err)


def test_shard_map_on_mixed_dtypes_keeps_types():
  """Eight workers, half-precision leaves merged in float32: the state keeps
  its types through the ``scan`` (replicated weight at ``init``, per worker
  after) and every leaf its dtype."""
  params = harness.grads_like(harness.MIXED_PARAMS, seed=12)
  steps = 3
  rng = np.random.default_rng(13)
  grads = jax.tree.map(
    lambda p: jnp.asarray(rng.standard_normal((steps, N, *p.shape)), p.dtype), params
  )
  tx = gosgd(optax.sgd(LR), 1.0, seed=5, axis_name=harness.AXIS)
  sharded = harness.shard(grads, P(None, harness.AXIS))
  jitted = harness.scheme_steps(tx)(params, sharded)
  # Eager against compiled: the scheme contract test (test_schemes.py) on one
  # device; here, types and dtypes through the 8-worker scan.
  for leaf, p in zip(jax.tree.leaves(jitted[0]), jax.tree.leaves(params), strict=True):
    assert leaf.dtype == p.dtype
  np.testing.assert_array_equal(jitted[1].weight, 1.0)  # p=1: every worker pushes


def test_pmap_matches_shard_map():
  """The training program's other path: ``pmap`` types nothing, the key is
  the same on every device by construction, and the run is the same."""
  params, grads = _params(), _grads(seed=10, steps=4)
  tx = gosgd(optax.sgd(LR), 0.5, seed=3, axis_name=harness.AXIS)
  want = _run(tx, params, grads)

  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  f = jax.pmap(step, axis_name=harness.AXIS)
  carry = gradcomp.add_worker_axis(
    (jax.tree.map(jnp.asarray, params), tx.init(params)), N
  )
  for t in range(4):
    carry = f(carry, jax.tree.map(lambda g, t=t: g[t], grads))
  # Same arithmetic in two programs: equal here, but XLA may fuse differently.
  harness.assert_states_close(carry, want, rel=4 * (N + 4) * U)
  np.testing.assert_array_equal(carry[1].weight, want[1].weight)


def test_same_seed_same_run_other_seed_other_pushes():
  params, grads = _params(), _grads(seed=8, steps=4)
  make = lambda seed: gosgd(optax.sgd(LR), 0.5, seed=seed, axis_name=harness.AXIS)
  a, b, c = (_run(make(s), params, grads) for s in (0, 0, 1))
  chex.assert_trees_all_equal(a, b)
  assert not np.array_equal(a[1].weight, c[1].weight)


@pytest.mark.parametrize(
  ("make", "message"),
  [
    (
      lambda: gosgd(optax.sgd(LR), -0.1),
      r"p must be a probability in \[0, 1\], got -0.1",
    ),
    (lambda: gosgd(optax.sgd(LR), 1.5), r"p must be .* got 1.5"),
    (lambda: gosgd(optax.sgd(LR), True), "p must be"),
    (lambda: gosgd(optax.sgd(LR), "0.5"), "p must be"),
    (lambda: gosgd(optax.sgd(LR), float("nan")), "p must be"),
    (lambda: gosgd("sgd", 0.5), "inner must be an optax.GradientTransformation"),
    (lambda: gosgd(optax.sgd(LR), 0.5, seed=1.5), "seed must be an integer"),
  ],
)
def test_bad_hyper_parameters_name_the_argument(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_docstring_examples():
  result = doctest.testmod(gosgd_module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
