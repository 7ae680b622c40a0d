"""The outer checkpoint: Orbax, every ``islands.checkpoint_every_rounds`` (DESIGN §12).

It holds what a whole-cluster stop needs to go on: the rounds applied, the
global params, the outer optimizer state (its leaves in tree order), the
agreed hash of both, and each live island's unsent mass (error-feedback
residuals plus carry, ``Replica.unsent``) stacked on a leading island
axis. A run resumed on ``m`` islands gives each of them
``(1/m) sum_w unsent_w`` as its carry (``train.elastic.repartition_sum``,
DESIGN §9: the sum, the mass not yet applied, is conserved); the global
state is the same on every island, checked against the saved hash.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from train import elastic

DIRECTORY = "outer"


class OuterCheckpoints:
  """Saves and restores outer checkpoints under ``workdir/outer``."""

  def __init__(self, workdir: str | Path, max_to_keep: int = 2):
    self.directory = Path(workdir).absolute() / DIRECTORY
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True
      ),
      item_handlers=ocp.StandardCheckpointHandler(),
    )

  def latest(self) -> int | None:
    """Rounds applied in the latest checkpoint, or ``None``."""
    return self._manager.latest_step()

  def save(self, snapshot, unsent: list) -> None:
    """Saves a :class:`replica.Snapshot` and the islands' unsent mass (blocking)."""
    outer = {
      f"{i:04d}": np.asarray(x)
      for i, x in enumerate(jax.tree.leaves(snapshot.outer_state))
    }
    state = {
      "round": np.asarray(snapshot.round, np.int64),
      "params": snapshot.params,
      "outer": outer,
      "compressor_count": np.asarray(snapshot.compressor_count, np.int64),
      "hash": np.frombuffer(snapshot.hash.encode(), np.uint8).copy(),
      "unsent": jax.tree.map(lambda *x: np.stack(x), *unsent),
    }
    self._manager.save(snapshot.round, args=ocp.args.StandardSave(state))
    self._manager.wait_until_finished()

  def restore(self, islands: int):
    """``(snapshot, [carry per island], saved islands)`` of the latest checkpoint."""
    from train.islands import replica

    step = self._manager.latest_step()
    state = self._manager.restore(step, args=ocp.args.StandardRestore())
    outer = [state["outer"][k] for k in sorted(state["outer"])]
    saved = jax.tree.leaves(state["unsent"])[0].shape[0]
    moved = jax.tree.map(
      lambda x: elastic.repartition_sum(np.asarray(x), islands), state["unsent"]
    )
    carries = [
      jax.tree.map(lambda x, j=j: np.array(x[j]), moved) for j in range(islands)
    ]
    snap = replica.Snapshot(
      round=int(state["round"]),
      params=jax.tree.map(np.asarray, state["params"]),
      outer_state=outer,
      compressor_count=int(state["compressor_count"]),
      hash=bytes(np.asarray(state["hash"], np.uint8)).decode(),
    )
    return snap, carries, saved

  def close(self) -> None:
    self._manager.close()
