"""Synchronous data parallelism (DESIGN §1), with sufficient factors as an option.

``config.scheme.name="none"``: every worker's gradient goes through the
compressor inside LayerFusion, the mean through the local optimizer, a
barrier every step. With ``config.sufficient_factors``, each ``nn.Dense``
layer whose factors are cheaper on the wire than the compressor's exchange
sends them instead (Poseidon's rule, ``train/factors.py``): its kernel then
leaves the compressor's order.

An optimizer that exchanges its own momentum (``config.optimizer.name`` in
``train.optimizer.SELF_EXCHANGING``: 1-bit Adam, 0/1 Adam, DeMo,
compressed-momentum Adam) takes each worker's own gradient, with no
compressor before it (compressed-momentum Adam's codec is
``config.compressor``, inside LayerFusion). 1-bit, 0/1 and
compressed-momentum Adam's rounds are priced by what each step sends
(dense, 1-bit or the codec's, or nothing in 0/1 Adam's local steps), and so
is a compressor's dense warm-up (``config.compressor.warmup_steps``);
DeMo's all-gather is the same every step.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import gradcomp
from train import factors as factors_lib
from train import optimizer as optimizer_lib
from train import pricing
from train import step as step_lib
from train.schemes.base import NEVER_FORCE, Scheme


class Synchronous(Scheme):
  """The default scheme: :class:`~train.schemes.base.Scheme`'s hooks as they are."""

  name = "none"

  def __init__(self, *args):
    super().__init__(*args)
    self.factored = None  # The rule's choice per Dense layer, once.
    self.per_worker_params = False  # 0/1 Adam's local steps: set at restore.

  def gradient_plan(self, params, model_state, batch_like, order, sizes):
    if not factors_lib.enabled(self.config):
      return order, sizes, None
    work = self.workload
    self.factored = factors_lib.plan(
      self.config,
      work.model,
      self.mesh,
      params,
      model_state,
      batch_like,
      work.criterion,
    )
    if not self.factored.active:
      return order, sizes, None
    order, sizes = self.factored.restrict(params, order, sizes)
    return order, sizes, self.factored

  def optimizer(self, order, sizes, saved_plan, total_steps, mask=None, like=None):
    if not optimizer_lib.exchanges_itself(self.config.optimizer):
      return super().optimizer(order, sizes, saved_plan, total_steps, mask, like)
    codec = plan = None
    if self.config.optimizer.name in optimizer_lib.CODEC_OPTIMIZERS:
      codec, plan = optimizer_lib.momentum_codec(
        self.config, order, sizes, saved_plan, step_lib.AXIS
      )
    parts = optimizer_lib.self_exchanging(
      self.config.optimizer, total_steps, step_lib.AXIS, codec
    )
    tx = optax.chain(*parts)
    return gradcomp.apply_if_finite(tx, NEVER_FORCE, axis_name=step_lib.AXIS), plan

  def price(self, plan, params, step_wire, num_steps, flops):
    if optimizer_lib.exchange_phases(self.config, 1) is not None:
      return self._price_phases(plan, params, step_wire, num_steps, flops)
    priced = super().price(plan, params, step_wire, num_steps, flops)
    if self.factored is not None:
      priced.fields["sufficient_factors"] = self.factored.record()
    return priced

  def restore(self, state, layout) -> None:
    self.per_worker_params = layout.params_per_worker

  def messages(self) -> list[str]:
    return [] if self.factored is None else [self.factored.summary()]

  def _compressed_round(self, plan, params) -> dict[str, int]:
    """``{kind: bytes}`` of one exchange through the codec (after a warm-up).

    ``compressed_adam``'s codec on its float32 momentum, or the compressor
    (inside LayerFusion) on the gradient, traced alone on the mesh.
    """
    if self.config.optimizer.name in optimizer_lib.CODEC_OPTIMIZERS:
      inner = optimizer_lib.compressor(self.config.compressor, step_lib.AXIS)
      tx = inner if plan is None else gradcomp.layerfusion(inner, plan)
      dtype = lambda x: np.float32
    else:
      tx = optimizer_lib.round_exchange(self.config, step_lib.AXIS, plan)
      dtype = lambda x: x.dtype
    return self._round(tx, params, dtype)

  def _warmup_round(self, params) -> dict[str, int]:
    """``{kind: bytes}`` of one warm-up exchange of a frozen-variance optimizer
    through its codec (``config.optimizer.warmup_bits``), on float32 gradients."""
    tx = optimizer_lib.warmup_codec(self.config.optimizer, step_lib.AXIS)
    return self._round(tx, params, lambda x: np.float32)

  def _round(self, tx, params, dtype) -> dict[str, int]:
    """``{kind: bytes}`` of ``tx`` on ``params``'s tree (leaves of ``dtype``),
    traced alone on the mesh."""
    n = self.mesh.size
    per_worker = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((n, *np.shape(x)), dtype(x)), params
    )
    wire = pricing.round_wire(tx, self.mesh, per_worker)
    return {kind: sent for kind, sent in wire.items() if sent}

  def _price_phases(self, plan, params, step_wire, num_steps, flops):
    """Rounds that change by phase, each priced by what it sends.

    Dense, the warm-up codec's, 1-bit, the codec's or nothing
    (:func:`train.pricing.self_exchange_rounds`,
    :func:`train.optimizer.exchange_phases`). The step's HLO holds every
    branch's collectives beside the every-step ones (metrics, the
    finite-step agreement); the 1-bit ones are checked against it.
    """
    n = self.mesh.size
    d = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    if self.per_worker_params:  # 0/1 Adam: one worker's params, not n copies.
      d //= n
    kinds, copies = optimizer_lib.exchange_phases(self.config, num_steps)
    rounds = pricing.self_exchange_rounds(d, n)
    if "compressed" in copies:
      rounds["compressed"] = self._compressed_round(plan, params)
    if "warmup" in copies:
      rounds["warmup"] = self._warmup_round(params)
    for kind, sent in rounds["onebit"].items():
      # The warm-up codec's reduce-scatter sends by the same collectives.
      want = copies.get("onebit", 0) * sent
      want += copies.get("warmup", 0) * rounds.get("warmup", {}).get(kind, 0)
      if "onebit" in copies and step_wire.get(kind, 0) != want:
        raise RuntimeError(
          f"the compiled step sends {step_wire.get(kind)} bytes by {kind}, its "
          f"1-bit exchange and warm-up {want}: the pricing is out of date"
        )
    in_hlo = sum(c * sum(rounds[k].values()) for k, c in copies.items())
    every_step = sum(b for b in step_wire.values() if b) - in_hlo
    if every_step < 0:
      raise RuntimeError(
        f"the compiled step sends {step_wire}, less than its phases' rounds "
        f"{ {k: rounds[k] for k in copies} }: the pricing is out of date"
      )
    per_step = every_step + sum(sum(rounds[k].values()) for k in kinds) / max(
      num_steps, 1
    )
    seconds = pricing.simulate_kinds(
      pricing.cluster_of(self.config, n), flops, kinds, rounds
    )
    fields = {
      "phase_wire": {k: w for k, w in rounds.items() if k in kinds},
      "phases": {k: kinds.count(k) for k in rounds if k in kinds},
    }
    peak = every_step + max(sum(rounds[k].values()) for k in set(kinds))
    # The round a run's compressed phase sends (the one after the warm-up).
    one_round = rounds["compressed" if "compressed" in copies else "onebit"]
    return pricing.Priced(per_step, one_round, seconds, fields, peak)
