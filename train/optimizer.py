"""The optimizer of a config: compressor, LayerFusion plan, SGD or AdamW, scheme, guard.

Synchronous training (``config.scheme.name="none"``) is DESIGN §1's usage::

  apply_if_finite(chain(layerfusion(compressor, plan), [clip], [weight decay], sgd))
  apply_if_finite(chain(layerfusion(compressor, plan), [clip], adamw))

A scheme (DESIGN §5) wraps the local optimizer and, where it exchanges a
compressible tensor (local SGD's pseudo-gradients), the compressor::

  apply_if_finite(local_sgd(chain([clip], [weight decay], sgd), every,
                            compressor=layerfusion(compressor, plan), ...))

The compressor is chosen by name from gradcomp's registry (STYLE 10); its
exchange runs inside ``tx.update`` over ``axis_name``. ``apply_if_finite`` sits
outside everything, so a step whose gradient (or loss, see ``train/step.py``)
is non-finite on any worker leaves params, momentum and residuals untouched on
every worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from absl import logging

import gradcomp
from train import edgegossip as edgegossip_lib

# ``apply_if_finite`` applies a non-finite update after this many rejections in
# a row; the training loop stops long before (``max_consecutive_nonfinite``),
# so a NaN never reaches the params.
_NEVER_FORCE = 2**31 - 2


def compressor(cfg, axis_name: str | None) -> optax.GradientTransformation:
  """``gradcomp.get(cfg.name, axis_name=..., **set fields of cfg)``.

  Fields of ``cfg`` other than ``name`` are keyword arguments; ``None`` ones
  are unset. A set field the chosen factory does not take (``ratio`` left over
  after ``--config.compressor.name=signsgd``) is dropped with a warning, so one
  config serves every compressor.

  Raises:
    ValueError: for an unknown name (listing the registered ones) or, from the
      factory, for an invalid hyper-parameter.
  """
  name = cfg.name
  if name not in gradcomp.names():
    raise ValueError(
      f"unknown compressor {name!r} (config.compressor.name); valid names: "
      f"{', '.join(gradcomp.names())}"
    )
  kwargs = {k: v for k, v in cfg.items() if k != "name" and v is not None}
  # The registry hands out instances, not factories; built-in names are the
  # factories' own names, so their signatures tell which fields apply.
  factory = getattr(gradcomp, name, None)
  if callable(factory):
    accepted = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
      dropped = sorted(set(kwargs) - set(accepted))
      for key in dropped:
        logging.warning(
          "compressor %s takes no %r; ignoring config.compressor.%s=%r",
          name,
          key,
          key,
          kwargs.pop(key),
        )
  return gradcomp.get(name, axis_name=axis_name, **kwargs)


def _same_on_every_process(plan: gradcomp.Plan) -> gradcomp.Plan:
  """Process 0's plan: profiles measured by each process may differ."""
  if jax.process_count() == 1:
    return plan
  from jax.experimental import multihost_utils

  starts = np.zeros(plan.num_leaves, np.int32)
  starts[list(plan.boundaries)] = 1
  starts = np.asarray(multihost_utils.broadcast_one_to_all(starts))
  return gradcomp.Plan.from_boundaries(plan.order, np.flatnonzero(starts).tolist())


def num_workers(config) -> int:
  """``config.workers`` (the run's first devices), or every device if unset."""
  workers = config.get("workers")
  if workers is None:
    return jax.device_count()
  if isinstance(workers, bool) or not isinstance(workers, int):
    raise ValueError(f"config.workers must be an integer, got {workers!r}")
  if not 1 <= workers <= jax.device_count():
    raise ValueError(
      f"config.workers must be in [1, {jax.device_count()}] (the devices), got {workers}"
    )
  if workers != jax.device_count() and jax.process_count() > 1:
    raise ValueError("config.workers below the device count runs in one process only")
  return workers


def cluster_of(config, workers: int) -> gradcomp.sim.Cluster:
  """The described cluster of ``config.cluster`` (defaults: homogeneous, 20 Gbps).

  Every set field is a ``gradcomp.sim.Cluster`` keyword, ``allreduce`` (and its
  ``servers``, ``colocated``, ``workers_per_node``, intra-node link) among
  them, so ``--config.cluster.allreduce=rabenseifner`` prices the run's
  all-reduces by that algorithm.
  """
  cfg = config.get("cluster") or {}
  kwargs = {k: v for k, v in dict(cfg).items() if v is not None}
  if "speeds" in kwargs:
    kwargs["speeds"] = tuple(float(v) for v in kwargs["speeds"])
  try:
    return gradcomp.sim.Cluster(workers, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.cluster: {e}") from e


def fusion_plan(
  cfg,
  order: Sequence[int],
  sizes: Sequence[int] | None = None,
  inner=None,
  saved: gradcomp.Plan | None = None,
  cluster: gradcomp.sim.Cluster | None = None,
) -> gradcomp.Plan | None:
  """The ``layerfusion`` plan of ``cfg.plan``, or ``None`` for no fusion.

  Every plan is built here as a :class:`gradcomp.Plan` over the gradient-ready
  ``order``, so the run's plan can be saved as JSON. ``"auto"`` (paper 000
  §4.3) needs the leaf ``sizes`` and the ``inner`` compressor: its profile is
  measured on this backend up to the model's size, and the plan is chosen
  for ``cluster`` (the run's ``config.cluster``; default
  ``Cluster(jax.device_count())``) with ``cfg.search``. A measured
  profile varies between runs, so a resumed run passes the plan it ``saved``
  (the checkpointed state is shaped by it), and with several processes all
  take process 0's (only process 0 profiles). ``"none"`` skips the wrapper
  (the compressor sees the parameter tree itself, in tree order).
  """
  plan = cfg.plan
  if plan == "layerwise":
    return gradcomp.Plan.layerwise(order)
  if plan == "single":
    return gradcomp.Plan.single(order)
  if plan == "auto":
    if saved is None or saved.order != tuple(order):
      if sizes is None or inner is None:
        raise ValueError(
          "config.fusion.plan='auto' needs the leaf sizes and compressor"
        )
      if jax.process_index() == 0:
        profile = gradcomp.fusion.profile_for(inner, up_to=sum(sizes))
        cluster = cluster or gradcomp.sim.Cluster(jax.device_count())
        saved = gradcomp.fusion.auto_plan(
          sizes, order, profile, cluster, method=cfg.search
        )
      else:  # Replaced by process 0's plan below: no need to profile.
        saved = gradcomp.Plan.single(order)
    # A saved plan too: every process joins the broadcast even when only some
    # read a plan.json (one being rewritten by process 0, an unshared disk).
    return _same_on_every_process(saved)
  if plan == "none":
    return None
  raise ValueError(
    f"unknown fusion plan {plan!r} (config.fusion.plan); valid: "
    "layerwise, single, auto, none"
  )


def learning_rate(cfg, total_steps: int) -> optax.ScalarOrSchedule:
  """``cfg.learning_rate``: constant, cosine-decayed, or warmed up then cosine-decayed.

  ``warmup_cosine`` rises linearly from 0 over ``cfg.warmup_steps`` and decays
  to ``cfg.min_learning_rate_ratio`` of the peak by the run's last step
  (``optax.warmup_cosine_decay_schedule``).
  """
  if cfg.schedule == "constant":
    return cfg.learning_rate
  if cfg.schedule == "cosine":
    return optax.cosine_decay_schedule(cfg.learning_rate, max(total_steps, 1))
  if cfg.schedule == "warmup_cosine":
    warmup = int(cfg.get("warmup_steps") or 0)
    if not 0 <= warmup < max(total_steps, 1):
      raise ValueError(
        f"config.optimizer.warmup_steps must be in [0, {max(total_steps, 1)}) "
        f"(the run's steps), got {warmup}"
      )
    return optax.warmup_cosine_decay_schedule(
      0.0,
      cfg.learning_rate,
      warmup,
      max(total_steps, 1),
      end_value=cfg.learning_rate * cfg.get("min_learning_rate_ratio", 0.0),
    )
  raise ValueError(
    f"unknown schedule {cfg.schedule!r} (config.optimizer.schedule); valid: "
    "constant, cosine, warmup_cosine"
  )


#: The worker's optimizer by ``config.optimizer.name``.
OPTIMIZERS = ("sgd", "adamw")


def decay_mask(params):
  """Weight decay on matrices and embeddings only, not on norms and biases.

  GPT-2's and nanoGPT's rule: a leaf of rank >= 2 is decayed; LayerNorm
  scales and offsets and every bias (rank 1) are not.
  """
  return jax.tree.map(lambda p: np.ndim(p) >= 2, params)


def local_optimizer(cfg, total_steps: int) -> list[optax.GradientTransformation]:
  """The chain after the exchange: [clipping], then SGD (+ weight decay) or AdamW.

  ``cfg.clip_norm`` clips the global norm of the exchanged (mean) gradient.
  ``sgd`` adds ``cfg.weight_decay * params`` to every leaf, then SGD with
  momentum; ``adamw`` is ``optax.adamw`` with decoupled weight decay masked by
  :func:`decay_mask` (Loshchilov & Hutter 2019).

  Raises:
    ValueError: an unknown ``cfg.name`` or schedule, or a non-positive clip norm.
  """
  name = cfg.get("name", "sgd")
  parts = []
  clip = cfg.get("clip_norm")
  if clip is not None:
    if not clip > 0:
      raise ValueError(f"config.optimizer.clip_norm must be > 0 or None, got {clip}")
    parts.append(optax.clip_by_global_norm(clip))
  lr = learning_rate(cfg, total_steps)
  if name == "sgd":
    if cfg.weight_decay:
      parts.append(optax.add_decayed_weights(cfg.weight_decay))
    parts.append(optax.sgd(lr, momentum=cfg.momentum, nesterov=cfg.nesterov))
  elif name == "adamw":
    parts.append(
      optax.adamw(
        lr,
        b1=cfg.get("b1", 0.9),
        b2=cfg.get("b2", 0.999),
        eps=cfg.get("eps", 1e-8),
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
      )
    )
  else:
    raise ValueError(
      f"unknown optimizer {name!r} (config.optimizer.name); valid: "
      f"{', '.join(OPTIMIZERS)}"
    )
  return parts


#: Training schemes by ``config.scheme.name`` (DESIGN §5); ``none`` is
#: synchronous data parallelism.
SCHEMES = {
  "local_sgd": gradcomp.local_sgd,
  "easgd": gradcomp.easgd,
  "cdsgd": gradcomp.cdsgd,
  "gossip": gradcomp.gossip,
  "gosgd": gradcomp.gosgd,
  "async_ps": gradcomp.async_ps,
  "backup_workers": gradcomp.backup_workers,
  "stale_sgd": gradcomp.stale_sgd,
  # Paper 002: GoSGD whose epochs train/edgegossip.py balances and orders.
  "edgegossip": gradcomp.gosgd,
}

#: Schemes whose factory takes the workers' ``speeds`` (from ``config.cluster``).
TIMED_SCHEMES = ("async_ps", "backup_workers")
#: Fields of ``config.scheme`` that build ``outer`` (DiLoCo's Nesterov SGD)
#: rather than being keywords of the factory.
_OUTER_FIELDS = ("outer_learning_rate", "outer_momentum")


def scheme_name(config) -> str:
  """``config.scheme.name``; configs written before schemes existed are ``none``."""
  scheme = config.get("scheme")
  name = "none" if scheme is None else scheme.name
  if name != "none" and name not in SCHEMES:
    raise ValueError(
      f"unknown scheme {name!r} (config.scheme.name); valid: none, {', '.join(SCHEMES)}"
    )
  return name


def round_steps(config) -> Callable[[int], bool]:
  """Which training steps (1-based) exchange: ``step -> bool``.

  Synchronous training, CD-SGD, gossip and GoSGD exchange every step (the
  last two with neighbours only, no barrier); local SGD after every
  ``every``-th step; EASGD on steps ``1, 1 + every, ...`` (its count before
  the step is a multiple of ``every``).
  """
  name = scheme_name(config)
  every = config.scheme.get("every") if name != "none" else None
  every = every or 1
  if name == "local_sgd":
    return lambda step: step % every == 0
  if name == "easgd":
    return lambda step: (step - 1) % every == 0
  return lambda step: True


def cdsgd_exchanges(config) -> Callable[[int], str]:
  """What CD-SGD's step ``t`` (1-based) puts on the wire: ``"full"`` or ``"compressed"``.

  The program's exchange, as ``gradcomp.cdsgd`` runs it: warm-up steps
  ``1 .. n - 1`` all-reduce their gradient; every later step exchanges the
  message of the step before, in full precision when ``(t - 1 - n) % k ==
  0`` (the switch step's message and every ``k``-th after it). The first
  formal step has no message yet and still runs its exchange (of zeros),
  so it is counted. Without a compressor every exchange is full.
  """
  cfg = config.scheme
  n, k = cfg.warmup_steps, cfg.get("k") or 2
  compressed = config.compressor.name != "none" and k > 1

  def kind(step: int) -> str:
    if not compressed or step < n or (step - 1 - n) % k == 0:
      return "full"
    return "compressed"

  return kind


def _scheme(config, local, compressor_tx, axis_name, speeds=None):
  """``SCHEMES[name](local, ...)`` with the set fields of ``config.scheme``.

  ``speeds`` (a ``(steps, workers)`` table of the described cluster) goes to
  the schemes of :data:`TIMED_SCHEMES`.
  """
  name = scheme_name(config)
  factory = SCHEMES[name]
  cfg = config.scheme
  kwargs = {
    k: v
    for k, v in cfg.items()
    if k != "name" and k not in _OUTER_FIELDS and v is not None
  }
  if name == "edgegossip":
    kwargs = {k: v for k, v in kwargs.items() if k not in edgegossip_lib.FIELDS}
  if name in TIMED_SCHEMES:
    if speeds is None:
      raise ValueError(f"scheme {name} needs the workers' speeds (config.cluster)")
    kwargs["speeds"] = speeds
  accepted = inspect.signature(factory).parameters
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
  return factory(local, axis_name=axis_name, **kwargs)


def create(
  config,
  order: Sequence[int],
  total_steps: int,
  axis_name: str | None,
  sizes: Sequence[int] | None = None,
  saved_plan: gradcomp.Plan | None = None,
  mask=None,
  speeds=None,
) -> tuple[optax.GradientTransformation, gradcomp.Plan | None]:
  """The run's optimizer and its fusion plan.

  Args:
    config: the run's config (``compressor``, ``fusion``, ``optimizer``).
    order: gradient-ready order of the parameter leaves
      (``gradcomp.fusion.gradient_order``); with ``mask``, of the leaves it keeps
      (``train.factors.Factored.restrict``).
    total_steps: steps of the run, for decaying schedules.
    axis_name: the workers' mesh axis, or ``None`` on one device.
    sizes: values per parameter leaf (tree order), for ``plan="auto"``.
    saved_plan: the plan of the run being resumed, reused by ``"auto"``.
    mask: ``optax.masked``'s mask of the compressor (with its fusion), or
      ``None``: leaves it maps to ``False`` (kernels whose sufficient factors
      the step exchanges, ``train/factors.py``) skip it, already the mean.
    speeds: the described cluster's ``(steps, workers)`` speed table
      (``pricing.speed_table``), for ``async_ps`` and ``backup_workers``.

  Returns:
    ``(tx, plan)``: ``tx``'s state is an ``optax.ApplyIfFiniteState``.
  """
  inner = compressor(config.compressor, axis_name)
  cluster = cluster_of(config, num_workers(config))
  plan = fusion_plan(config.fusion, order, sizes, inner, saved_plan, cluster)
  if plan is not None:
    inner = gradcomp.layerfusion(inner, plan)
  if mask is not None:
    inner = optax.masked(inner, mask)
  parts = local_optimizer(config.optimizer, total_steps)
  if scheme_name(config) == "none":
    tx = optax.chain(inner, *parts)
  elif scheme_name(config) in ("gossip", "async_ps"):
    # CHOCO and the server's pushes rebuild the codec for their exchange
    # (neighbours, pushes), per leaf: no fusion.
    codec = (
      None
      if config.compressor.name == "none"
      else compressor(config.compressor, axis_name)
    )
    tx = _scheme(config, optax.chain(*parts), codec, axis_name, speeds)
  else:
    # The dense mean is the scheme's own default: no compressor in between.
    pseudo = None if config.compressor.name == "none" else inner
    tx = _scheme(config, optax.chain(*parts), pseudo, axis_name, speeds)
  tx = gradcomp.apply_if_finite(tx, _NEVER_FORCE, axis_name=axis_name)
  return tx, plan


def round_exchange(
  config, axis_name: str, plan: gradcomp.Plan | None
) -> optax.GradientTransformation:
  """What one exchange of the run sends, as a transformation of the params' tree.

  Synchronous training, local SGD and CD-SGD's compressed steps: the
  compressor (inside LayerFusion with ``plan``); EASGD (and local SGD with
  ``none``): the dense mean. The
  training program reads its wire bytes from the compiled HLO to price a
  round and to amortise the bytes per step.
  """
  if scheme_name(config) == "easgd" or config.compressor.name == "none":
    return gradcomp.none(axis_name)
  tx = compressor(config.compressor, axis_name)
  return tx if plan is None else gradcomp.layerfusion(tx, plan)


def global_weights(opt_state):
  """CD-SGD's global weights :math:`W` in the run's optimizer state.

  ``opt_state`` is what :func:`create`'s ``tx`` keeps: an
  ``optax.ApplyIfFiniteState`` around ``gradcomp.CDSGDState``.
  """
  return opt_state.inner_state.global_params


def staleness_histogram(opt_state) -> np.ndarray:
  """``async_ps``'s staleness histogram (one worker's replica) in the run's state.

  ``opt_state`` is an ``optax.ApplyIfFiniteState`` around
  ``gradcomp.AsyncPSState``, its leaves with a leading worker axis.
  """
  hist = np.asarray(jax.device_get(opt_state.inner_state.staleness))
  return hist.reshape(-1, hist.shape[-1])[0]
