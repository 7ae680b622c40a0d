"""A described cluster and the alpha-beta price of an exchange on it: ``Comm(x)``.

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

``alpha`` counts once per collective the compressor issues (a two-round
compressor pays it twice). One worker exchanges nothing.

``overlap`` says whether an exchange can proceed while the worker computes:
true for a network with its own engine (a NIC, NCCL's copy engines), false
when the worker's own cores move the bytes, as between the virtual CPU devices
of one process (the "collective" is a rendezvous and a memcpy by the same
threads that compress and back-propagate). The timeline then runs exchanges
on the compute stream, and pipelining groups hides nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TOPOLOGIES = ("ring", "parameter_server")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Workers joined by a network, as the cost model sees them.

  Attributes:
    workers: number of data-parallel workers, >= 1.
    bandwidth_gbps: per-link bandwidth in Gbit/s (paper 000 §5: 20 Gbps
      Ethernet), > 0.
    latency_us: start-up latency of one message (alpha), in microseconds, >= 0.
    topology: ``"ring"`` (all-reduce and all-gather over a ring, as NCCL and
      Horovod do) or ``"parameter_server"``.
    overlap: whether exchanges run beside computation (a separate link) or
      on the compute stream (the same cores copy the bytes).
  """

  workers: int
  bandwidth_gbps: float = 20.0
  latency_us: float = 25.0
  topology: str = "ring"
  overlap: bool = True

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

  def exchange_seconds(self, kind: str, nbytes, messages=1) -> np.ndarray:
    """Seconds to run ``messages`` collectives of ``kind`` sending ``nbytes`` in all.

    ``nbytes`` is what one worker contributes (the operand bytes of the
    collectives, as in ``wire.wire_bytes``); arrays broadcast.
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
    steps, volume = {
      "all-reduce": (2 * (n - 1), 2 * (n - 1) / n),
      "all-gather": (n - 1, n - 1),
      "reduce-scatter": (n - 1, (n - 1) / n),
      "all-to-all": (n - 1, (n - 1) / n),
      "collective-permute": (1, 1),
    }[kind]
    return messages * steps * alpha + volume * nbytes * per_byte

  def comm_seconds(self, wire: dict) -> np.ndarray:
    """``Comm(x)``: the sum over kinds of :meth:`exchange_seconds`.

    Args:
      wire: ``{kind: (bytes, messages)}``, e.g. ``Profile.wire(size)``.
    """
    total = 0.0
    for kind, (nbytes, messages) in wire.items():
      total = total + self.exchange_seconds(kind, nbytes, messages)
    return np.asarray(total, np.float64)
