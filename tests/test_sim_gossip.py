"""The gossip simulator (``gradcomp.sim.gossip``): each worker waits for its neighbours.

Identical workers are checked against the closed forms (per step ``max(c, K
m)`` with overlap, ``c + K m`` without, ``K`` the messages a worker sends:
written out per topology, not read from it); unequal ones against timelines
worked out by hand, and against ``simulate_rounds``' global barrier. Every
time below is a sum of a few multiples of 0.1 or of dyadic numbers, so the
comparisons allow only float64 rounding of those sums.
"""

import doctest
import math

import numpy as np
import pytest

from gradcomp import topology
from gradcomp.sim import gossip
from gradcomp.sim.clock import simulate_rounds
from gradcomp.sim.cluster import Cluster, Failure, Slowdown
from gradcomp.sim.gossip import (
  gossip_step_seconds,
  gossip_worker_seconds,
  simulate_gossip,
)

# flops_per_second = 1 (a step of F FLOPs takes F seconds); 8 Gbit/s and no
# latency: a message of B bytes takes B / 1e9 seconds.
GBIT8 = {"flops_per_second": 1.0, "latency_us": 0.0, "bandwidth_gbps": 8.0}
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def _cluster(n, **kw):
  return Cluster(n, **(GBIT8 | kw))


# Messages a worker sends per step, by hand: ring 2; torus(8) = 2 x 4: 3
# (up = down); torus(16) = 4 x 4: 4; exponential: log2 n; one-peer: 1;
# complete: n - 1.
SENT = {
  ("ring", 8): 2,
  ("torus", 8): 3,
  ("torus", 16): 4,
  ("exponential", 8): 3,
  ("exponential", 16): 4,
  ("one_peer_exponential", 8): 1,
  ("one_peer_exponential", 16): 1,
  ("complete", 8): 7,
}


@pytest.mark.parametrize("name, n", list(SENT))
@pytest.mark.parametrize("seconds_per_message", [0.1, 0.3, 2.0])
@pytest.mark.parametrize("overlap", [True, False])
def test_identical_workers_match_the_closed_form(name, n, seconds_per_message, overlap):
  c, k = 1.0, SENT[(name, n)]
  m = seconds_per_message
  step = max(c, k * m) if overlap else c + k * m
  cluster = _cluster(n, latency_us=50.0)
  message = (m - 50e-6) * 1e9  # alpha + B / bw = m
  got = simulate_gossip(cluster, c, name, message, 6, overlap=overlap)
  np.testing.assert_allclose(got, step * np.arange(7), **TIGHT)
  closed = gossip_step_seconds(cluster, c, name, message, overlap=overlap)
  assert closed == pytest.approx(step, rel=1e-12)
  # Lockstep: every worker finishes every step at the same time.
  workers = gossip_worker_seconds(cluster, c, name, message, 6, overlap=overlap)
  np.testing.assert_allclose(workers, np.repeat(got[:, None], n, axis=1), **TIGHT)


def test_ring_closed_form_as_the_issue_states_it():
  # ring: max(c, deg msg) per step with overlap, c + deg msg without.
  cluster = _cluster(8)
  assert gossip_step_seconds(cluster, 1.0, "ring", 1e8) == pytest.approx(1.0)
  assert gossip_step_seconds(cluster, 1.0, "ring", 1e9) == pytest.approx(2.0)
  assert gossip_step_seconds(cluster, 1.0, "ring", 1e8, overlap=False) == 1.2


def _delayed(times, reference):
  return [
    {w for w in range(times.shape[1]) if times[t, w] > reference[t, w] + 1e-9}
    for t in range(1, times.shape[0])
  ]


def test_a_slow_worker_delays_one_hop_per_step_without_overlap():
  # Worker 0 computes step 1 in 3 s instead of 1; messages take 0.1 s. Ring
  # order: worker j sends to j + 1 first (arrives after 0.1 s), then to j - 1
  # (after 0.2 s).
  slow = _cluster(8, events=(Slowdown(worker=0, factor=3.0, start=1, stop=2),))
  got = gossip_worker_seconds(slow, 1.0, "ring", 1e8, 3, overlap=False)
  by_hand = np.array(
    [
      [0, 0, 0, 0, 0, 0, 0, 0],
      # Step 1: workers send after computing; 0 sends at 3, 1 gets it at
      # 3.1, 7 at 3.2; the others finish at 1 + 0.2.
      [3.0, 3.1, 1.2, 1.2, 1.2, 1.2, 1.2, 3.2],
      # Step 2: 1 and 7 send at 4.1 and 4.2; 2 gets 1's at 4.2, 6 gets 7's
      # at 4.4; 0 waits for 7 (4.2 + 0.1) and 1 (4.1 + 0.2); 3, 4, 5 untouched.
      [4.3, 4.1, 4.2, 2.4, 2.4, 2.4, 4.4, 4.2],
      # Step 3: three hops: only worker 4 is still on the undisturbed 3.6.
      [5.3, 5.4, 5.2, 5.3, 3.6, 5.6, 5.4, 5.5],
    ]
  )
  np.testing.assert_allclose(got, by_hand, **TIGHT)
  fast = gossip_worker_seconds(_cluster(8), 1.0, "ring", 1e8, 3, overlap=False)
  assert _delayed(got, fast) == [{0, 1, 7}, {0, 1, 2, 6, 7}, {0, 1, 2, 3, 5, 6, 7}]
  np.testing.assert_allclose(
    simulate_gossip(slow, 1.0, "ring", 1e8, 3, overlap=False), got.max(1), **TIGHT
  )
  # A global barrier (all-reduce every step) delays everyone in step 1.
  rounds = simulate_rounds(slow, 1.0, lambda s: True, {"collective-permute": 1e8}, 3)
  np.testing.assert_allclose(rounds, [0.0, 3.1, 4.2, 5.3], **TIGHT)
  assert got[1, 4] < rounds[1] - 1.5 and got[2, 4] < rounds[2] - 1.5


def test_a_slow_worker_delays_one_hop_per_step_with_overlap():
  # With overlap the message of step t leaves at the start of step t: the
  # slow compute of step 1 delays nobody in step 1, the neighbours in step 2.
  slow = _cluster(8, events=(Slowdown(worker=0, factor=3.0, start=1, stop=2),))
  got = gossip_worker_seconds(slow, 1.0, "ring", 1e8, 3)
  by_hand = np.array(
    [
      [0, 0, 0, 0, 0, 0, 0, 0],
      [3.0, 1, 1, 1, 1, 1, 1, 1],
      # Step 2: 0 starts (and sends) at 3: 1 gets it at 3.1, 7 at 3.2.
      [4.0, 3.1, 2, 2, 2, 2, 2, 3.2],
      # Step 3: 1 sends at 3.1 (2 has it at 3.2), 7 at 3.2 (6 has it at 3.4).
      [5.0, 4.1, 3.2, 3, 3, 3, 3.4, 4.2],
    ]
  )
  np.testing.assert_allclose(got, by_hand, **TIGHT)
  fast = gossip_worker_seconds(_cluster(8), 1.0, "ring", 1e8, 3)
  assert _delayed(got, fast) == [{0}, {0, 1, 7}, {0, 1, 2, 6, 7}]


def test_a_sender_link_queues_its_messages_across_steps():
  # W on 3 workers with a partial edge: worker 0 and 2 send two messages a
  # step, worker 1 one; 0 receives only one. Every message takes 1 s, the
  # compute 0.5 s, with overlap.
  w = np.array([[0.5, 0.0, 0.5], [0.25, 0.5, 0.25], [0.25, 0.5, 0.25]])
  topo = topology.from_matrices(w)
  assert [topo.out_neighbours(0, j) for j in range(3)] == [[1, 2], [2], [0, 1]]
  got = gossip_worker_seconds(_cluster(3), 0.5, topo, 1e9, 2)
  # Step 1: all send at 0; 0 has 2's first message at 1; 1 has 0's first at
  # 1 and 2's second at 2; 2 has 1's at 1 and 0's second at 2. Step 2: 0
  # starts at 1 but its link is busy until 2, so it sends at 2: 1 has 0's
  # first at 3 and 2's second at 4; 2 has 0's second at 4.
  np.testing.assert_allclose(got, [[0, 0, 0], [1, 2, 2], [3, 4, 4]], **TIGHT)
  # The closed form is an upper bound here (K = 2 messages per step).
  assert gossip_step_seconds(_cluster(3), 0.5, topo, 1e9) == 2.0


def test_time_varying_topology_prices_each_phase():
  # A custom two-phase topology: phase 0 is the ring (2 messages), phase 1
  # the identity (none); with c = 1 and m = 0.75: 1.5, 1, 1.5, 1, ...
  ring = topology.ring(4)
  topo = topology.Topology(4, (ring.phases[0], topology.Phase((), (1.0,) * 4)))
  got = simulate_gossip(_cluster(4), 1.0, topo, 0.75e9, 4)
  np.testing.assert_allclose(got, [0, 1.5, 2.5, 4.0, 5.0], **TIGHT)
  assert gossip_step_seconds(_cluster(4), 1.0, topo, 0.75e9) == 1.25


def test_a_failure_stalls_neighbours_one_hop_per_step():
  failing = _cluster(8, events=(Failure(worker=0, step=2),))
  got = gossip_worker_seconds(failing, 1.0, "ring", 1e8, 6)
  stalled = [set(np.flatnonzero(np.isinf(row))) for row in got[1:]]
  # A failed worker sends nothing from the step it fails in.
  assert stalled[:5] == [
    set(),
    {0, 1, 7},
    {0, 1, 2, 6, 7},
    {0, 1, 2, 3, 5, 6, 7},
    set(range(8)),
  ]
  seconds = simulate_gossip(failing, 1.0, "ring", 1e8, 6)
  np.testing.assert_allclose(seconds[:5], [0, 1, 2, 3, 4], **TIGHT)
  assert np.isinf(seconds[5:]).all()


def test_a_cluster_without_overlap_hides_nothing():
  cluster = _cluster(8, overlap=False)
  got = simulate_gossip(cluster, 1.0, "ring", 1e8, 2)  # overlap=True asked
  np.testing.assert_allclose(got, [0, 1.2, 2.4], **TIGHT)
  assert gossip_step_seconds(cluster, 1.0, "ring", 1e8) == 1.2


def test_one_worker_only_computes():
  got = simulate_gossip(_cluster(1), 2.0, "ring", 1e9, 3)
  np.testing.assert_array_equal(got, [0.0, 2.0, 4.0, 6.0])
  assert simulate_gossip(_cluster(4), 1.0, "ring", 1e9, 0).tolist() == [0.0]


def test_heterogeneous_speeds_wait_only_for_neighbours():
  # Worker 0 at half speed forever; with ample bandwidth the ring settles
  # to its pace, but workers far from it lag behind it by a step's worth of
  # hops only at first.
  cluster = _cluster(8, speeds=(0.5,) + (1.0,) * 7)
  got = gossip_worker_seconds(cluster, 1.0, "ring", 0.0, 12)
  assert got[1, 4] == 1.0 and got[2, 4] == 2.0 and got[3, 4] == 3.0
  # Eventually every worker moves at the slow worker's 2 s per step.
  np.testing.assert_allclose(np.diff(got[-3:], axis=0), 2.0, **TIGHT)
  with pytest.raises(ValueError, match="identical workers"):
    gossip_step_seconds(cluster, 1.0, "ring", 0.0)


@pytest.mark.parametrize(
  "call, message",
  [
    (lambda: simulate_gossip("c", 1.0, "ring", 1.0, 1), "cluster must be a Cluster"),
    (lambda: simulate_gossip(_cluster(4), 0.0, "ring", 1.0, 1), "flops_per_step"),
    (
      lambda: simulate_gossip(_cluster(4), 1.0, topology.ring(8), 1.0, 1),
      "has 8 workers, the cluster 4",
    ),
    (lambda: simulate_gossip(_cluster(4), 1.0, "star", 1.0, 1), "one of"),
    (lambda: simulate_gossip(_cluster(4), 1.0, 3, 1.0, 1), "topology must be"),
    (lambda: simulate_gossip(_cluster(4), 1.0, "ring", -1.0, 1), "message_bytes"),
    (lambda: simulate_gossip(_cluster(4), 1.0, "ring", 1.0, -1), "steps"),
    (
      lambda: simulate_gossip(_cluster(4), 1.0, "ring", 1.0, 1, overlap=1),
      "overlap must be True or False",
    ),
    (
      lambda: simulate_gossip(
        _cluster(4, topology="parameter_server"), 1.0, "ring", 1.0, 1
      ),
      "must be 'ring'",
    ),
  ],
)
def test_bad_input_raises(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_docstring_examples():
  result = doctest.testmod(gossip, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted >= 3 and result.failed == 0


def test_exported_from_sim():
  import gradcomp.sim

  assert gradcomp.sim.simulate_gossip is simulate_gossip
  assert gradcomp.sim.gossip_step_seconds is gossip_step_seconds
  assert gradcomp.sim.gossip_worker_seconds is gossip_worker_seconds
  assert math.isfinite(gossip_step_seconds(_cluster(2), 1.0, "complete", 1.0))
