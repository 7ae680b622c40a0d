r"""Pricing an epoch whose workers process different amounts of data (paper 002).

EdgeGossip (paper 002 §3.3-3.4) gives each platform a share ``r_i`` of its
data per epoch so that all finish together; the SPMD program steps every
worker the same number of times and masks a worker past its budget
(``gradcomp.schemes.gosgd``'s ``active``). The simulated clock must then
charge each worker only the samples it processed, not the steps it took.

**What is simulated.** Each worker ``w`` has its own clock ``t_w``. An
epoch of ``S`` steps starting at training step ``s_0`` (1-based, for the
cluster's events):

1. every worker first spends ``overhead_flops[w]`` (the trainer's loss
   evaluation of its aggregated points, Alg. 2 line 1) at its speed of
   step ``s_0``;
2. at step ``s = s_0 + j``, worker ``w`` computes ``samples[j, w]`` samples,
   ``samples[j, w] * flops_per_sample / (R v_w(s))`` seconds
   (:meth:`~gradcomp.sim.cluster.Cluster.compute_seconds`), then pays
   ``step_seconds[j, w]`` (its sends; the caller says what they cost). A
   worker with no samples in a step spends nothing: it is not waiting for
   anyone, gossip has no barrier (paper 002 §2.1);
3. the epoch ends in a barrier (NOTES.md, paper 002: "the paper's runs
   synchronise at each epoch"; §4.5: "slow platforms delay each epoch's
   sync"): every clock becomes the latest finite one.

The time reported after step ``j`` is the latest finite clock (the workers
still running, as :class:`~gradcomp.sim.clock.SimClock` reports it). A
failed worker (speed 0) with samples to do never finishes (``inf``) and is
dropped from the barrier: the gossip goes on without it, and routing its data
elsewhere is the balancer's halting rule (Alg. 1, lines 10-12). One with no
samples and no overhead keeps its clock.

The clocks are rounded to float32 after the barrier, so a run checkpointed
with float32 clocks and resumed continues exactly the uninterrupted run.

**What is ignored.** Receives and merges (gossip merges on receipt, off the
critical path); the codec and the mixing arithmetic unless added to the FLOPs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from gradcomp.sim.cluster import Cluster


class EpochTimes(NamedTuple):
  """One priced epoch.

  Attributes:
    seconds: ``(S,)`` float64, the simulated time after each step (the last
      after the barrier).
    times: ``(workers,)`` float64, every clock after the barrier (float32
      values).
    compute: ``(workers,)`` float64, each worker's seconds of training compute
      in the epoch (its samples only; ``inf`` for a failed worker with work).
    overhead: ``(workers,)`` float64, each worker's seconds of
      ``overhead_flops``.

  Examples:
    Worker 0 (speed 1) spends 1 s of overhead, then 2 samples per step;
    worker 1 (speed 0.5) processes 1 sample in step 1 and is masked in
    step 2. Each pays 0.5 s of sends per step with samples; the barrier at
    the end brings both clocks to worker 0's ``1 + 2 * (2 + 0.5) = 6`` s.

    >>> from gradcomp.sim import Cluster, simulate_masked_epoch
    >>> c = Cluster(2, speeds=(1.0, 0.5), flops_per_second=1.0)
    >>> samples = [[2, 1], [2, 0]]  # (steps, workers)
    >>> e = simulate_masked_epoch(c, [0.0, 0.0], 1, samples, flops_per_sample=1.0,
    ...                           overhead_flops=[1.0, 0.0], step_seconds=0.5)
    >>> e.seconds.tolist(), e.times.tolist()
    ([3.5, 6.0], [6.0, 6.0])
    >>> e.compute.tolist(), e.overhead.tolist()
    ([4.0, 2.0], [1.0, 0.0])
  """

  seconds: np.ndarray
  times: np.ndarray
  compute: np.ndarray
  overhead: np.ndarray


def _check_times(times, workers: int) -> np.ndarray:
  t = np.array(times, np.float64)
  if t.shape != (workers,) or np.isnan(t).any() or (t < 0).any():
    raise ValueError(
      f"times must have shape ({workers},) with values >= 0 (inf allowed), "
      f"got {times!r}"
    )
  return t


def _per_worker(name: str, value, shape) -> np.ndarray:
  a = np.broadcast_to(np.asarray(value, np.float64), shape)
  if not np.all(np.isfinite(a)) or np.any(a < 0):
    raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
  return a


def simulate_masked_epoch(
  cluster: Cluster,
  times: ArrayLike,
  first_step: int,
  samples: ArrayLike,
  *,
  flops_per_sample: float,
  overhead_flops: ArrayLike = 0.0,
  step_seconds: ArrayLike = 0.0,
) -> EpochTimes:
  """Advances per-worker clocks through one epoch of masked steps (module docstring).

  Args:
    cluster: the described cluster (speeds, events).
    times: ``(workers,)`` clocks at the epoch's start, >= 0 or ``inf``.
    first_step: the epoch's first training step, 1-based.
    samples: ``(S, workers)`` samples each worker processes at each step,
      >= 0 (0: a masked step).
    flops_per_sample: training FLOPs of one sample, forward and backward, > 0.
    overhead_flops: ``(workers,)`` (or a scalar) FLOPs each worker spends
      before its first step, >= 0.
    step_seconds: ``(S, workers)`` (or broadcastable) seconds each worker
      adds after computing a step with samples, >= 0 (its sends); ignored in
      masked steps.

  Returns:
    The :class:`EpochTimes`.

  Examples:
    >>> c = Cluster(2, speeds=(1.0, 0.5), flops_per_second=1.0)
    >>> e = simulate_masked_epoch(c, [0, 0], 1, [[2, 1], [2, 0]], flops_per_sample=1.0)
    >>> e.seconds.tolist(), e.compute.tolist()
    ([2.0, 4.0], [4.0, 2.0])
  """
  if not isinstance(cluster, Cluster):
    raise ValueError(f"cluster must be a Cluster, got {cluster!r}")
  n = cluster.workers
  t = _check_times(times, n)
  counts = np.asarray(samples)
  if counts.ndim != 2 or counts.shape[1] != n or counts.dtype.kind not in "iuf":
    raise ValueError(
      f"samples must be a real array of shape (steps, {n}), got {counts.shape}"
    )
  counts = _per_worker("samples", counts, counts.shape)
  if not (np.isfinite(flops_per_sample) and flops_per_sample > 0):
    raise ValueError(
      f"flops_per_sample must be finite and > 0, got {flops_per_sample!r}"
    )
  if isinstance(first_step, bool) or not isinstance(first_step, (int, np.integer)):
    raise ValueError(f"first_step must be an integer >= 1, got {first_step!r}")
  overhead_flops = _per_worker("overhead_flops", overhead_flops, (n,))
  sends = _per_worker("step_seconds", step_seconds, counts.shape)

  def seconds_of(flops, step):
    out = np.zeros(n)
    busy = flops > 0
    out[busy] = cluster.compute_seconds(1.0, step)[busy] * flops[busy]
    return out

  overhead = seconds_of(overhead_flops, int(first_step))
  t = t + overhead
  compute = np.zeros(n)
  after = np.empty(counts.shape[0])
  for j, row in enumerate(counts):
    work = seconds_of(row * flops_per_sample, int(first_step) + j)
    compute += work
    t = t + work + np.where(row > 0, sends[j], 0.0)
    finite = t[np.isfinite(t)]
    after[j] = finite.max() if finite.size else np.inf
  finite = np.isfinite(t)
  if finite.any():
    t = np.where(finite, t[finite].max(), np.inf)
  t = t.astype(np.float32).astype(np.float64)
  if after.size:
    finite_t = t[np.isfinite(t)]
    after[-1] = finite_t.max() if finite_t.size else np.inf
  return EpochTimes(seconds=after, times=t, compute=compute, overhead=overhead)
