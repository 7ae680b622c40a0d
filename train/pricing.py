"""What a run sends and how long it would take: bytes per step and the simulated clock.

DESIGN §4 (bytes from the compiled HLO) and §6 (simulated time on a
described cluster). The step's HLO holds every branch a scheme may take
(local SGD's round, CD-SGD's two exchanges, each gossip phase), so the
bytes a step actually sends are rebuilt from the branches and the scheme's
schedule, and each scheme's clock is the one its waiting pattern needs:

* synchronous SGD (and ``stale_sgd``, its gradients late), local SGD,
  EASGD: a barrier at each exchange round (``gradcomp.sim.simulate_rounds``);
* CD-SGD: the exchange of step t under step t+1's compute
  (``gradcomp.sim.simulate_delayed``, paper 001 eqs. 6-7);
* gossip and GoSGD: each worker waits for its in-neighbours only
  (``gradcomp.sim.simulate_gossip``);
* the asynchronous server (``async_ps``): never waits; its step is the
  fastest worker's cycle (compute, push, pull: :func:`speed_table`), the
  scheme's own time unit;
* backup workers: each round waits for the ``n - b``-th cycle to end (the
  scheme's own draws, replayed here);
* EdgeGossip: per-worker clocks charged for the samples each worker
  processed, a barrier per epoch (``gradcomp.sim.simulate_masked_epoch``),
  priced by ``train/edgegossip.py`` as each epoch is planned (here NaN).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import scatter
from gradcomp.parallel import wire, workers
from gradcomp.schemes import async_ps as async_ps_lib
from gradcomp.schemes import backup as backup_lib
from train import data as data_lib
from train import optimizer as optimizer_lib
from train import step as step_lib


class Priced(NamedTuple):
  """A run's wire and simulated clock.

  Attributes:
    wire_bytes_per_step: bytes one worker sends per step, over the run.
    round_wire: ``{kind: bytes}`` of one exchange (for the log line and
      re-pricing; the whole step for synchronous training).
    sim_seconds: float64, shape ``(steps + 1,)``: simulated seconds after
      each step.
    fields: more inputs of the clock, saved in ``sim.json``.
    peak_bytes_per_step: the most one worker sends in any single step of the
      run (a round's step, a warm-up's dense step), logged beside the mean.
  """

  wire_bytes_per_step: float
  round_wire: dict[str, int]
  sim_seconds: np.ndarray
  fields: dict[str, Any]
  peak_bytes_per_step: float


def round_wire(round_tx, mesh, params) -> dict[str, int]:
  """Bytes per collective kind of one exchange round, from its compiled HLO.

  ``round_tx`` runs on the params' tree (per-worker values, as the
  pseudo-gradients or params a round sends), under ``shard_map`` on the mesh.
  """
  sharded = NamedSharding(mesh, P(step_lib.AXIS))
  like = lambda tree: jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharded), tree
  )
  one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
  state = jax.eval_shape(
    lambda: gradcomp.add_worker_axis(round_tx.init(one), mesh.size)
  )
  update = jax.jit(workers.sharded_update(round_tx, mesh, step_lib.AXIS))
  text = update.lower(like(params), like(state)).compile().as_text()
  return wire.collective_bytes(text)


def peak_bytes(step_wire, round_wires, is_round, num_steps: int) -> float:
  """The most one step sends: every step's own collectives, plus the largest round.

  ``round_wires``: the ``{kind: bytes}`` of each distinct round the step's
  HLO holds once (one per Streaming DiLoCo fragment; one for local SGD).
  """
  sizes = [sum(w.values()) for w in round_wires]
  per_step = sum(step_wire.values()) - sum(sizes)
  any_round = any(is_round(s) for s in range(1, num_steps + 1))
  return per_step + (max(sizes, default=0) if any_round else 0)


def amortised_bytes(step_wire, round_wire, is_round, num_steps: int) -> float:
  """Bytes per step over the run: every step's own collectives, plus the
  round's on the steps that have one.

  A step's compiled HLO holds the round's collectives once (inside the
  conditional that runs them), beside the every-step ones (the finite-step
  agreement, logged means).
  """
  per_step = sum(step_wire.values()) - sum(round_wire.values())
  rounds = sum(is_round(s) for s in range(1, num_steps + 1))
  return per_step + sum(round_wire.values()) * rounds / max(num_steps, 1)


def _cdsgd_wire(config, plan, mesh, params, step_wire, num_steps):
  """CD-SGD's two exchanges (from their compiled HLO) and its bytes per step.

  Returns ``(full, compressed, bytes_per_step, peak)``: ``full`` is the dense
  all-reduce of a message (or of a warm-up gradient), ``compressed`` the
  compressor's exchange (``{}`` when no step compresses). The step's HLO
  holds the full all-reduce once per branch that runs it (the correction,
  and the warm-up with ``warmup_steps >= 2``) and the compressed exchange
  once; what it sends besides (metrics, the finite-step agreement) is sent
  every step. Each step then adds the exchange it runs
  (``optimizer.cdsgd_exchanges``).
  """
  full = round_wire(gradcomp.none(step_lib.AXIS), mesh, params)
  kind = optimizer_lib.cdsgd_exchanges(config)
  kinds = [kind(s) for s in range(1, num_steps + 1)]
  compressed = {}
  if "compressed" in kinds or config.scheme.warmup_steps == 1:
    exchange = optimizer_lib.round_exchange(config, step_lib.AXIS, plan)
    compressed = round_wire(exchange, mesh, params)
  full_copies = 1 + (config.scheme.warmup_steps >= 2)
  other = (
    sum(step_wire.values())
    - full_copies * sum(full.values())
    - sum(compressed.values())
  )
  sizes = {"full": sum(full.values()), "compressed": sum(compressed.values())}
  per_step = other + sum(sizes[k] for k in kinds) / max(num_steps, 1)
  peak = other + max((sizes[k] for k in kinds), default=0)
  drop_zero = lambda wire: {k: b for k, b in wire.items() if b}
  return drop_zero(full), drop_zero(compressed), per_step, peak


#: The described cluster of ``config.cluster`` (it also prices the fusion plan).
cluster_of = optimizer_lib.cluster_of


def speed_table(
  config, num_workers: int, num_steps: int, flops: float, param_bytes: float
) -> np.ndarray:
  """The described cluster as a ``(steps, workers)`` table of gradient rates.

  For ``async_ps`` and ``backup_workers``: entry ``[r, w]`` is ``1 / cycle``,
  the cycle of a gradient worker ``w`` starts in step ``r`` (at
  ``Cluster.speeds_at(r + 1)``, rows up to the last step an event changes):
  its compute, then a push and a pull of the dense params over its link,
  ``alpha + bytes / bandwidth`` each (survey 004 §2.1; the servers sharded
  enough not to queue). 0 for a failed worker. Compressed pushes are priced
  dense too (a known gap: their payload is known only once compiled).
  """
  cluster = cluster_of(config, num_workers)
  last = 1
  for event in cluster.events:
    last = max(last, event.start if hasattr(event, "start") else event.step)
    last = max(last, getattr(event, "stop", None) or 0)
  transfer = 2 * (
    cluster.latency_us * 1e-6 + 8 * param_bytes / (cluster.bandwidth_gbps * 1e9)
  )
  rows = []
  for r in range(min(last, num_steps + 1)):
    compute = cluster.compute_seconds(flops, r + 1)
    rows.append(np.where(np.isfinite(compute), 1.0 / (compute + transfer), 0.0))
  return np.stack(rows)


def async_clock(num_steps: int, table: np.ndarray) -> np.ndarray:
  """``async_ps``: simulated seconds after each step, one fastest cycle each.

  ``table`` is :func:`speed_table`'s (gradients per second); the fastest
  cycle is the asynchronous server's time unit.
  """
  unit = 1.0 / float(table.max())
  return unit * np.arange(num_steps + 1, dtype=np.float64)


def backup_clock(config, num_steps: int, table: np.ndarray) -> np.ndarray:
  """``backup_workers``: each round waits for the ``n - b``-th cycle to end.

  Replayed from the scheme's own draws (``table`` as for :func:`async_clock`).
  """
  unit = 1.0 / float(table.max())
  cfg = config.scheme
  jitter = float(cfg.get("jitter") or 0.0)
  keep = table.shape[1] - cfg.backups
  key = jax.random.PRNGKey(0)  # the factory's default seed
  speeds = async_ps_lib.speed_table(table)
  rounds = jax.vmap(
    lambda r: backup_lib.accepted_workers(
      async_ps_lib.task_durations(key, r, speeds, jitter), keep
    )[1]
  )(np.arange(num_steps, dtype=np.int32))
  per_round = unit * np.asarray(rounds, np.float64)
  return np.concatenate([[0.0], np.cumsum(per_round)])


def price_timed(step_wire, seconds: np.ndarray) -> Priced:
  """A timed scheme's wire (every step's own) and its clock ``seconds``."""
  every_step = sum(step_wire.values())
  return Priced(
    every_step, {k: b for k, b in step_wire.items() if b}, seconds, {}, every_step
  )


def flops_per_step(model, ds: data_lib.Dataset, batch_per_worker: int) -> float:
  """One worker's training FLOPs per step, from the model's jaxpr (DESIGN §6)."""
  sample = jax.ShapeDtypeStruct((1, *ds.input_shape), ds.x_train.dtype)
  return gradcomp.sim.training_flops(
    gradcomp.sim.forward_flops_per_sample(model, sample), batch_per_worker
  )


def gossip_wire(step_wire, branches: int, messages: int) -> tuple[float, float]:
  """Gossip / GoSGD: ``(bytes per step, bytes of one message)``.

  The step's HLO holds every branch's ``collective-permute``s: each phase of
  a topology (``messages`` edges over ``branches`` phases), or each of the
  ``n - 1`` push shifts of GoSGD (one message per worker, ``n - 1``
  branches). A step runs one branch.
  """
  permuted = step_wire.get("collective-permute", 0)
  other = sum(step_wire.values()) - permuted
  return other + permuted / branches, permuted / max(messages, 1)


def price_gossip(
  config, mesh, flops, step_wire, num_steps, topology, *, overlap, pushes=False
) -> Priced:
  """Each worker waits for its in-neighbours only (``gradcomp.sim.simulate_gossip``).

  ``topology``: what one step's messages follow. ``pushes``: GoSGD's one
  push per worker, sent by one of ``n - 1`` shift branches, priced on the
  one-peer ``topology`` the caller passes.
  """
  if pushes:
    branches = messages = max(mesh.size - 1, 1)
  else:
    branches = len(topology.phases)
    messages = sum(len(p.edges) for p in topology.phases)
  per_step, message = gossip_wire(step_wire, branches, messages)
  seconds = gradcomp.sim.simulate_gossip(
    cluster_of(config, mesh.size), flops, topology, message, num_steps, overlap=overlap
  )
  fields = {
    "message_bytes": message,
    "topology": topology.summary(),
    "overlap": overlap,
  }
  return Priced(
    per_step, {"collective-permute": int(message)}, seconds, fields, per_step
  )


def price_delayed(config, plan, mesh, params, step_wire, num_steps, flops) -> Priced:
  """CD-SGD: the exchange of step t runs under step t+1's compute (paper 001 eqs. 6-7)."""
  full, compressed, per_step, peak = _cdsgd_wire(
    config, plan, mesh, params, step_wire, num_steps
  )
  seconds = gradcomp.sim.simulate_delayed(
    cluster_of(config, mesh.size),
    flops,
    full,
    compressed or None,
    k=config.scheme.get("k") or 2,
    warmup_steps=config.scheme.warmup_steps,
    steps=num_steps,
  )
  fields = {"full_wire": full, "compressed_wire": compressed}
  return Priced(per_step, compressed or full, seconds, fields, peak)


def price_rounds(
  config, mesh, flops, step_wire, num_steps, is_round, round_wire_=None
) -> Priced:
  """A barrier at each exchange round (``gradcomp.sim.simulate_rounds``).

  ``round_wire_``: ``{kind: bytes}`` of one round (:func:`round_wire`), or
  ``None`` when every step is a round and the step's own collectives are it
  (synchronous SGD). Pure in its inputs: a resumed run recomputes the same
  clock.
  """
  if round_wire_ is None:
    round_wire_, per_step = step_wire, sum(step_wire.values())
    peak = per_step
  else:
    per_step = amortised_bytes(step_wire, round_wire_, is_round, num_steps)
    peak = peak_bytes(step_wire, [round_wire_], is_round, num_steps)
  round_wire_ = {k: b for k, b in round_wire_.items() if b}
  seconds = gradcomp.sim.simulate_rounds(
    cluster_of(config, mesh.size), flops, is_round, round_wire_, num_steps
  )
  return Priced(per_step, round_wire_, seconds, {}, peak)


def price_axis_steps(config, mesh, flops, records, fast_axes, num_steps) -> Priced:
  """Synchronous steps on a mesh with a fast axis and a slow one (DESIGN §7).

  Every step is a barrier and the step's own collectives, each priced on its
  link class (``Cluster.axis_seconds``): the described cluster's intra-node
  link (``config.cluster.intra_bandwidth_gbps`` / ``intra_latency_us``) for
  those over ``fast_axes`` only, its own link for the rest. ``records``:
  the compiled step's ``gradcomp.parallel.wire.collectives`` on ``mesh``.
  ``sim.json`` gets the bytes per mesh axis.
  """
  cluster = cluster_of(config, mesh.size)
  comm = cluster.axis_seconds(records, fast_axes=fast_axes)
  clock = gradcomp.sim.SimClock(cluster, flops)
  seconds = np.zeros(num_steps + 1)
  for step in range(1, num_steps + 1):
    seconds[step] = clock.step(step, barrier=True, exchange_seconds=comm)
  per_kind: dict[str, int] = {}
  for r in records:
    per_kind[r.kind] = per_kind.get(r.kind, 0) + r.operand_bytes
  per_step = sum(per_kind.values())
  by_axes = {
    "+".join(axes) if axes else "unlabelled": totals
    for axes, totals in wire.bytes_by_axes(records).items()
  }
  fields = {
    "wire_by_axes": by_axes,
    "fast_axes": list(fast_axes),
    "step_comm_seconds": comm,
    # The same collectives all on the cluster's own link: what the fast
    # axis saves.
    "step_comm_seconds_one_link": cluster.axis_seconds(records, fast_axes=()),
  }
  return Priced(per_step, per_kind, seconds, fields, per_step)


def self_exchange_rounds(d: int, n: int) -> dict[str, dict[str, int]]:
  """``{kind: {collective: bytes}}`` of 1-bit and 0/1 Adam's rounds on ``d`` values.

  ``"dense"``: the float32 gradient's all-reduce; ``"onebit"``: the two-stage
  1-bit all-reduce on ``n`` workers (``scatter.onebit_wire``); ``"none"``: a
  local step of 0/1 Adam, which sends nothing.
  """
  return {
    "dense": {"all-reduce": 4 * d},
    "onebit": scatter.onebit_wire(d, n),
    "none": {},
  }


def simulate_kinds(cluster, flops: float, kinds, rounds) -> np.ndarray:
  """Simulated seconds after each step of a run whose step ``t`` sends ``rounds[kinds[t - 1]]``.

  A barrier on every step that sends (``gradcomp.sim.simulate_rounds``).
  """
  return gradcomp.sim.simulate_rounds(
    cluster,
    flops,
    lambda step: kinds[step - 1] != "none",
    lambda step: rounds[kinds[step - 1]],
    len(kinds),
  )
