"""Islands on a local Ray: kills, stragglers, forged payloads, resume.

One local Ray per module, bound to 127.0.0.1 and stopped at the end; three
runs share it: a run without failures (its checkpoint seeds the resume), a
run with every kind of fault, and a resume on another island count that
ends on a corrupted island. Islands load their programs from the shared
JAX compilation cache, so a restarted island comes back in seconds.
"""

import shutil

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from configs import islands as islands_config  # noqa: E402
from train import logs  # noqa: E402
from train.islands import checkpoint as checkpoint_lib  # noqa: E402
from train.islands import coordinator, records, run  # noqa: E402

# One worker runs the module: its tests share one local Ray and its runs. The
# two-process runs (test_multihost) share that worker, so the suite's
# multi-process runs never starve each other of the 2 cores.
pytestmark = pytest.mark.xdist_group("processes")

ROUNDS = 14
FAULTS = ";".join(
  [
    "delay:island=2,round=2,seconds=2.5",  # past the grace window: skipped
    "delay:island=0,round=4,seconds=3",  # meanwhile 2 is back and works
    "forge:island=0,round=6,kind=nan",
    "forge:island=1,round=7,kind=shape",
    "forge:island=2,round=8,kind=round",
    "kill:island=1,round=9",  # SIGKILL of its own process
    "delay:island=0,round=10,seconds=8",  # time for Ray to bring island 1 back
    "drop:island=2,round=12",  # never handed in
  ]
)


@pytest.fixture(scope="module")
def local_ray():
  started = run.start_ray(None, num_cpus=4)
  yield
  if started:
    ray.shutdown()


def _config(**islands):
  config = islands_config.get_config()
  config.islands.rounds = ROUNDS
  config.islands.grace_seconds = 0.5
  config.islands.eval_every_rounds = 1
  config.islands.checkpoint_every_rounds = 0
  config.islands.update(islands)
  return config


@pytest.fixture(scope="module")
def baseline(local_ray, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("baseline")
  # A long grace window: a round closes as soon as all three are in, and a
  # busy machine's slow round does not make a straggler of the clean run.
  config = _config(checkpoint_every_rounds=7, grace_seconds=5.0)
  out = run.train_and_evaluate(config, workdir)
  return workdir, out


@pytest.fixture(scope="module")
def faulty(local_ray, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("faulty")
  out = run.train_and_evaluate(_config(inject=FAULTS), workdir)
  return workdir, out


def _losses(workdir):
  rows = logs.read_metrics(workdir / "metrics.jsonl")
  return {r["round"]: r["eval_loss"] for r in rows if "round" in r and "eval_loss" in r}


def test_without_failures_every_round_has_all_islands(baseline):
  workdir, out = baseline
  events = records.read(workdir)
  quorums = [e for e in events if e["event"] == "quorum"]
  assert [e["round"] for e in quorums] == list(range(ROUNDS))
  assert all(e["applied"] == [0, 1, 2] for e in quorums)
  assert len(set(out["final_hashes"].values())) == 1 and out["failures"] == 0
  checkpoints = [e["rounds"] for e in events if e["event"] == "checkpoint"]
  assert checkpoints == [7, 14]
  losses = _losses(workdir)
  assert losses[ROUNDS - 1] < losses[0] / 3  # it learns


def test_a_killed_island_rejoins_from_a_live_peer(faulty):
  workdir, out = faulty
  events = records.read(workdir)
  leaves = [e for e in events if e["event"] == "leave"]
  assert [e["island"] for e in leaves] == [1] and out["failures"] == 1
  joins = [e for e in events if e["event"] == "join" and e["island"] == 1]
  peer = [e for e in joins if e["via"] == "peer"]
  assert len(peer) == 1 and peer[0]["peer"] in (0, 2)
  # No checkpoint exists to read: the state came from the peer, checked by hash.
  assert not (workdir / checkpoint_lib.DIRECTORY).exists()
  assert not [e for e in events if e["event"] == "checkpoint"]
  end = events[-1]
  assert end["event"] == "end" and end["islands"] == [0, 1, 2] and not end["not_synced"]
  assert set(out["final_hashes"].values()) == {end["hash"]}  # survivors identical
  # Its state after the copy and the replay is the one the quorum agreed on.
  agreed = {e["round"]: e["hash"] for e in events if e["event"] == "quorum"}
  assert peer[0]["hash"] == agreed[peer[0]["round"] - 1]


def test_a_straggler_is_skipped_and_rejoins(faulty):
  workdir, _ = faulty
  events = records.read(workdir)
  quorum = {e["round"]: e for e in events if e["event"] == "quorum"}
  assert quorum[2]["islands"] == [0, 1]
  late = [e for e in events if e["event"] == "reject" and e["island"] == 2]
  assert any(
    e["round"] == 2 and e["reason"].startswith("late: round 2 closed") for e in late
  )
  replay = [
    e
    for e in events
    if e["event"] == "join" and e["via"] == "replay" and e["island"] == 2
  ]
  replay = [e for e in replay if e["replayed"][0] == 2]
  assert len(replay) == 1
  back = replay[0]["round"]
  assert any(2 in quorum[r]["islands"] for r in range(back, ROUNDS))  # in again


REASONS = {
  "nan": "array 0 is not finite",
  "shape": "array 0 has shape (11,), expected (12,)",
  "round": "round {r_1}, expected {r}",
  "drop": "dropped: never handed in",
}


def test_forged_and_dropped_payloads_are_rejected_and_never_applied(faulty):
  """Each fault strikes in the first round its island works at or after the
  planned one (a straggler's forge waits for it): the reject names that round."""
  workdir, _ = faulty
  events = records.read(workdir)
  rejects = {
    (e["round"], e["island"]): e["reason"] for e in events if e["event"] == "reject"
  }
  faults = [
    e for e in events if e["event"] == "fault" and e["kind"] in ("forge", "drop")
  ]
  assert sorted(e.get("forge") or e["kind"] for e in faults) == [
    "drop",
    "nan",
    "round",
    "shape",
  ]
  for f in faults:
    r, kind = f["round"], f.get("forge") or f["kind"]
    assert rejects[(r, f["island"])] == REASONS[kind].format(r=r, r_1=r - 1)
  for e in events:
    if e["event"] == "quorum":
      bad = {i for (r, i) in rejects if r == e["round"]}
      assert e["applied"] == sorted(set(e["islands"]) - bad)
      assert e["islands"] and set(e["applied"]) <= set(e["islands"])


def test_final_loss_within_the_argued_tolerance(baseline, faulty):
  """The fault run's final loss is no worse than the clean run's L rounds earlier.

  L counts the rounds in which some island's payload was not applied. Every
  round still applies a mean of >= min_quorum pseudo-gradients, an outer
  step of the same expected direction with more variance, and no mass is
  dropped (late and rejected payloads stay in their island's carry), so a
  round missing a payload costs at most one round of progress.
  """
  base, _ = baseline
  workdir, out = faulty
  quorums = [e for e in records.read(workdir) if e["event"] == "quorum"]
  lost = sum(e["applied"] != [0, 1, 2] for e in quorums)
  assert 0 < lost < ROUNDS
  clean = _losses(base)
  assert np.isfinite(out["eval_loss"])
  assert out["eval_loss"] <= clean[ROUNDS - 1 - lost], (out["eval_loss"], lost, clean)


def test_checkpoint_resume_conserves_the_unsent_mass(baseline):
  workdir, _ = baseline
  ckpts = checkpoint_lib.OuterCheckpoints(workdir)
  snap3, carries3, saved = ckpts.restore(3)
  snap2, carries2, _ = ckpts.restore(2)
  ckpts.close()
  assert saved == 3 and snap2.hash == snap3.hash and snap2.round == ROUNDS
  for a, b in zip(
    jax.tree.leaves(jax.tree.map(lambda *x: np.sum(x, 0, dtype=np.float64), *carries3)),
    jax.tree.leaves(jax.tree.map(lambda *x: np.sum(x, 0, dtype=np.float64), *carries2)),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_whole_stop_resumes_on_two_islands_then_a_mismatch_stops_it(baseline, tmp_path):
  base, _ = baseline
  shutil.copytree(base / checkpoint_lib.DIRECTORY, tmp_path / checkpoint_lib.DIRECTORY)
  config = _config(
    count=2,
    rounds=ROUNDS + 4,
    checkpoint_every_rounds=100,
    inject=f"corrupt:island=1,round={ROUNDS + 2}",
  )
  with pytest.raises(coordinator.IslandsMismatchError, match=f"round {ROUNDS + 2}"):
    run.train_and_evaluate(config, tmp_path)
  events = records.read(tmp_path)
  resume = [e for e in events if e["event"] == "resume"]
  assert resume == [resume[0]] and resume[0]["round"] == ROUNDS
  assert (resume[0]["saved_islands"], resume[0]["islands"]) == (3, 2)
  quorum = [e for e in events if e["event"] == "quorum"]
  assert [e["round"] for e in quorum] == [ROUNDS, ROUNDS + 1]
  assert all(e["islands"] == [0, 1] for e in quorum)
  assert events[-1]["event"] == "mismatch" and events[-1]["round"] == ROUNDS + 2
  # It went on from the trained state, not from scratch.
  assert _losses(tmp_path)[ROUNDS] < _losses(base)[ROUNDS // 2]
