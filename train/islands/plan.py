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

Instead of ``round=R`` a fault may say ``after=S``: it strikes in the first
round that starts ``S`` seconds or more after the run's first round (the
benchmark spaces kills in time, so that Ray has brought each island back
before the next). A fault strikes in the first round at or after its
``round`` (or time) in which its island works, and fires once: a restarted
island is not killed again by the same entry. Pure Python, no Ray:
:func:`parse` is unit-tested alone.
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
    round: the round it strikes, >= 0 (-1 for a fault given by ``after``).
    seconds: a ``delay``'s sleep, > 0 (0.0 for the other kinds).
    forge: a ``forge``'s breakage, one of :data:`FORGE_KINDS` (``""``
      for the other kinds).
  """

  kind: str
  island: int
  round: int
  seconds: float = 0.0
  forge: str = ""
  after: float | None = None

  def due(self, round_: int, elapsed: float) -> bool:
    """Whether it strikes in ``round_``, started ``elapsed`` s after the first round."""
    if self.after is not None:
      return elapsed >= self.after
    return round_ >= self.round

  def describe(self) -> dict:
    """The fault as a JSON-able dict (for ``islands.jsonl``)."""
    out = {"kind": self.kind}
    if self.kind == "delay":
      out["seconds"] = self.seconds
    if self.kind == "forge":
      out["forge"] = self.forge
    if self.after is not None:
      out["after"] = self.after
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
    if key not in _KEYS[kind] and not (key == "after" and kind != "corrupt"):
      raise ValueError(
        f"islands.inject: {kind} takes {', '.join(_KEYS[kind])}, got {key!r} in "
        f"{entry!r}"
      )
    if key in fields:
      raise ValueError(f"islands.inject: {key} given twice in {entry!r}")
    fields[key] = value.strip()
  after = None
  if "after" in fields:
    if "round" in fields:
      raise ValueError(f"islands.inject: {entry!r} gives both round and after")
    try:
      after = float(fields["after"])
    except ValueError:
      after = float("nan")
    if not 0 <= after < float("inf"):
      raise ValueError(
        f"islands.inject: after={fields['after']!r} in {entry!r} must be a finite "
        "number of seconds >= 0"
      )
    fields["round"] = "-1"
  missing = [k for k in _KEYS[kind] if k not in fields]
  if missing:
    raise ValueError(f"islands.inject: {entry!r} lacks {', '.join(missing)}")
  island = _int(entry, "island", fields["island"])
  round_ = -1 if after is not None else _int(entry, "round", fields["round"])
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
  return Fault(kind, island, round_, seconds, forge, after)


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
    >>> parse("kill:island=1,round=3;delay:island=2,round=5,seconds=4")  # doctest: +NORMALIZE_WHITESPACE
    (Fault(kind='kill', island=1, round=3, seconds=0.0, forge='', after=None),
     Fault(kind='delay', island=2, round=5, seconds=4.0, forge='', after=None))
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
    if f.after is None and (f.island, f.round) in seen:
      raise ValueError(
        f"islands.inject: two faults on island {f.island} in round {f.round}"
      )
    seen.add((f.island, f.round))
  return faults


def at_round(faults: Iterable[Fault], round_: int) -> Mapping[int, Fault]:
  """``{island: fault}`` of the faults planned for round ``round_``."""
  return {f.island: f for f in faults if f.round == round_}


def spread_kills(count: int, islands: int, first: float, every: float) -> str:
  """A plan of ``count`` kills, one every ``every`` seconds from ``first``, round robin.

  Island ``k mod islands`` dies in the first round that starts ``first + k *
  every`` seconds after the first round (the benchmark's many-failure run).

  Raises:
    ValueError: ``count < 0``, ``islands < 1``, ``first < 0`` or ``every <= 0``.
  """
  if count < 0 or islands < 1 or first < 0 or not every > 0:
    raise ValueError(
      f"need count >= 0, islands >= 1, first >= 0 and every > 0; got count={count}, "
      f"islands={islands}, first={first}, every={every}"
    )
  return ";".join(
    f"kill:island={k % islands},after={first + k * every:g}" for k in range(count)
  )
