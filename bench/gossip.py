"""Decentralized training (issue 14): D-PSGD, CHOCO-SGD and GoSGD against all-reduce.

``python -m bench gossip``. Every run is the real training program on
``configs/default.py`` (MLP on scikit-learn digits, 8 workers, 600 steps of
128, inner SGD lr 0.1 momentum 0.9, plan ``single``), configured as the
schemes suite does (:func:`bench.schemes.configure`) with
``config.scheme`` and ``config.compressor`` per method of :data:`METHODS`,
``seeds`` seeds each (``config.seed``: init and data order), seed-major. It is
evaluated every ``eval_every`` steps and logs (the consensus distance among
others) every :data:`LOG_EVERY` steps.

**Methods.**

* ``allreduce``: synchronous SGD, the dense fp32 all-reduce every step;
* ``dpsgd_{ring,torus,exponential,one_peer}``: D-PSGD (``gradcomp.gossip``
  without a compressor) on the ring, the 2-D torus (2 x 4), the static
  exponential graph and the one-peer exponential graph (time-varying, one
  peer per step; SGP's graph, Assran et al. 2019);
* ``choco_topk1``: CHOCO-SGD with top-k 1 % on :data:`CHOCO_TOPOLOGY`, a
  ring: the static graph with the smallest spectral gap here (0.195 on 8
  workers against 0.5 for the torus and the exponential graph) and the fewest
  messages (2 per step), so the hardest case for compressed consensus and the
  cheapest on the wire, and the same graph as ``dpsgd_ring``, its dense
  reference. (CHOCO's public copies need fixed neighbours: no one-peer graph.)
* ``choco_sign``: CHOCO with ``ef_signsgd``'s scaled sign (``||e||_1 / d``
  times the signs), used memoryless inside CHOCO (the public copy is the
  memory; ``gradcomp.schemes.gossip``), same ring;
* ``q2_topk1``: ``public_copies=False``, the compressed gossip on the params
  themselves that CHOCO fixes (Carli et al. 2007's "Q2"), same codec, ring and
  gamma as ``choco_topk1``;
* ``gosgd_p0.1``, ``gosgd_p1``: GoSGD, sum-weight push gossip with push
  probability 0.1 and 1.

**CHOCO's gamma** (:data:`GAMMA`, one per codec, fixed across seeds) is the
best of a sweep on seed 0, ``python -m bench gossip --gamma-sweep``
(:func:`gamma_sweep`, gammas :data:`SWEEP_GAMMAS`, 84 s on 2 cores): the
gamma with the lowest mean consensus distance over the run's second half,
which is what gamma steers. (The average model's final eval loss, the rule
first tried, is flat over the stable gammas, 0.062-0.068, and picks the
smallest: the least gossip.) Seed 0, ring, 600 steps:

======  ======================================  ==============================
gamma   top-k 1 %: acc. / worst / distance      scaled sign: acc. / worst / d.
======  ======================================  ==============================
0.01    98.61 / 96.39 / 5.29                    98.61 / 95.83 / 4.52
0.02    98.61 / 96.67 / 2.47                    98.61 / 97.22 / 2.08
0.05    **98.61 / 97.22 / 1.33**                98.33 / 97.22 / 0.686
0.1     98.33 / 96.67 / 3.99                    98.33 / 98.06 / 0.39
0.2     86.39 / 66.94 / 940 (diverging)         98.06 / 97.50 / 0.251
0.5     14.72 / 20.28 / 2e11                    98.06 / 97.78 / 0.123
1       stopped (non-finite)                    **98.33 / 97.50 / 0.0243**
======  ======================================  ==============================

(average-model and worst-worker final accuracy in %, mean consensus distance
over steps 320-600). CHOCO's theory asks for gamma of the order of the
compression quality omega times the spectral gap delta (Koloskova et al.
2019, Thm. 2): top-k 1 % has omega >= k / d = 0.01 in the worst case, so
about 0.002 on this ring (delta 0.195); in practice 0.05 is best and 0.2
already diverges. The scaled sign keeps most of the difference's energy (a
larger omega) and is stable up to gamma = 1.

**Accuracy, consensus, bytes.** ``eval_accuracy`` is the average model's
(the mean of the workers' params; for ``allreduce`` the replicated model),
``eval_worker_accuracy_min`` the worst worker's own model; final: the last
eval, mean ± std over seeds (ddof=1). The consensus distance is the program's
``mean_w ||x_w - mean x||^2`` (summed over leaves) at every logged step.
Bytes per step: the run's logged ``wire_bytes_per_step`` (per worker: the
``collective-permute`` messages of the step's phase, or the all-reduce, plus
16-20 bytes of logged means). GoSGD runs one ``ppermute`` every step whatever
``p`` (a worker that does not push sends a masked message): ``p = 0.1`` pays
the wire and time of ``p = 1`` in this synchronous reading.

**Simulated time.** Each run is re-priced from its ``sim.json`` (FLOPs per
worker-step, ``message_bytes``, ``overlap``, the topology's name; the
all-reduce run's ``round_wire``) by :func:`reprice` on
``Cluster(n, bandwidth_gbps=b)`` for n in :data:`PRICED_WORKERS` and b in
:data:`BANDWIDTHS_GBPS` (8 TFLOP/s per worker, 25 us latency): gossip with
``gradcomp.sim.simulate_gossip`` on the topology rebuilt by
``gradcomp.topology.get`` for n workers (each worker waits for its
in-neighbours only; GoSGD priced as a one-peer graph, as the program does),
all-reduce with ``gradcomp.sim.simulate_rounds`` (a barrier and a ring all-reduce
every step). **Assumptions**: the per-worker batch (16) and so the FLOPs per
step are the 8-worker runs'; a message is the same bytes at any n; and the
accuracy per step is the 8-worker run's. The last is optimistic for gossip on
large graphs: a ring of 64 has a spectral gap of 0.003 (0.195 on 8), so its
consensus (and accuracy per step) would lag; the one-peer exponential graph
still averages exactly in log2 n steps. With the step curve fixed, "more so
as workers grow" is carried by the step time alone. The same re-pricing on
the program's own cluster (8 workers, 20 Gbps) is checked against the run's
logged ``sim_seconds`` (``program_clock_max_rel_diff``).

On this model compute is negligible (0.92 MFLOP, 0.11 us at 8 TFLOP/s): a
step is its exchange, so D-PSGD's overlap of the messages with the backward
pass hides nothing, and the all-reduce's ``2 (n - 1)`` latencies dominate
(3.2 ms at 64 workers against one 25 us latency per gossip message).

**Time to target**: the target is ``allreduce``'s mean final accuracy minus
:data:`TARGET_PP` points (its own seeds' noise: one test image is 0.28
points); per seed, the simulated seconds at the first eval whose average
model reaches it (eval granularity), mean over the seeds that reach it, and
its ratio to ``allreduce``'s.

**Claims** (:func:`claim_checks`, printed with holds / does not hold):

* SGP's reading (Assran et al. 2019, 10 Gbps Ethernet): on 10 Gbps,
  :data:`SGP_METHOD` reaches the target, every seed, in less simulated time
  than all-reduce on 16 and on 64 workers; and its ratio to all-reduce's
  time is smaller on 64 workers than on 16;
* CHOCO's (Koloskova et al. 2019): at top-k 1 % CHOCO reaches the accuracy
  of dense D-PSGD on the same ring (mean final accuracy at most
  :data:`CHOCO_PP` points below ``dpsgd_ring``'s) and consensus (its mean
  final consensus distance at most 1 / :data:`CONSENSUS_FACTOR` of Q2's and
  below its value at the run's midpoint: shrinking); Q2 does not (its final
  distance at least :data:`CONSENSUS_FACTOR` times CHOCO's and above its
  midpoint value: growing). Constant learning rate: even dense D-PSGD keeps
  a consensus distance above zero, so "reaches consensus" is read as
  bounded and shrinking, not zero.

**Workloads** (``--workload``, :mod:`bench.workloads`): the above is
``digits``, the default. ``--workload gpt_tiny`` runs the same methods (the
same graphs, codecs and CHOCO gammas: the digits sweep's, as the transformer
suite's ``choco_ring`` does; not re-swept) on ``configs/gpt_tiny.py``, AdamW
the local optimizer of every worker, and reports the final validation bits
per byte (lower is better) of the average model and the workers' mean in
place of the worst worker's accuracy. The target is then ``allreduce``'s mean
final bpb plus ``workloads.BPB_MARGIN`` = 0.1 bits per byte (the transformer
suite's rule), and CHOCO's accuracy claim allows 0.1 bits per byte above
``dpsgd_ring``; the consensus and SGP claims are unchanged. ``--gamma-sweep``
stays on digits. The re-pricing is the same, from the runs' own FLOPs.

Writes ``gossip.json``, ``gossip.md`` and ``gossip.png`` (accuracy against
step; consensus distance against step, log; accuracy against simulated
seconds on 64 workers at 10 Gbps) to ``--out`` via
:func:`bench.output.publish`, and each run's workdir under
``--out/gossip_runs/``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import schemes, workloads
from bench.output import publish
from bench.schemes import Method
from bench.workloads import DIGITS, Workload

WORKERS = schemes.WORKERS
#: Log (consensus distance, simulated seconds) interval in steps.
LOG_EVERY = 20
#: CHOCO's and Q2's graph (module docstring).
CHOCO_TOPOLOGY = "ring"
TOPK_RATIO = 0.01
#: CHOCO's consensus step per codec: the gamma sweep's best on seed 0.
GAMMA = {"topk": 0.05, "ef_signsgd": 1.0}
#: The sweep's grid (``--gamma-sweep`` default).
SWEEP_GAMMAS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: Described clusters of the re-pricing: workers x link Gbit/s.
PRICED_WORKERS = (16, 64)
BANDWIDTHS_GBPS = (1.0, 10.0)
#: The reference of the time-to-target and its claims.
BASELINE = "allreduce"
#: Target: the baseline's mean final accuracy minus this (percentage points).
TARGET_PP = 0.5
#: SGP's graph: the one-peer exponential graph.
SGP_METHOD = "dpsgd_one_peer"
#: choco_topk1 may end at most this far below dpsgd_ring (percentage points).
CHOCO_PP = 1.0
#: Q2's final consensus distance at least this many times CHOCO's.
CONSENSUS_FACTOR = 10.0


def _dpsgd(label: str, topology: str, why: str) -> Method:
  return Method(
    label, {"name": "gossip", "topology": topology}, why=f"D-PSGD, dense: {why}"
  )


def _choco(
  label: str,
  codec: str,
  *,
  gamma: float | None = None,
  public_copies: bool = True,
  why: str = "",
) -> Method:
  scheme = {
    "name": "gossip",
    "topology": CHOCO_TOPOLOGY,
    "gamma": GAMMA[codec] if gamma is None else gamma,
  }
  if not public_copies:
    scheme["public_copies"] = False
  hyper = {"ratio": TOPK_RATIO} if codec == "topk" else {}
  return Method(label, scheme, codec, hyper, why=why)


METHODS: dict[str, Method] = {
  m.label: m
  for m in (
    Method(BASELINE, {"name": "none"}, why="dense fp32 all-reduce every step"),
    _dpsgd("dpsgd_ring", "ring", "2 neighbours"),
    _dpsgd("dpsgd_torus", "torus", "2-D torus, 3 neighbours on 2 x 4"),
    _dpsgd("dpsgd_exponential", "exponential", "peers at distances 2^k"),
    _dpsgd(
      "dpsgd_one_peer",
      "one_peer_exponential",
      "one peer at distance 2^(t mod log2 n) (SGP's graph)",
    ),
    _choco("choco_topk1", "topk", why="CHOCO-SGD, top-k 1 % of x - x_hat"),
    _choco(
      "choco_sign", "ef_signsgd", why="CHOCO-SGD, scaled sign of x - x_hat (memoryless)"
    ),
    _choco(
      "q2_topk1",
      "topk",
      public_copies=False,
      why="no public copies: top-k 1 % of the params (Q2), CHOCO's gamma",
    ),
    Method("gosgd_p0.1", {"name": "gosgd", "p": 0.1}, why="push w.p. 0.1"),
    Method("gosgd_p1", {"name": "gosgd", "p": 1.0}, why="push every step"),
  )
}
DEFAULT_METHODS = tuple(METHODS)


def cluster_name(workers: int, bandwidth_gbps: float) -> str:
  """``"64w_10gbps"``: the key of a re-pricing cluster."""
  return f"{workers}w_{bandwidth_gbps:g}gbps"


def clusters() -> dict[str, Any]:
  """The described clusters of the re-pricing (module docstring)."""
  import gradcomp

  return {
    cluster_name(n, b): gradcomp.sim.Cluster(n, bandwidth_gbps=b)
    for n in PRICED_WORKERS
    for b in BANDWIDTHS_GBPS
  }


def reprice(inputs: Mapping[str, Any], cluster, steps: int) -> np.ndarray:
  """Simulated seconds after each step ``0 .. steps`` of a run on ``cluster``.

  Args:
    inputs: the run's ``sim.json`` (:func:`schemes.priced_inputs`). With a
      ``topology`` (gossip, GoSGD): ``gradcomp.sim.simulate_gossip`` with the
      topology of that name rebuilt for ``cluster.workers``, the run's
      ``message_bytes`` and ``overlap``. Without (synchronous): a barrier and
      the run's ``round_wire`` every step, ``gradcomp.sim.simulate_rounds``.
    cluster: a ``gradcomp.sim.Cluster`` (ring links for gossip).
    steps: the run's steps.

  Returns:
    float64 array of shape ``(steps + 1,)``.
  """
  import gradcomp

  flops = inputs["flops_per_step"]
  if "topology" in inputs:
    topology = gradcomp.topology.get(inputs["topology"]["name"], cluster.workers)
    return gradcomp.sim.simulate_gossip(
      cluster,
      flops,
      topology,
      inputs["message_bytes"],
      steps,
      overlap=inputs["overlap"],
    )
  # Every method of this suite without a topology is synchronous SGD.
  return gradcomp.sim.simulate_rounds(
    cluster, flops, lambda step: True, inputs["round_wire"], steps
  )


def _consensus(rows: Sequence[Mapping[str, Any]]) -> dict[str, list]:
  """The logged consensus distances of one run (none for synchronous training)."""
  logged = [r for r in rows if "consensus_distance" in r]
  return {
    "step": [r["step"] for r in logged],
    # A diverged run logs a non-finite distance as null: NaN here.
    "distance": [
      math.nan if r["consensus_distance"] is None else float(r["consensus_distance"])
      for r in logged
    ],
  }


def summarize(
  runs: Sequence[Mapping[str, Any]],
  sim: Mapping[str, np.ndarray],
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """:func:`schemes.summarize` and the consensus distance over time."""
  out = schemes.summarize(runs, sim, workload)
  steps = runs[0]["consensus"]["step"]
  if steps and all(r["consensus"]["step"] == steps for r in runs):
    d = np.asarray([r["consensus"]["distance"] for r in runs])
    out["consensus"] = {
      "step": steps,
      "mean": d.mean(0).tolist(),
      "min": d.min(0).tolist(),
      "max": d.max(0).tolist(),
    }
  else:  # Synchronous, or a seed that stopped early.
    out["consensus"] = None
  return out


def add_time_to_target(
  summaries: Mapping[str, dict[str, Any]],
  accuracy: Mapping[str, np.ndarray],
  threshold: float,
  workload: Workload = DIGITS,
) -> None:
  """Per method and cluster, in place: the time to ``threshold`` and ratios.

  ``sim[cluster]["target"]`` is :func:`schemes._reach` of the method's
  per-seed metric (``accuracy[label]``, shape ``(seeds, evals)``) at the
  simulated seconds of its evals; ``"ratio"`` its mean over
  :data:`BASELINE`'s (``None`` if either reaches it in no seed);
  ``"step_ratio"`` the ratio of the runs' end times (of the step times).
  """
  for label, s in summaries.items():
    for sim in s["sim"].values():
      sim["target"] = schemes._reach(
        accuracy[label], np.asarray(sim["seconds"]), threshold, workload
      )
  base = summaries.get(BASELINE)
  for s in summaries.values():
    for name, sim in s["sim"].items():
      ref = None if base is None else base["sim"][name]
      mine, theirs = sim["target"]["mean"], ref and ref["target"]["mean"]
      sim["ratio"] = mine / theirs if mine is not None and theirs else None
      sim["step_ratio"] = sim["end"] / ref["end"] if ref else None


def _ratio(s: Mapping[str, Any], name: str) -> float | None:
  return s["sim"][name]["ratio"]


def claim_checks(
  summaries: Mapping[str, Mapping[str, Any]], workload: Workload = DIGITS
) -> list[dict[str, Any]]:
  """SGP's and CHOCO's readings (module docstring), where their methods ran."""
  w = workload
  checks = []
  if {BASELINE, SGP_METHOD} <= set(summaries):
    sgp = summaries[SGP_METHOD]
    names = [cluster_name(n, 10.0) for n in PRICED_WORKERS]
    ratios = {name: _ratio(sgp, name) for name in names}
    every_seed = all(
      sgp["sim"][name]["target"]["reached"] == sgp["sim"][name]["target"]["seeds"]
      for name in names
    )
    checks.append(
      {
        "claim": f"SGP: at 10 Gbps {SGP_METHOD} reaches the target in less "
        f"simulated time than {BASELINE} on "
        + " and ".join(str(n) for n in PRICED_WORKERS)
        + " workers",
        "ratios": ratios,
        "every_seed_reached": every_seed,
        "holds": every_seed and all(r is not None and r < 1 for r in ratios.values()),
      }
    )
    first, last = ratios[names[0]], ratios[names[-1]]
    checks.append(
      {
        "claim": f"SGP: {SGP_METHOD}'s time ratio to {BASELINE} at 10 Gbps is "
        f"smaller on {PRICED_WORKERS[-1]} workers than on {PRICED_WORKERS[0]}",
        "ratios": ratios,
        "holds": first is not None and last is not None and last < first,
      }
    )
  if {"choco_topk1", "dpsgd_ring"} <= set(summaries):
    choco = summaries["choco_topk1"][f"final_{w.key}"]["mean"]
    dense = summaries["dpsgd_ring"][f"final_{w.key}"]["mean"]
    checks.append(
      {
        "claim": f"CHOCO: choco_topk1 mean final {w.key} within "
        f"{w.tolerance(CHOCO_PP):g} {w.unit} of dpsgd_ring (same ring, dense)",
        w.difference_key: w.advantage(choco, dense),
        "holds": w.within(choco, dense, CHOCO_PP),
      }
    )
  if {"choco_topk1", "q2_topk1"} <= set(summaries):
    choco, q2 = summaries["choco_topk1"], summaries["q2_topk1"]
    c_end, q_end = choco["consensus_distance_end"], q2["consensus_distance_end"]
    factor = q_end / c_end if c_end and q_end is not None else None
    shrinks = _trend(choco["consensus"]) == "shrinks"
    checks.append(
      {
        "claim": "CHOCO: choco_topk1 reaches consensus: final consensus "
        f"distance <= 1/{CONSENSUS_FACTOR:g} of q2_topk1's and shrinking "
        "(final < midpoint)",
        "factor": factor,
        "shrinks": shrinks,
        "holds": bool(factor is not None and factor >= CONSENSUS_FACTOR and shrinks),
      }
    )
    grows = _trend(q2["consensus"]) == "grows"
    checks.append(
      {
        "claim": "CHOCO: q2_topk1 (no public copies) does not reach consensus: "
        f"final consensus distance >= {CONSENSUS_FACTOR:g}x choco_topk1's and "
        "growing (final > midpoint)",
        "factor": factor,
        "grows": grows,
        "holds": bool(factor is not None and factor >= CONSENSUS_FACTOR and grows),
      }
    )
  return checks


def _trend(consensus: Mapping[str, Any] | None) -> str | None:
  """``"grows"`` or ``"shrinks"``: the mean final consensus distance against
  its value at the run's midpoint (``None`` without two finite values)."""
  if not consensus or len(consensus["mean"]) < 2:
    return None
  d = consensus["mean"]
  mid, end = d[(len(d) - 1) // 2], d[-1]
  if not (math.isfinite(mid) and math.isfinite(end)):
    return None
  return "grows" if end > mid else "shrinks"


def _train_all(
  methods: Sequence[Method],
  seeds: Sequence[int],
  steps: int,
  eval_every: int,
  runs_dir: Path,
  workload: Workload = DIGITS,
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
  """Every method x seed (seed-major): runs with curves, and each method's pricing."""
  from train import pricing

  eval_steps = sorted({*range(eval_every, steps + 1, eval_every), steps})
  per_method: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
  priced: dict[str, dict[str, Any]] = {}
  described = clusters()
  for seed in seeds:
    for m in methods:
      config = schemes.configure(
        m, seed=seed, steps=steps, eval_every=eval_every, workload=workload
      )
      # Eval steps stay logged steps: the curve reads their simulated seconds.
      config.log_every_steps = math.gcd(LOG_EVERY, eval_every)
      workdir = runs_dir / m.label / f"seed{seed}"
      r = schemes._train(config, workdir)
      rows = r.pop("rows")
      r["seed"] = seed
      r["curve"] = schemes._curve(rows, eval_steps, workload)
      r["consensus"] = _consensus(rows)
      per_method[m.label].append(r)
      if m.label not in priced:  # The same for every seed.
        inputs = schemes.priced_inputs(workdir)
        every = {**described, "program": pricing.cluster_of(config, WORKERS)}
        priced[m.label] = {
          "inputs": inputs,
          "sim": {name: reprice(inputs, c, steps) for name, c in every.items()},
        }
      stop = f" (stopped: {r['stopped'][:60]}...)" if r.get("stopped") else ""
      cd = r["curve"]["consensus_distance_end"]
      schemes._log(
        f"{m.label} seed {seed}: {workload.key} "
        f"{r['curve'][f'eval_{workload.key}'][-1]:.4f}, consensus {'-' if cd is None else f'{cd:.3g}'}, "
        f"{r['wire_bytes_per_step'] or math.nan:,.0f} B/step, "
        f"{r['run_seconds']:.1f} s{stop}"
      )
  return per_method, priced


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 3,
  steps: int = 600,
  eval_every: int = 100,
  out_dir: str = "bench_out",
  docs_png: str | Path | None = None,
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """Runs the suite, prints its tables, writes ``gossip.{json,md,png}``.

  Args:
    methods: the curves (default: :data:`DEFAULT_METHODS`).
    seeds: runs per method, seeds ``0 .. seeds - 1``.
    steps: training steps of each run.
    eval_every: eval interval in steps; the last step is always evaluated.
    out_dir: where the outputs and the runs' workdirs go.
    docs_png: also copy ``gossip.png`` there, if given.
    workload: the base config and metric (``bench.workloads``).
  """
  import gradcomp
  from bench.compress import machine_info

  w = workload
  methods = schemes.check_run(
    methods or [METHODS[m] for m in DEFAULT_METHODS], seeds, steps, eval_every
  )
  t_start = time.perf_counter()
  info = machine_info()
  schemes._log(
    f"gossip: {len(methods)} methods x {seeds} seeds x {steps} steps on {w.name}, "
    f"{WORKERS} workers ({info['backend']}), {info['cpu_count']} CPUs"
  )
  per_method, priced = _train_all(
    methods, range(seeds), steps, eval_every, Path(out_dir) / "gossip_runs", w
  )
  summaries, accuracy = {}, {}
  for label, rs in per_method.items():
    inputs = priced[label]["inputs"]
    summaries[label] = {
      **summarize(rs, priced[label]["sim"], w),
      "flops_per_step": inputs["flops_per_step"],
      "round_wire": inputs["round_wire"],
      "message_bytes": inputs.get("message_bytes"),
      "overlap": inputs.get("overlap"),
      "topology": inputs.get("topology"),
    }
    accuracy[label] = np.asarray([r["curve"][f"eval_{w.key}"] for r in rs], float)
  threshold = None
  if BASELINE in summaries:
    threshold = w.target(summaries[BASELINE][f"final_{w.key}"]["mean"], TARGET_PP)
    add_time_to_target(summaries, accuracy, threshold, w)
  described = clusters()
  result = {
    "suite": "gossip",
    "machine": info,
    "workload": w.describe(),
    "config": f"{w.config_file} (fusion.plan='single')",
    "workers": WORKERS,
    "steps": steps,
    "eval_every": eval_every,
    "log_every": math.gcd(LOG_EVERY, eval_every),
    "seeds": seeds,
    "global_batch_size": w.config().global_batch_size,
    "gamma": GAMMA,
    "clusters": {name: dataclasses.asdict(c) for name, c in described.items()},
    "target": threshold,
    "target_pp": TARGET_PP,
    "target_tolerance": w.tolerance(TARGET_PP),
    "methods": {m.label: dataclasses.asdict(m) for m in methods},
    "results": {
      label: {"summary": summaries[label], "runs": per_method[label]}
      for label in per_method
    },
    "claims": claim_checks(summaries, w),
    "gradcomp_version": getattr(gradcomp, "__version__", None),
    "wall_s": time.perf_counter() - t_start,
    "loadavg_end": list(os.getloadavg()),
  }
  publish(out_dir, "gossip", result, format_tables(result), plot, docs_png)
  return result


def gamma_sweep(
  gammas: Sequence[float] = SWEEP_GAMMAS,
  codecs: Sequence[str] = ("topk", "ef_signsgd"),
  seed: int = 0,
  steps: int = 600,
  eval_every: int = 100,
  out_dir: str = "bench_out",
) -> dict[str, Any]:
  """CHOCO's gamma per codec on one seed; writes ``gossip_gamma.{json,md,png}``.

  Each codec's best gamma is the one with the lowest mean consensus distance
  over the run's second half (what gamma steers; :data:`GAMMA` holds the
  choice).
  """
  from bench.compress import machine_info

  for g in gammas:
    if not 0 < g <= 1:
      raise ValueError(f"gamma must be in (0, 1], got {g}")
  label = lambda codec, g: f"choco_{codec}_g{g:g}"
  methods = [_choco(label(c, g), c, gamma=g) for c in codecs for g in gammas]
  methods = schemes.check_run(methods, 1, steps, eval_every)
  t_start = time.perf_counter()
  per_method, _ = _train_all(
    methods, [seed], steps, eval_every, Path(out_dir) / "gossip_gamma_runs"
  )
  rows = {c: [] for c in codecs}
  for c in codecs:
    for g in gammas:
      ((r),) = per_method[label(c, g)]
      curve = r["curve"]
      rows[c].append(
        {
          "gamma": g,
          "final_accuracy": curve["eval_accuracy"][-1],
          "final_loss": curve["eval_loss"][-1],
          "worst_worker": curve["worker_accuracy_min"][-1],
          "consensus_distance_end": curve["consensus_distance_end"],
          "consensus_late": _late_mean(r["consensus"]["distance"]),
          "consensus": r["consensus"],
          "stopped": bool(r.get("stopped")),
        }
      )
  best = {
    c: min(
      (r for r in rows[c] if math.isfinite(r["consensus_late"])),
      key=lambda r: r["consensus_late"],
    )["gamma"]
    for c in codecs
  }
  result = {
    "suite": "gossip_gamma",
    "machine": machine_info(),
    "seed": seed,
    "steps": steps,
    "topology": CHOCO_TOPOLOGY,
    "rows": rows,
    "best": best,
    "wall_s": time.perf_counter() - t_start,
  }
  lines = [
    f"CHOCO gamma sweep: digits, {WORKERS} workers, {CHOCO_TOPOLOGY}, seed "
    f"{seed}, {steps} steps; best = lowest mean consensus distance over the "
    "second half",
    "",
    "| codec | gamma | final accuracy (%) | final loss | worst worker (%) "
    "| consensus distance (end) | (mean, second half) |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for c in codecs:
    for r in rows[c]:
      mark = " (best)" if r["gamma"] == best[c] else ""
      mark += " (stopped: non-finite)" if r["stopped"] else ""
      cd = r["consensus_distance_end"]
      lines.append(
        f"| {c} | {r['gamma']:g}{mark} | {100 * r['final_accuracy']:.2f} "
        f"| {r['final_loss']:.4f} | {100 * r['worst_worker']:.2f} "
        f"| {'-' if cd is None else f'{cd:.3g}'} | {r['consensus_late']:.3g} |"
      )
  publish(out_dir, "gossip_gamma", result, "\n".join(lines), _plot_sweep)
  return result


def _late_mean(distance: Sequence[float]) -> float:
  """The mean of the second half of a consensus-distance curve (NaN if empty)."""
  late = np.asarray(distance[len(distance) // 2 :], float)
  return float(late.mean()) if late.size else math.nan


def _plot_sweep(result: Mapping[str, Any], path: str | Path) -> Path:
  """Consensus distance against step, one curve per gamma, one panel per codec."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  codecs = list(result["rows"])
  fig = Figure(figsize=(5 * len(codecs), 4), layout="constrained")
  FigureCanvasAgg(fig)
  for ax, c in zip(np.atleast_1d(fig.subplots(1, len(codecs))), codecs, strict=True):
    for r in result["rows"][c]:
      ax.plot(
        r["consensus"]["step"],
        r["consensus"]["distance"],
        label=f"gamma {r['gamma']:g}: {100 * r['final_accuracy']:.1f} %",
      )
    ax.set(xlabel="step", ylabel="consensus distance", yscale="log", title=c)
    ax.legend(fontsize="small")
  fig.savefig(path, dpi=110)
  return Path(path)


def _pct(stats: Mapping[str, Any] | None) -> str:
  if not stats:
    return "-"
  if stats.get("std") is None or not math.isfinite(stats["std"]):
    return f"{100 * stats['mean']:.2f}"
  return f"{100 * stats['mean']:.2f} ± {100 * stats['std']:.2f}"


def _reached(sim: Mapping[str, Any]) -> str:
  t = sim["target"]
  if t["mean"] is None:
    return "never"
  note = "" if t["reached"] == t["seeds"] else f" ({t['reached']}/{t['seeds']})"
  ratio = "" if sim["ratio"] is None else f" ({sim['ratio']:.2f}x)"
  return schemes._seconds(t["mean"]) + ratio + note


#: A step priced as ResNet-50's (its FLOPs at 32 images per worker and its
#: 25.6M values), for :func:`workload_reading`.
WORKLOAD_MODEL, WORKLOAD_BATCH = "resnet50", 32


def workload_reading(
  result: Mapping[str, Any], bandwidth_gbps: float = 10.0
) -> list[dict[str, Any]]:
  """Time to the target if every step cost a ResNet-50 step (a what-if).

  The MLP's steps are almost free of compute (0.1 us at 8 TFLOP/s), so the
  re-priced digits runs measure latency alone. Here each method's steps to
  the target (mean curve over seeds, from the 8-worker runs) are priced as
  :data:`WORKLOAD_MODEL` steps: FLOPs from ``gradcomp.models.shapes`` at
  :data:`WORKLOAD_BATCH` images per worker on V100s at NVIDIA's published
  ResNet-50 rate (``bench.paper.v100_tflops``), messages of its 25.6M values
  (dense fp32, top-k 1 % as (value, index) pairs, the scaled sign as bits
  plus a float per array), on 16 and 64 workers: all-reduce by
  ``synchronous_step_seconds``, gossip by ``gossip_step_seconds``.
  """
  import gradcomp
  from bench.paper import v100_tflops
  from gradcomp.models import shapes
  from gradcomp.sim.clock import training_flops

  named = shapes.MODELS[WORKLOAD_MODEL]()
  values = sum(int(np.prod(shape)) for _, shape in named)
  flops = training_flops(
    float(sum(shapes.forward_flops(WORKLOAD_MODEL))), WORKLOAD_BATCH
  )
  message = {
    "none": 4 * values,
    "topk": 8 * TOPK_RATIO * values,
    "ef_signsgd": values / 8 + 4 * len(named),
  }
  w = workloads.get(result.get("workload"))
  if result["target"] is None or BASELINE not in result["results"]:
    return []  # No all-reduce run: no target to reach, no reference.
  rows = []
  for n in PRICED_WORKERS:
    cluster = gradcomp.sim.Cluster(
      n, bandwidth_gbps=bandwidth_gbps, flops_per_second=v100_tflops() * 1e12
    )
    for label, entry in result["results"].items():
      s, m = entry["summary"], result["methods"][label]
      acc, steps = np.asarray(s[f"{w.key}_mean"]), np.asarray(s["step"])
      reached = np.flatnonzero(w.reached(acc, result["target"]))
      scheme = m["scheme"]["name"]
      if scheme == "none":
        step = gradcomp.sim.synchronous_step_seconds(
          cluster, flops, 1, {"all-reduce": (4 * values, 1)}
        )
      else:
        topology = m["scheme"].get("topology") or "one_peer_exponential"
        step = gradcomp.sim.gossip_step_seconds(
          cluster,
          flops,
          gradcomp.topology.get(topology, n),
          message[m["compressor"]],
          overlap=scheme == "gossip" and m["compressor"] == "none",
        )
      steps_to = int(steps[reached[0]]) if reached.size else None
      rows.append(
        {
          "workers": n,
          "method": label,
          "step_ms": 1e3 * step,
          "steps_to_target": steps_to,
          "seconds_to_target": None if steps_to is None else steps_to * step,
        }
      )
  for row in rows:
    base = next(
      r for r in rows if r["workers"] == row["workers"] and r["method"] == BASELINE
    )
    row["ratio"] = (
      None
      if row["seconds_to_target"] is None or base["seconds_to_target"] is None
      else row["seconds_to_target"] / base["seconds_to_target"]
    )
  return rows


def format_tables(result: Mapping[str, Any]) -> str:
  """Markdown: metric / consensus / bytes, simulated times, claims."""
  w = workloads.get(result.get("workload"))
  unit = "%" if w.higher_is_better else "bits/byte"
  res = result["results"]
  name = "Digits" if w.name == "digits" and not w.overrides else w.heading()
  lines = [
    f"### {name}, {result['workers']} workers, {result['steps']} steps of "
    f"{result['global_batch_size']}, {result['seeds']} seeds",
    "",
    f"Final {w.metric} ({unit}), mean ± std over seeds (ddof=1), of the average "
    f"model and of the {w.worker_title}; consensus distance mean_w ||x_w - "
    "x_avg||^2 at the last step (mean over seeds); bytes per worker.",
    "",
    "| method | scheme | compressor | topology (spectral gap) | average model "
    f"| {w.worker_title} | consensus distance | bytes/step | message |",
    "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  for label, entry in res.items():
    s, m = entry["summary"], result["methods"][label]
    scheme = ", ".join(
      f"{k}={v}" for k, v in m["scheme"].items() if k not in ("name", "topology")
    )
    scheme = m["scheme"]["name"] + (f" ({scheme})" if scheme else "")
    comp = m["compressor"] + "".join(
      f" {k}={v}" for k, v in m["hyperparameters"].items()
    )
    topo = s["topology"]
    topo = "-" if topo is None else f"{topo['name']} ({topo['spectral_gap']:.3g})"
    cd = s["consensus_distance_end"]
    stopped = f" ({s['stopped']} stopped)" if s["stopped"] else ""
    message = s["message_bytes"]
    lines.append(
      f"| {label} | {scheme} | {comp} | {topo} | {w.fmt_stats(s[f'final_{w.key}'])}"
      f"{stopped} | {w.fmt_stats(s[f'final_{w.worker_key}'])} "
      f"| {'-' if cd is None else f'{cd:.3g}'} | {s['wire_bytes_per_step']:,.0f} "
      f"| {'-' if message is None else f'{message:,.0f}'} |"
    )
  names = list(result["clusters"])
  if result["target"] is not None:
    sign = "-" if w.higher_is_better else "+"
    tolerance = result.get("target_tolerance", result["target_pp"])
    lines += [
      "",
      f"### Simulated time to {w.fmt(result['target'])} {unit} ({BASELINE}'s "
      f"mean final {w.key} {sign} {tolerance:g} {w.unit})",
      "",
      "Re-priced from each run's sim.json on n workers (topology rebuilt for n; "
      f"8 TFLOP/s, 25 us latency); the {w.key} per step is the 8-worker runs'. "
      f"Mean over the seeds reaching it at an eval (every {result['eval_every']} "
      f"steps), (ratio to {BASELINE}'s), (seeds reaching it if not all).",
      "",
      "| method | " + " | ".join(names) + " |",
      "| --- |" + " ---: |" * len(names),
    ]
    for label, entry in res.items():
      sim = entry["summary"]["sim"]
      lines.append(f"| {label} | " + " | ".join(_reached(sim[n]) for n in names) + " |")
  lines += [
    "",
    "### Simulated seconds per step (ratio to " + BASELINE + "'s)",
    "",
    "| method | " + " | ".join(names) + " | program (8 workers, 20 Gbps) |",
    "| --- |" + " ---: |" * (len(names) + 1),
  ]
  for label, entry in res.items():
    s = entry["summary"]
    cells = []
    for n in names + ["program"]:
      sim = s["sim"][n]
      ratio = sim.get("step_ratio")
      cells.append(
        schemes._seconds(sim["end"] / result["steps"])
        + ("" if ratio is None else f" ({ratio:.3g}x)")
      )
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  check = max(e["summary"]["program_clock_max_rel_diff"] for e in res.values())
  lines += [
    "",
    "Check: re-priced on the program's own cluster, every method's clock "
    f"matches its logged sim_seconds to a relative {check:.1e} at most.",
  ]
  lines += ["", "| claim | measured | holds |", "| --- | --- | --- |"]
  for c in result["claims"]:
    if "ratios" in c:
      what = ", ".join(
        f"{n}: {'-' if r is None else f'{r:.3f}x'}" for n, r in c["ratios"].items()
      )
    elif w.difference_key in c:
      what = f"{c[w.difference_key]:+.{3 if w.from_loss else 2}f} {w.unit}"
    else:
      factor = "-" if c["factor"] is None else f"{c['factor']:.3g}x"
      trend = f"shrinks: {c['shrinks']}" if "shrinks" in c else f"grows: {c['grows']}"
      what = f"q2 / choco final distance {factor}; {trend}"
    lines.append(f"| {c['claim']} | {what} | {'yes' if c['holds'] else 'no'} |")
  what_if = workload_reading(result)
  if what_if:
    lines += [
      "",
      f"### What-if: each step a {WORKLOAD_MODEL} step (batch {WORKLOAD_BATCH} per "
      "worker, V100s, 10 Gbps); steps to the target from the 8-worker runs",
      "",
      "| workers | method | step (ms) | steps to target | seconds to target "
      "| vs all-reduce |",
      "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in what_if:
      to = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
      ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
      lines.append(
        f"| {r['workers']} | {r['method']} | {r['step_ms']:.1f} | "
        f"{r['steps_to_target'] or '-'} | {to} | {ratio} |"
      )
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str | Path) -> Path:
  """Metric against step, consensus distance against step, metric against
  simulated seconds on 64 workers at 10 Gbps."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  w = workloads.get(result.get("workload"))
  key = w.key
  res = result["results"]
  fig = Figure(figsize=(16, 4.8), layout="constrained")
  FigureCanvasAgg(fig)
  by_step, consensus, by_time = fig.subplots(1, 3)
  timed = cluster_name(PRICED_WORKERS[-1], BANDWIDTHS_GBPS[-1])
  lows = [
    v
    for e in res.values()
    for v in e["summary"][f"{key}_min"]
    if math.isfinite(v) and v >= schemes.FLOOR
  ]
  bottom = math.floor(100 * min(lows, default=schemes.FLOOR)) / 100 - 0.01
  for label, entry in res.items():
    s = entry["summary"]
    x_time = s["sim"][timed]["seconds"]
    color = None
    for ax, x in ((by_step, s["step"]), (by_time, x_time)):
      (line,) = ax.plot(x, s[f"{key}_mean"], marker=".", label=label, color=color)
      color = line.get_color()
      ax.fill_between(x, s[f"{key}_min"], s[f"{key}_max"], color=color, alpha=0.12)
    c = s["consensus"]
    if c is not None:
      consensus.plot(c["step"], c["mean"], label=label, color=color)
      consensus.fill_between(c["step"], c["min"], c["max"], color=color, alpha=0.12)
  if result["target"] is not None:
    for ax in (by_step, by_time):
      ax.axhline(result["target"], color="grey", ls=":", lw=0.8)
  by_step.set(xlabel="step", ylabel=f"{w.axis_label} (average model)")
  by_time.set(
    xlabel=f"simulated seconds, {PRICED_WORKERS[-1]} workers, "
    f"{BANDWIDTHS_GBPS[-1]:g} Gbps (8-worker curves)",
    xscale="log",
  )
  if w.higher_is_better:  # Accuracy up to 1; a loss metric autoscales.
    for ax in (by_step, by_time):
      ax.set_ylim(max(bottom, 0.0), 1.0)
  consensus.set(
    xlabel="step", ylabel="consensus distance mean_w ||x_w - x_avg||^2", yscale="log"
  )
  for ax in (by_step, consensus, by_time):
    ax.grid(alpha=0.3, which="both")
  by_step.legend(
    loc="lower right" if w.higher_is_better else "upper right", fontsize="small"
  )
  fig.suptitle(
    f"{w.title}, {result['workers']} workers, {result['steps']} steps: mean of "
    f"{result['seeds']} seeds, band min-max; dotted: the target"
  )
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  return path
