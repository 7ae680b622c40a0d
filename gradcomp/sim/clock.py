"""A simulated clock: training time on a described cluster, step by step.

The papers measure wall-clock time on clusters we do not have
(heterogeneous devices, co-running jobs, failures). The training program runs
on virtual devices and advances a :class:`SimClock` once per training step, so
that accuracy can be reported against the time the run would have taken on a
described :class:`~gradcomp.sim.cluster.Cluster`.

**What is simulated.** Each worker ``w`` has its own clock ``t_w`` (seconds).
In step ``s`` every worker computes one step's FLOPs ``F`` at its described
speed ``v_w(s)`` (:meth:`Cluster.compute_seconds`; slowdowns and failures
included), ``c_w(s) = F / (R v_w(s))``. A **barrier** (a synchronous
exchange: an all-reduce, a parameter-server round, local SGD's averaging)
makes every worker wait for the slowest, then the exchange runs::

  t_w <- t_w + c_w(s)                        every step, every worker
  t_w <- max_v t_v + exchange_seconds        at a barrier, every worker

so the time of a step is set by the slowest worker, the straggler effect of
synchronous SGD (paper 004 §2.2). Without a barrier each worker runs at its
own pace, as under an asynchronous server (paper 004 §2.3). The closed forms
the clock reproduces are :func:`synchronous_step_seconds` (a barrier every
step: paper 001 eq. 2, ``T = tau + phi``, with ``tau`` the slowest worker's
compute; eq. 5, ``T = tau + delta + psi``, when the codec's time ``delta`` is
counted in the exchange) and :func:`local_sgd_round_seconds` (a barrier every
``every`` steps).

**What is ignored.** The exchange never overlaps computation here: the
synchronous price is compute *plus* exchange (eq. 5's sequential model). A
scheme that hides its exchange behind compute (CD-SGD's ``T = max(tau,
phi)``, paper 001 eqs. 6-7; wait-free backprop, priced per step by
:mod:`gradcomp.sim.timeline`) passes only the part it does not hide, e.g.
``max(0, phi - tau)``, as ``exchange_seconds``. Links are the cluster's
homogeneous alpha-beta links, unaffected by slowdowns; data loading, the
optimizer update and the codec's time count only if the caller adds them to
the FLOPs or the exchange. Compute time comes from FLOPs and the described
speeds, never from this machine's wall time, so a run's simulated time does
not depend on where it ran.

Everything here is NumPy; :func:`forward_flops_per_sample` alone imports
JAX, through :func:`gradcomp.models.shapes.derive`.
"""

from __future__ import annotations

import numpy as np

from gradcomp.sim.cluster import Cluster, _check_step, _is_int, _is_real


def _check_positive(name: str, value, *, strict: bool = True) -> float:
  ok = _is_real(value) and np.isfinite(value) and (value > 0 if strict else value >= 0)
  if not ok:
    raise ValueError(
      f"{name} must be finite and {'>' if strict else '>='} 0, got {value!r}"
    )
  return float(value)


class SimClock:
  """Per-worker simulated clocks, advanced once per training step.

  The training program calls :meth:`step` after each step with whether the
  step ended in a barrier (a synchronous exchange) and what the exchange
  costs, logs :attr:`seconds` beside the step, and checkpoints
  :meth:`state` so that a resumed run continues the same clock.

  A failed worker (:class:`~gradcomp.sim.cluster.Failure`) never finishes:
  its ``t_w`` becomes ``inf``, and so does every worker's at the next barrier
  (a synchronous scheme stalls on a failure; routing around it is a
  balancer's job, paper 002 Alg. 1). Without barriers the healthy workers keep
  going and their ``t_w`` stay finite.

  Args:
    cluster: the described cluster (speeds, events, links).
    flops_per_step: one worker's training FLOPs per step, forward and
      backward (:func:`training_flops`), finite and > 0.
    times: per-worker times to start from (:meth:`state` of a checkpointed
      clock), shape ``(workers,)``, each >= 0 or ``inf``; default zeros.

  Examples:
    >>> from gradcomp.sim.cluster import Cluster
    >>> clock = SimClock(Cluster(2, speeds=(1.0, 0.5)), flops_per_step=8e12)
    >>> clock.step(1, barrier=True, exchange_seconds=0.5)
    2.5
    >>> clock.state()
    array([2.5, 2.5])
  """

  def __init__(self, cluster: Cluster, flops_per_step: float, *, times=None):
    if not isinstance(cluster, Cluster):
      raise ValueError(f"cluster must be a Cluster, got {cluster!r}")
    self.cluster = cluster
    self.flops_per_step = _check_positive("flops_per_step", flops_per_step)
    self._times = np.zeros(cluster.workers, np.float64)
    if times is not None:
      self.restore(times)

  def step(self, step: int, *, barrier: bool, exchange_seconds: float = 0.0) -> float:
    """Advances every worker through training step ``step``.

    Every worker ``w`` computes: ``t_w += c_w(step)``
    (:meth:`Cluster.compute_seconds` of ``flops_per_step``). With a barrier,
    all then wait for the slowest and the exchange follows: ``t_w = max_v t_v
    + exchange_seconds``. Without one, each worker pays ``exchange_seconds``
    on its own clock (its own push / pull, waiting for no one).

    Args:
      step: the training step just run, 1-based (for the cluster's events).
      barrier: whether the step ends in a synchronous exchange.
      exchange_seconds: what the exchange costs after the barrier, e.g.
        ``cluster.comm_seconds(wire)``, finite and >= 0.

    Returns:
      :attr:`seconds` after the step.
    """
    _check_step(step)
    if not isinstance(barrier, bool):
      raise ValueError(f"barrier must be True or False, got {barrier!r}")
    exchange = _check_positive("exchange_seconds", exchange_seconds, strict=False)
    times = self._times + self.cluster.compute_seconds(self.flops_per_step, step)
    if barrier:
      times = np.full_like(times, times.max())
    self._times = times + exchange
    return self.seconds

  @property
  def seconds(self) -> float:
    """The simulated time: when every worker still running has finished.

    ``max_w t_w`` over the workers whose clock is finite, i.e. that have
    neither failed nor been stalled at a barrier by a failed worker; ``inf``
    when none is left (after a barrier that waited for a failed worker, or
    when every worker failed). Without failures it is simply ``max_w t_w``.
    """
    finite = self._times[np.isfinite(self._times)]
    return float(finite.max()) if finite.size else float("inf")

  def state(self) -> np.ndarray:
    """A copy of the per-worker times ``t_w``: float64, shape ``(workers,)``."""
    return self._times.copy()

  def restore(self, times) -> None:
    """Sets the per-worker times, e.g. from a checkpointed :meth:`state`.

    Args:
      times: shape ``(workers,)``, each >= 0 or ``inf`` (never NaN).
    """
    t = np.array(times, np.float64)
    if t.shape != (self.cluster.workers,) or np.isnan(t).any() or (t < 0).any():
      raise ValueError(
        f"times must have shape ({self.cluster.workers},) with values >= 0 "
        f"(inf allowed), got {times!r}"
      )
    self._times = t


def simulate_rounds(
  cluster: Cluster, flops_per_step: float, is_round, round_wire: dict, steps: int
) -> np.ndarray:
  """Simulated seconds after each step 0 to ``steps`` of a run with exchange rounds.

  The run's :class:`SimClock` played out: every step each worker computes
  ``flops_per_step``; a step with ``is_round(step)`` is a barrier followed by
  the round's exchange, ``cluster.comm_seconds`` of ``round_wire``
  (``{kind: bytes}``, one message per kind, as read from a compiled round);
  other steps exchange nothing. Synchronous training is a round every step;
  local SGD one every ``every`` steps. The clock is a pure function of its
  inputs, so a resumed run recomputes it rather than checkpointing it.

  Args:
    cluster: the described cluster.
    flops_per_step: one worker's training FLOPs per step, finite and > 0.
    is_round: ``step -> bool`` for steps ``1 .. steps``.
    round_wire: ``{kind: bytes}`` of one round (kinds with 0 bytes ignored),
      or ``step -> {kind: bytes}`` where rounds differ (1-bit Adam's dense
      warm-up, then its compressed exchange).
    steps: the run's number of steps, >= 0.

  Returns:
    float64 array of shape ``(steps + 1,)``: ``[0]`` is 0; ``inf`` from the
    first barrier after a failure.

  Examples:
    Local SGD with a round every 2 steps: 1 s of compute per step, and the
    round's 1 GB all-reduce takes 1 s on 2 workers at 8 Gbit/s. Worker 1
    failing in step 3 stalls the run at the next barrier.

    >>> from gradcomp.sim import Cluster, Failure, simulate_rounds
    >>> c = Cluster(2, bandwidth_gbps=8.0, latency_us=0.0, flops_per_second=1.0)
    >>> every_2 = lambda step: step % 2 == 0
    >>> simulate_rounds(c, 1.0, every_2, {"all-reduce": 1e9}, 4).round(6).tolist()
    [0.0, 1.0, 3.0, 4.0, 6.0]
    >>> c = Cluster(2, 8.0, 0.0, flops_per_second=1.0, events=(Failure(1, step=3),))
    >>> simulate_rounds(c, 1.0, every_2, {"all-reduce": 1e9}, 4).round(6).tolist()
    [0.0, 1.0, 3.0, 4.0, inf]
  """
  clock = SimClock(cluster, flops_per_step)
  wire_at = round_wire if callable(round_wire) else (lambda step: round_wire)
  priced: dict[tuple, float] = {}

  def exchange(step: int) -> float:
    wire = {k: b for k, b in wire_at(step).items() if b}
    key = tuple(sorted(wire.items()))
    if key not in priced:
      priced[key] = float(cluster.comm_seconds({k: (b, 1) for k, b in key}))
    return priced[key]

  seconds = np.zeros(steps + 1)
  for step in range(1, steps + 1):
    barrier = bool(is_round(step))
    seconds[step] = clock.step(
      step, barrier=barrier, exchange_seconds=exchange(step) if barrier else 0.0
    )
  return seconds


def simulate_overlapped_rounds(
  cluster: Cluster,
  flops_per_step: float,
  is_send,
  round_wire,
  steps: int,
  overlap: int,
) -> np.ndarray:
  """Simulated seconds after each step of a run whose exchanges overlap ``overlap`` steps.

  Streaming DiLoCo's overlapping communication (Douillard et al. 2025,
  arXiv 2501.18512): a round sent after step ``t`` (``is_send(t)``) starts
  once the last worker has finished step ``t`` (a collective needs every
  worker's operand) and runs for ``cluster.comm_seconds`` of its wire while
  the workers go on computing; its result is needed after step ``t +
  overlap``, where each worker waits for it if it has not yet arrived:
  ``t_w = max(t_w, start + comm)``. Nothing waits at the send. With
  ``overlap=0`` that is :func:`simulate_rounds`' barrier and exchange. The
  link carries one round at a time: rounds are assumed not to overlap each
  other (``local_sgd`` requires ``overlap < every / fragments``), so no two
  share bandwidth.

  Args:
    cluster: the described cluster.
    flops_per_step: one worker's training FLOPs per step, finite and > 0.
    is_send: ``step -> bool`` for steps ``1 .. steps``.
    round_wire: ``{kind: bytes}`` of one round, or ``step -> {kind: bytes}``
      (a fragment's round).
    steps: the run's number of steps, >= 0.
    overlap: steps between a send and the arrival it is needed at, >= 0.

  Returns:
    float64 array of shape ``(steps + 1,)``: ``[0]`` is 0.

  Examples:
    1 s of compute per step, a round every 4 steps whose exchange takes 2.5 s:
    with ``overlap=2``, two steps of compute hide 2 s of it.

    >>> from gradcomp.sim import Cluster, simulate_overlapped_rounds
    >>> c = Cluster(2, bandwidth_gbps=8.0, latency_us=0.0, flops_per_second=1.0)
    >>> every_4 = lambda step: step % 4 == 0
    >>> simulate_overlapped_rounds(c, 1.0, every_4, {"all-reduce": 2.5e9}, 8, 2).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.5, 7.5, 8.5]
  """
  if (
    isinstance(overlap, bool)
    or not isinstance(overlap, int | np.integer)
    or overlap < 0
  ):
    raise ValueError(f"overlap must be an int >= 0, got {overlap!r}")
  clock = SimClock(cluster, flops_per_step)
  wire_at = round_wire if callable(round_wire) else (lambda step: round_wire)
  arrivals: dict[int, float] = {}
  seconds = np.zeros(steps + 1)
  for step in range(1, steps + 1):
    clock.step(step, barrier=False)
    times = clock.state()
    if is_send(step):
      wire = {k: (b, 1) for k, b in wire_at(step).items() if b}
      done = float(times.max()) + float(cluster.comm_seconds(wire))
      arrivals[step + overlap] = max(arrivals.get(step + overlap, 0.0), done)
    if step in arrivals:
      clock.restore(np.maximum(times, arrivals.pop(step)))
    seconds[step] = clock.seconds
  return seconds


def synchronous_step_seconds(
  cluster: Cluster, flops_per_step: float, step: int, wire: dict
) -> float:
  """One step of synchronous SGD: the slowest worker's compute, then the exchange.

  .. math:: T(s) = \\max_w \\frac{F}{R \\, v_w(s)} + \\mathrm{Comm}(x)

  Paper 001 eq. 2 (``T = tau + phi``), with ``tau`` the slowest worker's
  compute (paper 004 §2.2); no overlap of the exchange with compute. It is what
  :class:`SimClock` adds in a step with a barrier and ``exchange_seconds =
  cluster.comm_seconds(wire)``. ``inf`` if a worker has failed.

  Args:
    cluster: the described cluster.
    flops_per_step: one worker's training FLOPs per step ``F``, finite and > 0.
    step: the training step ``s`` (1-based).
    wire: ``{kind: (bytes, messages)}``, as :meth:`Cluster.comm_seconds`
      takes it (``{}``: no exchange).

  Returns:
    Seconds.

  Examples:
    2 FLOPs at 1 FLOP/s, then a 1 GB all-reduce that takes 1 s on 2 workers
    at 8 Gbit/s; a half-speed worker makes everyone wait 4 s, not 2.

    >>> from gradcomp.sim import Cluster, synchronous_step_seconds
    >>> wire = {"all-reduce": (1e9, 1)}
    >>> fast = Cluster(2, 8.0, 0.0, flops_per_second=1.0)
    >>> round(synchronous_step_seconds(fast, 2.0, 1, wire), 6)
    3.0
    >>> slow = Cluster(2, 8.0, 0.0, speeds=(1.0, 0.5), flops_per_second=1.0)
    >>> round(synchronous_step_seconds(slow, 2.0, 1, wire), 6)
    5.0
  """
  flops = _check_positive("flops_per_step", flops_per_step)
  compute = cluster.compute_seconds(flops, step).max()
  return float(compute + cluster.comm_seconds(wire))


def local_sgd_round_seconds(
  cluster: Cluster, flops_per_step: float, first_step: int, every: int, wire: dict
) -> float:
  """One round of local SGD: ``every`` local steps, then a synchronous exchange.

  .. math:: T = \\max_w \\sum_{s=s_0}^{s_0 + H - 1} \\frac{F}{R \\, v_w(s)}
     + \\mathrm{Comm}(x)

  with ``s_0 = first_step`` and ``H = every``: workers run their ``H`` steps
  without waiting for one another and meet at the exchange, so a worker slowed
  for part of the round is waited for once, not every step. It is what
  :class:`SimClock` adds over steps ``s_0 .. s_0 + H - 1`` with a barrier on
  the last and ``exchange_seconds = cluster.comm_seconds(wire)``. ``inf`` if a
  worker has failed by the end of the round.

  Args:
    cluster: the described cluster.
    flops_per_step: one worker's training FLOPs per step ``F``, finite and > 0.
    first_step: the round's first training step ``s_0`` (1-based).
    every: the number of steps per round ``H``, >= 1.
    wire: the exchange, ``{kind: (bytes, messages)}`` as for
      :meth:`Cluster.comm_seconds`.

  Returns:
    Seconds.

  Examples:
    Worker 1 runs 3 times slower in step 2 of a 4-step round (1 s per step,
    a 1 s exchange): it finishes at ``1 + 3 + 1 + 1 = 6`` s and the round
    ends at 7 s, where synchronous SGD waits for it and exchanges every step:
    ``(1 + 3 + 1 + 1) + 4 * 1 = 10`` s.

    >>> from gradcomp.sim import Cluster, Slowdown
    >>> from gradcomp.sim import local_sgd_round_seconds, synchronous_step_seconds
    >>> slow = Slowdown(worker=1, factor=3.0, start=2, stop=3)
    >>> c = Cluster(2, 8.0, 0.0, flops_per_second=1.0, events=(slow,))
    >>> wire = {"all-reduce": (1e9, 1)}  # 1 s on 2 workers at 8 Gbit/s
    >>> round(local_sgd_round_seconds(c, 1.0, 1, 4, wire), 6)
    7.0
    >>> round(sum(synchronous_step_seconds(c, 1.0, s, wire) for s in range(1, 5)), 6)
    10.0
  """
  flops = _check_positive("flops_per_step", flops_per_step)
  _check_step(first_step)
  if not _is_int(every) or every < 1:
    raise ValueError(f"every must be an integer >= 1, got {every!r}")
  compute = sum(
    cluster.compute_seconds(flops, s) for s in range(first_step, first_step + every)
  )
  return float(compute.max() + cluster.comm_seconds(wire))


def training_flops(forward_flops_per_sample: float, batch_per_worker: int) -> float:
  """One worker's training FLOPs per step: forward and backward, ``3 * forward * batch``.

  The backward pass computes gradients for both the activations and the
  weights, about twice the forward's FLOPs (the convention of Kaplan et al.,
  *Scaling Laws for Neural Language Models*, 2020, §2.1: ``6N`` FLOPs per
  token for ``N`` parameters, a forward ``2N`` plus a backward ``4N``; also
  :func:`gradcomp.sim.model_workload.model_workload`'s backward = 2 x forward).
  The optimizer update and the codec are not counted.

  Args:
    forward_flops_per_sample: forward FLOPs of one sample
      (:func:`forward_flops_per_sample`), finite and >= 0.
    batch_per_worker: samples per worker per step, >= 1.

  Returns:
    FLOPs, the ``flops_per_step`` of :class:`SimClock`.

  Examples:
    >>> training_flops(2 * 784 * 10, 32)  # a Dense(784 -> 10) without bias
    1505280.0
  """
  forward = _check_positive(
    "forward_flops_per_sample", forward_flops_per_sample, strict=False
  )
  if not _is_int(batch_per_worker) or batch_per_worker < 1:
    raise ValueError(
      f"batch_per_worker must be an integer >= 1, got {batch_per_worker!r}"
    )
  return 3.0 * forward * batch_per_worker


def forward_flops_per_sample(module, sample) -> float:
  """Forward FLOPs of one sample through a flax module, from its jaxpr.

  The sum over parameter tensors of :func:`gradcomp.models.shapes.derive`'s
  per-tensor FLOPs, which are per sample for a sample with a leading batch
  dimension of 1 (derive scales with the batch it is given, so a larger one
  is refused here). Conventions: a multiply-add is 2 FLOPs (a ``Dense(din,
  dout)`` kernel costs ``2 * din * dout``, its bias ``dout``); any other op
  meeting a parameter costs its output size; ops on activations alone
  (nonlinearities, pooling, residual adds, the loss) are not counted, which
  undercounts slightly. The module is traced abstractly, never compiled or
  run.

  Args:
    module: a flax module whose ``apply(variables, x)`` is its forward pass.
    sample: one sample, leading batch dimension 1 (an array or a
      ``jax.ShapeDtypeStruct``).

  Returns:
    FLOPs per sample.

  Examples:
    >>> import flax.linen as nn
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from gradcomp.sim import forward_flops_per_sample
    >>> sample = jax.ShapeDtypeStruct((1, 784), jnp.float32)
    >>> forward_flops_per_sample(nn.Dense(10), sample)  # 2 * 784 * 10 + 10
    15690.0
  """
  from gradcomp.models import shapes  # JAX only when needed.

  shape = tuple(getattr(sample, "shape", ()))
  if not shape or shape[0] != 1:
    raise ValueError(
      f"sample must have a leading batch dimension of 1, got shape {shape}"
    )
  return float(sum(t.flops for t in shapes.derive(module, sample)))
