"""The outer payload one island hands in per round, and its validation (DESIGN §12).

A :class:`Payload` carries the compressor's wire arrays (top-k's values and
int32 indices, QSGD's codes and norms, ...: what ``wire.Outbox`` captured,
never the decoded floats) labelled with the run, the round and the sender.
A receiver applies it only if :func:`check` finds nothing wrong; a
rejection names the reason, and every receiver reaches the same verdict
(the check is a pure function of the payload), so all islands apply the
same mean.
"""

from __future__ import annotations

import dataclasses

import numpy as np

Spec = tuple[tuple[tuple[int, ...], str], ...]


@dataclasses.dataclass(frozen=True)
class Payload:
  """One island's compressed pseudo-gradient for one round.

  Attributes:
    run: the run's id (a fresh one per launch).
    round: the outer round it belongs to.
    island: the sender.
    arrays: the wire arrays, in the order the compressor exchanged them.
  """

  run: str
  round: int
  island: int
  arrays: tuple[np.ndarray, ...]

  @property
  def nbytes(self) -> int:
    """Bytes on the wire: the arrays' sizes (the labels are a few dozen more)."""
    return int(sum(a.nbytes for a in self.arrays))


def spec_of(arrays) -> Spec:
  """``((shape, dtype name), ...)`` of wire arrays: what a valid payload matches."""
  return tuple((tuple(np.shape(a)), np.dtype(a.dtype).name) for a in arrays)


def check(payload, spec: Spec, run: str, round_: int) -> str | None:
  """Why ``payload`` must not be applied in ``round_`` of ``run``, or ``None``.

  Rejected: anything not a :class:`Payload`; another run's or round's; a
  different number of arrays than ``spec``; an array of another shape or
  dtype; a float array holding NaN or Inf.

  Examples:
    >>> import numpy as np
    >>> p = Payload("r1", 3, 0, (np.ones(2, np.float32), np.arange(2, dtype=np.int32)))
    >>> spec = spec_of(p.arrays)
    >>> check(p, spec, "r1", 3) is None
    True
    >>> check(p, spec, "r1", 4)
    'round 3, expected 4'
    >>> bad = Payload("r1", 3, 0, (np.array([1.0, np.nan], np.float32), p.arrays[1]))
    >>> check(bad, spec, "r1", 3)
    'array 0 is not finite'
  """
  if not isinstance(payload, Payload):
    return f"not a payload: {type(payload).__name__}"
  if payload.run != run:
    return f"run {payload.run!r}, expected {run!r}"
  if payload.round != round_:
    return f"round {payload.round}, expected {round_}"
  if len(payload.arrays) != len(spec):
    return f"{len(payload.arrays)} arrays, expected {len(spec)}"
  for i, (a, (shape, dtype)) in enumerate(zip(payload.arrays, spec, strict=True)):
    if not isinstance(a, np.ndarray):
      return f"array {i} is a {type(a).__name__}, not a numpy array"
    if a.shape != shape:
      return f"array {i} has shape {a.shape}, expected {shape}"
    if a.dtype.name != dtype:
      return f"array {i} has dtype {a.dtype.name}, expected {dtype}"
    if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
      return f"array {i} is not finite"
  return None


def forged(payload: Payload, kind: str) -> Payload:
  """``payload`` broken on the wire as a ``forge`` fault says (``plan.py``).

  ``nan``: NaN in the first float array; ``shape``: the first array one
  element short; ``dtype``: the first array as float64; ``round``: labelled
  with the previous round; ``run``: labelled with another run.
  """
  arrays = list(payload.arrays)
  if kind == "nan":
    i = next(i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.inexact))
    a = arrays[i].copy()
    a.reshape(-1)[0] = np.nan
    arrays[i] = a
  elif kind == "shape":
    arrays[0] = arrays[0].reshape(-1)[:-1]
  elif kind == "dtype":
    arrays[0] = arrays[0].astype(np.float64)
  elif kind == "round":
    return dataclasses.replace(payload, round=payload.round - 1)
  elif kind == "run":
    return dataclasses.replace(payload, run=payload.run + "-forged")
  else:
    raise ValueError(f"unknown forge kind {kind!r}")
  return dataclasses.replace(payload, arrays=tuple(arrays))
