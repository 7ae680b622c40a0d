"""Step 1 of the input data aggregator: feature reduction (paper 002 §3.2, Table 3).

The aggregator first maps the ``N x d`` local data ``X`` to an ``N x d'``
dataset ``X'`` (``d' << d``) on which similar points stay close, so that the
division step (:mod:`gradcomp.edgegossip.aggregator`) is cheap. Paper 002
keeps three reductions (§3.2, Fig. 3, Table 3; settings in §4.3):

* :func:`svd_features` -- per-sample SVD: each sample, read as a matrix (an
  image), is replaced by its largest singular values (``d' = 10``).
  ``O(N d^{3/2})`` (Table 3): one ``sqrt(d) x sqrt(d)`` SVD per sample.
* :func:`gha` / :func:`gha_features` -- incremental SVD by the Generalized
  Hebbian Algorithm (Sanger 1989; Gorrell 2006, paper 002 ref. [40]): the
  rows of ``W`` converge to the top right singular vectors of the centred
  data, learnt a mini-batch at a time; ``X' = (X - mean) W^T``. ``d' =
  log2(0.1 d / ratio)`` (§4.3). ``O(d' e v N)`` (Table 3).
* :func:`hash_features` -- a hash "fingerprint" of length ``d' = 10``: the
  hashing trick (Weinberger et al. 2009), every original feature added with a
  random sign to one of ``d'`` hashed buckets. ``O(N d)`` (Table 3).

Readings (paper 002 leaves these open):

* **Per-sample SVD with fewer than 10 singular values.** A sample read as an
  ``h x w`` matrix has ``min(h, w)`` singular values: sklearn's 8 x 8 digits
  have 8. We keep ``min(n_values, h, w)``. Without ``image_shape`` a flat
  sample of ``d`` features is read as the most nearly square ``h x (d / h)``
  matrix; a ``(N, h, w, c)`` image batch is read as ``h x (w c)``.
* **GHA's settings.** §4.3 gives learning rate 0.001, "1 percent of original
  feature values", a constant ``l = 0.015`` and 20 iterations, on unstated
  data scaling. We centre the data and scale it to unit mean squared norm (so
  a learning rate means the same on any data), run ``iterations`` epochs of
  mini-batch Sanger updates over all samples and all features, and do not use
  ``l`` or the 1 % feature sampling (their role is not stated; 1 % of digits'
  64 features is under one feature). With the paper's learning rate 0.001 the
  weights barely leave their random start in 20 epochs on unit-scaled data,
  so our default is 0.3 (a keyword): on 450 digits samples, 20 epochs with
  3 components reach cosine 0.99 with the leading principal direction (0.17
  at 0.001), the rows keeping unit norm.
* **GHA's ``d'``.** ``log2(0.1 d / ratio)`` is rounded to the nearest integer
  and clipped to ``[1, d]``: it is negative for digits (``d = 64``) at every
  ratio the paper tests, and 5 / 5 / 4 for CIFAR-10 at ratios 5 / 10 / 20.
* **Hash.** The paper names "Hash" with a length-10 fingerprint and the cost
  ``O(N d)``, nothing more. We take the signed hashing trick, a linear map
  that preserves inner products in expectation, so K-means on fingerprints
  groups similar samples; the bucket and sign of each feature come from
  ``seed``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numpy.typing import ArrayLike

#: §4.3: "the number of singular value is 10"; "the fingerprint length ... is 10".
DEFAULT_SVD_VALUES = 10
DEFAULT_HASH_LENGTH = 10
#: §4.3: "the number of iterations is 20" (incremental SVD and K-means alike).
DEFAULT_ITERATIONS = 20
DEFAULT_GHA_LEARNING_RATE = 0.3
DEFAULT_GHA_BATCH = 32


def _check_int(name: str, value, low: int) -> int:
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
  return int(value)


def _check_seed(seed) -> int:
  return _check_int("seed", seed, 0)


def as_samples(x: ArrayLike) -> np.ndarray:
  """``x`` as a finite ``(N, d)`` float array, one flattened sample per row.

  Args:
    x: ``(N, d)`` features or ``(N, ...)`` images, real and finite, ``N >= 1``.

  Returns:
    ``(N, d)`` float64 array (float32 stays float32).
  """
  a = np.asarray(x)
  if a.ndim < 2 or a.shape[0] < 1 or a.size == 0:
    raise ValueError(
      f"x must have shape (N, d) or (N, ...) with N >= 1 and d >= 1, got {a.shape}"
    )
  if a.dtype.kind not in "iuf":
    raise ValueError(f"x must be a real numeric array, got dtype {a.dtype}")
  a = a.reshape(a.shape[0], -1)
  a = a if a.dtype == np.float32 else a.astype(np.float64)
  if not np.all(np.isfinite(a)):
    raise ValueError("x must be finite, got NaN or inf entries")
  return a


def _matrix_shape(x: np.ndarray, image_shape) -> tuple[int, int]:
  """The ``(h, w)`` matrix each sample is read as for the per-sample SVD."""
  if image_shape is not None:
    shape = tuple(int(s) for s in image_shape)
    if len(shape) not in (2, 3) or any(s < 1 for s in shape):
      raise ValueError(
        f"image_shape must be (h, w) or (h, w, c) of positive sizes, "
        f"got {image_shape!r}"
      )
    h, w = shape[0], math.prod(shape[1:])
  elif x.ndim >= 3:
    h, w = x.shape[1], math.prod(x.shape[2:])
  else:
    d = x.shape[1]
    h = max(k for k in range(1, math.isqrt(d) + 1) if d % k == 0)
    w = d // h
  d = math.prod(np.shape(x)[1:])
  if h * w != d:
    raise ValueError(
      f"image_shape {image_shape!r} holds {h * w} features, the samples have {d}"
    )
  return h, w


def svd_features(
  x: ArrayLike, n_values: int = DEFAULT_SVD_VALUES, *, image_shape=None
) -> np.ndarray:
  """Per-sample SVD: each sample's largest singular values (paper 002 §3.2, §4.3).

  Each sample is read as an ``h x w`` matrix ``A`` (the readings in the module
  docstring say which) and replaced by ``sigma_1(A) >= ... >= sigma_k(A)``,
  ``k = min(n_values, h, w)``: NumPy's batched SVD, no vectors.

  Args:
    x: ``(N, d)`` features or ``(N, h, w[, c])`` images.
    n_values: singular values kept per sample, >= 1 (the paper's 10).
    image_shape: ``(h, w)`` or ``(h, w, c)`` to read a flat ``(N, d)`` ``x``
      as images; ``None`` infers it (module docstring).

  Returns:
    ``(N, k)`` float array, descending along each row.

  Examples:
    >>> import numpy as np
    >>> u, v = np.arange(1.0, 5.0), np.ones(4)
    >>> svd_features(np.outer(u, v).reshape(1, 16), 2).round(6).tolist()
    [[10.954451, 0.0]]
  """
  n_values = _check_int("n_values", n_values, 1)
  raw = np.asarray(x)
  a = as_samples(raw)
  h, w = _matrix_shape(raw, image_shape)
  a = a.reshape(-1, h, w)
  values = np.linalg.svd(a, compute_uv=False)
  return values[:, : min(n_values, h, w)]


def gha_components(d: int, ratio: int) -> int:
  """GHA's reduced dimensionality ``d' = log2(0.1 d / ratio)`` (paper 002 §4.3).

  Rounded to the nearest integer and clipped to ``[1, d]`` (module docstring).

  Examples:
    >>> [gha_components(3072, r) for r in (5, 10, 20)], gha_components(64, 10)
    ([6, 5, 4], 1)
  """
  d = _check_int("d", d, 1)
  ratio = _check_int("ratio", ratio, 1)
  value = math.log2(0.1 * d / ratio)
  return int(min(d, max(1, math.floor(value + 0.5))))


def gha(
  x: ArrayLike,
  components: int,
  *,
  iterations: int = DEFAULT_ITERATIONS,
  learning_rate: float = DEFAULT_GHA_LEARNING_RATE,
  batch_size: int = DEFAULT_GHA_BATCH,
  seed: int = 0,
) -> np.ndarray:
  """Generalized Hebbian Algorithm: the top right singular vectors, incrementally.

  Sanger's rule (Sanger 1989; Gorrell 2006 uses it for incremental SVD, paper
  002 ref. [40], §3.2 "incremental SVD"), on mini-batches ``B`` of the
  centred, unit-scaled samples (module docstring):

  .. math::

    Y = B W^T, \\qquad
    W \\leftarrow W + \\frac{\\eta}{|B|}\\big(Y^T B - \\mathrm{tril}(Y^T Y) W\\big)

  The rows of ``W`` tend to the leading eigenvectors of the samples'
  covariance, in order, with unit norm: the right singular vectors of the
  centred data. One iteration is one pass over the samples in a seeded random
  order. The cost is ``O(d' e N d)`` (Table 3's ``O(d' e v N)`` with every
  attribute used, ``v = d``).

  Args:
    x: ``(N, d)`` samples (or ``(N, ...)``, flattened).
    components: rows of ``W``, ``d'``, in ``[1, d]``.
    iterations: passes over the data, >= 1 (the paper's 20).
    learning_rate: ``eta``, in ``(0, 1]``, on unit-scaled data.
    batch_size: samples per update, >= 1.
    seed: seeds ``W``'s random orthonormal start and the sample order.

  Returns:
    ``(components, d)`` float64 ``W``.

  Examples:
    Points spread along ``(0.6, 0.8)`` with a little noise: the one row of
    ``W`` is that direction (up to its sign), of unit norm.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = np.outer(rng.standard_normal(200), [0.6, 0.8])
    >>> x += 0.05 * rng.standard_normal((200, 2))
    >>> np.abs(gha(x, 1)).round(2).tolist()
    [[0.6, 0.8]]
  """
  a = as_samples(x).astype(np.float64)
  n, d = a.shape
  components = _check_int("components", components, 1)
  if components > d:
    raise ValueError(f"components must be in [1, d = {d}], got {components}")
  iterations = _check_int("iterations", iterations, 1)
  batch_size = _check_int("batch_size", batch_size, 1)
  if not (
    isinstance(learning_rate, numbers.Real) and 0.0 < float(learning_rate) <= 1.0
  ):
    raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate!r}")
  rng = np.random.default_rng(_check_seed(seed))
  a = a - a.mean(axis=0)
  scale = math.sqrt(float(np.mean(np.sum(a * a, axis=1))))
  if scale > 0:
    a = a / scale
  w = np.linalg.qr(rng.standard_normal((d, components)))[0].T
  eta = float(learning_rate)
  for _ in range(iterations):
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
      b = a[order[start : start + batch_size]]
      y = b @ w.T
      w = w + eta / b.shape[0] * (y.T @ b - np.tril(y.T @ y) @ w)
  return w


def gha_features(
  x: ArrayLike,
  components: int,
  *,
  iterations: int = DEFAULT_ITERATIONS,
  learning_rate: float = DEFAULT_GHA_LEARNING_RATE,
  batch_size: int = DEFAULT_GHA_BATCH,
  seed: int = 0,
) -> np.ndarray:
  """The samples projected on :func:`gha`'s components: ``(X - mean) W^T``.

  Args and seeding as :func:`gha`.

  Returns:
    ``(N, components)`` float64 array.

  Examples:
    Five points ``(1, 1) + t (0.6, 0.8)``: the feature is ``t`` (up to sign).

    >>> import numpy as np
    >>> t = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])
    >>> x = 1.0 + np.outer(t, [0.6, 0.8])
    >>> gha_features(x, 1).round(2).ravel().tolist()
    [-2.0, -1.0, 0.0, 1.0, 2.0]
  """
  a = as_samples(x).astype(np.float64)
  w = gha(
    a,
    components,
    iterations=iterations,
    learning_rate=learning_rate,
    batch_size=batch_size,
    seed=seed,
  )
  return (a - a.mean(axis=0)) @ w.T


def hash_features(
  x: ArrayLike, length: int = DEFAULT_HASH_LENGTH, *, seed: int = 0
) -> np.ndarray:
  """A signed feature-hashing fingerprint of each sample (paper 002 §3.2, §4.3).

  Feature ``j`` goes to bucket ``h(j)`` in ``[0, length)`` with sign
  ``s(j) = +-1`` (both drawn from ``seed``); the fingerprint is

  .. math::

    f_k(x) = \\sum_{j : h(j) = k} s(j)\\, x_j ,

  a linear map with ``E[<f(x), f(z)>] = <x, z>`` (Weinberger et al. 2009), in
  ``O(N d)`` (Table 3).

  Args:
    x: ``(N, d)`` samples (or ``(N, ...)``, flattened).
    length: the fingerprint's length ``d'``, >= 1 (the paper's 10).
    seed: seeds the buckets and signs.

  Returns:
    ``(N, length)`` float array.

  Examples:
    >>> f = hash_features(np.eye(5), 3)
    >>> np.abs(f).sum(axis=1).tolist()  # each feature lands in one bucket
    [1.0, 1.0, 1.0, 1.0, 1.0]
  """
  a = as_samples(x)
  length = _check_int("length", length, 1)
  rng = np.random.default_rng(_check_seed(seed))
  d = a.shape[1]
  bucket = rng.integers(0, length, size=d)
  sign = rng.choice(np.array([-1.0, 1.0], dtype=a.dtype), size=d)
  out = np.zeros((a.shape[0], length), dtype=a.dtype)
  for k in range(length):
    cols = bucket == k
    if cols.any():
      out[:, k] = a[:, cols] @ sign[cols]
  return out
