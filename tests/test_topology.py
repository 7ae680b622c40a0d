"""Gossip topologies (``gradcomp.topology``): matrices, gaps and mixing.

The matrices are checked doubly stochastic for every factory and worker count
1..16, the spectral gaps against closed forms (circulant eigenvalues), and
``mix`` / ``mix_decoded`` on 8 virtual devices (``shard_map`` and ``pmap``)
against a float64 NumPy ``W @ X`` with a bound from float32 rounding, as
``harness.assert_mean_over_workers`` argues it: a sum of ``k`` weighted terms
rounded in float32 errs by at most ``k u sum |w x|`` (Higham §4.2, ``u =
2^-24``), and the float32 weights add ``u`` each, so ``2 k u sum_j W_ij
|x_j|`` bounds every output.
"""

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gradcomp import topology
from gradcomp.parallel import mixing, wire
from gradcomp.parallel.branches import varying_axes
from gradcomp.topology import Edge, Phase, Topology

from harness import AXIS, WORKERS, mesh, shard

U32 = float(np.finfo(np.float32).eps) / 2  # float32 unit roundoff, 2^-24
FACTORIES = [getattr(topology, name) for name in topology.NAMES]


def _per_worker(seed=0, shape=(6,)):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((WORKERS, *shape)).astype(np.float32)


def _sharded_mix(topo, *, steps=1, scan=False):
  """``f(x, step0) -> x`` after ``steps`` mixes on 8 workers, x of shape (8, ...)."""

  def run(x, step0):
    x = x[0]
    if scan:  # a traced step: lax.switch over the phases.
      x, _ = jax.lax.scan(
        lambda x, t: (mixing.mix(topo, x, step0 + t, AXIS), None),
        x,
        jnp.arange(steps, dtype=jnp.int32),
      )
    else:
      for t in range(steps):
        x = mixing.mix(topo, x, t, AXIS)
    return x[None]

  return jax.jit(
    jax.shard_map(run, mesh=mesh(), in_specs=(P(AXIS), P()), out_specs=P(AXIS))
  )


def _assert_mixed(out, w, x, terms):
  """``out`` is ``W @ x`` up to ``2 terms u sum_j W_ij |x_j|`` per coordinate."""
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  out = np.asarray(out, np.float64).reshape(len(x), -1)
  err = np.abs(out - w @ x)
  bound = 2 * terms * U32 * (np.abs(w) @ np.abs(x))
  assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"


# -- the matrices ----------------------------------------------------------------------


@pytest.mark.parametrize("factory", FACTORIES, ids=topology.NAMES)
def test_every_factory_is_doubly_stochastic_and_one_ppermute_per_edge(factory):
  for n in range(1, 17):
    topo = factory(n)
    assert topo.workers == n and topo.name == factory.__name__
    for p, phase in enumerate(topo.phases):
      w = topo.matrix(p)
      assert w.shape == (n, n) and (w >= 0).all()
      np.testing.assert_allclose(w.sum(0), 1.0, rtol=0, atol=topology.tolerance(n))
      np.testing.assert_allclose(w.sum(1), 1.0, rtol=0, atol=topology.tolerance(n))
      assert topo.messages(p) == len(phase.edges) <= max(n - 1, 0)
      for edge in phase.edges:
        senders = [s for s, _ in edge.perm]
        receivers = [r for _, r in edge.perm]
        assert len(set(senders)) == len(senders)  # a partial permutation
        assert all(s != r for s, r in edge.perm)  # no self loop
        assert len(set(receivers)) == len(receivers)
      for i in range(n):
        expected = [j for j in range(n) if j != i and w[i, j] > 0]
        assert sorted(topo.in_neighbours(p, i)) == expected
        expected = [j for j in range(n) if j != i and w[j, i] > 0]
        assert sorted(topo.out_neighbours(p, i)) == expected


def test_ring_matrix_and_neighbours():
  w = topology.ring(5).matrix(0)
  third = 1.0 / 3.0
  for i in range(5):
    row = np.zeros(5)
    row[[i, (i - 1) % 5, (i + 1) % 5]] = third
    np.testing.assert_array_equal(w[i], row)
  assert topology.ring(5).in_neighbours(0, 0) == [4, 1]
  assert topology.ring(5).out_neighbours(0, 0) == [1, 4]
  np.testing.assert_array_equal(topology.ring(2).matrix(0), np.full((2, 2), 0.5))
  np.testing.assert_array_equal(topology.ring(1).matrix(0), np.eye(1))
  assert topology.ring(1).messages(0) == 0 and topology.ring(2).messages(0) == 1


def test_step_cycles_through_phases():
  topo = topology.one_peer_exponential(8)
  assert len(topo.phases) == 3
  for t in range(7):
    k = t % 3
    assert topo.in_neighbours(t, 5) == [(5 - 2**k) % 8]
    np.testing.assert_array_equal(topo.matrix(t), topo.matrix(k))
  assert topo.messages(4) == 1


def test_torus_shape_and_degenerate_shapes():
  shapes = {1: (1, 1), 2: (1, 2), 4: (2, 2), 7: (1, 7), 8: (2, 4), 12: (3, 4)}
  shapes |= {15: (3, 5), 16: (4, 4)}
  for n, shape in shapes.items():
    assert topology.torus_shape(n) == shape
  # r = 1 (prime n, n <= 3) is the ring; the 2 x 2 grid the 4-cycle 0-1-3-2.
  for n in (2, 3, 5, 7, 11, 13):
    np.testing.assert_array_equal(
      topology.torus(n).matrix(0), topology.ring(n).matrix(0)
    )
  four = topology.torus(4)
  assert [sorted(four.in_neighbours(0, i)) for i in range(4)] == [
    [1, 2],
    [0, 3],
    [0, 3],
    [1, 2],
  ]
  assert four.matrix(0)[0, 0] == 1 / 3
  assert topology.torus(8).summary()["peers_per_worker"] == 3
  assert topology.torus(8).matrix(0)[0, 0] == 0.25
  assert topology.torus(16).summary()["peers_per_worker"] == 4
  # 4 x 4: worker 5 = (1, 1) has (0, 1), (2, 1), (1, 0), (1, 2).
  assert topology.torus(16).in_neighbours(0, 5) == [1, 9, 4, 6]
  assert topology.torus(16).matrix(0)[5, 5] == 0.2


def test_from_matrices_round_trip_and_shift_decomposition():
  rng = np.random.default_rng(0)
  n = 7
  # Birkhoff: a convex combination of permutation matrices is doubly stochastic.
  perms = [np.eye(n)[rng.permutation(n)] for _ in range(3)]
  coef = np.array([0.5, 0.25, 0.25])  # dyadic: exact sums
  w = sum(c * p for c, p in zip(coef, perms, strict=True))
  topo = topology.from_matrices([w, np.eye(n)], name="mine")
  np.testing.assert_array_equal(topo.matrix(0), w)
  np.testing.assert_array_equal(topo.matrix(1), np.eye(n))
  assert topo.name == "mine" and len(topo.phases) == 2 and topo.messages(1) == 0
  assert topo.messages(0) <= n - 1
  ring = topology.from_matrices(topology.ring(8).matrix(0))
  assert ring.messages(0) == 2
  np.testing.assert_array_equal(ring.matrix(0), topology.ring(8).matrix(0))


@pytest.mark.parametrize(
  "matrices, message",
  [
    ([[0.9, 0.0], [0.1, 1.0]], r"phase 0 .*row 0 .* sums to 0\.9"),
    ([[1.0, 0.0], [1.0, 0.0]], r"column 0 .* sums to 2\.0"),
    ([np.eye(2), [[0.5, 0.5], [0.5, 0.6]]], r"phase 1 .*row 1 .* sums to 1\.1"),
    ([[1.5, -0.5], [-0.5, 1.5]], r"W\[0, 1\] = -0\.5 is negative"),
    (np.full((2, 3), 0.5), "square"),
    ([[np.nan, 1.0], [1.0, 0.0]], "finite"),
  ],
)
def test_bad_user_matrix_raises(matrices, message):
  with pytest.raises(ValueError, match=message):
    topology.from_matrices(matrices)


def test_float32_weights_are_refused_float64_ones_pass():
  third = np.full((3, 3), 1 / 3)
  topology.from_matrices(third)  # float64 1/3: sums within n eps
  with pytest.raises(ValueError, match="doubly stochastic"):
    topology.from_matrices(third.astype(np.float32) + np.float32(1e-7))


@pytest.mark.parametrize(
  "call, message",
  [
    (lambda: Edge((1, 0, 0), (0.5, 0.5, 0.5)), "worker 0 sends to workers 1 and 2"),
    (lambda: Edge((0, 0), (0.5, 0.5)), r"sources\[0\] = 0 is a self loop"),
    (lambda: Edge((1, -1), (0.5, 0.5)), r"weights\[1\] must be 0"),
    (lambda: Edge((1, 0), (0.5, 0.0)), r"weights\[1\] is 0"),
    (lambda: Edge((1, 3), (0.5, 0.5)), r"sources\[1\] must be an integer in \[-1, 2\)"),
    (lambda: Edge((-1, -1), (0.0, 0.0)), "at least one message"),
    (lambda: Edge((1, 0), (0.5, -0.5)), r"weights\[1\] must be finite and >= 0"),
    (lambda: Phase((Edge((1, 0), (0.5, 0.5)),), (0.5,)), "has 2 workers"),
    (lambda: Topology(2, (Phase((), (1.0, 0.5)),)), "row 1 .* sums to 0.5"),
    (lambda: Topology(3, (Phase((), (1.0, 1.0)),)), "has 2 workers, the topology 3"),
    (lambda: Topology(2, ()), "non-empty"),
    (lambda: topology.ring(0), "n must be an integer >= 1"),
    (lambda: topology.get("star", 4), "one of .*'ring'.*'one_peer_exponential'"),
    (lambda: topology.ring(4).matrix(-1), "step must be an integer >= 0"),
    (lambda: topology.ring(4).in_neighbours(0, 4), r"worker must be .* \[0, 4\)"),
  ],
)
def test_bad_input_raises(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_get_by_name():
  for name in topology.NAMES:
    assert topology.get(name, 6) == getattr(topology, name)(6)


def test_topology_is_hashable_and_frozen():
  assert hash(topology.ring(8)) == hash(topology.ring(8))
  with pytest.raises(AttributeError):
    topology.ring(8).workers = 4


# -- spectral gaps ---------------------------------------------------------------------


def test_spectral_gaps_closed_forms():
  for n in range(3, 17):
    # Circulant (I + S + S^-1) / 3: eigenvalues (1 + 2 cos(2 pi k / n)) / 3, k = 1
    # the largest after k = 0, and the most negative, -1/3, no larger in magnitude.
    expected = 1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3
    assert topology.ring(n).spectral_gap() == pytest.approx(expected, abs=1e-12)
  for n in range(1, 17):
    assert topology.complete(n).spectral_gap() == 1.0
  assert (
    topology.ring(2).spectral_gap() == 1.0 and topology.ring(1).spectral_gap() == 1.0
  )
  for n in (2, 4, 8, 16, 32):  # static exponential, n a power of two: 2 / (tau + 1)
    tau = int(math.log2(n))
    assert topology.exponential(n).spectral_gap() == pytest.approx(
      2 / (tau + 1), abs=1e-12
    )
  for r, c in ((3, 3), (3, 4), (3, 5), (4, 4)):
    # Two commuting circulants: eigenvalues (1 + 2 cos(2 pi a / r) + 2 cos(2 pi b / c)) / 5.
    lam = [
      (1 + 2 * math.cos(2 * math.pi * a / r) + 2 * math.cos(2 * math.pi * b / c)) / 5
      for a in range(r)
      for b in range(c)
      if (a, b) != (0, 0)
    ]
    gap = 1 - max(abs(v) for v in lam)
    assert topology.torus(r * c).spectral_gap() == pytest.approx(gap, abs=1e-12)


def test_one_peer_exponential_period_is_exact_averaging_for_powers_of_two():
  for n in (2, 4, 8, 16):
    topo = topology.one_peer_exponential(n)
    # Dyadic products: the period's product is J exactly.
    np.testing.assert_array_equal(topo.period_matrix(), np.full((n, n), 1 / n))
    assert topo.spectral_gap() == 1.0
  # One phase alone, (I + S^(2^k)) / 2, has singular values |cos(pi m 2^k / n)|:
  # gap 1 - cos(pi / 8) for k = 0, and 0 for k = 1, 2 (m = n / 2^k gives 1).
  gaps = topology.one_peer_exponential(8).phase_spectral_gaps()
  assert gaps[0] == pytest.approx(1 - math.cos(math.pi / 8), abs=1e-12)
  assert gaps[1] == pytest.approx(0.0, abs=1e-12)
  assert gaps[2] == pytest.approx(0.0, abs=1e-12)
  # n = 3: (I + S)(I + S^2) / 4 = (2I + S + S^2) / 4, eigenvalues 1/4 off 1.
  assert topology.one_peer_exponential(3).spectral_gap() == pytest.approx(0.75)
  assert 0 < topology.one_peer_exponential(6).spectral_gap() < 1


def test_summary():
  s = topology.one_peer_exponential(8).summary()
  assert s == {
    "name": "one_peer_exponential",
    "workers": 8,
    "phases": 3,
    "peers_per_worker": 1,
    "messages_per_step": 1,
    "spectral_gap": 1.0,
    "phase_spectral_gaps": list(topology.one_peer_exponential(8).phase_spectral_gaps()),
  }
  assert topology.complete(8).summary()["messages_per_step"] == 7


def test_docstring_examples():
  result = doctest.testmod(topology, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted >= 4 and result.failed == 0


# -- mixing in JAX ---------------------------------------------------------------------


@pytest.mark.parametrize("name", topology.NAMES)
def test_mix_equals_numpy_reference(name):
  # Ring and complete as the issue asks; every other factory too (direction
  # included: one-peer exponential's W[i, i - 2^k] is not symmetric).
  topo = topology.get(name, WORKERS)
  x = _per_worker(1)
  for step in (0, 1):
    out = _sharded_mix(topo, scan=True)(shard(x), jnp.int32(step))
    assert out.dtype == jnp.float32
    _assert_mixed(out, topo.matrix(step), x, terms=topo.messages(step) + 1)


@pytest.mark.parametrize("name", topology.NAMES)
def test_mix_keeps_the_average(name):
  topo = topology.get(name, WORKERS)
  x = _per_worker(2, (4, 3))
  out = np.asarray(_sharded_mix(topo, steps=2, scan=True)(shard(x), jnp.int32(1)))
  # Column sums are 1, so the per-worker bounds add up to 2 k u mean |x| per
  # step (two steps; the averages of |x| do not grow under a stochastic W).
  terms = max(topo.messages(t) for t in range(3)) + 1
  err = np.abs(out.astype(np.float64).mean(0) - x.astype(np.float64).mean(0))
  assert np.all(err <= 2 * 2 * terms * U32 * np.abs(x).mean(0) + 1e-30)
  assert not np.allclose(out, x)  # something moved


def test_one_peer_exponential_reaches_exact_consensus_in_log2_n_steps():
  topo = topology.one_peer_exponential(WORKERS)
  x = _per_worker(3, (5,))
  mean = x.astype(np.float64).mean(0)
  # Each step computes (x_i + x_j) / 2: the halvings are exact and the sum
  # rounds once (at most u times max|x|, averages never exceeding max|x|);
  # in exact arithmetic the result is the mean after log2(8) = 3 steps.
  bound = 3 * U32 * np.abs(x).max(0)
  for scan in (False, True):
    out = np.asarray(_sharded_mix(topo, steps=3, scan=scan)(shard(x), jnp.int32(0)))
    assert np.all(np.abs(out - mean) <= bound)
  # Two steps are not enough; starting from phase 1 the period still averages.
  two = np.asarray(_sharded_mix(topo, steps=2)(shard(x), jnp.int32(0)))
  assert np.abs(two - mean).max() > 1e-3
  late = np.asarray(_sharded_mix(topo, steps=3, scan=True)(shard(x), jnp.int32(4)))
  assert np.all(np.abs(late - mean) <= bound)


def test_mix_under_pmap_matches_numpy_with_a_traced_step():
  topo = topology.one_peer_exponential(WORKERS)
  x = _per_worker(4)
  f = jax.pmap(
    lambda x, t: mixing.mix(topo, x, t, AXIS), axis_name=AXIS, in_axes=(0, None)
  )
  for t in range(4):
    _assert_mixed(f(x, jnp.int32(t)), topo.matrix(t), x, terms=2)


def test_mix_preserves_dtypes_and_tree():
  topo = topology.ring(WORKERS)
  x = _per_worker(5, (16,))
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "f16": (x.astype(np.float16),)}

  def run(tree):
    return jax.tree.map(
      lambda v: v[None], mixing.mix(topo, jax.tree.map(lambda v: v[0], tree), 0, AXIS)
    )

  f = jax.jit(jax.shard_map(run, mesh=mesh(), in_specs=P(AXIS), out_specs=P(AXIS)))
  out = f(shard(tree))
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  assert out["f32"].dtype == jnp.float32 and out["bf16"].dtype == jnp.bfloat16
  assert out["f16"][0].dtype == jnp.float16
  w = topo.matrix(0)
  # Half precision is summed in float32, then rounded once to its own unit.
  for leaf, unit in ((out["bf16"], 2.0**-8), (out["f16"][0], 2.0**-11)):
    inputs = np.asarray(tree["bf16"] if unit == 2.0**-8 else tree["f16"][0], np.float64)
    ref = w @ inputs
    err = np.abs(np.asarray(leaf, np.float64) - ref)
    assert np.all(err <= unit * np.abs(ref) + 2 * 3 * U32 * (w @ np.abs(inputs)))


def test_mix_of_replicated_values_is_typed_varying():
  topo = topology.one_peer_exponential(WORKERS)
  x = np.arange(6, dtype=np.float32)

  def run(x, t):
    assert not varying_axes(x)
    out = mixing.mix(topo, x, t, AXIS)
    assert varying_axes(out) == {AXIS}
    return out[None]

  f = jax.jit(jax.shard_map(run, mesh=mesh(), in_specs=(P(), P()), out_specs=P(AXIS)))
  out = np.asarray(f(shard(x, P()), jnp.int32(2)))
  np.testing.assert_array_equal(out, np.broadcast_to(x, (WORKERS, 6)))


def test_one_worker_is_the_identity():
  tree = {"a": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}
  assert mixing.mix(topology.ring(1), tree, 0, None) is tree
  out = mixing.mix_decoded(
    topology.ring(1), (jnp.int8(3), jnp.float32(0.5)), lambda p: p[0] * p[1], 0, None
  )
  assert float(out) == 1.5


def test_mix_errors():
  x = shard(_per_worker(6))
  with pytest.raises(ValueError, match="has 4 workers, but axis 'data' has 8"):
    _sharded_mix(topology.ring(4))(x, jnp.int32(0))
  with pytest.raises(ValueError, match="dtype int32"):
    _sharded_mix(topology.ring(WORKERS))(shard(np.ones((8, 3), np.int32)), 0)
  with pytest.raises(ValueError, match="topology must be a Topology"):
    mixing.mix("ring", x, 0, None)


# -- compressed payloads ---------------------------------------------------------------


def _codes_and_scales(seed=7, size=64):
  rng = np.random.default_rng(seed)
  codes = rng.integers(-127, 128, (WORKERS, size)).astype(np.int8)
  scales = rng.uniform(0.01, 0.1, WORKERS).astype(np.float32)
  return codes, scales


def _decode(payload):
  codes, scale = payload
  return codes.astype(jnp.float32) * scale


def _sharded_mix_decoded(topo, decode=_decode):
  def run(codes, scales):
    return mixing.mix_decoded(topo, (codes[0], scales[0]), decode, 0, AXIS)[None]

  return jax.jit(
    jax.shard_map(run, mesh=mesh(), in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
  )


def test_mix_decoded_equals_mix_of_decoded_and_sends_the_payload():
  topo = topology.ring(WORKERS)
  codes, scales = _codes_and_scales()
  f = _sharded_mix_decoded(topo)
  out = f(shard(codes), shard(scales))
  # Decoding is one exact product per value (an int8 code fits float32), so
  # the mix of decoded values is the mix of the dense values up to float32
  # rounding: XLA:CPU may fuse the decode's product into the mix's
  # multiply-adds (an FMA rounds once where two operations round twice), so
  # both are held to the float32 bound of W x rather than to each other's bits.
  dense = codes.astype(np.float32) * scales[:, None]
  expected = _sharded_mix(topo)(shard(dense), jnp.int32(0))
  _assert_mixed(expected, topo.matrix(0), dense, terms=3)
  _assert_mixed(out, topo.matrix(0), dense, terms=3)
  # The wire: per edge the payload (64 int8 codes + one float32 scale), not
  # 64 float32 values.
  hlo = f.lower(shard(codes), shard(scales)).compile().as_text()
  permuted = wire.collective_bytes(hlo)["collective-permute"]
  assert permuted == topo.messages(0) * (codes[0].nbytes + scales[0].nbytes) == 136
  assert permuted < topo.messages(0) * dense[0].nbytes
  assert sum(wire.collective_bytes(hlo).values()) == permuted


def test_mix_decoded_masks_what_non_receivers_decode():
  # Even workers also receive from i - 2; odd ones keep that weight on
  # themselves, so the shift-2 edge is partial: odd workers receive zeros on
  # it, which a decode dividing by the payload's scale turns into NaN.
  n = WORKERS
  w = np.zeros((n, n))
  for i in range(n):
    w[i, i] = 0.5 if i % 2 == 0 else 0.75
    w[i, (i - 1) % n] = 0.25
    if i % 2 == 0:
      w[i, (i - 2) % n] = 0.25
  topo = topology.from_matrices(w)
  edges = topo.phases[0].edges
  assert [e.is_permutation for e in edges] == [True, False]
  codes, scales = _codes_and_scales(8)
  inverse = (1.0 / scales).astype(np.float32)

  def decode(payload):
    codes, inverse = payload
    return codes.astype(jnp.float32) / inverse  # zeros decode to NaN

  out = np.asarray(_sharded_mix_decoded(topo, decode)(shard(codes), shard(inverse)))
  assert np.isfinite(out).all()
  dense = codes.astype(np.float64) / inverse.astype(np.float64)[:, None]
  # One more rounding than a plain mix: the division.
  _assert_mixed(out, topo.matrix(0), dense, terms=4)
  pmapped = jax.pmap(
    lambda c, v: mixing.mix_decoded(topo, (c, v), decode, 0, AXIS), axis_name=AXIS
  )
  _assert_mixed(pmapped(codes, inverse), topo.matrix(0), dense, terms=4)
