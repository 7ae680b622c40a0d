"""The optimizer's parts of a config: compressor, LayerFusion plan, SGD, AdamW or Muon.

``train/schemes/`` puts them together, each scheme its own way (its
``build_optimizer``).

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

Two fields make one protocol for every method (DESIGN §11, the transformer
study ``bench/study.py`` sets both): ``config.optimizer.clip_scope``
(:func:`clip_scope`) says whose gradient ``clip_norm`` clips, and
``config.optimizer.mask_decay`` (:func:`decay_mask_of`) which leaves weight
decay reaches. Both are placeholders: unset, every method does what it did
before they existed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from absl import logging

import gradcomp
from gradcomp.compressors import warmup as warmup_lib
from gradcomp.optimizers import compressed_adam as compressed_adam_lib
from gradcomp.optimizers import zero_one_adam as zero_one_adam_lib
from train import mesh as mesh_lib

#: Fields of ``config.compressor`` that are the program's, not the factory's.
PROGRAM_FIELDS = ("hierarchical", "warmup_steps")
#: ``config.fusion.exchange``: the compressor's own form, or one per group.
FUSION_EXCHANGES = ("inner", "auto")


def compressor(cfg, axis_name: str | None) -> optax.GradientTransformation:
  """``gradcomp.get(cfg.name, axis_name=..., **set fields of cfg)``.

  Fields of ``cfg`` other than ``name`` (and :data:`PROGRAM_FIELDS`, read by
  :func:`mesh_spec`) are keyword arguments; ``None`` ones
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
  skip = ("name", *PROGRAM_FIELDS)
  kwargs = {k: v for k, v in cfg.items() if k not in skip and v is not None}
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


def warmup_steps(config) -> int:
  """``config.compressor.warmup_steps``: dense updates before the compressor's (0 unset).

  Raises:
    ValueError: a value that is not an integer ``>= 0``.
  """
  steps = config.compressor.get("warmup_steps")
  if steps is None:
    return 0
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ValueError(
      f"config.compressor.warmup_steps must be an integer >= 0, got {steps!r}"
    )
  return steps


def check_warmup(config, scheme: str) -> None:
  """Raises ``ValueError`` unless ``config.compressor.warmup_steps`` can run as set.

  The warm-up (``gradcomp.compressors.warmup.dense_warmup`` around the fused
  compressor) runs in synchronous training on a ``data=N`` mesh, where the
  program prices its two phases apart; not with an optimizer that exchanges
  its own momentum (``compressed_adam``'s warm-up is its ``freeze_step``)
  nor with sufficient factors.
  """
  steps = warmup_steps(config)
  if not steps:
    return
  where = f"config.compressor.warmup_steps={steps}"
  if scheme != "none":
    raise ValueError(
      f"{where} warms up synchronous training only (config.scheme.name=none), "
      f"not {scheme!r}"
    )
  if exchanges_itself(config.optimizer):
    hint = (
      "; its dense warm-up is config.optimizer.freeze_step"
      if config.optimizer.name in CODEC_OPTIMIZERS
      else ""
    )
    raise ValueError(
      f"{where} does not apply to config.optimizer.name={config.optimizer.name}{hint}"
    )
  if config.get("sufficient_factors"):
    raise ValueError(f"{where} does not run with config.sufficient_factors")
  if config.get("mesh") is not None and len(mesh_spec(config).names) > 1:
    raise ValueError(
      f"{where} runs on a data=N mesh only (its phases are priced on one "
      f"link), not config.mesh={config.mesh!r}"
    )


def warmed(config, fused, axis_name) -> optax.GradientTransformation:
  """``fused`` (the compressor, inside LayerFusion) after the config's dense warm-up.

  ``gradcomp.compressors.warmup.dense_warmup(fused, warmup_steps)``, or
  ``fused`` itself when no warm-up is set. Outside LayerFusion, so the plan
  is the compressor's own (``"auto"`` profiles the bare compressor).
  """
  steps = warmup_steps(config)
  if not steps:
    return fused
  return warmup_lib.dense_warmup(fused, steps, axis_name=axis_name)


def _same_on_every_process(plan: gradcomp.Plan) -> gradcomp.Plan:
  """Process 0's plan: profiles measured by each process may differ."""
  if jax.process_count() == 1:
    return plan
  from jax.experimental import multihost_utils

  # Per position in gradient order: 1 where a group starts; and each
  # group's form (index into FORMS, -1 for none) at its first position.
  starts = np.zeros(plan.num_leaves, np.int32)
  starts[list(plan.boundaries)] = 1
  forms = np.full(plan.num_leaves, -1, np.int32)
  if plan.forms is not None and plan.num_leaves:
    firsts = [0, *plan.boundaries]
    forms[firsts] = [gradcomp.fusion.FORMS.index(f) for f in plan.forms]
  starts, forms = (
    np.asarray(a) for a in multihost_utils.broadcast_one_to_all((starts, forms))
  )
  agreed = gradcomp.Plan.from_boundaries(plan.order, np.flatnonzero(starts).tolist())
  if forms.size == 0 or forms[0] < 0:
    return agreed
  firsts = [0, *agreed.boundaries]
  return agreed.with_forms([gradcomp.fusion.FORMS[i] for i in forms[firsts]])


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


def mesh_spec(config) -> mesh_lib.MeshSpec:
  """The run's mesh: ``config.mesh`` over :func:`num_workers` workers (``train/mesh.py``).

  Unset, ``data=<workers>``; ``config.compressor.hierarchical`` names the
  fast axis a compressor reduce-scatters over.

  Raises:
    ValueError: a bad ``config.mesh`` or ``config.compressor.hierarchical``.
  """
  return mesh_lib.parse(
    config.get("mesh"), num_workers(config), config.compressor.get("hierarchical")
  )


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
  ``cfg.exchange="auto"`` (with ``"auto"``) also gives each group its
  exchange form, gathered or reduce-scattered, in :attr:`gradcomp.Plan.forms`
  (``layerfusion(..., exchange="auto")``; a codec with an ``exchange=``
  keyword); ``"inner"``: the compressor's own form everywhere.
  """
  plan, exchange = cfg.plan, cfg.get("exchange") or "inner"
  if exchange not in FUSION_EXCHANGES:
    raise ValueError(
      f"config.fusion.exchange must be one of {FUSION_EXCHANGES}, got {exchange!r}"
    )
  if exchange == "auto" and plan != "auto":
    raise ValueError(
      "config.fusion.exchange='auto' chooses each group's form with the cost "
      f"model: it needs config.fusion.plan='auto', got {plan!r}"
    )
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
        cluster = cluster or gradcomp.sim.Cluster(jax.device_count())
        if exchange == "auto":  # both forms priced; each group takes one
          in_form = gradcomp.fusion.in_forms(inner)
          profile = {
            form: gradcomp.fusion.profile_for(
              in_form(form), up_to=sum(sizes), workers=cluster.workers
            )
            for form in gradcomp.fusion.FORMS
          }
        else:
          profile = gradcomp.fusion.profile_for(
            inner, up_to=sum(sizes), workers=cluster.workers
          )
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
OPTIMIZERS = ("sgd", "adamw", "muon")
#: Optimizers that exchange, and compress, their own momentum
#: (``gradcomp.optimizers``): used alone, on each worker's own gradient.
SELF_EXCHANGING = ("onebit_adam", "zero_one_adam", "demo", "compressed_adam")
#: Self-exchanging optimizers whose exchange is ``config.compressor``'s codec
#: (inside LayerFusion with ``config.fusion``'s plan).
CODEC_OPTIMIZERS = ("compressed_adam",)
#: Self-exchanging optimizers with a warm-up then a frozen variance
#: (``config.optimizer.freeze_step``; their warm-up's ``warmup_bits``).
FROZEN_VARIANCE = ("onebit_adam", "compressed_adam")
#: ``config.optimizer.warmup_bits``: the int_quantize codes a warm-up may send.
WARMUP_BITS = (4, 8)
#: 0/1 Adam's schedule fields of ``config.optimizer`` (unset: DeepSpeed's).
_ZERO_ONE_FIELDS = (
  "var_freeze_step",
  "var_update_scaler",
  "local_step_scaler",
  "local_step_clipper",
)


#: ``config.optimizer.clip_scope``: whose gradient ``clip_norm`` clips.
CLIP_SCOPES = ("worker", "mean")


def clip_scope(config, scheme) -> str:
  """Whose gradient ``config.optimizer.clip_norm`` clips: ``"worker"`` or ``"mean"``.

  ``config.optimizer.clip_scope``:

  - ``"worker"``: every worker clips its own gradient's global norm to
    ``clip_norm`` before anything is exchanged or compressed. In
    synchronous training the clip sits before the compressor
    (:func:`worker_clipped`) and the exchanged mean is not clipped again;
    an optimizer that exchanges its own momentum (:data:`SELF_EXCHANGING`)
    and the inner optimizer of a scheme whose ``optimizer_steps_on`` is
    ``"worker"`` (DiLoCo's, MuLoCo's, SparseLoCo's inner steps) clip there
    already. The
    one rule every method can follow: the transformer study
    (``bench/study.py``, DESIGN §11) sets it.
  - ``"mean"``: synchronous training clips the exchanged mean, after the
    compressor (what its chains did before the field existed); so do the
    schemes whose ``config.optimizer`` steps on a mean (``cdsgd``'s server,
    ``stale_sgd``, ``async_ps``, ``backup_workers``).
  - unset (a placeholder, so the configs of earlier runs are unchanged):
    each method as before the field existed, ``"mean"`` for synchronous
    chains and the mean-stepping schemes, ``"worker"`` for the others.

  Args:
    config: the run's config.
    scheme: the run's scheme class or instance
      (``train.schemes.base.Scheme``): its ``name`` and whether its
      optimizer steps on each worker's own gradient or on an exchanged one
      (``optimizer_steps_on``).

  Raises:
    ValueError: a scope not in :data:`CLIP_SCOPES`, or one the method cannot
      follow (``"mean"`` where no mean gradient exists, ``"worker"`` where a
      scheme exchanges before its optimizer steps), naming the field.
  """
  cfg = config.optimizer
  scope = cfg.get("clip_scope")
  own = exchanges_itself(cfg) or scheme.optimizer_steps_on == "worker"
  scheme = scheme.name
  natural = "worker" if own else "mean"
  if scope is None:
    return natural
  if scope not in CLIP_SCOPES:
    raise ValueError(
      f"config.optimizer.clip_scope must be one of {CLIP_SCOPES} or unset, "
      f"got {scope!r}"
    )
  if scope == natural or (scheme == "none" and not own):
    return scope
  if scope == "mean":
    what = (
      f"config.optimizer.name={cfg.name} steps on each worker's own gradient"
      if exchanges_itself(cfg)
      else f"scheme {scheme}'s optimizer steps on each worker's own gradient"
    )
    raise ValueError(
      f"config.optimizer.clip_scope='mean' clips an exchanged mean gradient, "
      f"but {what}: use 'worker' (or leave it unset)"
    )
  raise ValueError(
    f"config.optimizer.clip_scope='worker' clips each worker's gradient before "
    f"the exchange, but scheme {scheme} exchanges inside itself and steps "
    "config.optimizer on the result: use 'mean' (or leave it unset)"
  )


def check_clip_scope(config, scheme) -> None:
  """Raises ``ValueError`` unless ``config.optimizer.clip_scope`` can run as set.

  :func:`clip_scope`'s checks; and a synchronous chain clips each worker's
  gradient on a ``data=N`` mesh only, without sufficient factors (the
  clip's norm is over the whole gradient the compressor sees).
  """
  clip_scope(config, scheme)
  if not clips_before_exchange(config, scheme):
    return
  where = "config.optimizer.clip_scope='worker'"
  if config.get("sufficient_factors"):
    raise ValueError(f"{where} does not run with config.sufficient_factors")
  if config.get("mesh") is not None and len(mesh_spec(config).names) > 1:
    raise ValueError(
      f"{where} clips before the compressor on a data=N mesh only, not "
      f"config.mesh={config.mesh!r}"
    )


def clips_before_exchange(config, scheme) -> bool:
  """Whether synchronous training clips each worker's gradient before its compressor.

  ``config.optimizer.clip_scope="worker"`` with ``clip_norm`` set, scheme
  ``none``, and an optimizer that does not exchange itself: then
  :func:`worker_clipped` clips before the exchange and the local optimizer
  (``local_optimizer(..., clip=False)``) does not clip the mean.
  """
  cfg = config.optimizer
  return (
    scheme.name == "none"
    and not exchanges_itself(cfg)
    and cfg.get("clip_norm") is not None
    and clip_scope(config, scheme) == "worker"
  )


def worker_clipped(config, scheme, fused) -> optax.GradientTransformation:
  """``fused`` (the exchange) after each worker clips its own gradient, if it must.

  ``chain(clip_by_global_norm(clip_norm), fused)`` when
  :func:`clips_before_exchange`, else ``fused`` itself (the same
  transformation and state as before ``clip_scope`` existed).
  """
  if not clips_before_exchange(config, scheme):
    return fused
  return optax.chain(*_clipping(config.optimizer), fused)


def decay_mask_of(cfg, default):
  """The weight-decay mask ``config.optimizer.mask_decay`` gives an optimizer.

  ``True``: :func:`decay_mask` (AdamW's: matrices and embeddings decayed,
  norms and biases not) for every optimizer, DeMo and SGD included; the
  transformer study sets it. ``False``: no mask, every leaf decayed.
  Unset (a placeholder, so earlier runs' configs are unchanged):
  ``default``, each optimizer's mask before the field existed
  (:func:`decay_mask` for AdamW, Muon and the Adam family, ``None`` for SGD
  and DeMo, whose reference decays every leaf).

  Raises:
    ValueError: a value that is not ``True``, ``False`` or unset.
  """
  mask = cfg.get("mask_decay")
  if mask is None:
    return default
  if not isinstance(mask, bool):
    raise ValueError(
      f"config.optimizer.mask_decay must be True, False or unset, got {mask!r}"
    )
  return decay_mask if mask else None


def muon(cfg, learning_rate, mask) -> optax.GradientTransformation:
  """``optax.contrib.muon`` with ``config.optimizer``'s fields (MuLoCo's inner optimizer).

  Muon (Jordan et al. 2024): Nesterov momentum ``beta`` (``cfg.beta``,
  unset: 0.95, the paper's and optax's) orthogonalised by five
  Newton-Schulz steps for each 2-D leaf, scaled by
  ``sqrt(max(1, fan_out / fan_in))``; every other leaf (biases, norms,
  leaves of rank 3 and more) steps with optax's fallback, AdamW with
  Nesterov momentum, at the same learning rate, ``b1``, ``b2`` and ``eps``
  from ``cfg``: as ``optax.contrib.muon`` does it. Weight decay ``cfg.weight_decay`` on the
  2-D leaves ``mask`` decays (``None``: all of them); the AdamW fallback
  takes no mask, so it decays its leaves only when ``mask`` is ``None``
  (with :func:`decay_mask` its leaves of rank 1 are undecayed, as AdamW's
  mask wants; a rank-3+ leaf, which that mask would decay, is not).
  Thérien et al. 2025 (MuLoCo, arXiv 2505.23725) use it as DiLoCo's inner
  optimizer: ``config.scheme.name=local_sgd`` (``configs/muloco.py``).

  Raises:
    ValueError: ``cfg.beta`` outside [0, 1).
  """
  return optax.contrib.muon(
    learning_rate,
    beta=_muon_beta(cfg),
    eps=cfg.get("eps", 1e-8),
    weight_decay=cfg.weight_decay,
    weight_decay_mask=mask,
    adam_b1=cfg.get("b1", 0.9),
    adam_b2=cfg.get("b2", 0.999),
    adam_weight_decay=cfg.weight_decay if mask is None else 0.0,
  )


def _muon_beta(cfg) -> float:
  """Muon's momentum ``cfg.beta`` (unset: 0.95); raises ``ValueError`` outside [0, 1)."""
  beta = cfg.get("beta")
  beta = 0.95 if beta is None else beta
  if not 0.0 <= beta < 1.0:
    raise ValueError(f"config.optimizer.beta (muon) must be in [0, 1), got {beta}")
  return beta


def _clipping(cfg, shards=None) -> list[optax.GradientTransformation]:
  """``[clip_by_global_norm(cfg.clip_norm)]``, or ``[]`` when unset.

  With ``shards`` (``train.mesh.ShardedParams``) each device clips its
  shards by the norm of the whole gradient (``train.mesh.clip_by_global_norm``).

  Raises:
    ValueError: a clip norm that is not positive.
  """
  clip = cfg.get("clip_norm")
  if clip is None:
    return []
  if not clip > 0:
    raise ValueError(f"config.optimizer.clip_norm must be > 0 or None, got {clip}")
  if shards is not None:
    return [mesh_lib.clip_by_global_norm(clip, shards.axis)]
  return [optax.clip_by_global_norm(clip)]


def exchanges_itself(cfg) -> bool:
  """Whether ``config.optimizer`` names an optimizer that does its own exchange."""
  return cfg.get("name", "sgd") in SELF_EXCHANGING


def check_self_exchanging(config, scheme) -> None:
  """Raises ``ValueError`` unless a self-exchanging optimizer runs as it must.

  Synchronous data parallelism only, no compressor before it (it compresses
  its own exchange; ``compressed_adam``'s codec is ``config.compressor``),
  no sufficient factors, and its required fields set. Also checks
  ``config.compressor.warmup_steps`` (:func:`check_warmup`),
  ``config.optimizer.clip_scope`` (:func:`check_clip_scope`),
  ``config.optimizer.mask_decay`` (:func:`decay_mask_of`), Muon's mesh and
  the quantized warm-up's fields (:func:`_check_warmup_codes`).
  """
  check_warmup(config, scheme.name)
  check_clip_scope(config, scheme)
  scheme = scheme.name
  cfg = config.optimizer
  decay_mask_of(cfg, None)
  if cfg.get("name") == "muon":
    _muon_beta(cfg)
  if cfg.get("name") == "muon" and config.get("mesh") is not None:
    if mesh_spec(config).fsdp is not None:
      raise ValueError(
        "config.optimizer.name=muon orthogonalises whole matrices: not on an "
        f"FSDP mesh (config.mesh={config.mesh!r}), whose optimizer sees shards"
      )
  _check_warmup_codes(cfg)
  if not exchanges_itself(cfg):
    return
  name = cfg.name
  if scheme != "none":
    raise ValueError(
      f"config.optimizer.name={name} exchanges its own momentum: synchronous "
      f"training only (config.scheme.name=none), not {scheme!r}"
    )
  if config.compressor.name != "none" and name not in CODEC_OPTIMIZERS:
    raise ValueError(
      f"config.optimizer.name={name} compresses its own exchange: set "
      f"config.compressor.name=none (got {config.compressor.name!r})"
    )
  if config.get("sufficient_factors"):
    raise ValueError(f"config.optimizer.name={name} does not take sufficient factors")
  if name in FROZEN_VARIANCE and cfg.get("freeze_step") is None:
    raise ValueError(
      f"config.optimizer.name={name} needs config.optimizer.freeze_step (the "
      "dense AdamW updates before the variance freezes; Tang et al. warm up for "
      "about 15-25 % of a run); e.g. --config.optimizer.freeze_step=100"
    )
  freeze = cfg.get("freeze_step")
  if name in FROZEN_VARIANCE and (
    isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 1
  ):
    raise ValueError(
      f"config.optimizer.freeze_step must be an integer >= 1, got {freeze!r}"
    )


def _check_warmup_codes(cfg) -> None:
  """Raises ``ValueError`` unless ``warmup_bits`` / ``warmup_block_size`` can run as set."""
  bits = cfg.get("warmup_bits")
  if bits is not None and cfg.get("name") not in FROZEN_VARIANCE:
    raise ValueError(
      f"config.optimizer.warmup_bits is the warm-up of {' and '.join(FROZEN_VARIANCE)}"
      f", not of {cfg.get('name')}: unset it"
    )
  if bits is not None and (isinstance(bits, bool) or bits not in WARMUP_BITS):
    raise ValueError(
      f"config.optimizer.warmup_bits must be one of {WARMUP_BITS} (unset: the "
      f"dense all-reduce), got {bits!r}"
    )
  block = cfg.get("warmup_block_size")
  if block is not None and bits is None:
    raise ValueError(
      "config.optimizer.warmup_block_size is the quantized warm-up's: set "
      "config.optimizer.warmup_bits too, or unset it"
    )
  if block is not None and (
    isinstance(block, bool) or not isinstance(block, int) or block < 1
  ):
    raise ValueError(
      f"config.optimizer.warmup_block_size must be an integer >= 1, got {block!r}"
    )


def self_exchanging(
  cfg, total_steps: int, axis_name, codec: optax.GradientTransformation | None = None
) -> list[optax.GradientTransformation]:
  """The whole optimizer of ``cfg.name`` in :data:`SELF_EXCHANGING`, on local gradients.

  ``cfg.clip_norm`` clips each worker's own gradient (there is no mean
  gradient in the compressed phases to clip): ``clip_scope="worker"``,
  whether set or not. Weight decay by :func:`decay_mask_of`: unset, 1-bit,
  0/1 and compressed-momentum Adam mask it by :func:`decay_mask`, as
  AdamW's, and DeMo decays every leaf, as its reference does;
  ``mask_decay=True`` masks DeMo's too. ``codec``: ``compressed_adam``'s
  (:func:`momentum_codec`).
  """
  parts = _clipping(cfg)
  lr = learning_rate(cfg, total_steps)
  if cfg.name == "demo":
    # None leaves DeMo's own defaults (beta 0.999, chunk 64, top 32).
    kwargs = {
      k: cfg.get(k) for k in ("beta", "chunk", "topk") if cfg.get(k) is not None
    }
    mask = decay_mask_of(cfg, None)
    if mask is not None:  # Unset: the call as before mask existed.
      kwargs["mask"] = mask
    parts.append(
      gradcomp.demo(lr, weight_decay=cfg.weight_decay, axis_name=axis_name, **kwargs)
    )
    return parts
  adam = {
    "b1": cfg.get("b1", 0.9),
    "b2": cfg.get("b2", 0.999),
    "eps": cfg.get("eps", 1e-8),
    "weight_decay": cfg.weight_decay,
    "mask": decay_mask_of(cfg, decay_mask),
    "axis_name": axis_name,
  }
  if cfg.name == "zero_one_adam":
    parts.append(gradcomp.zero_one_adam(lr, **_zero_one_schedule(cfg), **adam))
    return parts
  frozen = {
    "freeze_step": int(cfg.freeze_step),
    "warmup_codec": warmup_codec(cfg, axis_name),
  }
  if cfg.name == "compressed_adam":
    if codec is None:
      raise ValueError("config.optimizer.name=compressed_adam needs its codec")
    parts.append(compressed_adam_lib.compressed_adam(lr, codec, **frozen, **adam))
  else:
    parts.append(gradcomp.onebit_adam(lr, **frozen, **adam))
  return parts


def warmup_codec(cfg, axis_name) -> optax.GradientTransformation | None:
  """The frozen-variance optimizers' warm-up exchange; ``None``: the dense all-reduce.

  ``config.optimizer.warmup_bits``: ``gradcomp.int_quantize(bits,
  block_size, exchange="scatter")`` (ZeRO++'s quantized reduce-scatter with
  LoCo's error feedback at each hop) on every leaf fused into one buffer, as
  1-bit Adam's own exchange flattens the momentum; ``block_size`` is
  ``config.optimizer.warmup_block_size`` (unset: int_quantize's 512). Smaller
  blocks cost 4 bytes a block and round finer: on gpt_tiny an int8 warm-up
  with blocks of 64 kept 1-bit Adam's final bpb where blocks of 512 lost
  2.4 % (BUILD_NOTES, "1-bit Adam").
  """
  bits = cfg.get("warmup_bits")
  if bits is None:
    return None
  block = (
    {}
    if cfg.get("warmup_block_size") is None
    else {"block_size": int(cfg.warmup_block_size)}
  )
  inner = gradcomp.int_quantize(
    int(bits), exchange="scatter", axis_name=axis_name, **block
  )
  return gradcomp.layerfusion(inner, "single")


def momentum_codec(
  config, order, sizes, saved_plan, axis_name
) -> tuple[optax.GradientTransformation, gradcomp.Plan | None]:
  """``compressed_adam``'s codec: ``config.compressor`` inside LayerFusion.

  The plan is ``config.fusion``'s over the momentum tree (shaped as the
  params, in gradient order), as a synchronous compressor's would be.

  Returns:
    ``(codec, plan)``: ``plan`` is ``None`` for ``config.fusion.plan=none``.
  """
  inner = compressor(config.compressor, axis_name)
  cluster = cluster_of(config, num_workers(config))
  plan = fusion_plan(config.fusion, order, sizes, inner, saved_plan, cluster)
  return (inner if plan is None else gradcomp.layerfusion(inner, plan)), plan


def exchange_phases(config, num_steps: int):
  """What each step of the run sends when that changes by phase, for pricing.

  :func:`self_exchange_rounds` for 1-bit and 0/1 Adam; for
  ``compressed_adam`` and for ``config.compressor.warmup_steps``,
  ``"dense"`` (the float32 all-reduce) through the warm-up and
  ``"compressed"`` (the codec's exchange) after it. A frozen-variance
  optimizer's warm-up with ``warmup_bits`` is ``"warmup"`` (its codec's
  exchange, :func:`warmup_codec`). ``None`` when every step sends the same.
  """
  cfg = config.optimizer
  phases = self_exchange_rounds(cfg, num_steps)
  if phases is not None:
    return phases
  warm = "dense"
  if exchanges_itself(cfg) and cfg.name in CODEC_OPTIMIZERS:
    dense, warm = int(cfg.freeze_step), _warmup_kind(cfg)
  elif not exchanges_itself(cfg) and warmup_steps(config):
    dense = warmup_steps(config)
  else:
    return None
  dense = min(dense, num_steps)
  kinds = [warm] * dense + ["compressed"] * (num_steps - dense)
  return kinds, {warm: 1, "compressed": 1}


def _warmup_kind(cfg) -> str:
  """A frozen-variance optimizer's warm-up steps: ``"dense"`` or ``"warmup"`` (its codec)."""
  return "dense" if cfg.get("warmup_bits") is None else "warmup"


def _zero_one_schedule(cfg) -> dict[str, int]:
  """The set schedule fields of 0/1 Adam (the rest keep DeepSpeed's defaults)."""
  return {k: int(cfg.get(k)) for k in _ZERO_ONE_FIELDS if cfg.get(k) is not None}


def self_exchange_rounds(cfg, num_steps: int):
  """What each step of a self-exchanging optimizer sends, for pricing.

  Returns ``(kinds, copies)``: ``kinds[t - 1]`` is ``"dense"`` (an
  all-reduce of the float32 gradient), ``"warmup"`` (1-bit Adam's warm-up
  through :func:`warmup_codec`), ``"onebit"`` (the two-stage 1-bit
  all-reduce) or ``"none"`` for steps ``1 .. num_steps``; ``copies`` how
  many times each kind's collectives appear in the compiled step (once per
  branch that runs them). ``None`` for an optimizer whose every step sends
  the same (DeMo's all-gather).
  """
  if cfg.name == "onebit_adam":
    freeze = min(int(cfg.freeze_step), num_steps)
    warm = _warmup_kind(cfg)
    kinds = [warm] * freeze + ["onebit"] * (num_steps - freeze)
    return kinds, {warm: 1, "onebit": 1}
  if cfg.name == "zero_one_adam":
    kinds = zero_one_adam_lib.exchange_schedule(num_steps, **_zero_one_schedule(cfg))
    # The 1-bit exchange runs in two branches: between variance steps, and
    # at a synchronisation after the freeze.
    return kinds, {"dense": 1, "onebit": 2}
  return None


def decay_mask(params):
  """Weight decay on matrices and embeddings only, not on norms and biases.

  GPT-2's and nanoGPT's rule: a leaf of rank >= 2 is decayed; LayerNorm
  scales and offsets and every bias (rank 1) are not.
  """
  return jax.tree.map(lambda p: np.ndim(p) >= 2, params)


def local_optimizer(
  cfg, total_steps: int, shards: mesh_lib.ShardedParams | None = None, *, clip=True
) -> list[optax.GradientTransformation]:
  """The local optimizer: [clipping], then SGD (+ weight decay), AdamW or Muon.

  In synchronous training it steps on the exchanged mean; in a scheme
  whose ``optimizer_steps_on`` is ``"worker"``, on each worker's own
  gradient (the inner optimizer). ``cfg.clip_norm`` clips the global norm of what it receives,
  unless ``clip=False`` (synchronous training with
  ``clip_scope="worker"``, whose workers clipped before the compressor:
  :func:`clips_before_exchange`). ``sgd`` adds ``cfg.weight_decay * params``
  (to every leaf unless ``mask_decay=True``), then SGD with momentum;
  ``adamw`` is ``optax.adamw`` with decoupled weight decay masked by
  :func:`decay_mask` (Loshchilov & Hutter 2019); ``muon`` is
  ``optax.contrib.muon`` (:func:`muon`), masked the same way. Masks by
  :func:`decay_mask_of`.

  ``shards``: under FSDP (``train.mesh.ShardedParams``) the chain updates
  each device's 1-D shards of the mean gradient; clipping then sums the
  norm over the shards and the decay mask is the full params' (a shard of a
  matrix is decayed, of a bias not).

  Raises:
    ValueError: an unknown ``cfg.name`` or schedule, or a non-positive clip norm.
  """
  name = cfg.get("name", "sgd")
  parts = _clipping(cfg, shards) if clip else []
  lr = learning_rate(cfg, total_steps)

  def on_shards(mask):
    return mask if mask is None or shards is None else mask(shards.like)

  if name == "sgd":
    if cfg.weight_decay:
      mask = on_shards(decay_mask_of(cfg, None))
      parts.append(optax.add_decayed_weights(cfg.weight_decay, mask))
    parts.append(optax.sgd(lr, momentum=cfg.momentum, nesterov=cfg.nesterov))
  elif name == "adamw":
    parts.append(
      optax.adamw(
        lr,
        b1=cfg.get("b1", 0.9),
        b2=cfg.get("b2", 0.999),
        eps=cfg.get("eps", 1e-8),
        weight_decay=cfg.weight_decay,
        mask=on_shards(decay_mask_of(cfg, decay_mask)),
      )
    )
  elif name == "muon":
    if shards is not None:
      raise ValueError(
        "config.optimizer.name=muon orthogonalises whole matrices, not FSDP shards"
      )
    parts.append(muon(cfg, lr, decay_mask_of(cfg, decay_mask)))
  else:
    raise ValueError(
      f"unknown optimizer {name!r} (config.optimizer.name); valid: "
      f"{', '.join(OPTIMIZERS + SELF_EXCHANGING)}"
    )
  return parts


def scheme_name(config) -> str:
  """``config.scheme.name``; configs written before schemes existed are ``none``."""
  scheme = config.get("scheme")
  return "none" if scheme is None else scheme.name


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
  if name in ("local_sgd", "sparseloco"):
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


def round_exchange(
  config, axis_name: str, plan: gradcomp.Plan | None
) -> optax.GradientTransformation:
  """What one exchange of the run sends, as a transformation of the params' tree.

  Synchronous training, local SGD and CD-SGD's compressed steps: the
  compressor (inside LayerFusion with ``plan``); with ``none``, the dense
  mean. The
  training program reads its wire bytes from the compiled HLO to price a
  round and to amortise the bytes per step.
  """
  if config.compressor.name == "none":
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
