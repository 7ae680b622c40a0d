"""A wait-free-backprop timeline: iteration time of a compressor x fusion plan.

Paper 000 §4.3, eq. 7: ``F(X_y) = sum Comp(x_i) + sum Comm(x_i) + beta - sum
p(x_i)``, with ``beta`` the backward time and ``p(x_i)`` the part of group
``i``'s exchange hidden behind backprop (WFBP, paper 004 §2.5). Rather than
estimate ``p`` separately, the simulator plays the timeline out; eq. 7's
terms are then read off it. The model's choices:

* **Leaves become ready in gradient-ready order**, leaf ``j`` after its
  backward time ``b_j``: the compute stream runs the forward pass, then the
  backward of the leaves one after the other.
* **Compression shares the compute stream** (as on one GPU, and as on a CPU
  whose cores do both): when the last leaf of a group is ready, the group is
  compressed *and* decompressed there, ``Comp(x_i)`` from a measured
  :class:`~gradcomp.sim.profile.Profile`, delaying the backward of the
  following leaves. Eq. 7 likewise never hides ``Comp``.
* **One exchange at a time on the link**, in group order: group ``i``'s
  exchange starts when it is compressed and the link is free, and takes
  ``Comm(x_i)`` (``cluster.py``). On a cluster without ``overlap`` (virtual
  CPU devices: the same cores copy the bytes) the exchange runs on the
  compute stream right after the group's compression instead: ``Comm`` is
  then added to ``Comp`` below and the link term is zero.
* The optimizer update follows the last exchange.

With ``K_i`` the compute clock after group ``i`` is compressed and ``L_i``
the time its exchange ends::

  K_i = forward + sum_{j <= end_i} b_j + sum_{l <= i} Comp(x_l)
  L_i = max(K_i, L_{i-1}) + Comm(x_i)
  T   = L_y + update = max_i (K_i + sum_{l >= i} Comm(x_l)) + update

The scaling factor (paper 000 eq. 1) compares ``n`` workers with one worker
training alone (no compression, no exchange) at the same per-worker batch:
``T_1 / T_n``, i.e. throughput on ``n`` workers over ``n`` times that on one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from gradcomp.sim.cluster import Cluster
from gradcomp.sim.profile import Profile


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one worker computes per step, leaf by leaf in gradient-ready order.

  Attributes:
    sizes: values per leaf.
    backward_seconds: backward time that makes each leaf's gradient ready.
    forward_seconds: the forward pass, before the first leaf.
    update_seconds: the optimizer update, after the last exchange.

  Examples:
    >>> from gradcomp.sim import Workload
    >>> w = Workload(sizes=(100, 300), backward_seconds=(0.1, 0.3), forward_seconds=0.2)
    >>> round(w.single_worker_seconds, 6)  # T_1 = forward + backward + update
    0.6
    >>> w = Workload.from_weights((100, 300), weights=(1.0, 3.0), backward_seconds=0.4)
    >>> [round(b, 6) for b in w.backward_seconds], w.forward_seconds
    ([0.1, 0.3], 0.2)
  """

  sizes: tuple[int, ...]
  backward_seconds: tuple[float, ...]
  forward_seconds: float = 0.0
  update_seconds: float = 0.0

  def __post_init__(self):
    sizes = tuple(int(s) for s in self.sizes)
    backward = tuple(float(b) for b in self.backward_seconds)
    if not sizes or min(sizes) < 1:
      raise ValueError(f"sizes must list at least one leaf, each >= 1 value: {sizes}")
    if len(backward) != len(sizes):
      raise ValueError(
        f"backward_seconds has {len(backward)} entries for {len(sizes)} leaves"
      )
    for name, values in (
      ("backward_seconds", backward),
      ("forward_seconds", (self.forward_seconds,)),
      ("update_seconds", (self.update_seconds,)),
    ):
      if not all(np.isfinite(values)) or min(values) < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {values}")
    object.__setattr__(self, "sizes", sizes)
    object.__setattr__(self, "backward_seconds", backward)

  @classmethod
  def from_weights(
    cls,
    sizes: Sequence[int],
    weights: Sequence[float],
    backward_seconds: float,
    *,
    forward_seconds: float | None = None,
    update_seconds: float = 0.0,
  ) -> Workload:
    """A total backward time split over the leaves in proportion to ``weights``.

    Weights are usually each leaf's FLOPs (``shapes.forward_flops``). The
    forward pass defaults to half the backward (a backward computes gradients
    for both the inputs and the weights: about twice the forward's FLOPs).
    """
    w = np.asarray(weights, np.float64)
    if (
      w.shape != (len(sizes),)
      or not np.all(np.isfinite(w))
      or w.min() < 0
      or w.sum() <= 0
    ):
      raise ValueError("weights must be one finite value >= 0 per leaf, not all 0")
    return cls(
      sizes=tuple(sizes),
      backward_seconds=tuple(backward_seconds * w / w.sum()),
      forward_seconds=backward_seconds / 2
      if forward_seconds is None
      else forward_seconds,
      update_seconds=update_seconds,
    )

  @property
  def single_worker_seconds(self) -> float:
    """``T_1``: one worker alone, no compression and no exchange."""
    return self.forward_seconds + sum(self.backward_seconds) + self.update_seconds


@dataclasses.dataclass(frozen=True)
class Timeline:
  """One simulated iteration (times in seconds from the start of the forward).

  Attributes:
    iteration_seconds: ``T_n``.
    scaling_factor: ``T_1 / T_n`` (paper 000 eq. 1).
    groups: per group ``(start, end)`` positions in gradient-ready order.
    ready, compressed, comm_start, comm_end: per group.
    comp_seconds, comm_seconds: per group ``Comp(x_i)`` and ``Comm(x_i)``.
    backward_seconds: ``beta``.
    overlap_seconds: ``sum p(x_i)``, exchange time hidden behind backprop.
    forms: each group's exchange form, when the model prices several
      (:meth:`CostModel.group_forms`); ``None`` otherwise.

  Examples:
    Two leaves of 1 s of backward each, compressed in 0.1 s and exchanged in
    1 s per group: leaf 0's exchange (1.1 s to 2.1 s) hides behind leaf 1's
    backward, leaf 1's starts when it is compressed at 2.2 s.

    >>> from gradcomp.sim import Cluster, CostModel, Profile, Workload
    >>> p = Profile(compressor="none()", backend="synthetic", devices=1,
    ...             sizes=(10**6, 2 * 10**6), seconds=(0.1, 0.1),
    ...             fused_seconds=(0.1, 0.1), wire_bytes={"all-reduce": (4e6, 8e6)},
    ...             wire_messages={"all-reduce": (1, 1)})
    >>> c = Cluster(2, bandwidth_gbps=0.032, latency_us=0.0)  # 4 MB/s: 4e6 bytes in 1 s
    >>> w = Workload(sizes=(10**6, 10**6), backward_seconds=(1.0, 1.0))
    >>> t = CostModel(p, c, w).timeline((1,))  # two groups: [0, 1) and [1, 2)
    >>> t.groups
    ((0, 1), (1, 2))
    >>> [round(s, 6) for s in t.comm_start], [round(e, 6) for e in t.comm_end]
    ([1.1, 2.2], [2.1, 3.2])
    >>> round(t.iteration_seconds, 6), round(t.overlap_seconds, 6)
    (3.2, 1.0)
    >>> round(t.scaling_factor, 6)  # T_1 / T_n = 2 / 3.2
    0.625
  """

  iteration_seconds: float
  scaling_factor: float
  groups: tuple[tuple[int, int], ...]
  ready: tuple[float, ...]
  compressed: tuple[float, ...]
  comm_start: tuple[float, ...]
  comm_end: tuple[float, ...]
  comp_seconds: tuple[float, ...]
  comm_seconds: tuple[float, ...]
  backward_seconds: float
  overlap_seconds: float
  forms: tuple[str, ...] | None = None


class CostModel:
  """Eq. 7 for one compressor profile, cluster and workload.

  Groups are runs ``[start, end)`` of leaf positions in gradient-ready order;
  a partition is given by its boundaries (the starts of groups 2..y).
  ``Comp`` and ``Comm`` of every possible group are tabulated once, so a
  partition costs a handful of array operations and many partitions can be
  evaluated at once (:meth:`iteration_seconds`).

  ``profile`` may map exchange forms to profiles, e.g. ``{"gather": p,
  "scatter": q}`` for a quantizing codec's two forms: every
  possible group is then priced in each form and takes the one of least
  ``Comp + Comm`` (:meth:`group_forms`), so a plan may gather its small
  groups (one latency per peer, small payloads) and scatter its large ones
  (link bytes about twice the payload, whatever the worker count).

  Examples:
    Two leaves of 1 s of backward each, ``Comp = 0.1 s`` per group and
    ``Comm = 1 s`` per leaf's 4 MB. One group: ``2 + 0.1 + 2 = 4.1 s``; two
    groups: leaf 0's exchange hides behind leaf 1's backward, ``2 + 0.1 +
    0.1 + 1 = 3.2 s``; on the compute stream (no ``overlap``) nothing
    hides: ``2 + 2 * (0.1 + 1) = 4.2 s``.

    >>> from gradcomp.sim import Cluster, CostModel, Profile, Workload
    >>> p = Profile(compressor="none()", backend="synthetic", devices=1,
    ...             sizes=(10**6, 2 * 10**6), seconds=(0.1, 0.1),
    ...             fused_seconds=(0.1, 0.1), wire_bytes={"all-reduce": (4e6, 8e6)},
    ...             wire_messages={"all-reduce": (1, 1)})
    >>> c = Cluster(2, bandwidth_gbps=0.032, latency_us=0.0)  # 4 MB/s: 4e6 bytes in 1 s
    >>> w = Workload(sizes=(10**6, 10**6), backward_seconds=(1.0, 1.0))
    >>> model = CostModel(p, c, w)
    >>> [round(float(model.iteration_seconds(b)[0]), 6) for b in [(), (1,)]]
    [4.1, 3.2]
    >>> serial = Cluster(2, bandwidth_gbps=0.032, latency_us=0.0, overlap=False)
    >>> CostModel(p, serial, w).iteration_seconds((1,)).round(6).tolist()
    [4.2]

    Two forms: one that sends half the bytes but compresses in 0.7 s wins
    the fused group of 2 * 10^6 values (0.7 + 1 s against 0.1 + 2 s), not a
    group of one leaf (0.7 + 0.5 s against 0.1 + 1 s).

    >>> half = dataclasses.replace(p, seconds=(0.7, 0.7),
    ...   fused_seconds=(0.7, 0.7), wire_bytes={"all-reduce": (2e6, 4e6)})
    >>> both = CostModel({"gather": p, "scatter": half}, c, w)
    >>> both.group_forms(()), both.group_forms((1,))
    (('scatter',), ('gather', 'gather'))
    >>> [round(float(both.iteration_seconds(b)[0]), 6) for b in [(), (1,)]]
    [3.7, 3.2]
  """

  def __init__(
    self,
    profile: Profile | Mapping[str, Profile],
    cluster: Cluster,
    workload: Workload,
  ):
    if isinstance(profile, Mapping):
      if not profile or not all(isinstance(p, Profile) for p in profile.values()):
        raise ValueError(
          "profile must be a Profile or a non-empty mapping of exchange forms "
          f"to Profiles, got {profile!r}"
        )
      self.forms: tuple[str, ...] | None = tuple(profile)
      profiles = tuple(profile.values())
    else:
      self.forms, profiles = None, (profile,)
    for p in profiles:  # a profile priced on two link classes fits one shape
      p.check_cluster(cluster)
    self.profile, self.cluster, self.workload = profile, cluster, workload
    n = len(workload.sizes)
    self.num_leaves = n
    self.values_before = np.concatenate([[0], np.cumsum(workload.sizes)])
    self.backward_before = np.concatenate([[0.0], np.cumsum(workload.backward_seconds)])
    start, end = np.triu_indices(n + 1, k=1)
    size = self.values_before[end] - self.values_before[start]
    comp = np.stack([p.comp_seconds(size, fused=(end - start) > 1) for p in profiles])
    comm = np.stack([cluster.comm_seconds(p.wire(size)) for p in profiles])
    # Per form f, group [i, j): form_comp[f, i, j] and form_comm[f, i, j];
    # what it holds the compute stream and the link for (on a cluster
    # without overlap the exchange runs on the compute stream).
    shape = (len(profiles), n + 1, n + 1)
    self.form_comp, self.form_comm = np.full(shape, np.inf), np.full(shape, np.inf)
    self.form_comp[:, start, end], self.form_comm[:, start, end] = comp, comm
    if cluster.overlap:
      self.form_stream, self.form_link = self.form_comp, self.form_comm
    else:
      self.form_stream = self.form_comp + self.form_comm
      self.form_link = np.where(np.isinf(self.form_comm), np.inf, 0.0)
    # By default each group takes the form of least Comp + Comm (exact
    # without overlap; with it, :meth:`best_forms` and the searches weigh
    # what each form hides).
    self.form_index = np.zeros((n + 1, n + 1), np.int64)
    self.form_index[start, end] = np.argmin(comp + comm, axis=0)
    at = (self.form_index, *np.indices((n + 1, n + 1)))
    self.comp, self.comm = self.form_comp[at], self.form_comm[at]
    self.stream, self.link = self.form_stream[at], self.form_link[at]

  def _bounds(self, boundaries) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(boundaries, np.int64)
    b = b.reshape(b.shape[0], -1) if b.ndim == 2 else b.reshape(1, -1)
    m = b.shape[0]
    starts = np.concatenate([np.zeros((m, 1), np.int64), b], axis=1)
    ends = np.concatenate([b, np.full((m, 1), self.num_leaves, np.int64)], axis=1)
    return starts, ends

  def group_forms(self, boundaries) -> tuple[str, ...] | None:
    """Each group's form of least ``Comp + Comm`` (``None``: one profile)."""
    if self.forms is None:
      return None
    starts, ends = (a[0] for a in self._bounds(boundaries))
    return tuple(self.forms[i] for i in self.form_index[starts, ends])

  def form_indices(self, forms) -> np.ndarray:
    """Form names (one per group, or rows of them) as indices into :attr:`forms`."""
    if self.forms is None:
      raise ValueError("this model prices one profile: it has no exchange forms")
    names = np.asarray(forms, object)
    unknown = set(names.ravel()) - set(self.forms)
    if unknown:
      raise ValueError(f"forms {sorted(unknown)} are not among {self.forms}")
    return np.vectorize(self.forms.index, otypes=[np.int64])(names)

  def iteration_seconds(self, boundaries, forms=None) -> np.ndarray:
    """``T_n`` of each partition; ``boundaries`` is ``(y-1,)`` or ``(M, y-1)``.

    ``forms``: each group's form index (into :attr:`forms`), ``(y,)`` or
    ``(M, y)``; ``None``: the form of least ``Comp + Comm`` per group.

    Returns an array of shape ``(M,)`` (``(1,)`` for one partition).
    """
    starts, ends = self._bounds(boundaries)
    if forms is None:
      stream, link = self.stream[starts, ends], self.link[starts, ends]
    else:
      f = np.broadcast_to(np.asarray(forms, np.int64), starts.shape)
      stream, link = self.form_stream[f, starts, ends], self.form_link[f, starts, ends]
    compressed = (
      self.workload.forward_seconds
      + self.backward_before[ends]
      + np.cumsum(stream, axis=1)
    )
    comm_after = np.cumsum(link[:, ::-1], axis=1)[:, ::-1]
    return (compressed + comm_after).max(axis=1) + self.workload.update_seconds

  def best_forms(self, boundaries) -> tuple[tuple[str, ...], float]:
    """The groups' forms for one partition, by descent, and ``T_n`` with them.

    From the least-``Comp + Comm`` choice and from every form throughout,
    the best single-group change of form is made until none lowers ``T_n``
    (one batched evaluation per round); the best end point is returned.
    With overlap this weighs what each form hides behind the backward pass.

    Raises:
      ValueError: for a model of one profile.
    """
    if self.forms is None:
      raise ValueError("this model prices one profile: it has no exchange forms")
    b = np.asarray(boundaries, np.int64).reshape(-1)
    y, kinds = len(b) + 1, len(self.forms)
    starts, ends = (a[0] for a in self._bounds(b))
    starts_points = [self.form_index[starts, ends]] + [
      np.full(y, f, np.int64) for f in range(kinds)
    ]
    best, best_t = None, np.inf
    for f in starts_points:
      t = float(self.iteration_seconds(b, f)[0])
      while kinds > 1:
        rows = np.repeat(f[None], y * (kinds - 1), axis=0)
        group = np.repeat(np.arange(y), kinds - 1)
        rows[np.arange(len(rows)), group] = (
          f[group] + np.tile(np.arange(1, kinds), y)
        ) % kinds
        seconds = self.iteration_seconds(np.broadcast_to(b, (len(rows), len(b))), rows)
        i = int(np.argmin(seconds))
        if not seconds[i] < t * (1 - 1e-12):
          break
        f, t = rows[i], float(seconds[i])
      if t < best_t:
        best, best_t = f, t
    return tuple(self.forms[i] for i in best), best_t

  def timeline(self, plan_or_boundaries) -> Timeline:
    """The detailed timeline of one partition (a :class:`~gradcomp.fusion.plan.Plan` or boundaries).

    A plan's own :attr:`~gradcomp.fusion.plan.Plan.forms` are priced when it
    has them; otherwise each group's form of least ``Comp + Comm``.
    """
    boundaries = (
      plan_or_boundaries.boundaries
      if hasattr(plan_or_boundaries, "boundaries")
      else tuple(plan_or_boundaries)
    )
    starts, ends = (a[0] for a in self._bounds(boundaries))
    named = getattr(plan_or_boundaries, "forms", None)
    if self.forms is None:
      forms, f = None, None
    elif named is None:
      forms, f = self.group_forms(boundaries), self.form_index[starts, ends]
    else:
      forms, f = tuple(named), self.form_indices(named)
    comp = self.comp[starts, ends] if f is None else self.form_comp[f, starts, ends]
    comm = self.comm[starts, ends] if f is None else self.form_comm[f, starts, ends]
    stream = (
      self.stream[starts, ends] if f is None else self.form_stream[f, starts, ends]
    )
    w = self.workload
    ready = (
      w.forward_seconds
      + self.backward_before[ends]
      + np.concatenate([[0.0], np.cumsum(stream)[:-1]])
    )
    compressed = ready + comp
    comm_start, comm_end, link = [], [], 0.0
    for i in range(len(starts)):
      comm_start.append(max(compressed[i], link))
      link = comm_start[-1] + comm[i]
      comm_end.append(link)
    backward_end = compressed[-1]
    # On the compute stream an exchange delays the backward: nothing is hidden.
    hidden = self.cluster.overlap * sum(
      max(0.0, min(e, backward_end) - s)
      for s, e in zip(comm_start, comm_end, strict=True)
    )
    total = link + w.update_seconds
    return Timeline(
      iteration_seconds=float(total),
      scaling_factor=float(w.single_worker_seconds / total) if total > 0 else 1.0,
      groups=tuple(zip(starts.tolist(), ends.tolist(), strict=True)),
      ready=tuple(ready.tolist()),
      compressed=tuple(compressed.tolist()),
      comm_start=tuple(float(s) for s in comm_start),
      comm_end=tuple(float(e) for e in comm_end),
      comp_seconds=tuple(comp.tolist()),
      comm_seconds=tuple(comm.tolist()),
      backward_seconds=float(sum(w.backward_seconds)),
      overlap_seconds=float(hidden),
      forms=forms,
    )
