"""CD-SGD (paper 001): compressed, delayed gradients with a full-precision correction.

The exchange of step t runs under step t+1's compute (paper 001 eqs. 6-7,
``gradcomp.sim.simulate_delayed``); evaluations also score the global
weights :math:`W`, one step behind the workers' local ones.
"""

from __future__ import annotations

import gradcomp
from train import optimizer as optimizer_lib
from train import pricing
from train.schemes.base import Scheme


class CDSGD(Scheme):
  """``gradcomp.cdsgd``: ``config.optimizer`` is its global (server) optimizer.

  The paper fixes neither the local learning rate nor the warm-up (OD-SGD's
  code uses 200 warm-up steps of much longer runs), so both are required;
  ``k`` keeps the factory's default 2, the paper's main setting.
  """

  name = "cdsgd"
  factory = staticmethod(gradcomp.cdsgd)
  required = {"local_learning_rate": 0.1, "warmup_steps": 50}

  def price(self, plan, params, step_wire, num_steps, flops):
    return pricing.price_delayed(
      self.config, plan, self.mesh, params, step_wire, num_steps, flops
    )

  def evaluate(self, score, opt_state, model_state):
    """The global weights too (``eval_global_*``), with the average model state."""
    scores = score(optimizer_lib.global_weights(opt_state()), model_state)
    return {k.replace("eval_", "eval_global_"): v for k, v in scores.items()}
