"""The island actor: one Ray actor, one process, one JAX program (DESIGN §12).

The actor's process gets ``JAX_PLATFORMS=cpu`` and
``--xla_force_host_platform_device_count=<devices_per_island>`` through
Ray's ``runtime_env`` before JAX starts in it (flags set after JAX has
initialised are silently ignored), and the repository on ``PYTHONPATH``.
It wraps a :class:`train.islands.replica.Replica`; the coordinator calls its
methods, which Ray runs one at a time in call order.

Payloads leave through Ray's object store: :meth:`Island.work` returns the
:class:`train.islands.payload.Payload` (its value becomes an object owned
by the caller) and :meth:`Island.apply` receives the quorum's object
references and fetches the payloads itself. A fault of the failure plan is
executed by the island on itself: ``kill`` is ``os.kill(os.getpid(),
SIGKILL)``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[2])


def runtime_env(devices: int, compilation_cache: str | None = None) -> dict[str, Any]:
  """Ray's ``runtime_env`` of an island: CPU JAX with ``devices`` devices.

  ``compilation_cache``: a directory for JAX's persistent compilation cache,
  shared by the islands, so an island Ray restarts loads its programs
  instead of compiling them again (``None``: no cache).
  """
  path = os.environ.get("PYTHONPATH")
  # The launcher's other XLA flags carry over; its device count does not.
  flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": " ".join(
      [*flags, f"--xla_force_host_platform_device_count={devices}"]
    ),
    "PYTHONPATH": REPO if not path else f"{REPO}{os.pathsep}{path}",
    "TF_CPP_MIN_LOG_LEVEL": "3",
  }
  if compilation_cache is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = str(compilation_cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  return {"env_vars": env}


class Island:
  """One island (wrapped by ``ray.remote`` in ``coordinator.py``).

  Args:
    config: the run's config as a dict (``ConfigDict.to_dict()``).
    island: this island's id.
    run: the run's id.
    devices: devices of its mesh (``islands.devices_per_island``).
  """

  def __init__(self, config: dict, island: int, run: str, devices: int):
    import jax
    import ml_collections

    jax.config.update("jax_num_cpu_devices", devices)
    from train.islands import replica

    self.island = island
    cfg = ml_collections.ConfigDict(config)
    self.replica = replica.Replica(cfg, island, run, jax.devices()[:devices])
    self.started = time.time()

  def pid(self) -> int:
    return os.getpid()

  def start(self, snapshot=None, carry=None) -> str:
    """Starts at round 0, or from a checkpoint's ``snapshot`` and ``carry``."""
    if snapshot is None:
      return self.replica.hash()
    return self.replica.load(snapshot, carry)

  def join(self, snapshot, expected: str) -> str:
    """Copies a live peer's ``snapshot`` (an object in the store); checks both hashes.

    Raises:
      ValueError: the copy does not hash to the peer's hash or to
        ``expected``, the hash the islands agreed on for that round.
    """
    got = self.replica.load(snapshot)
    if got != expected:
      raise ValueError(
        f"island {self.island}: the peer's state hashes to {got[:12]}, the "
        f"islands agreed on {expected[:12]}"
      )
    return got

  def work(self, round_: int, fault: dict | None = None):
    """Round ``round_``'s inner steps (called with ``num_returns=2``).

    Returns:
      ``(payload, info)``: the payload (``None`` when a ``drop`` fault eats
      it) and ``{"loss", "dropped", "nbytes"}``, two objects so that the
      coordinator reads the small ``info`` and only islands fetch payloads.
    """
    from train.islands import payload as payload_lib

    kind = None if fault is None else fault["kind"]
    if kind == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    out, loss = self.replica.train_round(round_)
    nbytes = out.nbytes
    if kind == "delay":
      time.sleep(fault["seconds"])
    if kind == "drop":
      out = None
    if kind == "forge":
      out = payload_lib.forged(out, fault["forge"])
    return out, {"loss": loss, "dropped": out is None, "nbytes": nbytes}

  def warmup(self) -> float:
    """Compiles the round's programs before round 0 (seconds taken)."""
    return self.replica.warmup()

  def flops_per_round(self) -> float:
    return self.replica.flops_per_round()

  def apply(self, round_: int, refs: list, fault: dict | None = None) -> dict:
    """Applies round ``round_`` from the quorum's payload references."""
    import ray

    payloads = ray.get(refs)
    out = self.replica.apply(round_, payloads)
    if fault is not None and fault["kind"] == "corrupt":
      self.replica.corrupt()
      out["hash"] = self.replica.hash()
    return out

  def snapshot(self):
    return self.replica.snapshot()

  def unsent(self):
    return self.replica.unsent()

  def evaluate(self) -> dict:
    return self.replica.evaluate()

  def hash(self) -> tuple[int, str]:
    return self.replica.round, self.replica.hash()
