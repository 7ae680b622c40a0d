"""The input data aggregator: aggregated data points (paper 002 §3.2, Eq. 1, Table 3).

Once per worker, before training (§3.1, "pre-training stage"), three steps:

1. **Reduce features** (:mod:`gradcomp.edgegossip.reduction`): ``X`` (``N x
   d``) to ``X'`` (``N x d'``).
2. **Divide** ``X'`` into ``M`` subsets of similar points, each of one class
   ("each subsets consists of data points belonging to the same class", §3.2):
   :func:`kmeans_divide` (scikit-learn's K-means) or :func:`lsh_divide`
   (random-hyperplane buckets), class by class, about ``ratio`` points per
   subset (``N / ratio`` centroids or buckets, §4.3).
3. **Average** each subset over the *original* features (Eq. 1,
   :func:`average_subsets`): ``a_j = sum_k x_j^(k) / |X_i|``.

The paper's three methods (§4.2, Table 3) are :data:`METHODS`:
``"svd_kmeans"`` (per-sample SVD + K-means), ``"gha_lsh"`` (incremental SVD by
GHA + LSH) and ``"hash_kmeans"`` (hash fingerprint + K-means).
:func:`aggregate` runs one; :func:`time_aggregation` times each stage per
method and ratio, for §4.3's ordering (K-means dominates methods 1 and 3, the
incremental SVD method 2).

Readings (the paper leaves these open):

* **Subsets per class.** Class ``c`` with ``N_c`` samples gets ``k_c =
  max(1, round(N_c / ratio))`` subsets (half up), so ``M`` is about ``N /
  ratio`` (§4.3) and no subset mixes classes. K-means is capped at the number
  of distinct reduced points of the class.
* **K-means.** scikit-learn's :class:`~sklearn.cluster.KMeans`, k-means++
  start, one start, at most ``iterations`` Lloyd iterations (§4.3: 20).
  Cluster sizes vary around ``ratio`` (Fig. 4 shows 1 to 7 points per subset).
* **LSH.** §4.3 fixes the number of buckets, ``N / ratio``; a fixed-width hash
  cannot. We bucket with random hyperplanes placed at quantiles: a class's
  points are split at the hyperplane normal to a random Gaussian direction
  ``a_l`` (one per depth ``l``, shared by all buckets at that depth) that
  leaves ``floor(n k1 / k)`` of the ``n`` points on the low side, ``k1 =
  floor(k / 2)``, recursively, until ``k_c`` buckets remain: a data-dependent
  random-projection LSH (a random projection tree, Dasgupta & Freund 2008).
  Every bucket holds ``floor(N_c / k_c)`` or ``ceil(N_c / k_c)`` points.
* **Numbering.** Subsets are numbered by class, then by their smallest sample
  index; members are listed in increasing sample index. A result therefore
  depends on the partition only, not on K-means' label permutation, and is
  deterministic given ``seed``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from sklearn.cluster import KMeans

from gradcomp.edgegossip import reduction
from gradcomp.edgegossip.reduction import (
  DEFAULT_GHA_LEARNING_RATE,
  DEFAULT_ITERATIONS,
  _check_int,
  _check_seed,
  as_samples,
)

#: The paper's three methods (§4.2 "three input data generation methods").
METHODS = ("svd_kmeans", "gha_lsh", "hash_kmeans")
#: §4.2: the aggregation ratio is 10; §4.3 and §4.5 also test 5 and 20.
DEFAULT_RATIO = 10
PAPER_RATIOS = (5, 10, 20)


@dataclasses.dataclass(frozen=True, eq=False)
class Aggregation:
  """Aggregated data points and the subsets they stand for (paper 002 §3.2).

  Attributes:
    points: ``(M, d)`` float; row ``m`` is the mean over subset ``m``'s
      original features (Eq. 1), flattened as :func:`as_samples` does.
    labels: ``(M,)`` int64, subset ``m``'s class (every member has it).
    assignment: ``(N,)`` int64, the subset of each sample.
    indices: ``(N,)`` int64, sample indices grouped by subset: subset ``m`` is
      ``indices[offsets[m]:offsets[m + 1]]``, increasing.
    offsets: ``(M + 1,)`` int64, ``offsets[0] = 0``, ``offsets[M] = N``.

  Examples:
    Samples 0 and 1 form one subset, 3 and 2 one each (numbered by class, then
    smallest member):

    >>> import numpy as np
    >>> x = np.array([[0.0, 0.0], [2.0, 2.0], [10.0, 0.0], [4.0, 4.0]])
    >>> agg = average_subsets(x, [0, 0, 1, 0], [5, 5, 7, 6])
    >>> agg.num_subsets, agg.sizes.tolist(), [s.tolist() for s in agg.subsets()]
    (3, [2, 1, 1], [[0, 1], [3], [2]])
    >>> agg.offsets.tolist(), agg.subset(0).tolist()
    ([0, 2, 3, 4], [0, 1])
  """

  points: np.ndarray
  labels: np.ndarray
  assignment: np.ndarray
  indices: np.ndarray
  offsets: np.ndarray

  @property
  def num_subsets(self) -> int:
    """``M``, the number of subsets (and aggregated points)."""
    return int(self.labels.shape[0])

  @property
  def sizes(self) -> np.ndarray:
    """``(M,)`` int64, ``|X_m|``: each subset's number of samples."""
    return np.diff(self.offsets)

  def subset(self, m: int) -> np.ndarray:
    """The sample indices of subset ``m``, increasing."""
    if not 0 <= m < self.num_subsets:
      raise ValueError(f"m must be in [0, {self.num_subsets}), got {m!r}")
    return self.indices[self.offsets[m] : self.offsets[m + 1]]

  def subsets(self) -> list[np.ndarray]:
    """Every subset's sample indices, in subset order (for the trainer's ordering)."""
    return np.split(self.indices, self.offsets[1:-1])


def _check_labels(y: ArrayLike, n: int) -> np.ndarray:
  labels = np.asarray(y)
  if labels.shape != (n,):
    raise ValueError(f"y must have shape (N,) = ({n},), got {labels.shape}")
  if labels.dtype.kind not in "iu":
    raise ValueError(f"y must hold integer class labels, got dtype {labels.dtype}")
  return labels.astype(np.int64)


def _check_ratio(ratio) -> int:
  return _check_int("ratio", ratio, 1)


def _check_method(method) -> str:
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  return method


def subsets_per_class(count: int, ratio: int) -> int:
  """``k_c = max(1, round(count / ratio))``, rounding half up (module docstring).

  Examples:
    >>> [subsets_per_class(n, 10) for n in (1, 14, 15, 180)]
    [1, 1, 2, 18]
  """
  count = _check_int("count", count, 1)
  ratio = _check_ratio(ratio)
  return max(1, (2 * count + ratio) // (2 * ratio))


def _class_seeds(classes: np.ndarray, seed: int) -> dict[int, int]:
  states = np.random.SeedSequence(seed).generate_state(len(classes))
  return {int(c): int(s) for c, s in zip(classes, states, strict=True)}


def _divide(
  reduced: ArrayLike,
  y: ArrayLike,
  ratio: int,
  seed: int,
  split: Callable[[np.ndarray, int, int], np.ndarray],
) -> np.ndarray:
  """Class by class: ``split(points, k, seed)`` -> a local label per point."""
  z = as_samples(reduced)
  labels = _check_labels(y, z.shape[0])
  ratio = _check_ratio(ratio)
  seed = _check_seed(seed)
  classes = np.unique(labels)
  seeds = _class_seeds(classes, seed)
  assignment = np.empty(z.shape[0], dtype=np.int64)
  next_id = 0
  for c in classes:
    rows = np.flatnonzero(labels == c)
    k = subsets_per_class(rows.size, ratio)
    local = split(z[rows], k, seeds[int(c)]) if k > 1 else np.zeros(rows.size, int)
    _, local = np.unique(local, return_inverse=True)
    assignment[rows] = next_id + local
    next_id += int(local.max()) + 1
  return _canonical(assignment, labels)


def _canonical(assignment: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """Renumber subsets by (class, smallest member index)."""
  ids, first = np.unique(assignment, return_index=True)
  order = np.lexsort((first, labels[first]))
  rank = np.empty(ids.size, dtype=np.int64)
  rank[order] = np.arange(ids.size)
  return rank[np.searchsorted(ids, assignment)]


def kmeans_divide(
  reduced: ArrayLike,
  y: ArrayLike,
  ratio: int = DEFAULT_RATIO,
  *,
  iterations: int = DEFAULT_ITERATIONS,
  seed: int = 0,
) -> np.ndarray:
  """Single-class subsets by K-means on the reduced features (paper 002 §3.2, §4.3).

  Class ``c``'s points are clustered into ``k_c = max(1, round(N_c / ratio))``
  clusters (capped at its number of distinct points) by scikit-learn's
  :class:`~sklearn.cluster.KMeans` (k-means++, one start, at most
  ``iterations`` iterations). ``O(d' M e N)`` per Table 3.

  Args:
    reduced: ``(N, d')`` reduced features.
    y: ``(N,)`` integer class labels.
    ratio: samples per subset on average, >= 1.
    iterations: K-means' maximum iterations, >= 1 (the paper's 20).
    seed: seeds each class's K-means.

  Returns:
    ``(N,)`` int64 subset of each sample, numbered as the module docstring says.

  Examples:
    Six points of one class, ``ratio=2``: three clusters, around 0, 5 and 9.

    >>> import numpy as np
    >>> z = np.array([[0.0], [5.0], [0.1], [5.1], [9.0], [9.2]])
    >>> kmeans_divide(z, np.zeros(6, int), ratio=2).tolist()
    [0, 1, 0, 1, 2, 2]
  """
  iterations = _check_int("iterations", iterations, 1)

  def split(z: np.ndarray, k: int, state: int) -> np.ndarray:
    k = min(k, np.unique(z, axis=0).shape[0])
    if k == 1:
      return np.zeros(z.shape[0], dtype=np.int64)
    km = KMeans(n_clusters=k, n_init=1, max_iter=iterations, random_state=state)
    return km.fit_predict(z)

  return _divide(reduced, y, ratio, seed, split)


def _bisect(z: np.ndarray, k: int, directions: np.ndarray) -> np.ndarray:
  """Split ``z`` into ``k`` buckets by quantile hyperplanes (module docstring)."""
  local = np.empty(z.shape[0], dtype=np.int64)
  counter = 0

  def rec(rows: np.ndarray, k: int, depth: int) -> None:
    nonlocal counter
    if k == 1:
      local[rows] = counter
      counter += 1
      return
    k1 = k // 2
    n1 = rows.size * k1 // k
    order = np.argsort(z[rows] @ directions[depth], kind="stable")
    rec(rows[order[:n1]], k1, depth + 1)
    rec(rows[order[n1:]], k - k1, depth + 1)

  rec(np.arange(z.shape[0]), k, 0)
  return local


def lsh_divide(
  reduced: ArrayLike,
  y: ArrayLike,
  ratio: int = DEFAULT_RATIO,
  *,
  seed: int = 0,
) -> np.ndarray:
  """Single-class subsets by random-hyperplane buckets (paper 002 §3.2, §4.3).

  Class ``c``'s ``N_c`` points go into exactly ``k_c = max(1, round(N_c /
  ratio))`` buckets of ``floor(N_c / k_c)`` or ``ceil(N_c / k_c)`` points,
  split recursively at quantile hyperplanes with random Gaussian normals (the
  module docstring's reading of §4.3's "the number of buckets is N /
  aggregation ratio"). ``O(d' N log N)`` as Table 3's LSH.

  Args:
    reduced: ``(N, d')`` reduced features.
    y: ``(N,)`` integer class labels.
    ratio: samples per bucket on average, >= 1.
    seed: seeds the hyperplanes' normals.

  Returns:
    ``(N,)`` int64 subset of each sample, numbered as the module docstring says.

  Examples:
    Seven points of one class, ``ratio=2``: ``round(3.5) = 4`` buckets of
    ``floor(7 / 4)`` or ``ceil(7 / 4)`` points; with two classes, no bucket
    mixes them.

    >>> import numpy as np
    >>> z = np.random.default_rng(0).standard_normal((7, 3))
    >>> np.bincount(lsh_divide(z, np.zeros(7, int), ratio=2)).tolist()
    [2, 2, 2, 1]
    >>> lsh_divide(z, np.array([0, 0, 0, 0, 1, 1, 1]), ratio=3).tolist()
    [0, 0, 0, 0, 1, 1, 1]
  """

  def split(z: np.ndarray, k: int, state: int) -> np.ndarray:
    depth = math.ceil(math.log2(k))
    directions = np.random.default_rng(state).standard_normal((depth, z.shape[1]))
    return _bisect(z, k, directions)

  return _divide(reduced, y, ratio, seed, split)


def average_subsets(x: ArrayLike, y: ArrayLike, assignment: ArrayLike) -> Aggregation:
  """Aggregated points: each subset's mean over the original features (Eq. 1).

  Args:
    x: ``(N, d)`` (or ``(N, ...)``) original samples.
    y: ``(N,)`` integer labels; every subset must be of one class.
    assignment: ``(N,)`` integer subset of each sample (any numbering; it is
      renumbered as the module docstring says).

  Returns:
    The :class:`Aggregation`.

  Examples:
    Any numbering goes in (5, 6, 7 here); subsets come out numbered by class,
    then by smallest member, each point the mean of its members:

    >>> import numpy as np
    >>> x = np.array([[0.0, 0.0], [2.0, 2.0], [10.0, 0.0], [4.0, 4.0]])
    >>> agg = average_subsets(x, [0, 0, 1, 0], [5, 5, 7, 6])
    >>> agg.points.tolist(), agg.labels.tolist(), agg.assignment.tolist()
    ([[1.0, 1.0], [4.0, 4.0], [10.0, 0.0]], [0, 0, 1], [0, 0, 2, 1])
  """
  a = as_samples(x)
  labels = _check_labels(y, a.shape[0])
  assign = np.asarray(assignment)
  if assign.shape != labels.shape or assign.dtype.kind not in "iu":
    raise ValueError(
      f"assignment must be an integer array of shape ({a.shape[0]},), "
      f"got {assign.dtype} {assign.shape}"
    )
  assign = _canonical(assign.astype(np.int64), labels)
  indices = np.argsort(assign, kind="stable")
  sizes = np.bincount(assign)
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  grouped = labels[indices]
  subset_labels = grouped[offsets[:-1]]
  mixed = np.flatnonzero(
    np.add.reduceat(grouped != np.repeat(subset_labels, sizes), offsets[:-1])
  )
  if mixed.size:
    raise ValueError(
      f"assignment must give single-class subsets; subset {int(mixed[0])} mixes classes"
    )
  points = np.add.reduceat(a[indices], offsets[:-1], axis=0) / sizes[:, None]
  return Aggregation(
    points=points.astype(a.dtype),
    labels=subset_labels,
    assignment=assign,
    indices=indices.astype(np.int64),
    offsets=offsets,
  )


def reduce_features(
  x: ArrayLike,
  method: str = "svd_kmeans",
  *,
  ratio: int = DEFAULT_RATIO,
  components: int | None = None,
  image_shape: Sequence[int] | None = None,
  iterations: int = DEFAULT_ITERATIONS,
  learning_rate: float = DEFAULT_GHA_LEARNING_RATE,
  seed: int = 0,
) -> np.ndarray:
  """Step 1 of ``method`` (:func:`aggregate`'s arguments): ``X`` to ``X'``.

  ``components`` is ``d'``: singular values per sample (default 10), GHA's
  components (default :func:`~gradcomp.edgegossip.reduction.gha_components`
  of ``d`` and ``ratio``) or the fingerprint length (default 10).

  Examples:
    On 64 features (read as 8 x 8 images): 8 singular values, 1 GHA
    component (``log2(6.4 / 10)`` clipped to 1) and a 10-value fingerprint.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).random((20, 64))
    >>> [reduce_features(x, m).shape for m in METHODS]
    [(20, 8), (20, 1), (20, 10)]
  """
  method = _check_method(method)
  ratio = _check_ratio(ratio)
  raw = np.asarray(x)
  if method == "svd_kmeans":
    n_values = reduction.DEFAULT_SVD_VALUES if components is None else components
    return reduction.svd_features(raw, n_values, image_shape=image_shape)
  if method == "hash_kmeans":
    length = reduction.DEFAULT_HASH_LENGTH if components is None else components
    return reduction.hash_features(raw, length, seed=seed)
  a = as_samples(raw)
  if components is None:
    components = reduction.gha_components(a.shape[1], ratio)
  return reduction.gha_features(
    a, components, iterations=iterations, learning_rate=learning_rate, seed=seed
  )


def _stage_seeds(seed) -> tuple[int, int]:
  states = np.random.SeedSequence(_check_seed(seed)).generate_state(2)
  return int(states[0]), int(states[1])


def divide(
  reduced: ArrayLike,
  y: ArrayLike,
  method: str = "svd_kmeans",
  *,
  ratio: int = DEFAULT_RATIO,
  iterations: int = DEFAULT_ITERATIONS,
  seed: int = 0,
) -> np.ndarray:
  """Step 2 of ``method``: K-means (methods 1 and 3) or LSH (method 2).

  Examples:
    >>> import numpy as np
    >>> z, y = np.array([[0.0], [5.0], [0.1], [5.1], [9.0], [9.2]]), np.zeros(6, int)
    >>> divide(z, y, "svd_kmeans", ratio=2).tolist()  # kmeans_divide
    [0, 1, 0, 1, 2, 2]
    >>> divide(z, y, "gha_lsh", ratio=2).tolist()  # lsh_divide
    [0, 1, 0, 1, 2, 2]
  """
  if _check_method(method) == "gha_lsh":
    return lsh_divide(reduced, y, ratio, seed=seed)
  return kmeans_divide(reduced, y, ratio, iterations=iterations, seed=seed)


def aggregate(
  x: ArrayLike,
  y: ArrayLike,
  *,
  method: str = "svd_kmeans",
  ratio: int = DEFAULT_RATIO,
  components: int | None = None,
  image_shape: Sequence[int] | None = None,
  iterations: int = DEFAULT_ITERATIONS,
  learning_rate: float = DEFAULT_GHA_LEARNING_RATE,
  seed: int = 0,
) -> Aggregation:
  """One worker's aggregated data points (paper 002 §3.2, Eq. 1; §4.2's methods).

  Args:
    x: ``(N, d)`` features or ``(N, h, w[, c])`` images of one worker.
    y: ``(N,)`` integer class labels.
    method: one of :data:`METHODS`.
    ratio: the aggregation ratio, samples per subset on average, >= 1 (the
      paper's 10; 5 and 20 in §4.3).
    components: the reduced dimensionality ``d'`` (:func:`reduce_features`).
    image_shape: how a flat sample is read as a matrix for the per-sample SVD.
    iterations: GHA's epochs and K-means' maximum iterations (§4.3: 20).
    learning_rate: GHA's learning rate (:func:`~gradcomp.edgegossip.reduction.gha`).
    seed: seeds every random choice; the result is a function of the inputs.

  Returns:
    The :class:`Aggregation`.

  Examples:
    >>> from sklearn.datasets import load_digits
    >>> x, y = load_digits(return_X_y=True)
    >>> agg = aggregate(x[:200], y[:200], method="gha_lsh", ratio=10)
    >>> agg.num_subsets, int(agg.sizes.sum())
    (20, 200)
  """
  reduce_seed, divide_seed = _stage_seeds(seed)
  reduced = reduce_features(
    x,
    method,
    ratio=ratio,
    components=components,
    image_shape=image_shape,
    iterations=iterations,
    learning_rate=learning_rate,
    seed=reduce_seed,
  )
  assignment = divide(
    reduced, y, method, ratio=ratio, iterations=iterations, seed=divide_seed
  )
  return average_subsets(x, y, assignment)


class StageTimes(NamedTuple):
  """Seconds per aggregation stage (paper 002 §4.3, Fig. 7): the best of repeats.

  Examples:
    >>> st = StageTimes("gha_lsh", 10, 4, 0.5, 0.25, 0.125)
    >>> st.subsets, st.total_seconds
    (4, 0.875)
  """

  method: str
  ratio: int
  subsets: int  # M, the number of aggregated points
  reduce_seconds: float  # step 1, feature reduction
  divide_seconds: float  # step 2, K-means or LSH
  average_seconds: float  # step 3, Eq. 1

  @property
  def total_seconds(self) -> float:
    return self.reduce_seconds + self.divide_seconds + self.average_seconds


def time_aggregation(
  x: ArrayLike,
  y: ArrayLike,
  *,
  methods: Sequence[str] = METHODS,
  ratios: Sequence[int] = PAPER_RATIOS,
  repeats: int = 1,
  seed: int = 0,
  **options,
) -> list[StageTimes]:
  """Time each stage of :func:`aggregate`, per method and ratio (paper 002 §4.3).

  Each stage is timed with :func:`time.perf_counter`, the minimum over
  ``repeats`` runs; ``options`` go to :func:`aggregate` (``components``,
  ``iterations``, ...). §4.3 reports K-means dominating methods 1 and 3 and
  the incremental SVD dominating method 2.

  Args:
    x: ``(N, d)`` samples (or ``(N, ...)`` images).
    y: ``(N,)`` integer labels.
    methods: methods from :data:`METHODS`.
    ratios: aggregation ratios, each >= 1.
    repeats: runs per (method, ratio), >= 1.
    seed: as :func:`aggregate`.

  Returns:
    One :class:`StageTimes` per (method, ratio), methods outermost.

  Examples:
    Two classes of 10 samples: ratio 5 gives 2 subsets per class, ratio 10
    one. The seconds are this machine's.

    >>> import numpy as np
    >>> x, y = np.random.default_rng(0).random((20, 64)), np.repeat([0, 1], 10)
    >>> methods = ("gha_lsh", "hash_kmeans")
    >>> for row in time_aggregation(x, y, methods=methods, ratios=(5, 10)):
    ...   print(row.method, row.ratio, row.subsets)
    gha_lsh 5 4
    gha_lsh 10 2
    hash_kmeans 5 4
    hash_kmeans 10 2
  """
  repeats = _check_int("repeats", repeats, 1)
  methods = [_check_method(m) for m in methods]
  ratios = [_check_ratio(r) for r in ratios]
  unknown = set(options) - {
    "components",
    "image_shape",
    "iterations",
    "learning_rate",
  }
  if unknown:
    raise ValueError(f"options must be aggregate's keywords, got {sorted(unknown)}")
  iterations = options.pop("iterations", DEFAULT_ITERATIONS)
  reduce_seed, divide_seed = _stage_seeds(seed)
  rows = []
  for method in methods:
    for ratio in ratios:
      best = [math.inf] * 3
      for _ in range(repeats):
        t0 = time.perf_counter()
        reduced = reduce_features(
          x, method, ratio=ratio, iterations=iterations, seed=reduce_seed, **options
        )
        t1 = time.perf_counter()
        assignment = divide(
          reduced, y, method, ratio=ratio, iterations=iterations, seed=divide_seed
        )
        t2 = time.perf_counter()
        agg = average_subsets(x, y, assignment)
        t3 = time.perf_counter()
        best = [
          min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2), strict=True)
        ]
      rows.append(StageTimes(method, ratio, agg.num_subsets, *best))
  return rows
