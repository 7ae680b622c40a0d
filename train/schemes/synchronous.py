"""Synchronous data parallelism (DESIGN §1), with sufficient factors as an option.

``config.scheme.name="none"``: every worker's gradient goes through the
compressor inside LayerFusion, the mean through the local optimizer, a
barrier every step. With ``config.sufficient_factors``, each ``nn.Dense``
layer whose factors are cheaper on the wire than the compressor's exchange
sends them instead (Poseidon's rule, ``train/factors.py``): its kernel then
leaves the compressor's order.

An optimizer that exchanges its own momentum (``config.optimizer.name`` in
``train.optimizer.SELF_EXCHANGING``: 1-bit Adam, DeMo) takes each worker's
own gradient, with no compressor before it. 1-bit Adam's rounds are priced
by phase (the warm-up's dense all-reduce, then its compressed exchange);
DeMo's all-gather is the same every step.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import gradcomp
from gradcomp.compressors import scatter
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

  def optimizer(self, order, sizes, saved_plan, total_steps, mask=None):
    if not optimizer_lib.exchanges_itself(self.config.optimizer):
      return super().optimizer(order, sizes, saved_plan, total_steps, mask)
    parts = optimizer_lib.self_exchanging(
      self.config.optimizer, total_steps, step_lib.AXIS
    )
    tx = optax.chain(*parts)
    return gradcomp.apply_if_finite(tx, NEVER_FORCE, axis_name=step_lib.AXIS), None

  def price(self, plan, params, step_wire, num_steps, flops):
    if optimizer_lib.self_exchange_phase(self.config.optimizer) is not None:
      return self._price_phases(params, step_wire, num_steps, flops)
    priced = super().price(plan, params, step_wire, num_steps, flops)
    if self.factored is not None:
      priced.fields["sufficient_factors"] = self.factored.record()
    return priced

  def messages(self) -> list[str]:
    return [] if self.factored is None else [self.factored.summary()]

  def _price_phases(self, params, step_wire, num_steps, flops):
    """1-bit Adam's rounds: dense through the warm-up, then its 1-bit exchange.

    The step's HLO holds both phases' collectives (in the conditional's two
    branches) beside the every-step ones (metrics, the finite-step
    agreement): the dense round is the all-reduce of the float32 gradient,
    the compressed one :func:`gradcomp.compressors.scatter.onebit_payload_bytes`
    (its size is checked against the compiled HLO in the tests).
    """
    d = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    n = self.mesh.size
    rounds = {
      "dense": {"all-reduce": 4 * d},
      "compressed": scatter.onebit_wire(d, n),
    }
    for kind, sent in rounds["compressed"].items():
      if step_wire.get(kind) != sent:
        raise RuntimeError(
          f"1-bit Adam's compiled step sends {step_wire.get(kind)} bytes by "
          f"{kind}, its exchange {sent}: the pricing is out of date"
        )
    both = sum(sum(w.values()) for w in rounds.values())
    other = {k: b for k, b in step_wire.items() if b}
    every_step = sum(other.values()) - both
    phase = optimizer_lib.self_exchange_phase(self.config.optimizer)
    per_round = [sum(rounds[phase(t)].values()) for t in range(1, num_steps + 1)]
    per_step = every_step + sum(per_round) / max(num_steps, 1)
    seconds = gradcomp.sim.simulate_rounds(
      pricing.cluster_of(self.config, n),
      flops,
      lambda step: True,
      lambda step: rounds[phase(step)],
      num_steps,
    )
    fields = {
      "phase_wire": rounds,
      "freeze_step": int(self.config.optimizer.freeze_step),
    }
    return pricing.Priced(per_step, rounds["compressed"], seconds, fields)
