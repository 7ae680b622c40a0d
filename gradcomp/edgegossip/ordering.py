"""The accuracy-aware trainer's choice of data (paper 002 §3.4, Algorithm 2).

Each epoch, on platform ``i``: score each aggregated point ``a_m`` by the
current model's loss ``e_m`` (line 1, :func:`subset_losses`), rank the
subsets highest loss first (lines 2-3, :func:`rank_subsets`) and train on
batches of whole subsets, in that order, until ``r_i |X_i|`` samples are
processed (lines 4-16; ``r_i`` from :func:`~gradcomp.edgegossip.balancer.balance`).
:func:`random_ranking` is the ablation the paper implies and never runs: the
same budget rule on subsets in a random order.

:func:`plan_epoch` returns the epoch as fixed-shape arrays for an SPMD step,
``indices`` and ``mask`` of shape ``(steps, batch_size)``: row ``s`` is the
platform's batch at step ``s``; masked entries are padding (index 0). Every
worker steps the same number of times (:func:`stack_plans` pads plans to a
common ``steps``); a worker past its budget has fully masked rows, and the
training step leaves its parameters and optimizer state unchanged there.

Readings (what the paper leaves open):

* **Index bugs.** Algorithm 2's inner ``for`` breaks before ``i++``, so the
  next batch would start with the subset just used, and the ``while`` never
  ends once the subsets run out. We continue from the next subset and stop
  when they run out.
* **Stop rule.** Subsets are taken whole, in rank order, while fewer than
  ``budget = r_i |X_i|`` samples are taken: the shortest ranked prefix with at
  least ``budget`` samples (:func:`select_subsets`), so ``budget <= taken <
  budget + |last subset|``. The printed ``while (b_processed <= |X_i| r_i)``
  would run one more batch when the budget is met exactly, and finish the
  batch that crosses it (up to a batch over); we stop at the subset.
* **Batch shape.** Algorithm 2 grows a batch until it holds at least ``b``
  samples (line 10), so its batches vary in size; a compiled step needs a
  fixed one. ``layout="whole"`` (default) keeps batches of whole subsets:
  each row takes subsets in order while they fit in ``batch_size`` and is
  padded when the next one does not (a subset larger than a row is split
  across rows). ``layout="packed"`` fills rows of exactly ``batch_size``
  samples from the ranked sequence (subsets may straddle two rows), padding
  only the last row: GoSGD's batch size, the same samples.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

#: §4.1: "the batch size ... set to ... 64".
DEFAULT_BATCH_SIZE = 64
LAYOUTS = ("whole", "packed")


def _check_int(name: str, value, low: int) -> int:
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True, eq=False)
class EpochPlan:
  """One platform's epoch as fixed-shape arrays (Algorithm 2, lines 4-16).

  Attributes:
    indices: ``(steps, batch_size)`` int32 sample indices into the platform's
      data; 0 where masked.
    mask: ``(steps, batch_size)`` bool, true where ``indices`` is a sample to
      train on.
    subsets: ``(S,)`` int64, the subsets processed, in processing order.
    budget: ``r_i |X_i|``, the samples asked for.

  Examples:
    A budget of 5 takes the two highest-loss subsets (2 + 3 samples), one row
    each; a third, padding row is asked for:

    >>> import numpy as np
    >>> subsets = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6, 7])]
    >>> plan = plan_epoch(subsets, [1, 2, 0], 5, batch_size=4, steps=3)
    >>> plan.subsets.tolist(), plan.samples, plan.steps, plan.active_steps
    ([1, 2], 5, 3, 2)
  """

  indices: np.ndarray
  mask: np.ndarray
  subsets: np.ndarray
  budget: float

  @property
  def samples(self) -> int:
    """Samples processed this epoch (``b_processed`` at the end)."""
    return int(self.mask.sum())

  @property
  def steps(self) -> int:
    return int(self.indices.shape[0])

  @property
  def active_steps(self) -> int:
    """Rows with at least one sample: the steps this platform really trains."""
    return int(self.mask.any(axis=1).sum())


def subset_losses(
  points: ArrayLike,
  labels: ArrayLike,
  loss_fn: Callable[[np.ndarray, np.ndarray], ArrayLike],
) -> np.ndarray:
  """Algorithm 2, line 1: each aggregated point's loss under the current model.

  Args:
    points: ``(M, ...)`` aggregated points (``Aggregation.points``, reshaped
      as the model wants).
    labels: ``(M,)`` their classes.
    loss_fn: ``loss_fn(points, labels)`` -> ``(M,)`` per-point losses (e.g.
      the cross-entropy of the current parameters, evaluated in batches).

  Returns:
    ``(M,)`` float64 finite losses ``e_m``.

  Examples:
    A squared error as the model's loss: the point of label 0 at 1.0 is the
    worst, ranked first.

    >>> import numpy as np
    >>> points, labels = np.array([[0.5], [0.25], [1.0]]), np.array([1, 0, 0])
    >>> losses = subset_losses(points, labels, lambda p, y: (p[:, 0] - y) ** 2)
    >>> losses.tolist(), rank_subsets(losses).tolist()
    ([0.25, 0.0625, 1.0], [2, 0, 1])
  """
  points = np.asarray(points)
  labels = np.asarray(labels)
  losses = np.asarray(loss_fn(points, labels), dtype=np.float64)
  m = labels.shape[0]
  if losses.shape != (m,):
    raise ValueError(f"loss_fn must return shape ({m},), got {losses.shape}")
  if not np.all(np.isfinite(losses)):
    raise ValueError("loss_fn must return finite losses, got NaN or inf")
  return losses


def rank_subsets(losses: ArrayLike) -> np.ndarray:
  """Algorithm 2, lines 2-3: subsets by descending loss (ties: lower index first).

  Args:
    losses: ``(M,)`` finite per-subset losses ``e_m``.

  Returns:
    ``(M,)`` int64 permutation, highest loss first.

  Examples:
    >>> rank_subsets([0.1, 2.0, 0.5, 2.0]).tolist()
    [1, 3, 2, 0]
  """
  e = np.asarray(losses, dtype=np.float64)
  if e.ndim != 1 or not np.all(np.isfinite(e)):
    raise ValueError(f"losses must be a finite 1-D array, got shape {e.shape}")
  return np.argsort(-e, kind="stable").astype(np.int64)


def random_ranking(num_subsets: int, seed: int) -> np.ndarray:
  """The ablation's order: a uniformly random permutation of the subsets, seeded.

  Examples:
    >>> sorted(random_ranking(4, seed=0).tolist())
    [0, 1, 2, 3]
  """
  num_subsets = _check_int("num_subsets", num_subsets, 0)
  seed = _check_int("seed", seed, 0)
  return np.random.default_rng(seed).permutation(num_subsets).astype(np.int64)


def _check_order(order: ArrayLike, m: int) -> np.ndarray:
  o = np.asarray(order)
  if (
    o.shape != (m,)
    or o.dtype.kind not in "iu"
    or not np.array_equal(np.sort(o), np.arange(m))
  ):
    raise ValueError(f"order must be a permutation of range({m}), got {o!r}")
  return o.astype(np.int64)


def _check_budget(budget, total: int) -> float:
  ok = isinstance(budget, numbers.Real) and not isinstance(budget, bool)
  if not ok or not 0.0 <= float(budget) <= total:
    raise ValueError(
      f"budget must be in [0, {total}] (the platform's samples), got {budget!r}"
    )
  return float(budget)


def select_subsets(order: ArrayLike, sizes: ArrayLike, budget: float) -> np.ndarray:
  """The shortest prefix of ``order`` holding at least ``budget`` samples.

  Args:
    order: ``(M,)`` permutation of the subsets, first processed first.
    sizes: ``(M,)`` subset sizes ``|X_m|`` >= 1.
    budget: ``r_i |X_i|`` in ``[0, sum(sizes)]``.

  Returns:
    ``(S,)`` int64 subsets, in order; ``budget <= sum(sizes[chosen]) <
    budget + sizes[chosen[-1]]`` (none when ``budget == 0``).

  Examples:
    >>> select_subsets([2, 0, 1], [5, 5, 10], 12.0).tolist()
    [2, 0]
  """
  s = np.asarray(sizes)
  if s.ndim != 1 or s.dtype.kind not in "iu" or np.any(s < 1):
    raise ValueError(f"sizes must be a 1-D integer array >= 1, got {s!r}")
  o = _check_order(order, s.size)
  budget = _check_budget(budget, int(s.sum()))
  if budget == 0.0:
    return o[:0]
  cum = np.cumsum(s[o])
  return o[: int(np.searchsorted(cum, budget, side="left")) + 1]


def plan_epoch(
  subsets: Sequence[ArrayLike],
  order: ArrayLike,
  budget: float,
  *,
  batch_size: int = DEFAULT_BATCH_SIZE,
  steps: int | None = None,
  layout: str = "whole",
) -> EpochPlan:
  """Algorithm 2, lines 4-16, as fixed-shape batches (module docstring).

  Args:
    subsets: ``M`` disjoint 1-D arrays of sample indices, one per subset
      (``Aggregation.subsets()``).
    order: ``(M,)`` processing order: :func:`rank_subsets` of the losses, or
      :func:`random_ranking` for the ablation.
    budget: ``r_i |X_i|`` samples, in ``[0, total samples]``
      (``Balance.budgets``).
    batch_size: a row's capacity ``b``, >= 1 (§4.1: 64).
    steps: rows of the result, >= the rows this plan needs; ``None`` for
      exactly those.
    layout: ``"whole"`` (rows of whole subsets) or ``"packed"`` (full rows).

  Returns:
    The :class:`EpochPlan`.

  Examples:
    >>> subsets = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6, 7])]
    >>> plan = plan_epoch(subsets, rank_subsets([0.2, 0.9, 0.5]), 5, batch_size=4)
    >>> plan.indices.tolist(), plan.mask.sum(axis=1).tolist()
    ([[3, 4, 0, 0], [5, 6, 7, 0]], [2, 3])
  """
  members = [np.asarray(s) for s in subsets]
  for m, s in enumerate(members):
    if s.ndim != 1 or s.size == 0 or s.dtype.kind not in "iu" or np.any(s < 0):
      raise ValueError(
        f"subsets[{m}] must be a non-empty 1-D array of indices >= 0, got {s!r}"
      )
  flat = np.concatenate(members) if members else np.zeros(0, np.int64)
  if np.unique(flat).size != flat.size:
    raise ValueError("subsets must be disjoint, got a sample in two subsets")
  if flat.size and flat.max() > np.iinfo(np.int32).max:
    raise ValueError(f"sample indices must fit int32, got {flat.max()}")
  batch_size = _check_int("batch_size", batch_size, 1)
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  sizes = np.array([s.size for s in members], dtype=np.int64)
  chosen = select_subsets(order, sizes, budget)

  starts = np.empty(chosen.size, dtype=np.int64)
  pos = 0
  for j, c in enumerate(chosen):
    n = int(sizes[c])
    col = pos % batch_size
    if layout == "whole" and col and col + n > batch_size:
      pos += batch_size - col  # close the row: the subset does not fit
    starts[j] = pos
    pos += n
  rows = math.ceil(pos / batch_size)
  if steps is None:
    steps = rows
  elif _check_int("steps", steps, 0) < rows:
    raise ValueError(f"steps must be >= {rows} (the rows this plan needs), got {steps}")

  indices = np.zeros(steps * batch_size, dtype=np.int32)
  mask = np.zeros(steps * batch_size, dtype=bool)
  if chosen.size:
    n = sizes[chosen]
    where = np.repeat(starts - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    indices[where] = np.concatenate([members[c] for c in chosen])
    mask[where] = True
  return EpochPlan(
    indices=indices.reshape(steps, batch_size),
    mask=mask.reshape(steps, batch_size),
    subsets=chosen,
    budget=float(budget),
  )


def stack_plans(
  plans: Sequence[EpochPlan], steps: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Every platform's plan on a common number of steps, for one SPMD epoch.

  Args:
    plans: one :class:`EpochPlan` per worker, all of one ``batch_size``.
    steps: the common number of steps, >= every plan's active rows; ``None``
      for the most any plan needs.

  Returns:
    ``(indices, mask)``, each ``(workers, steps, batch_size)``; the added rows
    are masked.

  Examples:
    Worker 0 needs 3 rows for its 8 samples, worker 1 one row for 2: worker
    1 gets two fully masked rows (it does not train in steps 1 and 2).

    >>> import numpy as np
    >>> subsets = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6, 7])]
    >>> plans = [plan_epoch(subsets, [1, 2, 0], b, batch_size=4) for b in (8, 2)]
    >>> indices, mask = stack_plans(plans)
    >>> indices.shape, mask.sum(axis=(1, 2)).tolist(), mask.any(axis=2).tolist()
    ((2, 3, 4), [8, 2], [[True, True, True], [True, False, False]])
  """
  if not plans:
    raise ValueError("plans must hold at least one EpochPlan, got none")
  widths = {p.indices.shape[1] for p in plans}
  if len(widths) != 1:
    raise ValueError(f"plans must share one batch_size, got {sorted(widths)}")
  (width,) = widths
  need = max(int(np.flatnonzero(p.mask.any(axis=1)).max(initial=-1)) + 1 for p in plans)
  if steps is None:
    steps = need
  elif _check_int("steps", steps, 0) < need:
    raise ValueError(f"steps must be >= {need} (the rows the plans need), got {steps}")
  indices = np.zeros((len(plans), steps, width), dtype=np.int32)
  mask = np.zeros((len(plans), steps, width), dtype=bool)
  for w, p in enumerate(plans):
    rows = min(p.steps, steps)
    indices[w, :rows] = p.indices[:rows]
    mask[w, :rows] = p.mask[:rows]
  return indices, mask
