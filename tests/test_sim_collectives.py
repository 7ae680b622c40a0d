"""The collectives' closed forms against a message-by-message simulation.

The simulation is independent of ``gradcomp.sim.collectives``: each algorithm
is written here as steps of messages ``(src, dst, chunks, op)``; a message of
``b`` bytes occupies ``src``'s outgoing and ``dst``'s incoming link direction
for ``alpha + b beta`` (one message at a time per direction, queued in list
order); a step ends when its last message arrives. Each node's buffer counts,
per chunk, how many times each worker's data was summed in, so the test also
checks every schedule really is an all-reduce (each worker ends with every
chunk holding each contribution exactly once).
"""

import numpy as np
import pytest

from gradcomp.sim import collectives as col

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
