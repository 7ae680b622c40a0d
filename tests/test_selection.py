"""Tests for gradcomp.kernels.selection against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradcomp.kernels import selection

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# A small sample makes medium arrays (2^16..2^18) take the sampled path.
SMALL_SAMPLE = 1 << 12

_top_k = jax.jit(selection.top_k_magnitude, static_argnums=1)
_sampled = jax.jit(selection._sampled_top_k, static_argnums=(1, 2))

# One pytest-xdist worker runs the module, so a program compiled for one test
# (the jitted functions above, per size, k and dtype) serves the others.
pytestmark = pytest.mark.xdist_group("selection")


def _check(x, k, values, indices):
  """Asserts (values, indices) is an exact magnitude top-k of x."""
  assert values.dtype == x.dtype
  x = np.asarray(x.astype(jnp.float32))
  values = np.asarray(values.astype(jnp.float32))
  indices = np.asarray(indices)
  assert indices.shape == (k,) and values.shape == (k,)
  assert indices.dtype == np.int32
  assert np.all((indices >= 0) & (indices < x.shape[0]))
  assert np.unique(indices).shape[0] == k, "duplicate indices"
  np.testing.assert_array_equal(values, x[indices])
  mag = np.abs(x)
  want = np.sort(mag[np.argpartition(-mag, k - 1)[:k]])
  np.testing.assert_array_equal(np.sort(mag[indices]), want)


def _layered(rng, d, segments=161):
  """Concatenated 'layers' whose scales span 1e-4..1e1, like real gradients."""
  cuts = np.sort(rng.choice(np.arange(1, d), segments - 1, replace=False))
  sizes = np.diff(np.concatenate([[0], cuts, [d]]))
  scales = 10.0 ** rng.uniform(-4, 1, segments)
  return rng.standard_normal(d) * np.repeat(scales, sizes)


def _tier(x, k, sample_size):
  """Which candidates the sampled path takes, recomputed in NumPy: "fast"
  (those at or above the threshold), "strict" (those above it) or "whole"."""
  d = x.shape[0]
  stride, r, capacity = selection._plan(d, k, sample_size)
  mag = np.abs(np.asarray(x.astype(jnp.float32)))
  threshold = np.sort(mag[::stride])[-r]
  count = np.sum(mag >= threshold)
  if count > capacity:
    count = np.sum(mag > threshold)
    return "strict" if k <= count <= capacity else "whole"
  return "fast" if count >= k else "whole"


def _fallback_taken(x, k, sample_size):
  """Whether the sampled path leaves its first capacity."""
  return _tier(x, k, sample_size) != "fast"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 2, 7, 1000, 4099])
def test_small(d, dtype):
  rng = np.random.default_rng(d)
  x = jnp.asarray(rng.standard_normal(d), dtype)
  for k in sorted({1, max(1, d // 3), max(1, d - 1), d}):
    _check(x, k, *_top_k(x, k))


# Each (d, k, dtype) is a compilation (~1-2 s), so the grid is kept sparse.
@pytest.mark.parametrize(
  "d,dtype,ks",
  [
    (1 << 16, jnp.float32, (1, 655, 6553, 1 << 16)),
    ((1 << 18) + 13, jnp.float32, (2621,)),
    (1 << 16, jnp.bfloat16, (1, 655)),
    (1 << 16, jnp.float16, (655,)),
  ],
)
@pytest.mark.parametrize("kind", ["gauss", "layered"])
def test_sampled_path(d, dtype, ks, kind):
  rng = np.random.default_rng(d)
  xn = rng.standard_normal(d) if kind == "gauss" else _layered(rng, d)
  x = jnp.asarray(xn, dtype)
  for k in ks:
    _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


@pytest.mark.parametrize(
  "d,k", [(1 << 15, 3000), (1 << 17, 1310), ((1 << 18) + 13, 5000), (1 << 19, 100_000)]
)
def test_public_medium(d, k):
  # Both sides of the lax.top_k cutoffs.
  x = jnp.asarray(_layered(np.random.default_rng(0), d), jnp.float32)
  _check(x, k, *_top_k(x, k))


def test_k_equals_d_returns_everything():
  x = jnp.arange(5.0) - 2.0
  values, indices = _top_k(x, 5)
  np.testing.assert_array_equal(indices, np.arange(5))
  np.testing.assert_array_equal(values, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_equal_values(dtype):
  # Every element ties with the k-th: any k distinct indices are correct.
  d = 1 << 16
  x = -jnp.ones(d, dtype)
  for k in [1, 655]:
    _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


@pytest.mark.parametrize(
  "dtype,ks",
  [(jnp.float32, (1, 655, 21847)), (jnp.bfloat16, (655,)), (jnp.float16, (655,))],
)
def test_few_distinct_values(dtype, ks):
  # Heavy ties exactly at the k-th magnitude, in and out of the sample.
  d = (1 << 16) + 5
  x = jnp.asarray(np.random.default_rng(1).integers(-3, 4, d), dtype)
  for k in ks:
    _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


@pytest.mark.parametrize("nonzero_fraction", [0.1, 0.005, 0.0])
def test_many_zeros(nonzero_fraction):
  d = 1 << 16
  rng = np.random.default_rng(2)
  xn = rng.standard_normal(d) * (rng.random(d) < nonzero_fraction)
  x = jnp.asarray(xn, jnp.float32)
  for k in [1, 655, 6553]:
    _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


def test_fallback_when_sample_underestimates():
  # Large values only at positions the strided sample skips: the sampled
  # threshold is far too low and the candidates overflow their capacity.
  d, k = 1 << 16, 600
  stride, _, _ = selection._plan(d, k, SMALL_SAMPLE)
  rng = np.random.default_rng(3)
  xn = rng.standard_normal(d) * 1e-3
  off_sample = np.arange(d) % stride != 0
  xn[off_sample] *= 1e6
  x = jnp.asarray(xn, jnp.float32)
  assert _tier(x, k, SMALL_SAMPLE) == "whole"
  _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keys_above_a_tied_threshold_when_the_ties_overflow(dtype, monkeypatch):
  # 1.05 k large distinct values, then twice the capacity of copies of one
  # value: the sampled threshold lands on the tie, whose count overflows the
  # capacity, while the keys above it fit (sketch_topk's priorities do this).
  d, k = 1 << 16, 655
  _, _, capacity = selection._plan(d, k, SMALL_SAMPLE)
  rng = np.random.default_rng(6)
  n_big = k + k // 20
  xn = rng.uniform(0.0, 0.5, d)
  xn[:n_big] = rng.uniform(2.0, 3.0, n_big)
  xn[n_big : n_big + 2 * capacity] = 1.0
  x = jnp.asarray(rng.permutation(xn) * rng.choice([-1.0, 1.0], d), dtype)
  assert _tier(x, k, SMALL_SAMPLE) == "strict"
  # A wrong fallback, so that only the strict candidates can pass the check.
  monkeypatch.setattr(
    selection,
    "_direct_top_k",
    lambda x, k: (jnp.zeros(k, x.dtype), jnp.zeros(k, jnp.int32)),
  )
  sampled = jax.jit(lambda x: selection._sampled_top_k(x, k, SMALL_SAMPLE))
  _check(x, k, *sampled(x))


def test_fallback_when_sample_overestimates():
  # Large values only at sampled positions, fewer than k of them: the
  # threshold admits fewer than k candidates.
  d, k = 1 << 16, 3000
  stride, _, _ = selection._plan(d, k, SMALL_SAMPLE)
  rng = np.random.default_rng(4)
  xn = rng.standard_normal(d)
  xn[::stride] *= 1e3
  x = jnp.asarray(xn, jnp.float32)
  assert _tier(x, k, SMALL_SAMPLE) == "whole"
  _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


def test_fast_path_taken_on_layered_buffer():
  # The layered buffer must not rely on the fallback for correctness.
  d, k = 1 << 18, 2621
  x = jnp.asarray(_layered(np.random.default_rng(5), d), jnp.float32)
  assert not _fallback_taken(x, k, SMALL_SAMPLE)
  _check(x, k, *_sampled(x, k, SMALL_SAMPLE))


def _keys(rng, n, padding, tied):
  """Non-negative int32 keys (many ties, or all distinct), then ``padding`` -1s."""
  keys = rng.integers(0, 50, n) if tied else rng.permutation(n) * 7
  keys = np.concatenate([keys, np.full(padding, -1)]).astype(np.int32)
  return jnp.asarray(keys)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("form", ["bitwise", "sorted"])
@pytest.mark.parametrize("n", [1, 37, 500])
def test_kth_largest_forms(form, n, tied):
  # The CPU form and the other backends' form, both against NumPy.
  keys = _keys(np.random.default_rng(n), 600, 0, tied)
  fn = getattr(selection, f"_kth_largest_{form}")
  got = jax.jit(fn, static_argnums=1)(keys, n)
  assert int(got) == np.sort(np.asarray(keys))[-n]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("form", ["bitwise", "sorted"])
@pytest.mark.parametrize("k", [1, 250, 600])
def test_exact_select_forms(form, k, tied):
  keys = _keys(np.random.default_rng(k), 600, 40, tied)
  fn = getattr(selection, f"_exact_select_{form}")
  pos = np.asarray(jax.jit(fn, static_argnums=1)(keys, k))
  assert pos.dtype == np.int32 and np.unique(pos).shape[0] == k
  want = np.sort(np.asarray(keys))[-k:]
  np.testing.assert_array_equal(np.sort(np.asarray(keys)[pos]), want)


@pytest.mark.parametrize("kind", ["gauss", "layered"])
def test_sampled_path_with_the_sorted_form(kind, monkeypatch):
  # What a GPU runs (lax.platform_dependent picks it off CPU), run here.
  monkeypatch.setattr(selection, "_kth_largest", selection._kth_largest_sorted)
  monkeypatch.setattr(selection, "_exact_select", selection._exact_select_sorted)
  d, k = 1 << 16, 655
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal(d) if kind == "gauss" else _layered(rng, d))
  x = x.astype(jnp.float32)
  assert not _fallback_taken(x, k, SMALL_SAMPLE)
  sampled = jax.jit(lambda x: selection._sampled_top_k(x, k, SMALL_SAMPLE))
  _check(x, k, *sampled(x))
  values, indices = jax.jit(lambda x: selection.threshold_top_k(x, k, SMALL_SAMPLE))(x)
  used = np.asarray(indices) < d
  mag = np.abs(np.asarray(x))
  assert np.all(np.asarray(values)[used] == np.asarray(x)[np.asarray(indices)[used]])
  # Every kept magnitude is at least every unkept candidate's (exact within).
  assert mag[np.asarray(indices)[used]].min() >= np.sort(mag)[-k]


@pytest.mark.parametrize("form", ["cpu", "other"])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 4097])
def test_pack_unpack_matches_flatnonzero(n, form, monkeypatch):
  if form == "other":  # What lax.platform_dependent picks off CPU.
    monkeypatch.setattr(
      selection, "_running", lambda x, kind: selection._CUMULATIVE[kind](x)
    )
  rng = np.random.default_rng(n)
  mask = rng.random(n) < 0.3
  words, count = jax.jit(selection._pack)(jnp.asarray(mask))
  want = np.flatnonzero(mask)
  assert int(count) == want.shape[0]
  size = max(1, want.shape[0])
  unpack = jax.jit(lambda w: selection._unpack(w, size, n))  # Traced per form.
  got = unpack(words)
  np.testing.assert_array_equal(np.asarray(got)[: want.shape[0]], want)
  assert np.all((np.asarray(got) >= 0) & (np.asarray(got) < n))


@pytest.mark.parametrize(
  "d,k", [(10**6, 1), (10**6, 10**4), (25_557_032, 255_570), (300_000, 150_000)]
)
def test_plan_margins(d, k):
  stride, r, capacity = selection._plan(d, k, selection._SAMPLE_SIZE)
  s = -(-d // stride)
  assert 1 <= r <= s and k <= capacity <= d
  assert r >= s * k / d  # The sampled threshold aims above k candidates.


def test_rejects_bad_k():
  with pytest.raises(ValueError):
    selection.top_k_magnitude(jnp.ones(4), 0)
  with pytest.raises(ValueError):
    selection.top_k_magnitude(jnp.ones(4), 5)


def test_threshold_top_k_selects_at_most_k_above_a_sampled_threshold():
  from gradcomp.kernels.selection import threshold_top_k

  x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
  select = jax.jit(threshold_top_k, static_argnums=(1, 2))  # eager: 10x slower
  values, indices = select(jnp.asarray(x), 500, 5_000)  # sampled path
  values, indices = np.asarray(values), np.asarray(indices)
  used = indices < x.size
  # Close to k entries, all distinct, values read from x, largest first taken.
  assert 400 <= used.sum() <= 500
  assert np.unique(indices[used]).size == used.sum()
  np.testing.assert_array_equal(values[used], x[indices[used]])
  np.testing.assert_array_equal(values[~used], 0)
  assert np.abs(values[used]).min() >= np.sort(np.abs(x))[-700]


def test_threshold_top_k_pads_when_few_pass():
  from gradcomp.kernels.selection import threshold_top_k

  x = np.zeros(10_000, np.float32)
  x[[5, 7000]] = [3.0, -2.0]
  values, indices = threshold_top_k(jnp.asarray(x), 100, 100)
  used = np.asarray(indices) < x.size
  # The sampled threshold is 0 here, so zeros pass too; every used slot is distinct.
  assert np.unique(np.asarray(indices)[used]).size == used.sum()
  sent = np.zeros_like(x)
  np.add.at(sent, np.asarray(indices)[used], np.asarray(values)[used])
  assert np.all((sent == 0) | (sent == x))


def _numpy_threshold_top_k(x, k, sample_size):
  """DGC's selection, from its definition (selection.threshold_top_k)."""
  d = x.size
  stride = -(-d // min(sample_size, d))
  sample = np.sort(np.abs(x[::stride]))[::-1]
  threshold = sample[max(1, round(sample.size * k / d)) - 1]
  capacity = min(d, int(np.ceil(1.25 * k)) + 64)
  candidates = np.flatnonzero(np.abs(x) >= threshold)
  count = candidates.size
  candidates = candidates[:capacity]
  if candidates.size > k:  # the k largest magnitudes, in position order
    keep = np.sort(np.argsort(-np.abs(x[candidates]), kind="stable")[:k])
    candidates = candidates[keep]
  return candidates, count


def test_threshold_top_k_matches_numpy_with_few_and_many_candidates():
  # Distinct magnitudes (no ties). Across the seeds the sampled threshold lets
  # both fewer and more than k candidates through (asserted), the two
  # branches of the selection.
  select = jax.jit(selection.threshold_top_k, static_argnums=(1, 2))
  k, sample_size = 400, 2_000
  regimes = set()
  for seed in range(6):
    x = np.random.default_rng(seed).standard_normal(40_000).astype(np.float32)
    expected, count = _numpy_threshold_top_k(x, k, sample_size)
    values, indices = select(jnp.asarray(x), k, sample_size)
    indices, values = np.asarray(indices), np.asarray(values)
    used = indices < x.size
    np.testing.assert_array_equal(np.sort(indices[used]), expected)
    np.testing.assert_array_equal(values[used], x[indices[used]])
    regimes.add(count > k)
  assert regimes == {True, False}
