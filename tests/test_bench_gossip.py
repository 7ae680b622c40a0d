"""The gossip suite's arithmetic, without training: re-pricing against the
alpha-beta closed forms, time to target, the claims, the CLI."""

import numpy as np
import pytest

import gradcomp
from bench import __main__ as bench_main
from bench import gossip, workloads

# alpha = 25 us; one message of B bytes at 1 Gbit/s: alpha + 8 B / 1e9.
ALPHA, B, F = 25e-6, 38_440, 4e9  # F: 0.5 ms of compute at 8 TFLOP/s.
COMPUTE = F / 8e12


def _inputs(topology, overlap):
  return {
    "flops_per_step": F,
    "message_bytes": B,
    "overlap": overlap,
    # As in a run's sim.json: the 8-worker summary; rebuilt for the cluster.
    "topology": gradcomp.topology.get(topology, 8).summary(),
    "round_wire": {"collective-permute": B},
  }


@pytest.mark.parametrize("workers", [16, 64])
def test_all_reduce_is_a_barrier_and_a_ring_all_reduce_every_step(workers):
  cluster = gradcomp.sim.Cluster(workers, bandwidth_gbps=10.0)
  n, per_byte = workers, 8 / 10e9
  step = COMPUTE + 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * B * per_byte
  inputs = {"flops_per_step": F, "round_wire": {"all-reduce": B}}
  got = gossip.reprice(inputs, cluster, 4)
  np.testing.assert_allclose(got, step * np.arange(5), rtol=1e-12)


@pytest.mark.parametrize(
  ("topology", "messages"),
  # Messages per step on 64 workers: the topology is rebuilt for them.
  [("ring", 2), ("torus", 4), ("exponential", 6), ("one_peer_exponential", 1)],
)
@pytest.mark.parametrize("overlap", [True, False])
def test_gossip_waits_for_its_neighbours_messages_only(topology, messages, overlap):
  """Per step ``max(c, K m)`` with overlap (D-PSGD), ``c + K m`` without
  (CHOCO, GoSGD): ``K`` messages of ``m = alpha + B / bw`` each."""
  cluster = gradcomp.sim.Cluster(64, bandwidth_gbps=1.0)
  m = ALPHA + 8 * B / 1e9  # 0.33 ms: between c / 2 and c.
  step = max(COMPUTE, messages * m) if overlap else COMPUTE + messages * m
  got = gossip.reprice(_inputs(topology, overlap), cluster, 12)
  np.testing.assert_allclose(got, step * np.arange(13), rtol=1e-12)
  assert got[-1] / 12 == pytest.approx(
    gradcomp.sim.gossip_step_seconds(cluster, F, topology, B, overlap=overlap)
  )


def _sim(seconds, ends):
  return {
    name: {"seconds": list(s), "end": e}
    for name, s, e in zip(("16w_10gbps", "64w_10gbps"), seconds, ends, strict=True)
  }


def test_time_to_target_and_its_ratio_to_all_reduce():
  summaries = {  # Evals at steps 100, 200, 300.
    # All-reduce: 1 s and 4 s per eval interval on 16 and 64 workers.
    "allreduce": {"sim": _sim([[1, 2, 3], [4, 8, 12]], [3, 12])},
    # Gossip: 0.5 s and 0.5 s (no barrier: the same on both).
    "dpsgd_ring": {"sim": _sim([[0.5, 1, 1.5], [0.5, 1, 1.5]], [1.5, 1.5])},
    "q2_topk1": {"sim": _sim([[0.5, 1, 1.5], [0.5, 1, 1.5]], [1.5, 1.5])},
  }
  accuracy = {
    # Seeds reach 0.97 at steps 200 and 300 (all-reduce), 100 and 200.
    "allreduce": np.array([[0.96, 0.97, 0.98], [0.95, 0.96, 0.97]]),
    "dpsgd_ring": np.array([[0.97, 0.97, 0.98], [0.96, 0.975, 0.97]]),
    "q2_topk1": np.array([[0.90, 0.91, 0.92], [0.90, 0.91, np.nan]]),
  }
  gossip.add_time_to_target(summaries, accuracy, 0.97)
  base = summaries["allreduce"]["sim"]
  assert base["16w_10gbps"]["target"]["mean"] == pytest.approx(2.5)  # (2 + 3) / 2
  assert base["64w_10gbps"]["target"]["mean"] == pytest.approx(10.0)
  ring = summaries["dpsgd_ring"]["sim"]
  assert ring["16w_10gbps"]["target"]["mean"] == pytest.approx(0.75)
  assert ring["16w_10gbps"]["ratio"] == pytest.approx(0.75 / 2.5)
  assert ring["64w_10gbps"]["ratio"] == pytest.approx(0.75 / 10)
  assert ring["64w_10gbps"]["step_ratio"] == pytest.approx(1.5 / 12)
  never = summaries["q2_topk1"]["sim"]["64w_10gbps"]
  assert never["target"] == {"reached": 0, "seeds": 2, "mean": None}
  assert never["ratio"] is None


def _summary(accuracy, *, ratios=(0.5, 0.1), reached=3, consensus=None):
  sim = {
    gossip.cluster_name(n, 10.0): {
      "ratio": r,
      "target": {"reached": reached, "seeds": 3, "mean": None if r is None else r},
    }
    for n, r in zip(gossip.PRICED_WORKERS, ratios, strict=True)
  }
  return {
    "final_accuracy": {"mean": accuracy, "std": 0.0},
    "consensus_distance_end": None if consensus is None else consensus[-1],
    "consensus": None if consensus is None else {"mean": list(consensus)},
    "sim": sim,
  }


def _good():
  return {
    "allreduce": _summary(0.980, ratios=(1.0, 1.0)),
    "dpsgd_one_peer": _summary(0.978, ratios=(0.3, 0.05)),
    "dpsgd_ring": _summary(0.979, consensus=[0.1, 0.05, 0.01]),
    "choco_topk1": _summary(0.975, consensus=[5.0, 2.0, 1.0]),
    "q2_topk1": _summary(0.970, consensus=[5.0, 20.0, 30.0]),
  }


def test_claims_hold_by_their_rules():
  checks = gossip.claim_checks(_good())
  assert [c["holds"] for c in checks] == [True] * 5, checks
  assert checks[2]["difference_pp"] == pytest.approx(-0.4)
  assert checks[3]["factor"] == pytest.approx(30.0)


@pytest.mark.parametrize(
  ("change", "failing"),
  [
    # Slower than all-reduce, more so on 64 workers: both SGP claims fail.
    ({"dpsgd_one_peer": _summary(0.978, ratios=(1.2, 1.5))}, [0, 1]),
    # Slower on 16 workers only: the ratio still falls.
    ({"dpsgd_one_peer": _summary(0.978, ratios=(1.2, 0.9))}, [0]),
    # Faster, but not more so on 64 workers.
    ({"dpsgd_one_peer": _summary(0.978, ratios=(0.3, 0.4))}, [1]),
    # A seed never reaches the target.
    ({"dpsgd_one_peer": _summary(0.978, ratios=(0.3, 0.05), reached=2)}, [0]),
    # CHOCO 1.5 points below dense D-PSGD on the ring.
    ({"choco_topk1": _summary(0.964, consensus=[5.0, 2.0, 1.0])}, [2]),
    # CHOCO's distance grows: no consensus, though Q2's is 30x.
    ({"choco_topk1": _summary(0.975, consensus=[0.5, 0.8, 1.0])}, [3]),
    # Q2 within 10x of CHOCO: neither consensus claim holds.
    ({"q2_topk1": _summary(0.970, consensus=[5.0, 6.0, 8.0])}, [3, 4]),
    # Q2 far above CHOCO but shrinking.
    ({"q2_topk1": _summary(0.970, consensus=[50.0, 40.0, 30.0])}, [4]),
  ],
)
def test_claims_fail_by_their_rules(change, failing):
  checks = gossip.claim_checks({**_good(), **change})
  assert [i for i, c in enumerate(checks) if not c["holds"]] == failing


def test_claims_need_their_methods():
  assert gossip.claim_checks({"allreduce": _good()["allreduce"]}) == []


def test_q2_is_choco_topk1_without_public_copies():
  choco, q2 = gossip.METHODS["choco_topk1"], gossip.METHODS["q2_topk1"]
  assert {**q2.scheme, "public_copies": True} == {**choco.scheme, "public_copies": True}
  assert q2.scheme["public_copies"] is False and "public_copies" not in choco.scheme
  assert (q2.compressor, q2.hyperparameters) == ("topk", {"ratio": 0.01})
  assert q2.hyperparameters == choco.hyperparameters
  assert len(gossip.DEFAULT_METHODS) == 10


def test_cli_rejects_unknown_methods_and_bad_flags():
  with pytest.raises(SystemExit, match="unknown --methods.*known: allreduce"):
    bench_main.main(["gossip", "--methods", "allreduce,dpsgd_star"])
  with pytest.raises(SystemExit, match="--seeds must be >= 1"):
    bench_main.main(["gossip", "--seeds", "0"])
  with pytest.raises(SystemExit, match="could not convert"):
    bench_main.main(["gossip", "--gamma-sweep", "0.1,big"])


def test_workload_reading_prices_resnet50_steps():
  """All-reduce: compute + 2(n-1)/n of the dense bytes; one-peer D-PSGD:
  max(compute, one dense message) per step (the exchange overlaps)."""
  import gradcomp
  from bench.paper import v100_tflops
  from gradcomp.models import shapes
  from gradcomp.sim.clock import training_flops

  summary = {"step": [100, 200], "accuracy_mean": [0.5, 0.99]}
  result = {
    "target": 0.9,
    "results": {"allreduce": {"summary": summary}, "p": {"summary": summary}},
    "methods": {
      "allreduce": {"scheme": {"name": "none"}, "compressor": "none"},
      "p": {
        "scheme": {"name": "gossip", "topology": "one_peer_exponential"},
        "compressor": "none",
      },
    },
  }
  rows = {(r["workers"], r["method"]): r for r in gossip.workload_reading(result)}
  values = sum(int(np.prod(s)) for _, s in shapes.MODELS["resnet50"]())
  compute = training_flops(float(sum(shapes.forward_flops("resnet50"))), 32) / (
    v100_tflops() * 1e12
  )
  cluster = gradcomp.sim.Cluster(16, bandwidth_gbps=10.0)
  dense = float(cluster.exchange_seconds("all-reduce", 4 * values))
  message = float(cluster.exchange_seconds("collective-permute", 4 * values))
  assert rows[16, "allreduce"]["step_ms"] == pytest.approx(1e3 * (compute + dense))
  assert rows[16, "p"]["step_ms"] == pytest.approx(1e3 * max(compute, message))
  assert rows[16, "p"]["steps_to_target"] == 200
  assert rows[16, "allreduce"]["ratio"] == pytest.approx(1.0)


def test_gpt_tiny_workload_reports_bits_per_byte(tmp_path):
  """``--workload gpt_tiny``: CHOCO on the ring, one smoke run: bits per byte of
  the average model and the workers' mean, a consensus distance."""
  workload = workloads.GPT_TINY.with_overrides(workloads.SMOKE)
  result = gossip.run(
    methods=[gossip.METHODS["choco_topk1"]],
    seeds=1,
    steps=4,
    eval_every=2,
    out_dir=str(tmp_path),
    workload=workload,
  )
  s = result["results"]["choco_topk1"]["summary"]
  assert 3.0 < s["final_bpb"]["mean"] < 9.0
  assert 3.0 < s["final_worker_bpb_mean"]["mean"] < 9.0
  assert s["consensus_distance_end"] >= 0 and s["program_clock_max_rel_diff"] < 1e-9
  assert result["target"] is None  # No allreduce run: no target.
  table = (tmp_path / "gossip.md").read_text()
  assert "Final validation bits per byte (bits/byte)" in table
  assert "| choco_topk1 | gossip (gamma=0.05) | topk ratio=0.01 | ring" in table
  with pytest.raises(SystemExit, match="digits only"):
    bench_main.main(["gossip", "--gamma-sweep", "--workload", "gpt_tiny"])
