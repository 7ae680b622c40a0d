"""Bytes on the wire, read from the compiled program.

The optimized HLO of a ``shard_map``/``pmap`` step is the per-device program, so
the operand bytes of its collectives are what each device sends: for an
all-reduce its buffer, for an all-gather its own piece, and so on. Counting from
the compiled program, not from the algorithm's description, catches padding,
indices, dtype promotions and anything XLA adds.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "collective-permute",
  "all-to-all",
)

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 1,
  "u4": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")


def shape_bytes(text: str) -> int:
  """Bytes of every array type (``f32[8,128]``) in an HLO shape string."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * int(
        np.prod([int(d) for d in dims.split(",") if d])
      )
  return total


def _operands(args: str) -> list[str]:
  depth, current, out = 0, [], []
  for ch in args:
    if ch == "(":
      depth += 1
    elif ch == ")":
      if depth == 0:
        break
      depth -= 1
    if ch == "," and depth == 0:
      out.append("".join(current))
      current = []
    else:
      current.append(ch)
  out.append("".join(current))
  return [o.strip() for o in out if o.strip()]


def _found(hlo_text: str) -> list[tuple[str, int, str]]:
  """``(kind, operand bytes, the rest of the line)`` of each collective, in order.

  Async pairs count once, at their ``-start``.
  """
  shapes: dict[str, str] = {}
  found: list[tuple[str, list[str], str]] = []
  for line in hlo_text.splitlines():
    m = _DEF.match(line)
    if not m:
      continue
    name, shape, opcode, args = m.groups()
    shapes[name] = shape
    kind = opcode.removesuffix("-start")
    if kind in COLLECTIVES and not opcode.endswith("-done"):
      found.append((kind, _operands(args), args))
  out = []
  for kind, operands, args in found:
    nbytes = 0
    for operand in operands:
      # Operands are printed either typed ("f32[4]{0} %x") or by name ("%x").
      typed = shape_bytes(operand.split("%")[0])
      name = "%" + operand.split("%")[-1] if "%" in operand else None
      nbytes += typed or shape_bytes(shapes.get(name, ""))
    out.append((kind, nbytes, args))
  return out


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Operand bytes per collective kind in an HLO module's text.

  Async pairs count once, at their ``-start``.
  """
  totals = dict.fromkeys(COLLECTIVES, 0)
  for kind, nbytes, _ in _found(hlo_text):
    totals[kind] += nbytes
  return totals


# -- Per mesh axis ----------------------------------------------------------------

_GROUPS = re.compile(r"replica_groups=(\{\{[0-9,{}\s]*\}\}|\{\})")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{([0-9,{}\s]*)\}")


def link_factor(kind: str, group: int) -> float:
  """Bytes over links per operand byte, for the algorithm the cost model assumes.

  Ring collectives (``gradcomp.sim.Cluster``): an all-reduce sends
  ``2 (g - 1) / g`` of its buffer, a reduce-scatter or all-to-all ``(g - 1)
  / g``, an all-gather its piece to ``g - 1`` peers; a collective-permute
  sends its operand once. 0 for a group of one.
  """
  if group <= 1:
    return 0.0
  return {
    "all-reduce": 2 * (group - 1) / group,
    "reduce-scatter": (group - 1) / group,
    "all-to-all": (group - 1) / group,
    "all-gather": float(group - 1),
    "collective-permute": 1.0,
  }[kind]


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled per-device program.

  Attributes:
    kind: one of :data:`COLLECTIVES`.
    operand_bytes: what this device hands the collective.
    group: devices in each of its replica groups (2 for a permute's pairs).
    axes: the mesh axes its groups span (every group the devices that differ
      only along them), in mesh order; ``None`` without a mesh or when the
      groups are no such set.
  """

  kind: str
  operand_bytes: int
  group: int
  axes: tuple[str, ...] | None

  @property
  def link_bytes(self) -> float:
    """Bytes this device puts on links: ``operand_bytes * link_factor``."""
    return self.operand_bytes * link_factor(self.kind, self.group)


def _groups(args: str) -> list[list[int]] | None:
  """The replica groups of a collective's attributes (explicit or iota form)."""
  m = _IOTA.search(args)
  if m:
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  m = _GROUPS.search(args)
  if m:
    inner = re.findall(r"\{([0-9,\s]*)\}", m.group(1)[1:-1])
    return [[int(v) for v in g.split(",") if v.strip()] for g in inner]
  m = _PAIRS.search(args)
  if m:
    return [
      [int(v) for v in g.split(",")] for g in re.findall(r"\{([0-9,\s]+)\}", m.group(1))
    ]
  return None


def _axes_of(groups, mesh) -> tuple[str, ...] | None:
  """The mesh axes whose devices form exactly these groups, or ``None``.

  Group members are positions in the mesh's devices, row-major (the
  partition ids of a ``shard_map`` program). A collective-permute's pairs
  name the axes its pairs differ along.
  """
  if mesh is None or not groups:
    return None
  shape = tuple(mesh.devices.shape)
  size = int(np.prod(shape))
  varying: set[int] = set()
  for group in groups:
    if any(not 0 <= p < size for p in group):
      return None
    coords = np.array(np.unravel_index(group, shape)).T
    varying |= {a for a in range(len(shape)) if len(set(coords[:, a])) > 1}
  axes = tuple(sorted(varying))
  full = int(np.prod([shape[a] for a in axes]))
  if any(len(set(g)) not in (full, 2) for g in groups):
    return None
  names = tuple(mesh.axis_names)
  return tuple(names[a] for a in axes)


def collectives(hlo_text: str, mesh=None) -> list[Collective]:
  """Every collective of an HLO module's text, with its group and mesh axes.

  Args:
    hlo_text: the optimized HLO of a ``shard_map`` (or ``pmap``) program.
    mesh: the ``jax.sharding.Mesh`` it runs on, to label each collective
      with the axes of its replica groups; ``None``: unlabelled.

  Returns:
    :class:`Collective` records in program order. Their ``operand_bytes``
    summed per kind equal :func:`collective_bytes`.
  """
  out = []
  for kind, nbytes, args in _found(hlo_text):
    groups = _groups(args)
    group = len(groups[0]) if groups else 1
    if kind == "collective-permute":
      group = 2
    out.append(Collective(kind, nbytes, group, _axes_of(groups, mesh)))
  return out


def bytes_by_axes(records) -> dict[tuple[str, ...] | None, dict[str, float]]:
  """``{axes: {"operand": bytes, "link": bytes}}`` summed over ``records``.

  Fast-axis and slow-axis traffic of a step as separate figures: e.g.
  ``{("local",): ..., ("node",): ...}`` for a hierarchical exchange.
  """
  totals: dict = {}
  for r in records:
    entry = totals.setdefault(r.axes, {"operand": 0, "link": 0.0})
    entry["operand"] += r.operand_bytes
    entry["link"] += r.link_bytes
  return totals


def axis_wire(fn, *args, mesh, **kwargs) -> list[Collective]:
  """The :func:`collectives` of ``fn``'s compiled program on ``mesh``.

  As :func:`wire_bytes`, but each collective kept apart with its operand
  bytes, its link bytes and the mesh axes of its replica groups.

  Examples:
    A sum over the 4 devices of a node: 16 floats, ``2 (4 - 1) / 4`` of
    them over links.

    >>> import jax, jax.numpy as jnp, gradcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
    >>> spec = P(("node", "local"))
    >>> f = jax.shard_map(
    ...   lambda x: jax.lax.psum(x, "local"), mesh=mesh, in_specs=spec, out_specs=spec
    ... )
    >>> x = jax.ShapeDtypeStruct((128,), jnp.float32, sharding=NamedSharding(mesh, spec))
    >>> [(c.kind, c.operand_bytes, c.link_bytes, c.axes)
    ...  for c in gradcomp.axis_wire(f, x, mesh=mesh)]
    [('all-reduce', 64, 96.0, ('local',))]
  """
  lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = lowerable.lower(*args, **kwargs).compile().as_text()
  return collectives(text, mesh)


def wire_bytes(fn, *args, **kwargs) -> int:
  """Bytes each device sends in the collectives of ``fn``'s compiled program.

  Args:
    fn: a function (jitted or not) whose collectives run under ``shard_map`` or
      ``pmap``; ``pmap``-ed functions are lowered as they are.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: keyword arguments for ``fn``.

  Returns:
    The sum of operand bytes of all-reduce, all-gather, reduce-scatter,
    collective-permute and all-to-all in the optimized HLO.

  Examples:
    >>> import jax, jax.numpy as jnp, gradcomp
    >>> gradcomp.wire_bytes(lambda x: x * 2, jnp.ones(4))
    0
  """
  lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = lowerable.lower(*args, **kwargs).compile().as_text()
  return sum(collective_bytes(text).values())
