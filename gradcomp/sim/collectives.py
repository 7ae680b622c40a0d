r"""Alpha-beta prices of one all-reduce, algorithm by algorithm.

Survey 004 §2.4 compares a parameter server (§2.1) with ring all-reduce;
this module prices one all-reduce of ``nbytes`` per worker on ``n`` workers
for the usual algorithms, so that a planner can pick one. ``alpha`` is the
start-up latency of one message (s) and ``beta`` the time per byte (s/B) of
one link; the reduction arithmetic (Thakur et al.'s ``gamma``) is not counted.

**The machine model** (Thakur, Rabenseifner & Gropp 2005, §2): every node has
one full-duplex link (to a switch), so it can send one message and receive
one message at the same time; a message of ``b`` bytes occupies the sender's
outgoing and the receiver's incoming direction for ``alpha + b beta``.
Messages that share a direction queue; messages on disjoint directions run
in parallel. An algorithm is a sequence of steps, each ending when its last
message arrives. ``tests/test_sim_collectives.py`` replays each algorithm
message by message in that model and checks it against these closed forms.

Closed forms (``B = nbytes``, ``lg = log2``):

* :func:`ring_allreduce` (Patarasuk & Yuan 2009; *not* survey 004's
  Algorithm 2, which indexes wrongly): reduce-scatter then all-gather
  around a ring, ``2 (n-1)`` steps of one ``B / n`` message per worker:
  ``2 (n-1) alpha + 2 (n-1)/n B beta``; any ``n``.
* :func:`recursive_halving_doubling` (Thakur et al. 2005, §4.4):
  reduce-scatter by recursive halving, then all-gather by recursive
  doubling: ``2 lg n alpha + 2 (n-1)/n B beta`` for ``n`` a power of two.
  Otherwise, with ``p`` the largest power of two below ``n`` and ``r = n - p``,
  ``r`` ranks first send their whole vector to a partner and drop out, the
  ``p`` left run the power-of-two algorithm, and the partners send the
  result back: ``(2 lg p + 2) alpha + (2 (p-1)/p + 2) B beta``.
* :func:`rabenseifner`: Thakur et al. (§4.4) call exactly this algorithm
  Rabenseifner's; the two names give the same price for every ``n``.
* :func:`binary_tree`: reduce to rank 0 then broadcast from it, each on a
  binomial tree (the binary-tree family of Thakur et al. §4.1-4.3, in which a
  node receives one message per round): ``2 ceil(lg n) (alpha + B beta)``; any
  ``n``. The whole vector moves in every round, so it only pays off when
  ``alpha`` dominates.
* :func:`hierarchical`: ``g`` workers per node, ``m = n / g`` nodes.
  Binomial-tree reduce inside each node to its first worker (intra-node
  ``alpha_i``, ``beta_i``), ring all-reduce among the ``m`` node leaders on
  the inter-node network, binomial-tree broadcast inside each node:
  ``2 ceil(lg g) (alpha_i + B beta_i) + 2 (m-1) alpha + 2 (m-1)/m B beta``.
* :func:`sharded_parameter_server` (survey 004 §2.1, §2.4): ``S`` servers,
  each owning ``1/S`` of the vector. Every worker pushes ``B / S`` to each
  server, which sums, then every worker pulls ``B / S`` from each. The price
  is that of the busiest link direction, the survey's argument for why one
  server is a bottleneck. Dedicated servers (separate nodes): a server
  receives ``n`` pushes and sends ``n`` pulls, a worker sends and receives
  ``S`` messages: ``2 max(n, S) (alpha + B/S beta)``. Co-located (server ``s``
  is worker ``s``, ``S <= n``; its own shard does not cross the network): a
  server receives ``n - 1`` pushes, a worker sends at most ``S <= n``, and at
  most ``n - 1`` cross the network: ``2 (n-1) (alpha + B/S beta)``. With
  ``S = n`` co-located this is the ring's price. Unlike
  :meth:`~gradcomp.sim.cluster.Cluster.exchange_seconds`'s single server,
  whose ``alpha`` is paid once per phase, here every queued message pays its
  own ``alpha``.

One worker (``n = 1``) exchanges nothing: every price is 0.

A :class:`~gradcomp.sim.cluster.Cluster` prices its all-reduces with the
algorithm its ``allreduce`` names (or the cheapest, ``"best"``), so the
LayerFusion planner, the schemes' clocks and the training program's
simulated clock all see the choice. :func:`allreduce_table` tabulates
:func:`best_allreduce`'s pick over worker counts and sizes
(``python -m bench collectives``).

References:
  Survey 004 §2.1, §2.4; P. Patarasuk and X. Yuan, "Bandwidth optimal
  all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009;
  R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective
  communication operations in MPICH", IJHPCA 19(1), 2005, §2, §4.
"""

from __future__ import annotations

import numbers

import numpy as np


def _check_int(name: str, value, lo: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
    raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
  return int(value)


def _check_nonneg(name: str, value) -> float:
  if (
    isinstance(value, bool)
    or not isinstance(value, numbers.Real)
    or not np.isfinite(value)
    or value < 0
  ):
    raise ValueError(f"{name} must be a finite real >= 0, got {value!r}")
  return float(value)


def _check(n, nbytes, alpha, beta) -> tuple[int, float, float, float]:
  return (
    _check_int("n", n, 1),
    _check_nonneg("nbytes", nbytes),
    _check_nonneg("alpha", alpha),
    _check_nonneg("beta", beta),
  )


def _ceil_log2(n: int) -> int:
  return (n - 1).bit_length()


def ring_allreduce(n: int, nbytes: float, alpha: float, beta: float) -> float:
  r"""Ring all-reduce (Patarasuk & Yuan 2009): reduce-scatter, then all-gather.

  .. math:: T = 2 (n-1) \alpha + 2 \frac{n-1}{n} B \beta

  Args:
    n: workers, an integer >= 1.
    nbytes: bytes each worker reduces, >= 0.
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0.

  Returns:
    Seconds for one all-reduce.

  Examples:
    >>> ring_allreduce(4, 4e6, 1e-5, 1e-9)
    0.00606
  """
  n, nbytes, alpha, beta = _check(n, nbytes, alpha, beta)
  return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def recursive_halving_doubling(
  n: int, nbytes: float, alpha: float, beta: float
) -> float:
  r"""Recursive-halving reduce-scatter + recursive-doubling all-gather.

  Thakur et al. 2005, §4.4. For ``n`` a power of two:

  .. math:: T = 2 \lg n \, \alpha + 2 \frac{n-1}{n} B \beta

  Otherwise ``p = 2^{\lfloor \lg n \rfloor}``: ``n - p`` ranks first hand
  their whole vector to a partner and wait; the ``p`` others run the
  power-of-two algorithm; the partners hand the result back, two extra
  steps of ``alpha + B beta``:

  .. math:: T = (2 \lg p + 2) \alpha + \left(2 \frac{p-1}{p} + 2\right) B \beta

  Args:
    n: workers, an integer >= 1.
    nbytes: bytes each worker reduces, >= 0.
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0.

  Returns:
    Seconds for one all-reduce.

  Examples:
    >>> recursive_halving_doubling(4, 4e6, 1e-5, 1e-9)
    0.00604
  """
  n, nbytes, alpha, beta = _check(n, nbytes, alpha, beta)
  if n == 1:
    return 0.0
  p = 1 << (n.bit_length() - 1)
  lg = p.bit_length() - 1
  seconds = 2 * lg * alpha + 2 * (p - 1) / p * nbytes * beta
  if p != n:
    seconds += 2 * (alpha + nbytes * beta)
  return seconds


def rabenseifner(n: int, nbytes: float, alpha: float, beta: float) -> float:
  """Rabenseifner's all-reduce: the name Thakur et al. 2005 (§4.4) give the same algorithm.

  Reduce-scatter by recursive halving, then all-gather by recursive doubling;
  the price is :func:`recursive_halving_doubling`'s for every ``n`` (powers
  of two and, with the same fold to the nearest lower power of two, others).
  Kept under its own name because the literature uses both.

  Args:
    n: workers, an integer >= 1.
    nbytes: bytes each worker reduces, >= 0.
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0.

  Returns:
    Seconds for one all-reduce.
  """
  return recursive_halving_doubling(n, nbytes, alpha, beta)


def binary_tree(n: int, nbytes: float, alpha: float, beta: float) -> float:
  r"""Tree reduce to rank 0, then tree broadcast from it.

  Binomial trees (Thakur et al. 2005, §4): in round ``k`` a rank sends its
  whole vector to the rank ``2^k`` below it (reduce), or above it
  (broadcast), so each rank receives at most one message per round:

  .. math:: T = 2 \lceil \lg n \rceil (\alpha + B \beta)

  Args:
    n: workers, an integer >= 1.
    nbytes: bytes each worker reduces, >= 0.
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0.

  Returns:
    Seconds for one all-reduce.
  """
  n, nbytes, alpha, beta = _check(n, nbytes, alpha, beta)
  return 2 * _ceil_log2(n) * (alpha + nbytes * beta)


def hierarchical(
  n: int,
  nbytes: float,
  alpha: float,
  beta: float,
  *,
  workers_per_node: int,
  intra_alpha: float,
  intra_beta: float,
) -> float:
  r"""Two-level all-reduce: tree inside nodes, ring between them.

  With ``g = workers_per_node`` and ``m = n / g`` nodes: a binomial-tree
  reduce inside every node to its first worker (on the intra-node link,
  ``intra_alpha``, ``intra_beta``), a ring all-reduce among the ``m`` leaders
  (``alpha``, ``beta``), and a binomial-tree broadcast inside every node:

  .. math::
    T = 2 \lceil \lg g \rceil (\alpha_i + B \beta_i)
      + 2 (m-1) \alpha + 2 \frac{m-1}{m} B \beta

  Args:
    n: workers, an integer >= 1, a multiple of ``workers_per_node``.
    nbytes: bytes each worker reduces, >= 0.
    alpha: inter-node seconds of start-up per message, >= 0.
    beta: inter-node seconds per byte, >= 0.
    workers_per_node: ``g``, an integer >= 1 dividing ``n``.
    intra_alpha: intra-node seconds of start-up per message, >= 0.
    intra_beta: intra-node seconds per byte, >= 0.

  Returns:
    Seconds for one all-reduce.
  """
  n, nbytes, alpha, beta = _check(n, nbytes, alpha, beta)
  g = _check_int("workers_per_node", workers_per_node, 1)
  if n % g:
    raise ValueError(f"workers_per_node must divide n = {n}, got {workers_per_node!r}")
  intra_alpha = _check_nonneg("intra_alpha", intra_alpha)
  intra_beta = _check_nonneg("intra_beta", intra_beta)
  intra = 2 * _ceil_log2(g) * (intra_alpha + nbytes * intra_beta)
  return intra + ring_allreduce(n // g, nbytes, alpha, beta)


def sharded_parameter_server(
  n: int,
  servers: int,
  nbytes: float,
  alpha: float,
  beta: float,
  colocated: bool,
) -> float:
  r"""Push to ``S`` sharded servers, sum, pull back (survey 004 §2.1, §2.4).

  Each server owns ``1/S`` of the vector; each worker pushes ``B / S`` to
  every server and pulls ``B / S`` from every server. The busiest link
  direction sets the price (each direction carries one message at a time):

  .. math::
    T_\text{dedicated} = 2 \max(n, S) \left(\alpha + \frac{B}{S} \beta\right),
    \qquad
    T_\text{co-located} = 2 (n - 1) \left(\alpha + \frac{B}{S} \beta\right)

  Dedicated: a server's link receives ``n`` pushes and sends ``n`` pulls; a
  worker's sends and receives ``S``. Co-located (server ``s`` is worker
  ``s``): a server's own shard stays local, so it receives ``n - 1`` pushes;
  a worker sends at most ``S <= n`` messages, ``n - 1`` at most off-node.

  Args:
    n: workers, an integer >= 1.
    servers: ``S``, an integer >= 1; at most ``n`` when co-located.
    nbytes: bytes each worker reduces, >= 0.
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0.
    colocated: whether servers run on worker nodes (True) or their own (False).

  Returns:
    Seconds for one push-and-pull.
  """
  n, nbytes, alpha, beta = _check(n, nbytes, alpha, beta)
  servers = _check_int("servers", servers, 1)
  if not isinstance(colocated, bool):
    raise ValueError(f"colocated must be True or False, got {colocated!r}")
  message = alpha + nbytes / servers * beta
  if colocated:
    if servers > n:
      raise ValueError(
        f"servers must be in [1, n = {n}] when colocated, got {servers!r}"
      )
    return 2 * (n - 1) * message
  return 2 * max(n, servers) * message


#: Every priced algorithm by name. ``hierarchical`` and
#: ``sharded_parameter_server`` take extra arguments.
ALGORITHMS = {
  "ring": ring_allreduce,
  "recursive_halving_doubling": recursive_halving_doubling,
  "rabenseifner": rabenseifner,
  "binary_tree": binary_tree,
  "hierarchical": hierarchical,
  "sharded_parameter_server": sharded_parameter_server,
}

#: The flat algorithms :func:`best_allreduce` chooses among, in tie-break
#: order (``rabenseifner`` is left out: it prices as
#: ``recursive_halving_doubling``).
FLAT = ("ring", "recursive_halving_doubling", "binary_tree")


def best_allreduce(
  n: int, nbytes: float, alpha: float, beta: float
) -> tuple[str, float]:
  """The cheapest flat all-reduce for ``n`` workers and ``nbytes`` bytes.

  Ties go to the first in :data:`FLAT`. Small messages favour fewer steps
  (halving/doubling's ``2 lg n alpha``); large ones a ``2 (n-1)/n B beta``
  bandwidth term, which on ``n`` not a power of two only the ring has.

  Args:
    n: workers, an integer >= 1.
    nbytes: bytes each worker reduces, >= 0.
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0.

  Returns:
    ``(name, seconds)``, the name a key of :data:`ALGORITHMS`.

  Examples:
    >>> best_allreduce(12, 1e3, 25e-6, 8e-10)[0]
    'recursive_halving_doubling'
    >>> best_allreduce(12, 1e9, 25e-6, 8e-10)[0]
    'ring'
  """
  _check(n, nbytes, alpha, beta)
  prices = [
    (ALGORITHMS[name](n, nbytes, alpha, beta), i) for i, name in enumerate(FLAT)
  ]
  seconds, i = min(prices)
  return FLAT[i], seconds


#: Worker counts of :func:`allreduce_table`: the powers of two 2..1024 and some
#: counts between them (where halving/doubling has to fold).
TABLE_WORKERS = (
  2,
  3,
  4,
  6,
  8,
  12,
  16,
  24,
  32,
  48,
  64,
  100,
  128,
  256,
  384,
  512,
  1000,
  1024,
)
#: Bytes per worker of :func:`allreduce_table`: 1 KB to 1 GB by decades.
TABLE_BYTES = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9)


def allreduce_table(
  alpha: float,
  beta: float,
  workers=TABLE_WORKERS,
  sizes=TABLE_BYTES,
) -> list[dict]:
  """Which flat all-reduce :func:`best_allreduce` picks, over workers and sizes.

  Issue 16: "which collective the cost model picks across worker counts
  2..1024 and message sizes 1 KB..1 GB on 10 Gbps". One row per
  ``(n, nbytes)``, workers outermost.

  Args:
    alpha: seconds of start-up per message, >= 0.
    beta: seconds per byte on one link, >= 0 (10 Gbit/s: ``8e-10``).
    workers: worker counts, integers >= 1 (default :data:`TABLE_WORKERS`).
    sizes: bytes each worker reduces, >= 0 (default :data:`TABLE_BYTES`).

  Returns:
    A list of ``{"workers": n, "nbytes": nbytes, "best": name, "seconds":
    seconds, "prices": {name: seconds}}``: the winner, its price and the
    price of every algorithm of :data:`FLAT` (the ring's among them).

  Examples:
    >>> [r["best"] for r in allreduce_table(25e-6, 8e-10, (12,), (1e3, 1e9))]
    ['recursive_halving_doubling', 'ring']
  """
  alpha, beta = _check_nonneg("alpha", alpha), _check_nonneg("beta", beta)
  workers, sizes = tuple(workers), tuple(sizes)
  if not workers or not sizes:
    raise ValueError(
      f"workers and sizes must be non-empty, got {workers!r} and {sizes!r}"
    )
  workers = tuple(_check_int(f"workers[{i}]", n, 1) for i, n in enumerate(workers))
  sizes = tuple(_check_nonneg(f"sizes[{i}]", b) for i, b in enumerate(sizes))
  rows = []
  for n in workers:
    for nbytes in sizes:
      name, seconds = best_allreduce(n, nbytes, alpha, beta)
      prices = {k: ALGORITHMS[k](n, nbytes, alpha, beta) for k in FLAT}
      rows.append(
        {
          "workers": n,
          "nbytes": nbytes,
          "best": name,
          "seconds": seconds,
          "prices": prices,
        }
      )
  return rows


__all__ = [
  "ALGORITHMS",
  "FLAT",
  "TABLE_BYTES",
  "TABLE_WORKERS",
  "allreduce_table",
  "best_allreduce",
  "binary_tree",
  "hierarchical",
  "rabenseifner",
  "recursive_halving_doubling",
  "ring_allreduce",
  "sharded_parameter_server",
]
