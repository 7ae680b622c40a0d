r"""Elastic resume: a run checkpointed on n workers resumes on m (DESIGN §9).

``train.train`` restores every checkpoint through :func:`restore`. One saved
on another number of workers (``train.checkpoint`` records it; older
checkpoints show it in their per-worker leaves) is read to host memory as
saved, every leaf of the train state is moved by the rule of its *kind*, and
the result is placed on the mesh as the run's initial state is: one pass over
the state beside what a plain restore reads. ``train.train`` logs what moved.

A leaf's kind comes from the state's structure: the innermost
``NamedTuple`` field on its path that :data:`FIELDS` knows (an
``ErrorFeedbackState.residual`` inside a ``CompressorState`` inside a
``LocalSGDState`` is a residual), and from the layout: whether the leaf has
a worker axis (``Layout.per_worker``, ``Layout.params_per_worker``). A
replicated leaf whose shape does not depend on the worker count is kept.
Per-worker params follow the scheme whose state the optimizer holds
(:data:`PARAMS`). :data:`KINDS` maps each kind to its rule, a small function
on NumPy arrays. A per-worker leaf of no known kind, or a replicated one
whose shape changed, is a ``ValueError`` naming its path: nothing is
silently reset.

Residuals conserve the mass not yet sent. Every compressor, the local SGD
round, CD-SGD's exchange and the 1-bit all-reduce average the workers'
payloads, so what the residuals still owe the next averaged update is
:math:`\frac1n\sum_w e_w`; each new worker gets exactly that,
:math:`e'_j = \frac1n\sum_w e_w`, and :math:`\frac1m\sum_j e'_j` is
the same mass. The asynchronous server applies each worker's push on its
own (a sum over pushes, not a mean): there :math:`\sum_w e_w` is owed, and
:math:`e'_j = \frac1m\sum_w e_w` keeps it. Sums are taken in float64 and
rounded to the leaf's dtype once.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.dgc import DGCLeafState
from gradcomp.compressors.fixed_point import DynamicFixedPointState
from gradcomp.compressors.intq import (
  Int8Residual,
  Int8ServerError,
  load_int8,
  store_int8,
)
from gradcomp.compressors.memory import ErrorFeedbackState
from gradcomp.compressors.scatter import ServerErrorState, chunk_size
from gradcomp.optimizers.demo import DeMoState
from gradcomp.optimizers.onebit_adam import OneBitAdamState
from gradcomp.optimizers.zero_one_adam import ZeroOneAdamState
from gradcomp.schemes.async_ps import AsyncPSState
from gradcomp.schemes.backup import BackupState
from gradcomp.schemes.cdsgd import CDSGDState
from gradcomp.schemes.easgd import EASGDState
from gradcomp.schemes.gosgd import GoSGDState
from gradcomp.schemes.gossip import GossipState
from gradcomp.schemes.local_sgd import LocalSGDState
from gradcomp.schemes.streaming import StreamingState
from train.checkpoint import name_of

#: The train state's entries every run checkpoints; a scheme's own entries
#: move by its ``Scheme.elastic`` hook.
CORE = ("params", "model_state", "opt_state", "step", "rng")


# -- The rules: one small function each, on NumPy arrays -----------------------
# ``rows`` has a leading axis of the n old workers; each rule returns the m
# new workers' rows (or, for a replicated leaf, its new value).


def _rows(value: np.ndarray, m: int) -> np.ndarray:
  """``value`` given to each of ``m`` workers (a view: placing it copies once)."""
  return np.broadcast_to(value, (m, *np.shape(value)))


def average(rows: np.ndarray, m: int) -> np.ndarray:
  """The old workers' mean, for every new worker.

  Summed in float64 and rounded to the dtype once; integer leaves (counters,
  fixed-point exponents) are rounded to the nearest integer.
  """
  mean = np.mean(rows, axis=0, dtype=np.float64)
  if not np.issubdtype(rows.dtype, np.inexact):
    mean = np.rint(mean)
  return _rows(mean.astype(rows.dtype), m)


def repartition_mean(residuals: np.ndarray, m: int) -> np.ndarray:
  """``e'_j = (1/n) sum_w e_w`` for every new worker j.

  With mean aggregation the residuals owe the next update ``(1/n) sum_w
  e_w``; the new workers owe ``(1/m) sum_j e'_j``, the same.
  """
  total = np.sum(residuals, axis=0, dtype=np.float64)
  total /= residuals.shape[0]
  return _rows(total.astype(residuals.dtype), m)


def repartition_sum(residuals: np.ndarray, m: int) -> np.ndarray:
  """``e'_j = (1/m) sum_w e_w``: ``sum_j e'_j = sum_w e_w`` (sum aggregation)."""
  total = np.sum(residuals, axis=0, dtype=np.float64)
  total /= m
  return _rows(total.astype(residuals.dtype), m)


def owner_residual(errors: np.ndarray, m: int) -> np.ndarray:
  """The 1-bit all-reduce's server errors, each value moved to its new owner.

  Worker w owns chunk w (``chunk_size(d, n)`` values) and uses only that
  chunk of its ``(d,)`` error, added once to the chunk's average. Value i
  goes from old owner ``i // chunk_size(d, n)`` to new owner ``i //
  chunk_size(d, m)``, unchanged; other entries are zero, as they are kept.
  """
  n, d = errors.shape
  index = np.arange(d)
  owned = errors[index // chunk_size(d, n), index]
  moved = np.zeros((m, d), errors.dtype)
  moved[index // chunk_size(d, m), index] = owned
  return moved


def int8_moved(codes: np.ndarray, scales: np.ndarray, move, m: int):
  """A residual stored in 8 bits (LoCo), decoded, moved by ``move``, re-encoded.

  ``move``: :func:`repartition_mean` (a worker's residual) or
  :func:`owner_residual` (a server error). Returns the new ``(codes,
  scales)``; the re-encoding rounds each value to nearest, within half a
  step of its block's scale, as every step's storage does.
  """
  values = np.asarray(load_int8(codes, scales), np.float32)
  new_codes, new_scales = store_int8(np.ascontiguousarray(move(values, m)))
  return np.asarray(new_codes), np.asarray(new_scales)


def from_anchor(anchor: np.ndarray, m: int) -> np.ndarray:
  """Every new worker restarts from ``anchor`` (the agreed params of the last round)."""
  return _rows(anchor, m)


def gossip_average(rows: np.ndarray, weights: np.ndarray, m: int) -> np.ndarray:
  """``x' = sum_w a_w x_w / sum_w a_w`` for every new worker.

  GoSGD's gossip keeps the weighted average of the params; this is it.
  """
  total = np.zeros(rows.shape[1:], np.float64)
  for weight, row in zip(weights.astype(np.float64), rows, strict=True):
    total += weight * row
  return _rows((total / np.sum(weights, dtype=np.float64)).astype(rows.dtype), m)


def gossip_weights(weights: np.ndarray, m: int) -> np.ndarray:
  """GoSGD's sum-weights renormalised for ``m`` workers.

  Weights are in units of ``1/n`` (they sum to n). Every new worker gets
  ``sum_w w_w / n``: in units of ``1/m`` they sum to m times the old total
  fraction, so the total sum-weight is kept and, with the params all equal
  (:func:`gossip_average`), so is the weighted average.
  """
  total = np.sum(weights, dtype=np.float64)
  return np.full((m,), total / weights.shape[0], weights.dtype)


def rederive_keys(start: np.ndarray, step: int) -> np.ndarray:
  """Worker j's key: ``fold_in(fold_in(start_j, step), j)``.

  ``start``: ``(m, 2)`` uint32, the keys a fresh run on m workers starts
  with (derived from the config's seed, as at step 0). Folding in the
  resume step keeps the resumed run from replaying step 0's draws; folding
  in j gives each new worker its own stream.
  """
  keys = [
    jax.random.fold_in(jax.random.fold_in(key, step), j) for j, key in enumerate(start)
  ]
  return np.stack([np.asarray(k, start.dtype) for k in keys])


def pulled_now(version: np.ndarray, m: int) -> np.ndarray:
  """Every new worker last pulled the server's current ``version``."""
  return np.full((m,), version, np.asarray(version).dtype)


def restart(fresh: np.ndarray) -> np.ndarray:
  """What a fresh run on m workers starts with (a task restarted at the new params)."""
  return np.asarray(fresh)


# -- The table: state kinds and their rules -------------------------------------


class Leaf(NamedTuple):
  """What a rule may read: the saved value, the run's initial one, and context."""

  saved: np.ndarray  # as checkpointed on n workers.
  like: Any  # the run's initial value (m workers): its shape, or a fresh start.
  m: int  # the new number of workers.
  step: int  # the checkpoint's step.
  partner: Any  # another saved leaf the rule reads (an anchor, the weights), or None.


class Kind(NamedTuple):
  rule: Callable[[Leaf], np.ndarray]
  why: str


KINDS: dict[str, Kind] = {
  "replicated": Kind(
    lambda leaf: leaf.saved,
    "equal on every worker and shaped independently of their number: step "
    "counters, the momentum trace of the exchanged mean, the shared PRNG key, "
    "PowerSGD's Q, anchors, centres, servers",
  ),
  "params": Kind(
    lambda leaf: average(leaf.saved, leaf.m),
    "the workers' models differ; their mean is the model the scheme converges "
    "to (gossip's mixing and EASGD's force keep it)",
  ),
  "params_from_anchor": Kind(
    lambda leaf: from_anchor(leaf.partner, leaf.m),
    "local SGD / DiLoCo: the anchor is the last agreed model; local steps "
    "since are discarded, as a round discards them",
  ),
  "params_gossip_average": Kind(
    lambda leaf: gossip_average(leaf.saved, leaf.partner, leaf.m),
    "GoSGD: the sum-weighted average is what gossip conserves",
  ),
  "params_from_server": Kind(
    lambda leaf: from_anchor(leaf.partner, leaf.m),
    "asynchronous server: a worker's params are a server version it pulled; "
    "new workers pull the current one",
  ),
  "local": Kind(
    lambda leaf: average(leaf.saved, leaf.m),
    "each worker's own optimizer or codec state (local momentum, DGC's "
    "momentum, fixed-point exponents, CHOCO's public copies, per-worker "
    "counters): their mean",
  ),
  "residual_mean": Kind(
    lambda leaf: repartition_mean(leaf.saved, leaf.m),
    "error feedback (residuals, DGC's velocity, CD-SGD's pending message, "
    "DeMo's delta, in-flight pseudo-gradients): mean aggregation owes "
    "(1/n) sum_w e_w; e'_j = (1/n) sum_w e_w owes the same",
  ),
  "residual_sum": Kind(
    lambda leaf: repartition_sum(leaf.saved, leaf.m),
    "the asynchronous server applies each push alone (sum aggregation): "
    "e'_j = (1/m) sum_w e_w keeps sum_w e_w",
  ),
  "owner_residual": Kind(
    lambda leaf: owner_residual(leaf.saved, leaf.m),
    "the server error of the 1-bit all-reduce and of the compressors' "
    "exchange='scatter' forms is owed once per chunk by its owner; each value "
    "moves to its chunk's new owner",
  ),
  "int8_residual_codes": Kind(
    lambda leaf: int8_moved(leaf.saved, leaf.partner, repartition_mean, leaf.m)[0],
    "residual_mean for an error-feedback residual stored in 8 bits (LoCo): "
    "decoded with its scales, moved, re-encoded",
  ),
  "int8_residual_scales": Kind(
    lambda leaf: int8_moved(leaf.partner, leaf.saved, repartition_mean, leaf.m)[1],
    "the scales of an 8-bit residual, moved with its codes",
  ),
  "int8_owner_codes": Kind(
    lambda leaf: int8_moved(leaf.saved, leaf.partner, owner_residual, leaf.m)[0],
    "owner_residual for a server error stored in 8 bits (LoCo): decoded with "
    "its scales, each value moved to its chunk's new owner, re-encoded",
  ),
  "int8_owner_scales": Kind(
    lambda leaf: int8_moved(leaf.partner, leaf.saved, owner_residual, leaf.m)[1],
    "the scales of an 8-bit server error, moved with its codes",
  ),
  "prng": Kind(
    lambda leaf: rederive_keys(np.asarray(leaf.like), leaf.step),
    "per-worker streams re-derived from the seed, the step and the new worker "
    "index: n streams do not split into m",
  ),
  "gossip_weight": Kind(
    lambda leaf: gossip_weights(leaf.saved, leaf.m),
    "GoSGD's sum-weights renormalised so their total, and the weighted "
    "average, are kept",
  ),
  "choco_neighbourhood": Kind(
    lambda leaf: average(leaf.partner, leaf.m),
    "CHOCO's s_i = sum_j W_ij x^_j recomputed for the averaged public copies "
    "(rows of W sum to 1)",
  ),
  "async_pulled": Kind(
    lambda leaf: pulled_now(leaf.partner, leaf.m),
    "new workers pulled the server's current version",
  ),
  "async_backup": Kind(
    lambda leaf: from_anchor(leaf.partner, leaf.m),
    "DC-ASGD's backups are the params each worker last pulled: the server's",
  ),
  "async_task": Kind(
    lambda leaf: restart(leaf.like),
    "gradients in progress were taken at the old params; each new worker "
    "starts a task as at step 0",
  ),
  "worker_statistic": Kind(
    lambda leaf: average(leaf.saved, leaf.m),
    "a count per worker (pushes, dropped rounds): the new workers start level, "
    "at the mean",
  ),
}

#: A leaf's kind from the ``NamedTuple`` field holding it, the innermost known
#: one on its path. Fields of replicated state need no entry (kept), unless
#: their shape depends on the number of workers.
FIELDS: dict[tuple[type, str], str] = {
  (ErrorFeedbackState, "residual"): "residual_mean",
  (DGCLeafState, "velocity"): "residual_mean",
  (DGCLeafState, "momentum"): "local",
  (DynamicFixedPointState, "exponent"): "local",
  (DynamicFixedPointState, "overflow"): "local",
  (CompressorState, "count"): "local",
  (CompressorState, "key"): "prng",
  (CDSGDState, "message"): "residual_mean",
  (DeMoState, "delta"): "residual_mean",
  (OneBitAdamState, "worker_error"): "residual_mean",
  (OneBitAdamState, "server_error"): "owner_residual",
  (ZeroOneAdamState, "worker_error"): "residual_mean",
  (ZeroOneAdamState, "server_error"): "owner_residual",
  (ServerErrorState, "error"): "owner_residual",  # exchange="scatter" forms
  (Int8Residual, "codes"): "int8_residual_codes",  # int_quantize(residual_bits=8)
  (Int8Residual, "scales"): "int8_residual_scales",
  (Int8ServerError, "codes"): "int8_owner_codes",
  (Int8ServerError, "scales"): "int8_owner_scales",
  (ZeroOneAdamState, "mu"): "local",
  (ZeroOneAdamState, "accumulator"): "local",
  (LocalSGDState, "inner_state"): "local",
  (StreamingState, "inner_state"): "local",
  (StreamingState, "anchor"): "local",  # Per worker with eager updates.
  (StreamingState, "outer_state"): "local",  # Likewise.
  (StreamingState, "in_flight"): "residual_mean",
  (EASGDState, "inner_state"): "local",
  (GossipState, "inner_state"): "local",
  (GossipState, "public"): "local",
  (GossipState, "neighbourhood"): "choco_neighbourhood",
  (GoSGDState, "inner_state"): "local",
  (GoSGDState, "weight"): "gossip_weight",
  (AsyncPSState, "pulled"): "async_pulled",
  (AsyncPSState, "pushes"): "worker_statistic",
  (AsyncPSState, "left"): "async_task",
  (AsyncPSState, "waiting"): "async_task",
  (AsyncPSState, "backups"): "async_backup",
  (BackupState, "dropped"): "worker_statistic",
}

#: Where the aggregation is a sum: a residual kind inside one of these fields.
SUMMED: dict[tuple[type, str], str] = {
  (AsyncPSState, "compressor_state"): "residual_sum",
}

#: The saved field a kind's rule reads beside the leaf (its ``partner``): a
#: tree shaped as the leaf's own (aligned by path) or a scalar.
PARTNERS: dict[str, str] = {
  "choco_neighbourhood": "public",
  "async_pulled": "version",
  "async_backup": "server",
  "int8_residual_codes": "scales",  # The sibling field: codes and scales move together.
  "int8_residual_scales": "codes",
  "int8_owner_codes": "scales",
  "int8_owner_scales": "codes",
}

#: Per-worker params by the scheme state the optimizer holds: (kind, field
#: read). Other schemes average them.
PARAMS: dict[type, tuple[str, str]] = {
  LocalSGDState: ("params_from_anchor", "anchor"),
  StreamingState: ("params_from_anchor", "anchor"),
  GoSGDState: ("params_gossip_average", "weight"),
  AsyncPSState: ("params_from_server", "server"),
}


# -- Reading the structure ------------------------------------------------------


def _owners(root, path) -> list[tuple[type, str, int]]:
  """``(NamedTuple type, field, position in path)`` of each field on ``path``."""
  node, owners = root, []
  for i, key in enumerate(path):
    if isinstance(key, GetAttrKey):
      owners.append((type(node), key.name, i))
      node = getattr(node, key.name)
    elif isinstance(key, SequenceKey):
      node = node[key.idx]
    elif isinstance(key, DictKey):
      node = node[key.key]
    else:  # A custom node: its fields are not ours.
      break
  return owners


def _get(root, path):
  for key in path:
    if isinstance(key, GetAttrKey):
      root = getattr(root, key.name)
    elif isinstance(key, SequenceKey):
      root = root[key.idx]
    else:
      root = root[key.key]
  return root


def kind_of(root, path, per_worker: bool) -> tuple[str | None, Any]:
  """``(kind, partner path)`` of the leaf at ``path`` of ``root`` (``None``: unknown).

  The innermost field of :data:`FIELDS` on the path decides; a residual
  inside a field of :data:`SUMMED` takes that field's kind instead.
  """
  owners = _owners(root, path)
  for cls, field, i in reversed(owners):
    kind = FIELDS.get((cls, field))
    if kind is None or (not per_worker and kind not in _WORKER_INDEXED):
      continue
    if kind == "residual_mean":
      for outer, name, _ in owners:
        kind = SUMMED.get((outer, name), kind)
    partner = None
    if kind in PARTNERS:
      rest = () if kind == "async_pulled" else path[i + 1 :]
      partner = (*path[:i], GetAttrKey(PARTNERS[kind]), *rest)
    return kind, partner
  return None, None


#: Kinds of replicated leaves shaped by the number of workers.
_WORKER_INDEXED = frozenset(
  {"async_pulled", "async_task", "async_backup", "worker_statistic"}
)


def _scheme_state(opt_state):
  """The first state in ``opt_state`` of a type :data:`PARAMS` names, or ``None``."""
  owners = tuple(PARAMS)
  found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, owners))
  return next((x for x in found if isinstance(x, owners)), None)


def _name(path) -> str:
  return "state" + jax.tree_util.keystr(tuple(path))


def _error(path, n: int, m: int, what: str) -> ValueError:
  return ValueError(
    f"elastic resume from {n} to {m} workers: no rule for {_name(path)} ({what}); "
    f"add its kind to train.elastic.FIELDS (never reset silently)"
  )


# -- Moving a state -------------------------------------------------------------


def _move(kind: str, x, like_x, rows: tuple[bool, bool], m: int, step: int, partner):
  """``x`` moved by ``kind``'s rule to ``like_x``'s shape.

  ``rows``: whether the saved leaf and the run's have a worker axis. One
  worker's layout may type replicated what more workers' type per worker
  (GoSGD's weight, whose gossip never runs alone): such a leaf moves by its
  per-worker rule, with the axis added to the saved value (n = 1) or dropped
  from the moved one (m = 1).
  """
  saved_rows, like_rows = rows
  if like_rows and not saved_rows:
    x = np.asarray(x)[None]
  if saved_rows and not like_rows:
    like_x = np.asarray(like_x)[None]
  moved = KINDS[kind].rule(Leaf(x, like_x, m, step, partner))
  return moved[0] if saved_rows and not like_rows else moved


def _has_rows(x, like_x, like_rows: bool) -> bool:
  """Whether saved ``x`` has a worker axis (the run's ``like_x`` has one if ``like_rows``)."""
  return np.ndim(x) == np.ndim(like_x) + (0 if like_rows else 1)


def _params(saved, like, opt_state, worker: bool, m: int, step: int, counts):
  """Per-worker params by the scheme's rule (:data:`PARAMS`), else their mean."""
  state = _scheme_state(opt_state)
  kind, field = PARAMS.get(type(state), ("params", None))
  partner = None if field is None else getattr(state, field)
  flat, treedef = jax.tree_util.tree_flatten(saved)
  like_flat = jax.tree.leaves(like)
  if kind in ("params_from_anchor", "params_from_server"):
    # An anchor kept per worker (eager updates) is first averaged.
    partners = [
      average(p, 1)[0] if np.ndim(p) > np.ndim(like_x) - worker else p
      for p, like_x in zip(jax.tree.leaves(partner), like_flat, strict=True)
    ]
  else:  # GoSGD's weights, one per saved worker (a scalar when one saved).
    partners = [None if partner is None else np.reshape(partner, -1)] * len(flat)
  moved = [
    _move(kind, x, like_x, (_has_rows(x, like_x, worker), worker), m, step, p)
    for x, like_x, p in zip(flat, like_flat, partners, strict=True)
  ]
  counts[kind] += len(flat)
  return jax.tree_util.tree_unflatten(treedef, moved)


def _opt_state(saved, like, per_worker, n: int, m: int, step: int, counts):
  flat, treedef = jax.tree_util.tree_flatten_with_path(saved)
  moved = []
  for (path, x), like_x, worker in zip(
    flat, jax.tree.leaves(like), jax.tree.leaves(per_worker), strict=True
  ):
    # Per worker as saved (n rows) or as the run lays it out (m rows).
    rows = (_has_rows(x, like_x, worker), worker)
    kind, partner = kind_of(saved, path, any(rows))
    where = (DictKey("opt_state"), *path)
    if kind is None:
      if any(rows):
        raise _error(where, n, m, "a per-worker leaf of unknown kind")
      if np.shape(x) != np.shape(like_x):
        raise _error(
          where,
          n,
          m,
          f"replicated, but shaped {np.shape(x)} on {n} workers and "
          f"{np.shape(like_x)} on {m}",
        )
      kind = "replicated"
    partner = None if partner is None else _get(saved, partner)
    moved.append(_move(kind, x, like_x, rows, m, step, partner))
    counts[kind] += 1
  return jax.tree_util.tree_unflatten(treedef, moved)


def resize(
  saved: Mapping[str, Any],
  like: Mapping[str, Any],
  per_worker,
  params_per_worker: bool,
  from_workers: int,
  to_workers: int,
) -> tuple[dict[str, Any], dict[str, int]]:
  """The core train state (:data:`CORE`) saved on ``from_workers`` workers, moved to ``like``'s.

  Args:
    saved: ``{"params", "model_state", "opt_state", "step", "rng"}`` as
      checkpointed, host arrays with the saved shapes.
    like: the same entries as the run starts them (m workers); read for
      shapes and for fresh starts (PRNG streams, asynchronous tasks).
    per_worker: ``Layout.per_worker`` of the run: which optimizer-state
      leaves carry a worker axis.
    params_per_worker: ``Layout.params_per_worker``.
    from_workers: n, the saved worker count.
    to_workers: m, the run's.

  Returns:
    ``(state, counts)``: host arrays shaped as ``like``'s, and how many
    leaves each kind of :data:`KINDS` moved.

  Raises:
    ValueError: naming the path of a leaf no rule covers.
  """
  n, m = from_workers, to_workers
  step = int(np.asarray(saved["step"]))
  counts: collections.Counter = collections.Counter()
  opt_state = _opt_state(
    saved["opt_state"], like["opt_state"], per_worker, n, m, step, counts
  )
  first, like_first = (
    jax.tree.leaves(saved["params"])[0],
    jax.tree.leaves(like["params"])[0],
  )
  if params_per_worker or _has_rows(
    first, like_first, False
  ):  # Per worker either side.
    worker = params_per_worker
    params = _params(
      saved["params"], like["params"], saved["opt_state"], worker, m, step, counts
    )
    model_state = jax.tree.map(
      lambda x, like_x: _move(
        "local", x, like_x, (_has_rows(x, like_x, worker), worker), m, step, None
      ),
      saved["model_state"],
      like["model_state"],
    )
    counts["local"] += len(jax.tree.leaves(model_state))
  else:
    params, model_state = saved["params"], saved["model_state"]
    counts["replicated"] += len(jax.tree.leaves((params, model_state)))
  counts["replicated"] += 2  # step, rng
  counts = +counts  # Kinds that moved nothing are not listed.
  state = {
    "params": params,
    "model_state": model_state,
    "opt_state": opt_state,
    "step": saved["step"],
    "rng": saved["rng"],
  }
  moved = jax.tree_util.tree_flatten_with_path(state)[0]
  wanted = jax.tree.leaves({k: like[k] for k in CORE})
  for (path, x), want in zip(moved, wanted, strict=True):
    if np.shape(x) != np.shape(want):
      raise AssertionError(
        f"{_name(path)}: moved to {np.shape(x)}, not {np.shape(want)}"
      )
  return state, dict(sorted(counts.items()))


# -- In the program -------------------------------------------------------------


def saved_workers(recorded: int | None, shapes, like, layout) -> int | None:
  """How many workers saved a checkpoint.

  ``recorded`` with it, or, for a checkpoint that does not say, the leading
  axis of its per-worker leaves in ``shapes`` (``None`` when it has none:
  then nothing saved depends on the number of workers).
  """
  if recorded is not None:
    return recorded
  entries = [("opt_state", jax.tree.leaves(layout.per_worker))]
  if layout.params_per_worker:
    entries.append(("params", None))
  for key, marks in entries:
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(like[key])[0]):
      name = checkpoint_name(key, path)
      if (marks is None or marks[i]) and name in shapes:
        return shapes[name][0]
  return None


def checkpoint_name(key: str, path) -> str:
  """The saved name of the leaf at ``path`` of the state's entry ``key``."""
  return name_of((DictKey(key), *path))


def restore(checkpoints, step: int, like, layout, scheme):
  """Checkpoint ``step`` for the run: moved if saved on another number of workers.

  Args:
    checkpoints: the run's ``train.checkpoint.Checkpointer``.
    step: the checkpoint.
    like: the run's initial state (its layout on the mesh, its fresh values).
    layout: the run's ``train.step.Layout``.
    scheme: the run's scheme; its ``elastic`` hook moves its own entries.

  Returns:
    ``(state, record)``: the state placed as ``like`` is, and ``None`` for a
    plain restore (the same number of workers), else what was moved:
    ``{"from_workers": n, "to_workers": m, "rules": {kind: leaves}}``.
  """
  recorded, shapes = checkpoints.saved(step)
  n, m = saved_workers(recorded, shapes, like, layout), layout.num_workers
  if n in (None, m):
    return checkpoints.restore(step, like=like), None

  def as_saved(path, x):
    name = checkpoint_name(path[0].key, path[1:])
    if name not in shapes:
      raise ValueError(
        f"checkpoint {step} has no array {_name(path)} ({name}): it was saved "
        f"by another config"
      )
    return jax.ShapeDtypeStruct(shapes[name], x.dtype)

  saved = checkpoints.restore_host(
    step, jax.tree_util.tree_map_with_path(as_saved, like)
  )
  state, counts = resize(
    {k: saved[k] for k in CORE},
    {k: like[k] for k in CORE},
    layout.per_worker,
    layout.params_per_worker,
    n,
    m,
  )
  state.update(scheme.elastic({k: v for k, v in saved.items() if k not in CORE}, n))
  placed = jax.tree.map(lambda x, want: jax.device_put(x, want.sharding), state, like)
  return placed, {"from_workers": n, "to_workers": m, "rules": counts}


def describe(record: Mapping[str, Any]) -> str:
  """The run's log line of an elastic resume."""
  rules = ", ".join(f"{kind} {count}" for kind, count in record["rules"].items())
  return (
    f"elastic resume: {record['from_workers']} -> {record['to_workers']} workers; "
    f"leaves moved by rule: {rules}"
  )
