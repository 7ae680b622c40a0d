"""Fusion plans: which gradient leaves LayerFusion compresses together.

Paper 000 §4.1 (Algorithm 2): LayerFusion divides the model ``X`` into ``y``
groups ``x_1, ..., x_y``; the tensors of a group are fused and compressed in one
call. Groups are contiguous in *gradient-ready order*, the order in which
backprop produces the gradients (paper 000 §4.3: wait-free backprop overlaps
the exchange of a group with the backward pass of the layers below it), so a
plan is a list of boundaries in that order. ``gradient_order.py`` derives the
order from the loss's computation;
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

from gradcomp.compressors.scatter import FORMS


def _is_index(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_order(order: Iterable[int], num_leaves: int | None = None) -> tuple[int, ...]:
  """``order`` as a tuple, checked to be a permutation of ``range(num_leaves)``.

  Args:
    order: leaf indices (of ``jax.tree.leaves``) in gradient-ready order.
    num_leaves: the number of leaves; ``len(order)`` when ``None``.

  Returns:
    ``tuple(order)``.

  Raises:
    ValueError: naming the index that is out of range, skipped or repeated.
  """
  order = tuple(order)
  n = len(order) if num_leaves is None else num_leaves
  if len(order) != n:
    raise ValueError(f"order has {len(order)} entries for {n} leaves: {order}")
  seen = set()
  for i in order:
    if not _is_index(i) or not 0 <= i < n:
      raise ValueError(f"order: leaf index {i!r} is out of range [0, {n})")
    if i in seen:
      raise ValueError(f"order: leaf {i} is repeated")
    seen.add(i)
  return order


@dataclasses.dataclass(frozen=True)
class Plan:
  """An immutable, JSON-serialisable fusion plan (paper 000 §4.1, Algorithm 2).

  ``groups`` lists contiguous groups of leaf indices (indices into
  ``jax.tree.leaves(params)``) in gradient-ready order: reading the groups one
  after the other gives :attr:`order`, the gradient-ready order of the leaves,
  and each group becomes one fused buffer. Every leaf appears in exactly one
  group; no group is empty.

  Attributes:
    groups: the groups, first-ready first.
    num_leaves: the number of leaves of the tree the plan is for.
    forms: ``None``, or one exchange form per group (``"gather"`` or
      ``"scatter"``, the ``exchange=`` keyword of the quantizing codecs)
      for ``layerfusion`` to build ``inner`` with; the cost model
      chooses them with ``layerfusion(..., exchange="auto")``.

  Examples:
    >>> plan = Plan.from_boundaries((2, 1, 0, 3), (1, 3))
    >>> plan.groups
    ((2,), (1, 0), (3,))
    >>> Plan.from_json(plan.to_json()) == plan
    True
    >>> mixed = plan.with_forms(("gather", "scatter", "gather"))
    >>> mixed.forms, Plan.from_json(mixed.to_json()) == mixed
    (('gather', 'scatter', 'gather'), True)
  """

  groups: tuple[tuple[int, ...], ...]
  num_leaves: int
  forms: tuple[str, ...] | None = None

  def __post_init__(self):
    if not _is_index(self.num_leaves) or self.num_leaves < 0:
      raise ValueError(f"num_leaves must be an integer >= 0, got {self.num_leaves!r}")
    try:
      groups = tuple(tuple(group) for group in self.groups)
    except TypeError:
      raise ValueError(
        f"groups must be a sequence of sequences of leaf indices, got {self.groups!r}"
      ) from None
    object.__setattr__(self, "groups", groups)
    n = self.num_leaves
    seen = {}
    for g, group in enumerate(groups):
      if not group:
        raise ValueError(f"group {g} is empty")
      for i in group:
        if not _is_index(i) or not 0 <= i < n:
          raise ValueError(
            f"group {g}: leaf index {i!r} is out of range [0, {n}) (num_leaves={n})"
          )
        if i in seen:
          raise ValueError(f"leaf {i} is repeated (groups {seen[i]} and {g})")
        seen[i] = g
    skipped = sorted(set(range(n)) - set(seen))
    if skipped:
      raise ValueError(f"leaves {skipped} are in no group (num_leaves={n})")
    if self.forms is not None:
      forms = tuple(self.forms) if isinstance(self.forms, list | tuple) else None
      if forms is None or len(forms) != len(groups):
        raise ValueError(
          f"forms must list one exchange form per group ({len(groups)}), "
          f"got {self.forms!r}"
        )
      for g, form in enumerate(forms):
        if form not in FORMS:
          raise ValueError(f"forms[{g}] must be one of {FORMS}, got {form!r}")
      object.__setattr__(self, "forms", forms)

  def with_forms(self, forms: Sequence[str] | None) -> Plan:
    """The same groups, exchanged in ``forms`` (one per group; ``None``: inner's own)."""
    return Plan(self.groups, self.num_leaves, None if forms is None else tuple(forms))

  @property
  def order(self) -> tuple[int, ...]:
    """The leaves in gradient-ready order: the groups read one after the other."""
    return tuple(i for group in self.groups for i in group)

  @property
  def boundaries(self) -> tuple[int, ...]:
    """Positions in :attr:`order` where groups 1, ..., y-1 start."""
    starts, position = [], 0
    for group in self.groups[:-1]:
      position += len(group)
      starts.append(position)
    return tuple(starts)

  def check_order(self, order: Sequence[int]) -> None:
    """Raises ``ValueError`` unless the groups are contiguous runs of ``order``.

    The plan's groups, read one after the other, must list the leaves exactly
    as ``order`` does (a fused buffer is laid out in gradient-ready order).
    """
    order = check_order(order)
    if len(order) != self.num_leaves:
      raise ValueError(
        f"the plan is for {self.num_leaves} leaves, order has {len(order)}"
      )
    position = 0
    for g, group in enumerate(self.groups):
      run = order[position : position + len(group)]
      if run != group:
        raise ValueError(
          f"groups are not contiguous in order: group {g} is {group}, but "
          f"order has {run} at positions {position}..{position + len(group) - 1}"
        )
      position += len(group)

  @classmethod
  def layerwise(cls, order: Iterable[int]) -> Plan:
    """One group per leaf: layer-wise compression (paper 000 §3.2)."""
    order = check_order(order)
    return cls(tuple((i,) for i in order), len(order))

  @classmethod
  def single(cls, order: Iterable[int]) -> Plan:
    """All leaves in one group: one buffer for the whole model."""
    order = check_order(order)
    return cls((order,) if order else (), len(order))

  @classmethod
  def from_boundaries(cls, order: Iterable[int], boundaries: Iterable[int]) -> Plan:
    """Groups cut from ``order`` where each boundary position starts a new group.

    Args:
      order: leaf indices in gradient-ready order.
      boundaries: strictly increasing positions in ``order``, each in
        ``[1, len(order) - 1]``: group ``j`` is ``order[b_{j-1}:b_j]`` with
        ``b_0 = 0`` and ``b_y = len(order)``. No boundaries give one group.

    Returns:
      The plan.

    Raises:
      ValueError: when ``order`` is not a permutation, or a boundary is out of
        range or not strictly increasing (which would make a group empty).
    """
    order = check_order(order)
    boundaries = tuple(boundaries)
    n = len(order)
    cuts = (0, *boundaries, n)
    for b in boundaries:
      if not _is_index(b) or not 0 <= b <= n:
        raise ValueError(f"boundary {b!r} is out of range [1, {n - 1}]")
    for j in range(len(cuts) - 1):
      if cuts[j + 1] <= cuts[j]:
        raise ValueError(
          f"group {j} is empty: boundaries must be strictly increasing in "
          f"[1, {n - 1}], got {boundaries}"
        )
    groups = tuple(order[cuts[j] : cuts[j + 1]] for j in range(len(cuts) - 1))
    return cls(groups, n)

  def to_json(self) -> str:
    """``{"num_leaves": n, "groups": [[...], ...]}``, and ``"forms"`` when set."""
    data = {"num_leaves": self.num_leaves, "groups": [list(g) for g in self.groups]}
    if self.forms is not None:
      data["forms"] = list(self.forms)
    return json.dumps(data)

  @classmethod
  def from_json(cls, text: str) -> Plan:
    """Inverse of :meth:`to_json`; the plan is validated again.

    Raises:
      ValueError: when ``text`` is not JSON, lacks a field, or is a bad plan.
    """
    data = json.loads(text)
    if not isinstance(data, dict) or set(data) - {"forms"} != {"num_leaves", "groups"}:
      raise ValueError(
        "a plan is a JSON object with the fields 'num_leaves' and 'groups' "
        f"(and optionally 'forms'), got {text[:200]!r}"
      )
    if not isinstance(data["groups"], list) or not all(
      isinstance(g, list) for g in data["groups"]
    ):
      raise ValueError(f"'groups' must be a list of lists, got {data['groups']!r}")
    return cls(
      tuple(tuple(g) for g in data["groups"]), data["num_leaves"], data.get("forms")
    )
