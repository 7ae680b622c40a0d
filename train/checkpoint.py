"""Orbax checkpoints of the whole train state (DESIGN §3).

A checkpoint holds ``{"params", "model_state", "opt_state", "step", "rng"}``:
the optimizer state in its global layout, so each worker's residuals (the
per-worker leaves' rows) are saved and restored per worker. The step is also
the data position (``train.data.batches(..., start_step=step)`` resumes the
batch order exactly). Orbax writes each checkpoint to a temporary directory
and renames it when complete, so a run killed mid-save leaves the previous
checkpoint as the latest.

Each checkpoint also records, in Orbax's metadata, the number of workers
that saved it and their mesh (``config.mesh``): a run resumed on another
number moves the state by the rules of ``train/elastic.py`` (elastic
resume, DESIGN §9), one resumed on another mesh shape by those of
``train/reshard.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

# Orbax's default on CPU saves a replicated array in slices, one per replica,
# each cut by an eager `slice` that XLA compiles for every shape and replica:
# 64 compiles in the first save of a tiny run on 8
# virtual devices, for no gain on one host. Whole shards are written instead.
_verbosity = logging.get_verbosity()
logging.set_verbosity(logging.ERROR)  # Orbax warns that it overrides a handler.
ocp.type_handlers.register_type_handler(
  jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
)
logging.set_verbosity(_verbosity)

State = dict[str, Any]


@jax.jit
def _finite(leaves) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _all_finite(tree) -> bool:
  # One program for all leaves: one eager reduction per sharded leaf (DGC on
  # ResNet-20 has 130) deadlocked XLA's CPU backend on 8 virtual devices.
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_finite(leaves)) if leaves else True


def name_of(path) -> str:
  """Orbax's name of the array at a key path: ``opt_state.inner_state.0.count``."""
  keys = []
  for key in path:
    if isinstance(key, GetAttrKey):
      keys.append(key.name)
    elif isinstance(key, SequenceKey):
      keys.append(str(key.idx))
    elif isinstance(key, DictKey):
      keys.append(str(key.key))
    else:
      raise TypeError(f"no Orbax name for key {key!r} of {path}")
  return ".".join(keys)


class Checkpointer:
  """Saves and restores the train state under ``directory``.

  Args:
    directory: where the numbered checkpoints go.
    max_to_keep: how many of the latest checkpoints are kept.
    workers: the run's number of workers, recorded with each checkpoint
      (``None``: not recorded).
    mesh: the run's mesh, ``{"mesh": "data=2,fsdp=4", "hierarchical":
      "fsdp"}`` (``train.mesh.MeshSpec.record``), recorded with each
      checkpoint (``None``: not recorded).
  """

  def __init__(
    self,
    directory: str | Path,
    max_to_keep: int,
    workers: int | None = None,
    mesh: dict[str, Any] | None = None,
  ):
    self._workers = workers
    self._mesh = mesh
    self._manager = ocp.CheckpointManager(
      Path(directory).absolute(),
      # A run killed mid-save leaves a temporary directory; drop it on restart.
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True
      ),
      # Named up front, so the saved arrays' metadata is readable before any
      # restore (``saved``).
      item_handlers=ocp.StandardCheckpointHandler(),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: State) -> None:
    """Saves ``state`` as checkpoint ``step`` (asynchronously).

    Raises:
      FloatingPointError: a float leaf holds NaN or inf; nothing is written.
    """
    if not _all_finite(state):
      raise FloatingPointError(
        f"refusing to checkpoint step {step}: the train state is not finite"
      )
    # Orbax copies the arrays to host before returning, so the next step may
    # donate (delete) their buffers.
    custom = {} if self._workers is None else {"workers": self._workers}
    custom.update(self._mesh or {})
    custom = custom or None
    self._manager.save(
      step, args=ocp.args.StandardSave(state), force=True, custom_metadata=custom
    )

  def restore(self, step: int, like: State) -> State:
    """Checkpoint ``step`` laid out (shapes, dtypes, shardings) like ``like``."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

  def saved(self, step: int) -> tuple[int | None, dict[str, tuple[int, ...]]]:
    """``(workers, shapes)`` of checkpoint ``step``, from its metadata (one read).

    ``workers``: the number of workers that saved it, if it says; ``shapes``:
    the shape of every saved array, by :func:`name_of` its path.
    """
    metadata = self._manager.metadata(step)
    workers = (metadata.custom_metadata or {}).get("workers")
    shapes = {
      leaf.name: tuple(leaf.shape)
      for leaf in jax.tree.leaves(metadata.item_metadata.tree)
    }
    return (None if workers is None else int(workers)), shapes

  def saved_mesh(self, step: int) -> dict[str, Any] | None:
    """The mesh checkpoint ``step`` recorded (as given to the constructor), if any."""
    custom = self._manager.metadata(step).custom_metadata or {}
    if "mesh" not in custom:
      return None
    return {k: custom.get(k) for k in ("mesh", "hierarchical")}

  def restore_named(self, step: int) -> dict[str, np.ndarray]:
    """Every array of checkpoint ``step``, on the host, by :func:`name_of` its path.

    Read in the checkpoint's own tree (from its metadata), whatever the
    run's: for moving a state between layouts (``train/reshard.py``).
    """
    tree = self._manager.metadata(step).item_metadata.tree
    template = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), tree)
    restored = self._manager.restore(step, args=ocp.args.StandardRestore(template))
    return {
      name_of(path): np.asarray(x)
      for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]
    }

  def restore_host(self, step: int, like: State) -> State:
    """Checkpoint ``step`` as host NumPy arrays in ``like``'s tree (shapes as saved).

    ``like``'s leaves give shape and dtype (``jax.ShapeDtypeStruct`` or arrays).
    """
    template = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), like)
    return self._manager.restore(step, args=ocp.args.StandardRestore(template))

  def close(self) -> None:
    """Waits for pending saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
