r"""EdgeGossip in the training program (paper 002 §3): ``config.scheme.name=edgegossip``.

GoSGD underneath (``gradcomp.gosgd``, push probability ``config.scheme.p``),
on per-worker shards of the training set, with the paper's three parts in
front of each epoch (``gradcomp.edgegossip``):

1. **Balancer** (Alg. 1): each worker's rate ``p_i`` (samples/s) is its
   speed in the described cluster (``config.cluster``: speeds, slowdowns,
   failures) at the epoch's first step times ``flops_per_second`` over the
   training FLOPs of one sample; ``r_i = T_min / T_i`` with ``T_i = |X_i| /
   p_i``. A worker below ``speed_threshold`` has failed (``r_i = 0``); more
   than ``failure_threshold`` of them halts the run
   (:class:`~gradcomp.edgegossip.BalancerHalted`). The predictor feeds this
   through ``config.cluster.speeds`` (``python -m bench
   predictor`` fits one on this machine). ``balance=False`` keeps ``r_i =
   1``: plain GoSGD.
2. **Aggregator** (§3.2), once at start: each worker's shard in single-class
   subsets of about ``ratio`` samples (``method``, one of
   ``gradcomp.edgegossip.METHODS``) and their mean points.
3. **Accuracy-aware trainer** (Alg. 2): each worker scores its aggregated
   points with its own current model, ranks the subsets by loss, highest
   first (``selection="loss"``), and takes whole subsets until ``r_i |X_i|``
   samples. ``selection="random"`` is the same rule on a random subset order
   (the ablation the paper implies); ``"shuffle"`` ignores the subsets and
   takes a random prefix of ``r_i |X_i|`` samples (with ``balance=False``,
   GoSGD's ordinary shuffled epoch).

**SPMD epochs.** Every worker steps ``steps_per_epoch = ceil(max_i |X_i| /
b)`` times per epoch (``b = global_batch_size / workers``, the paper's 64
per platform in §4.1). The chosen samples fill rows of exactly ``b`` in
their order (``plan_epoch(..., layout="packed")``: the same samples and order
as Alg. 2's batches of whole subsets, with the batch boundaries of a fixed
shape; a subset may straddle two steps); rows past a worker's budget are
masked. A masked step leaves the worker's params, optimizer state and batch
statistics as they were and it does not push, though it merges a push it
receives (``gradcomp.gosgd``'s ``active``).

**Simulated time** (``gradcomp.sim.simulate_masked_epoch``): each worker's clock
advances by the samples it processed at its speed, by its loss evaluation
(forward FLOPs of its aggregated points) at the epoch's start, and by ``p``
times one message (``alpha + bytes / bandwidth``, the expected cost of
GoSGD's push) per step it trained; the epoch ends in a barrier (NOTES.md).
``sim_seconds`` is the latest worker's clock.

**Resume.** The epoch's plan and its clocks at the epoch's start are
checkpointed with the state (``state["edgegossip"]``), so a run killed
mid-epoch continues the same batches and the same clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp import edgegossip as eg
from train import data as data_lib

NAME = "edgegossip"
#: Fields of ``config.scheme`` the trainer reads (not ``gradcomp.gosgd``'s).
FIELDS = (
  "method",
  "ratio",
  "balance",
  "selection",
  "speed_threshold",
  "failure_threshold",
)
SELECTIONS = ("loss", "random", "shuffle")


def check(config, ds: data_lib.Dataset, variant: str) -> None:
  """Raises ``ValueError`` for a config or dataset EdgeGossip cannot run."""
  cfg = config.scheme
  if variant != "shard_map":
    raise ValueError(
      f"scheme edgegossip runs under config.step=shard_map, got {variant!r}"
    )
  if jax.process_count() != 1:
    raise ValueError("scheme edgegossip runs in one process (its shards are host-side)")
  if np.ndim(ds.y_train) != 1:
    raise ValueError(
      f"scheme edgegossip needs one class label per example (its subsets are "
      f"single-class), got labels of shape {np.shape(ds.y_train)} ({ds.name})"
    )
  if config.get("sufficient_factors"):
    raise ValueError(
      "scheme edgegossip does not combine with config.sufficient_factors"
    )
  selection = cfg.get("selection") or "loss"
  if selection not in SELECTIONS:
    raise ValueError(
      f"config.scheme.selection must be one of {SELECTIONS}, got {selection!r}"
    )
  method = cfg.get("method") or eg.METHODS[0]
  if method not in eg.METHODS:
    raise ValueError(
      f"config.scheme.method must be one of {eg.METHODS}, got {method!r}"
    )


def shards(num_examples: int, workers: int, seed: int) -> list[np.ndarray]:
  """Each worker's training rows: a seeded permutation cut into ``workers`` parts.

  Sizes differ by at most one (``np.array_split``); each part is sorted.
  """
  order = np.random.default_rng((seed, 0x6564)).permutation(num_examples)
  return [np.sort(part) for part in np.array_split(order, workers)]


@dataclasses.dataclass(frozen=True, eq=False)
class Epoch:
  """One planned epoch.

  Attributes:
    index: the epoch, 0-based.
    first_step: its first training step, 1-based.
    rows: ``(S, workers * b)`` int32 rows of the training set, worker-major
      within a step; 0 where masked.
    mask: ``(S, workers * b)`` bool, true where a row is trained on.
    clock: ``(workers,)`` float64 clocks at the epoch's start.
  """

  index: int
  first_step: int
  rows: np.ndarray
  mask: np.ndarray
  clock: np.ndarray

  def samples(self, workers: int) -> np.ndarray:
    """``(S, workers)`` samples each worker trains on at each step."""
    return self.mask.reshape(self.mask.shape[0], workers, -1).sum(axis=2)


class Trainer:
  """The host side of EdgeGossip: shards, aggregation, balancing, plans, prices.

  Args:
    config: the run's config (``scheme``, ``seed``).
    ds: the dataset.
    cluster: the described cluster (one worker per device of the run).
    batch_per_worker: ``b``.
    forward_flops: forward FLOPs of one sample.
    message_bytes: bytes of one GoSGD push (params and weight).
  """

  def __init__(
    self,
    config,
    ds: data_lib.Dataset,
    cluster: gradcomp.sim.Cluster,
    batch_per_worker: int,
    forward_flops: float,
    message_bytes: float,
  ):
    cfg = config.scheme
    self.workers = cluster.workers
    self.cluster = cluster
    self.batch = int(batch_per_worker)
    self.seed = int(config.seed)
    self.p = float(cfg.p)
    self.balance_on = cfg.get("balance") is not False
    self.selection = cfg.get("selection") or "loss"
    self.speed_threshold = (
      cfg.get("speed_threshold") or eg.balancer.DEFAULT_SPEED_THRESHOLD
    )
    failure = cfg.get("failure_threshold")
    self.failure_threshold = (
      eg.balancer.DEFAULT_FAILURE_THRESHOLD if failure is None else failure
    )
    self.forward_flops = float(forward_flops)
    self.flops_per_sample = gradcomp.sim.training_flops(self.forward_flops, 1)
    self.push_seconds = self.p * float(
      cluster.exchange_seconds("collective-permute", message_bytes)
    )
    self.input_shape = ds.input_shape
    self.shards = shards(len(ds.y_train), self.workers, self.seed)
    self.sizes = np.array([s.size for s in self.shards])
    if self.sizes.min() < 1:
      raise ValueError(
        f"the {len(ds.y_train)} training examples cannot give each of the "
        f"{self.workers} workers a shard"
      )
    start = time.perf_counter()
    # "shuffle" never reads the subsets: no aggregation (plain GoSGD's epochs).
    self.aggregations = (
      []
      if self.selection == "shuffle"
      else [
        eg.aggregate(
          np.asarray(ds.x_train[s]),
          np.asarray(ds.y_train[s]),
          method=cfg.get("method") or eg.METHODS[0],
          ratio=cfg.get("ratio") or eg.aggregator.DEFAULT_RATIO,
          seed=self.seed + w,
        )
        for w, s in enumerate(self.shards)
      ]
    )
    self.aggregation_seconds = time.perf_counter() - start
    self.steps_per_epoch = math.ceil(int(self.sizes.max()) / self.batch)
    self.num_points = np.array(
      [a.num_subsets for a in self.aggregations] or [0] * self.workers
    )
    self.ratios(1)  # Alg. 1's halting rule, before anything compiles.
    per_subset = float(np.mean(self.sizes / np.maximum(self.num_points, 1)))
    if self.selection != "shuffle" and self.batch < 4 * per_subset:
      # Batches of whole single-class subsets in rank order: a batch that
      # holds one or two subsets holds one or two classes (BUILD_NOTES).
      logging.warning(
        "edgegossip: %d samples per worker per step hold only %.1f subsets of "
        "~%.0f single-class samples: near single-class batches train poorly "
        "(the paper's 64 per platform hold ~6); raise config.global_batch_size",
        self.batch,
        self.batch / per_subset,
        per_subset,
      )

  # -- the trainer's inputs ---------------------------------------------------

  def points(self) -> tuple[np.ndarray, np.ndarray]:
    """Every worker's aggregated points, padded to a common ``M``, worker-major.

    Returns ``(x, y)``: ``(workers * M, *input_shape)`` and ``(workers * M,)``
    int32; padding repeats a worker's first point (its loss is ignored).
    """
    m = int(self.num_points.max())
    xs, ys = [], []
    for a in self.aggregations:
      take = np.minimum(np.arange(m), a.num_subsets - 1)
      xs.append(a.points[take].reshape(m, *self.input_shape))
      ys.append(a.labels[take])
    return np.concatenate(xs), np.concatenate(ys).astype(np.int32)

  def rates(self, step: int) -> np.ndarray:
    """``p_i``, samples per second of each worker at ``step`` (0 if failed)."""
    speeds = self.cluster.speeds_at(step)
    return speeds * self.cluster.flops_per_second / self.flops_per_sample

  def ratios(self, step: int) -> eg.Balance | None:
    """Algorithm 1 before the epoch starting at ``step``; ``None`` without balancing."""
    if not self.balance_on:
      return None
    return eg.balance(
      self.sizes,
      self.rates(step),
      speed_threshold=self.speed_threshold,
      failure_threshold=self.failure_threshold,
    )

  def _order(self, w: int, epoch: int, losses: np.ndarray | None) -> np.ndarray:
    m = int(self.num_points[w])
    if self.selection == "loss":
      return eg.rank_subsets(losses[w, :m])
    return np.random.default_rng((self.seed, epoch, w, 1)).permutation(m)

  def plan(
    self,
    epoch: int,
    clock,
    losses: np.ndarray | None = None,
    *,
    from_step: int | None = None,
  ) -> Epoch:
    """Plans epoch ``epoch`` (0-based) from the clocks at its start.

    Args:
      epoch: the epoch.
      clock: ``(workers,)`` clocks at its start.
      losses: ``(workers, M)`` each worker's per-point losses under its
        current model (``selection="loss"`` only).
      from_step: plan only the epoch's steps from this one on (an elastic
        resume in mid-epoch): each worker's budget shrinks to the share of
        the epoch left, and the steps before it are masked. ``None``: the
        whole epoch.
    """
    first = epoch * self.steps_per_epoch + 1
    skip = 0 if from_step is None else int(from_step) - first
    if not 0 <= skip < self.steps_per_epoch:
      raise ValueError(
        f"from_step must be a step of epoch {epoch} (steps {first} to "
        f"{first + self.steps_per_epoch - 1}), got {from_step!r}"
      )
    left = self.steps_per_epoch - skip
    balance = self.ratios(first)
    ratios = np.ones(self.workers) if balance is None else balance.ratios
    rows = np.zeros((self.steps_per_epoch, self.workers, self.batch), np.int32)
    mask = np.zeros(rows.shape, bool)
    for w, shard in enumerate(self.shards):
      budget = min(float(ratios[w] * shard.size), float(shard.size))
      if skip:  # Whole subsets overshoot by less than the largest: it must fit.
        largest = 1 if self.selection == "shuffle" else self.aggregations[w].sizes.max()
        fits = left * self.batch - int(largest) + 1
        budget = min(budget * left / self.steps_per_epoch, max(fits, 0))
      if self.selection == "shuffle":
        rng = np.random.default_rng((self.seed, epoch, w, 2))
        subsets = [np.array([i]) for i in range(shard.size)]
        order = rng.permutation(shard.size)
      else:
        subsets = self.aggregations[w].subsets()
        order = self._order(w, epoch, losses)
      plan = eg.plan_epoch(
        subsets,
        order,
        budget,
        batch_size=self.batch,
        steps=left,
        layout="packed",
      )
      rows[skip:, w] = np.where(plan.mask, shard[plan.indices], 0)
      mask[skip:, w] = plan.mask
    flat = (self.steps_per_epoch, self.workers * self.batch)
    return Epoch(
      epoch, first, rows.reshape(flat), mask.reshape(flat), np.asarray(clock, float)
    )

  def price(self, epoch: Epoch) -> gradcomp.sim.EpochTimes:
    """The epoch's simulated time (module docstring)."""
    overhead = self.num_points * self.forward_flops if self.selection == "loss" else 0.0
    return gradcomp.sim.simulate_masked_epoch(
      self.cluster,
      epoch.clock,
      epoch.first_step,
      epoch.samples(self.workers),
      flops_per_sample=self.flops_per_sample,
      overhead_flops=overhead,
      step_seconds=self.push_seconds,
    )

  def batch_of(self, ds: data_lib.Dataset, epoch: Epoch, step: int):
    """``(x, y, w)``: the global batch of training step ``step`` of ``epoch``."""
    j = step - epoch.first_step
    rows = epoch.rows[j]
    return ds.x_train[rows], ds.y_train[rows], epoch.mask[j].astype(np.float32)

  # -- checkpointed state -----------------------------------------------------

  def empty_state(self, mesh) -> dict[str, Any]:
    """The checkpoint entry before any epoch: replicated arrays on ``mesh``."""
    shape = (self.steps_per_epoch, self.workers * self.batch)
    return self._put(
      mesh,
      {
        "rows": np.zeros(shape, np.int32),
        "mask": np.zeros(shape, bool),
        "clock": np.zeros(self.workers, np.float32),
        "epoch": np.asarray(-1, np.int32),
      },
    )

  def state_of(self, mesh, epoch: Epoch) -> dict[str, Any]:
    """``epoch`` as the checkpoint entry."""
    return self._put(
      mesh,
      {
        "rows": epoch.rows,
        "mask": epoch.mask,
        "clock": epoch.clock.astype(np.float32),
        "epoch": np.asarray(epoch.index, np.int32),
      },
    )

  def epoch_of(self, state: dict[str, Any]) -> Epoch | None:
    """The epoch a checkpoint entry holds; ``None`` before the first."""
    index = int(state["epoch"])
    if index < 0:
      return None
    return Epoch(
      index,
      index * self.steps_per_epoch + 1,
      np.asarray(state["rows"]),
      np.asarray(state["mask"]),
      np.asarray(state["clock"], np.float64),
    )

  @staticmethod
  def _put(mesh, tree):
    return jax.device_put(jax.tree.map(jnp.asarray, tree), NamedSharding(mesh, P()))

  # -- logging ------------------------------------------------------------------

  def epoch_record(
    self, epoch: Epoch, priced: gradcomp.sim.EpochTimes
  ) -> dict[str, Any]:
    """What ``metrics.jsonl`` logs at an epoch's last step."""
    samples = epoch.samples(self.workers).sum(axis=0)
    busy = (samples > 0) & np.isfinite(priced.compute)
    compute = priced.compute[busy]
    balance = self.ratios(epoch.first_step)
    ratios = np.ones(self.workers) if balance is None else balance.ratios
    return {
      "epoch": epoch.index + 1,
      "ratios": [round(float(r), 6) for r in ratios],
      "samples": samples.tolist(),
      "compute_imbalance": float(compute.max() / compute.min())
      if compute.size
      else None,
      "sim_epoch_seconds": float(priced.times.max() - epoch.clock.max()),
      "sim_loss_eval_seconds": float(priced.overhead.max()),
    }


def total_steps(config, steps_per_epoch: int) -> int:
  """``config.num_train_steps`` if set, else ``num_epochs`` EdgeGossip epochs."""
  if config.get("num_train_steps"):
    return int(config.num_train_steps)
  return int(math.ceil(config.num_epochs * steps_per_epoch))
