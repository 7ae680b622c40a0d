"""Training schemes: accuracy, bytes and simulated time (issue 12, DESIGN §5-6).

Every run is the real training program, ``train.train.train_and_evaluate``, on
``configs/default.py`` (MLP on scikit-learn digits, 8 workers, 600 steps of
128, inner optimizer SGD lr 0.1 momentum 0.9) with ``config.scheme`` and
``config.compressor`` set per method of :data:`METHODS`, and
``config.fusion.plan="single"`` for all (no profiling). Each method runs for
``seeds`` seeds (``config.seed``: init and data order), seed-major (every
method once, then the next seed), evaluated every ``eval_every`` steps.

**Methods.**

* ``sync``: synchronous data parallelism, the dense fp32 all-reduce every step;
* ``local_sgd_{2,8,32}``: local SGD (periodic model averaging) every 2, 8 or
  32 steps, the dense mean of the params (outer SGD at lr 1, no momentum);
* ``diloco``: DiLoCo (Douillard et al. 2023, Alg. 1) every
  :data:`DILOCO_EVERY` = 8 steps, the dense mean pseudo-gradient fed to outer
  Nesterov SGD at lr 0.7, momentum 0.9 (the paper's outer optimizer). H = 8,
  not the paper's 500: a 600-step run then has 75 outer steps, and ``diloco``
  differs from ``local_sgd_8`` in the outer optimizer alone;
* ``diloco_topk1`` and ``diloco_signsgd``: the same, with the pseudo-gradients
  through top-k (1 %, error feedback) or signSGD (majority vote in
  {-1, 0, 1}, as the compressor defines it: no scale). Same outer optimizer,
  not tuned per compressor;
* ``easgd``: synchronous EASGD (Zhang, Choromanska and LeCun 2015, eqs. 5-6)
  with ``beta = n alpha = 0.9`` (their §3 choice), ``alpha = 0.9 / 8``, and
  ``every = 1`` (their basic synchronous form: one dense all-reduce of the
  params per step, the wire of ``sync``).

``diloco_ef_signsgd`` (the scaled sign of EF-signSGD) can be chosen with
``--methods``; it is not in the default set.

**Accuracy.** The eval rows of ``metrics.jsonl``: ``eval_accuracy`` is the
*average* model's (the mean of the workers' params; for ``sync`` the one
replicated model), ``eval_worker_accuracy_min`` the worst worker's own model
(for ``sync`` every worker holds the replicated model, so both are
``eval_accuracy``). Final accuracy: the last eval (at the last step), mean ±
std over seeds (ddof=1). Note that the last step is a round for every method
at 600 steps but ``local_sgd_32`` (600 = 18 x 32 + 24): its average model is
then the mean of workers 24 steps into a round, never sent.

**Bytes per step** is the run's logged ``wire_bytes_per_step``: the operand
bytes per worker of the collectives in the compiled step (DESIGN §4),
amortised over the rounds (``train.pricing.amortised_bytes``): the round's
bytes times rounds / steps, plus what every step sends besides: 16 bytes for
``sync`` (three logged metric means and the non-finite agreement), 20 for a
scheme (one more metric). **Bytes per round** are the round's collectives
alone, read by the training program from the compiled HLO of the round's
exchange and saved in the run's ``sim.json`` with its FLOPs per step: a
dense all-reduce of the 9,610 fp32 params (38,440 bytes) for local SGD,
DiLoCo and EASGD; an all-gather of the top-k values and indices, or of the
packed sign bits, for the compressed DiLoCo. For ``sync`` the round is the
whole step.

**Simulated time** (DESIGN §6). Each run is priced after the fact with
:func:`gradcomp.sim.simulate_rounds` on described clusters, the function the
training program prices its own ``sim_seconds`` with (kept in the JSON as
``program``: its ``config.cluster``, 8 homogeneous workers at 20 Gbps, 8
TFLOP/s), from the run's ``sim.json``: one worker's FLOPs per step ``F =
gradcomp.sim.training_flops(forward_flops_per_sample(model, f32[1, 64]), 128 /
8)`` (3 x forward x batch) and the round's wire; ``is_round =
train.optimizer.round_steps(config)``; a round waits for the slowest worker
and adds ``cluster.comm_seconds({kind: (bytes, 1)})``. The per-step bookkeeping collectives of a scheme (16-20 bytes) are not
priced between rounds, as in the training program: they are instrumentation
and a safety check, not the algorithm's exchange. Clusters:

* **(a)** ``Cluster(16, bandwidth_gbps=20)``: 16 homogeneous workers at
  8 TFLOP/s on a 20 Gbps ring, 25 us latency. The runs have 8 workers; (a)
  prices the same steps with 16 workers *keeping the per-worker batch* of 16
  (so F is unchanged; a 16-worker run would have a global batch of 256) and
  the same per-worker payload (an all-reduce's operand is the whole buffer and
  an all-gather's the worker's own piece, whatever the worker count); only the
  ring's ``2 (n - 1)`` or ``n - 1`` steps grow. The accuracy curve is the
  8-worker run's: an approximation;
* **(b)** ``Cluster(8, bandwidth_gbps=0.1, speeds=(1, 1, 2, 2, 3, 3, 5, 5),
  flops_per_second=EDGE_FLOPS_PER_SECOND)``: 8 heterogeneous edge devices at
  100 Mbps (25 us latency, the default). :data:`EDGE_FLOPS_PER_SECOND` = 1e10
  FLOP/s for a speed-1 device is an **assumption** (about a phone or
  single-board-computer CPU's sustained fp32 training rate, not a measured
  one). Same workers and batches as the runs, so the curves are exact; the
  slowest device (speed 1) sets every barrier.

On both the exchange dominates: one worker's step is about 0.92 MFLOP, 0.11
us on (a) and 92 us on the slowest device of (b), against a dense all-reduce
of 0.75 ms latency + 0.03 ms transfer on (a) and 0.35 ms + 5.4 ms on (b).
Time to an accuracy: per seed, the first eval at which the average model
reaches it (so at eval granularity), mean over the seeds that reach it.

The digits test set has 360 images: one image is 0.28 points, so the
0.5-point target is under two images, and seeds of different methods often
end on the same accuracy (with different losses).

**Targets** (printed PASS/FAIL): ``local_sgd_8``'s mean final accuracy at
most :data:`LOCAL_SGD_PP` points below ``sync``'s; ``diloco_topk1``'s at most
:data:`DILOCO_PP` point below ``diloco``'s, with at most 1 /
:data:`BYTES_FACTOR` of its bytes per step. The bytes rule is checked on the
logged bytes per step (every-step bookkeeping included); the ratio of the
rounds' bytes alone is printed beside it.

**Workloads** (``--workload``, :mod:`bench.workloads`): the above is
``digits``, the default. ``--workload gpt_tiny`` runs the same methods, with
the same scheme and compressor fields, on ``configs/gpt_tiny.py`` (AdamW is
then the inner optimizer of every scheme; no field of this suite is SGD's,
so none is adapted) and reports the final validation bits per byte (lower is
better) of the average model and, in place of the worst worker's accuracy,
the workers' mean bits per byte (the program logs no worst loss). The
targets become: ``local_sgd_8``'s and ``diloco_topk1``'s mean final bpb at
most ``workloads.BPB_MARGIN`` = 0.1 bits per byte above ``sync``'s and
``diloco``'s (``difference_bpb``: the reference's bpb minus theirs), the
bytes rule unchanged; the times to 95 and 97 % accuracy are not applicable
(not tabulated). The clusters, their FLOPs from the run's ``sim.json``, and
cluster (b)'s assumed edge devices are the same; on gpt_tiny the compute of a
step is no longer negligible.

Run: ``python -m bench schemes [--seeds 3] [--steps 600]
[--workload gpt_tiny]``. Writes
``schemes.json``, ``schemes.md`` and ``schemes.png`` (accuracy against step,
simulated seconds on (a), simulated seconds on (b): mean over seeds, band
min-max) to ``--out``, and each run's workdir (``metrics.jsonl``,
``config.json``, ``plan.json``; checkpoints deleted) under
``--out/schemes_runs/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import convergence
from bench.convergence import _stats, run_one
from bench.output import publish
from bench.workloads import DIGITS, Workload

#: Workers of every run (virtual devices).
WORKERS = 8
#: DiLoCo's inner steps per round (H).
DILOCO_EVERY = 8
#: DiLoCo's outer Nesterov SGD (Douillard et al. 2023).
OUTER = {"outer_learning_rate": 0.7, "outer_momentum": 0.9}
#: EASGD's ``beta = n alpha`` (Zhang et al. 2015, §3).
EASGD_BETA = 0.9
#: Training FLOP/s of a speed-1 device of cluster (b): an assumption.
EDGE_FLOPS_PER_SECOND = 1e10
EDGE_SPEEDS = (1, 1, 2, 2, 3, 3, 5, 5)
#: Accuracies whose simulated time to reach is tabulated.
REACH = (0.95, 0.97)
#: The plot's y axis starts below the lowest band at or above this accuracy.
FLOOR = 0.8
#: local_sgd_8 may be at most this far below sync (percentage points).
LOCAL_SGD_PP = 0.5
#: diloco_topk1 may be at most this far below diloco (percentage points) ...
DILOCO_PP = 1.0
#: ... with at most 1 / BYTES_FACTOR of its bytes per step.
BYTES_FACTOR = 50


@dataclasses.dataclass(frozen=True)
class Method:
  """One curve: a scheme and the compressor of its exchange.

  Attributes:
    label: name in tables, plots and ``--methods``.
    scheme: ``config.scheme`` fields (``name`` first).
    compressor: ``config.compressor.name``.
    hyperparameters: other ``config.compressor`` fields.
    why: one line on the choice, copied to the JSON.
  """

  label: str
  scheme: Mapping[str, Any]
  compressor: str = "none"
  hyperparameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  why: str = ""


def _local(every: int) -> Method:
  return Method(
    f"local_sgd_{every}",
    {"name": "local_sgd", "every": every},
    why=f"params averaged every {every} steps (dense mean)",
  )


_DILOCO = {"name": "local_sgd", "every": DILOCO_EVERY, **OUTER}
METHODS: dict[str, Method] = {
  m.label: m
  for m in (
    Method("sync", {"name": "none"}, why="dense fp32 all-reduce every step"),
    _local(2),
    _local(8),
    _local(32),
    Method("diloco", _DILOCO, why="dense mean pseudo-gradient, outer Nesterov"),
    Method(
      "diloco_topk1",
      _DILOCO,
      "topk",
      {"ratio": 0.01},
      why="pseudo-gradient top-k 1 % with error feedback",
    ),
    Method(
      "diloco_signsgd",
      _DILOCO,
      "signsgd",
      why="pseudo-gradient majority-vote sign in {-1,0,1} (unscaled)",
    ),
    Method(
      "easgd",
      {"name": "easgd", "alpha": EASGD_BETA / WORKERS, "every": 1},
      why="elastic averaging, beta = 0.9, every step",
    ),
    Method(
      "diloco_ef_signsgd",
      _DILOCO,
      "ef_signsgd",
      why="pseudo-gradient scaled sign (||e||_1 / d) with error feedback; "
      "not in the default set",
    ),
  )
}
DEFAULT_METHODS = tuple(m for m in METHODS if m != "diloco_ef_signsgd")


def clusters() -> dict[str, Any]:
  """The described clusters (a) and (b) of the module docstring."""
  import gradcomp

  return {
    "a": gradcomp.sim.Cluster(16, bandwidth_gbps=20.0),
    "b": gradcomp.sim.Cluster(
      WORKERS,
      bandwidth_gbps=0.1,
      speeds=EDGE_SPEEDS,
      flops_per_second=EDGE_FLOPS_PER_SECOND,
    ),
  }


CLUSTER_NOTES = {
  "a": "16 homogeneous workers, 20 Gbps, 8 TFLOP/s; per-worker batch of the "
  "8-worker runs kept ({per_worker})",
  "b": "8 edge devices, speeds (1,1,2,2,3,3,5,5) x 1e10 FLOP/s (assumed), 100 Mbps",
  "program": "the training program's own sim_seconds: config.cluster, 8 "
  "homogeneous workers, 20 Gbps, 8 TFLOP/s",
}


def configure(
  method: Method,
  *,
  seed: int,
  steps: int,
  eval_every: int,
  workload: Workload = DIGITS,
):
  """``workload``'s config with ``method``'s scheme and compressor, plan ``single``.

  The rest as the convergence suite's runs (``convergence.configure``): logs
  at every eval, checkpoints only at the end.
  """
  from configs import default

  base = convergence.Method(
    method.label, method.compressor, "single", dict(method.hyperparameters)
  )
  config = convergence.configure(
    workload.config, base, seed=seed, steps=steps, eval_every=eval_every
  )
  config.scheme = default.scheme(**method.scheme)
  return config


def priced_inputs(workdir: str | Path) -> dict[str, Any]:
  """The run's ``sim.json``: its FLOPs per worker-step and one round's wire.

  What the training program's own clock priced (``train.train.SIM_FILE``):
  the FLOPs from the model's jaxpr, and ``{kind: bytes}`` of one exchange
  round read from the compiled HLO (the whole step for synchronous training).
  """
  from train import train

  return json.loads((Path(workdir) / train.SIM_FILE).read_text())


def _train(config, workdir: Path) -> dict[str, Any]:
  """``run_one``, or, when the run stops on non-finite steps, what it logged."""
  from train import logs, train

  start = time.perf_counter()
  try:
    r = run_one(config, workdir)
  except train.NonFiniteError as e:
    shutil.rmtree(workdir / train.CHECKPOINT_DIR, ignore_errors=True)
    rows = logs.read_metrics(workdir / logs.METRICS_FILE)
    wire = [r["wire_bytes_per_step"] for r in rows if "wire_bytes_per_step" in r]
    r = {
      "workdir": str(workdir),
      "rows": rows,
      "final": {},
      "run_seconds": time.perf_counter() - start,
      "wire_bytes_per_step": wire[-1] if wire else None,
      "stopped": str(e),
    }
  return r


def _curve(
  rows: Sequence[Mapping[str, Any]],
  eval_steps: Sequence[int],
  workload: Workload = DIGITS,
) -> dict:
  """One run's eval points at ``eval_steps`` (NaN where it stopped before).

  ``eval_{key}`` is the workload's metric of the average model,
  ``worker_{key}_{stat}`` its workers' own (``Workload.worker_values``).
  """
  w = workload
  evals = {r["step"]: r for r in rows if "eval_loss" in r}
  nan = math.nan
  workers = [w.worker_values(evals[s]) if s in evals else {} for s in eval_steps]

  def column(key):
    out = []
    for s in eval_steps:
      value = evals.get(s, {}).get(key, nan)
      out.append(nan if value is None else float(value))
    return out

  distance = [r["consensus_distance"] for r in rows if "consensus_distance" in r]
  sim_at = {
    r["step"]: r["sim_seconds"] for r in rows if r.get("sim_seconds") is not None
  }
  return {
    "step": list(eval_steps),
    f"eval_{w.key}": [w.value(evals.get(s, {})) for s in eval_steps],
    "eval_loss": column("eval_loss"),
    # Synchronous: one replicated model, every worker's is the average's.
    **{
      f"worker_{w.key}_{stat}": [v.get(f"worker_{w.key}_{stat}", nan) for v in workers]
      for stat in w.worker_columns
    },
    # An eval row carries sim_seconds only where no training row of its step
    # does (train/train.py), so it is read from any row of the step.
    "program_sim_seconds": [float(sim_at.get(s, nan)) for s in eval_steps],
    # A diverged run logs a non-finite distance as null: NaN here.
    "consensus_distance_end": (nan if distance[-1] is None else float(distance[-1]))
    if distance
    else None,
  }


def _reach(
  accuracy: np.ndarray,
  seconds: np.ndarray,
  threshold: float,
  workload: Workload = DIGITS,
):
  """Per seed, seconds at the first eval reaching ``threshold``; stats over those.

  ``accuracy``: the workload's metric, shape ``(seeds, evals)``; reaching is
  at or above the threshold for accuracy, at or below for bits per byte.
  """
  hits = [
    float(seconds[np.flatnonzero(workload.reached(a, threshold))[0]])
    for a in accuracy
    if workload.reached(a, threshold).any()
  ]
  if not hits:
    return {"reached": 0, "seeds": len(accuracy), "mean": None}
  return {"reached": len(hits), "seeds": len(accuracy), **_stats(hits)}


def summarize(
  runs: Sequence[Mapping[str, Any]],
  sim: Mapping[str, np.ndarray],
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """Over seeds: final metrics, curves, and the simulated times of each cluster.

  Keys name the workload's metric (``final_accuracy``, ``accuracy_mean`` on
  digits; ``final_bpb``, ``bpb_mean`` on gpt_tiny); the times to the
  :data:`REACH` accuracies only where the workload has absolute levels.
  """
  w, key = workload, workload.key
  curves = [r["curve"] for r in runs]
  steps = curves[0]["step"]
  acc = np.asarray([c[f"eval_{key}"] for c in curves])
  shown = np.asarray([c[w.worker_key] for c in curves])
  wires = {r["wire_bytes_per_step"] for r in runs}
  if len(wires) != 1:
    raise ValueError(f"seeds of one method logged different bytes per step: {wires}")
  distances = [c["consensus_distance_end"] for c in curves]
  out = {
    "step": steps,
    f"{key}_mean": acc.mean(0).tolist(),
    f"{key}_min": acc.min(0).tolist(),
    f"{key}_max": acc.max(0).tolist(),
    f"{w.worker_key}_mean": shown.mean(0).tolist(),
    f"final_{key}": _stats(acc[:, -1]),
    **{
      f"final_worker_{key}_{stat}": _stats(
        [c[f"worker_{key}_{stat}"][-1] for c in curves]
      )
      for stat in w.worker_columns
    },
    "final_loss": _stats([c["eval_loss"][-1] for c in curves]),
    "consensus_distance_end": None if None in distances else _stats(distances)["mean"],
    "wire_bytes_per_step": wires.pop(),
    "stopped": sum(bool(r.get("stopped")) for r in runs),
    "run_seconds": _stats([r["run_seconds"] for r in runs]),
    "sim": {},
  }
  levels = REACH if w.absolute_levels else ()
  for name, seconds in sim.items():
    at = seconds[steps]
    out["sim"][name] = {
      "seconds": at.tolist(),
      "end": float(seconds[-1]),
      "reach": {str(t): _reach(acc, at, t, w) for t in levels},
    }
  logged = np.asarray([c["program_sim_seconds"] for c in curves])
  # The post-hoc clock of the program's cluster against the run's own column.
  out["program_clock_max_rel_diff"] = float(
    np.nanmax(np.abs(logged - sim["program"][steps]) / sim["program"][steps])
  )
  return out


def _rule(w: Workload, method: str, reference: str, points: float) -> str:
  worse = "below" if w.higher_is_better else "above"
  return (
    f"{method} mean final {w.metric} at most {w.tolerance(points):g} {w.unit} "
    f"{worse} {reference}'s"
  )


def target_checks(
  summaries: Mapping[str, Mapping[str, Any]], workload: Workload = DIGITS
) -> list[dict[str, Any]]:
  """The two targets, where their methods ran.

  A difference (``difference_pp`` on digits, ``difference_bpb`` on gpt_tiny)
  is how much better the method ends than its reference
  (``Workload.advantage``); it passes at ``-Workload.tolerance`` or above.
  """
  w, final = workload, f"final_{workload.key}"
  checks = []
  if {"sync", "local_sgd_8"} <= set(summaries):
    base = summaries["sync"][final]["mean"]
    local = summaries["local_sgd_8"][final]["mean"]
    checks.append(
      {
        "rule": _rule(w, "local_sgd_8", "sync", LOCAL_SGD_PP),
        "sync": base,
        "local_sgd_8": local,
        w.difference_key: w.advantage(local, base),
        "passed": w.within(local, base, LOCAL_SGD_PP),
      }
    )
  if {"diloco", "diloco_topk1"} <= set(summaries):
    dense, topk = summaries["diloco"], summaries["diloco_topk1"]
    diff = w.advantage(topk[final]["mean"], dense[final]["mean"])
    accuracy_passed = w.within(topk[final]["mean"], dense[final]["mean"], DILOCO_PP)
    ratio = dense["wire_bytes_per_step"] / topk["wire_bytes_per_step"]
    dense_round = sum(dense["round_wire"].values())
    round_ratio = dense_round / sum(topk["round_wire"].values())
    checks.append(
      {
        "rule": _rule(w, "diloco_topk1", "diloco", DILOCO_PP)
        + f" and bytes/step <= diloco's / {BYTES_FACTOR}",
        "diloco": dense[final]["mean"],
        "diloco_topk1": topk[final]["mean"],
        w.difference_key: diff,
        "bytes_ratio": ratio,
        "round_bytes_ratio": round_ratio,
        "accuracy_passed": accuracy_passed,
        "bytes_passed": bool(ratio >= BYTES_FACTOR),
        "round_bytes_passed": bool(round_ratio >= BYTES_FACTOR),
        "passed": bool(accuracy_passed and ratio >= BYTES_FACTOR),
      }
    )
  return checks


def check_run(methods, seeds: int, steps: int, eval_every: int) -> list:
  """``methods`` as a list, after checking a seeded suite's run shape.

  Shared by the suites of seeded training runs (schemes, cdsgd, gossip).

  Raises:
    ValueError: for no methods, ``seeds``, ``steps`` or ``eval_every`` below
      1, or a device count other than :data:`WORKERS`.
  """
  import jax

  methods = list(methods)
  if not methods:
    raise ValueError("no methods")
  for name, value in (("seeds", seeds), ("steps", steps), ("eval_every", eval_every)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  if jax.device_count() != WORKERS:
    raise ValueError(
      f"the suite runs {WORKERS} workers, found {jax.device_count()} devices; set "
      f'jax.config.update("jax_num_cpu_devices", {WORKERS}) before using JAX'
    )
  return methods


def _log(text: str) -> None:
  print(f"# schemes: {text}", file=sys.stderr, flush=True)


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 3,
  steps: int = 600,
  eval_every: int = 100,
  out_dir: str = "bench_out",
  docs_png: str | Path | None = None,
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """Runs the suite, prints its tables, writes ``schemes.{json,md,png}``.

  Args:
    methods: the curves (default: :data:`DEFAULT_METHODS`).
    seeds: runs per method, seeds ``0 .. seeds - 1``.
    steps: training steps of each run.
    eval_every: eval (and log) interval, in steps; the last step is always
      evaluated.
    out_dir: where the outputs and the runs' workdirs go.
    docs_png: also copy ``schemes.png`` there, if given.
    workload: the base config and metric (``bench.workloads``).
  """
  import gradcomp
  from bench.compress import machine_info
  from train import optimizer, pricing

  if methods is None:
    methods = [METHODS[m] for m in DEFAULT_METHODS]
  methods = check_run(methods, seeds, steps, eval_every)
  w = workload
  runs_dir = Path(out_dir) / "schemes_runs"
  eval_steps = sorted({*range(eval_every, steps + 1, eval_every), steps})
  t_start = time.perf_counter()
  info = machine_info()
  _log(
    f"{len(methods)} methods x {seeds} seeds x {steps} steps on {w.name}, "
    f"{WORKERS} workers ({info['backend']}), {info['cpu_count']} CPUs"
  )
  described = clusters()
  batch = w.config().global_batch_size
  per_method: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
  priced: dict[str, dict[str, Any]] = {}
  for seed in range(seeds):
    for m in methods:
      config = configure(m, seed=seed, steps=steps, eval_every=eval_every, workload=w)
      workdir = runs_dir / m.label / f"seed{seed}"
      r = _train(config, workdir)
      r["seed"] = seed
      r["curve"] = _curve(r["rows"], eval_steps, w)
      r["curve"]["train_seconds"] = convergence.eval_curve(
        r["rows"], config.global_batch_size
      )["train_seconds"]
      del r["rows"]
      per_method[m.label].append(r)
      if m.label not in priced:  # The same for every seed.
        inputs = priced_inputs(workdir)
        flops, wire = inputs["flops_per_step"], inputs["round_wire"]
        is_round = optimizer.round_steps(config)
        every = {**described, "program": pricing.cluster_of(config, WORKERS)}
        priced[m.label] = {
          "flops_per_step": flops,
          "round_wire": wire,
          "rounds": sum(bool(is_round(s)) for s in range(1, steps + 1)),
          "sim": {
            name: gradcomp.sim.simulate_rounds(c, flops, is_round, wire, steps)
            for name, c in every.items()
          },
        }
      stop = f" (stopped: {r['stopped'][:60]}...)" if r.get("stopped") else ""
      _log(
        f"{m.label} seed {seed}: {w.key} {r['curve'][f'eval_{w.key}'][-1]:.4f}, "
        f"{r['wire_bytes_per_step']:,.0f} B/step, {r['run_seconds']:.1f} s{stop}"
      )
  summaries = {}
  for label, rs in per_method.items():
    p = priced[label]
    summaries[label] = {
      **summarize(rs, p["sim"], w),
      "round_wire": p["round_wire"],
      "rounds": p["rounds"],
      "flops_per_step": p["flops_per_step"],
    }
  result = {
    "suite": "schemes",
    "machine": info,
    "workload": w.describe(),
    "config": f"{w.config_file} (fusion.plan='single')",
    "workers": WORKERS,
    "steps": steps,
    "eval_every": eval_every,
    "seeds": seeds,
    "global_batch_size": batch,
    "clusters": {
      name: {
        **dataclasses.asdict(c),
        "note": CLUSTER_NOTES[name].format(per_worker=batch // WORKERS),
      }
      for name, c in described.items()
    }
    | {"program": {"note": CLUSTER_NOTES["program"]}},
    "reach": list(REACH) if w.absolute_levels else [],
    "methods": {m.label: dataclasses.asdict(m) for m in methods},
    "results": {
      label: {"summary": summaries[label], "runs": per_method[label]}
      for label in per_method
    },
    "targets": target_checks(summaries, w),
    "gradcomp_version": getattr(gradcomp, "__version__", None),
    "wall_s": time.perf_counter() - t_start,
    "loadavg_end": list(os.getloadavg()),
  }
  publish(out_dir, "schemes", result, format_tables(result), plot, docs_png)
  return result


def _pct(stats: Mapping[str, Any]) -> str:
  std = "" if stats["std"] is None else f" ± {100 * stats['std']:.2f}"
  return f"{100 * stats['mean']:.2f}{std}"


def _seconds(x: float | None) -> str:
  if x is None or not math.isfinite(x):
    return "-"
  return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _wire(wire: Mapping[str, int]) -> str:
  return ", ".join(f"{k} {v:,}" for k, v in wire.items()) or "-"


def format_tables(result: Mapping[str, Any]) -> str:
  """Markdown tables of a :func:`run` result."""
  from bench import workloads

  w = workloads.get(result.get("workload"))
  res, mi = result["results"], result["machine"]
  unit = "%" if w.higher_is_better else "bits/byte"
  head = (
    f"{w.heading()}, {result['workers']} workers ({mi['backend']}), "
    f"{result['steps']} steps of {result['global_batch_size']}, "
    f"{result['seeds']} seeds, plan single; final {w.metric} mean ± std "
    f"over seeds (ddof=1), of the average model and of the {w.worker_title}; "
    f"bytes per worker"
  )
  lines = [
    head,
    "",
    f"| method | scheme | compressor | final {w.key} (average, {unit}) "
    f"| {w.worker_title} | bytes/step | bytes/round | rounds "
    "| consensus distance (end) |",
    "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for label, entry in res.items():
    s, m = entry["summary"], result["methods"][label]
    scheme = ", ".join(
      f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
      for k, v in m["scheme"].items()
      if k != "name"
    )
    scheme = m["scheme"]["name"] + (f" ({scheme})" if scheme else "")
    comp = m["compressor"] + "".join(
      f" {k}={v}" for k, v in m["hyperparameters"].items()
    )
    cd = s["consensus_distance_end"]
    stopped = f" ({s['stopped']} stopped)" if s["stopped"] else ""
    lines.append(
      f"| {label} | {scheme} | {comp} | {w.fmt_stats(s[f'final_{w.key}'])}{stopped} "
      f"| {w.fmt_stats(s[f'final_{w.worker_key}'])} "
      f"| {s['wire_bytes_per_step']:,.0f} | {_wire(s['round_wire'])} "
      f"| {s['rounds']} | {'-' if cd is None else f'{cd:.3g}'} |"
    )
  cl = result["clusters"]
  reach = result["reach"]
  lines += [
    "",
    f"simulated time (SimClock; FLOPs per worker-step "
    f"{next(iter(res.values()))['summary']['flops_per_step']:,.0f}): "
    f"(a) {cl['a']['note']}; (b) {cl['b']['note']}; program: "
    f"{cl['program']['note']}. "
    + (
      f"'to X %': mean over the seeds whose average model reaches X at an "
      f"eval (every {result['eval_every']} steps), with their count if not all"
      if reach
      else "Times to a fixed accuracy: not applicable to bits per byte"
    ),
    "",
    "| method | (a) end | "
    + "".join(f"(a) to {100 * t:g} % | " for t in reach)
    + "(b) end | "
    + "".join(f"(b) to {100 * t:g} % | " for t in reach)
    + "program end |",
    "| --- |" + " ---: |" * (3 + 2 * len(reach)),
  ]
  for label, entry in res.items():
    sim = entry["summary"]["sim"]
    cells = [label]
    for name in ("a", "b"):
      cells.append(_seconds(sim[name]["end"]))
      for t in reach:
        r = sim[name]["reach"][str(t)]
        note = "" if r["reached"] == r["seeds"] else f" ({r['reached']}/{r['seeds']})"
        cells.append(_seconds(r["mean"]) + note)
    cells.append(_seconds(sim["program"]["end"]))
    lines.append("| " + " | ".join(cells) + " |")
  digits = 3 if w.from_loss else 2
  for t in result["targets"]:
    lines.append("")
    diff = f"{t[w.difference_key]:+.{digits}f} {w.unit}"
    if "local_sgd_8" in t:
      lines.append(
        f"target: local_sgd_8 {w.fmt(t['local_sgd_8'])} vs sync "
        f"{w.fmt(t['sync'])} {unit}: {diff} better (tolerance "
        f"-{w.tolerance(LOCAL_SGD_PP):g} {w.unit}): "
        f"{'PASS' if t['passed'] else 'FAIL'}"
      )
    else:
      lines.append(
        f"target: diloco_topk1 {w.fmt(t['diloco_topk1'])} vs diloco "
        f"{w.fmt(t['diloco'])} {unit}: {diff} better (tolerance "
        f"-{w.tolerance(DILOCO_PP):g} {w.unit}): "
        f"{'PASS' if t['accuracy_passed'] else 'FAIL'}; bytes "
        f"per step 1/{t['bytes_ratio']:.1f} of diloco's (need <= 1/{BYTES_FACTOR}): "
        f"{'PASS' if t['bytes_passed'] else 'FAIL'} (rounds' bytes alone: "
        f"1/{t['round_bytes_ratio']:.2f}, "
        f"{'PASS' if t['round_bytes_passed'] else 'FAIL'}); overall "
        f"{'PASS' if t['passed'] else 'FAIL'}"
      )
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str | Path) -> Path:
  """Average-model metric against step and simulated time on (a) and (b)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  from bench import workloads

  w = workloads.get(result.get("workload"))
  key = w.key
  res = result["results"]
  fig = Figure(figsize=(15, 4.6), layout="constrained")
  FigureCanvasAgg(fig)
  by_step, on_a, on_b = fig.subplots(1, 3, sharey=True)
  # The y range of the methods that learn (band minimum >= FLOOR); a curve
  # that falls below it is marked in the legend rather than squashing the rest.
  lows = [
    v
    for e in res.values()
    for v in e["summary"][f"{key}_min"]
    if math.isfinite(v) and v >= FLOOR
  ]
  bottom = math.floor(100 * min(lows, default=FLOOR)) / 100 - 0.01
  for label, entry in res.items():
    s = entry["summary"]
    # Accuracy: a curve below the axis is marked (a loss metric autoscales).
    below = w.higher_is_better and any(not (v >= bottom) for v in s[f"{key}_mean"])
    xs = (s["step"], s["sim"]["a"]["seconds"], s["sim"]["b"]["seconds"])
    for ax, x in zip((by_step, on_a, on_b), xs, strict=True):
      (line,) = ax.plot(
        x,
        s[f"{key}_mean"],
        marker=".",
        label=label + (" (below the axis)" if below else ""),
      )
      ax.fill_between(
        x, s[f"{key}_min"], s[f"{key}_max"], color=line.get_color(), alpha=0.15
      )
  by_step.set(xlabel="step", ylabel=f"{w.axis_label} (average model)")
  on_a.set(xlabel="simulated seconds, (a) 16 workers, 20 Gbps", xscale="log")
  on_b.set(xlabel="simulated seconds, (b) 8 edge devices, 100 Mbps", xscale="log")
  if w.higher_is_better:
    by_step.set_ylim(max(bottom, 0.0), 1.0)
  for ax in (by_step, on_a, on_b):
    ax.grid(alpha=0.3, which="both")
  by_step.legend(
    loc="lower right" if w.higher_is_better else "upper right", fontsize="small"
  )
  fig.suptitle(
    f"{w.title}, {result['workers']} workers, {result['steps']} steps: mean of "
    f"{result['seeds']} seeds, band min-max"
  )
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  return path
