"""``python -m bench islands``: islands on Ray under injected failures (DESIGN §12).

Two runs of ``configs/islands.py`` (3 islands x 2 virtual CPU devices, the
digits MLP, DiLoCo with top-k 10 % pseudo-gradients) on one local Ray bound
to 127.0.0.1: one without failures, one with ``failures`` SIGKILLs spread
in time (island ``k mod 3`` killed ``first + k * every`` seconds into the
run, ``train.islands.plan.spread_kills``), each brought back by Ray and
rejoined from a live peer. Reported, from each run's ``islands.jsonl`` and
``metrics.jsonl``:

- rounds per minute (wall clock of the rounds, startup excluded);
- bytes per round (the payloads applied; each island sends one);
- time lost per failure: the time the rounds a failure touched (the one its
  island died in, the one Ray's report of the death came in, the one it
  rejoined in) took above the median round, per failure: the run's
  downtime, since the other islands go on; each killed island's own
  downtime (kill to rejoin) and the time Ray took to report its death; and
  the difference of the two runs' wall times per failure (on a shared
  machine it mixes in the load, and two islands run faster than three on 2
  cores);
- the final eval loss of both and their gap;
- that nothing was lost: every surviving island ends on one hash, every
  round's ``applied`` is the quorum minus its rejected payloads, and every
  failure was followed by a join from a live peer.

  python -m bench islands --failures 10 --rounds 3000 --out bench_out/
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import output


def _config(rounds: int, grace: float, inject: str | None, cache: str | None):
  from configs import islands as islands_config

  config = islands_config.get_config()
  config.islands.rounds = rounds
  config.islands.grace_seconds = grace
  config.islands.checkpoint_every_rounds = 0
  config.islands.eval_every_rounds = max(1, rounds // 20)
  config.islands.inject = inject
  config.islands.compilation_cache = cache
  return config


def _audit(workdir: Path) -> dict[str, Any]:
  """What ``islands.jsonl`` says: failures, joins, and the checks that nothing was lost."""
  from train.islands import records

  events = records.read(workdir)
  quorums = [e for e in events if e["event"] == "quorum"]
  rejected = {(e["round"], e["island"]) for e in events if e["event"] == "reject"}
  means_ok = all(
    e["applied"]
    == sorted(set(e["islands"]) - {i for r, i in rejected if r == e["round"]})
    for e in quorums
  )
  leaves = [e for e in events if e["event"] == "leave"]
  peer_joins = [e for e in events if e["event"] == "join" and e["via"] == "peer"]
  end = events[-1] if events and events[-1]["event"] == "end" else {}
  # Per failure: fault -> leave (Ray reports the death), fault -> join from a peer.
  kills = [e for e in events if e["event"] == "fault" and e["kind"] == "kill"]
  detect, down = [], []
  for k in kills:
    leave = next(
      (e for e in leaves if e["island"] == k["island"] and e["time"] >= k["time"]), None
    )
    join = next(
      (e for e in peer_joins if e["island"] == k["island"] and e["time"] >= k["time"]),
      None,
    )
    if leave is not None:
      detect.append(leave["time"] - k["time"])
    if join is not None:
      down.append(join["time"] - k["time"])
  # The rounds a failure slowed: the one its island died in (closed by Ray's
  # report of the death or by the grace window) and the one it rejoined in
  # (a peer's snapshot, the copy, the replay), each above the median round.
  seconds = {e["round"]: e["seconds"] for e in quorums}
  median = float(np.median(list(seconds.values()))) if seconds else 0.0
  slowed = {k["round"] for k in kills} | {e["round"] for e in peer_joins}
  slowed |= {e["round"] for e in leaves}
  stall = sum(max(seconds.get(r, median) - median, 0.0) for r in slowed)
  return {
    "median_round_seconds": median,
    "stall_seconds": stall,
    "detect_seconds": detect,
    "island_downtime_seconds": down,
    "rounds": len(quorums),
    "failures": len(leaves),
    "peer_joins": len(peer_joins),
    "rounds_missing_a_payload": sum(len(e["applied"]) < 3 for e in quorums),
    "every_mean_from_its_quorum": means_ok,
    "islands_at_end": end.get("islands", []),
    "one_hash_at_end": bool(end) and not end.get("not_synced"),
    "checkpoint_reads": sum(e["event"] == "resume" for e in events),
  }


def _read(label: str, workdir: Path) -> dict[str, Any]:
  """A finished run's numbers, all from its ``islands.jsonl`` and ``metrics.jsonl``."""
  from train import logs
  from train.islands import records

  events = records.read(workdir)
  quorums = [e for e in events if e["event"] == "quorum"]
  faults = [e for e in events if e["event"] == "fault"]
  final = [r for r in logs.read_metrics(workdir / "metrics.jsonl") if r.get("final")]
  end = events[-1] if events and events[-1]["event"] == "end" else {}
  # From the first round's start to the last round's close.
  seconds = quorums[-1]["time"] - (quorums[0]["time"] - quorums[0]["seconds"])
  return {
    "label": label,
    "workdir": str(workdir),
    # The faults as they struck (round, and seconds into the run if planned so).
    "faults": [
      {
        "kind": f["kind"],
        "island": f["island"],
        "round": f["round"],
        "after": f.get("after"),
      }
      for f in faults
    ],
    "rounds_seconds": seconds,
    "rounds_per_minute": len(quorums) / seconds * 60.0,
    "bytes_per_round": float(np.mean([e["bytes"] for e in quorums])),
    "eval_loss": final[-1]["eval_loss"],
    "eval_accuracy": final[-1]["eval_accuracy"],
    "final_hashes": [end["hash"]] if end else [],
    **_audit(workdir),
  }


def _one(label: str, config, workdir: Path) -> dict[str, Any]:
  from train.islands import run as islands_run

  islands_run.train_and_evaluate(config, workdir)
  return _read(label, workdir)


def _mean(xs) -> float:
  return float(sum(xs) / len(xs)) if xs else float("nan")


def summarize(clean: dict, faulty: dict) -> dict[str, Any]:
  """Time lost per failure and the loss gap, from the two runs' records."""
  failures = max(faulty["failures"], 1)
  return {
    "failures": faulty["failures"],
    "time_lost_per_failure_seconds": faulty["stall_seconds"] / failures,
    "wall_difference_per_failure_seconds": (
      faulty["rounds_seconds"] - clean["rounds_seconds"]
    )
    / failures,
    "loss_gap": faulty["eval_loss"] - clean["eval_loss"],
    "mean_detect_seconds": _mean(faulty["detect_seconds"]),
    "mean_island_downtime_seconds": _mean(faulty["island_downtime_seconds"]),
    "nothing_lost": bool(
      faulty["one_hash_at_end"]
      and len(faulty["final_hashes"]) == 1
      and faulty["every_mean_from_its_quorum"]
      and faulty["peer_joins"] >= faulty["failures"]
      and faulty["checkpoint_reads"] == 0
    ),
  }


def format_table(clean: dict, faulty: dict, summary: dict) -> str:
  rows = [
    "| run | rounds | rounds/min | bytes/round | failures | peer joins | "
    "rounds missing a payload | eval loss | eval acc |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in (clean, faulty):
    rows.append(
      f"| {r['label']} | {r['rounds']} | {r['rounds_per_minute']:.0f} | "
      f"{r['bytes_per_round']:.0f} | {r['failures']} | {r['peer_joins']} | "
      f"{r['rounds_missing_a_payload']} | {r['eval_loss']:.4f} | "
      f"{r['eval_accuracy']:.4f} |"
    )
  rows.append("")
  rows.append(
    f"{summary['failures']} failures survived; time lost per failure "
    f"{summary['time_lost_per_failure_seconds']:.2f} s (the others go on; wall "
    f"difference {summary['wall_difference_per_failure_seconds']:+.2f} s); an "
    f"island is back {summary['mean_island_downtime_seconds']:.1f} s after its kill "
    f"(Ray reports the death after {summary['mean_detect_seconds']:.1f} s); loss gap "
    f"{summary['loss_gap']:+.4f}; nothing lost: {summary['nothing_lost']}"
  )
  return "\n".join(rows)


def _publish(clean: dict, faulty: dict, out_dir: str) -> dict[str, Any]:
  summary = summarize(clean, faulty)
  table = format_table(clean, faulty, summary)
  result = {"clean": clean, "faults": faulty, "summary": summary}
  print(table)
  output.write_json(out_dir, "islands.json", result)
  (Path(out_dir) / "islands.md").write_text(table + "\n")
  return result


def run(
  failures: int = 10,
  rounds: int = 3000,
  first: float = 3.0,
  every: float = 7.0,
  grace: float = 0.5,
  out_dir: str = "bench_out/",
  reuse: str | None = None,
) -> dict[str, Any]:
  """Both runs on one local Ray; writes ``islands.json`` and ``islands.md``.

  ``reuse``: a directory holding ``clean/`` and ``faults/`` of finished runs,
  read instead of running again.
  """
  if reuse is not None:
    base = Path(reuse)
    return _publish(
      _read("no failures", base / "clean"),
      _read(f"{failures} kills", base / "faults"),
      out_dir,
    )
  from train.islands import plan
  from train.islands import run as islands_run

  out = Path(out_dir)
  base = out / "islands_runs" / time.strftime("%Y%m%d-%H%M%S")
  cache = str((out / "islands_runs" / "xla_cache").absolute())
  inject = plan.spread_kills(failures, 3, first, every) if failures else None
  started = islands_run.start_ray(None, num_cpus=4)
  try:
    clean = _one("no failures", _config(rounds, grace, None, cache), base / "clean")
    faulty = _one(
      f"{failures} kills", _config(rounds, grace, inject, cache), base / "faults"
    )
  finally:
    if started:
      import ray

      ray.shutdown()
  return _publish(clean, faulty, out_dir)


def add_parser(suites) -> None:
  """Registers ``islands`` on ``python -m bench``'s sub-commands."""
  p = suites.add_parser("islands", help="islands on Ray under injected failures")
  p.add_argument("--failures", type=int, default=10, help="islands SIGKILLed")
  p.add_argument("--rounds", type=int, default=3000, help="outer rounds per run")
  p.add_argument("--first", type=float, default=3.0, help="seconds to the first kill")
  p.add_argument("--every", type=float, default=7.0, help="seconds between kills")
  p.add_argument("--grace", type=float, default=0.5, help="islands.grace_seconds")
  p.add_argument("--out", default="bench_out/", help="directory for islands.*")
  p.add_argument(
    "--reuse",
    default=None,
    help="a directory with clean/ and faults/ of finished runs: read, not rerun",
  )
  p.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
  run(
    args.failures,
    args.rounds,
    args.first,
    args.every,
    args.grace,
    args.out,
    args.reuse,
  )


if __name__ == "__main__":
  parser = argparse.ArgumentParser(prog="python -m bench.islands")
  add_parser(parser.add_subparsers(dest="suite", required=True))
  parsed = parser.parse_args(["islands", *__import__("sys").argv[1:]])
  parsed.func(parsed)
