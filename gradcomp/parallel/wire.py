"""Bytes on the wire, read from the compiled program (DESIGN §4).

The optimized HLO of a ``shard_map``/``pmap`` step is the per-device program, so
the operand bytes of its collectives are what each device sends: for an
all-reduce its buffer, for an all-gather its own piece, and so on. Counting from
the compiled program, not from the algorithm's description, catches padding,
indices, dtype promotions and anything XLA adds.
"""

from __future__ import annotations

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


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Operand bytes per collective kind in an HLO module's text.

  Async pairs count once, at their ``-start``.
  """
  shapes: dict[str, str] = {}
  found: list[tuple[str, list[str]]] = []
  for line in hlo_text.splitlines():
    m = _DEF.match(line)
    if not m:
      continue
    name, shape, opcode, args = m.groups()
    shapes[name] = shape
    kind = opcode.removesuffix("-start")
    if kind in COLLECTIVES and not opcode.endswith("-done"):
      found.append((kind, _operands(args)))
  totals = dict.fromkeys(COLLECTIVES, 0)
  for kind, operands in found:
    for operand in operands:
      # Operands are printed either typed ("f32[4]{0} %x") or by name ("%x").
      typed = shape_bytes(operand.split("%")[0])
      name = "%" + operand.split("%")[-1] if "%" in operand else None
      totals[kind] += typed or shape_bytes(shapes.get(name, ""))
  return totals


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
