"""The optimizer of a config: compressor, LayerFusion plan, SGD, non-finite guard.

The chain is DESIGN §1's usage::

  apply_if_finite(chain(layerfusion(compressor, plan), [weight decay], sgd))

The compressor is chosen by name from gradcomp's registry (STYLE 10); its
exchange runs inside ``tx.update`` over ``axis_name``. ``apply_if_finite`` sits
outside everything, so a step whose gradient (or loss, see ``train/step.py``)
is non-finite on any worker leaves params, momentum and residuals untouched on
every worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import jax
import numpy as np
import optax
from absl import logging

import gradcomp

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


def fusion_plan(
  cfg,
  order: Sequence[int],
  sizes: Sequence[int] | None = None,
  inner=None,
  saved: gradcomp.Plan | None = None,
) -> gradcomp.Plan | None:
  """The ``layerfusion`` plan of ``cfg.plan``, or ``None`` for no fusion.

  Every plan is built here as a :class:`gradcomp.Plan` over the gradient-ready
  ``order``, so the run's plan can be saved as JSON. ``"auto"`` (paper 000
  §4.3) needs the leaf ``sizes`` and the ``inner`` compressor: its profile is
  measured on this backend up to the model's size, and the plan is chosen
  for ``Cluster(jax.device_count())`` with ``cfg.search``. A measured
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
        profile = gradcomp.profile_for(inner, up_to=sum(sizes))
        cluster = gradcomp.Cluster(jax.device_count())
        saved = gradcomp.auto_plan(sizes, order, profile, cluster, method=cfg.search)
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
  """``cfg.learning_rate`` constant, or cosine-decayed over the run."""
  if cfg.schedule == "constant":
    return cfg.learning_rate
  if cfg.schedule == "cosine":
    return optax.cosine_decay_schedule(cfg.learning_rate, max(total_steps, 1))
  raise ValueError(
    f"unknown schedule {cfg.schedule!r} (config.optimizer.schedule); valid: "
    "constant, cosine"
  )


def create(
  config,
  order: Sequence[int],
  total_steps: int,
  axis_name: str | None,
  sizes: Sequence[int] | None = None,
  saved_plan: gradcomp.Plan | None = None,
) -> tuple[optax.GradientTransformation, gradcomp.Plan | None]:
  """The run's optimizer and its fusion plan.

  Args:
    config: the run's config (``compressor``, ``fusion``, ``optimizer``).
    order: gradient-ready order of the parameter leaves
      (``gradcomp.gradient_order``).
    total_steps: steps of the run, for decaying schedules.
    axis_name: the workers' mesh axis, or ``None`` on one device.
    sizes: values per parameter leaf (tree order), for ``plan="auto"``.
    saved_plan: the plan of the run being resumed, reused by ``"auto"``.

  Returns:
    ``(tx, plan)``: ``tx``'s state is an ``optax.ApplyIfFiniteState``.
  """
  inner = compressor(config.compressor, axis_name)
  plan = fusion_plan(config.fusion, order, sizes, inner, saved_plan)
  if plan is not None:
    inner = gradcomp.layerfusion(inner, plan)
  opt = config.optimizer
  parts = [inner]
  if opt.weight_decay:
    parts.append(optax.add_decayed_weights(opt.weight_decay))
  parts.append(
    optax.sgd(
      learning_rate(opt, total_steps), momentum=opt.momentum, nesterov=opt.nesterov
    )
  )
  tx = gradcomp.apply_if_finite(optax.chain(*parts), _NEVER_FORCE, axis_name=axis_name)
  return tx, plan
