"""A scheme's side of the training program, and its default: synchronous SGD.

The loop (``train/train.py``) knows a scheme only through :class:`Scheme`:
it builds one per run and calls its hooks, in this order:

1. :meth:`Scheme.resolve` (a classmethod, before anything is traced): the
   config with the scheme's honest defaults filled in, a compressor its
   exchange can send, and a one-line ``ValueError`` for a required field
   left unset;
2. :meth:`check` (the dataset loaded), :meth:`batch_like`,
   :meth:`gradient_plan` (which leaves the compressor sees, in which order),
   :meth:`prepare` (the run's steps, once the FLOPs are known) and
   :meth:`optimizer`;
3. :meth:`initial_state` / :meth:`restore` / :meth:`saved_state`: what the
   scheme checkpoints beside params and optimizer state (and :meth:`elastic`:
   how those entries move to another number of workers);
4. :meth:`price`: bytes per step and the simulated clock;
5. per step :meth:`batch` and :meth:`after_step`; per log row :meth:`log`;
   per evaluation :meth:`evaluate`.

Each hook's default is synchronous data parallelism (``scheme.name="none"``,
DESIGN §1): ``chain(layerfusion(compressor), local optimizer)``, a barrier
every step. A new scheme is a subclass in its own module and one line in
``train/schemes/__init__.py`` (or a :func:`train.schemes.register` call).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import optax
from absl import logging

import gradcomp
from gradcomp.compressors import exchange
from train import data as data_lib
from train import factors as factors_lib
from train import mesh as mesh_lib
from train import optimizer as optimizer_lib
from train import pricing
from train import step as step_lib
from train.workload import Workload

#: ``apply_if_finite`` applies a non-finite update after this many rejections
#: in a row; the training loop stops long before
#: (``config.max_consecutive_nonfinite``), so a NaN never reaches the params.
NEVER_FORCE = 2**31 - 2


def _set(config, updates: Mapping[str, Any]):
  """A copy of ``config`` with ``{"scheme.every": 8, ...}`` set."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.update_from_flattened_dict(dict(updates))
  return config


class Scheme:
  """Synchronous data parallelism, and the hooks every scheme overrides.

  Class attributes declare what the config may hold:

  Attributes:
    name: ``config.scheme.name``.
    factory: the ``gradcomp`` transformation wrapping the local optimizer, or
      ``None`` (synchronous: the compressor, then the optimizer).
    defaults: honest defaults of ``config.scheme`` fields the factory
      requires, each where a paper gives one; a callable takes the number of
      workers.
    required: fields with no honest default, each with an example value for
      the error.
    program_fields: fields of ``config.scheme`` the program reads, not
      keywords of ``factory``.
    sends_compressor: how the config's compressor reaches the exchange:
      ``"fused"`` (inside LayerFusion's plan), ``"per_leaf"`` (the codec
      alone, to neighbours or a server: a codec whose exchange needs a
      global reduction is replaced by dense, with a log line) or ``None``
      (the scheme exchanges params densely; a compressor is ignored).
    optimizer_steps_on: whose gradient ``config.optimizer`` steps on:
      ``"mean"`` (an exchanged mean, or a server's: synchronous training,
      CD-SGD's server, the parameter servers) or ``"worker"`` (each
      worker's own, before anything is exchanged: the inner steps of the
      periodic and decentralised schemes). It decides where
      ``config.optimizer.clip_norm`` can clip (``train.optimizer.clip_scope``).
  """

  name: ClassVar[str] = "none"
  factory: ClassVar[Callable[..., optax.GradientTransformation] | None] = None
  defaults: ClassVar[Mapping[str, Any]] = {}
  required: ClassVar[Mapping[str, Any]] = {}
  program_fields: ClassVar[tuple[str, ...]] = ()
  sends_compressor: ClassVar[str | None] = "fused"
  optimizer_steps_on: ClassVar[str] = "mean"
  #: Fields of ``config.scheme`` that build ``outer`` (DiLoCo's Nesterov SGD).
  _OUTER_FIELDS: ClassVar[tuple[str, ...]] = ("outer_learning_rate", "outer_momentum")

  def __init__(self, config, workload: Workload, mesh, variant: str):
    self.config = config
    self.workload = workload
    self.mesh = mesh
    self.variant = variant
    self.speeds = None  # Set by :meth:`prepare` for the timed schemes.
    # The compiled step's collectives with their mesh axes
    # (``wire.collectives``), set by the program before :meth:`price`.
    self.step_records = None

  # -- Validation, before anything is traced ------------------------------

  @classmethod
  def resolve(cls, config):
    """``config`` with this scheme's defaults set and its fields checked.

    Raises:
      ValueError: a required field left unset, in one line naming it and an
        example value.
    """
    factors_lib.check(config)  # Sufficient factors: synchronous training only.
    optimizer_lib.check_self_exchanging(config, cls)
    cfg = config.get("scheme")
    updates = {}
    for field, default in cls.defaults.items():
      if cfg is not None and cfg.get(field) is None:
        value = (
          default(optimizer_lib.num_workers(config)) if callable(default) else default
        )
        updates[f"scheme.{field}"] = value
        logging.info("scheme %s: config.scheme.%s=%r (default)", cls.name, field, value)
    for field, example in cls.required.items():
      if cfg is None or cfg.get(field) is None:
        raise ValueError(
          f"scheme {cls.name} needs config.scheme.{field} (no default the paper "
          f"gives); e.g. --config.scheme.{field}={example}"
        )
    name = config.compressor.name
    if cls.sends_compressor == "per_leaf" and name not in ("none", *exchange.GATHERED):
      logging.warning(
        "scheme %s sends its codec to neighbours or a server, which %s's "
        "exchange (a global reduction) cannot do: sending dense values "
        "(config.compressor.name=none); gathered codecs: %s",
        cls.name,
        name,
        ", ".join(exchange.GATHERED),
      )
      updates["compressor.name"] = "none"
      # The replaced codec's fields: none takes no ratio, rank or seed.
      updates.update(
        {
          f"compressor.{k}": None
          for k, v in config.compressor.items()
          if k != "name" and v is not None
        }
      )
    return _set(config, updates) if updates else config

  def check(self) -> None:
    """Raises ``ValueError`` for a dataset or step variant the scheme cannot run."""

  # -- Building the run ---------------------------------------------------

  def batch_like(self, like: tuple) -> tuple:
    """The global batch's shapes: ``(x, y)``, or more for a scheme's step."""
    return like

  def gradient_plan(self, params, model_state, batch_like, order, sizes):
    """``(order, sizes, factors)``: the leaves the compressor sees.

    Default: every leaf, in gradient-ready ``order``; no sufficient factors.
    """
    return order, sizes, None

  def prepare(self, params, flops: float) -> int:
    """The run's number of steps, once the params and FLOPs per step are known."""
    config = self.config
    if config.get("num_train_steps"):
      return int(config.num_train_steps)
    per_epoch = data_lib.steps_per_epoch(
      len(self.workload.dataset.y_train), config.global_batch_size
    )
    return int(math.ceil(config.num_epochs * per_epoch))

  def local_optimizer(self, total_steps: int) -> list[optax.GradientTransformation]:
    """The chain after the exchange (``config.optimizer``).

    It clips unless the workers clipped before the compressor
    (``config.optimizer.clip_scope="worker"``, synchronous training).
    """
    clip = not optimizer_lib.clips_before_exchange(self.config, self)
    return optimizer_lib.local_optimizer(self.config.optimizer, total_steps, clip=clip)

  def wrap(self, local, fused, codec) -> optax.GradientTransformation:
    """The scheme's transformation around the ``local`` optimizer chain.

    ``fused``: the compressor inside LayerFusion, ``codec`` the compressor
    alone (both ``None`` for ``none``: the scheme's own dense exchange).
    Default: :attr:`factory` with ``fused`` on what it exchanges.
    """
    return scheme_transformation(self, local, fused, self.speeds)

  def optimizer(self, order, sizes, saved_plan, total_steps: int, mask=None, like=None):
    """``(tx, plan)``: see :func:`build_optimizer`."""
    return build_optimizer(self, order, sizes, saved_plan, total_steps, mask, like)

  # -- Checkpointed state ---------------------------------------------------

  def initial_state(self) -> dict[str, Any]:
    """Entries the scheme checkpoints beside the train state (shapes of a restore)."""
    return {}

  def restore(self, state: dict[str, Any], layout: step_lib.Layout) -> None:
    """Reads its entries of the run's ``state`` (restored, or initial), once laid out."""

  def saved_state(self) -> dict[str, Any]:
    return {}

  def elastic(self, entries: dict[str, Any], from_workers: int) -> dict[str, Any]:
    """Its checkpoint entries, saved on ``from_workers`` workers, for this run's.

    For an elastic resume (``train/elastic.py``): ``entries`` are the
    entries :meth:`initial_state` names, as saved (host arrays). A scheme
    that checkpoints entries of its own overrides this with their rules.

    Raises:
      ValueError: by default, naming an entry: no rule moves it, and none is
        reset silently.
    """
    for key in entries:
      raise ValueError(
        f"elastic resume from {from_workers} to {self.mesh.size} workers: no rule "
        f"for state[{key!r}], scheme {self.name}'s own checkpoint entry; resume "
        f"it on {from_workers} workers"
      )
    return {}

  # -- Wire and clock -------------------------------------------------------

  def price(self, plan, params, step_wire, num_steps: int, flops: float):
    """``pricing.Priced``: every step is an exchange round behind a barrier.

    On a mesh with a fast axis (``fsdp``, ``local``) each collective is
    priced on its own link class (``pricing.price_axis_steps``).
    """
    fast = mesh_lib.FAST.get(tuple(self.mesh.axis_names))
    if fast is not None and self.step_records is not None:
      return pricing.price_axis_steps(
        self.config, self.mesh, flops, self.step_records, (fast,), num_steps
      )
    return pricing.price_rounds(
      self.config, self.mesh, flops, step_wire, num_steps, lambda step: True, None
    )

  def messages(self) -> list[str]:
    """Lines the run logs once it is built."""
    return []

  # -- Per step, row and evaluation -----------------------------------------

  def batches(self, start: int) -> Iterator:
    """Host batches from step ``start + 1`` on (resumable from ``start``)."""
    ds = self.workload.dataset
    return data_lib.batches(
      ds.x_train,
      ds.y_train,
      self.config.global_batch_size,
      self.config.seed,
      start_step=start,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )

  def batch(self, step: int, batches: Iterator, current: Callable):
    """Step ``step``'s host batch. ``current()`` gives ``(params, model_state)``."""
    return next(batches)

  def after_step(self, step: int, writer, sim_at: Callable) -> None:
    """Once step ``step`` was dispatched (EdgeGossip logs its epochs)."""

  def log(self, step: int, row: dict[str, Any], writer, opt_state) -> None:
    """Adds the scheme's figures to a training row (``opt_state``: global layout)."""

  def evaluate(self, score: Callable, opt_state, model_state) -> dict[str, float]:
    """Extra evaluations: ``score(params, model_state)`` gives ``eval_*`` metrics."""
    return {}


def scheme_transformation(
  scheme: Scheme, local, compressor_tx, speeds=None, **extra
) -> optax.GradientTransformation:
  """``scheme.factory(local, ...)`` with the set fields of ``config.scheme``.

  Fields the factory does not take are dropped with a warning; ``speeds``
  (the described cluster's ``(steps, workers)`` table) goes to a factory
  that takes them; ``extra`` keywords (what the program knows, such as the
  gradient order) go to it as they are.
  """
  config, name, factory = scheme.config, scheme.name, scheme.factory
  cfg = config.scheme
  skip = (*scheme._OUTER_FIELDS, *scheme.program_fields, "name")
  kwargs = {k: v for k, v in cfg.items() if k not in skip and v is not None}
  accepted = inspect.signature(factory).parameters
  if "speeds" in accepted:
    kwargs["speeds"] = speeds
  for key in sorted(set(kwargs) - set(accepted)):
    logging.warning(
      "scheme %s takes no %r; ignoring config.scheme.%s=%r",
      name,
      key,
      key,
      kwargs.pop(key),
    )
  if cfg.get("outer_learning_rate") is not None:
    if "outer" not in accepted:
      raise ValueError(f"scheme {name} has no outer optimizer (config.scheme.outer_*)")
    momentum = cfg.get("outer_momentum")
    kwargs["outer"] = optax.sgd(
      cfg.outer_learning_rate,
      momentum=0.9 if momentum is None else momentum,
      nesterov=True,
    )
  if "compressor" in accepted:
    kwargs["compressor"] = compressor_tx
  elif compressor_tx is not None:
    logging.warning(
      "scheme %s exchanges params densely; ignoring config.compressor.name=%r",
      name,
      config.compressor.name,
    )
  # The first parameter is the optimizer built from config.optimizer: the
  # local one (local SGD, EASGD) or the global one (CD-SGD's server).
  missing = [
    p.name
    for p in list(accepted.values())[1:]
    if p.default is p.empty and p.name not in kwargs
  ]
  if missing:
    raise ValueError(
      f"scheme {name} needs config.scheme.{missing[0]} (a keyword of "
      f"gradcomp.{name}); e.g. --config.scheme.{missing[0]}=..."
    )
  return factory(local, axis_name=step_lib.AXIS, **kwargs, **extra)


def build_optimizer(
  scheme: Scheme, order, sizes, saved_plan, total_steps, mask=None, like=None
):
  """The run's optimizer and its fusion plan.

  On the run's mesh (``config.mesh``, ``train/mesh.py``): the compressor
  averages over every mesh axis, or, with a fast axis (FSDP's ``"fsdp"``,
  ``config.compressor.hierarchical``), over the others inside
  ``gradcomp.hierarchical`` (see :func:`synchronous_chain`).

  Args:
    scheme: the run's scheme (its config: ``compressor``, ``fusion``,
      ``optimizer``, ``scheme``).
    order: gradient-ready order of the parameter leaves
      (``gradcomp.fusion.gradient_order``); with ``mask``, of the leaves it
      keeps (``train.factors.Factored.restrict``).
    sizes: values per parameter leaf (tree order), for ``plan="auto"``.
    saved_plan: the plan of the run being resumed, reused by ``"auto"``.
    total_steps: steps of the run, for decaying schedules.
    mask: ``optax.masked``'s mask of the compressor (with its fusion), or
      ``None``: leaves it maps to ``False`` (kernels whose sufficient factors
      the step exchanges, ``train/factors.py``) skip it, already the mean.
    like: the params (or ``jax.ShapeDtypeStruct``), needed on an FSDP mesh
      only, whose optimizer is built for their shards.

  Returns:
    ``(tx, plan)``: ``tx``'s state is an ``optax.ApplyIfFiniteState``.
  """
  config = scheme.config
  spec = optimizer_lib.mesh_spec(config)
  inner = optimizer_lib.compressor(config.compressor, spec.exchange_axis)
  cluster = optimizer_lib.cluster_of(config, optimizer_lib.num_workers(config))
  plan = optimizer_lib.fusion_plan(
    config.fusion, order, sizes, inner, saved_plan, cluster
  )
  fused = inner if plan is None else gradcomp.layerfusion(inner, plan)
  # config.compressor.warmup_steps: the dense mean first (outside the plan).
  fused = optimizer_lib.warmed(config, fused, spec.exchange_axis)
  # config.optimizer.clip_scope="worker": each worker clips before the exchange.
  fused = optimizer_lib.worker_clipped(config, scheme, fused)
  if mask is not None:
    fused = optax.masked(fused, mask)
  if scheme.factory is None:  # Synchronous: the compressor, then the optimizer.
    tx = synchronous_chain(scheme, spec, fused, total_steps, like)
  elif config.compressor.name == "none":  # The scheme's own dense exchange.
    tx = scheme.wrap(optax.chain(*scheme.local_optimizer(total_steps)), None, None)
  else:
    codec = optimizer_lib.compressor(config.compressor, step_lib.AXIS)
    tx = scheme.wrap(optax.chain(*scheme.local_optimizer(total_steps)), fused, codec)
  tx = gradcomp.apply_if_finite(tx, NEVER_FORCE, axis_name=spec.worker_axis)
  return tx, plan


def synchronous_chain(
  scheme: Scheme, spec: mesh_lib.MeshSpec, fused, total_steps: int, like=None
) -> optax.GradientTransformation:
  """``chain(exchange, local optimizer)`` on the run's mesh.

  ``data=N`` or ``node=N,local=M``: ``chain(fused, ...)`` (DESIGN §1).
  ``config.compressor.hierarchical=local``: the exchange is
  ``hierarchical(fused, "local")`` (``fused`` built over ``"node"``).
  FSDP (``data=D,fsdp=F``): ``hierarchical(fused, "fsdp", gather=False)``
  and an optimizer on this device's shards (``train.mesh.sharded_chain``).
  """
  if spec.hierarchical is None:
    return optax.chain(fused, *scheme.local_optimizer(total_steps))
  exchange = gradcomp.hierarchical(fused, spec.hierarchical, gather=spec.fsdp is None)
  if spec.fsdp is None:
    return optax.chain(exchange, *scheme.local_optimizer(total_steps))
  if like is None:
    raise ValueError(
      f"config.mesh={str(spec)!r}: FSDP's optimizer is built for the params' "
      f"shards; pass like= (the params or their shapes)"
    )
  shards = spec.sharded_params(like)
  parts = optimizer_lib.local_optimizer(scheme.config.optimizer, total_steps, shards)
  return mesh_lib.sharded_chain(exchange, *parts, shards=shards)
