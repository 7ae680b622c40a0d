"""Described heterogeneous clusters and the simulated clock (DESIGN §6).

Closed forms for every price: the clock is checked against
``synchronous_step_seconds`` / ``local_sgd_round_seconds`` and both against
sums written out by hand. Pure NumPy apart from one abstract trace of a Dense
layer.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradcomp.sim import model_workload
from gradcomp.sim.clock import (
  SimClock,
  forward_flops_per_sample,
  local_sgd_round_seconds,
  simulate_overlapped_rounds,
  simulate_rounds,
  synchronous_step_seconds,
  training_flops,
)
from gradcomp.sim.cluster import DEFAULT_FLOPS_PER_SECOND, Cluster, Failure, Slowdown

R = 1e12  # FLOP/s of a speed-1.0 worker in these tests: F = R * seconds.
WIRE = {"all-reduce": (4e6, 2), "all-gather": (1e5, 1)}


# -- the cluster -----------------------------------------------------------------------


def test_homogeneous_defaults_unchanged():
  c = Cluster(8)
  assert (c.speeds, c.flops_per_second, c.events) == (None, 8e12, ())
  assert DEFAULT_FLOPS_PER_SECOND == model_workload.DEFAULT_TFLOPS * 1e12
  # The ring alpha-beta price of 20 Gbit/s, 25 us, written out as before.
  alpha, per_byte = 25e-6, 8.0 / 20e9
  assert c.exchange_seconds("all-reduce", 1e6) == pytest.approx(
    14 * alpha + 14 / 8 * 1e6 * per_byte, rel=1e-15
  )
  assert c.comm_seconds(WIRE) == pytest.approx(
    2 * 14 * alpha + 14 / 8 * 4e6 * per_byte + 7 * alpha + 7 * 1e5 * per_byte,
    rel=1e-15,
  )
  # Positional construction, equality, hashing and replace behave as before.
  ps = Cluster(8, 10.0, 5.0, "parameter_server", False)
  assert (ps.bandwidth_gbps, ps.latency_us, ps.topology, ps.overlap) == (
    10.0,
    5.0,
    "parameter_server",
    False,
  )
  assert Cluster(8) == Cluster(8) and hash(Cluster(8)) == hash(Cluster(8))
  assert dataclasses.replace(c, workers=4).workers == 4
  np.testing.assert_array_equal(c.speeds_at(1), np.ones(8))
  assert c.speeds_at(1).dtype == np.float64
  np.testing.assert_array_equal(c.compute_seconds(8e12, 3), np.ones(8))


def test_lists_are_stored_as_tuples():
  c = Cluster(2, speeds=[1, np.float32(0.5)], events=[Slowdown(1, 2, 1)])
  assert c.speeds == (1.0, 0.5) and isinstance(c.events, tuple)
  assert hash(c) == hash(Cluster(2, speeds=(1.0, 0.5), events=(Slowdown(1, 2.0, 1),)))


@pytest.mark.parametrize(
  "make, message",
  [
    (lambda: Cluster(2, speeds=(1.0,)), r"speeds must hold one value per worker \(2\)"),
    (lambda: Cluster(2, speeds=(1.0, 0.0)), r"speeds\[1\] must be finite and > 0"),
    (lambda: Cluster(2, speeds=(1.0, np.inf)), r"speeds\[1\]"),
    (lambda: Cluster(2, speeds=3.0), "speeds"),
    (lambda: Cluster(2, flops_per_second=0), "flops_per_second must be finite and > 0"),
    (lambda: Cluster(2, flops_per_second=np.nan), "flops_per_second"),
    (
      lambda: Cluster(2, events=(Slowdown(2, 2.0, 1),)),
      r"events\[0\]\.worker .*\[0, 2\)",
    ),
    (lambda: Cluster(2, events=[Failure(0, 3), Failure(5, 1)]), r"events\[1\]\.worker"),
    (
      lambda: Cluster(2, events=("slow",)),
      r"events\[0\] must be a Slowdown or a Failure",
    ),
    (lambda: Slowdown(-1, 2.0, 1), "Slowdown.worker must be an integer >= 0, got -1"),
    (lambda: Slowdown(0, 0.5, 1), r"Slowdown.factor must be finite and >= 1, got 0.5"),
    (lambda: Slowdown(0, np.inf, 1), "Slowdown.factor"),
    (lambda: Slowdown(0, 2.0, 0), "Slowdown.start must be an integer >= 1, got 0"),
    (
      lambda: Slowdown(0, 2.0, 3, 3),
      "Slowdown.stop must be None or an integer > start",
    ),
    (lambda: Failure(0, 0), "Failure.step must be an integer >= 1, got 0"),
    (lambda: Failure(True, 1), "Failure.worker"),
    (lambda: Cluster(2).speeds_at(0), "step must be an integer >= 1"),
    (lambda: Cluster(2).compute_seconds(-1.0, 1), "flops must be finite and >= 0"),
    (lambda: SimClock(Cluster(2), 0.0), "flops_per_step must be finite and > 0"),
    (lambda: SimClock(Cluster(2), 1.0, times=[0.0]), r"times must have shape \(2,\)"),
    (lambda: SimClock(Cluster(2), 1.0, times=[0.0, np.nan]), "times"),
    (lambda: SimClock(Cluster(2), 1.0).step(1, barrier=1), "barrier must be True"),
    (
      lambda: SimClock(Cluster(2), 1.0).step(1, barrier=True, exchange_seconds=-1),
      "exchange_seconds must be finite and >= 0",
    ),
    (lambda: local_sgd_round_seconds(Cluster(2), 1.0, 1, 0, {}), "every must be"),
    (lambda: training_flops(10.0, 0), "batch_per_worker must be an integer >= 1"),
    (lambda: training_flops(-1.0, 2), "forward_flops_per_sample"),
  ],
)
def test_bad_values_raise(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_speeds_at_with_overlapping_slowdowns_and_a_failure():
  c = Cluster(
    4,
    speeds=(1.0, 2.0, 1.0, 0.5),
    flops_per_second=R,
    events=(
      Slowdown(0, 2.0, start=3, stop=6),
      Slowdown(0, 3.0, start=5),  # overlaps the first on step 5: 2 x 3.
      Slowdown(1, 4.0, start=2, stop=3),  # step 2 only.
      Failure(2, step=4),
      Slowdown(2, 2.0, start=1),  # a failed worker stays at 0.
    ),
  )
  expected = {
    1: [1.0, 2.0, 0.5, 0.5],
    2: [1.0, 0.5, 0.5, 0.5],
    3: [0.5, 2.0, 0.5, 0.5],
    4: [0.5, 2.0, 0.0, 0.5],
    5: [1 / 6, 2.0, 0.0, 0.5],
    6: [1 / 3, 2.0, 0.0, 0.5],
    100: [1 / 3, 2.0, 0.0, 0.5],
  }
  for step, speeds in expected.items():
    np.testing.assert_allclose(c.speeds_at(step), speeds, rtol=1e-15)
    seconds = c.compute_seconds(3 * R, step)
    with np.errstate(divide="ignore"):
      np.testing.assert_allclose(seconds, 3 / np.asarray(speeds), rtol=1e-15)
  assert c.compute_seconds(0.0, 4)[2] == np.inf  # a failed worker never finishes.


# -- the clock against closed forms ----------------------------------------------------


def test_synchronous_clock_waits_for_the_slowest_worker():
  c = Cluster(8, speeds=(1, 1, 2, 2, 3, 3, 5, 5), flops_per_second=R)
  comm = float(c.comm_seconds(WIRE))
  clock = SimClock(c, 2 * R)
  for step in range(1, 11):
    # comm_seconds' 0-d array is taken as it is.
    seconds = clock.step(step, barrier=True, exchange_seconds=c.comm_seconds(WIRE))
    # Speed 1 rules: 2 s of compute every step, then the exchange.
    assert synchronous_step_seconds(c, 2 * R, step, WIRE) == pytest.approx(2 + comm)
    assert seconds == pytest.approx(step * (2 + comm), rel=1e-13)
    np.testing.assert_array_equal(clock.state(), np.full(8, seconds))


@pytest.mark.parametrize("every", [1, 3, 4])
def test_local_sgd_clock_matches_the_round_price(every):
  # Worker 1 is slowed on steps 2-4 only: local SGD waits for it once per round.
  c = Cluster(
    3,
    speeds=(1.0, 2.0, 4.0),
    flops_per_second=R,
    events=(Slowdown(1, 8.0, 2, 5),),
  )
  comm = float(c.comm_seconds(WIRE))
  clock, expected = SimClock(c, R), 0.0
  for first in range(1, 13, every):
    expected += local_sgd_round_seconds(c, R, first, every, WIRE)
    for step in range(first, first + every):
      sync = step == first + every - 1  # local steps exchange nothing.
      seconds = clock.step(step, barrier=sync, exchange_seconds=comm * sync)
    assert seconds == pytest.approx(expected, rel=1e-13)
  # By hand: worker 1 computes 0.5 s a step, 4 s on steps 2-4; worker 0 1 s.
  if every == 4:
    rounds = [max(4.0, 0.5 + 3 * 4.0), max(4.0, 2.0), max(4.0, 2.0)]
    assert seconds == pytest.approx(sum(rounds) + 3 * comm, rel=1e-13)
  if every == 1:
    steps = [1.0, 4.0, 4.0, 4.0] + [1.0] * 8
    assert seconds == pytest.approx(sum(steps) + 12 * comm, rel=1e-13)


@pytest.mark.parametrize("every", [1, 3])
def test_simulate_rounds_is_the_sum_of_round_prices(every):
  """A run's seconds after each round: the sum of the closed-form round prices."""
  c = Cluster(
    3, speeds=(1.0, 2.0, 4.0), flops_per_second=R, events=(Slowdown(1, 8.0, 2, 5),)
  )
  round_wire = {"all-reduce": 4e6, "all-gather": 0}  # One message of each kind sent.
  wire = {"all-reduce": (4e6, 1)}
  seconds = simulate_rounds(c, R, lambda s: s % every == 0, round_wire, 12)
  assert seconds.shape == (13,) and seconds[0] == 0
  expected = 0.0
  for first in range(1, 13, every):
    expected += local_sgd_round_seconds(c, R, first, every, wire)
    assert seconds[first + every - 1] == pytest.approx(expected, rel=1e-13)


def test_overlap_zero_is_the_barrier_clock_and_overlap_hides_compute():
  """Overlap 0 replays simulate_rounds; with overlap the exchange runs under compute."""
  c = Cluster(
    3, speeds=(1.0, 2.0, 4.0), flops_per_second=R, events=(Slowdown(1, 8.0, 2, 5),)
  )
  wire = lambda step: {"all-reduce": 4e6 * (1 + step % 2)}  # Fragments differ.
  sends = lambda step: step % 3 == 0
  barrier = simulate_rounds(c, R, sends, wire, 12)
  np.testing.assert_array_equal(
    simulate_overlapped_rounds(c, R, sends, wire, 12, 0), barrier
  )
  # Equal speeds, 1 s of compute a step, an exchange of comm s every 4 steps
  # arriving 2 steps later: each round costs max(0, comm - 2) s of waiting.
  plain = Cluster(2, flops_per_second=R)
  for nbytes in (1e6, 4e9):
    comm = plain.comm_seconds({"all-reduce": (nbytes, 1)})
    got = simulate_overlapped_rounds(
      plain, R, lambda s: s % 4 == 0, {"all-reduce": nbytes}, 12, 2
    )
    wait = max(0.0, comm - 2.0)
    # Rounds after steps 4 and 8 arrive after steps 6 and 10; step 12's arrives later.
    assert got[12] == pytest.approx(12 + 2 * wait, rel=1e-13)
    assert (
      got[12]
      <= simulate_rounds(plain, R, lambda s: s % 4 == 0, {"all-reduce": nbytes}, 12)[12]
    )
  with pytest.raises(ValueError, match="overlap must be an int >= 0, got -1"):
    simulate_overlapped_rounds(plain, R, sends, wire, 4, -1)


def test_a_slowdown_delays_exactly_the_steps_it_covers():
  plain = Cluster(4, flops_per_second=R)
  slowed = dataclasses.replace(plain, events=(Slowdown(2, 3.0, start=4, stop=7),))
  a, b = SimClock(plain, R), SimClock(slowed, R)
  for step in range(1, 11):
    delay = b.step(step, barrier=True) - a.step(step, barrier=True)
    # Each of steps 4, 5, 6 takes 3 s instead of 1 s.
    assert delay == pytest.approx(2.0 * min(max(step - 3, 0), 3))


def test_a_failure_stalls_the_barrier_but_not_a_clock_without_one():
  c = Cluster(3, speeds=(1.0, 2.0, 1.0), flops_per_second=R, events=(Failure(1, 3),))
  sync, free = SimClock(c, R), SimClock(c, R)
  for step in (1, 2):
    assert sync.step(step, barrier=True) == free.step(step, barrier=False) == step
  assert synchronous_step_seconds(c, R, 3, WIRE) == np.inf
  assert sync.step(3, barrier=True, exchange_seconds=1.0) == np.inf
  assert np.isinf(sync.state()).all()
  for step in range(3, 6):
    free.step(step, barrier=False, exchange_seconds=0.25)
  # The healthy workers went on at 1 s a step (plus their own exchange).
  np.testing.assert_allclose(free.state(), [5.75, np.inf, 5.75])
  assert free.seconds == 5.75
  everyone = Cluster(2, events=(Failure(0, 1), Failure(1, 2)))
  lonely = SimClock(everyone, 1.0)
  assert np.isfinite(lonely.step(1, barrier=False))
  assert lonely.step(2, barrier=False) == np.inf


def test_state_and_restore_continue_the_same_clock():
  c = Cluster(
    4,
    speeds=(1.0, 0.5, 2.0, 1.5),
    flops_per_second=R,
    events=(Slowdown(3, 2.0, 3, 9), Failure(2, 12)),
  )
  schedule = [(s, s % 3 == 0, 0.1 * (s % 3 == 0)) for s in range(1, 16)]
  whole = SimClock(c, R)
  for step, barrier, comm in schedule:
    whole.step(step, barrier=barrier, exchange_seconds=comm)
  first = SimClock(c, R)
  for step, barrier, comm in schedule[:7]:
    first.step(step, barrier=barrier, exchange_seconds=comm)
  saved = first.state()
  saved_copy = saved.copy()
  first.step(8, barrier=True)  # state() is a copy: this does not touch it.
  np.testing.assert_array_equal(saved, saved_copy)
  resumed = SimClock(c, R, times=saved)
  restored = SimClock(c, R)
  restored.restore(saved)
  for clock in (resumed, restored):
    for step, barrier, comm in schedule[7:]:
      clock.step(step, barrier=barrier, exchange_seconds=comm)
    np.testing.assert_array_equal(clock.state(), whole.state())
    assert clock.seconds == whole.seconds


# -- FLOPs -------------------------------------------------------------------------------


def test_training_flops_of_a_dense_layer():
  din, dout, batch = 7, 5, 16
  # Forward per sample: 2 * din * dout for the matmul, dout for the bias add.
  forward = forward_flops_per_sample(
    nn.Dense(dout), jax.ShapeDtypeStruct((1, din), jnp.float32)
  )
  assert forward == 2 * din * dout + dout
  assert training_flops(forward, batch) == 3 * (2 * din * dout + dout) * batch
  with pytest.raises(ValueError, match="leading batch dimension of 1"):
    forward_flops_per_sample(nn.Dense(dout), jnp.zeros((2, din)))


# -- the training program's cluster (configs/default.py, train/pricing.py) -----------


def test_config_cluster_chooses_the_allreduce():
  from configs import default
  from train import pricing

  # The config block's defaults are the Cluster's: the same cluster as before.
  assert pricing.cluster_of(default.get_config(), 8) == Cluster(8)
  # The fields a `--config.cluster.*` override sets (typed: ConfigDict fields).
  config = default.get_config()
  config.cluster.allreduce = "sharded_parameter_server"
  config.cluster.servers = 4
  config.cluster.colocated = True
  with pytest.raises(TypeError):
    config.cluster.servers = "four"
  c = pricing.cluster_of(config, 8)
  assert (c.allreduce, c.servers, c.colocated) == ("sharded_parameter_server", 4, True)
  want = 2 * 7 * (25.0 * 1e-6 + 1e6 / 4 * 8.0 / 20e9)  # 2 (n-1) (alpha + B/S beta)
  assert c.exchange_seconds("all-reduce", 1e6) == pytest.approx(want, rel=1e-12)
  config = default.get_config()
  config.cluster.allreduce = "rabenseifner"
  assert pricing.cluster_of(config, 8).allreduce == "rabenseifner"
  config.cluster.allreduce = "hierarchical"
  config.cluster.workers_per_node = 3
  with pytest.raises(ValueError, match="config.cluster: workers_per_node must divide"):
    pricing.cluster_of(config, 8)
  config.cluster.allreduce = "butterfly"
  with pytest.raises(ValueError, match="config.cluster: allreduce must be one of"):
    pricing.cluster_of(config, 8)
