"""EdgeGossip's host side in the training program (train/edgegossip.py, paper 002).

The trainer's epochs against the paper's rules restated here: shards partition
the training set; a worker with ``r_i = 1`` trains on its whole shard once; a
balanced worker takes the highest-loss subsets whole until its budget
(Alg. 2); the plan survives a checkpoint round trip. No training here: the
end-to-end run and its exact resume are in test_train.py.
"""

import jax
import numpy as np
import pytest

import gradcomp
from configs import default
from gradcomp import edgegossip as eg
from train import data
from train import edgegossip as edge_lib

# One worker runs the module: its tests share the module's trainer (``trainer``), built
# once.
pytestmark = pytest.mark.xdist_group("train_edgegossip")

WORKERS = 8
BATCH = 64
SPEEDS = (1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25)


def _config(**scheme):
  config = default.get_config()
  config.scheme = default.scheme("edgegossip", p=0.5, **scheme)
  return config


@pytest.fixture(scope="module")
def digits():
  return data.load_digits()


@pytest.fixture(scope="module")
def trainer(digits):
  return _trainer(digits)


def _trainer(ds, **scheme):
  cluster = gradcomp.sim.Cluster(WORKERS, speeds=SPEEDS, flops_per_second=1e9)
  return edge_lib.Trainer(_config(**scheme), ds, cluster, BATCH, 1e4, 4e4)


def _trained(plan, w):
  """Worker ``w``'s trained rows, in order."""
  rows = plan.rows.reshape(plan.rows.shape[0], WORKERS, BATCH)[:, w]
  mask = plan.mask.reshape(plan.mask.shape[0], WORKERS, BATCH)[:, w]
  return rows[mask]


def test_shards_partition_the_training_set():
  parts = edge_lib.shards(1437, WORKERS, seed=3)
  flat = np.concatenate(parts)
  np.testing.assert_array_equal(np.sort(flat), np.arange(1437))
  assert max(p.size for p in parts) - min(p.size for p in parts) <= 1
  again = edge_lib.shards(1437, WORKERS, seed=3)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
  assert not np.array_equal(parts[0], edge_lib.shards(1437, WORKERS, seed=4)[0])


def test_loss_ranked_plan_follows_algorithms_1_and_2(trainer):
  m = int(trainer.num_points.max())
  losses = np.random.default_rng(0).random((WORKERS, m))
  plan = trainer.plan(0, np.zeros(WORKERS), losses)
  sizes = trainer.sizes.astype(float)
  times = sizes / np.asarray(SPEEDS)
  ratios = times.min() / times  # Alg. 1, restated
  samples = plan.samples(WORKERS).sum(0)
  for w, shard in enumerate(trainer.shards):
    agg = trainer.aggregations[w]
    got = _trained(plan, w)
    assert np.all(np.isin(got, shard))
    # The highest-loss subsets, whole, in rank order, until the budget.
    order = np.argsort(-losses[w, : agg.num_subsets], kind="stable")
    want, total = [], 0
    for subset in order:
      if total >= ratios[w] * sizes[w]:
        break
      want.append(shard[agg.subset(subset)])
      total += agg.sizes[subset]
    np.testing.assert_array_equal(got, np.concatenate(want))
    assert samples[w] == total
    if ratios[w] == 1.0:  # A fastest worker trains on its whole shard once.
      np.testing.assert_array_equal(np.sort(got), shard)
    # Packed rows: full rows, one partial, then masked rows.
    per_step = plan.samples(WORKERS)[:, w]
    full, rest = divmod(int(samples[w]), BATCH)
    np.testing.assert_array_equal(per_step[:full], BATCH)
    assert per_step[full:].sum() == rest
  assert np.all(plan.rows[~plan.mask] == 0)  # padding


def test_gosgd_epoch_visits_every_shard_once(digits):
  gosgd = _trainer(digits, balance=False, selection="shuffle")
  first, second = gosgd.plan(0, np.zeros(WORKERS)), gosgd.plan(1, np.zeros(WORKERS))
  for w, shard in enumerate(gosgd.shards):
    np.testing.assert_array_equal(np.sort(_trained(first, w)), shard)
    assert not np.array_equal(_trained(first, w), _trained(second, w))  # reshuffled
  assert gosgd.ratios(1) is None


def test_random_selection_has_the_same_budget_and_another_order(digits):
  ranked = _trainer(digits, selection="random")
  plan = ranked.plan(0, np.zeros(WORKERS))
  again = ranked.plan(0, np.zeros(WORKERS))
  np.testing.assert_array_equal(plan.rows, again.rows)  # seeded
  other = ranked.plan(1, np.zeros(WORKERS))
  assert not np.array_equal(plan.rows, other.rows)
  ratios = ranked.ratios(1).ratios
  samples = plan.samples(WORKERS).sum(0)
  assert np.all(samples >= ratios * ranked.sizes)


def test_plan_survives_the_checkpoint_entry(trainer):
  mesh = jax.make_mesh((WORKERS,), ("data",))
  assert trainer.epoch_of(jax.device_get(trainer.empty_state(mesh))) is None
  losses = np.zeros((WORKERS, int(trainer.num_points.max())))
  plan = trainer.plan(4, np.full(WORKERS, 0.25), losses)
  back = trainer.epoch_of(jax.device_get(trainer.state_of(mesh, plan)))
  assert (back.index, back.first_step) == (4, 4 * trainer.steps_per_epoch + 1)
  np.testing.assert_array_equal(back.rows, plan.rows)
  np.testing.assert_array_equal(back.mask, plan.mask)
  np.testing.assert_array_equal(back.clock, plan.clock)
  priced = trainer.price(back)
  np.testing.assert_array_equal(priced.times, trainer.price(plan).times)


def test_balancer_halts_at_construction(digits):
  cluster = gradcomp.sim.Cluster(WORKERS, speeds=(1e-12,) * 2 + (1.0,) * 6)
  with pytest.raises(eg.BalancerHalted, match="2 of 8"):
    edge_lib.Trainer(_config(), digits, cluster, BATCH, 1e4, 4e4)


def test_a_plan_from_mid_epoch_covers_the_share_left(trainer):
  """An elastic resume's partial epoch: the steps before it masked, each
  worker's budget ``(left / S) r_i |X_i|`` taken as whole subsets."""
  steps = trainer.steps_per_epoch
  losses = np.random.default_rng(1).random((WORKERS, int(trainer.num_points.max())))
  whole = trainer.plan(2, np.zeros(WORKERS), losses)
  part = trainer.plan(2, np.zeros(WORKERS), losses, from_step=whole.first_step + 1)
  assert not part.mask[0].any() and part.first_step == whole.first_step
  ratios = trainer.ratios(whole.first_step).ratios
  for w, shard in enumerate(trainer.shards):
    got = _trained(part, w)
    assert np.all(np.isin(got, shard))
    largest = trainer.aggregations[w].sizes.max()
    share = min(ratios[w], 1.0) * shard.size * (steps - 1) / steps
    budget = min(share, (steps - 1) * BATCH - largest + 1)  # It must fit.
    assert budget <= got.size < budget + largest
  np.testing.assert_array_equal(
    trainer.plan(2, np.zeros(WORKERS), losses, from_step=whole.first_step).rows,
    whole.rows,
  )
  with pytest.raises(ValueError, match="from_step must be a step of epoch 2"):
    trainer.plan(2, np.zeros(WORKERS), losses, from_step=whole.first_step + steps)
