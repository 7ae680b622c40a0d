"""EdgeGossip (paper 002 §3) in the loop: balanced, loss-ranked epochs over GoSGD.

The host side (shards, aggregation, balancer, plans, prices) is
``train/edgegossip.py``'s :class:`~train.edgegossip.Trainer`; this module is
what the loop asks of it: a per-example mask in each batch, an epoch planned
(and priced) at each epoch's first step, the plan and its clocks in the
checkpoint, and one log row per epoch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from train import edgegossip as edgegossip_lib
from train import pricing
from train import step as step_lib
from train.schemes.base import Scheme


class EdgeGossip(Scheme):
  """GoSGD (``p``, required as for ``gosgd``) on per-worker shards with EdgeGossip's epochs."""

  name = edgegossip_lib.NAME
  optimizer_steps_on = "worker"
  factory = staticmethod(gradcomp.gosgd)
  required = {"p": 0.5}
  program_fields = edgegossip_lib.FIELDS
  sends_compressor = None

  def __init__(self, *args):
    super().__init__(*args)
    self.edge = None
    self.epoch = {"plan": None, "priced": None, "clock": None, "wall": 0.0}
    self.restored = None
    self.start_clock = None
    self.sim_seconds = None

  def check(self):
    edgegossip_lib.check(self.config, self.workload.dataset, self.variant)

  def batch_like(self, like):
    batch_size = self.config.global_batch_size
    return (*like, jax.ShapeDtypeStruct((batch_size,), jnp.float32))

  def prepare(self, params, flops):
    per_worker = self.config.global_batch_size // self.mesh.size
    message = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) + 4
    self.edge = edgegossip_lib.Trainer(
      self.config,
      self.workload.dataset,
      pricing.cluster_of(self.config, self.mesh.size),
      per_worker,
      flops / gradcomp.sim.training_flops(1.0, per_worker),
      message,
    )
    return edgegossip_lib.total_steps(self.config, self.edge.steps_per_epoch)

  def initial_state(self):
    return {"edgegossip": self.edge.empty_state(self.mesh)}

  def restore(self, state, layout):
    entry = jax.device_get(state["edgegossip"])
    self.restored = self.edge.epoch_of(entry)
    self.start_clock = np.asarray(entry["clock"], np.float64)
    if self.edge.selection == "loss":
      self.point_losses = step_lib.make_point_losses(
        self.workload.model, layout, criterion=self.workload.criterion
      )
      sharded = NamedSharding(self.mesh, P(step_lib.AXIS))
      self.points = tuple(jax.device_put(a, sharded) for a in self.edge.points())

  def saved_state(self):
    return {"edgegossip": self.edge.state_of(self.mesh, self.epoch["plan"])}

  def elastic(self, entries, from_workers):
    """The epoch in progress, planned on n workers, is re-planned on the m.

    Shards, aggregated points and balance depend on the worker count, so
    the saved plan cannot be moved: the entry restarts with no epoch, and
    :meth:`batch` plans the interrupted epoch at the first step it runs,
    for its remaining steps only (``Trainer.plan(from_step=...)``: each
    worker's budget shrinks to the share of the epoch left), ranked by each
    new worker's losses under the moved params. The m workers' clocks start
    at the latest finite clock of the saved epoch's start (a resize is a
    barrier). The steps of that epoch already run are not priced again:
    the simulated time under-counts by at most that part of one epoch.
    The run's length is the m-worker run's (``num_epochs`` of its epochs).
    """
    rest = {k: v for k, v in entries.items() if k != "edgegossip"}
    super().elastic(rest, from_workers)
    clock = np.asarray(entries["edgegossip"]["clock"], np.float64)
    finite = clock[np.isfinite(clock)]
    fresh = jax.device_get(self.edge.empty_state(self.mesh))
    fresh["clock"] = np.full(self.mesh.size, finite.max() if finite.size else 0.0)
    fresh["clock"] = fresh["clock"].astype(np.float32)
    return {"edgegossip": fresh}

  def price(self, plan, params, step_wire, num_steps, flops):
    """Bytes of GoSGD's pushes; the clock is filled as each epoch is planned."""
    n = max(self.mesh.size - 1, 1)
    per_step, message = pricing.gossip_wire(step_wire, n, n)
    self.sim_seconds = np.full(num_steps + 1, np.nan)
    self.sim_seconds[0] = 0.0
    self.num_steps = num_steps
    if self.restored is not None:  # Resumed: the same plan and the same clock.
      self._start_epoch(self.restored)
    else:  # Zeros, or the clocks an elastic resume carried (:meth:`elastic`).
      self.epoch["clock"] = self.start_clock
    edge = self.edge
    fields = {
      "message_bytes": message,
      "steps_per_epoch": edge.steps_per_epoch,
      "shard_sizes": edge.sizes.tolist(),
      "aggregated_points": edge.num_points.tolist(),
      "aggregation_wall_seconds": edge.aggregation_seconds,
      "push_seconds": edge.push_seconds,
    }
    wire = {"collective-permute": int(message)}
    return pricing.Priced(per_step, wire, self.sim_seconds, fields, per_step)

  def _start_epoch(self, plan) -> None:
    """Price a planned (or restored) epoch and fill its steps' simulated times."""
    priced = self.edge.price(plan)
    self.epoch.update(plan=plan, priced=priced, clock=priced.times)
    for j, seconds in enumerate(priced.seconds):
      if plan.first_step + j <= self.num_steps:
        self.sim_seconds[plan.first_step + j] = seconds

  def batches(self, start):
    return None  # Planned epoch by epoch in :meth:`batch`.

  def batch(self, step, batches, current):
    """Step ``step``'s batch, planning an epoch at its first step (Alg. 2)."""
    edge = self.edge
    # No plan in mid-epoch: an elastic resume re-plans the epoch's rest.
    if (step - 1) % edge.steps_per_epoch == 0 or self.epoch["plan"] is None:
      losses, begin = None, time.perf_counter()
      if edge.selection == "loss":  # Alg. 2 line 1: every worker's own model.
        losses = np.asarray(self.point_losses(*current(), *self.points))
        losses = losses.reshape(self.mesh.size, -1)
      self.epoch["wall"] = time.perf_counter() - begin
      index = (step - 1) // edge.steps_per_epoch
      self._start_epoch(edge.plan(index, self.epoch["clock"], losses, from_step=step))
    return edge.batch_of(self.workload.dataset, self.epoch["plan"], step)

  def after_step(self, step, writer, sim_at):
    plan = self.epoch["plan"]
    last = plan.first_step + self.edge.steps_per_epoch - 1
    if step == last or step == self.num_steps:
      writer.write(
        step,
        **self.edge.epoch_record(plan, self.epoch["priced"]),
        loss_eval_wall_seconds=self.epoch["wall"],
        sim_seconds=sim_at(step),
      )
