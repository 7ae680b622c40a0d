"""The round coordinator: quorum, grace window, joins, hash checks (DESIGN §12).

It runs in the launching process (as torchft's lighthouse does) and never
reads a payload: it starts islands' rounds, watches which payloads are in
(``ray.wait`` on their small ``info`` objects), closes each round by the
rule of ``quorum.py`` and hands every synced island the object references
of the quorum's payloads, which the islands fetch from Ray's object store
and check themselves. Each round's hashes must agree.

Island states: *synced* (has applied every closed round, idle), *behind*
(its work for an earlier round is still running: a straggler), *joining*
(restarted by Ray, copying a live peer's state) and *dead* (its process
died; Ray is restarting it). A straggler or a joiner catches up by applying
the rounds it missed, in order, from the payload references the coordinator
kept (the same payloads, so the same bits), then its hash is checked
against the agreed one.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from train.islands import quorum as quorum_lib
from train.islands import records

#: Joins tried on an island Ray does not bring back before it counts as gone.
MAX_JOIN_ATTEMPTS = 1000


class IslandsMismatchError(RuntimeError):
  """Islands that applied the same round hold different global states."""


class QuorumError(RuntimeError):
  """A round could not gather ``islands.min_quorum`` payloads."""


def _actor_error():
  import ray

  return (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Coordinator:
  """Runs the rounds of one islands run.

  Args:
    handles: ``{island: actor handle}``, every island started and warmed up
      at ``start_round``.
    settings: ``train.islands.settings.Settings``.
    start_round: the first round to run (rounds applied so far).
    start_hash: the islands' agreed hash at ``start_round``.
    events: the run's :class:`records.EventLog`.
    on_round: ``on_round(round, summary)`` after each round (metrics).
    checkpoint: ``checkpoint(round, applier handles)`` where one is due, or
      ``None``.
  """

  def __init__(
    self,
    handles: dict[int, Any],
    settings,
    start_round: int,
    start_hash: str,
    events: records.EventLog,
    on_round=None,
    checkpoint=None,
  ):
    self.handles = dict(handles)
    self.s = settings
    self.quorum = quorum_lib.Quorum(settings.min_quorum, settings.grace_seconds)
    self.round = start_round
    self.hashes = {start_round - 1: start_hash}
    self.history: dict[int, list] = {}  # round -> the quorum's payload refs
    self.status = dict.fromkeys(handles, "synced")
    self.behind: dict[int, tuple[int, Any]] = {}  # island -> (round, info ref)
    self.joining: dict[int, tuple[int, int, Any]] = {}  # island -> (round, peer, ref)
    self.faults = list(settings.inject)
    self.events = events
    self.on_round = on_round
    self.checkpoint = checkpoint
    self.failures = 0
    self.first_round_time = None
    self.join_attempts: dict[int, int] = {}
    self.probes: dict[int, Any] = {}  # dead island -> a pending ping

  # -- helpers ------------------------------------------------------------------

  def _leave(self, island: int, round_: int, why: str) -> None:
    if self.status.get(island) != "dead":
      self.events.write(round_, "leave", island, reason=why)
      self.failures += 1
    self.status[island] = "dead"
    self.behind.pop(island, None)
    self.joining.pop(island, None)

  def _fault(self, island: int, round_: int):
    """The first unfired fault of ``island`` due in ``round_`` (``Fault.due``)."""
    elapsed = time.time() - self.first_round_time
    for f in self.faults:
      if f.island == island and f.kind != "corrupt" and f.due(round_, elapsed):
        self.faults.remove(f)
        self.events.write(
          round_, "fault", island, planned_round=f.round, **f.describe()
        )
        return f
    return None

  def _corrupt(self, island: int, round_: int):
    for f in self.faults:
      if f.island == island and f.round == round_ and f.kind == "corrupt":
        self.faults.remove(f)
        self.events.write(
          round_, "fault", island, planned_round=f.round, **f.describe()
        )
        return dict(f.describe())
    return None

  def _check(self, round_: int, results: dict[int, dict]) -> str:
    """The agreed hash of ``round_``, or :class:`IslandsMismatchError`."""
    hashes = {i: r["hash"] for i, r in results.items()}
    if round_ in self.hashes:
      hashes = {**{"agreed": self.hashes[round_]}, **hashes}
    if len(set(hashes.values())) > 1:
      self.events.write(
        round_, "mismatch", None, hashes={str(k): v for k, v in hashes.items()}
      )
      raise IslandsMismatchError(
        f"round {round_}: islands hold different global states after applying it "
        f"(hash by island: "
        + ", ".join(f"{k}: {v[:12]}" for k, v in hashes.items())
        + "); the run stops"
      )
    return next(iter(hashes.values()))

  def _catch_up(self, island: int, first: int, via: str, **fields) -> bool:
    """Applies rounds ``first .. self.round - 1`` on ``island``; True when synced."""
    import ray

    h = self.handles[island]
    refs = [h.apply.remote(r, self.history[r]) for r in range(first, self.round)]
    try:
      results = ray.get(refs)
    except _actor_error():
      self._leave(island, self.round, "died while catching up")
      return False
    if results:
      self._check(self.round - 1, {island: results[-1]})
    else:
      _, got = ray.get(h.hash.remote())
      self._check(self.round - 1, {island: {"hash": got}})
    self.status[island] = "synced"
    self.events.write(
      self.round,
      "join",
      island,
      via=via,
      replayed=list(range(first, self.round)),
      hash=self.hashes[self.round - 1],
      **fields,
    )
    return True

  def _sweep(self) -> list[int]:
    """Stragglers whose late work is done, joiners whose copy is done: catch up.

    Returns the islands it synced (to the last closed round).
    """
    import ray

    synced = []
    for island, (r, info) in list(self.behind.items()):
      ready, _ = ray.wait([info], timeout=0)
      if not ready:
        continue
      del self.behind[island]
      try:
        ray.get(info)
      except _actor_error():
        self._leave(island, self.round, "died while late")
        continue
      self.events.write(
        r, "reject", island, reason=f"late: round {r} closed before it arrived"
      )
      if self._catch_up(island, r, "replay"):
        synced.append(island)
    for island, (r, peer, ref) in list(self.joining.items()):
      ready, _ = ray.wait([ref], timeout=0)
      if not ready:
        continue
      del self.joining[island]
      try:
        ray.get(ref)
      except _actor_error():
        # Still restarting (or died again): try again next round.
        self.status[island] = "dead"
        self.join_attempts[island] = self.join_attempts.get(island, 0) + 1
        if self.join_attempts[island] > MAX_JOIN_ATTEMPTS:
          self.status[island] = "gone"
          self.events.write(self.round, "leave", island, reason="never came back")
        continue
      self.join_attempts.pop(island, None)
      if self._catch_up(island, r, "peer", peer=peer, copied_round=r):
        synced.append(island)
    return synced

  def _start_joins(self) -> None:
    """Each dead island Ray has brought back copies a synced peer's state.

    A dead island is probed with a cheap call first (it fails while Ray
    restarts the process); once it answers, it is sent the peer's snapshot.
    """
    import ray

    # A working peer's global state is that of the last closed round too: its
    # snapshot is taken after its work, before it applies the round.
    synced = sorted(i for i, s in self.status.items() if s in ("synced", "working"))
    back = []
    for island in [i for i, s in self.status.items() if s == "dead"]:
      probe = self.probes.get(island)
      if probe is None:
        self.probes[island] = self.handles[island].pid.remote()
        continue
      ready, _ = ray.wait([probe], timeout=0)
      if not ready:
        continue
      del self.probes[island]
      try:
        ray.get(probe)
      except _actor_error():
        self.join_attempts[island] = self.join_attempts.get(island, 0) + 1
        if self.join_attempts[island] > MAX_JOIN_ATTEMPTS:
          self.status[island] = "gone"
          self.events.write(self.round, "leave", island, reason="never came back")
        continue
      back.append(island)
    if not back or not synced:
      return
    peer = synced[0]
    snap = self.handles[peer].snapshot.remote()
    for island in back:
      ref = self.handles[island].join.remote(snap, self.hashes[self.round - 1])
      self.joining[island] = (self.round, peer, ref)
      self.status[island] = "joining"

  def _prune(self) -> None:
    keep = min(
      [r for r, _ in self.behind.values()]
      + [r for r, _, _ in self.joining.values()]
      + [self.round]
    )
    for r in [r for r in self.history if r < keep]:
      del self.history[r]
    for r in [r for r in self.hashes if r < keep - 1]:
      del self.hashes[r]

  # -- a round ------------------------------------------------------------------

  def run_round(self) -> dict:
    """Runs round ``self.round``; returns its summary."""
    import ray

    r, start = self.round, time.time()
    if self.first_round_time is None:
      self.first_round_time = start
    self._sweep()
    self._start_joins()
    payloads, infos, pending, expected = {}, {}, {}, set()

    def start_work(i: int) -> None:
      fault = self._fault(i, r)
      p, info = (
        self.handles[i]
        .work.options(num_returns=2)
        .remote(r, None if fault is None else dict(vars(fault)))
      )
      payloads[i], infos[i], pending[info] = p, info, i
      expected.add(i)
      self.status[i] = "working"

    for i in sorted(i for i, s in self.status.items() if s == "synced"):
      start_work(i)
    arrivals, losses, nbytes, idle = {}, {}, {}, []
    while True:
      now = time.time()
      if self.quorum.closed(arrivals, now, expected):
        break
      if now - start > self.s.round_timeout_seconds:
        raise QuorumError(
          f"round {r}: {len(arrivals)} payloads in after {now - start:.1f} s, "
          f"islands.min_quorum={self.s.min_quorum}; live islands: "
          f"{sorted(i for i, s in self.status.items() if s not in ('dead', 'gone'))}"
        )
      wait = self.quorum.wait_seconds(
        arrivals, now, start, self.s.round_timeout_seconds
      )
      if len(arrivals) + len(pending) < self.s.min_quorum:
        # Short of a quorum: islands Ray brings back join this round.
        self._start_joins()
        wait = min(wait, 0.1)
      # Stragglers and joiners are watched too: one that is done meanwhile
      # catches up to round r - 1 and works on round r.
      others = [ref for _, ref in self.behind.values()]
      others += [ref for _, _, ref in self.joining.values()]
      if not pending and not others:
        time.sleep(wait)
        continue
      ready, _ = ray.wait(list(pending) + others, num_returns=1, timeout=wait)
      if any(ref not in pending for ref in ready):
        for i in self._sweep():
          start_work(i)
      for ref in ready:
        if ref not in pending:
          continue
        i = pending.pop(ref)
        try:
          info = ray.get(ref)
        except _actor_error():
          self._leave(i, r, "died during its round")
          expected.discard(i)
          continue
        if info["dropped"]:
          self.events.write(r, "reject", i, reason="dropped: never handed in")
          expected.discard(i)
          idle.append(i)
          continue
        arrivals[i] = time.time()
        losses[i], nbytes[i] = info["loss"], info["nbytes"]
    quorum = sorted(arrivals)
    for ref, i in pending.items():  # past the grace window
      self.behind[i] = (r, ref)
      self.status[i] = "behind"
    refs = [payloads[i] for i in quorum]
    appliers = sorted(quorum + idle)
    applies = {
      i: self.handles[i].apply.remote(r, refs, self._corrupt(i, r)) for i in appliers
    }
    results = {}
    for i, ref in applies.items():
      try:
        results[i] = ray.get(ref)
      except _actor_error():
        self._leave(i, r, "died applying the round")
    if not results:
      raise QuorumError(f"round {r}: every island of the quorum died applying it")
    agreed = self._check(r, results)
    first = results[min(results)]
    rejected = {tuple(x) for x in first["rejected"]}
    for i, res in results.items():
      if {tuple(x) for x in res["rejected"]} != rejected:
        raise IslandsMismatchError(
          f"round {r}: islands {min(results)} and {i} rejected different payloads"
        )
      self.status[i] = "synced"
    for sender, reason in sorted(rejected, key=str):
      self.events.write(r, "reject", sender, reason=reason)
    self.hashes[r] = agreed
    self.history[r] = refs
    self.round = r + 1
    summary = {
      "round": r,
      "quorum": quorum,
      "applied": first["applied"],
      "rejected": sorted(s for s, _ in rejected),
      "bytes": int(sum(first["bytes"])),
      "payload_bytes": int(max(nbytes.values(), default=0)),
      "train_loss": float(np.mean(list(losses.values()))) if losses else float("nan"),
      "seconds": time.time() - start,
      "hash": agreed,
    }
    self.events.write(
      r,
      "quorum",
      None,
      islands=quorum,
      applied=first["applied"],
      bytes=summary["bytes"],
      seconds=round(summary["seconds"], 4),
      hash=agreed,
      behind=sorted(self.behind),
      joining=sorted(self.joining),
    )
    self._prune()
    if self.checkpoint is not None:
      self.checkpoint(r, [self.handles[i] for i in sorted(results)])
    if self.on_round is not None:
      self.on_round(r, summary)
    return summary

  def finish(self, timeout: float) -> dict[int, str]:
    """Waits for stragglers, joiners and restarts, catches them up; live islands' hashes.

    Raises:
      IslandsMismatchError: a live island's state differs from the agreed one.
    """
    import ray

    end = time.time() + timeout
    unsettled = lambda: [
      i for i, s in self.status.items() if s not in ("synced", "gone")
    ]
    while unsettled() and time.time() < end:
      self._sweep()
      self._start_joins()
      if unsettled():
        time.sleep(0.05)
    live = sorted(i for i, s in self.status.items() if s == "synced")
    got = dict(
      zip(live, ray.get([self.handles[i].hash.remote() for i in live]), strict=True)
    )
    results = {i: {"hash": h} for i, (_, h) in got.items()}
    agreed = self._check(self.round - 1, results)
    self.events.write(
      self.round,
      "end",
      None,
      islands=live,
      hash=agreed,
      failures=self.failures,
      not_synced=sorted(i for i, s in self.status.items() if s != "synced"),
    )
    return {i: h for i, (_, h) in got.items()}
