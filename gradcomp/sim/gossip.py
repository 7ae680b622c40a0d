r"""Pricing gossip on a described cluster: each worker waits for its neighbours only.

Gossip waits only for neighbours. A gossip step (D-PSGD, Lian
et al. 2017; CHOCO-SGD, Koloskova et al. 2019; survey 004 §2.3) has no
global barrier: worker ``i`` finishes step ``t`` once it has its own update
and the messages of its in-neighbours in the topology's phase of step ``t``
(:meth:`~gradcomp.topology.Topology.in_neighbours`). A slow worker
therefore delays its neighbours in the next step, their neighbours in the
step after, and so on, one hop per step, where a synchronous all-reduce
(:func:`~gradcomp.sim.clock.simulate_rounds`) delays everyone at once.

**What is simulated.** Training steps ``t = 1, 2, ...`` (1-based, for the
cluster's events) use the topology's phase of ``t - 1`` updates taken.
Worker ``i`` computes step ``t`` in ``c_i(t)``
(:meth:`~gradcomp.sim.cluster.Cluster.compute_seconds`). Each message costs
``m = cluster.exchange_seconds("collective-permute", message_bytes)``
(``alpha + B / bw``); a worker sending several messages in a step sends them
one after another on its link, in the phase's edge order, so its ``k``-th
message (1-based) arrives ``k m`` after its sends start; and a worker's
sends of step ``t`` wait for its link to finish those of step ``t - 1``.
Receives are buffered: a send never waits for the receiver (SGP's
non-blocking sends, Assran et al. 2019). With ``S``, ``F`` a worker's start
and finish, ``A`` the start of its sends and ``L`` when its link is free::

  S_i(t) = F_i(t-1)                                  (F_i(0) = 0)
  A_j(t) = max(S_j(t) [+ c_j(t) without overlap], L_j(t-1))
  L_j(t) = A_j(t) + m_j(t) m                         (m_j(t) messages sent)
  F_i(t) = max(S_i(t) + c_i(t), max_{j -> i, k-th of j} A_j(t) + k m)

**Overlap.** D-PSGD's update ``x_{t+1} = W_t x_t + u_t`` sends ``x_t``,
which exists when step ``t`` starts, so the messages fly during the
forward and backward pass (``overlap=True``, the sends start at ``S``).
CHOCO-SGD's message depends on the step's gradient (``overlap=False``: the
sends start after the compute). On a cluster whose exchanges share the
compute stream (``cluster.overlap=False``) nothing hides, and the step is
priced as ``overlap=False``.

**Homogeneous closed form** (:func:`gossip_step_seconds`). On identical
workers whose every edge is a full permutation (every factory's topology)
all workers move in lockstep and phase ``p``, whose ``K_p`` edges each carry
one message per worker, costs ``max(c, K_p m)`` with overlap and ``c + K_p
m`` without; the link is always free by the next step.

**What is ignored.** Links are the cluster's homogeneous alpha-beta links
and a worker receives any number of messages at once (only its sends
queue); the mixing arithmetic and any codec time are not counted unless
added to the FLOPs. A failed worker sends nothing from the step it fails
in, so its neighbours, then theirs, stall (``inf``) one hop per step; the
simulated time is that of the workers still running, as
:class:`~gradcomp.sim.clock.SimClock` reports it. Everything here is NumPy
(the topology is only read).

References:
  Survey 004 §2.3 (gossiping SGD); Lian et al., NeurIPS 2017 (D-PSGD);
  Koloskova et al., ICML 2019 (CHOCO-SGD); Assran et al., ICML 2019 (SGP);

"""

from __future__ import annotations

import math

import numpy as np

from gradcomp import topology as topologies
from gradcomp.sim.clock import _check_positive
from gradcomp.sim.cluster import Cluster, _is_int, _is_real
from gradcomp.topology import Topology


def _inputs(cluster, flops_per_step, topology, message_bytes):
  """Validated ``(flops, topology, message seconds)``."""
  if not isinstance(cluster, Cluster):
    raise ValueError(f"cluster must be a Cluster, got {cluster!r}")
  flops = _check_positive("flops_per_step", flops_per_step)
  if isinstance(topology, str):
    topology = topologies.get(topology, cluster.workers)
  if not isinstance(topology, topologies.Topology):
    raise ValueError(
      f"topology must be a Topology or one of {topologies.NAMES}, got {topology!r}"
    )
  if topology.workers != cluster.workers:
    raise ValueError(
      f"topology {topology.name!r} has {topology.workers} workers, the cluster "
      f"{cluster.workers}"
    )
  if cluster.topology != "ring":
    raise ValueError(
      "gossip sends messages between peers; the cluster's topology must be "
      f"'ring' (peer links), got {cluster.topology!r}"
    )
  if not _is_real(message_bytes) or not np.isfinite(message_bytes) or message_bytes < 0:
    raise ValueError(f"message_bytes must be finite and >= 0, got {message_bytes!r}")
  message = float(cluster.exchange_seconds("collective-permute", message_bytes))
  return flops, topology, message


def _check_overlap(overlap) -> None:
  if not isinstance(overlap, bool):
    raise ValueError(f"overlap must be True or False, got {overlap!r}")


def gossip_worker_seconds(
  cluster: Cluster,
  flops_per_step: float,
  topology: Topology | str,
  message_bytes: float,
  steps: int,
  *,
  overlap: bool = True,
) -> np.ndarray:
  """Each worker's simulated time after each step 0 to ``steps`` of a gossip run.

  The module docstring's recursion: worker ``i`` ends step ``t`` when it has
  computed and received its in-neighbours' messages of that step's phase.

  Args:
    cluster: the described cluster (speeds, slowdowns, failures, links); its
      ``topology`` must be ``"ring"`` (peer links).
    flops_per_step: one worker's training FLOPs per step, finite and > 0.
    topology: a :class:`~gradcomp.topology.Topology` on
      ``cluster.workers`` workers, or a name for
      :func:`~gradcomp.topology.get`.
    message_bytes: the bytes of one message (one ``ppermute``'s operand, as
      read from the compiled step), finite and >= 0.
    steps: the run's number of steps, >= 0.
    overlap: whether the messages of step ``t`` exist when it starts
      (D-PSGD) rather than after its compute (CHOCO-SGD).

  Returns:
    float64 array of shape ``(steps + 1, workers)``: row 0 is zeros; ``inf``
    for a worker that failed or waits for one.

  Examples:
    Worker 0 takes 5 s instead of 1 s in step 1 of a ring on 6 workers
    (free messages): its delay reaches its neighbours 1 and 5 in step 2,
    workers 2 and 4 in step 3, one hop per step.

    >>> from gradcomp.sim import Cluster, Slowdown, gossip_worker_seconds
    >>> slow = Slowdown(worker=0, factor=5.0, start=1, stop=2)
    >>> c = Cluster(6, latency_us=0.0, flops_per_second=1.0, events=(slow,))
    >>> for row in gossip_worker_seconds(c, 1.0, "ring", 0.0, 3):
    ...   print(row.round(6).tolist())
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    [5.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    [6.0, 5.0, 2.0, 2.0, 2.0, 5.0]
    [7.0, 6.0, 5.0, 3.0, 5.0, 6.0]
  """
  flops, topology, message = _inputs(cluster, flops_per_step, topology, message_bytes)
  if not _is_int(steps) or steps < 0:
    raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
  _check_overlap(overlap)
  hide = overlap and cluster.overlap
  n = cluster.workers
  # Per phase: for every edge, who sends to whom, and each sender's position.
  plans = []
  for phase in topology.phases:
    sent = np.zeros(n, np.int64)  # messages each worker has queued so far
    arrivals = []  # (receivers, senders, position of the message at its sender)
    for edge in phase.edges:
      receivers = np.array([i for i, s in enumerate(edge.sources) if s >= 0])
      senders = np.array([edge.sources[i] for i in receivers])
      sent[senders] += 1
      arrivals.append((receivers, senders, sent[senders].copy()))
    plans.append((arrivals, sent))

  times = np.zeros((steps + 1, n))
  finish = np.zeros(n)
  link = np.zeros(n)  # L_j: when worker j's link is free
  for t in range(1, steps + 1):
    arrivals, sent = plans[(t - 1) % len(plans)]
    compute = cluster.compute_seconds(flops, t)
    start = finish
    ready = start if hide else start + compute
    ready = np.where(np.isfinite(compute), ready, math.inf)  # failed: no sends
    sends = np.maximum(ready, link)
    link = np.where(sent > 0, sends + sent * message, link)
    finish = start + compute
    for receivers, senders, position in arrivals:
      finish[receivers] = np.maximum(
        finish[receivers], sends[senders] + position * message
      )
    times[t] = finish
  return times


def simulate_gossip(
  cluster: Cluster,
  flops_per_step: float,
  topology: Topology | str,
  message_bytes: float,
  steps: int,
  *,
  overlap: bool = True,
) -> np.ndarray:
  """Simulated seconds after each step 0 to ``steps`` of a gossip run on a cluster.

  Entry ``t`` is the latest finish of step ``t`` over the workers still
  running (:func:`gossip_worker_seconds`' row ``t``, its finite entries;
  ``inf`` when none is), like :func:`~gradcomp.sim.clock.simulate_rounds`
  for a synchronous run, but with no barrier: each worker waits only for
  its in-neighbours' messages. On identical workers entry ``t`` is the sum
  of :func:`gossip_step_seconds`' per-phase costs over steps ``1 .. t``.

  Args:
    cluster, flops_per_step, topology, message_bytes, steps, overlap: as
      for :func:`gossip_worker_seconds`.

  Returns:
    float64 array of shape ``(steps + 1,)``: ``[0]`` is 0.

  Examples:
    >>> c = Cluster(8, flops_per_second=1.0, latency_us=0.0, bandwidth_gbps=8.0)
    >>> simulate_gossip(c, 1.0, "ring", 1e9, 3).round(9).tolist()
    [0.0, 2.0, 4.0, 6.0]
    >>> simulate_gossip(c, 1.0, "ring", 1e9, 3, overlap=False).round(9).tolist()
    [0.0, 3.0, 6.0, 9.0]

  References:
    Survey 004 §2.3.
  """
  times = gossip_worker_seconds(
    cluster, flops_per_step, topology, message_bytes, steps, overlap=overlap
  )
  finite = np.where(np.isfinite(times), times, -math.inf).max(axis=1)
  return np.where(np.isfinite(finite), finite, math.inf)


def gossip_step_seconds(
  cluster: Cluster,
  flops_per_step: float,
  topology: Topology | str,
  message_bytes: float,
  *,
  overlap: bool = True,
) -> float:
  """The homogeneous steady-state gossip step: compute and ``K`` messages.

  .. math::

    T = \\frac1P \\sum_{p=0}^{P-1} \\begin{cases}
      \\max(c, K_p m) & \\text{overlap (D-PSGD)} \\\\
      c + K_p m & \\text{otherwise (CHOCO-SGD)}
    \\end{cases}

  with ``c`` one worker's compute (its base speed; events are ignored),
  ``m`` one message's ``cluster.exchange_seconds("collective-permute",
  message_bytes)``, ``K_p`` the most messages a worker sends in phase ``p``
  and ``P`` the topology's phases: the mean step over one period (the step
  itself for a static topology). It is :func:`simulate_gossip`'s step on
  identical workers when every edge is a full permutation (every factory's
  topology; a ring: ``max(c, 2m)``), and an upper bound otherwise.

  Args:
    cluster: a cluster whose workers all have the same speed.
    flops_per_step, topology, message_bytes, overlap: as for
      :func:`gossip_worker_seconds`.

  Returns:
    Seconds per step.

  Examples:
    A ring: each worker sends ``K = 2`` messages of 1 GB, ``m = 1`` s each
    at 8 Gbit/s. With 1 s of compute the exchange dominates, ``max(1, 2)``
    with overlap and ``1 + 2`` without; with 3 s it hides, ``max(3, 2)``.

    >>> from gradcomp.sim import Cluster, gossip_step_seconds
    >>> c = Cluster(8, 8.0, 0.0, flops_per_second=1.0)
    >>> round(gossip_step_seconds(c, 1.0, "ring", 1e9), 6)
    2.0
    >>> round(gossip_step_seconds(c, 1.0, "ring", 1e9, overlap=False), 6)
    3.0
    >>> round(gossip_step_seconds(c, 3.0, "ring", 1e9), 6)
    3.0
  """
  flops, topology, message = _inputs(cluster, flops_per_step, topology, message_bytes)
  _check_overlap(overlap)
  speeds = (1.0,) if cluster.speeds is None else cluster.speeds
  if len(set(speeds)) != 1:
    raise ValueError(
      "gossip_step_seconds prices identical workers, got speeds "
      f"{cluster.speeds!r}; use simulate_gossip for a heterogeneous cluster"
    )
  compute = flops / (cluster.flops_per_second * speeds[0])
  hide = overlap and cluster.overlap
  costs = []
  for step in range(len(topology.phases)):
    most = max(len(topology.out_neighbours(step, w)) for w in range(topology.workers))
    exchange = most * message
    costs.append(max(compute, exchange) if hide else compute + exchange)
  return float(np.mean(costs))
