"""Bytes and messages of every collective in a traced (not compiled) program.

:func:`traced_collectives` traces an update under ``shard_map`` on an abstract
mesh, so it needs no devices; ``wire.collective_bytes`` reads the same from the
compiled HLO. Counting from the program catches indices, padding and second
rounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomp.parallel import wire
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


def _found(jaxpr, scale: int = 1) -> list[tuple[str, object, int, int]]:
  """``(kind, eqn, operand bytes, times)`` of every collective in ``jaxpr``.

  A ``scan`` body's collectives run ``length`` times (``times``, and their
  bytes scaled by it); of a ``cond``'s branches, only one runs: the one
  sending the most counts.
  """
  out = []
  for eqn in jaxpr.eqns:
    kind = _PRIMITIVE_KINDS.get(eqn.primitive.name)
    if kind is not None:
      nbytes = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
      out.append((kind, eqn, scale * nbytes, scale))
    inner_scale = scale * int(eqn.params.get("length", 1))
    for name, value in eqn.params.items():
      branches = value if isinstance(value, tuple | list) else (value,)
      subs = [getattr(b, "jaxpr", b) for b in branches]
      subs = [s for s in subs if hasattr(s, "eqns")]
      if not subs:
        continue
      if name == "branches":
        options = [_found(s, inner_scale) for s in subs]
        out.extend(max(options, key=lambda found: sum(f[2] for f in found)))
      else:
        for s in subs:
          out.extend(_found(s, inner_scale))
  return out


def _collectives(jaxpr, totals: dict[str, list]) -> None:
  """Adds the operand bytes and message count of every collective in ``jaxpr``."""
  for kind, _, nbytes, times in _found(jaxpr):
    totals[kind][0] += nbytes
    totals[kind][1] += times


def _axes_param(eqn) -> tuple[str, ...]:
  """The mesh axes a collective equation runs over (``axes`` or ``axis_name``)."""
  value = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  return tuple(value) if isinstance(value, tuple | list) else (value,)


def _records(jaxpr, mesh) -> list:
  """A :class:`wire.Collective` for every collective in ``jaxpr`` (:func:`_found`)."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  out = []
  for kind, eqn, nbytes, _ in _found(jaxpr):
    named = set(_axes_param(eqn))
    axes = tuple(a for a in mesh.axis_names if a in named)
    group = 1
    for a in axes:
      group *= sizes[a]
    if kind == "collective-permute":
      group = 2
    out.append(wire.Collective(kind, nbytes, group, axes))
  return out


def traced_axis_wire(fn, *args, mesh) -> list:
  """:func:`gradcomp.axis_wire`'s records, from the traced program: no devices.

  ``fn`` is a ``shard_map``-ped function on ``mesh`` (a ``Mesh`` or an
  ``AbstractMesh`` of any size, e.g. 64 nodes x 8 devices); ``args`` are
  arrays or ``jax.ShapeDtypeStruct`` (placed on the mesh as its ``in_specs``
  say). Each collective is labelled with the axes it names and sized by
  their product. On a real mesh the compiled HLO's records
  (:func:`gradcomp.axis_wire`) carry the same operand bytes, short of what
  XLA adds or removes (a one-device group compiled away, a combined op).
  """
  return _records(jax.make_jaxpr(fn)(*args).jaxpr, mesh)


def traced_collectives(tx, tree, axis_name: str, workers: int):
  """``{kind: (bytes, messages)}`` one worker sends updating gradients ``tree``.

  ``tx`` exchanges over ``axis_name``; ``tree`` holds arrays or
  ``jax.ShapeDtypeStruct``. The update is traced (not compiled or run) under
  ``shard_map`` on an abstract mesh of ``workers``, so this needs no
  devices. Counting from the program catches indices, padding and second
  rounds; ``wire.wire_bytes`` reads the same from the compiled HLO.
  """
  mesh = AbstractMesh((workers,), (axis_name,))
  # Typed as sharded over the workers, as shard_map's in_specs say (JAX 0.11
  # checks the arguments' shardings against them, also when only tracing).
  sharded = NamedSharding(mesh, P(axis_name))

  def per_worker(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded)

  state = jax.eval_shape(lambda: add_worker_axis(tx.init(tree), workers))
  state = jax.tree.map(per_worker, state)
  grads = jax.tree.map(
    lambda x: per_worker(jax.ShapeDtypeStruct((workers, *x.shape), x.dtype)), tree
  )
  f = sharded_update(tx, mesh, axis_name)
  totals = {k: [0, 0] for k in KINDS}
  _collectives(jax.make_jaxpr(f)(grads, state).jaxpr, totals)
  return {k: (b, m) for k, (b, m) in totals.items() if m}


def traced_wire(
  tx_for_axis, size: int, workers: int = _TRACE_WORKERS
) -> dict[str, tuple[int, int]]:
  """:func:`traced_collectives` of one float32 buffer of ``size`` values.

  ``tx_for_axis(axis_name)`` builds the compressor exchanging over
  ``axis_name``; it is traced on ``workers`` workers. A gathered payload's
  bytes do not depend on them; a reduce-scatter form's chunks (and qgZ's)
  do, so price those on the run's worker count.
  """
  leaf = jax.ShapeDtypeStruct((size,), jnp.float32)
  return traced_collectives(tx_for_axis(_TRACE_AXIS), (leaf,), _TRACE_AXIS, workers)


def _taint(jaxpr, tainted: list[bool], found: list[tuple[str, bool]]) -> list[bool]:
  """Which outputs of ``jaxpr`` depend on its tainted inputs; records collectives.

  ``found`` gains ``(primitive name, whether an operand is tainted)`` for every
  collective, in nested jaxprs too. A ``lax.cond``'s branches see its operands
  (not the predicate); a loop's carry is iterated to a fixed point; any other
  primitive with a nested jaxpr of matching arity maps its inputs one to one,
  and otherwise is treated conservatively (any tainted input taints every
  output and every input of the nested jaxprs).
  """
  dirty = set()
  for var, t in zip(jaxpr.invars, tainted, strict=True):
    if t:
      dirty.add(var)
  is_dirty = lambda v: not hasattr(v, "val") and v in dirty
  for eqn in jaxpr.eqns:
    ins = [is_dirty(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _PRIMITIVE_KINDS:
      found.append((name, any(ins)))
    subs = {
      key: [
        getattr(b, "jaxpr", b) for b in (v if isinstance(v, tuple | list) else (v,))
      ]
      for key, v in eqn.params.items()
    }
    subs = {
      key: [s for s in group if hasattr(s, "eqns")] for key, group in subs.items()
    }
    subs = {key: group for key, group in subs.items() if group}
    if "branches" in subs:  # lax.cond: invars = (index, *operands)
      outs = [False] * len(eqn.outvars)
      for branch in subs["branches"]:
        res = _taint(branch, ins[1:], found)
        outs = [a or b for a, b in zip(outs, res, strict=True)]
      outs = [o or ins[0] for o in outs]
    elif name == "scan":
      body = subs["jaxpr"][0]
      n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
      carry = ins[n_consts : n_consts + n_carry]
      while True:
        trial: list[tuple[str, bool]] = []
        res = _taint(body, ins[:n_consts] + carry + ins[n_consts + n_carry :], trial)
        new = [a or b for a, b in zip(carry, res[:n_carry], strict=True)]
        if new == carry:
          found.extend(trial)
          break
        carry = new
      outs = carry + res[n_carry:]
    elif name == "while":
      cond, body = subs["cond_jaxpr"][0], subs["body_jaxpr"][0]
      nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      carry = ins[nc + nb :]
      while True:
        trial = []
        _taint(cond, ins[:nc] + carry, trial)
        res = _taint(body, ins[nc : nc + nb] + carry, trial)
        new = [a or b for a, b in zip(carry, res, strict=True)]
        if new == carry:
          found.extend(trial)
          break
        carry = new
      outs = carry
    else:
      outs = [any(ins)] * len(eqn.outvars)
      for group in subs.values():
        for sub in group:
          if len(sub.invars) == len(ins):
            res = _taint(sub, ins, found)
            if len(res) == len(eqn.outvars):
              outs = res
          else:
            _taint(sub, [any(ins)] * len(sub.invars), found)
    for var, t in zip(eqn.outvars, outs, strict=True):
      if t:
        dirty.add(var)
  return [is_dirty(v) for v in jaxpr.outvars]


def collectives_depending_on(fn, args: tuple, argnums) -> list[tuple[str, bool]]:
  """Every collective of ``fn(*args)``'s program and whether it depends on ``argnums``.

  Walks the jaxpr (into ``shard_map``, ``jit``, ``cond`` branches and loops),
  tainting every value computed from the leaves of ``args[i]`` for ``i`` in
  ``argnums``. A collective none of whose operands is tainted can run before
  those inputs exist: CD-SGD's exchange of the last step's message (paper 001
  §3.1) may overlap the backward pass that produces this step's
  gradient.

  Returns:
    ``[(primitive name, depends)]`` in program order (each collective of a
    ``cond`` branch once per branch).
  """
  argnums = {argnums} if isinstance(argnums, int) else set(argnums)
  closed = jax.make_jaxpr(fn)(*args)
  tainted = []
  for i, arg in enumerate(args):
    tainted += [i in argnums] * len(jax.tree.leaves(arg))
  found: list[tuple[str, bool]] = []
  _taint(closed.jaxpr, tainted, found)
  return found
