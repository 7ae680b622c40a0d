"""EdgeGossip's input data aggregator (paper 002 §3.2, Eq. 1, Table 3).

Each reduction is checked against a closed form or an independent computation
(eigenvalues of ``A^T A`` for the per-sample SVD, the covariance's eigenvectors
for GHA, linearity for the hash), each division against a partition known in
advance (tight blobs for K-means, sorted runs and exact sizes for the LSH
buckets), and the averages against a loop. NumPy and scikit-learn only.
"""

import doctest

import numpy as np
import pytest
from sklearn.datasets import load_digits, make_blobs

from gradcomp import edgegossip as eg
from gradcomp.edgegossip import aggregator, balancer, ordering, predictor, reduction


@pytest.fixture(scope="module")
def digits():
  """One worker's shard of digits: 450 samples, 64 features, labels 0-9."""
  x, y = load_digits(return_X_y=True)
  return x[:450], y[:450]


def test_doctests():
  for module in (reduction, aggregator, balancer, ordering, predictor):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0, module.__name__


# -- step 1: feature reduction ---------------------------------------------------------


def test_svd_features_closed_forms():
  rng = np.random.default_rng(0)
  # A rank-one image u v^T has one singular value, |u| |v|.
  u, v = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
  rank_one = np.einsum("ni,nj->nij", u, v)
  got = eg.svd_features(rank_one.reshape(5, 64))
  assert got.shape == (5, 8)  # 8 x 8 images: min(10, 8, 8) values
  np.testing.assert_allclose(
    got[:, 0], np.linalg.norm(u, axis=1) * np.linalg.norm(v, axis=1), rtol=1e-12
  )
  np.testing.assert_allclose(got[:, 1:], 0.0, atol=1e-12)
  # Any image: the square roots of A^T A's eigenvalues, descending.
  x = rng.standard_normal((4, 6, 10))
  ref = np.sqrt(np.clip(np.linalg.eigvalsh(np.einsum("nij,nik->njk", x, x)), 0, None))
  np.testing.assert_allclose(eg.svd_features(x), ref[:, ::-1][:, :6], atol=1e-10)
  np.testing.assert_allclose(eg.svd_features(x, 3), ref[:, ::-1][:, :3], atol=1e-10)
  # A flat sample is read as the most nearly square matrix; image_shape overrides.
  flat = x.reshape(4, 60)
  np.testing.assert_allclose(
    eg.svd_features(flat, image_shape=(6, 10)), ref[:, ::-1][:, :6], atol=1e-10
  )
  assert eg.svd_features(flat).shape == (4, 6)  # 60 = 6 x 10
  assert eg.svd_features(rng.standard_normal((2, 4, 4, 3))).shape == (2, 4)  # 4 x 12


def test_gha_recovers_the_principal_subspace():
  rng = np.random.default_rng(0)
  d = 20
  lam = np.array([5.0, 3.0, 2.0] + [0.2] * (d - 3))
  q = np.linalg.qr(rng.standard_normal((d, d)))[0]
  x = (rng.standard_normal((600, d)) * np.sqrt(lam)) @ q.T + 3.0
  w = eg.gha(x, 3, seed=1)
  assert w.shape == (3, d)
  np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, atol=0.02)
  # Independent: the top right singular vectors of the centred data, by SVD.
  vt = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)[2][:3]
  cosines = np.abs(np.sum(w * vt, axis=1)) / np.linalg.norm(w, axis=1)
  assert np.all(cosines > 0.98), cosines
  projector = lambda m: m.T @ np.linalg.pinv(m.T)
  assert np.linalg.norm(projector(w) - projector(vt)) < 0.1
  # Features are the centred data on W; the seed fixes everything.
  np.testing.assert_array_equal(eg.gha(x, 3, seed=1), w)
  np.testing.assert_allclose(eg.gha_features(x, 3, seed=1), (x - x.mean(0)) @ w.T)
  assert not np.allclose(eg.gha(x, 3, seed=2, iterations=1), w)


def test_gha_components_follows_section_4_3():
  # d' = log2(0.1 d / ratio), rounded, clipped to [1, d].
  assert [eg.gha_components(3072, r) for r in (5, 10, 20)] == [6, 5, 4]
  assert eg.gha_components(784, 10) == 3
  assert [eg.gha_components(64, r) for r in (5, 10, 20)] == [1, 1, 1]
  assert eg.gha_components(4, 1) == 1


def test_hash_features_is_the_signed_hashing_trick():
  rng = np.random.default_rng(0)
  d, length = 50, 10
  h = eg.hash_features(np.eye(d), length, seed=3)
  # Each feature lands in exactly one bucket, with sign +-1.
  assert np.all(np.count_nonzero(h, axis=1) == 1)
  assert set(np.unique(h[h != 0])) <= {-1.0, 1.0}
  # The fingerprint is the linear map x -> x H, with H read off unit vectors.
  a, b = rng.standard_normal((2, 7, d))
  np.testing.assert_allclose(eg.hash_features(a, length, seed=3), a @ h, atol=1e-12)
  np.testing.assert_allclose(
    eg.hash_features(2 * a - 3 * b, length, seed=3),
    2 * eg.hash_features(a, length, seed=3) - 3 * eg.hash_features(b, length, seed=3),
    atol=1e-12,
  )
  assert not np.array_equal(eg.hash_features(np.eye(d), length, seed=4), h)
  f32 = eg.hash_features(a.astype(np.float32), length)
  assert f32.dtype == np.float32


# -- step 2: division ------------------------------------------------------------------


def _partition(assignment):
  return {frozenset(np.flatnonzero(assignment == m)) for m in np.unique(assignment)}


def test_kmeans_divide_recovers_tight_blobs():
  # Two classes, each made of tight far-apart blobs of exactly `ratio` points.
  ratio, xs, ys, truth = 5, [], [], []
  for label, blobs in ((0, 4), (1, 3)):
    centers = np.random.default_rng(label).uniform(-100, 100, (blobs, 3))
    x, blob = make_blobs(
      [ratio] * blobs, centers=centers, cluster_std=0.01, random_state=label
    )
    xs.append(x)
    ys.append(np.full(len(x), label))
    truth.append(blob + 10 * label)
  x, y, truth = np.concatenate(xs), np.concatenate(ys), np.concatenate(truth)
  assignment = eg.kmeans_divide(x, y, ratio, seed=0)
  assert _partition(assignment) == _partition(truth)
  # Numbered by class, then by smallest member; deterministic given the seed.
  firsts = [np.flatnonzero(assignment == m)[0] for m in range(assignment.max() + 1)]
  assert [y[i] for i in firsts] == sorted(y[i] for i in firsts)
  np.testing.assert_array_equal(eg.kmeans_divide(x, y, ratio, seed=0), assignment)


def test_kmeans_divide_caps_at_distinct_points():
  x = np.repeat(np.array([[0.0], [1.0], [2.0]]), 10, axis=0)  # 3 distinct points
  y = np.zeros(30, dtype=int)
  assignment = eg.kmeans_divide(x, y, ratio=2)  # asks round(30 / 2) = 15 clusters
  assert _partition(assignment) == {
    frozenset(range(0, 10)),
    frozenset(range(10, 20)),
    frozenset(range(20, 30)),
  }


def test_lsh_divide_exact_bucket_counts_and_sizes():
  rng = np.random.default_rng(0)
  counts = {0: 37, 3: 100, 5: 7, 9: 1}
  y = rng.permutation(np.concatenate([np.full(n, c) for c, n in counts.items()]))
  z = rng.standard_normal((y.size, 4))
  ratio = 10
  assignment = eg.lsh_divide(z, y, ratio, seed=1)
  for c, n in counts.items():
    k = eg.subsets_per_class(n, ratio)
    assert k == max(1, int(np.floor(n / ratio + 0.5)))
    ids = np.unique(assignment[y == c])
    assert ids.size == k
    sizes = [np.sum(assignment == m) for m in ids]
    assert set(sizes) <= {n // k, -(-n // k)}, (c, sizes)
  # Single class per subset.
  for m in np.unique(assignment):
    assert np.unique(y[assignment == m]).size == 1
  np.testing.assert_array_equal(eg.lsh_divide(z, y, ratio, seed=1), assignment)
  assert not np.array_equal(eg.lsh_divide(z, y, ratio, seed=2), assignment)


def test_lsh_divide_on_a_line_cuts_sorted_runs():
  # In one dimension every hyperplane is a threshold: buckets are sorted runs.
  rng = np.random.default_rng(0)
  z = rng.standard_normal((53, 1))
  y = np.zeros(53, dtype=int)
  assignment = eg.lsh_divide(z, y, ratio=6)
  runs = assignment[np.argsort(z[:, 0])]
  assert np.count_nonzero(np.diff(runs)) == np.unique(runs).size - 1


# -- step 3 and the whole --------------------------------------------------------------


def test_average_subsets_matches_a_loop(digits):
  x, y = digits
  rng = np.random.default_rng(0)
  assignment = 100 * y + rng.integers(0, 5, y.size)  # single-class, arbitrary ids
  agg = eg.average_subsets(x, y, assignment)
  m = agg.num_subsets
  assert agg.points.shape == (m, 64) and agg.offsets[0] == 0 and agg.offsets[-1] == 450
  np.testing.assert_array_equal(np.sort(agg.indices), np.arange(450))
  assert _partition(agg.assignment) == _partition(assignment)
  keys = []
  for k in range(m):
    members = agg.subset(k)
    np.testing.assert_array_equal(members, np.flatnonzero(agg.assignment == k))
    np.testing.assert_allclose(agg.points[k], x[members].mean(axis=0), rtol=1e-12)
    assert np.all(y[members] == agg.labels[k])
    keys.append((agg.labels[k], members[0]))
  assert keys == sorted(keys)  # numbered by (class, smallest member)
  assert [s.tolist() for s in agg.subsets()] == [
    agg.subset(k).tolist() for k in range(m)
  ]
  np.testing.assert_array_equal(agg.sizes, [agg.subset(k).size for k in range(m)])
  with pytest.raises(ValueError, match="single-class"):
    eg.average_subsets(x, y, np.zeros(450, dtype=int))


@pytest.mark.parametrize("method", eg.METHODS)
def test_aggregate_each_method_on_digits(digits, method):
  x, y = digits
  rng = np.random.default_rng(0)
  for ratio in (5, 10, 20):
    agg = eg.aggregate(x, y, method=method, ratio=ratio, seed=0)
    np.testing.assert_array_equal(np.sort(agg.indices), np.arange(450))
    expected = sum(eg.subsets_per_class(n, ratio) for n in np.bincount(y))
    if method == "gha_lsh":
      assert agg.num_subsets == expected
    else:
      assert 0.8 * expected <= agg.num_subsets <= expected
    for k in range(agg.num_subsets):
      members = agg.subset(k)
      assert np.all(y[members] == agg.labels[k])
      np.testing.assert_allclose(agg.points[k], x[members].mean(axis=0), rtol=1e-12)
    # Similarity preserved: members sit closer to their mean than in random
    # single-class subsets of the same sizes.
    spread = np.mean(np.sum((x - agg.points[agg.assignment]) ** 2, axis=1))
    shuffled = np.empty_like(agg.assignment)
    for c in np.unique(y):
      rows = np.flatnonzero(y == c)
      shuffled[rows] = rng.permutation(agg.assignment[rows])
    rand = eg.average_subsets(x, y, shuffled)
    rand_spread = np.mean(np.sum((x - rand.points[rand.assignment]) ** 2, axis=1))
    assert spread < 0.95 * rand_spread, (method, ratio, spread, rand_spread)
  again = eg.aggregate(x, y, method=method, ratio=20, seed=0)
  np.testing.assert_array_equal(again.assignment, agg.assignment)
  np.testing.assert_array_equal(again.points, agg.points)


def test_aggregate_takes_images_and_components(digits):
  x, y = digits
  flat = eg.aggregate(x, y, method="svd_kmeans", seed=0)
  images = eg.aggregate(x.reshape(-1, 8, 8), y, method="svd_kmeans", seed=0)
  np.testing.assert_array_equal(flat.assignment, images.assignment)
  np.testing.assert_allclose(images.points, flat.points)
  reduced = eg.reduce_features(x, "gha_lsh", components=3)
  assert reduced.shape == (450, 3)
  assert eg.reduce_features(x, "hash_kmeans", components=4).shape == (450, 4)
  assert eg.reduce_features(x, "gha_lsh", ratio=5).shape == (450, 1)  # §4.3's d'


def test_time_aggregation_rows(digits):
  x, y = digits
  x, y = x[:200], y[:200]
  rows = eg.time_aggregation(x, y, ratios=(10, 20), components=4)
  assert [(r.method, r.ratio) for r in rows] == [
    (m, r) for m in eg.METHODS for r in (10, 20)
  ]
  for r in rows:
    stages = (r.reduce_seconds, r.divide_seconds, r.average_seconds)
    assert all(np.isfinite(s) and s >= 0 for s in stages)
    assert r.total_seconds == pytest.approx(sum(stages))
    agg = eg.aggregate(x, y, method=r.method, ratio=r.ratio, components=4)
    assert r.subsets == agg.num_subsets
  with pytest.raises(ValueError, match="options"):
    eg.time_aggregation(x, y, ratio=5)
  with pytest.raises(ValueError, match="repeats"):
    eg.time_aggregation(x, y, repeats=0)


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda x, y: eg.aggregate(x, y, ratio=0), r"ratio must be an integer >= 1, got 0"),
    (lambda x, y: eg.aggregate(x, y, ratio=2.5), r"ratio .* got 2.5"),
    (lambda x, y: eg.aggregate(x, y, method="pca"), r"method must be one of .* 'pca'"),
    (lambda x, y: eg.aggregate(x, y, seed=-1), r"seed must be an integer >= 0"),
    (lambda x, y: eg.aggregate(x[0], y), r"x must have shape"),
    (lambda x, y: eg.aggregate(x, y[:-1]), r"y must have shape \(N,\) = \(450,\)"),
    (lambda x, y: eg.aggregate(x, y + 0.5), r"y must hold integer"),
    (lambda x, y: eg.aggregate(np.where(x > 15, np.nan, x), y), r"x must be finite"),
    (lambda x, y: eg.gha(x, 65), r"components must be in \[1, d = 64\], got 65"),
    (lambda x, y: eg.gha(x, 2, learning_rate=2.0), r"learning_rate must be in"),
    (lambda x, y: eg.svd_features(x, 0), r"n_values must be an integer >= 1"),
    (lambda x, y: eg.svd_features(x, image_shape=(7, 9)), r"image_shape"),
    (lambda x, y: eg.hash_features(x, 0), r"length must be an integer >= 1"),
    (lambda x, y: eg.kmeans_divide(x, y, iterations=0), r"iterations must be"),
  ],
)
def test_aggregator_rejects_bad_inputs(digits, call, match):
  with pytest.raises(ValueError, match=match):
    call(*digits)
