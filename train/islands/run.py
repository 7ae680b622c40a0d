"""``python -m train --config configs/islands.py --workdir DIR``: an islands run.

Starts Ray (a local one in-process, bound to 127.0.0.1, unless
``islands.address`` names a cluster), the islands (one actor each, restarted
by Ray up to ``islands.max_restarts`` times), runs the rounds with the
coordinator, then evaluates the global params and stops what it started.
A workdir with an outer checkpoint resumes from it on ``islands.count``
islands. Writes ``islands.jsonl`` and ``metrics.jsonl`` (one row per
round: train loss, quorum size, bytes, wall and simulated seconds).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from train import logs
from train.islands import actor as actor_lib
from train.islands import checkpoint as checkpoint_lib
from train.islands import coordinator as coordinator_lib
from train.islands import records
from train.islands import settings as settings_lib
from train.islands import wire as wire_lib

LOCAL_ADDRESS = "127.0.0.1"


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
  """Connects to ``address``, or starts a local Ray on 127.0.0.1; True if started."""
  import ray

  if ray.is_initialized():
    return False
  with warnings.catch_warnings():
    # Ray starts its servers by fork + exec; JAX, if already running here,
    # warns on any fork, but the children exec at once and run no JAX.
    warnings.filterwarnings(
      "ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning
    )
    if address is not None:
      ray.init(address=address, log_to_driver=False)
      return False
    ray.init(
      address="local",  # a new one, never a cluster `ray start` left running
      _node_ip_address=LOCAL_ADDRESS,
      include_dashboard=False,
      num_cpus=num_cpus,
      log_to_driver=False,
      configure_logging=False,
    )
  return True


def _sim_seconds(config, flops: float, islands: int, payload_bytes: int) -> float:
  """One round on the described link: compute of ``every`` steps + the all-gather."""
  import gradcomp

  c = config.cluster
  cluster = gradcomp.sim.Cluster(
    max(islands, 1), bandwidth_gbps=c.bandwidth_gbps, latency_us=c.latency_us
  )
  compute = flops / cluster.flops_per_second
  if islands <= 1:
    return compute
  return compute + float(cluster.comm_seconds({"all-gather": (payload_bytes, 1)}))


def train_and_evaluate(config, workdir: str | Path) -> dict[str, Any]:
  """Runs ``config`` (with an ``islands`` field) in ``workdir``; returns a summary.

  Raises:
    ValueError: a bad ``config.islands`` field or compressor.
    coordinator_lib.IslandsMismatchError: islands' states diverged.
    coordinator_lib.QuorumError: a round could not gather its quorum.
  """
  import ray

  s = settings_lib.read(config.islands)
  wire_lib.check_name(config.compressor.name)
  if s.devices_per_island and config.global_batch_size % s.devices_per_island:
    raise ValueError(
      f"config.global_batch_size={config.global_batch_size} must be a multiple of "
      f"islands.devices_per_island={s.devices_per_island}"
    )
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  run = uuid.uuid4().hex[:12]
  events = records.EventLog(workdir)
  ckpts = (
    checkpoint_lib.OuterCheckpoints(workdir) if s.checkpoint_every_rounds else None
  )
  resume = None if ckpts is None or ckpts.latest() is None else ckpts.restore(s.count)
  started = start_ray(s.address, num_cpus=max(4, s.count + 1))
  t0 = time.time()
  cache = (
    s.compilation_cache
    or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    or str((workdir / "xla_cache").absolute())
  )
  handles, metrics = {}, None
  try:
    remote = ray.remote(actor_lib.Island)
    for i in range(s.count):
      handles[i] = remote.options(
        max_restarts=s.max_restarts,
        max_task_retries=0,
        num_cpus=0,
        runtime_env=actor_lib.runtime_env(s.devices_per_island, cache),
        name=f"island-{run}-{i}",
      ).remote(config.to_dict(), i, run, s.devices_per_island)
    if resume is None:
      start_round, starts = 0, [h.start.remote() for h in handles.values()]
    else:
      snap, carries, saved = resume
      start_round = snap.round
      starts = [h.start.remote(snap, carries[i]) for i, h in handles.items()]
      events.write(start_round, "resume", None, saved_islands=saved, islands=s.count)
    hashes = ray.get(starts)
    if len(set(hashes)) != 1:
      raise coordinator_lib.IslandsMismatchError(
        f"islands start from different states: {hashes}"
      )
    warm = ray.get([h.warmup.remote() for h in handles.values()])
    flops = ray.get(handles[0].flops_per_round.remote())
    for i in handles:
      events.write(
        start_round, "join", i, via="start" if resume is None else "checkpoint"
      )
    metrics = logs.MetricWriter(workdir, resume_step=start_round * config.scheme.every)
    sim_total = [0.0]

    def on_round(r, summary):
      sim_total[0] += _sim_seconds(
        config, flops, len(summary["quorum"]), summary["payload_bytes"]
      )
      row = {
        "round": r,
        "train_loss": summary["train_loss"],
        "quorum": len(summary["quorum"]),
        "applied": len(summary["applied"]),
        "bytes_per_round": summary["bytes"],
        "payload_bytes": summary["payload_bytes"],
        "round_seconds": summary["seconds"],
        "sim_seconds": sim_total[0],
      }
      if s.eval_every_rounds and (r + 1) % s.eval_every_rounds == 0:
        synced = [i for i, st in coord.status.items() if st == "synced"]
        row.update(ray.get(handles[synced[0]].evaluate.remote()))
      metrics.write((r + 1) * config.scheme.every, **row)

    def checkpoint(r, appliers):
      if (r + 1) % s.checkpoint_every_rounds:
        return
      snap = ray.get(appliers[0].snapshot.remote())
      unsent = ray.get([h.unsent.remote() for h in appliers])
      ckpts.save(snap, unsent)
      events.write(
        r, "checkpoint", None, rounds=snap.round, islands=len(appliers), hash=snap.hash
      )

    coord = coordinator_lib.Coordinator(
      handles,
      s,
      start_round,
      hashes[0],
      events,
      on_round,
      checkpoint if ckpts is not None else None,
    )
    t_rounds = time.time()
    summaries = [coord.run_round() for _ in range(start_round, s.rounds)]
    rounds_seconds = time.time() - t_rounds
    final = coord.finish(timeout=s.round_timeout_seconds)
    live = sorted(final)
    result = ray.get(handles[live[0]].evaluate.remote())
    metrics.write(s.rounds * config.scheme.every, **result, final=True)
    return {
      "run": run,
      "rounds": len(summaries),
      "start_round": start_round,
      "final_hashes": final,
      "failures": coord.failures,
      "rounds_seconds": rounds_seconds,
      "startup_seconds": t_rounds - t0,
      "warmup_seconds": warm,
      "bytes_per_round": float(np.mean([x["bytes"] for x in summaries]))
      if summaries
      else 0.0,
      "sim_seconds": sim_total[0],
      **result,
    }
  finally:
    for h in handles.values():
      try:
        ray.kill(h, no_restart=True)
      except Exception:  # noqa: BLE001 - already gone
        pass
    events.close()
    if metrics is not None:
      metrics.close()
    if ckpts is not None:
      ckpts.close()
    if started:
      ray.shutdown()


def main(config, workdir: str, debug: bool = False) -> None:
  """``python -m train``'s islands branch: the run, errors as one line."""
  try:
    summary = train_and_evaluate(config, workdir)
  except (ValueError, coordinator_lib.QuorumError) as e:
    if debug:
      raise
    sys.exit(f"error: {e}")
  print(
    f"islands: {summary['rounds']} rounds in {summary['rounds_seconds']:.1f} s, "
    f"{summary['failures']} failures survived, eval_loss {summary['eval_loss']:.4f}, "
    f"eval_accuracy {summary['eval_accuracy']:.4f}; records in {workdir}"
  )
