"""Decentralised schemes: gossip (D-PSGD, CHOCO-SGD) and GoSGD.

Each worker waits for its in-neighbours only
(``gradcomp.sim.simulate_gossip``). The compressor reaches CHOCO's exchange
per leaf (no fusion): its codec goes to neighbours, so only gathered codecs
can be sent.
"""

from __future__ import annotations

import gradcomp
from train import pricing
from train.schemes.base import Scheme, scheme_transformation


class Gossip(Scheme):
  """``gradcomp.gossip`` on ``topology`` (default ``ring``, D-PSGD's own example).

  With a compressor, CHOCO-SGD: its consensus step ``gamma`` has no default
  that holds across compressors, so it is then required (the factory says
  so in one line).
  """

  name = "gossip"
  optimizer_steps_on = "worker"
  factory = staticmethod(gradcomp.gossip)
  defaults = {"topology": "ring"}
  sends_compressor = "per_leaf"

  def wrap(self, local, fused, codec):
    return scheme_transformation(self, local, codec)

  def price(self, plan, params, step_wire, num_steps, flops):
    topology = gradcomp.topology.get(self.config.scheme.topology, self.mesh.size)
    # D-PSGD sends the params the gradient was taken at (overlapped); CHOCO
    # sends what the step computed.
    overlap = self.config.compressor.name == "none"
    return pricing.price_gossip(
      self.config, self.mesh, flops, step_wire, num_steps, topology, overlap=overlap
    )


class GoSGD(Scheme):
  """``gradcomp.gosgd`` (Blot et al. 2016): each worker pushes with probability ``p``.

  Blot et al. sweep ``p`` and give no default, so it is required.
  """

  name = "gosgd"
  optimizer_steps_on = "worker"
  factory = staticmethod(gradcomp.gosgd)
  required = {"p": 0.5}
  sends_compressor = None

  def price(self, plan, params, step_wire, num_steps, flops):
    topology = gradcomp.topology.get("one_peer_exponential", self.mesh.size)
    return pricing.price_gossip(
      self.config,
      self.mesh,
      flops,
      step_wire,
      num_steps,
      topology,
      overlap=False,
      pushes=True,
    )
