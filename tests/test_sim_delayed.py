"""Paper 001's time model (``gradcomp.sim.delayed``) and its simulated tables.

The step prices are checked against the paper's equations written out by hand
(eqs. 2-9), the per-worker event recursion against those closed forms on
identical workers, against timelines worked out by hand on unequal ones, and
against ``simulate_rounds`` where every step is synchronous. Pure NumPy
except the last test, which traces the bench's wire once.
"""

import doctest

import numpy as np
import pytest

from gradcomp.sim import delayed
from gradcomp.sim.clock import SimClock, simulate_rounds
from gradcomp.sim.cluster import Cluster, Failure, Slowdown
from gradcomp.sim.delayed import (
  delayed_exchange,
  method_step_seconds,
  saving_over_bitsgd,
  saving_over_local_update,
  simulate_delayed,
  steady_step_seconds,
)

EPS = np.finfo(np.float64).eps
R = 1e12  # FLOP/s of a speed-1.0 worker: F = R * seconds.

# Dyadic times: every sum and difference below is exact in float64.
TAU, PHI, PSI, DELTA = 1.0, 3.0, 0.5, 0.25


def _cumulative(method, steps, **kw):
  return np.concatenate(
    [
      [0.0],
      np.cumsum([method_step_seconds(method, t, **kw) for t in range(1, steps + 1)]),
    ]
  )


# -- the schedule ----------------------------------------------------------------------


def test_schedule_by_hand():
  s, n, f, c = "synchronous", "none", "full", "compressed"
  schedule = lambda k, w: [
    delayed_exchange(t, k=k, warmup_steps=w) for t in range(1, 9)
  ]
  # Warm-up 3, k = 4: steps 1-2 synchronous, 3 the switch; messages 3, 7 (c = 0, 4)
  # are full, exchanged under steps 4 and 8 (Fig. 2, k = 4).
  assert schedule(4, 3) == [s, s, n, f, c, c, c, f]
  assert schedule(2, 3) == [s, s, n, f, c, f, c, f]
  # No warm-up: step 1 is the switch and its message (c = 1) is compressed.
  assert schedule(2, 0) == [n, c, f, c, f, c, f, c]
  # Warm-up 1: the same, but the first message (c = 0) is full precision.
  assert schedule(2, 1) == [n, f, c, f, c, f, c, f]
  # k = 1 (OD-SGD) never compresses.
  assert schedule(1, 0) == [n] + [f] * 7
  assert schedule(1, 2) == [s, n] + [f] * 6


# -- closed forms (eqs. 2-7) ----------------------------------------------------------


def test_synchronous_methods_cost_the_same_every_step():
  for t in (1, 2, 7):
    assert method_step_seconds("ssgd", t, tau=TAU, phi=PHI) == 4.0  # eq. 2
    assert (  # eq. 5
      method_step_seconds("bitsgd", t, tau=TAU, phi=PHI, psi=PSI, delta=DELTA) == 1.75
    )


def test_cdsgd_steps_by_hand():
  kw = dict(tau=TAU, phi=PHI, psi=PSI, delta=DELTA, warmup_steps=3)
  # Exchange-bound (phi > tau > delta + psi): warm-up tau + phi, the switch tau,
  # then max(tau, phi) under full messages and max(tau, delta + psi) = tau.
  steps = [method_step_seconds("cdsgd", t, k=2, **kw) for t in range(1, 9)]
  assert steps == [4.0, 4.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0]
  steps = [method_step_seconds("cdsgd", t, k=3, **kw) for t in range(1, 9)]
  assert steps == [4.0, 4.0, 1.0, 3.0, 1.0, 1.0, 3.0, 1.0]
  # Compressed exchange longer than compute: max(tau, delta + psi) = delta + psi.
  kw["psi"] = 1.5
  steps = [method_step_seconds("cdsgd", t, k=2, **kw) for t in range(4, 8)]
  assert steps == [3.0, 1.75, 3.0, 1.75]
  # OD-SGD is k = 1 whatever k says, and needs no psi.
  od = [
    method_step_seconds("odsgd", t, tau=TAU, phi=PHI, k=5, warmup_steps=2)
    for t in range(1, 5)
  ]
  assert od == [4.0, 1.0, 3.0, 3.0]
  assert od == [
    method_step_seconds("cdsgd", t, tau=TAU, phi=PHI, k=1, warmup_steps=2)
    for t in range(1, 5)
  ]


@pytest.mark.parametrize("k", [1, 2, 5, 20])
@pytest.mark.parametrize("tau", [0.25, 1.0, 4.0])  # exchange-, mixed, compute-bound
def test_steady_step_is_the_mean_over_a_period(k, tau):
  kw = dict(tau=tau, phi=PHI, psi=PSI, delta=DELTA, k=k)
  mean = steady_step_seconds("cdsgd", **kw)
  for first in (4, 5, 9):  # any k consecutive steps after the switch (step 3)
    window = [
      method_step_seconds("cdsgd", t, warmup_steps=3, **kw)
      for t in range(first, first + k)
    ]
    assert mean == pytest.approx(sum(window) / k, rel=4 * EPS)
  if tau >= PHI:  # compute-bound: tau, whatever k (Table 2)
    assert mean == tau
  if tau <= PSI + DELTA:  # exchange-bound: §3.3 (2), ((k-1)(delta + psi) + phi) / k
    assert mean == pytest.approx(((k - 1) * (DELTA + PSI) + PHI) / k, rel=4 * EPS)
  assert steady_step_seconds("odsgd", tau=tau, phi=PHI) == max(tau, PHI)
  assert steady_step_seconds("ssgd", tau=tau, phi=PHI) == tau + PHI


# -- savings (eqs. 8-9) ----------------------------------------------------------------

GRID = [0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0]


def _cases():
  for tau in GRID:
    for phi in GRID:
      for psi in GRID[:5]:
        for delta in (0.0, 0.25):
          for full in (False, True):
            yield tau, phi, psi, delta, full


def test_bit_saving_is_its_definition_in_every_case():
  """Eq. 9 as printed == T_bit - T_cd (eqs. 5, 7), ties included."""
  for tau, phi, psi, delta, full in _cases():
    phi_cd = phi if full else delta + psi
    expected = (tau + delta + psi) - max(tau, phi_cd)
    got = saving_over_bitsgd(
      tau=tau, phi=phi, psi=psi, delta=delta, full_precision=full
    )
    assert got == expected, (tau, phi, psi, delta, full)


def test_local_saving_is_its_definition_where_compression_does_not_lengthen():
  """Eq. 8 as printed == T_loc - T_cd (eqs. 4, 7) when delta + psi <= max(tau, phi)."""
  checked = 0
  for tau, phi, psi, delta, full in _cases():
    phi_cd = phi if full else delta + psi
    expected = max(tau, phi) - max(tau, phi_cd)
    got = saving_over_local_update(
      tau=tau, phi=phi, psi=psi, delta=delta, full_precision=full
    )
    if delta + psi <= max(tau, phi):
      assert got == expected, (tau, phi, psi, delta, full)
      checked += 1
    else:  # The printed cases miss that the compressed exchange got longer.
      assert got >= expected
  assert checked > 300
  # The counterexample: tau > phi, yet delta + psi > tau; eq. 8 says 0.
  kw = dict(tau=1.0, phi=0.5, psi=1.5, delta=0.25, full_precision=False)
  assert saving_over_local_update(**kw) == 0.0
  # Step 10 exchanges message 9 (c = 9, compressed): 1 - 1.75.
  assert delayed_exchange(10, k=2, warmup_steps=0) == "compressed"
  assert (
    method_step_seconds("odsgd", 10, tau=1.0, phi=0.5)
    - method_step_seconds("cdsgd", 10, tau=1.0, phi=0.5, psi=1.5, delta=0.25, k=2)
    == -0.75
  )


def test_savings_by_case():
  # Eq. 8, cases 1-4; eq. 9, cases 1-3.
  loc = lambda tau, full=False: saving_over_local_update(
    tau=tau, phi=PHI, psi=PSI, delta=DELTA, full_precision=full
  )
  assert (loc(4.0), loc(1.0), loc(0.5), loc(0.5, True)) == (0.0, 2.0, 2.25, 0.0)
  bit = lambda tau, full=False: saving_over_bitsgd(
    tau=tau, phi=PHI, psi=PSI, delta=DELTA, full_precision=full
  )
  assert (bit(4.0, True), bit(0.5), bit(0.5, True)) == (0.75, 0.5, -1.75)


# -- the per-worker recursion -------------------------------------------------------

FULL = {"all-reduce": (4e6, 3), "all-gather": 0}
COMPRESSED = {"all-gather": (2.5e5, 3)}


@pytest.mark.parametrize("warmup_steps", [0, 1, 4])
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("tau", [1e-4, 5e-3, 0.05])  # exchange-, mixed, compute-bound
@pytest.mark.parametrize("speeds", [None, (2.0, 0.5, 1.0, 1.0)])
def test_equal_workers_follow_the_closed_form(warmup_steps, k, tau, speeds):
  """Constant speeds: each step is method_step_seconds with tau the slowest's compute.

  Both sides add one step's price to the running total per step, the same
  float operations, except that a synchronous step adds ``tau`` and ``phi`` one
  after the other rather than their sum: one rounding of the running total per
  step at most, so rtol = steps * eps.
  """
  c = Cluster(4, topology="parameter_server", speeds=speeds, flops_per_second=R)
  delta = 1e-4
  flops = tau * R * (0.5 if speeds else 1.0)  # the slowest (speed 0.5) takes tau
  tau_run = float(c.compute_seconds(flops, 1).max())
  phi = float(c.comm_seconds({"all-reduce": (4e6, 3)}))
  psi = float(c.comm_seconds({"all-gather": (2.5e5, 3)}))
  assert 0 < delta + psi < 5e-3 < phi < 0.05  # the regimes are as labelled
  steps = 23
  got = simulate_delayed(
    c, flops, FULL, COMPRESSED, k=k, warmup_steps=warmup_steps, steps=steps, delta=delta
  )
  expected = _cumulative(
    "cdsgd",
    steps,
    tau=tau_run,
    phi=phi,
    psi=psi,
    delta=delta,
    k=k,
    warmup_steps=warmup_steps,
  )
  assert got.shape == (steps + 1,) and got.dtype == np.float64 and got[0] == 0
  np.testing.assert_allclose(got, expected, rtol=steps * EPS, atol=0)


def _exact_cluster(events=()):
  # Two workers of 1 FLOP/s; a ring of 2 at 8 Gbit/s without latency prices
  # x bytes at x * 1e-9 s for an all-reduce and for an all-gather.
  return Cluster(
    2, bandwidth_gbps=8.0, latency_us=0.0, flops_per_second=1.0, events=events
  )


def test_straggler_with_warmup_by_hand():
  """Warm-up 2, k = 2, phi 1.5, psi + delta 0.75; worker 1 takes 3 s in step 4.

  step 1 (sync): compute 0-1, exchange 1-2.5                      -> 2.5
  step 2 (switch): compute 2.5-3.5; message 2 (full) 3.5-5.0      -> 3.5
  step 3: compute 3.5-4.5; waits for message 2: 5.0; message 3
          (compressed) 5.0-5.75                                   -> 5.0
  step 4: compute 5-6 / 5-8; message 4 (full) 8-9.5               -> 8.0
  step 5: compute 6-7 / 8-9; waits for message 4 (9.5); message 5
          9.5-10.25                                               -> 9.5
  step 6: compute 9.5-10.5; message 5 ended at 10.25              -> 10.5
  """
  c = _exact_cluster((Slowdown(1, 3.0, start=4, stop=5),))
  got = simulate_delayed(
    c,
    1.0,
    {"all-reduce": 1.5e9},
    {"all-gather": 0.5e9},
    k=2,
    warmup_steps=2,
    steps=6,
    delta=0.25,
  )
  np.testing.assert_allclose(got, [0, 2.5, 3.5, 5.0, 8.0, 9.5, 10.5], rtol=1e-12)


def test_slowdowns_in_consecutive_steps_overlap_by_hand():
  """Worker 0 slow (3 s) in step 2, worker 1 in step 3; no warm-up, k = 2.

  step 1 (switch): compute 0-1; message 1 (compressed) 1-1.25     -> 1
  step 2: compute 1-4 / 1-2; message 2 (full) 4-4.5               -> 4
  step 3: worker 1 starts at 2 (message 1 ended at 1.25): 2-5;
          worker 0 4-5; message 3 5-5.25                          -> 5
  step 4: compute 5-6; message 2 ended at 4.5                     -> 6

  A per-step tau_t = max_w c_w(t) would give 1, 3, 3, 1: [0, 1, 4, 7, 8].
  """
  c = _exact_cluster((Slowdown(0, 3.0, 2, 3), Slowdown(1, 3.0, 3, 4)))
  wires = ({"all-reduce": 0.5e9}, {"all-gather": 0.25e9})
  got = simulate_delayed(c, 1.0, *wires, k=2, warmup_steps=0, steps=4)
  np.testing.assert_allclose(got, [0, 1, 4, 5, 6], rtol=1e-12)
  slowest = [
    method_step_seconds("cdsgd", t, tau=tau, phi=0.5, psi=0.25, k=2)
    for t, tau in zip(range(1, 5), [1.0, 3.0, 3.0, 1.0], strict=True)
  ]
  assert np.cumsum(slowest).tolist() == [1.0, 4.0, 7.0, 8.0]


def test_all_synchronous_steps_are_simulate_rounds():
  """Warm-up longer than the run: a barrier and a full exchange every step."""
  c = Cluster(
    3,
    speeds=(1.0, 2.0, 4.0),
    flops_per_second=R,
    events=(Slowdown(1, 8.0, 2, 5), Slowdown(0, 2.0, 7)),
  )
  wire = {"all-reduce": 4e6, "all-gather": 1e5}
  got = simulate_delayed(c, R, wire, None, k=1, warmup_steps=13, steps=12)
  np.testing.assert_array_equal(got, simulate_rounds(c, R, lambda s: True, wire, 12))


def test_bitsgd_reference_is_simulate_rounds_plus_delta():
  """The module's recipe: a barrier every step makes delta add up exactly."""
  c = Cluster(
    3, speeds=(1.0, 2.0, 4.0), flops_per_second=R, events=(Slowdown(1, 8.0, 2, 5),)
  )
  wire, delta = {"all-gather": 2e5}, 0.125
  clock = SimClock(c, R)
  psi = float(c.comm_seconds({"all-gather": (2e5, 1)}))
  expected = [0.0] + [
    clock.step(t, barrier=True, exchange_seconds=psi + delta) for t in range(1, 9)
  ]
  got = simulate_rounds(c, R, lambda s: True, wire, 8) + delta * np.arange(9)
  np.testing.assert_allclose(got, expected, rtol=8 * EPS)


def test_a_failure_stalls_the_run_one_step_later():
  c = Cluster(3, flops_per_second=R, events=(Failure(2, step=5),))
  got = simulate_delayed(c, R, FULL, COMPRESSED, k=2, warmup_steps=2, steps=8)
  # Until step 5 the healthy workers are priced; step 6 waits for message 5.
  assert np.isfinite(got[:6]).all() and np.isinf(got[6:]).all()
  homogeneous = simulate_delayed(
    Cluster(3, flops_per_second=R), R, FULL, COMPRESSED, k=2, warmup_steps=2, steps=5
  )
  np.testing.assert_array_equal(got[:6], homogeneous)
  # A failure in a synchronous step stalls at once, as simulate_rounds does.
  got = simulate_delayed(c, R, FULL, COMPRESSED, k=2, warmup_steps=7, steps=8)
  assert np.isfinite(got[:5]).all() and np.isinf(got[5:]).all()


def test_no_compressor_is_od_sgd_whatever_k():
  c = Cluster(3, speeds=(1.0, 0.5, 2.0), flops_per_second=R)
  od = simulate_delayed(c, 3e9, FULL, None, k=1, warmup_steps=3, steps=10)
  for k in (2, 5):
    got = simulate_delayed(c, 3e9, FULL, None, k=k, warmup_steps=3, steps=10)
    np.testing.assert_array_equal(got, od)
  # ... and so is a compressed exchange as long as the full one.
  same = simulate_delayed(c, 3e9, FULL, FULL, k=2, warmup_steps=3, steps=10)
  np.testing.assert_array_equal(same, od)


def test_no_steps():
  got = simulate_delayed(
    Cluster(2), 1.0, FULL, COMPRESSED, k=2, warmup_steps=0, steps=0
  )
  np.testing.assert_array_equal(got, [0.0])


# -- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
  "call, message",
  [
    (
      lambda: delayed_exchange(1, k=0, warmup_steps=0),
      "k must be an integer >= 1, got 0",
    ),
    (lambda: delayed_exchange(1, k=2.0, warmup_steps=0), "k must be an integer"),
    (
      lambda: delayed_exchange(1, k=2, warmup_steps=-1),
      "warmup_steps must be an integer >= 0, got -1",
    ),
    (lambda: delayed_exchange(0, k=2, warmup_steps=0), "step must be an integer >= 1"),
    (
      lambda: method_step_seconds("asgd", 1, tau=1.0, phi=1.0),
      r"method must be one of \('ssgd', 'bitsgd', 'odsgd', 'cdsgd'\), got 'asgd'",
    ),
    (
      lambda: method_step_seconds("ssgd", 1, tau=-1.0, phi=1.0),
      "tau must be finite and >= 0 seconds, got -1.0",
    ),
    (lambda: method_step_seconds("ssgd", 1, tau=1.0, phi=np.nan), "phi must be finite"),
    (
      lambda: method_step_seconds("cdsgd", 1, tau=1.0, phi=1.0, psi=np.inf),
      "psi must be finite",
    ),
    (
      lambda: method_step_seconds("bitsgd", 1, tau=1.0, phi=1.0, delta=-0.5, psi=0.1),
      "delta must be finite and >= 0",
    ),
    (
      lambda: method_step_seconds("bitsgd", 1, tau=1.0, phi=1.0),
      "psi must be given for method 'bitsgd'",
    ),
    (
      lambda: method_step_seconds("cdsgd", 1, tau=1.0, phi=1.0, k=3),
      "psi must be given for method 'cdsgd' with k=3",
    ),
    (lambda: steady_step_seconds("cdsgd", tau=1.0, phi=1.0, psi=1.0, k=0), "k must be"),
    (
      lambda: saving_over_bitsgd(tau=1.0, phi=1.0, psi=1.0, full_precision=1),
      "full_precision must be True or False",
    ),
    (
      lambda: saving_over_local_update(tau=1.0, phi=-1, psi=1.0, full_precision=True),
      "phi must be finite",
    ),
    (
      lambda: simulate_delayed("c", 1.0, {}, {}, k=2, warmup_steps=0, steps=1),
      "cluster must be a Cluster",
    ),
    (
      lambda: simulate_delayed(Cluster(2), 0.0, {}, {}, k=2, warmup_steps=0, steps=1),
      "flops_per_step must be finite and > 0",
    ),
    (
      lambda: simulate_delayed(Cluster(2), 1.0, {}, {}, k=2, warmup_steps=0, steps=-1),
      "steps must be an integer >= 0, got -1",
    ),
    (
      lambda: simulate_delayed(
        Cluster(2), 1.0, {"all-reduce": -1}, {}, k=2, warmup_steps=0, steps=1
      ),
      r"full_wire\['all-reduce'\] must be finite bytes >= 0",
    ),
    (
      lambda: simulate_delayed(
        Cluster(2), 1.0, {}, {"all-gather": (8, 0)}, k=2, warmup_steps=0, steps=1
      ),
      r"compressed_wire\['all-gather'\] messages must be an integer >= 1",
    ),
    (
      lambda: simulate_delayed(
        Cluster(2), 1.0, {}, {}, k=2, warmup_steps=0, steps=1, delta=np.inf
      ),
      "delta must be finite",
    ),
  ],
)
def test_bad_input_raises(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_docstring_examples():
  result = doctest.testmod(delayed, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted >= 3 and result.failed == 0


# -- the simulated tables (bench.cdsgd_time) ---------------------------------


def test_table2_rows_and_compute_bound_independence_of_k():
  from bench import cdsgd_time

  rows = cdsgd_time.table2_rows()
  methods = [
    "S-SGD",
    "BIT-SGD",
    "CD-SGD k=2",
    "CD-SGD k=5",
    "CD-SGD k=10",
    "CD-SGD k=20",
  ]
  for nodes in (2, 4):
    mine = [r for r in rows if r["nodes"] == nodes and r["gpu"] == "K80"]
    assert [r["method"] for r in mine] == methods
    assert all(np.isfinite(r["epoch_s"]) and r["epoch_s"] > 0 for r in mine)
    cd = [r for r in mine if r["method"].startswith("CD-SGD")]
    assert all(r["bound"] == "compute" for r in cd)  # as the paper says of K80
    assert len({r["epoch_s"] for r in cd}) == 1  # hence independent of k
    assert cd[0]["epoch_s"] < mine[0]["epoch_s"]  # faster than S-SGD
  # The calibration point reproduces its paper number.
  (cal,) = [
    r
    for r in rows
    if r["gpu"] == "K80" and r["nodes"] == 4 and r["method"] == "CD-SGD k=5"
  ]
  assert cal["epoch_s"] == pytest.approx(cal["paper_s"], rel=1e-12)


def test_fig10_rows_and_rendering():
  from bench import cdsgd_time

  rows = cdsgd_time.fig10_rows(models=("resnet20",), gpus=("V100",))
  assert [r["batch"] for r in rows] == [32, 64, 128]
  for r in rows:
    assert {"BIT-SGD", "OD-SGD", "CD-SGD k=5"} <= set(r)
    # Overlap never loses to S-SGD; CD-SGD never loses to OD-SGD (delta + psi < phi).
    assert r["CD-SGD k=5"] >= r["OD-SGD"] >= 1.0
  text = cdsgd_time.render_fig10(rows)
  assert text.count("| V100 | resnet20 |") == 3 and "speedup shrinks" in text
