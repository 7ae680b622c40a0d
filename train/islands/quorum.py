"""When a round closes: the quorum and its grace window (DESIGN §12).

Round r closes when at least ``min_quorum`` payloads are in and
``grace_seconds`` have passed since the first arrived, or, once
``min_quorum`` are in, as soon as every island working on the round has
handed in (waiting longer cannot add a payload). Below ``min_quorum`` it
stays open (islands Ray brings back join it) until the round's timeout. A payload that arrives after its round closed is never applied
(the coordinator keeps its island out of that round; its mass is kept in
the island's carry, ``replica.py``). Pure Python, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping


@dataclasses.dataclass(frozen=True)
class Quorum:
  """The closing rule of a round.

  Attributes:
    min_quorum: payloads a round needs, >= 1.
    grace_seconds: how long after the first payload the round stays open
      for more, >= 0.
  """

  min_quorum: int
  grace_seconds: float

  def __post_init__(self):
    if self.min_quorum < 1:
      raise ValueError(f"min_quorum must be >= 1, got {self.min_quorum}")
    if not self.grace_seconds >= 0:
      raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")

  def closed(
    self, arrivals: Mapping[int, float], now: float, expected: Collection[int]
  ) -> bool:
    """Whether the round closes at time ``now``.

    Args:
      arrivals: ``{island: arrival time}`` of the payloads in so far.
      now: the current time (same clock as ``arrivals``).
      expected: the islands working on this round.
    """
    if len(arrivals) < self.min_quorum:
      return False
    if set(expected) <= set(arrivals):
      return True
    return now >= min(arrivals.values()) + self.grace_seconds

  def wait_seconds(
    self, arrivals: Mapping[int, float], now: float, round_start: float, timeout: float
  ) -> float:
    """How long to wait for the next arrival before looking again (>= 0).

    Until the first payload: until the round's timeout; after it, until the
    grace window ends (or the timeout, if that comes first).
    """
    end = round_start + timeout
    if arrivals:
      end = min(end, max(min(arrivals.values()) + self.grace_seconds, now))
    return max(0.0, end - now)
