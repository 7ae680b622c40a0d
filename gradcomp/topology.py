r"""Gossip topologies: who each worker averages with, and the ``ppermute`` that does it.

Decentralized SGD (survey 004 §2.3, gossiping SGD; D-PSGD, Lian et al. 2017)
replaces the all-reduce by a *mixing* step with neighbours:

.. math:: x_i \leftarrow \sum_j W_t[i, j] \, x_j

with :math:`W_t` a doubly stochastic matrix (non-negative, every row and
column summing to 1), so the workers' average is preserved and, on a
connected graph, every worker converges to it at a rate set by the spectral
gap :math:`1 - \|W - J\|_2` (:math:`J = \mathbf{1}\mathbf{1}^\top / n`).

**Representation.** A :class:`Topology` is a cycle of :class:`Phase` values;
training step ``t`` (the 0-based number of updates already taken) uses phase
``t % len(phases)``. A phase is a self weight per worker and a tuple of
:class:`Edge` values; an edge says, for every worker ``i``, from which worker
``sources[i]`` it receives (``-1``: nothing) and with which weight. Each edge
is a partial permutation (a worker sends at most one message on it, never to
itself), so it is exactly one ``jax.lax.ppermute``, a ``collective-permute``
in the compiled program; a phase costs ``len(edges)`` of them
(:meth:`Topology.messages`).

**Factories.** :func:`ring`, :func:`torus`, :func:`exponential` (static,
peers at distances :math:`2^k`), :func:`one_peer_exponential` (time-varying,
one peer per step; Ying et al. 2021), :func:`complete`, a user's matrices
(:func:`from_matrices`), and :func:`get` by name. Every phase's matrix is
checked doubly stochastic at construction.

The values are NumPy (the simulator prices them without JAX); the mixing
itself, one ``ppermute`` per edge, is :mod:`gradcomp.parallel.mixing`. Use a
topology with :func:`gradcomp.gossip` and price it with
:func:`gradcomp.sim.simulate_gossip`.

References:
  Survey 004 §2.3 (gossiping SGD).
  Lian et al., "Can Decentralized Algorithms Outperform Centralized
  Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient
  Descent", NeurIPS 2017 (D-PSGD, Alg. 1).
  Ying, Yuan, Chen, Hu, Pan, Yin, "Exponential Graph is Provably Efficient for
  Decentralized Deep Training", NeurIPS 2021 (static and one-peer
  exponential graphs, §3-4).
  Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for Distributed
  Deep Learning", ICML 2019 (SGP's time-varying exponential graph).
  Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization and Gossip
  Algorithms with Compressed Communication", ICML 2019 (CHOCO-SGD).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

__all__ = [
  "NAMES",
  "Edge",
  "Phase",
  "Topology",
  "complete",
  "exponential",
  "from_matrices",
  "get",
  "one_peer_exponential",
  "ring",
  "torus",
  "torus_shape",
]

#: The topologies :func:`get` builds by name.
NAMES = ("ring", "torus", "exponential", "one_peer_exponential", "complete")


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_workers(n) -> int:
  if not _is_int(n) or n < 1:
    raise ValueError(f"n must be an integer >= 1 (the number of workers), got {n!r}")
  return int(n)


def _check_step(step) -> int:
  if not _is_int(step) or step < 0:
    raise ValueError(
      f"step must be an integer >= 0 (updates already taken), got {step!r}"
    )
  return int(step)


def tolerance(n: int) -> float:
  """The float64 tolerance on a row or column sum of an ``n``-worker matrix.

  ``n * eps``, ``eps = 2^-52``. A row holds at most ``n`` non-negative
  weights, each the correctly rounded float64 value of an exact weight
  summing to 1 (relative error at most ``u = eps / 2`` each: at most ``u``
  on the sum), and adding them in any order errs by at most ``(n - 1) u``
  times their sum (Higham, *Accuracy and Stability of Numerical Algorithms*,
  §4.2). So a doubly stochastic matrix written in float64 sums to 1 within
  ``n u = n eps / 2``; twice that leaves room for weights computed by one
  more operation (``1 - a - b``). Weights rounded to float32 (error about
  ``6e-8``) fail: renormalise them in float64.
  """
  return float(n) * float(np.finfo(np.float64).eps)


@dataclasses.dataclass(frozen=True)
class Edge:
  """One ``ppermute``: each worker receives from at most one other.

  Worker ``i`` receives the value of worker ``sources[i]`` and weighs it by
  ``weights[i]``; ``sources[i] = -1`` means it receives nothing on this edge
  (its weight must then be 0). A worker appears at most once in ``sources``
  (it sends one message per edge) and never as its own source, so the edge
  is a partial permutation: one ``jax.lax.ppermute`` with pairs
  ``[(sources[i], i) for i if sources[i] >= 0]``.

  Attributes:
    sources: per receiving worker, the sending worker in ``[0, n)`` or -1.
    weights: per receiving worker, the weight of what it receives: finite
      and > 0 where it receives, 0 where it does not.

  Examples:
    Workers 0 and 1 swap values, worker 2 receives nothing:

    >>> e = Edge(sources=(1, 0, -1), weights=(0.5, 0.5, 0.0))
    >>> e.perm, e.is_permutation
    (((1, 0), (0, 1)), False)
  """

  sources: tuple[int, ...]
  weights: tuple[float, ...]

  def __post_init__(self):
    if not np.iterable(self.sources) or not np.iterable(self.weights):
      raise ValueError(
        f"Edge.sources and Edge.weights must be sequences, got {self.sources!r} "
        f"and {self.weights!r}"
      )
    sources, weights = tuple(self.sources), tuple(self.weights)
    n = len(sources)
    if n < 1 or len(weights) != n:
      raise ValueError(
        "Edge.sources and Edge.weights must hold one entry per worker (>= 1), "
        f"got {len(sources)} sources and {len(weights)} weights"
      )
    senders: dict[int, int] = {}
    for i, (s, w) in enumerate(zip(sources, weights, strict=True)):
      if not _is_int(s) or not -1 <= s < n:
        raise ValueError(
          f"Edge.sources[{i}] must be an integer in [-1, {n}), got {s!r}"
        )
      if s == i:
        raise ValueError(
          f"Edge.sources[{i}] = {i} is a self loop; a worker's own weight is "
          "its Phase.self_weights entry"
        )
      if s >= 0 and s in senders:
        raise ValueError(
          f"Edge.sources: worker {s} sends to workers {senders[s]} and {i} on "
          "one edge, which must be a partial permutation (one message per "
          "sender per ppermute); split it into two edges"
        )
      if s >= 0:
        senders[int(s)] = i
      if not _is_real(w) or not np.isfinite(w) or w < 0:
        raise ValueError(f"Edge.weights[{i}] must be finite and >= 0, got {w!r}")
      if s < 0 and w != 0:
        raise ValueError(
          f"Edge.weights[{i}] must be 0 where sources[{i}] = -1 (worker {i} "
          f"receives nothing), got {w!r}"
        )
      if s >= 0 and w == 0:
        raise ValueError(
          f"Edge.weights[{i}] is 0 for a message from worker {s}; use "
          f"sources[{i}] = -1 to send nothing"
        )
    if not senders:
      raise ValueError("an Edge must carry at least one message, got none")
    object.__setattr__(self, "sources", tuple(int(s) for s in sources))
    object.__setattr__(self, "weights", tuple(float(w) for w in weights))

  @property
  def perm(self) -> tuple[tuple[int, int], ...]:
    """The ``(sender, receiver)`` pairs of its ``ppermute``."""
    return tuple((s, i) for i, s in enumerate(self.sources) if s >= 0)

  @property
  def is_permutation(self) -> bool:
    """Whether every worker receives (and so sends) one message on it."""
    return all(s >= 0 for s in self.sources)


@dataclasses.dataclass(frozen=True)
class Phase:
  """One step's mixing matrix, as edges (``ppermute``'s) and self weights.

  .. math:: W[i, i] = \\mathrm{self\\_weights}[i], \\qquad
     W[i, e.\\mathrm{sources}[i]] \\mathrel{+}= e.\\mathrm{weights}[i]

  for every edge ``e``.

  Attributes:
    edges: the phase's :class:`Edge` values, in send order (the simulator
      sends a worker's messages one after another in this order).
    self_weights: per worker, the weight of its own value, finite and >= 0.

  Examples:
    Workers 0 and 1 average with each other; worker 2 keeps its value:

    >>> swap = Edge(sources=(1, 0, -1), weights=(0.5, 0.5, 0.0))
    >>> Phase(edges=(swap,), self_weights=(0.5, 0.5, 1.0)).matrix()
    array([[0.5, 0.5, 0. ],
           [0.5, 0.5, 0. ],
           [0. , 0. , 1. ]])
  """

  edges: tuple[Edge, ...]
  self_weights: tuple[float, ...]

  def __post_init__(self):
    if not np.iterable(self.edges) or not np.iterable(self.self_weights):
      raise ValueError(
        f"Phase.edges and Phase.self_weights must be sequences, got "
        f"{self.edges!r} and {self.self_weights!r}"
      )
    edges, self_weights = tuple(self.edges), tuple(self.self_weights)
    n = len(self_weights)
    if n < 1:
      raise ValueError("Phase.self_weights must hold one weight per worker (>= 1)")
    for i, w in enumerate(self_weights):
      if not _is_real(w) or not np.isfinite(w) or w < 0:
        raise ValueError(f"Phase.self_weights[{i}] must be finite and >= 0, got {w!r}")
    for k, edge in enumerate(edges):
      if not isinstance(edge, Edge):
        raise ValueError(f"Phase.edges[{k}] must be an Edge, got {edge!r}")
      if len(edge.sources) != n:
        raise ValueError(
          f"Phase.edges[{k}] has {len(edge.sources)} workers, self_weights {n}"
        )
    object.__setattr__(self, "edges", edges)
    object.__setattr__(self, "self_weights", tuple(float(w) for w in self_weights))

  def matrix(self) -> np.ndarray:
    """The mixing matrix ``W``, float64 of shape ``(n, n)``."""
    w = np.diag(np.array(self.self_weights, np.float64))
    for edge in self.edges:
      for i, (s, v) in enumerate(zip(edge.sources, edge.weights, strict=True)):
        if s >= 0:
          w[i, s] += v
    return w


def _gap(matrix: np.ndarray) -> float:
  """``1 - ||W - J||_2``: one minus W's second largest singular value."""
  n = matrix.shape[0]
  sigma = np.linalg.norm(matrix - np.full((n, n), 1.0 / n), 2)
  return float(min(1.0, max(0.0, 1.0 - sigma)))


@dataclasses.dataclass(frozen=True)
class Topology:
  """A (possibly time-varying) gossip topology on ``workers`` workers.

  Step ``t`` (0-based: the number of updates already taken) mixes with
  phase ``t % len(phases)``. Every phase's :meth:`matrix` is checked doubly
  stochastic at construction: non-negative, every row and column summing to
  1 within :func:`tolerance` (``n * eps`` in float64). Frozen and hashable,
  so it can be closed over or passed as a static argument to ``jit``.

  Attributes:
    workers: number of workers ``n``, >= 1.
    phases: one or more :class:`Phase` values over ``n`` workers.
    name: a label (the factory's name, or ``"custom"``).

  Examples:
    >>> t = ring(4)
    >>> t.matrix(0)
    array([[0.33333333, 0.33333333, 0.        , 0.33333333],
           [0.33333333, 0.33333333, 0.33333333, 0.        ],
           [0.        , 0.33333333, 0.33333333, 0.33333333],
           [0.33333333, 0.        , 0.33333333, 0.33333333]])
    >>> t.messages(0), t.in_neighbours(0, 0)
    (2, [3, 1])
  """

  workers: int
  phases: tuple[Phase, ...]
  name: str = "custom"

  def __post_init__(self):
    n = _check_workers(self.workers)
    if not np.iterable(self.phases) or not len(tuple(self.phases)):
      raise ValueError(
        f"phases must be a non-empty sequence of Phase, got {self.phases!r}"
      )
    phases = tuple(self.phases)
    for p, phase in enumerate(phases):
      if not isinstance(phase, Phase):
        raise ValueError(f"phases[{p}] must be a Phase, got {phase!r}")
      if len(phase.self_weights) != n:
        raise ValueError(
          f"phases[{p}] has {len(phase.self_weights)} workers, the topology {n}"
        )
    if not isinstance(self.name, str):
      raise ValueError(f"name must be a str, got {self.name!r}")
    object.__setattr__(self, "workers", n)
    object.__setattr__(self, "phases", phases)
    for p, phase in enumerate(phases):
      _check_doubly_stochastic(phase.matrix(), f"phase {p} of topology {self.name!r}")

  def phase(self, step: int) -> Phase:
    """The phase step ``step`` (0-based) mixes with: ``phases[step % len(phases)]``."""
    return self.phases[_check_step(step) % len(self.phases)]

  def matrix(self, step: int) -> np.ndarray:
    """The mixing matrix ``W_t`` of step ``step``: float64, shape ``(n, n)``."""
    return self.phase(step).matrix()

  def messages(self, step: int) -> int:
    """``ppermute``'s (edges) in step ``step``: a worker sends at most this many."""
    return len(self.phase(step).edges)

  def in_neighbours(self, step: int, worker: int) -> list[int]:
    """The workers ``worker`` receives from in step ``step``, in edge order."""
    self._check_worker(worker)
    return [e.sources[worker] for e in self.phase(step).edges if e.sources[worker] >= 0]

  def out_neighbours(self, step: int, worker: int) -> list[int]:
    """The workers ``worker`` sends to in step ``step``, in edge (send) order."""
    self._check_worker(worker)
    return [
      i for e in self.phase(step).edges for i, s in enumerate(e.sources) if s == worker
    ]

  def _check_worker(self, worker) -> None:
    if not _is_int(worker) or not 0 <= worker < self.workers:
      raise ValueError(
        f"worker must be an integer in [0, {self.workers}), got {worker!r}"
      )

  def period_matrix(self) -> np.ndarray:
    r"""The mixing of one period of ``P`` phases: :math:`W_{P-1} \cdots W_1 W_0`."""
    product = np.eye(self.workers)
    for phase in self.phases:
      product = phase.matrix() @ product
    return product

  def phase_spectral_gaps(self) -> tuple[float, ...]:
    """Each phase's ``1 - ||W_p - J||_2`` (its second largest singular value)."""
    return tuple(_gap(phase.matrix()) for phase in self.phases)

  def spectral_gap(self) -> float:
    r"""The spectral gap of one period: :math:`1 - \|W_{P-1} \cdots W_0 - J\|_2`.

    For a static topology (one phase) this is ``1 - sigma_2(W)``, one minus
    the second largest singular value of ``W`` (for a doubly stochastic
    ``W`` the largest is 1, on the all-ones vector, and ``||W - J||_2`` is
    the next); D-PSGD's rate depends on it (Lian et al. 2017, Assumption 1,
    "spectral gap"; for a symmetric ``W`` it is ``1 - max(|lambda_2|,
    |lambda_n|)``). For a time-varying topology a single phase may be
    disconnected (on 8 workers two of the three one-peer exponential phases
    have gap 0), so the meaningful number is that of the product over one
    period, which is what this returns: every ``P`` steps the distance to
    consensus, ``||x - mean(x)||``, is multiplied by at most ``1 - gap``.
    :meth:`phase_spectral_gaps` gives each phase's own. In ``[0, 1]``; 1
    means exact averaging (``complete``, or one-peer exponential on a
    power of two), 0 a disconnected graph.
    """
    return _gap(self.period_matrix())

  def summary(self) -> dict:
    """A JSON-friendly description for logs and benchmark tables.

    Returns:
      ``{"name", "workers", "phases", "peers_per_worker" (the most
      in-neighbours of any worker in any phase), "messages_per_step" (the
      most ``ppermute``'s of any phase), "spectral_gap"`` (of one period,
      :meth:`spectral_gap`), ``"phase_spectral_gaps"}``.
    """
    peers = max(
      (
        sum(e.sources[i] >= 0 for e in phase.edges)
        for phase in self.phases
        for i in range(self.workers)
      ),
      default=0,
    )
    return {
      "name": self.name,
      "workers": self.workers,
      "phases": len(self.phases),
      "peers_per_worker": int(peers),
      "messages_per_step": max(len(p.edges) for p in self.phases),
      "spectral_gap": self.spectral_gap(),
      "phase_spectral_gaps": list(self.phase_spectral_gaps()),
    }


def _check_doubly_stochastic(matrix: np.ndarray, what: str) -> None:
  n = matrix.shape[0]
  tol = tolerance(n)
  if (matrix < 0).any():
    i, j = np.argwhere(matrix < 0)[0]
    raise ValueError(
      f"{what}: W[{i}, {j}] = {float(matrix[i, j])!r} is negative; a mixing matrix "
      "must be doubly stochastic (non-negative, rows and columns summing to 1)"
    )
  for axis, label in ((1, "row"), (0, "column")):
    sums = matrix.sum(axis=axis)
    bad = np.flatnonzero(np.abs(sums - 1.0) > tol)
    if bad.size:
      k = int(bad[0])
      raise ValueError(
        f"{what}: {label} {k} of its mixing matrix sums to {float(sums[k])!r}, not 1 "
        f"(tolerance {tol:.3g}); a mixing matrix must be doubly stochastic "
        "(non-negative, rows and columns summing to 1 in float64)"
      )


def _shift_edge(n: int, shift: int, weight: float) -> Edge:
  """Every worker ``i`` receives from ``(i - shift) % n``, with ``weight``."""
  return Edge(tuple((i - shift) % n for i in range(n)), (float(weight),) * n)


def _uniform(n: int, shifts, name: str) -> Topology:
  """Receive from ``i - s`` for each distinct non-zero shift, uniform weights."""
  distinct = []
  for s in shifts:
    if s % n and s % n not in distinct:
      distinct.append(s % n)
  w = 1.0 / (len(distinct) + 1)
  edges = tuple(_shift_edge(n, s, w) for s in distinct)
  return Topology(n, (Phase(edges, (w,) * n),), name=name)


def ring(n: int) -> Topology:
  """The ring: each worker averages with its two neighbours, weights 1/3.

  Worker ``i`` receives from ``i - 1`` (first edge) and ``i + 1`` (second),
  modulo ``n``. ``n = 2``: one neighbour, weights 1/2 (``W = J``); ``n = 1``:
  the identity, no edge. Spectral gap ``1 - (1 + 2 cos(2 pi / n)) / 3`` for
  ``n >= 3`` (the eigenvalues of the circulant are ``(1 + 2 cos(2 pi k / n))
  / 3``).

  Args:
    n: number of workers, >= 1.

  Returns:
    A static :class:`Topology` named ``"ring"``.

  Examples:
    Three times the matrix on five workers (a circulant band), and its
    spectral gap against the closed form:

    >>> import math
    >>> t = ring(5)
    >>> (3 * t.matrix(0)).round().astype(int)
    array([[1, 1, 0, 0, 1],
           [1, 1, 1, 0, 0],
           [0, 1, 1, 1, 0],
           [0, 0, 1, 1, 1],
           [1, 0, 0, 1, 1]])
    >>> closed_form = 1 - (1 + 2 * math.cos(2 * math.pi / 5)) / 3
    >>> round(t.spectral_gap(), 6), round(closed_form, 6)
    (0.460655, 0.460655)
  """
  n = _check_workers(n)
  return _uniform(n, (1, -1), "ring")


def torus_shape(n: int) -> tuple[int, int]:
  """The torus grid ``(r, c)``: ``r`` the largest divisor of ``n`` with ``r <= sqrt(n)``.

  Examples:
    >>> [torus_shape(n) for n in (7, 8, 9, 12)]  # a prime is one row: a ring
    [(1, 7), (2, 4), (3, 3), (3, 4)]
  """
  n = _check_workers(n)
  r = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
  return r, n // r


def torus(n: int) -> Topology:
  """The 2-D torus: an ``r x c`` grid with wrap-around, four neighbours.

  Worker ``i = a c + b`` (row ``a``, column ``b``) receives from ``(a - 1,
  b)``, ``(a + 1, b)``, ``(a, b - 1)``, ``(a, b + 1)`` modulo ``(r, c)``, in
  that order, with :func:`torus_shape`'s ``r`` (the largest divisor of ``n``
  at most ``sqrt(n)``, so the grid is as square as ``n`` allows) and ``c =
  n / r``. Each worker weighs itself and each *distinct* neighbour by
  ``1 / (d + 1)``; on degenerate shapes neighbours coincide or vanish, and
  ``d`` is what is left (the grid is vertex-transitive, so ``W`` stays
  doubly stochastic):

  * ``r, c >= 3``: ``d = 4``, weights 1/5;
  * ``r = 2`` (or ``c = 2``): up and down are the same worker, ``d = 3``
    (``n = 4``, a 2 x 2 grid: ``d = 2``, the 4-cycle 0-1-3-2);
  * ``r = 1`` (``n`` prime, or ``n <= 3``): no rows, the torus is
    :func:`ring` (``d = 2``, 1/3; ``n = 2``: 1/2; ``n = 1``: identity).

  Args:
    n: number of workers, >= 1.

  Returns:
    A static :class:`Topology` named ``"torus"``.

  Examples:
    On a 3 x 3 grid the centre, worker 4, receives from above, below, left
    and right, and weighs itself and each of them 1/5:

    >>> t = torus(9)
    >>> t.messages(0), t.in_neighbours(0, 4)
    (4, [1, 7, 3, 5])
    >>> t.matrix(0)[4].round(2).tolist()
    [0.0, 0.2, 0.0, 0.2, 0.2, 0.2, 0.0, 0.2, 0.0]
    >>> torus(8).in_neighbours(0, 0)  # 2 x 4: up and down are one worker
    [4, 3, 1]
  """
  r, c = torus_shape(n)
  grid = np.arange(n).reshape(r, c)
  candidates = []
  for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1)):
    # Worker (a, b) receives from (a - da, b - db): the grid rolled by (da, db).
    sources = np.roll(grid, (da, db), axis=(0, 1)).reshape(-1)
    if (sources == np.arange(n)).any() or any((sources == s).all() for s in candidates):
      continue  # a self loop (r or c is 1) or a duplicate (r or c is 2)
    candidates.append(sources)
  w = 1.0 / (len(candidates) + 1)
  edges = tuple(Edge(tuple(int(s) for s in src), (w,) * n) for src in candidates)
  return Topology(n, (Phase(edges, (w,) * n),), name="torus")


def _log2_ceil(n: int) -> int:
  return (n - 1).bit_length()  # ceil(log2 n); 0 for n = 1


def exponential(n: int) -> Topology:
  """The static exponential graph: peers at distances ``2^k``, uniform weights.

  Worker ``i`` receives from ``(i - 2^k) mod n`` for ``k = 0 .. tau - 1``,
  ``tau = ceil(log2 n)`` (the distances are below ``n``, so distinct), and
  weighs itself and each peer ``1 / (tau + 1)`` (Ying et al. 2021, §3,
  eq. 4). Its spectral gap shrinks only like ``1 / log2 n`` (Ying et al.
  2021, Prop. 1; for ``n`` a power of two it is ``2 / (tau + 1)``), at the
  price of ``tau`` messages per step.

  Args:
    n: number of workers, >= 1.

  Returns:
    A static :class:`Topology` named ``"exponential"``.

  Examples:
    On 8 workers (``tau = 3``), worker 0 receives from 0 - 1, 0 - 2 and 0 - 4
    (mod 8); the gap is ``2 / (tau + 1)``:

    >>> t = exponential(8)
    >>> t.in_neighbours(0, 0), t.messages(0), round(t.spectral_gap(), 6)
    ([7, 6, 4], 3, 0.5)
  """
  n = _check_workers(n)
  return _uniform(n, tuple(2**k for k in range(_log2_ceil(n))), "exponential")


def one_peer_exponential(n: int) -> Topology:
  """The one-peer exponential graph: one peer per step at distance ``2^(t mod tau)``.

  Step ``t`` mixes :math:`x_i \\leftarrow (x_i + x_{i - 2^k}) / 2` with ``k
  = t mod tau``, ``tau = ceil(log2 n)`` phases (Ying et al. 2021, §4, eq. 5;
  SGP's graph, Assran et al. 2019): one message per worker per step. Each
  phase is ``(I + S^{2^k}) / 2`` with ``S`` the cyclic shift, doubly
  stochastic.

  For ``n`` a power of two the product over one period is exactly ``J``:
  :math:`\\prod_{k=0}^{\\tau-1} (I + S^{2^k}) / 2 = \\frac1n
  \\sum_{m=0}^{n-1} S^m`` (every ``m < n`` is one binary number), so all
  workers hold the initial mean after ``log2 n`` steps (spectral gap 1).

  For other ``n`` this keeps Ying et al.'s definition (``tau = ceil(log2
  n)`` phases, distances ``2^k < n``, weights 1/2): each phase is still
  doubly stochastic and the period's product is a mixing matrix with gap
  in ``(0, 1)`` (``n = 3``: ``(2I + S + S^2) / 4``, gap 3/4), so consensus
  is reached only asymptotically (Ying et al. prove exact averaging for
  powers of two only). Graphs with finite-time consensus for every ``n``
  exist (Takezawa et al., NeurIPS 2023, Base-(k+1) graphs) but are not
  built here. ``n = 1``: one phase, the identity; ``n = 2``: one phase,
  ``W = J``.

  Args:
    n: number of workers, >= 1.

  Returns:
    A :class:`Topology` named ``"one_peer_exponential"`` with
    ``max(1, ceil(log2 n))`` phases.

  Examples:
    On 8 workers, three steps of one message each (from 1, 2 and 4 workers
    back) leave every worker with the initial mean, 3.5, exactly:

    >>> import numpy as np
    >>> t = one_peer_exponential(8)
    >>> x = np.arange(8.0)
    >>> for step in range(3):
    ...   x = t.matrix(step) @ x
    ...   print(t.in_neighbours(step, 0), x.tolist())
    [7] [3.5, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
    [6] [4.5, 3.5, 2.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    [4] [3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5, 3.5]
    >>> t.spectral_gap(), [round(g, 4) for g in t.phase_spectral_gaps()]
    (1.0, [0.0761, 0.0, 0.0])
  """
  n = _check_workers(n)
  tau = _log2_ceil(n)
  if tau == 0:
    return Topology(1, (Phase((), (1.0,)),), name="one_peer_exponential")
  phases = tuple(Phase((_shift_edge(n, 2**k, 0.5),), (0.5,) * n) for k in range(tau))
  return Topology(n, phases, name="one_peer_exponential")


def complete(n: int) -> Topology:
  """The complete graph: every weight ``1 / n`` (``W = J``: exact averaging).

  ``n - 1`` edges, the cyclic shifts ``1 .. n - 1``, one ``ppermute`` each;
  spectral gap 1. Mixing with it equals the all-reduce mean (at ``n - 1``
  messages of the full size per worker, against the ring all-reduce's
  ``2 (n - 1) / n``).

  Args:
    n: number of workers, >= 1.

  Returns:
    A static :class:`Topology` named ``"complete"``.

  Examples:
    >>> t = complete(4)
    >>> t.matrix(0).tolist()[0], t.messages(0), t.spectral_gap()
    ([0.25, 0.25, 0.25, 0.25], 3, 1.0)
  """
  n = _check_workers(n)
  return _uniform(n, tuple(range(1, n)), "complete")


def from_matrices(matrices, name: str = "custom") -> Topology:
  """A topology from a user's doubly stochastic matrices, one per phase.

  Each ``W`` (non-negative, rows and columns summing to 1 in float64 within
  :func:`tolerance`) is split into at most ``n - 1`` edges by cyclic shift:
  edge ``s`` has ``sources[i] = (i - s) % n`` where ``W[i, (i - s) % n] >
  0``, else -1 (a sub-permutation of the shift, so one ``ppermute``); shifts
  with no entry are dropped, and the diagonal is the self weights.

  Args:
    matrices: a sequence of ``(n, n)`` arrays (or one ``(n, n)`` array, or
      an ``(phases, n, n)`` array), finite.
    name: the topology's label.

  Returns:
    A :class:`Topology` whose :meth:`Topology.matrix` gives back each ``W``.

  Raises:
    ValueError: a matrix is not square, not finite, has a negative entry,
      or a row or column not summing to 1 (naming the phase, the row or
      column and its sum).

  Examples:
    >>> from_matrices([[[0.5, 0.5], [0.5, 0.5]]]).messages(0)
    1
  """
  stack = np.asarray(matrices, np.float64)
  if stack.ndim == 2:
    stack = stack[None]
  if stack.ndim != 3 or stack.shape[0] < 1 or stack.shape[1] != stack.shape[2]:
    raise ValueError(
      "matrices must be one or more square (n, n) matrices, got an array of "
      f"shape {np.shape(matrices)}"
    )
  if stack.shape[1] < 1 or not np.isfinite(stack).all():
    raise ValueError("matrices must be non-empty and finite")
  n = stack.shape[1]
  phases = []
  for p, w in enumerate(stack):
    _check_doubly_stochastic(w, f"phase {p} of topology {name!r}")
    edges = []
    for s in range(1, n):
      sources = tuple((i - s) % n if w[i, (i - s) % n] > 0 else -1 for i in range(n))
      if any(src >= 0 for src in sources):
        weights = tuple(
          float(w[i, src]) if src >= 0 else 0.0 for i, src in enumerate(sources)
        )
        edges.append(Edge(sources, weights))
    phases.append(Phase(tuple(edges), tuple(float(v) for v in np.diag(w))))
  return Topology(n, tuple(phases), name=name)


_FACTORIES = {
  "ring": ring,
  "torus": torus,
  "exponential": exponential,
  "one_peer_exponential": one_peer_exponential,
  "complete": complete,
}


def get(name: str, n: int) -> Topology:
  """The topology ``name`` (one of :data:`NAMES`) on ``n`` workers.

  Examples:
    >>> get("one_peer_exponential", 8).summary()["phases"]
    3
  """
  if name not in _FACTORIES:
    raise ValueError(f"topology name must be one of {NAMES}, got {name!r}")
  return _FACTORIES[name](n)


# --- JAX ---------------------------------------------------------------------
