"""Bytes and messages of every collective in a traced (not compiled) program.

:func:`traced_collectives` traces an update under ``shard_map`` on an abstract
mesh, so it needs no devices; ``wire.collective_bytes`` reads the same from the
compiled HLO. Counting from the program catches indices, padding and second
rounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from gradcomp.parallel.wire import COLLECTIVES as KINDS
from gradcomp.parallel.workers import add_worker_axis, sharded_update

_PRIMITIVE_KINDS = {
  "psum": "all-reduce",
  "psum_invariant": "all-reduce",
  "pmax": "all-reduce",
  "pmin": "all-reduce",
  "all_gather": "all-gather",
  "all_gather_invariant": "all-gather",
  "reduce_scatter": "reduce-scatter",
  "ppermute": "collective-permute",
  "all_to_all": "all-to-all",
}
_TRACE_AXIS = "gradcomp_profile"
_TRACE_WORKERS = 2


def _collectives(jaxpr, totals: dict[str, list], scale: int = 1) -> None:
  """Adds the operand bytes and message count of every collective in ``jaxpr``."""
  for eqn in jaxpr.eqns:
    kind = _PRIMITIVE_KINDS.get(eqn.primitive.name)
    if kind is not None:
      nbytes = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
      totals[kind][0] += scale * nbytes
      totals[kind][1] += scale
    inner_scale = scale * int(eqn.params.get("length", 1))
    for name, value in eqn.params.items():
      branches = value if isinstance(value, tuple | list) else (value,)
      subs = [getattr(b, "jaxpr", b) for b in branches]
      subs = [s for s in subs if hasattr(s, "eqns")]
      if not subs:
        continue
      if name == "branches":  # lax.cond: one branch runs; count the largest.
        options = []
        for s in subs:
          part = {k: [0, 0] for k in KINDS}
          _collectives(s, part, inner_scale)
          options.append(part)
        best = max(options, key=lambda p: sum(v[0] for v in p.values()))
        for k in KINDS:
          totals[k][0] += best[k][0]
          totals[k][1] += best[k][1]
      else:
        for s in subs:
          _collectives(s, totals, inner_scale)


def traced_collectives(tx, tree, axis_name: str, workers: int):
  """``{kind: (bytes, messages)}`` one worker sends updating gradients ``tree``.

  ``tx`` exchanges over ``axis_name``; ``tree`` holds arrays or
  ``jax.ShapeDtypeStruct``. The update is traced (not compiled or run) under
  ``shard_map`` on an abstract mesh of ``workers``, so this needs no
  devices. Counting from the program catches indices, padding and second
  rounds; ``wire.wire_bytes`` reads the same from the compiled HLO.
  """
  mesh = AbstractMesh((workers,), (axis_name,))
  state = jax.eval_shape(lambda: add_worker_axis(tx.init(tree), workers))
  grads = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((workers, *x.shape), x.dtype), tree
  )
  f = sharded_update(tx, mesh, axis_name)
  totals = {k: [0, 0] for k in KINDS}
  _collectives(jax.make_jaxpr(f)(grads, state).jaxpr, totals)
  return {k: (b, m) for k, (b, m) in totals.items() if m}


def traced_wire(tx_for_axis, size: int) -> dict[str, tuple[int, int]]:
  """:func:`traced_collectives` of one float32 buffer of ``size`` values.

  ``tx_for_axis(axis_name)`` builds the compressor exchanging over
  ``axis_name``; it is traced on two workers.
  """
  leaf = jax.ShapeDtypeStruct((size,), jnp.float32)
  return traced_collectives(
    tx_for_axis(_TRACE_AXIS), (leaf,), _TRACE_AXIS, _TRACE_WORKERS
  )
