"""EdgeGossip's balancer (paper 002 Alg. 1) and the trainer's data order (Alg. 2).

The balancer against its closed form and the invariant it exists for (every
live platform needs ``T_min`` for its share), with every branch (failure,
halt, flag); the epoch plans against an independent prefix search, the
order they must follow and the shape an SPMD step needs. Pure NumPy.
"""

import numpy as np
import pytest

from gradcomp import edgegossip as eg

# -- Algorithm 1 ----------------------------------------------------------------------


def test_balance_closed_form():
  sizes, speeds = [100, 200, 50, 80], [10.0, 40.0, 2.0, 8.0]
  b = eg.balance(sizes, speeds)
  np.testing.assert_array_equal(b.times, [10.0, 5.0, 25.0, 10.0])
  np.testing.assert_allclose(b.ratios, [0.5, 1.0, 0.2, 0.5], rtol=1e-15)
  assert not b.halted and not b.failed.any() and b.failed_share == 0.0
  assert b.epoch_seconds == 5.0
  np.testing.assert_allclose(b.budgets(sizes), [50.0, 200.0, 10.0, 40.0])


def test_balance_equalises_live_platforms():
  rng = np.random.default_rng(0)
  for _ in range(20):
    e = int(rng.integers(1, 12))
    sizes = rng.integers(1, 10_000, e)
    speeds = rng.uniform(0.01, 500.0, e)
    b = eg.balance(sizes, speeds)
    # r_i |X_i| / p_i = T_min on every platform; the fastest keeps all its data.
    np.testing.assert_allclose(b.ratios * sizes / speeds, b.epoch_seconds, rtol=1e-12)
    assert b.epoch_seconds == pytest.approx(np.min(sizes / speeds), rel=1e-15)
    assert b.ratios[np.argmin(sizes / speeds)] == 1.0
    assert np.all((b.ratios > 0) & (b.ratios <= 1.0))


def test_balance_failure_detection_is_strict():
  sizes = np.full(10, 100)
  speeds = np.full(10, 5.0)
  speeds[3] = 0.0009  # below the §3.3 threshold 0.001: failed
  speeds[7] = 0.001  # at the threshold: alive (p_i < p_threshold fails)
  b = eg.balance(sizes, speeds)  # 1 failed of 10: share 0.1, not > 0.1
  assert b.failed.tolist() == [i == 3 for i in range(10)]
  assert b.times[3] == np.inf and b.ratios[3] == 0.0 and not b.halted
  assert b.ratios[7] == pytest.approx(0.001 / 5.0, rel=1e-12)
  live = ~b.failed
  np.testing.assert_allclose(
    b.ratios[live] * sizes[live] / speeds[live], b.epoch_seconds, rtol=1e-12
  )


def test_balance_halts_when_too_many_fail():
  sizes = np.full(10, 100)
  speeds = np.full(10, 5.0)
  speeds[[2, 6]] = 0.0  # share 0.2 > 0.1
  with pytest.raises(eg.BalancerHalted, match=r"2 of 10 .* platforms \[2, 6\]") as info:
    eg.balance(sizes, speeds)
  assert info.value.failed.tolist() == [2, 6] and info.value.balance.halted
  flagged = eg.balance(sizes, speeds, on_halt="flag")
  assert flagged.halted and flagged.failed_share == pytest.approx(0.2)
  np.testing.assert_array_equal(flagged.ratios, np.where(flagged.failed, 0.0, 1.0))
  # A looser threshold lets the epoch go on; a zero threshold halts on any failure.
  assert not eg.balance(sizes, speeds, failure_threshold=0.2).halted
  with pytest.raises(eg.BalancerHalted):
    eg.balance([1, 1], [1.0, 0.0], failure_threshold=0.0)
  assert not eg.balance([1, 1], [1.0, 2.0], failure_threshold=0.0).halted


def test_balance_all_failed_flagged():
  b = eg.balance([5, 5], [0.0, 0.0], on_halt="flag")
  assert b.halted and b.failed.all()
  np.testing.assert_array_equal(b.ratios, [0.0, 0.0])
  assert b.epoch_seconds == np.inf


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(sizes=[1, 2], speeds=[1.0]), r"same length, got 2 and 1"),
    (dict(sizes=[], speeds=[]), r"sizes must be a non-empty 1-D"),
    (dict(sizes=[0, 2], speeds=[1.0, 1.0]), r"sizes must be >= 1"),
    (dict(sizes=[1, 2], speeds=[1.0, -1.0]), r"speeds must be >= 0"),
    (dict(sizes=[1, 2], speeds=[1.0, np.nan]), r"speeds must be finite"),
    (dict(speed_threshold=0.0), r"speed_threshold must be in \(0, inf\), got 0.0"),
    (dict(failure_threshold=1.0), r"failure_threshold must be in \[0, 1\), got 1.0"),
    (dict(on_halt="ignore"), r"on_halt must be one of .* 'ignore'"),
  ],
)
def test_balance_rejects_bad_inputs(kwargs, match):
  args = dict(sizes=[1, 2], speeds=[1.0, 2.0]) | kwargs
  with pytest.raises(ValueError, match=match):
    eg.balance(args.pop("sizes"), args.pop("speeds"), **args)


# -- Algorithm 2 ----------------------------------------------------------------------


def _random_subsets(rng, m, high=15):
  """``m`` disjoint subsets of sizes 1..high over a shuffled range of samples."""
  sizes = rng.integers(1, high + 1, m)
  samples = rng.permutation(int(sizes.sum()))
  return np.split(samples, np.cumsum(sizes)[:-1])


def test_rank_subsets_matches_a_sort():
  rng = np.random.default_rng(0)
  losses = rng.integers(0, 5, 40).astype(float)  # many ties
  expected = sorted(range(40), key=lambda m: (-losses[m], m))
  assert eg.rank_subsets(losses).tolist() == expected
  with pytest.raises(ValueError, match="losses must be a finite 1-D"):
    eg.rank_subsets([1.0, np.nan])


def test_select_subsets_is_the_shortest_prefix():
  rng = np.random.default_rng(1)
  for _ in range(50):
    sizes = rng.integers(1, 20, int(rng.integers(1, 30)))
    order = rng.permutation(sizes.size)
    budget = float(rng.uniform(0, sizes.sum()))
    got = eg.select_subsets(order, sizes, budget).tolist()
    # Independent: walk the order, stop once the budget is met.
    taken, chosen = 0, []
    for m in order:
      if taken >= budget:
        break
      chosen.append(int(m))
      taken += sizes[m]
    assert got == chosen
  assert eg.select_subsets([1, 0], [3, 4], 0.0).tolist() == []
  assert eg.select_subsets([1, 0], [3, 4], 7.0).tolist() == [1, 0]
  assert eg.select_subsets([1, 0], [3, 4], 4.0).tolist() == [1]  # met exactly


@pytest.mark.parametrize("layout", ["whole", "packed"])
@pytest.mark.parametrize("batch", [16, 64])
def test_plan_epoch_budget_order_and_shape(layout, batch):
  rng = np.random.default_rng(batch)
  subsets = _random_subsets(rng, 60)
  total = sum(s.size for s in subsets)
  losses = rng.standard_normal(60)
  order = eg.rank_subsets(losses)
  for budget in (0.0, 1.0, 0.37 * total, 0.8 * total, float(total)):
    plan = eg.plan_epoch(subsets, order, budget, batch_size=batch, layout=layout)
    assert plan.indices.shape == plan.mask.shape == (plan.steps, batch)
    assert plan.indices.dtype == np.int32 and plan.mask.dtype == bool
    assert np.all(plan.indices[~plan.mask] == 0)
    # Whole subsets, highest loss first, in that order through the rows.
    chosen = plan.subsets.tolist()
    assert (
      chosen == eg.select_subsets(order, [s.size for s in subsets], budget).tolist()
    )
    assert chosen == order[: len(chosen)].tolist()
    sequence = np.concatenate([subsets[m] for m in chosen]) if chosen else []
    np.testing.assert_array_equal(plan.indices[plan.mask], sequence)
    # The stop rule: budget <= processed < budget + |last subset|.
    assert plan.samples >= budget
    if chosen:
      assert plan.samples - subsets[chosen[-1]].size < budget
      assert plan.active_steps == plan.steps  # no empty row inside
    else:
      assert plan.samples == 0 and plan.steps == 0
    rows = plan.mask.sum(axis=1)
    if layout == "packed":
      assert np.all(rows[:-1] == batch)
    else:
      # Each row holds whole subsets, and was closed only when the next one
      # did not fit (every subset here is smaller than a row).
      row_of = {
        m: set(np.flatnonzero(np.isin(plan.indices, subsets[m]) & plan.mask) // batch)
        for m in chosen
      }
      assert all(len(r) == 1 for r in row_of.values())
      firsts = [
        m for j, m in enumerate(chosen) if j == 0 or row_of[m] != row_of[chosen[j - 1]]
      ]
      for r in range(1, plan.steps):
        assert rows[r - 1] + subsets[firsts[r]].size > batch


def test_plan_epoch_whole_layout_splits_only_oversized_subsets():
  subsets = [np.arange(0, 3), np.arange(3, 13), np.arange(13, 15)]
  plan = eg.plan_epoch(subsets, [0, 1, 2], 15, batch_size=4)
  assert plan.indices.tolist() == [
    [0, 1, 2, 0],
    [3, 4, 5, 6],
    [7, 8, 9, 10],
    [11, 12, 13, 14],
  ]
  assert plan.mask.sum(axis=1).tolist() == [3, 4, 4, 4]
  packed = eg.plan_epoch(subsets, [0, 1, 2], 15, batch_size=4, layout="packed")
  assert packed.indices.ravel()[:15].tolist() == list(range(15))
  assert packed.mask.sum() == 15 and packed.steps == 4


def test_plan_epoch_steps_padding_and_stacking():
  rng = np.random.default_rng(2)
  subsets = _random_subsets(rng, 30)
  order = eg.rank_subsets(rng.standard_normal(30))
  total = sum(s.size for s in subsets)
  short = eg.plan_epoch(subsets, order, 0.3 * total, batch_size=32)
  full = eg.plan_epoch(subsets, order, total, batch_size=32)
  padded = eg.plan_epoch(subsets, order, 0.3 * total, batch_size=32, steps=full.steps)
  assert padded.steps == full.steps and padded.samples == short.samples
  np.testing.assert_array_equal(padded.indices[: short.steps], short.indices)
  assert not padded.mask[short.steps :].any()  # past its budget: masked
  with pytest.raises(ValueError, match=rf"steps must be >= {short.steps}"):
    eg.plan_epoch(subsets, order, 0.3 * total, batch_size=32, steps=short.steps - 1)
  indices, mask = eg.stack_plans([short, full, padded])
  assert indices.shape == mask.shape == (3, full.steps, 32)
  for w, p in enumerate([short, full, padded]):
    np.testing.assert_array_equal(indices[w, : p.steps], p.indices)
    np.testing.assert_array_equal(mask[w, : p.steps], p.mask)
    assert not mask[w, p.steps :].any()
  assert eg.stack_plans([short], steps=full.steps + 2)[1].shape == (
    1,
    full.steps + 2,
    32,
  )
  with pytest.raises(ValueError, match="share one batch_size"):
    eg.stack_plans([short, eg.plan_epoch(subsets, order, 10, batch_size=8)])


def test_loss_ranking_against_random_selection():
  rng = np.random.default_rng(3)
  subsets = _random_subsets(rng, 50)
  losses = rng.exponential(size=50)
  total = sum(s.size for s in subsets)
  budget = 0.4 * total
  ranked = eg.plan_epoch(subsets, eg.rank_subsets(losses), budget)
  chosen = ranked.subsets
  rest = np.setdiff1d(np.arange(50), chosen)
  assert losses[chosen].min() >= losses[rest].max()  # the top-loss subsets
  a = eg.plan_epoch(subsets, eg.random_ranking(50, seed=7), budget)
  b = eg.plan_epoch(subsets, eg.random_ranking(50, seed=7), budget)
  c = eg.plan_epoch(subsets, eg.random_ranking(50, seed=8), budget)
  np.testing.assert_array_equal(a.indices, b.indices)  # reproducible by seed
  assert not np.array_equal(a.subsets, c.subsets)
  for plan in (ranked, a, c):  # the same budget rule
    assert budget <= plan.samples < budget + subsets[plan.subsets[-1]].size
  assert losses[a.subsets].mean() < losses[chosen].mean()


def test_subset_losses_calls_the_model():
  points = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 0.0]])
  labels = np.array([0, 1, 0])
  prototypes = np.array([[0.0, 0.0], [0.0, 0.0]])
  loss_fn = lambda p, y: np.sum((p - prototypes[y]) ** 2, axis=1)
  losses = eg.subset_losses(points, labels, loss_fn)
  np.testing.assert_array_equal(losses, [0.0, 25.0, 1.0])
  assert eg.rank_subsets(losses).tolist() == [1, 2, 0]
  with pytest.raises(ValueError, match=r"loss_fn must return shape \(3,\)"):
    eg.subset_losses(points, labels, lambda p, y: np.zeros(2))
  with pytest.raises(ValueError, match="finite"):
    eg.subset_losses(points, labels, lambda p, y: np.full(3, np.inf))


def test_balancer_and_plans_finish_together():
  # Alg. 1 then Alg. 2 on four platforms: processed samples / speed is T_min,
  # up to the last whole subset.
  rng = np.random.default_rng(4)
  shards = [_random_subsets(rng, m) for m in (40, 40, 60, 30)]
  sizes = np.array([sum(s.size for s in shard) for shard in shards])
  speeds = np.array([100.0, 50.0, 30.0, 10.0])
  b = eg.balance(sizes, speeds)
  plans = [
    eg.plan_epoch(shard, eg.rank_subsets(rng.standard_normal(len(shard))), budget)
    for shard, budget in zip(shards, b.budgets(sizes), strict=True)
  ]
  for p, speed in zip(plans, speeds, strict=True):
    seconds = p.samples / speed
    assert b.epoch_seconds <= seconds < b.epoch_seconds + 15 / speed


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(order=[0, 0, 1]), r"order must be a permutation of range\(3\)"),
    (dict(budget=10.5), r"budget must be in \[0, 10\]"),
    (dict(budget=-1.0), r"budget must be in \[0, 10\]"),
    (dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    (dict(layout="ragged"), r"layout must be one of .* 'ragged'"),
    (dict(steps=-1), r"steps must be an integer >= 0"),
    (dict(subsets=[[0, 1], [1, 2], [3]]), r"disjoint"),
    (dict(subsets=[[0, 1], [], [3]]), r"subsets\[1\] must be a non-empty"),
  ],
)
def test_plan_epoch_rejects_bad_inputs(kwargs, match):
  args = dict(subsets=[[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]], order=[2, 0, 1], budget=5.0)
  args |= kwargs
  subsets = [np.asarray(s, dtype=int) for s in args.pop("subsets")]
  with pytest.raises(ValueError, match=match):
    eg.plan_epoch(subsets, args.pop("order"), args.pop("budget"), **args)
