"""Searching fusion plans that minimise eq. 7 (paper 000 §4.3).

Three searches over contiguous partitions of the leaves (in gradient-ready
order), all scored by a :class:`~gradcomp.sim.timeline.CostModel`:

* :func:`heuristic_search`, the paper's: grow the number of groups ``y`` one
  at a time; ``X_y`` is ``X_{y-1}`` with one group split in two, the split
  point of every group placed by binary search; stop when ``F(X_y)`` is worse
  than ``F(X_{y-1})`` or better by less than ``eps * F(X_{y-1})``. Plus its
  mirror image (merging from layer-wise) and a local search, because growth
  alone stalls.
* :func:`optimal_search`, the oracle: dynamic programming over prefixes
  ``[0, i)``. The timeline's state after a prefix is two clocks (compute
  ``K``, link ``L``) and the cost is monotone in both, so keeping, for every
  prefix, the Pareto front of ``(K, L)`` over its partitions is exact.
* :func:`brute_force_search`, over all ``2^(N-1)`` partitions, checks the DP
  in tests (``N <= 12``).

Each returns boundaries (starts of groups 2..y) and the predicted iteration
time; :func:`search_plan` wraps them into a :class:`Plan`.
"""

from __future__ import annotations

import itertools

import numpy as np

from gradcomp.fusion.plan import Plan
from gradcomp.sim.timeline import CostModel

METHODS = ("heuristic", "optimal", "layerwise", "single")


def _binary_search_splits(model: CostModel, boundaries: tuple[int, ...]):
  """For every group of ``boundaries``, the best place to split it in two.

  Binary search on the sign of ``F(p + 1) - F(p)`` over split positions ``p``
  inside each group (exact when ``F`` is unimodal in ``p``); all groups are
  searched together, one batched evaluation per halving.

  Returns:
    ``(candidates, seconds)``: one boundary tuple per splittable group and its
    predicted time.
  """
  cuts = (0, *boundaries, model.num_leaves)
  groups = [(s, e) for s, e in zip(cuts[:-1], cuts[1:], strict=True) if e - s > 1]
  if not groups:
    return [], np.array([])
  lo = np.array([s + 1 for s, _ in groups])
  hi = np.array([e - 1 for _, e in groups])
  base = np.array(boundaries, np.int64)

  def with_split(p):
    rows = np.concatenate([np.broadcast_to(base, (len(p), len(base))), p[:, None]], 1)
    return np.sort(rows, axis=1)

  while np.any(lo < hi):
    mid = (lo + hi) // 2
    left = model.iteration_seconds(with_split(mid))
    right = model.iteration_seconds(with_split(np.minimum(mid + 1, hi)))
    go_right = (right < left) & (lo < hi)
    stay = (~go_right) & (lo < hi)
    lo = np.where(go_right, mid + 1, lo)
    hi = np.where(stay, mid, hi)
  rows = with_split(lo)
  return [tuple(r.tolist()) for r in rows], model.iteration_seconds(rows)


def _grow(model: CostModel, eps: float) -> tuple[tuple[int, ...], float]:
  """Paper 000 §4.3: from one group, split one group per round (binary search)."""
  best = ()
  best_f = float(model.iteration_seconds(best)[0])
  while len(best) + 1 < model.num_leaves:
    candidates, seconds = _binary_search_splits(model, best)
    i = int(np.argmin(seconds))
    if not seconds[i] < best_f - eps * best_f:
      if seconds[i] < best_f:
        best, best_f = candidates[i], float(seconds[i])
      break
    best, best_f = candidates[i], float(seconds[i])
  return best, best_f


def _merge(model: CostModel) -> tuple[tuple[int, ...], float]:
  """The mirror image: from layer-wise, merge the best adjacent pair per round."""
  best = tuple(range(1, model.num_leaves))
  best_f = float(model.iteration_seconds(best)[0])
  while best:
    rows = np.array([best[:j] + best[j + 1 :] for j in range(len(best))], np.int64)
    seconds = model.iteration_seconds(rows.reshape(len(best), len(best) - 1))
    i = int(np.argmin(seconds))
    if not seconds[i] < best_f:
      break
    best, best_f = tuple(rows[i].tolist()), float(seconds[i])
  return best, best_f


def _between(cuts: list[int], k: int, n: int) -> range:
  """Positions boundary ``k`` of ``cuts`` may take without emptying a group."""
  return range((cuts[k - 1] if k else 0) + 1, cuts[k + 1] if k + 1 < len(cuts) else n)


def _moved(cuts: list[int], ks, n: int) -> list[list[int]]:
  """``cuts`` with one of the boundaries ``ks`` moved anywhere between its neighbours."""
  return [
    cuts[:k] + [q] + cuts[k + 1 :]
    for k in ks
    if 0 <= k < len(cuts)
    for q in _between(cuts, k, n)
    if q != cuts[k]
  ]


def _neighbours(cuts: list[int], n: int, compound: bool) -> list[list[int]]:
  """One boundary moved, removed or added; with ``compound``, added or removed
  *and* a neighbouring boundary moved (to leave a local optimum of the first)."""
  present = set(cuts)
  added = [sorted([*cuts, p]) for p in range(1, n) if p not in present]
  removed = [cuts[:j] + cuts[j + 1 :] for j in range(len(cuts))]
  if not compound:
    return _moved(cuts, range(len(cuts)), n) + added + removed
  rows = []
  for p, c in zip((p for p in range(1, n) if p not in present), added, strict=True):
    j = c.index(p)
    rows += _moved(c, (j - 1, j + 1), n)
  for j, c in enumerate(removed):
    rows += _moved(c, (j - 1, j), n)
  return rows


def _local_search(model: CostModel, boundaries, seconds: float):
  """Best-improvement descent over :func:`_neighbours`, one batch per size."""
  cuts, n = list(boundaries), model.num_leaves
  compound = False
  while True:
    best = None
    by_groups: dict[int, list[list[int]]] = {}
    for row in _neighbours(cuts, n, compound):
      by_groups.setdefault(len(row), []).append(row)
    for y, rows in by_groups.items():
      values = model.iteration_seconds(np.array(rows, np.int64).reshape(len(rows), y))
      i = int(np.argmin(values))
      if values[i] < seconds * (1 - 1e-12) and (best is None or values[i] < best[1]):
        best = (rows[i], float(values[i]))
    if best is None:
      if compound:
        return tuple(cuts), seconds
      compound = True
      continue
    (cuts, seconds), compound = best, False


def heuristic_search(
  model: CostModel, eps: float = 1e-3
) -> tuple[tuple[int, ...], float]:
  """The §4.3 heuristic: grow ``y``, place each new boundary by binary search.

  Starting from one group, each round splits every group at its
  binary-searched best point and keeps the best split; it stops when
  ``F(X_y)`` is worse than ``F(X_{y-1})`` or gains less than ``eps`` of it,
  and keeps the better of the two (the paper returns ``X_y``; we never return
  a plan worse than one seen). The same ``eps`` decides the result: when
  the better of one group and layer-wise is within ``eps`` of the plan found,
  that extreme is returned, so noise-level gains in a measured profile do not
  buy an irregular plan.

  Growing alone stalls where one split does not pay but several do: on
  ResNet-50 with a 0.2 ms per-call cost the optimum fuses each BatchNorm
  pair and keeps each conv kernel alone (about 60 groups), and growth from
  one group stopped at 2, 7 % above the optimum. Two additions, measured
  against the DP in ``BUILD_NOTES.md``: the mirror image, merging from
  layer-wise the adjacent pair that lowers ``F`` most until none does; then a
  local search from the better of the two (move, add or remove one boundary;
  when none helps, add or remove one and move a neighbour). Starting from
  the extremes, the result is never worse than layer-wise or single. Every
  step is one batched evaluation of ``O(N)`` candidates (``O(N^2 / y)`` for
  the compound moves): about 0.1 s for ResNet-50's 161 leaves.

  Args:
    model: the cost model.
    eps: relative gain below which growing ``y`` stops, in [0, 1).

  Returns:
    ``(boundaries, predicted iteration seconds)``.

  Examples:
    One worker (no exchange), no backward to overlap: the big leaf alone
    (0.2 + 4.194 ms), the three small ones fused (0.2 + 0.00024 ms), against
    5.443 ms for one group and 4.994 ms layer-wise.

    >>> import gradcomp
    >>> s = (16, 2**20)  # 0.2 ms per call, 4 ns per value (5 ns fused)
    >>> profile = gradcomp.sim.Profile(
    ...   "x", "hand-made", 1, s, [2e-4 + 4e-9 * x for x in s],
    ...   [2e-4 + 5e-9 * x for x in s], {"all-reduce": (64, 2**22)},
    ...   {"all-reduce": (1, 1)})
    >>> work = gradcomp.sim.Workload((2**20, 16, 16, 16), (0.0,) * 4)
    >>> model = gradcomp.sim.CostModel(profile, gradcomp.sim.Cluster(1), work)
    >>> boundaries, seconds = heuristic_search(model)
    >>> boundaries, round(seconds * 1e3, 4)
    ((1,), 4.5945)
  """
  if not 0 <= eps < 1:
    raise ValueError(f"eps must be in [0, 1), got {eps!r}")
  grown = _grow(model, eps)
  merged = _merge(model)
  found = _local_search(model, *min(grown, merged, key=lambda r: r[1]))
  # A partition must beat the two extremes by more than eps to be chosen:
  # where the model sees no real difference, the better extreme is simpler
  # (one group: fewest calls and collectives; layer-wise: ``inner`` as
  # written), and one group on a tie.
  extremes = [
    (float(model.iteration_seconds(b)[0]), b)
    for b in ((), tuple(range(1, model.num_leaves)))
  ]
  seconds, best = min(extremes, key=lambda e: e[0])
  return (best, seconds) if seconds <= found[1] * (1 + eps) else found


def optimal_search(model: CostModel) -> tuple[tuple[int, ...], float]:
  """The exact optimum of the timeline over contiguous partitions (the oracle).

  For every prefix end ``i`` it keeps the partitions of ``[0, i)`` whose
  clocks ``(K, L)`` no other partition beats in both; extending by a group
  ``[i, k)`` maps ``(K, L)`` to ``(K + b(i, k) + Comp, max(K', L) + Comm)``
  (``Comp + Comm`` and ``0`` on a cluster without overlap),
  monotone in both, so a dominated prefix never leads to the optimum.
  With several exchange forms (``CostModel.forms``) each form of a group is
  one more such extension, so the optimum is over partitions and forms
  together (:func:`search_plan` returns the forms in the plan).

  Returns:
    ``(boundaries, predicted iteration seconds)``.

  Examples:
    Eight workers on 10 Gbps, 1 ms of backward per leaf: the two small leaves
    ready first share a call, the big one and the last small one go alone,
    each exchanged while the backward pass goes on; one group and layer-wise
    take longer.

    >>> import gradcomp
    >>> s = (16, 2**20)  # 0.2 ms per call, 4 ns per value (5 ns fused)
    >>> profile = gradcomp.sim.Profile(
    ...   "x", "hand-made", 1, s, [2e-4 + 4e-9 * x for x in s],
    ...   [2e-4 + 5e-9 * x for x in s], {"all-reduce": (64, 2**22)},
    ...   {"all-reduce": (1, 1)})
    >>> work = gradcomp.sim.Workload((16, 16, 2**20, 16), (1e-3,) * 4)
    >>> cluster = gradcomp.sim.Cluster(8, bandwidth_gbps=10.0)
    >>> model = gradcomp.sim.CostModel(profile, cluster, work)
    >>> boundaries, seconds = optimal_search(model)
    >>> boundaries, round(seconds * 1e3, 3)
    ((2, 3), 14.167)
    >>> for name, b in [("single", ()), ("layerwise", (1, 2, 3))]:
    ...   print(name, round(float(model.iteration_seconds(b)[0]) * 1e3, 3))
    single 15.665
    layerwise 14.367
  """
  boundaries, _, seconds = _pareto_search(model)
  return boundaries, seconds


def _pareto_search(model: CostModel):
  """:func:`optimal_search`, over every form of each group when the model has
  several: each form is one more way to extend a prefix, so the fronts stay
  exact. Returns ``(boundaries, form indices or None, seconds)``."""
  n = model.num_leaves
  if model.forms is None:
    ways = [(model.stream, model.link)]
  else:
    ways = list(zip(model.form_stream, model.form_link, strict=True))
  start_clock = model.workload.forward_seconds
  # fronts[i]: arrays K, L, parent prefix end, parent index in its front, form.
  pending: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(n + 1)]
  pending[0].append(
    (
      np.array([start_clock]),
      np.array([0.0]),
      np.array([-1]),
      np.array([-1]),
      np.array([-1]),
    )
  )
  fronts: list[tuple[np.ndarray, ...] | None] = [None] * (n + 1)
  for i in range(n + 1):
    k_, l_, parent, index, form = (
      np.concatenate(parts) for parts in zip(*pending[i], strict=True)
    )
    order = np.lexsort((l_, k_))  # by K, then L
    k_, l_, parent, index, form = (a[order] for a in (k_, l_, parent, index, form))
    keep = l_ < np.minimum.accumulate(np.concatenate([[np.inf], l_[:-1]]))
    fronts[i] = (k_[keep], l_[keep], parent[keep], index[keep], form[keep])
    pending[i] = []
    if i == n:
      break
    k_f, l_f = fronts[i][0], fronts[i][1]
    ends = np.arange(i + 1, n + 1)
    work = model.backward_before[ends] - model.backward_before[i]
    members = np.arange(len(k_f))
    for f, (stream, link) in enumerate(ways):
      k_new = k_f[:, None] + work[None, :] + stream[i, ends][None, :]
      l_new = np.maximum(k_new, l_f[:, None]) + link[i, ends][None, :]
      for j, end in enumerate(ends):
        pending[end].append(
          (
            k_new[:, j],
            l_new[:, j],
            np.full(len(k_f), i),
            members,
            np.full(len(k_f), f),
          )
        )
  l_n = fronts[n][1]
  best = int(np.argmin(l_n))
  seconds = float(l_n[best]) + model.workload.update_seconds
  cuts, forms, at, member = [], [], n, best
  while at > 0:
    _, _, parent, index, form = fronts[at]
    forms.append(int(form[member]))
    at, member = int(parent[member]), int(index[member])
    if at > 0:
      cuts.append(at)
  forms = None if model.forms is None else tuple(reversed(forms))
  return tuple(reversed(cuts)), forms, seconds


def brute_force_search(model: CostModel) -> tuple[tuple[int, ...], float]:
  """Every contiguous partition scored; for checking the others (``N <= 16``)."""
  n = model.num_leaves
  if n > 16:
    raise ValueError(f"brute force over 2^{n - 1} partitions is too many (N <= 16)")
  best, best_f = (), float(model.iteration_seconds(())[0])
  for y in range(1, n):
    rows = np.array(list(itertools.combinations(range(1, n), y)), np.int64)
    seconds = model.iteration_seconds(rows)
    i = int(np.argmin(seconds))
    if seconds[i] < best_f:
      best, best_f = tuple(rows[i].tolist()), float(seconds[i])
  return best, best_f


def search_plan(
  model: CostModel, order, method: str = "heuristic", eps: float = 1e-3
) -> Plan:
  """The plan ``method`` chooses, over leaves in gradient-ready ``order``.

  Args:
    model: cost model whose workload lists the leaves in ``order``.
    order: leaf indices in gradient-ready order.
    method: ``"heuristic"`` (paper 000 §4.3), ``"optimal"`` (DP),
      ``"layerwise"`` or ``"single"``.
    eps: the heuristic's stopping tolerance.

  Returns:
    The :class:`Plan` of the chosen partition, its groups in ``order``; when
    ``model`` prices several exchange forms, each group's form
    (:meth:`CostModel.group_forms`) in :attr:`Plan.forms`.

  Examples:
    Leaves 3, 2, 1, 0 are ready in that order; leaf 3 holds 2^20 values and
    the others 16 each. The model lists the leaves in that order.

    >>> import gradcomp
    >>> s = (16, 2**20)  # 0.2 ms per call, 4 ns per value (5 ns fused)
    >>> profile = gradcomp.sim.Profile(
    ...   "x", "hand-made", 1, s, [2e-4 + 4e-9 * x for x in s],
    ...   [2e-4 + 5e-9 * x for x in s], {"all-reduce": (64, 2**22)},
    ...   {"all-reduce": (1, 1)})
    >>> work = gradcomp.sim.Workload((2**20, 16, 16, 16), (0.0,) * 4)
    >>> model = gradcomp.sim.CostModel(profile, gradcomp.sim.Cluster(1), work)
    >>> search_plan(model, (3, 2, 1, 0)).groups
    ((3,), (2, 1, 0))
    >>> search_plan(model, (3, 2, 1, 0), "single").groups
    ((3, 2, 1, 0),)
  """
  order = tuple(order)
  if len(order) != model.num_leaves:
    raise ValueError(f"order has {len(order)} leaves, the model {model.num_leaves}")
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  forms = None
  if method == "optimal":
    boundaries, indices, _ = _pareto_search(model)
    if indices is not None:
      forms = tuple(model.forms[i] for i in indices)
  elif method == "heuristic" and model.forms is not None:
    boundaries, forms = _heuristic_with_forms(model, eps)
  elif method == "heuristic":
    boundaries, _ = heuristic_search(model, eps)
  else:
    boundaries = tuple(range(1, len(order))) if method == "layerwise" else ()
    if model.forms is not None:
      forms, _ = model.best_forms(boundaries)
  return Plan.from_boundaries(order, boundaries).with_forms(forms)


def _heuristic_with_forms(model: CostModel, eps: float):
  """The heuristic with exchange forms: the partitions it finds with each
  group's least-``Comp + Comm`` form and with every form throughout, each
  given its forms by :meth:`CostModel.best_forms`; the fastest is kept (so
  never slower than one form throughout)."""
  candidates = [heuristic_search(model, eps)[0]]
  for form in model.forms:
    alone = CostModel(model.profile[form], model.cluster, model.workload)
    candidates.append(heuristic_search(alone, eps)[0])
  scored = [(model.best_forms(b), b) for b in dict.fromkeys(candidates)]
  (forms, _), boundaries = min(scored, key=lambda c: c[0][1])
  return boundaries, forms
