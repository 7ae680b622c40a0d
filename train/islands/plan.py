"""The failure plan of ``config.islands.inject``: what to break, where and when.

DESIGN §12. A plan is a ``;``-separated list of faults, each ``kind:key=value,...``::

  kill:island=1,round=3;delay:island=2,round=5,seconds=4;forge:island=0,round=6,kind=nan

Kinds:

- ``kill``: the island SIGKILLs its own process at the start of that round's
  work (``os.kill(os.getpid(), SIGKILL)``); Ray restarts the actor.
- ``delay``: the island sleeps ``seconds`` after its inner steps, before it
  hands in its payload (a straggler).
- ``drop``: the island computes its payload and never hands it in.
- ``forge``: the island hands in a payload broken on the wire; ``kind`` is
  ``nan`` (a NaN in its first float array), ``shape`` (its first array cut
  by one element), ``dtype`` (its first array cast to float64), ``round``
  (labelled with the previous round) or ``run`` (labelled with another
  run's id).
- ``corrupt``: the island adds ``1e-3`` to one of its global params after
  applying that round (a silent divergence the hash check must catch).

Each fault fires once: a restarted island is not killed again by the same
entry. Pure Python, no Ray: :func:`parse` is unit-tested alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

KINDS = ("kill", "delay", "drop", "forge", "corrupt")
FORGE_KINDS = ("nan", "shape", "dtype", "round", "run")
_KEYS = {
  "kill": ("island", "round"),
  "delay": ("island", "round", "seconds"),
  "drop": ("island", "round"),
  "forge": ("island", "round", "kind"),
  "corrupt": ("island", "round"),
}


@dataclasses.dataclass(frozen=True)
class Fault:
  """One injected failure.

  Attributes:
    kind: one of :data:`KINDS`.
    island: the island it strikes, >= 0.
    round: the round it strikes, >= 0.
    seconds: a ``delay``'s sleep, > 0 (0.0 for the other kinds).
    forge: a ``forge``'s breakage, one of :data:`FORGE_KINDS` (``""``
      for the other kinds).
  """

  kind: str
  island: int
  round: int
  seconds: float = 0.0
  forge: str = ""

  def describe(self) -> dict:
    """The fault as a JSON-able dict (for ``islands.jsonl``)."""
    out = {"kind": self.kind}
    if self.kind == "delay":
      out["seconds"] = self.seconds
    if self.kind == "forge":
      out["forge"] = self.forge
    return out


def _int(entry: str, key: str, value: str) -> int:
  try:
    number = int(value)
  except ValueError:
    raise ValueError(
      f"islands.inject: {key}={value!r} in {entry!r} must be an integer >= 0"
    ) from None
  if number < 0:
    raise ValueError(f"islands.inject: {key}={number} in {entry!r} must be >= 0")
  return number


def _fault(entry: str) -> Fault:
  kind, sep, rest = entry.partition(":")
  kind = kind.strip()
  if not sep or kind not in KINDS:
    raise ValueError(
      f"islands.inject: {entry!r} must start with a kind and a colon, one of "
      f"{', '.join(KINDS)} (e.g. 'kill:island=1,round=3')"
    )
  fields: dict[str, str] = {}
  for item in filter(None, (s.strip() for s in rest.split(","))):
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq:
      raise ValueError(f"islands.inject: {item!r} in {entry!r} must be key=value")
    if key not in _KEYS[kind]:
      raise ValueError(
        f"islands.inject: {kind} takes {', '.join(_KEYS[kind])}, got {key!r} in "
        f"{entry!r}"
      )
    if key in fields:
      raise ValueError(f"islands.inject: {key} given twice in {entry!r}")
    fields[key] = value.strip()
  missing = [k for k in _KEYS[kind] if k not in fields]
  if missing:
    raise ValueError(f"islands.inject: {entry!r} lacks {', '.join(missing)}")
  island = _int(entry, "island", fields["island"])
  round_ = _int(entry, "round", fields["round"])
  seconds, forge = 0.0, ""
  if kind == "delay":
    try:
      seconds = float(fields["seconds"])
    except ValueError:
      seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
      raise ValueError(
        f"islands.inject: seconds={fields['seconds']!r} in {entry!r} must be a "
        "finite number > 0"
      )
  if kind == "forge":
    forge = fields["kind"]
    if forge not in FORGE_KINDS:
      raise ValueError(
        f"islands.inject: kind={forge!r} in {entry!r} must be one of "
        f"{', '.join(FORGE_KINDS)}"
      )
  return Fault(kind, island, round_, seconds, forge)


def parse(text: str | None, islands: int | None = None) -> tuple[Fault, ...]:
  """The faults of a plan, in the order written.

  Args:
    text: the plan (``None`` or ``""``: no faults).
    islands: the number of islands, to check each fault's ``island`` against
      (``None``: unchecked).

  Returns:
    A tuple of :class:`Fault`.

  Raises:
    ValueError: an unknown kind or key, a missing or repeated key, a value
      out of range, an island outside ``[0, islands)``, or two faults on one
      island in one round.

  Examples:
    >>> parse("kill:island=1,round=3;delay:island=2,round=5,seconds=4")
    (Fault(kind='kill', island=1, round=3, seconds=0.0, forge=''), Fault(kind='delay', island=2, round=5, seconds=4.0, forge=''))
  """
  if not text:
    return ()
  faults = tuple(_fault(e.strip()) for e in text.split(";") if e.strip())
  seen = set()
  for f in faults:
    if islands is not None and not f.island < islands:
      raise ValueError(
        f"islands.inject: island={f.island} in a {f.kind} fault must be in "
        f"[0, {islands}) (islands.count)"
      )
    if (f.island, f.round) in seen:
      raise ValueError(
        f"islands.inject: two faults on island {f.island} in round {f.round}"
      )
    seen.add((f.island, f.round))
  return faults


def at_round(faults: Iterable[Fault], round_: int) -> Mapping[int, Fault]:
  """``{island: fault}`` of the faults that strike in ``round_``."""
  return {f.island: f for f in faults if f.round == round_}


def spread_kills(count: int, islands: int, first: int, every: int) -> str:
  """A plan of ``count`` kills, one every ``every`` rounds from ``first``, round robin.

  Island ``k mod islands`` dies in round ``first + k * every`` (the benchmark's
  many-failure run).

  Raises:
    ValueError: ``count < 0``, ``islands < 1``, ``first < 0`` or ``every < 1``.
  """
  for name, value, low in (
    ("count", count, 0),
    ("islands", islands, 1),
    ("first", first, 0),
    ("every", every, 1),
  ):
    if value < low:
      raise ValueError(f"{name} must be >= {low}, got {value}")
  return ";".join(
    f"kill:island={k % islands},round={first + k * every}" for k in range(count)
  )
