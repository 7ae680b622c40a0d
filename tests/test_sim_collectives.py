"""The collectives' closed forms against a message-by-message simulation.

Then a described :class:`~gradcomp.sim.cluster.Cluster` pricing its
all-reduce by the algorithm it chooses, and the table of which algorithm wins
(``python -m bench collectives``). Pure NumPy.

The simulation is independent of ``gradcomp.sim.collectives``: each algorithm
is written here as steps of messages ``(src, dst, chunks, op)``; a message of
``b`` bytes occupies ``src``'s outgoing and ``dst``'s incoming link direction
for ``alpha + b beta`` (one message at a time per direction, queued in list
order); a step ends when its last message arrives. Each node's buffer counts,
per chunk, how many times each worker's data was summed in, so the test also
checks every schedule really is an all-reduce (each worker ends with every
chunk holding each contribution exactly once).
"""

import json

import numpy as np
import pytest

from gradcomp.sim import collectives as col
from gradcomp.sim.cluster import ALLREDUCE, Cluster

ALPHA = 25e-6
BETA = 8e-10  # 10 Gbit/s
B = 3.0e6


def _simulate(nodes, workers, chunks, steps, cost):
  """Runs ``steps``; returns (seconds, buffers of shape (nodes, chunks, workers))."""
  buf = np.zeros((nodes, chunks, workers), np.int64)
  for w in range(workers):
    buf[w, :, w] = 1
  now = 0.0
  for step in steps:
    out_free, in_free = {}, {}
    end = now
    snapshot = buf.copy()
    for src, dst, idx, op in step:
      assert src != dst
      start = max(now, out_free.get(src, now), in_free.get(dst, now))
      finish = start + cost(src, dst, len(idx) * B / chunks)
      out_free[src] = in_free[dst] = finish
      end = max(end, finish)
      idx = list(idx)
      if op == "add":
        buf[dst, idx] += snapshot[src, idx]
      else:
        buf[dst, idx] = snapshot[src, idx]
    now = end
  return now, buf


def _flat_cost(alpha=ALPHA, beta=BETA):
  return lambda src, dst, nbytes: alpha + nbytes * beta


def _assert_allreduced(buf, workers):
  np.testing.assert_array_equal(buf[:workers], np.ones_like(buf[:workers]))


# Schedules. `ranks` maps an algorithm's logical rank to a node.


def _ring(ranks):
  n = len(ranks)
  steps = []
  for t in range(n - 1):
    steps.append(
      [(ranks[i], ranks[(i + 1) % n], [(i - t) % n], "add") for i in range(n)]
    )
  for t in range(n - 1):
    steps.append(
      [(ranks[i], ranks[(i + 1) % n], [(i + 1 - t) % n], "copy") for i in range(n)]
    )
  return steps


def _halving_doubling(n):
  p = 1 << (n.bit_length() - 1)
  r = n - p
  ranks = [2 * j if j < r else j + r for j in range(p)]
  steps = []
  if r:
    steps.append([(2 * i + 1, 2 * i, range(p), "add") for i in range(r)])
  lo, hi = [0] * p, [p] * p
  d = p // 2
  while d >= 1:  # reduce-scatter by recursive halving
    step = []
    for j in range(p):
      mid = (lo[j] + hi[j]) // 2
      keep_upper = bool(j & d)
      send = range(lo[j], mid) if keep_upper else range(mid, hi[j])
      step.append((ranks[j], ranks[j ^ d], send, "add"))
    for j in range(p):
      mid = (lo[j] + hi[j]) // 2
      lo[j], hi[j] = (mid, hi[j]) if j & d else (lo[j], mid)
    steps.append(step)
    d //= 2
  d = 1
  while d < p:  # all-gather by recursive doubling
    steps.append(
      [(ranks[j], ranks[j ^ d], range(lo[j], hi[j]), "copy") for j in range(p)]
    )
    for j in range(p):
      k = j ^ d
      lo[j], hi[j] = min(lo[j], lo[k]), max(hi[j], hi[k])
    d *= 2
  if r:
    steps.append([(2 * i, 2 * i + 1, range(p), "copy") for i in range(r)])
  return steps, p


def _binomial(ranks, chunks):
  n = len(ranks)
  rounds = (n - 1).bit_length()
  reduce, bcast = [], []
  for k in range(rounds):
    reduce.append(
      [
        (ranks[i], ranks[i - (1 << k)], range(chunks), "add")
        for i in range(n)
        if i % (1 << (k + 1)) == 1 << k
      ]
    )
  for k in reversed(range(rounds)):
    bcast.append(
      [
        (ranks[i], ranks[i + (1 << k)], range(chunks), "copy")
        for i in range(n)
        if i % (1 << (k + 1)) == 0 and i + (1 << k) < n
      ]
    )
  return reduce, bcast


def _sharded_ps(n, servers, colocated):
  node = (lambda s: s) if colocated else (lambda s: n + s)
  m = max(n, servers)
  pairs = [(w, s) for w in range(n) for s in range(servers) if node(s) != w]
  pairs.sort(key=lambda ws: (ws[0] - ws[1]) % m)  # a proper edge colouring
  push = [(w, node(s), [s], "add") for w, s in pairs]
  pull = [(node(s), w, [s], "copy") for w, s in pairs]
  return [push, pull]


SIZES = [2, 3, 4, 5, 6, 8, 12, 16]


@pytest.mark.parametrize("n", SIZES)
def test_ring_matches_simulation(n):
  seconds, buf = _simulate(n, n, n, _ring(list(range(n))), _flat_cost())
  _assert_allreduced(buf, n)
  assert np.isclose(seconds, col.ring_allreduce(n, B, ALPHA, BETA), rtol=1e-12)


@pytest.mark.parametrize("n", SIZES)
def test_recursive_halving_doubling_matches_simulation(n):
  steps, p = _halving_doubling(n)
  seconds, buf = _simulate(n, n, p, steps, _flat_cost())
  _assert_allreduced(buf, n)
  for fn in (col.recursive_halving_doubling, col.rabenseifner):
    assert np.isclose(seconds, fn(n, B, ALPHA, BETA), rtol=1e-12)


def test_halving_doubling_power_of_two_closed_form():
  for n in (2, 4, 8, 16):
    lg = int(np.log2(n))
    want = 2 * lg * ALPHA + 2 * (n - 1) / n * B * BETA
    assert np.isclose(col.recursive_halving_doubling(n, B, ALPHA, BETA), want)
    assert col.rabenseifner(n, B, ALPHA, BETA) == col.recursive_halving_doubling(
      n, B, ALPHA, BETA
    )


@pytest.mark.parametrize("n", SIZES)
def test_binary_tree_matches_simulation(n):
  reduce, bcast = _binomial(list(range(n)), 1)
  seconds, buf = _simulate(n, n, 1, reduce + bcast, _flat_cost())
  _assert_allreduced(buf, n)
  assert np.isclose(seconds, col.binary_tree(n, B, ALPHA, BETA), rtol=1e-12)


@pytest.mark.parametrize("n,g", [(4, 2), (8, 4), (16, 4), (12, 3), (6, 6), (5, 1)])
def test_hierarchical_matches_simulation(n, g):
  m = n // g
  ia, ib = 2e-6, 1e-11

  def cost(src, dst, nbytes):
    if src // g == dst // g:
      return ia + nbytes * ib
    return ALPHA + nbytes * BETA

  reduce, bcast = [], []
  for node in range(m):
    r, b = _binomial(list(range(node * g, (node + 1) * g)), m)
    reduce = [x + y for x, y in zip(reduce, r, strict=True)] if reduce else r
    bcast = [x + y for x, y in zip(bcast, b, strict=True)] if bcast else b
  steps = reduce + _ring([k * g for k in range(m)]) + bcast
  seconds, buf = _simulate(n, n, m, steps, cost)
  _assert_allreduced(buf, n)
  want = col.hierarchical(
    n, B, ALPHA, BETA, workers_per_node=g, intra_alpha=ia, intra_beta=ib
  )
  assert np.isclose(seconds, want, rtol=1e-12)


@pytest.mark.parametrize(
  "n,servers,colocated",
  [
    (n, s, c)
    for n in SIZES
    for s in (1, 2, 3, 4, 20)
    for c in (False, True)
    if not (c and s > n)  # co-located servers are at most n
  ],
)
def test_sharded_parameter_server_matches_simulation(n, servers, colocated):
  nodes = n if colocated else n + servers
  steps = _sharded_ps(n, servers, colocated)
  seconds, buf = _simulate(nodes, n, servers, steps, _flat_cost())
  _assert_allreduced(buf, n)
  want = col.sharded_parameter_server(n, servers, B, ALPHA, BETA, colocated)
  assert np.isclose(seconds, want, rtol=1e-12)


def test_colocated_fully_sharded_server_costs_a_ring():
  for n in (2, 5, 16):
    assert np.isclose(
      col.sharded_parameter_server(n, n, B, ALPHA, BETA, True),
      col.ring_allreduce(n, B, ALPHA, BETA),
    )


def test_one_worker_is_free():
  for name in col.FLAT + ("rabenseifner",):
    assert col.ALGORITHMS[name](1, B, ALPHA, BETA) == 0.0
  assert col.sharded_parameter_server(1, 1, B, ALPHA, BETA, True) == 0.0


def test_crossover_and_best_allreduce():
  small, large = 1e3, 1e9
  for n in (8, 12, 16):
    ring = col.ring_allreduce(n, small, ALPHA, BETA)
    assert col.recursive_halving_doubling(n, small, ALPHA, BETA) < ring
    assert col.binary_tree(n, small, ALPHA, BETA) < ring
    assert col.best_allreduce(n, small, ALPHA, BETA)[0] == "recursive_halving_doubling"
    assert col.binary_tree(n, large, ALPHA, BETA) > col.ring_allreduce(
      n, large, ALPHA, BETA
    )
  # Large messages: on a power of two halving/doubling has the ring's bandwidth
  # term and fewer latencies; otherwise its fold costs 2 B beta more, and the
  # ring wins.
  assert col.best_allreduce(16, large, ALPHA, BETA)[0] == "recursive_halving_doubling"
  name, seconds = col.best_allreduce(12, large, ALPHA, BETA)
  assert name == "ring"
  assert seconds == col.ring_allreduce(12, large, ALPHA, BETA)
  for n in (2, 3, 12, 16, 1024):
    for nbytes in (1e3, 1e6, 1e9):
      name, seconds = col.best_allreduce(n, nbytes, ALPHA, BETA)
      assert seconds == min(col.ALGORITHMS[k](n, nbytes, ALPHA, BETA) for k in col.FLAT)
      assert seconds == col.ALGORITHMS[name](n, nbytes, ALPHA, BETA)


@pytest.mark.parametrize("name", col.FLAT + ("rabenseifner",))
@pytest.mark.parametrize(
  "args,param",
  [
    ((0, B, ALPHA, BETA), "n"),
    ((2.0, B, ALPHA, BETA), "n"),
    ((True, B, ALPHA, BETA), "n"),
    ((4, -1.0, ALPHA, BETA), "nbytes"),
    ((4, float("nan"), ALPHA, BETA), "nbytes"),
    ((4, B, -1e-6, BETA), "alpha"),
    ((4, B, ALPHA, float("inf")), "beta"),
  ],
)
def test_bad_inputs(name, args, param):
  with pytest.raises(ValueError, match=param):
    col.ALGORITHMS[name](*args)


def test_bad_inputs_extra_parameters():
  with pytest.raises(ValueError, match="n"):
    col.best_allreduce(0, B, ALPHA, BETA)
  with pytest.raises(ValueError, match="workers_per_node"):
    col.hierarchical(8, B, ALPHA, BETA, workers_per_node=3, intra_alpha=0, intra_beta=0)
  with pytest.raises(ValueError, match="workers_per_node"):
    col.hierarchical(8, B, ALPHA, BETA, workers_per_node=0, intra_alpha=0, intra_beta=0)
  with pytest.raises(ValueError, match="intra_beta"):
    col.hierarchical(
      8, B, ALPHA, BETA, workers_per_node=2, intra_alpha=0, intra_beta=-1
    )
  with pytest.raises(ValueError, match="servers"):
    col.sharded_parameter_server(4, 5, B, ALPHA, BETA, True)
  with pytest.raises(ValueError, match="servers"):
    col.sharded_parameter_server(4, 0, B, ALPHA, BETA, False)
  with pytest.raises(ValueError, match="colocated"):
    col.sharded_parameter_server(4, 2, B, ALPHA, BETA, 1)


# -- a described cluster prices its all-reduce by the chosen algorithm ----------------

LINK = {"bandwidth_gbps": 10.0, "latency_us": 25.0}
# As the Cluster reads its link: alpha = latency_us * 1e-6 (not the literal
# 25e-6, one ulp away), beta = 8 / (bandwidth_gbps * 1e9).
C_ALPHA, C_BETA = 25.0 * 1e-6, 8.0 / (10.0 * 1e9)
HIER = {"workers_per_node": 4, "intra_bandwidth_gbps": 100.0, "intra_latency_us": 2.0}


def _cluster_and_reference(name, n):
  """The Cluster choosing ``name`` and ``(n, nbytes) -> seconds`` of collectives."""
  if name == "hierarchical":
    cluster = Cluster(n, **LINK, allreduce=name, **HIER)
    ia, ib = 2.0 * 1e-6, 8.0 / (100.0 * 1e9)
    ref = lambda b: col.hierarchical(
      n, b, C_ALPHA, C_BETA, workers_per_node=4, intra_alpha=ia, intra_beta=ib
    )
  elif name == "sharded_parameter_server":
    cluster = Cluster(n, **LINK, allreduce=name, servers=3, colocated=True)
    ref = lambda b: col.sharded_parameter_server(n, 3, b, C_ALPHA, C_BETA, True)
  elif name == "best":
    cluster = Cluster(n, **LINK, allreduce=name)
    ref = lambda b: col.best_allreduce(n, b, C_ALPHA, C_BETA)[1]
  else:
    cluster = Cluster(n, **LINK, allreduce=name)
    ref = lambda b: col.ALGORITHMS[name](n, b, C_ALPHA, C_BETA)
  return cluster, ref


CLUSTER_SIZES = (1e3, 3e5, 7.5e6, 1e9)


@pytest.mark.parametrize("name", ALLREDUCE)
@pytest.mark.parametrize("n", [4, 12, 16])
def test_cluster_all_reduce_is_the_chosen_algorithm(name, n):
  cluster, ref = _cluster_and_reference(name, n)
  sizes = np.array(CLUSTER_SIZES)
  want = np.array([ref(b) for b in CLUSTER_SIZES])
  # Arrays broadcast; one collective per entry is the collectives' price.
  np.testing.assert_allclose(cluster.exchange_seconds("all-reduce", sizes), want, 1e-12)
  np.testing.assert_allclose(
    cluster.comm_seconds({"all-reduce": (sizes, 1)}), want, 1e-12
  )
  # m collectives carrying B in all: m of them, B / m each.
  messages = np.array([[1], [3]])
  got = cluster.exchange_seconds("all-reduce", sizes, messages)
  assert got.shape == (2, len(CLUSTER_SIZES))
  np.testing.assert_allclose(got[1], [3 * ref(b / 3) for b in CLUSTER_SIZES], 1e-12)
  # The other kinds keep their ring prices whatever the all-reduce.
  ring = Cluster(n, **LINK)
  for kind in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
    assert cluster.exchange_seconds(kind, 1e6, 2) == ring.exchange_seconds(kind, 1e6, 2)
  assert Cluster(1, allreduce=name).exchange_seconds("all-reduce", 1e9) == 0.0


@pytest.mark.parametrize("n", [2, 3, 12, 16, 1000])
def test_best_is_the_least_flat_price_per_message_size(n):
  best = Cluster(n, **LINK, allreduce="best")
  sizes = np.geomspace(1e3, 1e9, 13)
  messages = np.array([[1], [4]])
  each = [
    Cluster(n, **LINK, allreduce=a).exchange_seconds("all-reduce", sizes, messages)
    for a in col.FLAT
  ]
  got = best.exchange_seconds("all-reduce", sizes, messages)
  np.testing.assert_array_equal(got, np.min(each, axis=0))
  for a in col.FLAT:  # the same prices through allreduce_seconds(algorithm=)
    np.testing.assert_array_equal(
      best.allreduce_seconds(sizes, messages, a), each[col.FLAT.index(a)]
    )
  # The winner depends on the size of each collective, B / messages.
  for b in sizes:
    assert best.exchange_seconds("all-reduce", b, 4) == pytest.approx(
      4 * col.best_allreduce(n, b / 4, C_ALPHA, C_BETA)[1], rel=1e-12
    )


def test_default_cluster_all_reduce_is_unchanged_bit_for_bit():
  sizes = np.array([0.0, 1.0, 1e3, 7.77e5, 3e6, 123456789.0, 1e9])
  for n in (1, 2, 3, 5, 8, 12, 16, 100, 1000, 1024):
    c = Cluster(n)
    assert c.allreduce == "ring"
    for messages in (0, 1, 2, 7):
      got = c.exchange_seconds("all-reduce", sizes, messages)
      if n == 1:
        np.testing.assert_array_equal(got, 0.0)
        continue
      # The formula exchange_seconds had before algorithms were a choice.
      alpha, per_byte = 25.0 * 1e-6, 8.0 / (20.0 * 1e9)
      m = np.float64(messages)
      old = m * (2 * (n - 1)) * alpha + (2 * (n - 1) / n) * sizes * per_byte
      np.testing.assert_array_equal(got, old)
    # ... which is collectives.ring_allreduce exactly, one collective at a time.
    for b in sizes:
      assert c.exchange_seconds("all-reduce", b) == col.ring_allreduce(
        n, b, 25.0 * 1e-6, 8.0 / (20.0 * 1e9)
      )


def test_parameter_server_topology_keeps_the_single_server_model():
  n, b = 8, 1e6
  ps = Cluster(n, **LINK, topology="parameter_server")
  # Survey 004 §2.1, one server: alpha once per phase, 2 n B through its link.
  assert ps.exchange_seconds("all-reduce", b) == pytest.approx(
    2 * C_ALPHA + 2 * n * b * C_BETA, rel=1e-15
  )
  assert ps.exchange_seconds("all-gather", b) == pytest.approx(
    2 * C_ALPHA + (n + n * n) * b * C_BETA, rel=1e-15
  )
  assert ps.allreduce_seconds(b) == ps.exchange_seconds("all-reduce", b)
  # The sharded model with one dedicated server moves the same bytes, but every
  # one of the n queued pushes (and pulls) pays its own alpha.
  one = Cluster(n, **LINK, allreduce="sharded_parameter_server")
  assert one.exchange_seconds("all-reduce", b) == pytest.approx(
    ps.exchange_seconds("all-reduce", b) + (2 * n - 2) * C_ALPHA, rel=1e-12
  )
  assert ps.allreduce_seconds(b, algorithm="sharded_parameter_server") == (
    one.exchange_seconds("all-reduce", b)
  )


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"allreduce": "butterfly"}, "allreduce must be one of"),
    ({"allreduce": "ring", "topology": "parameter_server", "servers": 2}, None),
    (
      {"allreduce": "best", "topology": "parameter_server"},
      "allreduce must be 'ring'.*got 'best'",
    ),
    ({"servers": 0}, "servers must be an integer >= 1, got 0"),
    ({"servers": 2.0}, "servers must be an integer >= 1, got 2.0"),
    ({"servers": True}, "servers must be an integer >= 1, got True"),
    (
      {"allreduce": "sharded_parameter_server", "servers": 9, "colocated": True},
      r"servers must be in \[1, workers = 8\] when colocated, got 9",
    ),
    ({"allreduce": "sharded_parameter_server", "servers": 9}, None),
    ({"colocated": 1}, "colocated must be True or False, got 1"),
    ({"workers_per_node": 0}, "workers_per_node must be an integer >= 1, got 0"),
    (
      {"allreduce": "hierarchical", "workers_per_node": 3},
      "workers_per_node must divide workers = 8, got 3",
    ),
    ({"intra_bandwidth_gbps": 0.0}, "intra_bandwidth_gbps must be finite and > 0"),
    ({"intra_bandwidth_gbps": np.inf}, "intra_bandwidth_gbps"),
    ({"intra_latency_us": -1.0}, "intra_latency_us must be finite and >= 0, got -1.0"),
    ({"intra_latency_us": "5"}, "intra_latency_us"),
  ],
)
def test_bad_allreduce_fields_raise(kwargs, message):
  if message is None:  # valid: a parameter its algorithm does not use
    Cluster(8, **kwargs)
    return
  with pytest.raises(ValueError, match=message):
    Cluster(8, **kwargs)


def test_allreduce_seconds_rejects_an_unknown_algorithm():
  with pytest.raises(ValueError, match="algorithm must be one of"):
    Cluster(4).allreduce_seconds(1e6, algorithm="butterfly")


# -- the table of winners (python -m bench collectives) ---------------------


def test_allreduce_table_limiting_cases():
  # At beta = 8e-10 (10 Gbit/s), alpha = 25 us. Per worker, with B bytes:
  #   ring   2 (n-1) alpha + 2 (n-1)/n B beta
  #   RHD    2 lg n alpha + 2 (n-1)/n B beta                 (n a power of two)
  #          (2 lg p + 2) alpha + (2 (p-1)/p + 2) B beta     (else, p < n)
  #   tree   2 ceil(lg n) (alpha + B beta)
  # * n a power of two: RHD has the ring's bandwidth term and 2 lg n <= 2 (n-1)
  #   latencies (equal only at n = 2, where the tie goes to the ring), so it
  #   wins at every size; the tree has the same latencies and 2 lg n >=
  #   2 (n-1)/n times the bytes, so it never wins.
  # * Tiny messages on many workers (n = 1000, 1 KB): the latency terms rule,
  #   2 (lg 512 + 1) = 20 alpha = 0.5 ms for RHD against 1998 alpha = 50 ms for
  #   the ring: a log-latency algorithm, not the ring.
  # * Huge messages (1 GB) on n not a power of two: the bandwidth terms rule;
  #   RHD's fold costs 2 B beta = 1.6 s more than the ring's bandwidth-optimal
  #   2 (n-1)/n B beta, far more than the ring's extra latencies (at most
  #   (2 (n-1) - 20) alpha < 50 ms for n = 1000): the ring.
  # * n = 3: RHD and the tree have the ring's 4 alpha and more bytes: the ring.
  # * The tree's latency count equals RHD's (2 ceil(lg n) = 2 lg p + 2 off the
  #   powers of two) and its bytes are at least RHD's: never strictly cheaper.
  rows = col.allreduce_table(25e-6, 8e-10, (2, 3, 12, 1000, 1024), (1e3, 1e9))
  got = {(r["workers"], r["nbytes"]): r["best"] for r in rows}
  rhd = "recursive_halving_doubling"
  assert got == {
    (2, 1e3): "ring",
    (2, 1e9): "ring",
    (3, 1e3): "ring",
    (3, 1e9): "ring",
    (12, 1e3): rhd,
    (12, 1e9): "ring",
    (1000, 1e3): rhd,
    (1000, 1e9): "ring",
    (1024, 1e3): rhd,
    (1024, 1e9): rhd,
  }
  for r in rows:
    assert r["prices"] == {
      k: col.ALGORITHMS[k](r["workers"], r["nbytes"], 25e-6, 8e-10) for k in col.FLAT
    }
    assert r["seconds"] == min(r["prices"].values()) == r["prices"][r["best"]]
  default = col.allreduce_table(25e-6, 8e-10)
  assert len(default) == len(col.TABLE_WORKERS) * len(col.TABLE_BYTES)
  assert {2, 1024} <= set(col.TABLE_WORKERS) and min(col.TABLE_BYTES) == 1e3
  assert max(col.TABLE_BYTES) == 1e9
  assert all(r["best"] != "binary_tree" for r in default)


def test_allreduce_table_rejects_bad_input():
  with pytest.raises(ValueError, match="non-empty"):
    col.allreduce_table(25e-6, 8e-10, (), (1e3,))
  with pytest.raises(ValueError, match=r"workers\[1\] must be an integer >= 1"):
    col.allreduce_table(25e-6, 8e-10, (4, 0), (1e3,))
  with pytest.raises(ValueError, match=r"sizes\[0\] must be a finite real >= 0"):
    col.allreduce_table(25e-6, 8e-10, (4,), (-1.0,))
  with pytest.raises(ValueError, match="alpha"):
    col.allreduce_table(-1.0, 8e-10, (4,), (1e3,))


def test_collectives_bench_suite(tmp_path, capsys):
  from bench import __main__ as bench_main
  from bench import collectives as suite

  bench_main.main(["collectives", "--bandwidth-gbps", "10", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert "10 Gbit/s and 25 us per message" in out
  assert "| 1024 | RHD " in out and "| 3 | ring " in out
  result = json.loads((tmp_path / "collectives.json").read_text())
  alpha, beta = suite.link(10.0, 25.0)  # the Cluster's reading: 25.0 * 1e-6
  assert (alpha, beta) == (C_ALPHA, C_BETA)
  assert result["rows"] == col.allreduce_table(alpha, beta)
  assert (tmp_path / "collectives.md").read_text().startswith("Cheapest flat")
  # Ring from: the crossover of two affine prices, checked on both sides.
  for n, cross in result["ring_from"].items():
    n = int(n)
    if n & (n - 1) == 0 and n > 2:
      assert cross is None
      continue
    for b, winner in (
      (cross * 0.99, "recursive_halving_doubling"),
      (cross * 1.01, "ring"),
    ):
      if b > 0:
        assert col.best_allreduce(n, b, 25e-6, 8e-10)[0] == winner
  assert suite.ring_crossover(12, 25e-6, 8e-10) == pytest.approx(
    14 * 25e-6 / ((1.75 + 2 - 22 / 12) * 8e-10)
  )
  with pytest.raises(SystemExit, match="bandwidth_gbps must be finite and > 0"):
    bench_main.main(["collectives", "--bandwidth-gbps", "0", "--out", str(tmp_path)])
