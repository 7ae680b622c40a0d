"""Pricing an epoch of masked steps (``gradcomp.sim.epochs``, paper 002).

Against closed forms: a worker's clock is its overhead, its samples and its
sends at its own speed; the epoch ends in a barrier at the latest finite
clock; a balanced share (samples proportional to speed) gives equal compute.
"""

import doctest

import numpy as np
import pytest

import gradcomp
from gradcomp.sim import epochs
from gradcomp.sim.cluster import Cluster, Failure, Slowdown
from gradcomp.sim.epochs import simulate_masked_epoch


def test_closed_form_with_overhead_and_sends():
  c = Cluster(3, speeds=(1.0, 0.5, 0.25), flops_per_second=10.0)
  samples = np.array([[4, 2, 1], [4, 2, 0], [4, 0, 0]])
  e = simulate_masked_epoch(
    c,
    [1.0, 1.0, 1.0],
    5,
    samples,
    flops_per_sample=5.0,
    overhead_flops=[10.0, 10.0, 10.0],
    step_seconds=0.5,
  )
  speed = np.array([1.0, 0.5, 0.25])
  overhead = 10.0 / (10.0 * speed)
  compute = samples.sum(0) * 5.0 / (10.0 * speed)
  sends = 0.5 * (samples > 0).sum(0)
  np.testing.assert_allclose(e.overhead, overhead)
  np.testing.assert_allclose(e.compute, compute)
  ends = 1.0 + overhead + compute + sends
  np.testing.assert_allclose(e.times, np.full(3, ends.max()))
  # After step j: the latest clock of the workers' partial sums.
  cum = (
    1.0 + overhead + np.cumsum(samples * 5.0 / (10.0 * speed) + 0.5 * (samples > 0), 0)
  )
  np.testing.assert_allclose(e.seconds, cum.max(1))


def test_balanced_shares_give_equal_compute():
  """Alg. 1: samples in proportion to speed, so every worker computes equally long."""
  speeds = np.array([1.0, 0.5, 0.2, 0.1])
  c = Cluster(4, speeds=tuple(speeds), flops_per_second=1.0)
  samples = (np.array([[10, 10, 10, 10]] * 5) * speeds).round().astype(int)
  e = simulate_masked_epoch(c, np.zeros(4), 1, samples, flops_per_sample=2.0)
  np.testing.assert_allclose(e.compute, np.full(4, 100.0))
  unbalanced = simulate_masked_epoch(
    c, np.zeros(4), 1, np.full((5, 4), 10), flops_per_sample=2.0
  )
  assert unbalanced.compute.max() / unbalanced.compute.min() == pytest.approx(10.0)


def test_events_and_failures():
  c = Cluster(
    3,
    flops_per_second=1.0,
    events=(Slowdown(worker=0, factor=2.0, start=2, stop=3), Failure(worker=2, step=2)),
  )
  e = simulate_masked_epoch(
    c, np.zeros(3), 1, [[1, 1, 1], [1, 1, 0]], flops_per_sample=1.0
  )
  # Worker 0 takes 1 + 2 s (slowed in step 2), worker 1 2 s; worker 2 had no
  # work in the step it failed: its clock (1 s) waits at the barrier.
  np.testing.assert_allclose(e.compute, [3.0, 2.0, 1.0])
  np.testing.assert_allclose(e.times, [3.0, 3.0, 3.0])
  # A failed worker with work never finishes and is dropped from the barrier.
  e = simulate_masked_epoch(
    c, np.zeros(3), 1, [[1, 1, 1], [1, 1, 1]], flops_per_sample=1.0
  )
  assert np.isinf(e.compute[2]) and np.isinf(e.times[2])
  np.testing.assert_allclose(e.times[:2], [3.0, 3.0])
  np.testing.assert_allclose(e.seconds, [1.0, 3.0])


def test_clocks_are_float32_after_the_barrier():
  c = Cluster(2, flops_per_second=3.0)
  e = simulate_masked_epoch(c, [0.1, 0.1], 1, [[1, 1]], flops_per_sample=1.0)
  assert e.times[0] == float(np.float32(0.1 + 1 / 3))
  assert e.times.dtype == np.float64


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    (dict(times=[0.0]), r"times must have shape \(2,\)"),
    (dict(times=[0.0, np.nan]), "times must have shape"),
    (dict(samples=[[1, 1, 1]]), r"samples must be a real array of shape \(steps, 2\)"),
    (dict(samples=[[1, -1]]), "samples must be finite and >= 0"),
    (dict(flops_per_sample=0.0), "flops_per_sample must be finite and > 0"),
    (dict(first_step=0), "step"),
    (dict(first_step=1.5), "first_step must be an integer"),
    (dict(overhead_flops=[-1.0, 0.0]), "overhead_flops must be finite and >= 0"),
    (dict(step_seconds=np.inf), "step_seconds must be finite and >= 0"),
    (dict(cluster="two"), "cluster must be a Cluster"),
  ],
)
def test_bad_inputs_name_the_argument(kwargs, message):
  args = dict(
    cluster=Cluster(2),
    times=[0.0, 0.0],
    first_step=1,
    samples=[[1, 1]],
    flops_per_sample=1.0,
  )
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    simulate_masked_epoch(
      args.pop("cluster"),
      args.pop("times"),
      args.pop("first_step"),
      args.pop("samples"),
      **args,
    )


def test_public_name_and_docstring_examples():
  assert gradcomp.sim.simulate_masked_epoch is simulate_masked_epoch
  assert doctest.testmod(epochs).failed == 0
