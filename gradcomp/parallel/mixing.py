"""Gossip mixing on devices: one ``ppermute`` per edge of a topology's phase.

:func:`mix` mixes a pytree of per-worker values, ``sum_j W_t[i, j] x_j``;
:func:`mix_decoded` mixes a compressed payload that crosses the wire as it
is and is decoded by each receiver (CHOCO-SGD's compressed gossip, Koloskova
et al. 2019). Both run under ``jax.shard_map`` (JAX 0.10 varying types) and
``jax.pmap``. The topologies themselves are :mod:`gradcomp.topology`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from gradcomp.parallel.branches import varying_axes
from gradcomp.topology import Phase, Topology, _is_int


def _accumulator_dtype(dtype):
  """float32 for half-precision floats (sums of weighted terms), else ``dtype``."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
      f"gossip mixes floating-point values, got a leaf of dtype {dtype}; keep "
      "integer leaves out of the mixed tree"
    )
  return jnp.promote_types(dtype, jnp.float32)


def _per_worker(values: tuple[float, ...], index, dtype):
  """``values[index]`` for this worker: a Python float when all are equal."""
  if len(set(values)) == 1:
    return values[0]
  return jnp.asarray(values, dtype)[index]


def _phase_mix(phase: Phase, payload, decode, axis_name, masked: bool):
  """``sum_j W[i, j] decode(p_j)`` for one phase: all ppermutes, then the sum."""
  received = [jax.lax.ppermute(payload, axis_name, edge.perm) for edge in phase.edges]
  index = jax.lax.axis_index(axis_name)
  own = decode(payload)
  acc_dtypes = jax.tree.map(lambda d: _accumulator_dtype(d.dtype), own)

  def weighted(values, dense):
    return jax.tree.map(
      lambda d, a: d.astype(a) * _per_worker(values, index, a), dense, acc_dtypes
    )

  total = weighted(phase.self_weights, own)
  for edge, recv in zip(phase.edges, received, strict=True):
    # Receivers only: a worker outside the edge gets zeros from ppermute, and
    # weight 0; with a decode, zeros may decode to anything, so mask it.
    receivers = [i for i, s in enumerate(edge.sources) if s >= 0]
    weights = tuple(edge.weights[i] for i in receivers)
    if len(set(weights)) == 1:
      weights = (weights[0],) * len(edge.sources)  # zero-filled elsewhere
    else:
      weights = edge.weights
    term = weighted(weights, decode(recv))
    if masked and not edge.is_permutation:
      mask = jnp.asarray([s >= 0 for s in edge.sources])[index]
      term = jax.tree.map(lambda t: jnp.where(mask, t, jnp.zeros_like(t)), term)
    total = jax.tree.map(jnp.add, total, term)
  return jax.tree.map(lambda t, d: t.astype(d.dtype), total, own)


def _joined_switch(index, branches, operand):
  """``lax.switch`` whose branches' outputs are cast to their joined varying axes."""
  shapes = [jax.eval_shape(b, operand) for b in branches]
  union = jax.tree.map(lambda *s: frozenset().union(*map(varying_axes, s)), *shapes)

  def cast(x, axes):
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  joined = [lambda op, b=b: jax.tree.map(cast, b(op), union) for b in branches]
  return jax.lax.switch(index, joined, operand)


def _run(topology: Topology, payload, decode, step, axis_name, masked: bool):
  if not isinstance(topology, Topology):
    raise ValueError(f"topology must be a Topology, got {topology!r}")
  if axis_name is None:
    return decode(payload)
  size = jax.lax.axis_size(axis_name)
  if size != topology.workers:
    raise ValueError(
      f"topology {topology.name!r} has {topology.workers} workers, but axis "
      f"{axis_name!r} has {size}"
    )
  phases = topology.phases
  if len(phases) == 1:
    return _phase_mix(phases[0], payload, decode, axis_name, masked)
  if _is_int(step) or isinstance(step, np.integer):
    phase = topology.phase(int(step))
    return _phase_mix(phase, payload, decode, axis_name, masked)
  step = jnp.asarray(step)
  if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
    raise ValueError(f"step must be an integer scalar, got {step.dtype}{step.shape}")
  branches = [
    lambda op, p=p: _phase_mix(p, op, decode, axis_name, masked) for p in phases
  ]
  return _joined_switch(step % len(phases), branches, payload)


def mix(topology: Topology, tree, step, axis_name: str | None):
  """One gossip step: on worker ``i``, ``sum_j W_t[i, j] x_j`` for every leaf.

  .. math:: x_i \\leftarrow W_t[i, i] \\, x_i + \\sum_{e}
     e.\\mathrm{weights}[i] \\; x_{e.\\mathrm{sources}[i]}

  One ``jax.lax.ppermute`` per edge of the phase (the whole tree in one
  call), then the weighted sum, with the worker's own weights picked by
  ``jax.lax.axis_index`` (a Python constant where all workers share one).
  Half-precision leaves are summed in float32; every output leaf keeps its
  input dtype. With several phases and a traced ``step``, a ``lax.switch``
  picks the phase; ``step`` must then be the same on every worker (a count
  of updates), and the switch's branches' outputs are typed varying
  alike. Runs inside ``jax.shard_map`` (outputs varying over
  ``axis_name``) and ``jax.pmap``.

  Args:
    topology: the :class:`Topology`, with as many workers as ``axis_name``.
    tree: this worker's pytree of floating-point arrays.
    step: the number of updates already taken: a Python int (the phase is
      chosen at trace time) or a scalar integer array.
    axis_name: the workers' mesh axis; ``None``: one worker, the tree is
      returned as it is.

  Returns:
    The mixed tree, same structure, shapes and dtypes.
  """
  if axis_name is None:
    if not isinstance(topology, Topology):
      raise ValueError(f"topology must be a Topology, got {topology!r}")
    return tree
  return _run(topology, tree, lambda p: p, step, axis_name, masked=False)


def mix_decoded(
  topology: Topology, payload, decode: Callable, step, axis_name: str | None
):
  """Gossip of a compressed payload: ``sum_j W_t[i, j] decode(p_j)`` on worker ``i``.

  ``payload`` (a pytree of arrays: ``(values, int32 indices)``, packed
  ``uint8`` signs, ``(int8 codes, scale)``) goes through the ``ppermute``'s
  as it is, so the ``collective-permute`` carries the codec's wire format,
  not dense floats; each receiver rebuilds the dense value with ``decode``,
  and the self term decodes the worker's own payload locally. A worker that
  receives nothing on an edge never uses what ``decode`` makes of the zeros
  ``ppermute`` leaves it (masked out). Otherwise as :func:`mix`.

  Args:
    topology: the :class:`Topology`.
    payload: this worker's payload pytree.
    decode: ``decode(payload) -> dense``, called with a pytree shaped as
      ``payload`` (one argument) and returning a floating-point array (or
      pytree of them); traced once per edge plus once for the self term.
    step: as for :func:`mix`.
    axis_name: the workers' mesh axis; ``None``: one worker,
      ``decode(payload)``.

  Returns:
    The mix, shaped and typed as ``decode``'s output.
  """
  return _run(topology, payload, decode, step, axis_name, masked=True)
