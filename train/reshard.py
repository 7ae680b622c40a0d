r"""Resuming a checkpoint on another mesh shape with the same workers (DESIGN §7).

A checkpoint records its mesh (``config.mesh``, ``train/checkpoint.py``).
:func:`restore` is how the program reads every checkpoint: on the same
mesh it is a plain restore, and between worker counts on ``data=N``
meshes an elastic resume (``train/elastic.py``). On another mesh shape
with the same number of workers, e.g. ``data=8`` to ``data=2,fsdp=4`` and
back, or to ``node=2,local=4`` with ``config.compressor.hierarchical=local``,
the checkpoint is read to host memory in its own tree and each leaf of the
run's state is re-laid out by the rule of its *kind*:

================  ======================================  ==================================
kind              leaves                                  rule
================  ======================================  ==================================
``params``        params                                  the full leaf (unsharded if saved
                                                          under FSDP), sharded if the run is
                                                          FSDP: exact
``param_shaped``  optimizer state shaped like the         the same: exact
                  params: SGD's momentum trace, Adam's
                  ``mu`` and ``nu``
``residual``      error-feedback residuals                the workers' mean, each device
                  (``ErrorFeedbackState.residual``),      given its share (below): the mass
                  per worker                              not yet sent is conserved
``replicated``    counters, the shared PRNG key, the      kept (their shape is the same)
                  finite-step flags, model state,
                  ``step``, ``rng``
================  ======================================  ==================================

Anything else (a per-worker leaf of another kind, a leaf whose shape
changed and no rule covers, a scheme's own checkpoint entry) is a
``ValueError`` naming its path: nothing is silently reset. Only the
synchronous scheme runs on multi-axis meshes (``train/mesh.py``), so its
state is all there is to move.

**Finding a leaf.** The two runs' optimizer trees differ by one level: on
a mesh with a fast axis the exchange is ``gradcomp.hierarchical(...)``,
whose ``HierarchicalState.inner`` holds what the flat exchange holds
(``LayerFusionState``, ``CompressorState``). A leaf's saved path is the
run's with that level added or dropped at the exchange (the outermost of
those states on its path). A param-shaped leaf is one whose path ends with
a param's path.

**Residuals.** Each worker's residual is owed to the next averaged update.
Without a fast axis the update is the mean over all ``n`` workers, so the
residuals owe :math:`E = \frac1n\sum_w e_w`. With
``hierarchical(inner, fast)`` over ``g`` fast devices (FSDP, or
``node``/``local``), the device at fast index ``j`` compresses chunk ``j``
of each leaf (``ceil(d / g)`` values, the leaf raveled and zero-padded)
and the chunk's update is the mean over the ``n / g`` devices of that
index, so chunk ``j`` of :math:`E` is the mean of their residuals.
Either way :math:`E` (per leaf of the fused buffer, ``plan``'s groups) is
rebuilt in float64, and the run gives each worker all of :math:`E` (flat)
or, at fast index ``j``, chunk ``j`` of :math:`E` (hierarchical): the
mass each owes is :math:`E` again.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.fusion.fused import LayerFusionState
from gradcomp.fusion.hierarchical import HierarchicalState, shard_size
from train import elastic
from train import mesh as mesh_lib
from train.checkpoint import name_of

#: States an exchange (the compressor, in LayerFusion, in hierarchical) holds.
EXCHANGE_STATES = (HierarchicalState, LayerFusionState, CompressorState)

#: What each kind is, for the run's log.
KINDS = {
  "params": "full leaves, sharded or unsharded: exact",
  "param_shaped": "optimizer state shaped like the params: exact",
  "residual": "error feedback: the workers' mean, each device its share",
  "replicated": "kept",
}


def _child(node, key):
  if isinstance(key, GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, SequenceKey):
    return node[key.idx]
  return node[key.key]


def _walk(root, path) -> list:
  """The containers along ``path``: ``[(node, key)]``, ``key`` indexing ``node``."""
  steps, node = [], root
  for key in path:
    steps.append((node, key))
    node = _child(node, key)
  return steps


def _field(step, cls, name: str) -> bool:
  node, key = step
  return isinstance(node, cls) and isinstance(key, GetAttrKey) and key.name == name


def _error(path, saved: str, run: str, what: str) -> ValueError:
  return ValueError(
    f"resume from config.mesh={saved!r} on {run!r}: no rule for "
    f"state{jax.tree_util.keystr(tuple(path))} ({what}); resume it on {saved!r} "
    f"(train/reshard.py lists the kinds that move)"
  )


# -- Full leaves and shards ------------------------------------------------------


def _unfused_mean(rows: np.ndarray, shapes, g: int | None) -> list[np.ndarray]:
  """The workers' mean residual of each leaf of a fused group, full and float64.

  ``rows``: ``(n, *buffer)``: each worker's buffer, the group's leaves
  (``shapes``) raveled and concatenated, or with ``g`` their chunks at the
  worker's fast index ``r % g``.
  """
  n = rows.shape[0]
  flat = rows.reshape(n, -1).astype(np.float64)
  sizes = [math.prod(s) for s in shapes]
  if g is None:
    pieces = np.split(flat.mean(axis=0), np.cumsum(sizes)[:-1])
    return [p.reshape(s) for p, s in zip(pieces, shapes, strict=True)]
  chunks = [shard_size(d, g) for d in sizes]
  per_row = [np.split(row, np.cumsum(chunks)[:-1]) for row in flat]
  leaves = []
  for i, (d, s) in enumerate(zip(sizes, shapes, strict=True)):
    owned = [np.mean([per_row[r][i] for r in range(j, n, g)], axis=0) for j in range(g)]
    leaves.append(np.concatenate(owned)[:d].reshape(s))
  return leaves


def _fused_rows(leaves, g: int | None, m: int, row_shape, dtype) -> np.ndarray:
  """:func:`_unfused_mean`'s inverse for ``m`` workers: each its buffer of ``leaves``."""
  if g is None:
    buffer = np.concatenate([np.ravel(x) for x in leaves]).reshape(row_shape)
    return np.broadcast_to(buffer.astype(dtype), (m, *row_shape))
  shards = [mesh_lib.host_shard(x, g) for x in leaves]
  rows = [np.concatenate([s[r % g] for s in shards]) for r in range(m)]
  return np.stack(rows).reshape(m, *row_shape).astype(dtype)


# -- Moving a state ----------------------------------------------------------------


class _Move:
  """One re-layout: the saved arrays, both meshes, the run's layout and plan."""

  def __init__(self, saved, like, layout, saved_spec, spec, plan):
    self.saved, self.like, self.layout, self.plan = saved, like, layout, plan
    self.saved_spec, self.spec = saved_spec, spec
    full = layout.fsdp.like if layout.fsdp is not None else like["params"]
    flat = jax.tree_util.tree_flatten_with_path(full)[0]
    self.param_paths = [tuple(p) for p, _ in flat]
    self.param_shapes = [tuple(x.shape) for _, x in flat]
    self.counts: collections.Counter = collections.Counter()

  def fail(self, path, what: str) -> ValueError:
    return _error(path, str(self.saved_spec), str(self.spec), what)

  def read(self, path) -> np.ndarray:
    name = name_of(path)
    if name not in self.saved:
      raise self.fail(path, f"the checkpoint has no array {name}")
    return self.saved[name]

  def param_index(self, path) -> int | None:
    """The param whose path ``path`` ends with (the longest such), or ``None``."""
    found = [
      i
      for i, p in enumerate(self.param_paths)
      if p and len(p) <= len(path) and tuple(path[-len(p) :]) == p
    ]
    return max(found, key=lambda i: len(self.param_paths[i]), default=None)

  def full(self, path, x: np.ndarray, shape) -> np.ndarray:
    """A saved param-shaped leaf as the full leaf (unsharded if saved under FSDP)."""
    fsdp = self.saved_spec.fsdp
    if fsdp is None:
      if x.shape != shape:
        raise self.fail(path, f"saved {x.shape}, the param is {shape}")
      return x
    f = self.saved_spec.shape[fsdp]
    if x.shape != (f, shard_size(math.prod(shape), f)):
      raise self.fail(path, f"saved {x.shape}, not the {fsdp} shards of {shape}")
    return mesh_lib.host_unshard(x, shape)

  def param_shaped(self, path, saved_path, like_x, i: int, kind: str, sharded: bool):
    full = self.full(path, self.read(saved_path), self.param_shapes[i])
    self.counts[kind] += 1
    if sharded:
      return mesh_lib.host_shard(full, self.layout.fsdp.size)
    return full

  def residual(self, steps, path, saved_path, like_x) -> np.ndarray:
    """Error feedback: the workers' mean, each device given its share."""
    k = next(
      (i for i, s in enumerate(steps) if _field(s, CompressorState, "leaves")), None
    )
    e = max(
      (i for i, s in enumerate(steps) if _field(s, ErrorFeedbackState, "residual")),
      default=None,
    )
    if k is None or e is None:
      raise self.fail(path, "a residual outside a compressor's leaves")
    sub = tuple(path[k + 1 : e])
    if self.plan is not None and len(sub) == 1 and isinstance(sub[0], SequenceKey):
      unit = self.plan.groups[sub[0].idx]
    elif (i := self.param_index(sub)) is not None and self.param_paths[i] == sub:
      unit = (i,)
    else:
      raise self.fail(path, "a residual of no param or fused group")
    rows = self.read(saved_path)
    n, m = self.saved_spec.size, self.spec.size
    if rows.shape[0] != n or np.ndim(like_x) < 1 or like_x.shape[0] != m:
      raise self.fail(path, "a residual without a row per worker")
    shapes = [self.param_shapes[i] for i in unit]
    leaves = _unfused_mean(rows, shapes, self._fast(self.saved_spec))
    self.counts["residual"] += 1
    return _fused_rows(
      leaves, self._fast(self.spec), m, like_x.shape[1:], np.dtype(like_x.dtype)
    )

  @staticmethod
  def _fast(spec) -> int | None:
    return None if spec.hierarchical is None else spec.shape[spec.hierarchical]

  def saved_path(self, root, path):
    """``path``'s place in the saved tree: the hierarchical level added or dropped."""
    steps = _walk(root, path)
    start = next(
      (i for i, (node, _) in enumerate(steps) if isinstance(node, EXCHANGE_STATES)),
      None,
    )
    if start is None:
      return steps, tuple(path), False
    rest = tuple(path[start:])
    if self.spec.hierarchical is not None:
      rest = rest[1:]  # HierarchicalState.inner
    if self.saved_spec.hierarchical is not None:
      rest = (GetAttrKey("inner"), *rest)
    return steps, (*path[:start], *rest), True

  def leaf(self, path, like_x, per_worker: bool, sharded: bool):
    """The run's value of the optimizer-state leaf at ``path``."""
    steps, saved_path, in_exchange = self.saved_path(self.like, path)
    if in_exchange and any(_field(s, ErrorFeedbackState, "residual") for s in steps):
      return self.residual(steps, path, saved_path, like_x)
    i = None if in_exchange else self.param_index(path)
    if i is not None and not per_worker:
      return self.param_shaped(path, saved_path, like_x, i, "param_shaped", sharded)
    return self.kept(path, saved_path, like_x, per_worker)

  def kept(self, path, saved_path, like_x, per_worker: bool):
    x = self.read(saved_path)
    if per_worker:
      raise self.fail(path, "a per-worker leaf of no known kind")
    if x.shape != tuple(like_x.shape):
      raise self.fail(path, f"shaped {x.shape} when saved and {like_x.shape} here")
    self.counts["replicated"] += 1
    return x

  def state(self) -> dict[str, Any]:
    like, layout = self.like, self.layout
    extra = sorted(set(like) - set(elastic.CORE))
    if extra:
      raise self.fail((DictKey(extra[0]),), "a scheme's own checkpoint entry")
    top = lambda key: (DictKey(key),)
    params = jax.tree_util.tree_map_with_path(
      lambda p, x: self.param_shaped(
        (*top("params"), *p),
        (*top("params"), *p),
        x,
        self.param_paths.index(tuple(p)),
        "params",
        layout.fsdp is not None,
      ),
      like["params"],
    )
    kept = lambda key: jax.tree_util.tree_map_with_path(
      lambda p, x: self.kept((*top(key), *p), (*top(key), *p), x, False), like[key]
    )
    sharded = layout.sharded
    if sharded is None:
      sharded = jax.tree.map(lambda _: False, layout.per_worker)
    opt_state = jax.tree_util.tree_unflatten(
      jax.tree.structure(like["opt_state"]),
      [
        self.leaf((*top("opt_state"), *p), x, w, s)
        for (p, x), w, s in zip(
          jax.tree_util.tree_flatten_with_path(like["opt_state"])[0],
          jax.tree.leaves(layout.per_worker),
          jax.tree.leaves(sharded),
          strict=True,
        )
      ],
    )
    return {
      "params": params,
      "model_state": kept("model_state"),
      "opt_state": opt_state,
      "step": kept("step"),
      "rng": kept("rng"),
    }


def move(saved, like, layout, saved_spec, spec, plan):
  """The run's state from a checkpoint saved on ``saved_spec`` (same workers).

  Args:
    saved: the checkpoint's arrays by name (``Checkpointer.restore_named``).
    like: the run's initial state (for shapes, dtypes, and the tree's types).
    layout: the run's ``train.step.Layout``.
    saved_spec: the checkpoint's ``train.mesh.MeshSpec``.
    spec: the run's.
    plan: the run's fusion plan (the saved run's: the same config's), or ``None``.

  Returns:
    ``(state, counts)``: host arrays shaped as ``like``'s, and how many
    leaves each kind moved.

  Raises:
    ValueError: naming the path of a leaf no rule covers.
  """
  mover = _Move(saved, like, layout, saved_spec, spec, plan)
  state = mover.state()
  for (path, x), want in zip(
    jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(like), strict=True
  ):
    if np.shape(x) != tuple(want.shape):
      raise AssertionError(
        f"state{jax.tree_util.keystr(path)}: moved to {np.shape(x)}, not {want.shape}"
      )
  return state, dict(sorted(mover.counts.items()))


def restore(checkpoints, step: int, like, layout, scheme, spec, plan):
  """Checkpoint ``step`` for the run: as saved, moved between worker counts, or re-laid out.

  Args:
    checkpoints: the run's ``train.checkpoint.Checkpointer``.
    step: the checkpoint.
    like: the run's initial state (its layout on the mesh, its fresh values).
    layout: the run's ``train.step.Layout``.
    scheme: the run's scheme (for an elastic resume).
    spec: the run's ``train.mesh.MeshSpec``.
    plan: the run's fusion plan, or ``None``.

  Returns:
    ``(state, record)``: the state placed as ``like`` is, and ``None`` for a
    plain restore, else what moved: an elastic resume's record
    (``train.elastic.restore``), or ``{"from_mesh", "to_mesh", "rules"}``.

  Raises:
    ValueError: another mesh shape and another number of workers, or a leaf
      no rule moves.
  """
  record = checkpoints.saved_mesh(step)
  if record is None:  # Saved before meshes were recorded: data=N.
    workers = checkpoints.saved(step)[0] or spec.size
    record = {"mesh": f"{mesh_lib.DATA}={workers}", "hierarchical": None}
  saved_spec = mesh_lib.from_record(record)
  single = len(saved_spec.names) == 1 and len(spec.names) == 1
  if saved_spec == spec or single:
    return elastic.restore(checkpoints, step, like, layout, scheme)
  if saved_spec.size != spec.size:
    raise ValueError(
      f"checkpoint {step} was saved on config.mesh={str(saved_spec)!r} "
      f"({saved_spec.size} workers): another mesh shape resumes on the same "
      f"number of workers, not {spec.size} ({str(spec)!r})"
    )
  saved = checkpoints.restore_named(step)
  state, counts = move(saved, like, layout, saved_spec, spec, plan)
  placed = jax.tree.map(lambda x, want: jax.device_put(x, want.sharding), state, like)
  return placed, {"from_mesh": str(saved_spec), "to_mesh": str(spec), "rules": counts}


def log_key(record: Mapping[str, Any]) -> str:
  """The metrics row's key of a move's record: ``"remesh"`` or ``"elastic"``."""
  return "remesh" if "from_mesh" in record else "elastic"


def describe(record: Mapping[str, Any]) -> str:
  """The run's log line of a resume that moved the state."""
  if "from_mesh" not in record:
    return elastic.describe(record)
  rules = ", ".join(f"{kind} {count}" for kind, count in record["rules"].items())
  return (
    f"resumed on another mesh: {record['from_mesh']} -> {record['to_mesh']}; "
    f"leaves moved by rule: {rules}"
  )
