"""A described cluster: the alpha-beta price ``Comm(x)`` of an exchange, and compute.

Paper 000 §4.3, eq. 7 needs ``Comm(x_i)``, the time to exchange group ``i``'s
payload. The payload (bytes and collectives per worker) comes from the
compressor's :class:`~gradcomp.sim.profile.Profile`, so top-k's indices and
QSGD's norms count; this module prices it with the alpha-beta (latency +
bytes / bandwidth) model of each exchange pattern (paper 004 §2.4: ring
all-reduce, after Patarasuk & Yuan 2009, not the survey's Algorithm 2, which
indexes wrongly; parameter server, §2.1):

* ring all-reduce of ``B`` bytes on ``n`` workers: ``2 (n-1)`` steps, each a
  message of ``B / n``: ``2 (n-1) alpha + 2 (n-1) / n * B / bw``;
* ring all-gather of ``B`` bytes from each worker: ``(n-1) alpha + (n-1) B / bw``;
* reduce-scatter, all-to-all: ``(n-1) alpha + (n-1) / n * B / bw``;
  collective-permute: ``alpha + B / bw``;
* parameter server (one server on the same kind of link, full duplex): every
  worker pushes ``B`` and pulls the result. All-reduce: ``2 alpha + 2 n B /
  bw`` (the server's link carries ``n`` pushes, then ``n`` pulls); all-gather:
  ``2 alpha + (n + n^2) B / bw`` (each worker pulls all ``n`` payloads).

**How an all-reduce moves bytes** (``allreduce``, issue 16). With
``topology="ring"`` the all-reduce is priced by the algorithm of
:mod:`gradcomp.sim.collectives` that ``allreduce`` names (the other kinds keep
their ring prices above): ``"ring"`` (the default, the first formula above,
bit for bit: it is :func:`~gradcomp.sim.collectives.ring_allreduce`),
``"recursive_halving_doubling"`` / ``"rabenseifner"``, ``"binary_tree"``,
``"hierarchical"`` (``workers_per_node`` workers per node on an intra-node
link of ``intra_bandwidth_gbps`` and ``intra_latency_us``, a ring between
nodes on the cluster's link), ``"sharded_parameter_server"`` (``servers``
servers, ``colocated`` on workers or on their own nodes; survey 004 §2.1,
§2.4), or ``"best"``: the cheapest of
:data:`~gradcomp.sim.collectives.FLAT` for each message size, as
:func:`~gradcomp.sim.collectives.best_allreduce` picks.

Every one of these prices is affine in the bytes, ``T(B) = k alpha + v B beta``
(the hierarchical one adds an intra-node ``k_i alpha_i + v_i B beta_i``), so
``messages`` collectives carrying ``nbytes`` in all cost ``messages k alpha +
v nbytes beta = messages T(nbytes / messages)``: each collective pays its
latency, the bytes are paid once. ``k`` and ``v`` are read off the
collectives' own functions (at unit latency and unit per-byte time), so the
formulas live in one place; for the ring they are ``2 (n-1)`` and
``2 (n-1) / n`` exactly, and the price is the one this module always gave.
``"best"`` takes, element by element, the least of the flat algorithms'
prices; which one wins depends on ``nbytes / messages``.

``topology="parameter_server"`` keeps the single-server model above for both
the all-reduce and the all-gather, unchanged (the CD-SGD predictions of
``bench.cdsgd_time`` are read on it), and takes no ``allreduce``
but the default. It is not ``sharded_parameter_server`` with one dedicated
server, ``2 n (alpha + B beta)``: both send ``2 n B`` bytes through the
server's link, but the single-server model pays ``alpha`` once per phase
(the ``n`` pushes overlap their start-up), the sharded one once per queued
message, as every algorithm of :mod:`gradcomp.sim.collectives` does. For
sharded or co-located servers use ``allreduce="sharded_parameter_server"``
(with the default ``topology="ring"``, whose all-gather is the ring's).

``alpha`` counts once per collective the compressor issues (a two-round
compressor pays it twice). One worker exchanges nothing.

**Two link classes**. A profile's wire key may also name a link:
``"<kind>@fast"`` is a ring over the ``workers_per_node`` devices of a node
on the intra-node link, ``"<kind>@slow"`` a ring over the nodes on the
cluster's link (:meth:`Cluster.link_seconds`), as
``gradcomp.hierarchical``'s reduce-scatter, inner exchange and all-gather
run; :meth:`Cluster.axis_seconds` prices a program's traced collectives
the same way.

``overlap`` says whether an exchange can proceed while the worker computes:
true for a network with its own engine (a NIC, NCCL's copy engines), false
when the worker's own cores move the bytes, as between the virtual CPU devices
of one process (the "collective" is a rendezvous and a memcpy by the same
threads that compress and back-propagate). The timeline then runs exchanges
on the compute stream, and pipelining groups hides nothing.

**Compute.** A cluster also describes its workers' compute, so
that a run can be priced in simulated seconds on a cluster we do not have:

* ``speeds``: each worker's speed relative to a reference device that sustains
  ``flops_per_second`` (8 TFLOP/s by default, about half a V100's fp32 peak:
  paper 000 §5, as ``model_workload.DEFAULT_TFLOPS``); a heterogeneous edge
  platform (paper 002 §1) mixes devices of different speeds;
* ``events``: changes over time. A :class:`Slowdown` divides a worker's speed
  by ``factor`` over a range of steps, as a co-running job does (paper 002
  §3.3: the task's time becomes ``t0 * RG(U)`` with ``RG(U) > 1``); a
  :class:`Failure` stops a worker for good (paper 004 §2.3: synchronous SGD
  stalls on it, asynchronous SGD carries on).

One worker's compute time in step ``s`` is then
``flops / (flops_per_second * speed_w(s))`` (:meth:`Cluster.compute_seconds`):
the time is read from FLOPs and described speeds, never from this machine's
clock. Steps are the training program's, counted from 1.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import numpy as np

from gradcomp.parallel.wire import COLLECTIVES, link_factor
from gradcomp.sim import collectives

TOPOLOGIES = ("ring", "parameter_server")
#: The all-reduce algorithms a cluster can run: every one of
#: :data:`gradcomp.sim.collectives.ALGORITHMS`, and ``"best"``.
ALLREDUCE = (*collectives.ALGORITHMS, "best")
#: Intra-node link of ``allreduce="hierarchical"`` by default: PCIe 3.0 x16,
#: about 16 GB/s per direction (the V100 servers of paper 000 §5 have no
#: stated intra-node link), and a few microseconds per message.
DEFAULT_INTRA_BANDWIDTH_GBPS = 128.0
DEFAULT_INTRA_LATENCY_US = 5.0
#: Training throughput of a speed-1.0 worker, FLOP/s: ``model_workload``'s
#: ``DEFAULT_TFLOPS`` (about half a V100's 15.7 TFLOP/s fp32 peak, paper 000 §5).
DEFAULT_FLOPS_PER_SECOND = 8e12
#: The link classes a wire key may name after its kind: ``"all-gather@slow"``
#: is a ring across nodes, ``"reduce-scatter@fast"`` one inside a node
#: (:meth:`Cluster.link_seconds`).
LINKS = ("fast", "slow")


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  """A real scalar, not a bool; 0-d arrays such as :meth:`Cluster.comm_seconds`'s too."""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return value.dtype.kind in "iuf"
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def split_wire_key(key: str) -> tuple[str, str | None]:
  """``(kind, link class or None)`` of a wire key such as ``"all-gather@slow"``.

  Raises:
    ValueError: the kind is no collective of
      :data:`gradcomp.parallel.wire.COLLECTIVES`, or the suffix no link
      class of :data:`LINKS`; the message names the key.
  """
  kind, at, link = str(key).partition("@")
  if kind not in COLLECTIVES:
    raise ValueError(
      f"unknown collective kind {kind!r} in wire key {key!r}; use one of "
      f"{COLLECTIVES}, optionally with '@fast' or '@slow'"
    )
  if at and link not in LINKS:
    raise ValueError(
      f"unknown link class {link!r} in wire key {key!r}; use one of {LINKS}"
    )
  return kind, (link if at else None)


def _ring_seconds(kind: str, group: int, nbytes, messages, gbps, latency_us):
  """``messages`` ring collectives of ``kind`` over ``group`` devices, ``nbytes`` in all.

  One latency per ring step (``2 (group - 1)`` for an all-reduce, 1 for a
  permute, ``group - 1`` otherwise) per collective, and the operand bytes
  times :func:`~gradcomp.parallel.wire.link_factor` at the link's bandwidth;
  0 for a group of one. The price of :meth:`Cluster.axis_seconds`, of
  ``"<kind>@fast"`` / ``"<kind>@slow"`` wire keys, and of the flat ring's
  collectives other than the all-reduce (:meth:`Cluster.exchange_seconds`).
  """
  if group <= 1:
    return np.zeros(np.broadcast(nbytes, messages).shape)
  steps = {"all-reduce": 2 * (group - 1), "collective-permute": 1}.get(kind, group - 1)
  link_bytes = nbytes * link_factor(kind, group)
  return messages * steps * (latency_us * 1e-6) + link_bytes * 8.0 / (gbps * 1e9)


def _check_step(step) -> None:
  if not _is_int(step) or step < 1:
    raise ValueError(f"step must be an integer >= 1 (1-based), got {step!r}")


@dataclasses.dataclass(frozen=True)
class Slowdown:
  """A worker running slower for a while, as beside a co-running job.

  Paper 002 §3.3: a co-running workload stretches the training task's time per
  unit of data from ``t0`` to ``t0 * RG(U)``, ``RG(U) > 1``; here ``factor`` is
  that ratio, given rather than predicted. Slowdowns that overlap on a worker
  compound: their factors multiply.

  Attributes:
    worker: the worker's index, in ``[0, workers)`` of the cluster.
    factor: the worker's speed is divided by it, finite and >= 1.
    start: first training step slowed (1-based, inclusive), >= 1.
    stop: first step no longer slowed (exclusive), > ``start``; ``None`` for
      the rest of the run.

  Examples:
    >>> from gradcomp.sim import Cluster, Slowdown
    >>> slow = Slowdown(worker=1, factor=4.0, start=2, stop=3)  # step 2 only
    >>> c = Cluster(2, flops_per_second=1.0, events=(slow,))
    >>> [c.speeds_at(s).tolist() for s in (1, 2, 3)]
    [[1.0, 1.0], [1.0, 0.25], [1.0, 1.0]]
    >>> c.compute_seconds(2.0, step=2).tolist()  # 2 FLOPs at 1 / 4 FLOP/s
    [2.0, 8.0]
  """

  worker: int
  factor: float
  start: int
  stop: int | None = None

  def __post_init__(self):
    if not _is_int(self.worker) or self.worker < 0:
      raise ValueError(f"Slowdown.worker must be an integer >= 0, got {self.worker!r}")
    if not _is_real(self.factor) or not np.isfinite(self.factor) or self.factor < 1:
      raise ValueError(f"Slowdown.factor must be finite and >= 1, got {self.factor!r}")
    if not _is_int(self.start) or self.start < 1:
      raise ValueError(f"Slowdown.start must be an integer >= 1, got {self.start!r}")
    if self.stop is not None and (not _is_int(self.stop) or self.stop <= self.start):
      raise ValueError(
        f"Slowdown.stop must be None or an integer > start = {self.start}, "
        f"got {self.stop!r}"
      )
    object.__setattr__(self, "worker", int(self.worker))
    object.__setattr__(self, "factor", float(self.factor))
    object.__setattr__(self, "start", int(self.start))
    if self.stop is not None:
      object.__setattr__(self, "stop", int(self.stop))

  def active(self, step: int) -> bool:
    """Whether ``step`` is slowed: ``start <= step < stop``."""
    return self.start <= step and (self.stop is None or step < self.stop)


@dataclasses.dataclass(frozen=True)
class Failure:
  """A worker that stops for good: from ``step`` on it never finishes a step.

  Its speed is 0 and its compute time infinite (paper 004 §2.3: synchronous
  SGD then waits forever; asynchronous SGD carries on without it).

  Attributes:
    worker: the worker's index, in ``[0, workers)`` of the cluster.
    step: the first training step it does not finish (1-based), >= 1.

  Examples:
    >>> from gradcomp.sim import Cluster, Failure, synchronous_step_seconds
    >>> c = Cluster(2, flops_per_second=1.0, events=(Failure(worker=0, step=3),))
    >>> c.compute_seconds(2.0, step=2).tolist(), c.compute_seconds(2.0, step=3).tolist()
    ([2.0, 2.0], [inf, 2.0])
    >>> synchronous_step_seconds(c, 2.0, 3, {})  # the barrier waits forever
    inf
  """

  worker: int
  step: int

  def __post_init__(self):
    if not _is_int(self.worker) or self.worker < 0:
      raise ValueError(f"Failure.worker must be an integer >= 0, got {self.worker!r}")
    if not _is_int(self.step) or self.step < 1:
      raise ValueError(f"Failure.step must be an integer >= 1, got {self.step!r}")
    object.__setattr__(self, "worker", int(self.worker))
    object.__setattr__(self, "step", int(self.step))


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Workers joined by a network, as the cost model and the simulated clock see them.

  Attributes:
    workers: number of data-parallel workers, >= 1.
    bandwidth_gbps: per-link bandwidth in Gbit/s (paper 000 §5: 20 Gbps
      Ethernet), > 0.
    latency_us: start-up latency of one message (alpha), in microseconds, >= 0.
    topology: ``"ring"`` (collectives as NCCL and Horovod run them: the
      all-reduce by ``allreduce``, the other kinds over a ring) or
      ``"parameter_server"`` (one server; see the module docstring).
    overlap: whether exchanges run beside computation (a separate link) or
      on the compute stream (the same cores copy the bytes).
    speeds: each worker's compute speed relative to the reference device
      (1.0), ``workers`` finite values > 0 (a list is stored as a tuple);
      ``None``: a homogeneous cluster, every speed 1.0.
    flops_per_second: sustained training throughput of a speed-1.0 worker,
      FLOP/s, finite and > 0 (default :data:`DEFAULT_FLOPS_PER_SECOND`).
    events: :class:`Slowdown` and :class:`Failure` events (a list is stored
      as a tuple), their workers in ``[0, workers)``.
    allreduce: how an all-reduce moves bytes, one of :data:`ALLREDUCE`
      (default ``"ring"``); only ``"ring"`` with
      ``topology="parameter_server"``, which prices its own.
    servers: ``S`` of ``allreduce="sharded_parameter_server"``, an integer
      >= 1 (at most ``workers`` when ``colocated``).
    colocated: whether those servers run on workers (server ``s`` on worker
      ``s``) or on nodes of their own.
    workers_per_node: ``g`` of ``allreduce="hierarchical"``, an integer >= 1
      dividing ``workers``.
    intra_bandwidth_gbps: the intra-node link of ``"hierarchical"``, Gbit/s,
      finite and > 0 (default :data:`DEFAULT_INTRA_BANDWIDTH_GBPS`).
    intra_latency_us: its start-up latency per message, microseconds, finite
      and >= 0 (default :data:`DEFAULT_INTRA_LATENCY_US`).

  Examples:
    A ring all-reduce of 1 MB on 4 workers at 8 Gbit/s (1 ns per byte) and
    10 us per message: ``2 (n-1) alpha + 2 (n-1) / n * B / bw = 60 us + 1.5
    ms``; one parameter server: ``2 alpha + 2 n B / bw = 20 us + 8 ms``.

    >>> from gradcomp.sim import Cluster
    >>> ring = Cluster(4, bandwidth_gbps=8.0, latency_us=10.0)
    >>> round(float(ring.comm_seconds({"all-reduce": (1e6, 1)})), 6)
    0.00156
    >>> ps = Cluster(4, 8.0, 10.0, topology="parameter_server")
    >>> round(float(ps.comm_seconds({"all-reduce": (1e6, 1)})), 6)
    0.00802
    >>> Cluster(2, speeds=(1.0, 0.5), flops_per_second=1e12).compute_seconds(2e12, 1)
    array([2., 4.])
  """

  workers: int
  bandwidth_gbps: float = 20.0
  latency_us: float = 25.0
  topology: str = "ring"
  overlap: bool = True
  speeds: tuple[float, ...] | None = None
  flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
  events: tuple[Slowdown | Failure, ...] = ()
  allreduce: str = "ring"
  servers: int = 1
  colocated: bool = False
  workers_per_node: int = 1
  intra_bandwidth_gbps: float = DEFAULT_INTRA_BANDWIDTH_GBPS
  intra_latency_us: float = DEFAULT_INTRA_LATENCY_US

  def __post_init__(self):
    if (
      isinstance(self.workers, bool)
      or not isinstance(self.workers, int)
      or self.workers < 1
    ):
      raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
    if not np.isfinite(self.bandwidth_gbps) or self.bandwidth_gbps <= 0:
      raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps!r}")
    if not np.isfinite(self.latency_us) or self.latency_us < 0:
      raise ValueError(f"latency_us must be >= 0, got {self.latency_us!r}")
    if self.topology not in TOPOLOGIES:
      raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
    if not isinstance(self.overlap, bool):
      raise ValueError(f"overlap must be True or False, got {self.overlap!r}")
    if self.speeds is not None:
      speeds = tuple(self.speeds) if np.iterable(self.speeds) else None
      if speeds is None or len(speeds) != self.workers:
        raise ValueError(
          f"speeds must hold one value per worker ({self.workers}), got {self.speeds!r}"
        )
      for w, v in enumerate(speeds):
        if not _is_real(v) or not np.isfinite(v) or v <= 0:
          raise ValueError(f"speeds[{w}] must be finite and > 0, got {v!r}")
      object.__setattr__(self, "speeds", tuple(float(v) for v in speeds))
    if (
      not _is_real(self.flops_per_second)
      or not np.isfinite(self.flops_per_second)
      or self.flops_per_second <= 0
    ):
      raise ValueError(
        f"flops_per_second must be finite and > 0, got {self.flops_per_second!r}"
      )
    object.__setattr__(self, "flops_per_second", float(self.flops_per_second))
    if not np.iterable(self.events) or isinstance(self.events, str):
      raise ValueError(
        f"events must be a sequence of Slowdown / Failure, got {self.events!r}"
      )
    events = tuple(self.events)
    for i, event in enumerate(events):
      if not isinstance(event, Slowdown | Failure):
        raise ValueError(f"events[{i}] must be a Slowdown or a Failure, got {event!r}")
      if event.worker >= self.workers:
        raise ValueError(
          f"events[{i}].worker must be in [0, {self.workers}), got {event.worker}"
        )
    object.__setattr__(self, "events", events)
    self._check_allreduce()

  def _check_allreduce(self) -> None:
    """Validates ``allreduce`` and the parameters of its algorithms."""
    if self.allreduce not in ALLREDUCE:
      raise ValueError(f"allreduce must be one of {ALLREDUCE}, got {self.allreduce!r}")
    if self.topology == "parameter_server" and self.allreduce != "ring":
      raise ValueError(
        "allreduce must be 'ring' (the default) with topology='parameter_server', "
        f"which prices its own single-server all-reduce; got {self.allreduce!r} "
        "(for S servers: topology='ring', allreduce='sharded_parameter_server')"
      )
    if not _is_int(self.servers) or self.servers < 1:
      raise ValueError(f"servers must be an integer >= 1, got {self.servers!r}")
    if not isinstance(self.colocated, bool):
      raise ValueError(f"colocated must be True or False, got {self.colocated!r}")
    if (
      self.allreduce == "sharded_parameter_server"
      and self.colocated
      and self.servers > self.workers
    ):
      raise ValueError(
        f"servers must be in [1, workers = {self.workers}] when colocated, "
        f"got {self.servers!r}"
      )
    if not _is_int(self.workers_per_node) or self.workers_per_node < 1:
      raise ValueError(
        f"workers_per_node must be an integer >= 1, got {self.workers_per_node!r}"
      )
    if self.allreduce == "hierarchical" and self.workers % self.workers_per_node:
      raise ValueError(
        f"workers_per_node must divide workers = {self.workers}, "
        f"got {self.workers_per_node!r}"
      )
    for name, lo, strict in (
      ("intra_bandwidth_gbps", 0, True),
      ("intra_latency_us", 0, False),
    ):
      value = getattr(self, name)
      if (
        not _is_real(value)
        or not np.isfinite(value)
        or (value <= lo if strict else value < lo)
      ):
        bound = "> 0" if strict else ">= 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
      object.__setattr__(self, name, float(value))
    object.__setattr__(self, "servers", int(self.servers))
    object.__setattr__(self, "workers_per_node", int(self.workers_per_node))

  def speeds_at(self, step: int) -> np.ndarray:
    """Each worker's speed in training step ``step`` (1-based).

    ``speeds`` (1.0 if ``None``) divided by the factors of the slowdowns
    active at ``step`` (they compound), 0.0 for a worker failed at or before
    ``step``.

    Returns:
      A float64 array of shape ``(workers,)``.
    """
    _check_step(step)
    base = (1.0,) * self.workers if self.speeds is None else self.speeds
    speeds = np.array(base, np.float64)
    for event in self.events:
      if isinstance(event, Slowdown) and event.active(step):
        speeds[event.worker] /= event.factor
    for event in self.events:
      if isinstance(event, Failure) and event.step <= step:
        speeds[event.worker] = 0.0
    return speeds

  def compute_seconds(self, flops, step: int) -> np.ndarray:
    """Each worker's time to compute ``flops`` FLOPs in training step ``step``.

    .. math:: t_w(s) = \\frac{F}{R \\cdot v_w(s)}

    with ``F = flops``, ``R = flops_per_second`` and ``v_w(s)`` the speed of
    :meth:`speeds_at`; ``inf`` for a failed worker (it never finishes, even
    with no work).

    Args:
      flops: one worker's FLOPs for the step, finite and >= 0.
      step: the training step (1-based), for the events.

    Returns:
      A float64 array of shape ``(workers,)``, seconds.
    """
    if not _is_real(flops) or not np.isfinite(flops) or flops < 0:
      raise ValueError(f"flops must be finite and >= 0, got {flops!r}")
    speeds = self.speeds_at(step)
    seconds = np.full(self.workers, np.inf)
    alive = speeds > 0
    seconds[alive] = float(flops) / (self.flops_per_second * speeds[alive])
    return seconds

  def _allreduce_terms(
    self, name: str
  ) -> tuple[tuple[float, float, float, float], ...]:
    """``((k, v, alpha, per_byte), ...)``: algorithm ``name`` costs
    ``sum(messages k alpha + v nbytes per_byte)`` (see the module docstring).

    ``k`` (messages in sequence) and ``v`` (bytes per byte reduced) are the
    collectives function's price at unit latency and no bytes, and at unit
    per-byte time and one byte; the hierarchical algorithm has a second term
    for its intra-node link.
    """
    n = self.workers
    link = (self.latency_us * 1e-6, 8.0 / (self.bandwidth_gbps * 1e9))
    if name == "hierarchical":
      f = functools.partial(
        collectives.hierarchical, workers_per_node=self.workers_per_node
      )
      intra = (self.intra_latency_us * 1e-6, 8.0 / (self.intra_bandwidth_gbps * 1e9))
      return (
        (
          f(n, 0.0, 1.0, 0.0, intra_alpha=0.0, intra_beta=0.0),
          f(n, 1.0, 0.0, 1.0, intra_alpha=0.0, intra_beta=0.0),
          *link,
        ),
        (
          f(n, 0.0, 0.0, 0.0, intra_alpha=1.0, intra_beta=0.0),
          f(n, 1.0, 0.0, 0.0, intra_alpha=0.0, intra_beta=1.0),
          *intra,
        ),
      )
    if name == "sharded_parameter_server":
      f = functools.partial(
        collectives.sharded_parameter_server,
        n,
        self.servers,
        colocated=self.colocated,
      )
    else:
      f = functools.partial(collectives.ALGORITHMS[name], n)
    return ((f(0.0, 1.0, 0.0), f(1.0, 0.0, 1.0), *link),)

  def allreduce_seconds(self, nbytes, messages=1, algorithm: str | None = None):
    """Seconds of ``messages`` all-reduces of ``nbytes`` in all, by ``algorithm``.

    Args:
      nbytes: bytes one worker reduces, over all the collectives; arrays
        broadcast.
      messages: how many all-reduces carry them (each pays its latency).
      algorithm: one of :data:`ALLREDUCE`, priced on the cluster's links
        whatever its topology; ``None``: the cluster's own all-reduce (its
        ``allreduce``, or the single server's with
        ``topology="parameter_server"``).

    Returns:
      A float64 array, the broadcast shape of ``nbytes`` and ``messages``.
    """
    if algorithm is None and self.topology == "parameter_server":
      return self.exchange_seconds("all-reduce", nbytes, messages)
    name = self.allreduce if algorithm is None else algorithm
    if name not in ALLREDUCE:
      raise ValueError(f"algorithm must be one of {ALLREDUCE}, got {name!r}")
    nbytes = np.asarray(nbytes, np.float64)
    messages = np.asarray(messages, np.float64)
    if self.workers == 1:
      return np.zeros(np.broadcast(nbytes, messages).shape)
    if name == "best":
      return np.minimum.reduce(
        [self.allreduce_seconds(nbytes, messages, a) for a in collectives.FLAT]
      )
    (k, v, alpha, per_byte), *rest = self._allreduce_terms(name)
    seconds = messages * k * alpha + v * nbytes * per_byte
    for k, v, alpha, per_byte in rest:
      seconds = seconds + (messages * k * alpha + v * nbytes * per_byte)
    return seconds

  def exchange_seconds(self, kind: str, nbytes, messages=1) -> np.ndarray:
    """Seconds to run ``messages`` collectives of ``kind`` sending ``nbytes`` in all.

    ``nbytes`` is what one worker contributes (the operand bytes of the
    collectives, as in ``wire.wire_bytes``); arrays broadcast. An
    all-reduce is priced by the cluster's ``allreduce``
    (:meth:`allreduce_seconds`) unless ``topology="parameter_server"``.
    """
    n = self.workers
    nbytes = np.asarray(nbytes, np.float64)
    messages = np.asarray(messages, np.float64)
    if n == 1:
      return np.zeros(np.broadcast(nbytes, messages).shape)
    alpha = self.latency_us * 1e-6
    per_byte = 8.0 / (self.bandwidth_gbps * 1e9)
    if self.topology == "parameter_server":
      volume = {"all-reduce": 2 * n, "all-gather": n + n * n}
      if kind not in volume:
        raise ValueError(f"the parameter-server model has no {kind!r} exchange")
      return messages * 2 * alpha + volume[kind] * nbytes * per_byte
    if kind == "all-reduce":
      return self.allreduce_seconds(nbytes, messages)
    return _ring_seconds(
      kind, n, nbytes, messages, self.bandwidth_gbps, self.latency_us
    )

  def axis_seconds(self, records, fast_axes=()) -> float:
    """Seconds of a program's collectives, each on the link class of its mesh axes.

    Two link classes: a collective whose replica groups span
    only axes in ``fast_axes`` (a node's NVLink, a slice's ICI) runs on the
    intra-node link (``intra_bandwidth_gbps``, ``intra_latency_us``); any
    other (or one of unknown axes) on the cluster's own link
    (``bandwidth_gbps``, ``latency_us``). Each is a ring over its own group
    (``record.group`` devices, not ``workers``): ``link_bytes`` (operand
    bytes times ``gradcomp.parallel.wire.link_factor``) at the link's
    bandwidth, plus one latency per ring step (``2 (g - 1)`` for an
    all-reduce, ``g - 1`` for an all-gather, reduce-scatter or all-to-all,
    1 for a permute). Collectives run one after another.

    Args:
      records: ``gradcomp.parallel.wire.Collective`` records
        (``gradcomp.axis_wire``).
      fast_axes: the mesh axes inside a node.

    Examples:
      A 1 MB all-reduce inside nodes of 4 at 800 Gbit/s (6 steps of 10 us,
      1.5 MB over links: 60 + 15 us), then a 0.1 MB all-gather across 2
      nodes at 8 Gbit/s (10 + 100 us):

      >>> from gradcomp.parallel.wire import Collective
      >>> c = Cluster(8, bandwidth_gbps=8.0, latency_us=10.0,
      ...             intra_bandwidth_gbps=800.0, intra_latency_us=10.0)
      >>> records = [Collective("all-reduce", 10**6, 4, ("local",)),
      ...            Collective("all-gather", 10**5, 2, ("node",))]
      >>> round(c.axis_seconds(records, fast_axes=("local",)) * 1e6, 3)  # us
      185.0
    """
    fast = set(fast_axes)
    total = 0.0
    for r in records:
      inside = r.axes is not None and set(r.axes) <= fast
      gbps = self.intra_bandwidth_gbps if inside else self.bandwidth_gbps
      latency_us = self.intra_latency_us if inside else self.latency_us
      total += float(
        _ring_seconds(r.kind, r.group, r.operand_bytes, 1, gbps, latency_us)
      )
    return total

  def link_seconds(self, key: str, nbytes, messages=1) -> np.ndarray:
    """Seconds of a profile's wire key: a collective kind, or one on a link class.

    ``"<kind>"`` runs over all ``workers`` on the cluster's link
    (:meth:`exchange_seconds`). ``"<kind>@fast"`` is a ring over the
    ``workers_per_node`` devices of a node on the intra-node link
    (``intra_bandwidth_gbps``, ``intra_latency_us``); ``"<kind>@slow"`` a
    ring over the ``workers / workers_per_node`` nodes on the cluster's link,
    whatever ``topology`` and ``allreduce`` say (the two hops of
    ``gradcomp.hierarchical``, priced as :meth:`axis_seconds` prices them).

    Args:
      key: the wire key (``Profile.wire_bytes``' keys).
      nbytes: operand bytes one worker contributes, over all the collectives;
        arrays broadcast.
      messages: how many collectives carry them (each pays its latencies).

    Raises:
      ValueError: an unknown kind or link class, or a link class on a
        cluster without nodes (``workers_per_node`` 1, or not dividing
        ``workers``).

    Examples:
      A 1 MB reduce-scatter inside nodes of 8 at 800 Gbit/s and 5 us (7
      steps, 7/8 MB over links: 35 + 8.75 us), then 0.1 MB all-gathered
      across 4 nodes at 8 Gbit/s and 25 us (3 steps, 0.3 MB: 75 + 300 us):

      >>> c = Cluster(32, bandwidth_gbps=8.0, latency_us=25.0, workers_per_node=8,
      ...             intra_bandwidth_gbps=800.0, intra_latency_us=5.0)
      >>> round(float(c.link_seconds("reduce-scatter@fast", 1e6)) * 1e6, 3)
      43.75
      >>> round(float(c.link_seconds("all-gather@slow", 1e5)) * 1e6, 3)
      375.0
    """
    kind, link = split_wire_key(key)
    if link is None:
      return self.exchange_seconds(kind, nbytes, messages)
    g = self.workers_per_node
    if g == 1 or self.workers % g:
      raise ValueError(
        f"wire key {key!r} prices a ring {'inside' if link == 'fast' else 'across'} "
        f"nodes, but this cluster has workers_per_node={g} for {self.workers} "
        f"workers: the profile was made for nodes of g > 1 devices, so the "
        f"cluster needs workers_per_node=g, dividing workers "
        f"(Profile.check_cluster names g)"
      )
    nbytes = np.asarray(nbytes, np.float64)
    messages = np.asarray(messages, np.float64)
    if link == "fast":
      return _ring_seconds(
        kind, g, nbytes, messages, self.intra_bandwidth_gbps, self.intra_latency_us
      )
    return _ring_seconds(
      kind, self.workers // g, nbytes, messages, self.bandwidth_gbps, self.latency_us
    )

  def comm_seconds(self, wire: dict) -> np.ndarray:
    """``Comm(x)``: the sum over wire keys of :meth:`link_seconds`.

    Args:
      wire: ``{key: (bytes, messages)}``, e.g. ``Profile.wire(size)``: a
        collective kind over all workers (:meth:`exchange_seconds`), or
        ``"<kind>@fast"`` / ``"<kind>@slow"``, a ring inside or across nodes.
    """
    total = 0.0
    for key, (nbytes, messages) in wire.items():
      total = total + self.link_seconds(key, nbytes, messages)
    return np.asarray(total, np.float64)
