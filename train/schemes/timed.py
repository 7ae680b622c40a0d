"""Schemes whose clock is the workers' speeds: the asynchronous server and backup workers.

Both read the described cluster's speeds (``config.cluster.speeds``, equal
when unset) as a ``(steps, workers)`` table of gradient rates
(``train.pricing.speed_table``).
"""

from __future__ import annotations

import jax
import numpy as np

import gradcomp
from train import optimizer as optimizer_lib
from train import pricing
from train.schemes.base import Scheme, scheme_transformation


class _Timed(Scheme):
  def prepare(self, params, flops):
    num_steps = super().prepare(params, flops)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    self.speeds = pricing.speed_table(
      self.config, self.mesh.size, num_steps, flops, param_bytes
    )
    return num_steps


class AsyncPS(_Timed):
  """``gradcomp.async_ps`` (survey 004 §2.3): SSP with ``staleness_bound``, DC-ASGD.

  Its pushes carry the codec per leaf; a codec that needs a global reduction
  is replaced by dense pushes. Logs the staleness of the gradients applied.
  """

  name = "async_ps"
  factory = staticmethod(gradcomp.async_ps)
  sends_compressor = "per_leaf"

  def wrap(self, local, fused, codec):
    return scheme_transformation(self, local, codec, self.speeds)

  def price(self, plan, params, step_wire, num_steps, flops):
    return pricing.price_timed(step_wire, pricing.async_clock(num_steps, self.speeds))

  def log(self, step, row, writer, opt_state):
    counts = optimizer_lib.staleness_histogram(opt_state())
    row["staleness_mean"] = float(
      counts @ np.arange(counts.size) / max(counts.sum(), 1)
    )
    writer.histogram(step, "staleness_histogram", counts)


class BackupWorkers(_Timed):
  """``gradcomp.backup_workers`` (survey 004 §2.2): each round drops the ``backups`` slowest.

  The survey gives no number of backups to default to.
  """

  name = "backup_workers"
  factory = staticmethod(gradcomp.backup_workers)
  required = {"backups": 1}
  sends_compressor = None

  def price(self, plan, params, step_wire, num_steps, flops):
    clock = pricing.backup_clock(self.config, num_steps, self.speeds)
    return pricing.price_timed(step_wire, clock)
