"""Synchronous data parallelism (DESIGN §1), with sufficient factors as an option.

``config.scheme.name="none"``: every worker's gradient goes through the
compressor inside LayerFusion, the mean through the local optimizer, a
barrier every step. With ``config.sufficient_factors``, each ``nn.Dense``
layer whose factors are cheaper on the wire than the compressor's exchange
sends them instead (Poseidon's rule, ``train/factors.py``): its kernel then
leaves the compressor's order.
"""

from __future__ import annotations

from train import factors as factors_lib
from train.schemes.base import Scheme


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

  def price(self, plan, params, step_wire, num_steps, flops):
    priced = super().price(plan, params, step_wire, num_steps, flops)
    if self.factored is not None:
      priced.fields["sufficient_factors"] = self.factored.record()
    return priced

  def messages(self) -> list[str]:
    return [] if self.factored is None else [self.factored.summary()]
