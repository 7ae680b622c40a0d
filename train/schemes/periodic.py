"""Schemes that exchange on a schedule behind a barrier: local SGD / DiLoCo, SparseLoCo, EASGD, stale SGD.

Each round waits for the slowest worker (``gradcomp.sim.simulate_rounds``);
the bytes of a round come from its own compiled exchange, amortised over
the steps (``train.pricing.price_rounds``).
"""

from __future__ import annotations

import jax
from absl import logging

import gradcomp
from gradcomp.schemes import sparseloco as sparseloco_lib
from gradcomp.schemes import streaming as streaming_lib
from train import optimizer as optimizer_lib
from train import pricing
from train import step as step_lib
from train.schemes.base import Scheme, _set, scheme_transformation


class _Rounds(Scheme):
  """A round every ``every`` steps; :meth:`round_tx` is what one round sends."""

  def round_tx(self, plan):
    raise NotImplementedError

  def is_round(self):
    """``step -> bool``: which steps (1-based) end with a round."""
    return optimizer_lib.round_steps(self.config)

  def price(self, plan, params, step_wire, num_steps, flops):
    round_wire = pricing.round_wire(self.round_tx(plan), self.mesh, params)
    return pricing.price_rounds(
      self.config,
      self.mesh,
      flops,
      step_wire,
      num_steps,
      self.is_round(),
      round_wire,
    )


class LocalSGD(_Rounds):
  """Local SGD, and DiLoCo with ``outer_learning_rate`` (``gradcomp.local_sgd``).

  ``every`` defaults to 8: the local SGD period the project's evidence uses
  and DESIGN §5's default (DiLoCo's own H = 500 assumes far longer runs).

  **Streaming DiLoCo** (``fragments``, ``overlap``, ``alpha``, ``eager``;
  DESIGN §9): fragments are strided layers in the gradient-ready order the
  program measured (or, with ``split_leaves``, strided equal chunks of it
  that may cut leaves). Each fragment is its own unit of compression: the
  compressor sees one fused buffer per fragment (``config.fusion.plan``
  ``layerwise`` keeps one per leaf; ``auto``'s groups span fragments, so it
  becomes ``single``). Each fragment's round is priced from its own compiled
  exchange; the clock overlaps it with ``overlap`` steps of compute
  (``gradcomp.sim.simulate_overlapped_rounds``), and the peak bytes per step
  are the largest fragment's.
  """

  name = "local_sgd"
  optimizer_steps_on = "worker"
  factory = staticmethod(gradcomp.local_sgd)
  defaults = {"every": 8}

  @property
  def streaming(self) -> bool:
    """Whether a Streaming DiLoCo field is set away from plain local SGD."""
    cfg = self.config.scheme
    return streaming_lib.streams(
      cfg.get("fragments") or 1, cfg.get("overlap"), cfg.get("alpha"), cfg.get("eager")
    )

  def optimizer(self, order, sizes, saved_plan, total_steps, mask=None, like=None):
    self.order = order  # The strided fragments follow it.
    return super().optimizer(order, sizes, saved_plan, total_steps, mask, like)

  def _fragment_tx(self, codec):
    """The compressor of one fragment's subtree (the dense mean without one)."""
    if codec is None:
      return None
    plan = "layerwise" if self.config.fusion.plan == "layerwise" else "single"
    return gradcomp.layerfusion(codec, plan)

  def wrap(self, local, fused, codec):
    if not self.streaming:
      return super().wrap(local, fused, codec)
    return scheme_transformation(
      self, local, self._fragment_tx(codec), order=self.order
    )

  def round_tx(self, plan):
    return optimizer_lib.round_exchange(self.config, step_lib.AXIS, plan)

  def price(self, plan, params, step_wire, num_steps, flops):
    if not self.streaming:
      return super().price(plan, params, step_wire, num_steps, flops)
    cfg = self.config.scheme
    every, overlap = cfg.every, cfg.get("overlap") or 0
    fragments = cfg.get("fragments") or 1
    # ``params`` carry the worker axis; fragments are cut from one worker's.
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
    if cfg.get("split_leaves"):
      groups = streaming_lib.fragment_pieces(one, fragments, self.order)
    else:
      groups = streaming_lib.fragment_groups(one, fragments, self.order)

    def per_worker(group):
      view = streaming_lib.fragment_view(one, group)
      n = self.mesh.size
      return jax.tree.map(lambda v: jax.ShapeDtypeStruct((n, *v.shape), v.dtype), view)

    codec = None
    if self.config.compressor.name != "none":
      codec = optimizer_lib.compressor(self.config.compressor, step_lib.AXIS)
    tx = self._fragment_tx(codec) or gradcomp.none(step_lib.AXIS)
    wires = [pricing.round_wire(tx, self.mesh, per_worker(group)) for group in groups]
    spacing = every // len(groups)
    is_send = lambda step: step % spacing == 0
    wire_at = lambda step: wires[(step % every) // spacing]
    # The step's HLO holds each fragment's round once (in its branch).
    every_step = sum(step_wire.values()) - sum(sum(w.values()) for w in wires)
    if every_step < 0:
      raise RuntimeError(
        f"the compiled step sends {step_wire} but its fragments' rounds alone "
        f"{wires}: the pricing is out of date"
      )
    sent = [sum(wire_at(s).values()) for s in range(1, num_steps + 1) if is_send(s)]
    per_step = every_step + sum(sent) / max(num_steps, 1)
    peak = pricing.peak_bytes(step_wire, wires, is_send, num_steps)
    seconds = gradcomp.sim.simulate_overlapped_rounds(
      pricing.cluster_of(self.config, self.mesh.size),
      flops,
      is_send,
      wire_at,
      num_steps,
      overlap,
    )
    fields = {
      "fragments": len(groups),
      "overlap": overlap,
      "fragment_wire": wires,
      "fragment_leaves": [len(g) for g in groups],  # Pieces when split.
      "fragment_values": [
        sum(x.size for x in jax.tree.leaves(streaming_lib.fragment_view(one, g)))
        for g in groups
      ],
    }
    largest = max(wires, key=lambda w: sum(w.values()))
    return pricing.Priced(per_step, largest, seconds, fields, peak)


class SparseLoCo(_Rounds):
  """SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706; ``gradcomp.schemes.sparseloco``).

  DiLoCo whose pseudo-gradients are the top ``k`` of each ``chunk x chunk``
  tile in ``value_bits`` bits under error feedback decayed by ``ef_decay``,
  with a plain-SGD outer step at ``outer_learning_rate``. Fields of
  ``config.scheme``: ``every`` (default 8, as ``local_sgd``'s), ``k`` and
  ``outer_learning_rate`` (required: the paper's densities span 1-3 %, and
  its outer rate is tuned), ``chunk``, ``value_bits``, ``ef_decay`` and
  ``mean`` (unset: the factory's 64, 2, 0.95 and ``"workers"``). The scheme
  sends its own codec: ``config.compressor`` is set to ``none`` (with a
  warning if it named another) and ``config.fusion.plan`` to ``none`` (the
  codec tiles each leaf of the params' tree). A round is priced from its own compiled exchange,
  every ``every``-th step.
  """

  name = "sparseloco"
  optimizer_steps_on = "worker"
  factory = staticmethod(sparseloco_lib.sparseloco)
  defaults = {"every": 8}
  required = {"k": 64, "outer_learning_rate": 1.0}
  #: ``config.scheme`` fields that are keywords of the factory.
  FIELDS = (
    "every",
    "outer_learning_rate",
    "k",
    "chunk",
    "value_bits",
    "ef_decay",
    "mean",
  )

  @classmethod
  def resolve(cls, config):
    config = super().resolve(config)
    updates = {}
    if config.compressor.name != "none":
      logging.warning(
        "scheme sparseloco sends its own codec (top-k per tile, value_bits, "
        "ef_decay); ignoring config.compressor.name=%r",
        config.compressor.name,
      )
      updates["compressor.name"] = "none"
      updates.update(
        {
          f"compressor.{k}": None
          for k, v in config.compressor.items()
          if k != "name" and v is not None
        }
      )
    if config.fusion.plan != "none":
      logging.info(
        "scheme sparseloco: config.fusion.plan=none (its codec tiles leaves)"
      )
      updates["fusion.plan"] = "none"
    return _set(config, updates) if updates else config

  def _fields(self) -> dict:
    """The factory's keywords set in ``config.scheme`` (unset: its defaults)."""
    cfg = self.config.scheme
    ignored = sorted(
      k
      for k, v in cfg.items()
      if v is not None and k != "name" and k not in self.FIELDS
    )
    for key in ignored:
      logging.warning(
        "scheme sparseloco takes no %r; ignoring config.scheme.%s=%r",
        key,
        key,
        cfg[key],
      )
    return {k: cfg.get(k) for k in self.FIELDS if cfg.get(k) is not None}

  def wrap(self, local, fused, codec):
    del fused, codec  # resolve() set the compressor to none
    return self.factory(local, axis_name=step_lib.AXIS, **self._fields())

  def round_tx(self, plan):
    del plan
    fields = self._fields()
    fields.pop("every", None), fields.pop("outer_learning_rate", None)
    return sparseloco_lib.codec(axis_name=step_lib.AXIS, **fields)

  def is_round(self):
    every = self.config.scheme.every
    return lambda step: step % every == 0


class EASGD(_Rounds):
  """Synchronous EASGD (Zhang, Choromanska and LeCun 2015, eqs. 5-6).

  ``alpha`` defaults to ``0.9 / workers``: the paper's §3 choice ``beta = n
  alpha = 0.9``. A round all-reduces the params densely.
  """

  name = "easgd"
  optimizer_steps_on = "worker"
  factory = staticmethod(gradcomp.easgd)
  defaults = {"alpha": lambda workers: 0.9 / workers}
  sends_compressor = None

  def round_tx(self, plan):
    return gradcomp.none(step_lib.AXIS)


class StaleSGD(Scheme):
  """Synchronous SGD whose every gradient is ``staleness`` steps late (survey 004 Fig. 2).

  Every step is a round, as synchronous SGD; the survey gives no staleness
  to default to.
  """

  name = "stale_sgd"
  factory = staticmethod(gradcomp.stale_sgd)
  required = {"staleness": 4}
  sends_compressor = None
