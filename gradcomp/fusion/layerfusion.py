"""LayerFusion: compress fused groups of leaves instead of each leaf on its own.

Paper 000 §3.2: compressing and exchanging every layer separately pays a fixed
cost per call (kernel launches, collective start-up), which dominates for the
many small tensors of a deep model; §4.1 (Algorithm 2): LayerFusion divides
the model into ``y`` groups and compresses each group's fused gradient in one
call. Shaped like ``optax.flatten(inner)`` and ``optax.partition``: the wrapper
concatenates the leaves of each group of a :class:`~gradcomp.fusion.plan.Plan`
into one buffer, hands ``inner`` the tuple of buffers, and splits the result
back. ``plan="auto"`` chooses the groups by the cost model of §4.3 (eq. 7):
a measured profile of ``inner`` (``profile.py``), a described cluster
(``cluster.py``), the wait-free-backprop timeline (``timeline.py``) and the
search (``fusion_search.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import axes, scopes
from gradcomp.compressors.scatter import FORMS, SCATTERED
from gradcomp.compressors.spec import spec_of
from gradcomp.fusion import profiling
from gradcomp.fusion import search as fusion_search
from gradcomp.fusion.fused import fused, fusion_transform
from gradcomp.fusion.plan import Plan, check_order
from gradcomp.sim.cluster import Cluster
from gradcomp.sim.profile import Profile
from gradcomp.sim.timeline import CostModel, Workload

PLAN_NAMES = ("layerwise", "single", "auto")


def auto_plan(
  sizes: Sequence[int],
  order: Sequence[int],
  profile: Profile | Mapping[str, Profile],
  cluster: Cluster,
  backward_seconds: float | Sequence[float] = 0.0,
  method: str = "heuristic",
) -> Plan:
  """The plan minimising eq. 7 for leaves of ``sizes`` (in tree order).

  Args:
    sizes: values per leaf, indexed like ``jax.tree.leaves``.
    order: the gradient-ready order of the leaves.
    profile: the compressor's measured profile, or ``{form: Profile}`` to
      choose each group's exchange form too (:attr:`Plan.forms`).
    cluster: the cluster to plan for.
    backward_seconds: the backward pass of one step: a total, split over the
      leaves in proportion to their size, or one time per leaf in ``order``.
    method: a :data:`fusion_search.METHODS` entry.

  Examples:
    A hand-made profile (0.2 ms per call, 4 ns per value, 5 ns fused) on one
    worker: the big leaf, ready first, goes alone; the three small ones share
    one call.

    >>> import gradcomp
    >>> s = (16, 2**20)
    >>> profile = gradcomp.sim.Profile(
    ...   "x", "hand-made", 1, s, [2e-4 + 4e-9 * x for x in s],
    ...   [2e-4 + 5e-9 * x for x in s], {"all-reduce": (64, 2**22)},
    ...   {"all-reduce": (1, 1)})
    >>> plan = auto_plan((16, 16, 16, 2**20), (3, 2, 1, 0), profile,
    ...                  gradcomp.sim.Cluster(1))
    >>> plan.groups
    ((3,), (2, 1, 0))
  """
  ordered = [max(int(sizes[i]), 1) for i in order]  # an empty leaf costs a call
  if np.ndim(backward_seconds) == 0:
    workload = Workload.from_weights(
      ordered, ordered, float(backward_seconds), forward_seconds=0.0
    )
  else:
    workload = Workload(tuple(ordered), tuple(backward_seconds))
  model = CostModel(profile, cluster, workload)
  return fusion_search.search_plan(model, order, method)


def in_forms(inner: optax.GradientTransformation):
  """``form -> inner`` built with ``exchange=form``: a codec's exchange forms.

  ``inner``'s own form is ``inner`` itself; the other form is built from its
  recorded arguments, with ``seed + 1`` where it has a seed, so its groups
  draw a stream of their own rather than repeat the first form's.

  Raises:
    ValueError: when ``inner`` is not a gradcomp compressor with an
      ``exchange=`` keyword (one of ``gradcomp.compressors.scatter.SCATTERED``).
  """
  spec = spec_of(inner)
  arguments = {} if spec is None else dict(spec.arguments)
  if "exchange" not in arguments:
    raise ValueError(
      "exchange forms per group need a gradcomp compressor with an exchange= "
      f"keyword (one of {SCATTERED}), got "
      f"{'a transformation gradcomp did not build' if spec is None else spec.name}"
    )

  def build(form: str) -> optax.GradientTransformation:
    if form == arguments["exchange"]:
      return inner
    seed = arguments.get("seed")
    other_stream = {} if seed is None else {"seed": seed + 1}
    return spec.build(exchange=form, **other_stream)

  return build


def _measured(tx, cluster: Cluster, per_leaf: bool = True) -> Profile:
  """``tx``'s profile for ``cluster``: its wire traced on the cluster's
  workers, a ``hierarchical`` one's lifted to its nodes (two link classes);
  its fused pieces timed in the form the plan will run (``per_leaf``)."""
  return profiling.profile_for(
    tx,
    workers=cluster.workers,
    workers_per_node=cluster.workers_per_node,
    per_leaf=per_leaf,
  )


def _form_profiles(inner, profile, cluster: Cluster) -> dict[str, Profile]:
  """``{form: profile}`` for ``exchange="auto"``: given, checked, or measured."""
  build = in_forms(inner)
  if profile is None:
    return {f: _measured(build(f), cluster) for f in FORMS}
  if not isinstance(profile, Mapping) or set(profile) != set(FORMS):
    raise ValueError(
      f'with exchange="auto", profile must map each form {FORMS} to its Profile, '
      f"got {profile!r}"
    )
  for form in FORMS:
    profile[form].check_for(build(form))
  return {f: profile[f] for f in FORMS}


def layerfusion(
  inner: optax.GradientTransformation,
  plan: str | Plan = "auto",
  *,
  order=None,
  cluster: Cluster | None = None,
  profile: Profile | Mapping[str, Profile] | None = None,
  backward_seconds: float | Sequence[float] = 0.0,
  search: str = "heuristic",
  exchange: str | None = None,
  per_leaf: bool | None = None,
) -> optax.GradientTransformation:
  """Applies ``inner`` to fused buffers, one per group of leaves.

  With groups ``x_1, ..., x_y`` of a plan (paper 000 §4.1, Algorithm 2), the
  update tree's leaves (``jax.tree.leaves``) are gathered group by group in
  gradient-ready order, each group's leaves are raveled and concatenated into
  one 1-D buffer, ``inner`` receives the tuple ``(buffer_1, ..., buffer_y)``
  (a tree with one leaf per group, so a gradcomp compressor treats each group
  as one unit of compression), and its output is split back into the original
  leaves with their exact shapes, dtypes and tree structure.

  .. math::
    u = \\operatorname{split}\\big(\\operatorname{inner}(
      [\\operatorname{concat}_{j \\in x_1} g_j, \\ldots,
       \\operatorname{concat}_{j \\in x_y} g_j])\\big)

  Dtypes: a fused buffer is float32; each leaf is cast to float32 on the way
  in and back to its own dtype on the way out. Mixed float32 / bfloat16 /
  float16 trees therefore fuse into one buffer, rather than being grouped by
  dtype (which would break the contiguous gradient-ready groups); gradcomp's
  compressors compute in float32 anyway. A group of a single leaf is passed
  to ``inner`` as it is (its own shape and dtype), so ``plan="layerwise"`` is
  exactly ``inner`` applied to the tree, also for shape-aware compressors
  (PowerSGD's matrices).

  Semantics: a compressor declares what fusion may change
  (``gradcomp.compressors.scopes``: per element, per leaf, per buffer). A
  per-leaf compressor with a per-leaf form (``powersgd``) keeps its published
  semantics inside the fused program: the form receives each group's leaves
  rather than their concatenation, treats every leaf as ``inner`` would alone,
  and batches and exchanges the group at once (PowerSGD: one ``(P, Q)`` per
  leaf, leaves of one matrix shape in one batched product and QR, one
  all-reduce of the group's ``P``'s and one of its ``Q``'s). It equals the
  layer-wise plan up to float32 summation order.

  Planning is static Python on the number of leaves, so the wrapper works
  inside ``jit``, ``shard_map`` and ``pmap``; ``init`` accepts
  ``jax.ShapeDtypeStruct`` params. ``params``, when given to ``update``, are
  fused the same way before ``inner`` sees them. When ``inner`` is a gradcomp
  compressor whose ``axis_name`` names several mesh axes, the unfused params
  are checked against it first (``gradcomp.compressors.axes``): a fused
  buffer varies over the union of its leaves' axes, which can hide one leaf
  sharded across ``axis_name``.

  Args:
    inner: the transformation (usually a gradcomp compressor) applied to the
      tuple of fused buffers.
    plan: ``"auto"`` (the default: the plan minimising eq. 7 of §4.3 under
      the cost model below), ``"layerwise"`` (one group per leaf, paper 000
      §3.2), ``"single"`` (all leaves in one buffer: e.g. a global top-k
      across layers), or an explicit :class:`Plan`.
    order: the gradient-ready order of the leaves (a permutation of their
      indices, e.g. from :func:`gradient_order`), used to build the
      ``"layerwise"`` and ``"single"`` plans; default: tree order. With a
      :class:`Plan`, the plan's own order is used and ``order``, if given,
      must agree with it. The buffers are passed to ``inner`` in this order,
      so a compressor's per-leaf PRNG streams follow the groups.
    cluster: for ``"auto"``: the cluster to plan for; default
      ``Cluster(workers=jax.device_count())`` (20 Gbps, 25 us: paper 000 §5's
      Ethernet), the same in ``init`` and inside the step.
    profile: for ``"auto"``: ``inner``'s measured :class:`Profile`; default:
      measured on this backend when the factory is called, once per process
      and compressor (``gradcomp.fusion.profile(inner)``, seconds to a minute).
    backward_seconds: for ``"auto"``: the step's backward time, a total split
      over the leaves in proportion to their size, or one time per leaf in
      gradient-ready order. The default 0 plans without overlap (compression
      and exchange after the backward pass).
    search: for ``"auto"``: ``"heuristic"`` (§4.3) or ``"optimal"`` (DP).
    exchange: ``None`` (the default): every group in ``inner``'s own
      exchange form; ``"auto"`` (with ``plan="auto"`` and a codec with an
      ``exchange=`` keyword): each group in the form the search chooses
      with the partition (the whole timeline weighed), all-gathered
      (``"gather"``) or reduce-scattered (``"scatter"``), with
      ``profile`` then ``{form: Profile}`` (default:
      both measured, their wire traced on the cluster's workers). Groups
      of one form go to that form's compressor as one tuple; the plan
      records the forms (:attr:`Plan.forms`), and an explicit plan with
      forms is applied the same way.
    per_leaf: ``None`` (the default): ``inner``'s per-leaf form when it
      declares scope ``"leaf"`` and has one (``scopes.per_leaf_form``:
      PowerSGD keeps one ``(P, Q)`` per leaf, leaves of one matrix shape
      batched), so the fused program computes the published per-leaf
      algorithm; else fused buffers. ``True``: require the per-leaf form.
      ``False``: every group is one buffer, one unit of compression, whatever
      ``inner`` declares (the seed's fused form, e.g. PowerSGD of one
      near-square matrix per group). Plans
      with exchange forms always use fused buffers.

  The ``"auto"`` plan is computed from static shapes the first time a tree
  structure is seen (in ``init``), so it works inside ``jit``, ``shard_map``
  and ``pmap``; it is deterministic for a given profile.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`LayerFusionState`.

  Raises:
    ValueError: for an unknown plan name or ``exchange``, a profile
      measured for another compressor, ``exchange="auto"`` without
      ``plan="auto"`` or with a compressor that has one form, an
      ``"auto"`` plan of a transformation gradcomp did not build without
      a profile, ``per_leaf=True`` for a compressor without a per-leaf
      form, a bad ``order``, an ``order`` the
      plan's groups are not contiguous in, or (at ``init`` / ``update``) a
      plan or order made for a different number of leaves.

  Examples:
    >>> import jax.numpy as jnp, gradcomp
    >>> tx = layerfusion(gradcomp.topk(0.25), "single")
    >>> grads = {"a": jnp.array([4.0, -1.0]), "b": jnp.array([0.5, -3.0])}
    >>> updates, _ = tx.update(grads, tx.init(grads))
    >>> updates["a"].tolist(), updates["b"].tolist()
    ([4.0, 0.0], [0.0, 0.0])

  References:
    Paper 000 §3.2, §4.1 (Algorithm 2), §4.3 (eq. 7).
  """
  if order is not None:
    order = check_order(order)
  if isinstance(plan, str):
    if plan not in PLAN_NAMES:
      raise ValueError(f"plan must be one of {PLAN_NAMES} or a Plan, got {plan!r}")
  elif isinstance(plan, Plan):
    if order is not None:
      plan.check_order(order)
  else:
    raise ValueError(
      f"plan must be one of {PLAN_NAMES} or a Plan, got {type(plan).__name__}"
    )

  if search not in fusion_search.METHODS:
    raise ValueError(f"search must be one of {fusion_search.METHODS}, got {search!r}")
  if exchange not in (None, "auto"):
    raise ValueError(f'exchange must be None or "auto", got {exchange!r}')
  if exchange == "auto" and plan != "auto":
    raise ValueError(
      f'exchange="auto" chooses forms with the cost model: it needs plan="auto", '
      f"got plan={plan!r}"
    )
  if per_leaf not in (None, True, False):
    raise ValueError(f"per_leaf must be None, True or False, got {per_leaf!r}")
  leaf_form = None if per_leaf is False else scopes.per_leaf_form(inner)
  if per_leaf is True and leaf_form is None:
    raise ValueError(
      "per_leaf=True needs a compressor with a per-leaf form under fusion "
      f"(scope {scopes.scope_of(inner)!r}; see scopes.per_leaf_form)"
    )
  spec = spec_of(inner)
  if isinstance(plan, Plan):
    forms = None if plan.forms is None else in_forms(inner)
    return _checked(fused(inner, plan, forms, leaf_form), inner)
  # Only an "auto" plan needs the devices (a named plan may be built before
  # the backend is set up).
  planned_on = cluster
  if plan == "auto" and cluster is None:
    planned_on = Cluster(workers=jax.device_count())
  if exchange == "auto":
    profile = _form_profiles(inner, profile, planned_on)
  elif plan == "auto":
    if profile is None:
      profile = _measured(inner, planned_on, per_leaf=leaf_form is not None)
    elif spec is not None:
      profile.check_for(inner)
  auto_plans: dict[tuple[int, ...], Plan] = {}

  def resolve(leaves) -> Plan:
    num_leaves = len(leaves)
    leaf_order = tuple(range(num_leaves)) if order is None else order
    if len(leaf_order) != num_leaves:
      raise ValueError(
        f"order lists {len(leaf_order)} leaves, the tree has {num_leaves}"
      )
    if plan == "layerwise":
      return Plan.layerwise(leaf_order)
    if plan == "single":
      return Plan.single(leaf_order)
    sizes = tuple(int(np.prod(jnp.shape(x))) for x in leaves)
    if sizes not in auto_plans:
      auto_plans[sizes] = auto_plan(
        sizes, leaf_order, profile, planned_on, backward_seconds, search
      )
    return auto_plans[sizes]

  forms = in_forms(inner) if exchange == "auto" else None
  return _checked(fusion_transform(inner, resolve, forms, leaf_form), inner)


def _checked(
  tx: optax.GradientTransformation, inner: optax.GradientTransformation
) -> optax.GradientTransformation:
  """``tx`` checking the unfused params against the axes ``inner`` averages over.

  ``axes.group_of`` sees through wrappers (a ``hierarchical`` inner averages
  over its inner's axes and its fast axis), and files the same axes for this
  transformation.
  """
  return axes.checked(tx, axes.group_of(inner))
