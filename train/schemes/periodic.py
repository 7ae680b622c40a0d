"""Schemes that exchange on a schedule behind a barrier: local SGD / DiLoCo, EASGD, stale SGD.

Each round waits for the slowest worker (``gradcomp.sim.simulate_rounds``);
the bytes of a round come from its own compiled exchange, amortised over
the steps (``train.pricing.price_rounds``).
"""

from __future__ import annotations

import gradcomp
from train import optimizer as optimizer_lib
from train import pricing
from train import step as step_lib
from train.schemes.base import Scheme


class _Rounds(Scheme):
  """A round every ``every`` steps; :meth:`round_tx` is what one round sends."""

  def round_tx(self, plan):
    raise NotImplementedError

  def price(self, plan, params, step_wire, num_steps, flops):
    round_wire = pricing.round_wire(self.round_tx(plan), self.mesh, params)
    return pricing.price_rounds(
      self.config,
      self.mesh,
      flops,
      step_wire,
      num_steps,
      optimizer_lib.round_steps(self.config),
      round_wire,
    )


class LocalSGD(_Rounds):
  """Local SGD, and DiLoCo with ``outer_learning_rate`` (``gradcomp.local_sgd``).

  ``every`` defaults to 8: the local SGD period the project's evidence uses
  and DESIGN §5's default (DiLoCo's own H = 500 assumes far longer runs).
  """

  name = "local_sgd"
  factory = staticmethod(gradcomp.local_sgd)
  defaults = {"every": 8}

  def round_tx(self, plan):
    return optimizer_lib.round_exchange(self.config, step_lib.AXIS, plan)


class EASGD(_Rounds):
  """Synchronous EASGD (Zhang, Choromanska and LeCun 2015, eqs. 5-6).

  ``alpha`` defaults to ``0.9 / workers``: the paper's §3 choice ``beta = n
  alpha = 0.9``. A round all-reduces the params densely.
  """

  name = "easgd"
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
