"""The data-parallel training step and where its state lives (DESIGN §3).

One ``Mesh`` over all devices, with axis ``"data"`` unless ``config.mesh``
names others (``train/mesh.py``); every device is a worker and the step's
data-parallel axis is every mesh axis (:func:`worker_axis`). The step is
``jax.jit(jax.shard_map(...))``: each worker computes its local loss and
gradient, ``tx.update`` compresses and exchanges (DESIGN §1), and every worker
applies the same mean update.

Layout. Params are replicated for synchronous algorithms and per worker
(a leading worker axis sharded over ``"data"``) for a scheme whose
workers' params differ (DESIGN §5); ``infer_layout`` learns which from the
types, and ``Layout.params`` is the one place that says so. Optimizer
state is split by what the types say: a leaf that ``shard_map``'s
varying-manual-axes typing marks as varying over ``"data"`` after one update
(error-feedback residuals, PowerSGD's Q) is genuinely per worker and carries a
leading worker axis sharded over ``"data"``; everything else (the momentum
trace, computed from the exchanged mean; step counters; the shared PRNG key)
is replicated. Giving the momentum trace a worker axis too would type the
updates, and so the params, as varying, which ``out_specs=P()`` rejects
without an extra all-reduce (BUILD_NOTES, issue 4).

FSDP (``Layout.fsdp``, a mesh ``data=D,fsdp=F``): params are stored as
``(F, c)`` shards over ``"fsdp"`` (``train.mesh.ShardedParams``) and
all-gathered at use inside the step; ``tx`` returns this device's shards
of the update. An optimizer-state leaf typed varying over ``"fsdp"`` only
(momentum, Adam's moments of the shards) carries a leading shard axis
sharded over ``"fsdp"`` (``Layout.sharded``); one varying over any other
worker axis (error-feedback residuals of each device's shard) carries the
leading worker axis over every mesh axis.

Variants (``config.step``). ``"shard_map"`` (the default) runs on the state
as laid out above. ``"pmap"`` runs the same ``_body`` under ``jax.pmap`` over
``AXIS``: there every leaf (params, model state, optimizer state) carries a
leading device axis, this process's devices only (pmap takes host-local
arrays), and the batch is ``[local devices, per device, ...]``. pmap types
nothing as varying, so ``pcast`` is a no-op there and the compressors'
collectives (``psum``, ``all_gather(to="invarying")``) run as under
``shard_map``. ``Layout.to_variant`` / ``from_variant`` convert between the
two at start, at each checkpoint and at the end: checkpoints always hold the
``shard_map`` layout, so a run resumes under either variant.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel import branches
from train import mesh as mesh_lib

AXIS = mesh_lib.DATA
VARIANTS = ("shard_map", "pmap")

Batch = tuple[jax.Array, jax.Array]


def worker_axis(mesh: Mesh) -> str | tuple[str, ...]:
  """The step's data-parallel axis: every axis of ``mesh`` (``AXIS`` on the default one)."""
  names = tuple(mesh.axis_names)
  return names[0] if len(names) == 1 else names


def _axes(axis) -> tuple[str, ...]:
  return (axis,) if isinstance(axis, str) else tuple(axis)


def _varying(x, axis) -> frozenset:
  """The axes of ``axis`` that ``x``, traced inside ``shard_map``, is typed varying over."""
  return branches.varying_axes(x) & frozenset(_axes(axis))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the train state lives on the mesh.

  Attributes:
    mesh: the mesh; every device is a worker (:func:`worker_axis`).
    per_worker: a tree over the optimizer state's leaves: ``True`` where the
      leaf carries a leading worker axis sharded over :attr:`axis`.
    params_per_worker: whether params and model state carry a leading worker
      axis too (a scheme whose workers' params differ, DESIGN §5); otherwise
      they are replicated.
    fsdp: the params' shards (``train.mesh.ShardedParams``), or ``None``.
    sharded: with ``fsdp``, a tree over the optimizer state's leaves:
      ``True`` where the leaf carries a leading shard axis sharded over
      ``fsdp.axis`` (state shaped like the shards); ``None`` without.
  """

  mesh: Mesh
  per_worker: Any
  params_per_worker: bool = False
  fsdp: mesh_lib.ShardedParams | None = None
  sharded: Any = None

  @property
  def axis(self) -> str | tuple[str, ...]:
    """The step's data-parallel axis (:func:`worker_axis`)."""
    return worker_axis(self.mesh)

  @property
  def params(self) -> P:
    """Spec of every param leaf."""
    if self.fsdp is not None:
      return self.fsdp.spec
    return self.model_state_spec

  @property
  def model_state_spec(self) -> P:
    """Spec of every model-state leaf (batch statistics)."""
    return P(self.axis) if self.params_per_worker else P()

  @property
  def num_workers(self) -> int:
    return self.mesh.size

  def rows(self):
    """A tree over the optimizer state: whether a leaf has a leading (worker or shard) axis."""
    if self.sharded is None:
      return self.per_worker
    return jax.tree.map(lambda w, s: w or s, self.per_worker, self.sharded)

  def opt_specs(self):
    if self.sharded is None:
      return jax.tree.map(lambda w: P(self.axis) if w else P(), self.per_worker)
    return jax.tree.map(
      lambda w, s: P(self.axis) if w else self.fsdp.spec if s else P(),
      self.per_worker,
      self.sharded,
    )

  def shardings(self, specs):
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)

  def to_global(self, opt_state):
    """Per-worker leaves of a one-worker state repeated for every worker.

    Leaves shaped like the shards (``sharded``) are repeated for every
    shard: ``tx.init`` gives every shard the same start (zeros).
    """
    if self.sharded is None:
      return jax.tree.map(
        lambda x, w: gradcomp.add_worker_axis(x, self.num_workers) if w else x,
        opt_state,
        self.per_worker,
      )
    return jax.tree.map(
      lambda x, w, s: (
        gradcomp.add_worker_axis(x, self.num_workers if w else self.fsdp.size)
        if w or s
        else x
      ),
      opt_state,
      self.per_worker,
      self.sharded,
    )

  def params_to_global(self, tree):
    """Params (or model state) of one worker repeated for every worker, if per worker."""
    if not self.params_per_worker:
      return tree
    return gradcomp.add_worker_axis(tree, self.num_workers)

  def global_params(self, params, model_state):
    """One worker's full ``(params, model_state)`` in the layout's global shapes.

    Repeated for every worker if per worker; params cut in ``(F, c)``
    shards under FSDP (traceable, so ``jax.eval_shape`` gives the shapes).
    """
    if self.fsdp is not None:
      return self.fsdp.shard(params), model_state
    return self.params_to_global((params, model_state))

  def place(self, params, model_state, opt_state):
    """``(global params, global model_state, global opt_state)`` put on the mesh."""
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(self.mesh, spec))
    return (
      put(params, self.params),
      put(model_state, self.model_state_spec),
      jax.device_put(opt_state, self.shardings(self.opt_specs())),
    )

  def to_variant(self, variant: str, params, model_state, opt_state):
    """The placed state (as ``place`` returns it) laid out for ``variant``.

    The identity for ``"shard_map"``. For ``"pmap"``, every leaf gets a
    leading device axis: replicated leaves are copied to every device,
    per-worker leaves already have it; each process keeps its devices' rows.
    """
    if variant == "shard_map":
      return params, model_state, opt_state
    copy = lambda x: x[None]  # Each device stacks its own replica: no traffic.
    own_params = (lambda x: x) if self.params_per_worker else copy

    def stack(params, model_state, opt_state):
      return (
        jax.tree.map(own_params, params),
        jax.tree.map(own_params, model_state),
        jax.tree.map(lambda x, w: x if w else copy(x), opt_state, self.per_worker),
      )

    specs = (self.params, self.model_state_spec, self.opt_specs())
    stacked = jax.jit(
      jax.shard_map(stack, mesh=self.mesh, in_specs=specs, out_specs=P(AXIS))
    )(params, model_state, opt_state)
    return multihost_utils.global_array_to_host_local_array(stacked, self.mesh, P(AXIS))

  def from_variant(self, variant: str, params, model_state, opt_state):
    """The inverse of ``to_variant``: the state as ``place`` lays it out."""
    if variant == "shard_map":
      return params, model_state, opt_state
    stacked = multihost_utils.host_local_array_to_global_array(
      (params, model_state, opt_state), self.mesh, P(AXIS)
    )
    own = lambda x: x[0]  # The device's own row.
    own_params = (lambda x: x) if self.params_per_worker else own

    def unstack(params, model_state, opt_state):
      return (
        jax.tree.map(own_params, params),
        jax.tree.map(own_params, model_state),
        jax.tree.map(lambda x, w: x if w else own(x), opt_state, self.per_worker),
      )

    specs = (self.params, self.model_state_spec, self.opt_specs())
    # Unchecked: pmap's replicas are equal (the same program on the same
    # values), which the varying types cannot show.
    return jax.jit(
      jax.shard_map(
        unstack, mesh=self.mesh, in_specs=P(AXIS), out_specs=specs, check_vma=False
      )
    )(*stacked)


def _drop(opt_state, rows):
  return jax.tree.map(lambda x, w: x[0] if w else x, opt_state, rows)


def _add(opt_state, rows):
  return jax.tree.map(lambda x, w: x[None] if w else x, opt_state, rows)


def cross_entropy(logits, labels) -> tuple[jax.Array, jax.Array]:
  """Per-example (per-token for sequences) losses and correctness.

  The default ``criterion`` of every function here: a workload may pass its
  own ``criterion(outputs, targets) -> (losses, scores)``, both shaped as
  the targets' leading axes (``train.workload.Workload.criterion``).
  """
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return loss, correct


def loss_fn(
  model: nn.Module,
  params,
  model_state,
  x,
  y,
  w=None,
  *,
  train: bool,
  criterion: Callable = cross_entropy,
):
  """Mean loss and ``(mean score, new model state)`` (cross-entropy and accuracy).

  ``w``: per-example weights (EdgeGossip's mask, 0 for padding), or ``None``
  for the plain mean; a batch of zero weight has loss 0 and gradient 0.
  """
  variables = {"params": params, **model_state}
  if train and model_state:
    logits, new_state = model.apply(variables, x, train=True, mutable=list(model_state))
  else:
    logits, new_state = model.apply(variables, x, train=train), model_state
  loss, correct = criterion(logits, y)
  if w is None:
    return jnp.mean(loss), (jnp.mean(correct), new_state)
  count = jnp.maximum(jnp.sum(w), 1.0)
  return jnp.sum(loss * w) / count, (jnp.sum(correct * w) / count, new_state)


def init_model(model: nn.Module, rng, input_shape, dtype) -> tuple[Any, dict]:
  """``(params, model_state)``: ``model``'s variables for inputs of ``input_shape``."""
  variables = dict(jax.jit(model.init)(rng, jnp.zeros((1, *input_shape), dtype)))
  params = variables.pop("params")
  return params, variables


def gradient_order(
  model: nn.Module, params, model_state, x, y, *, criterion: Callable = cross_entropy
) -> list[int]:
  """``gradcomp.fusion.gradient_order`` of the loss: the leaves in gradient-ready order."""
  loss = lambda p, x, y: loss_fn(
    model, p, model_state, x, y, train=False, criterion=criterion
  )[0]
  return gradcomp.fusion.gradient_order(loss, params, x, y)


def poison_nonfinite(loss, grads):
  """``grads`` all NaN where the local ``loss`` is not finite.

  A non-finite local loss (with finite gradients, e.g. log(0) clipped)
  poisons the local gradient, so the agreed skip of apply_if_finite covers it.
  """
  return jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)


def _as_varying(tree, axis):
  """Every leaf typed varying over every axis of ``axis`` (as it is where it already is)."""

  def one(x):
    missing = tuple(a for a in _axes(axis) if a not in branches.varying_axes(x))
    if not missing:
      return x
    return jax.lax.pcast(x, missing[0] if len(missing) == 1 else missing, to="varying")

  return jax.tree.map(one, tree)


def _body(
  model,
  tx,
  layout: Layout,
  params,
  model_state,
  opt_state,
  batch,
  *,
  probe=None,
  independent: bool | None = None,
  factors=None,
  criterion: Callable = cross_entropy,
):
  """One worker's step; with ``probe``, records which axes the new state varies over.

  ``independent``: whether workers' params differ (default: the layout's
  ``params_per_worker``; pmap, whose layout has no worker axes, passes it).
  ``factors``: a ``train.factors.Factored`` whose layers send sufficient
  factors (their kernels' means replace the local gradient in what ``tx``
  receives), or ``None``.
  """
  independent = layout.params_per_worker if independent is None else independent
  # (x, y), or (x, y, w) with a per-example mask: a worker whose rows are all
  # masked (past its epoch's budget, EdgeGossip) takes no local step.
  x, y, *weights = batch
  w = weights[0] if weights else None
  active = None if w is None else jnp.sum(w) > 0
  axis, rows = layout.axis, layout.rows()
  opt_state = _drop(opt_state, rows)
  if layout.params_per_worker:
    params, model_state = gradcomp.drop_worker_axis((params, model_state))
  # What tx updates: the params, or under FSDP this device's shards of them,
  # all-gathered for the forward and backward passes.
  owned = params
  if layout.fsdp is not None:
    owned = jax.tree.map(lambda x: x[0], params)
    params = layout.fsdp.gather(owned)
  # Differentiate a per-worker copy: the gradient of replicated params comes
  # back already summed over workers (psum is pvary's transpose).
  local = _as_varying(params, axis)
  local_state = _as_varying(model_state, axis)
  loss_of = functools.partial(loss_fn, model, train=True, criterion=criterion)
  if factors is None:
    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    (loss, (accuracy, new_model_state)), grads = grad_fn(local, local_state, x, y, w)
    grads = sent = poison_nonfinite(loss, grads)
  else:
    (loss, (accuracy, new_model_state)), grads, sent = factors.gradients(
      loss_of, local, local_state, x, y
    )
  extra = {} if active is None else {"active": active}
  updates, new_opt_state = tx.update(sent, opt_state, owned, **extra)
  new_params = optax.apply_updates(owned, updates)
  if probe is not None:
    probe.append(
      (
        jax.tree.map(lambda x: _varying(x, axis), new_opt_state),
        frozenset().union(*(_varying(p, axis) for p in jax.tree.leaves(new_params))),
      )
    )
  skipped = ~new_opt_state.last_finite  # Agreed by every worker.
  applied = ~skipped if active is None else ~skipped & active
  # Synchronous training averages batch statistics over workers (synchronous
  # BN); a scheme's workers keep their own, as they keep their params. Both
  # are kept when the step is skipped.
  if not independent:
    new_model_state = jax.lax.pmean(new_model_state, axis)
  new_model_state = jax.tree.map(
    lambda new, old: jnp.where(applied, new, old), new_model_state, model_state
  )
  # One small all-reduce for every logged per-worker scalar. Loss and
  # accuracy are means over the workers that trained (all, unless masked).
  trained = None if active is None else active.astype(jnp.float32)
  logged = [loss, accuracy] if active is None else [loss * trained, accuracy * trained]
  logged.append(optax.tree.norm(grads, squared=True))
  if independent:
    logged.append(optax.tree.norm(updates, squared=True))
  if active is not None:
    logged.append(trained)
  means = jax.lax.pmean(jnp.stack(logged), axis)
  if independent:
    update_sq = means[3]
  else:
    update_sq = optax.tree.norm(updates, squared=True)
    if layout.fsdp is not None:  # This device's shards: the norm is their sum.
      update_sq = jax.lax.psum(update_sq, layout.fsdp.axis)
  share = 1.0 if active is None else jnp.maximum(means[-1], 1e-30)
  metrics = {
    "loss": means[0] / share,
    "accuracy": means[1] / share,
    "l2_grads": jnp.sqrt(means[2]),
    "l2_updates": jnp.sqrt(update_sq),  # The root mean square over workers.
    "skipped": skipped,
    "consecutive_nonfinite": new_opt_state.notfinite_count,
    "nonfinite_steps": new_opt_state.total_notfinite,
  }
  if layout.params_per_worker:
    new_params, new_model_state = gradcomp.add_worker_axis(
      (new_params, new_model_state)
    )
  if layout.fsdp is not None:
    new_params = jax.tree.map(lambda x: x[None], new_params)
  return new_params, new_model_state, _add(new_opt_state, rows), metrics


def infer_layout(
  model,
  tx,
  mesh: Mesh,
  params,
  model_state,
  opt_state,
  batch,
  factors=None,
  *,
  criterion: Callable = cross_entropy,
  fsdp: mesh_lib.ShardedParams | None = None,
) -> Layout:
  """The layout whose per-worker leaves are exactly those typed varying.

  Traces the step (no compile, no run) with a candidate set of per-worker
  leaves, starting from none, and adds every leaf that comes out varying until
  nothing changes (a leaf can turn varying only because another one did).
  Params come out varying under a scheme whose workers' params differ
  (DESIGN §5): then params and model state are per worker too. With
  ``fsdp``, a leaf varying over ``fsdp.axis`` alone is sharded like the
  params (``Layout.sharded``) and one varying over any other worker axis
  is per worker (the order replicated, sharded, per worker only grows).

  Args:
    model: the flax module.
    tx: the optimizer, with ``axis_name=AXIS``.
    mesh: the mesh.
    params: params, arrays or ``jax.ShapeDtypeStruct``.
    model_state: non-param collections (``batch_stats``), possibly ``{}``.
    opt_state: ``tx.init(params)``, without worker axes.
    batch: one global batch (arrays or ``jax.ShapeDtypeStruct``).
    factors: as for ``make_train_step``.
    criterion: the workload's, as for ``loss_fn``.
    fsdp: the params' shards (a mesh with an ``"fsdp"`` axis), or ``None``.
  """
  axis = worker_axis(mesh)
  fast = frozenset() if fsdp is None else frozenset({fsdp.axis})
  per_worker = jax.tree.map(lambda _: False, opt_state)
  sharded = None if fsdp is None else per_worker
  params_per_worker = False
  for _ in range(2 * len(jax.tree.leaves(opt_state)) + 2):
    layout = Layout(mesh, per_worker, params_per_worker, fsdp, sharded)
    found = []

    def probe(params, model_state, opt_state, batch, layout=layout, found=found):
      _body(
        model,
        tx,
        layout,
        params,
        model_state,
        opt_state,
        batch,
        probe=found,
        factors=factors,
        criterion=criterion,
      )
      return jnp.zeros(())

    state = layout.to_global(opt_state)
    abstract = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=s),
      tree,
      shardings,
    )
    full = lambda spec: NamedSharding(mesh, spec)
    global_params, global_model_state = jax.eval_shape(
      lambda: layout.global_params(params, model_state)
    )
    spec_of_state = layout.model_state_spec
    args = (
      abstract(global_params, jax.tree.map(lambda _: full(layout.params), params)),
      abstract(
        global_model_state, jax.tree.map(lambda _: full(spec_of_state), model_state)
      ),
      abstract(jax.eval_shape(lambda: state), layout.shardings(layout.opt_specs())),
      abstract(batch, jax.tree.map(lambda _: full(P(axis)), batch)),
    )
    jax.eval_shape(
      jax.shard_map(
        probe,
        mesh=mesh,
        in_specs=(layout.params, spec_of_state, layout.opt_specs(), P(axis)),
        out_specs=P(),
      ),
      *args,
    )
    found_opt, found_params = found[0]
    grown = jax.tree.map(lambda w, f: w or bool(f - fast), per_worker, found_opt)
    grown_sharded = sharded
    if sharded is not None:
      grown_sharded = jax.tree.map(
        lambda s, w, f: (s or bool(f & fast)) and not w, sharded, grown, found_opt
      )
    grown_params = params_per_worker or bool(found_params - fast)
    if (grown, grown_sharded, grown_params) == (
      per_worker,
      sharded,
      params_per_worker,
    ):
      return layout
    per_worker, sharded, params_per_worker = grown, grown_sharded, grown_params
  raise AssertionError("unreachable: a leaf's kind grows at most twice")


def check_variant(variant: str) -> None:
  """Raises ``ValueError`` unless ``variant`` is one of ``VARIANTS``."""
  if variant not in VARIANTS:
    raise ValueError(
      f"unknown step {variant!r} (config.step); valid: {', '.join(VARIANTS)}"
    )


def _pmap(fun, layout: Layout, **kwargs) -> Callable:
  # The mesh's own device order, so pmap's arrays are sharded as the layout's.
  return jax.pmap(fun, AXIS, devices=list(layout.mesh.devices.flat), **kwargs)


def make_train_step(
  model,
  tx,
  layout: Layout,
  variant: str = "shard_map",
  factors=None,
  *,
  criterion: Callable = cross_entropy,
) -> Callable:
  """``step(params, model_state, opt_state, batch) -> (..., metrics)``, jitted.

  Params, model state and optimizer state are donated; metrics are
  replicated scalars. Under ``"shard_map"``, ``batch`` is sharded over
  ``AXIS`` along its first axis; under ``"pmap"`` the state is laid out by
  ``Layout.to_variant`` and ``batch`` by ``shard_batch(..., "pmap")``.
  ``factors``: a ``train.factors.Factored`` whose layers send sufficient
  factors (``tx`` then masks their kernels off its compressor), or ``None``.
  ``criterion``: the workload's, as for ``loss_fn``.
  """
  check_variant(variant)
  if variant == "pmap":
    # pmap itself strips and restores the leading device axis of every leaf.
    per_device = dataclasses.replace(
      layout,
      per_worker=jax.tree.map(lambda _: False, layout.per_worker),
      params_per_worker=False,
    )
    return _pmap(
      functools.partial(
        _body,
        model,
        tx,
        per_device,
        independent=layout.params_per_worker,
        factors=factors,
        criterion=criterion,
      ),
      layout,
      out_axes=(0, 0, 0, None),
      donate_argnums=(0, 1, 2),
    )
  opt_specs = layout.opt_specs()
  state = (layout.params, layout.model_state_spec, opt_specs)
  return jax.jit(
    jax.shard_map(
      functools.partial(_body, model, tx, layout, factors=factors, criterion=criterion),
      mesh=layout.mesh,
      in_specs=(*state, P(layout.axis)),
      out_specs=(*state, P()),
    ),
    donate_argnums=(0, 1, 2),
  )


def _eval_sums(model, params, model_state, x, y, w, criterion) -> jax.Array:
  """``(sum loss, sum correct, count)`` of one model on its batch, ``w`` weighting rows."""
  logits = model.apply({"params": params, **model_state}, x, train=False)
  loss, correct = criterion(logits, y)
  w = jnp.broadcast_to(w.reshape(w.shape + (1,) * (loss.ndim - 1)), loss.shape)
  return jnp.stack([jnp.sum(loss * w), jnp.sum(correct * w), jnp.sum(w)])


def make_eval_step(
  model,
  layout: Layout,
  variant: str = "shard_map",
  *,
  criterion: Callable = cross_entropy,
) -> Callable:
  """``eval(params, model_state, x, y, w) -> (sum loss, sum correct, count)``.

  Each worker evaluates its shard of the batch; ``w`` weights the examples
  (0 for padding). The sums are over all workers, replicated. Arguments are
  laid out for ``variant`` as in ``make_train_step``.
  """
  check_variant(variant)
  axis = layout.axis

  def evaluate(params, model_state, x, y, w):
    if layout.fsdp is not None:  # This device's shards, all-gathered.
      params = layout.fsdp.gather(jax.tree.map(lambda p: p[0], params))
    sums = _eval_sums(model, params, model_state, x, y, w, criterion)
    return jax.lax.psum(sums, axis)

  if variant == "pmap":
    return _pmap(evaluate, layout, out_axes=None)
  return jax.jit(
    jax.shard_map(
      evaluate,
      mesh=layout.mesh,
      in_specs=(layout.params, layout.model_state_spec, *[P(axis)] * 3),
      out_specs=P(),
    )
  )


def make_worker_eval_step(
  model, layout: Layout, *, criterion: Callable = cross_entropy
) -> Callable:
  """``eval(params, model_state, x, y, w) -> (workers, 3)`` sums, each worker its own model.

  For per-worker params (``shard_map`` layout, leading worker axis): every
  worker evaluates its own params on the whole (replicated) batch, so one
  pass gives each worker's loss and accuracy sums.
  """

  def evaluate(params, model_state, x, y, w):
    params, model_state = gradcomp.drop_worker_axis((params, model_state))
    sums = _eval_sums(model, params, model_state, x, y, w, criterion)
    # Gathered, so every process can read every worker's sums.
    return jax.lax.all_gather(sums, AXIS, to="invarying")

  return jax.jit(
    jax.shard_map(
      evaluate,
      mesh=layout.mesh,
      in_specs=(P(AXIS), P(AXIS), P(), P(), P()),
      out_specs=P(),
    )
  )


def make_averager(layout: Layout) -> Callable:
  """``average(tree)``: the workers' average of per-worker leaves, replicated.

  Float leaves (leading worker axis) are averaged in float32; integer leaves
  (counters) are equal on every worker and taken from worker 0.
  """

  def mean(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype)
    return x[0]

  return jax.jit(
    lambda tree: jax.tree.map(mean, tree),
    out_shardings=NamedSharding(layout.mesh, P()),
  )


@jax.jit
def consensus_distance(params) -> jax.Array:
  """``mean_w ||x_w - mean_v x_v||^2`` over per-worker params (leading worker axis).

  The mean squared distance of the workers' params from their average, summed
  over leaves: 0 when every worker holds the same params.
  """
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(params):
    x = x.astype(jnp.float32)
    total = total + jnp.sum(jnp.square(x - jnp.mean(x, axis=0))) / x.shape[0]
  return total


def shard_batch(mesh: Mesh, local: tuple[np.ndarray, ...], variant: str = "shard_map"):
  """This process's rows of a global batch, as ``variant``'s step takes them.

  ``"shard_map"``: arrays sharded over every mesh axis (:func:`worker_axis`).
  ``"pmap"``: host-local arrays ``[local devices, rows per device, ...]``,
  split in the same order, so worker ``i`` gets the same rows under either
  variant.
  """
  if variant == "pmap":
    n = mesh.local_mesh.size
    sharding = NamedSharding(mesh.local_mesh, P(AXIS))
    return tuple(
      jax.device_put(np.reshape(a, (n, -1, *np.shape(a)[1:])), sharding) for a in local
    )
  sharding = NamedSharding(mesh, P(worker_axis(mesh)))
  return tuple(jax.make_array_from_process_local_data(sharding, a) for a in local)


def example_batch(mesh: Mesh, batch_like, variant: str = "shard_map"):
  """Arguments shaped like each step's batch, for lowering the step.

  ``batch_like``: ``jax.ShapeDtypeStruct`` of the global batch. pmap lowers
  only host-local arrays in a multi-process run, so its example is real.
  """
  if variant == "pmap":
    count = jax.process_count()
    local = [np.zeros((b.shape[0] // count, *b.shape[1:]), b.dtype) for b in batch_like]
    return shard_batch(mesh, tuple(local), variant)
  sharded = NamedSharding(mesh, P(worker_axis(mesh)))
  return tuple(
    jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharded) for b in batch_like
  )


def make_point_losses(
  model, layout: Layout, *, criterion: Callable = cross_entropy
) -> Callable:
  """``losses(params, model_state, x, y) -> (workers * M,)``: each worker's own model on its rows.

  For EdgeGossip's trainer (paper 002 Alg. 2, line 1): ``x`` and ``y`` hold
  ``M`` aggregated points per worker, worker-major and sharded over
  ``AXIS``; worker ``w`` scores its own ``M`` points with its own params
  (per-worker layout, leading worker axis). Returns the per-point
  cross-entropy, sharded as ``x``.
  """

  def losses(params, model_state, x, y):
    params, model_state = gradcomp.drop_worker_axis((params, model_state))
    logits = model.apply({"params": params, **model_state}, x, train=False)
    return criterion(logits, y)[0]

  return jax.jit(
    jax.shard_map(
      losses,
      mesh=layout.mesh,
      in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS)),
      out_specs=P(AXIS),
    )
  )
