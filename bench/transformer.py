"""The transformer workload: bits per byte, bytes and simulated time per method.

``python -m bench transformer [--methods dense,topk] [--seeds 3]
[--steps 600] [--eval-every 100] [--target-bpb X] [--out bench_out/]``

Every run is the real training program, ``train.train.train_and_evaluate``,
on ``configs/gpt_tiny.py`` (a 2-layer, 128-wide GPT on bytes of the Python
standard library's source, context 128, 8 virtual CPU devices with 8 windows
each, AdamW lr 3e-3 with 50 warm-up steps and cosine decay, clipping at 1.0)
with ``config.scheme``, ``config.compressor`` and ``config.fusion.plan`` set
per method of :data:`METHODS`. Each method runs for ``seeds`` seeds
(``config.seed``: init and data order), seed-major, evaluated (and logged)
every ``eval_every`` steps and at the last.

**Methods** (the AdamW of the config is the optimizer of every worker; no
hyper-parameter is tuned per method):

* ``dense``: synchronous data parallelism, the fp32 all-reduce every step;
* ``topk``: top-k 1 % with error feedback over one fused buffer
  (``fusion.plan="single"``: a global top-k, one all-gather per step);
* ``powersgd``: rank 4 per 2-D leaf, 1-D leaves dense (:data:`POWERSGD`),
  plan ``single`` (LayerFusion's per-leaf form: each leaf its own factors,
  as published, in one exchange); ``ef_signsgd``: the scaled sign with error
  feedback, its scale per leaf (the per-leaf form); ``qsgd``: its default
  levels, buckets per leaf; all three plan ``single``;
* ``diloco``: DiLoCo (Douillard et al. 2023, Alg. 1): AdamW inner steps,
  every :data:`DILOCO_EVERY` = 32 steps the dense mean pseudo-gradient
  through outer Nesterov SGD at lr 0.7, momentum 0.9 (the paper's outer
  optimizer, ``config.scheme.outer_learning_rate``); ``diloco_topk``: the
  same with the pseudo-gradients through top-k 1 % (error feedback, plan
  ``single``). 600 = 18 x 32 + 24: the last eval is 24 steps into a round,
  of the mean of the workers' params (never sent);
* ``cdsgd_k2``, ``cdsgd_k10``: CD-SGD (paper 001) with AdamW as its global
  (server) optimizer, 2-bit ``threshold_quantize`` codes, a full-precision
  message every k steps, after :data:`CDSGD_WARMUP` = 50 synchronous steps
  (the AdamW warm-up). Its local step ``W - eta_l g`` is plain SGD on the raw
  gradient; ``eta_l`` = :data:`CDSGD_LOCAL_LR` = 3e-3, the AdamW *peak* lr,
  untuned: an honest, not a tuned, choice. The threshold
  :data:`CDSGD_THRESHOLD` = 1.5e-3 is the root-mean-square coordinate of a
  gradient at the clipping norm 1.0 (1 / sqrt(445,952 params));
* ``choco_ring``: CHOCO-SGD gossip on a ring, top-k 1 % of ``x - x_hat``
  (per leaf: gossip builds its codec without fusion), consensus step
  ``gamma`` = :data:`CHOCO_GAMMA` (the gossip suite's sweep on digits,
  ``bench.gossip.GAMMA``; not re-swept here).

**Measured** on this machine: the validation bits per byte
``eval_bits_per_byte`` (``eval_loss / ln 2`` over the config's 4,096
validation windows; for the schemes with per-worker params, of the mean of
the workers' params); the bytes per worker per step ``wire_bytes_per_step``
as the program logs it (the compiled HLO's collectives, amortised over the
rounds: ``train.pricing``); and ``tokens_per_sec``, the logged training
throughput of 8 virtual devices sharing this CPU (compile and evals
excluded), weighted by steps over the run. Final bpb: the last eval, mean ±
std over seeds (ddof=1), at equal steps for every method.

**Simulated** (DESIGN §6): each run's steps re-priced from its ``sim.json``
(one worker's FLOPs per step, the exchange's bytes) by :func:`reprice` on
``gradcomp.sim.Cluster(16, bandwidth_gbps=10.0)`` (8 TFLOP/s per worker,
25 us latency, ring all-reduce), the clock of each scheme as the program
prices it: a barrier per round (``simulate_rounds``), CD-SGD's exchange
under the next step (``simulate_delayed``), gossip waiting for in-neighbours
only (``simulate_gossip`` on a ring of 16). The runs have 8 workers; the
cluster of 16 *keeps the per-worker batch* (8 windows, so the FLOPs per step
are unchanged) and the per-worker payload; the bpb curve is the 8-worker
run's: an approximation (for the ring, optimistic: its spectral gap shrinks
with n). The same re-pricing on the program's own cluster is checked
against the logged ``sim_seconds`` (``program_clock_max_rel_diff``).

**Time to target.** The target is ``--target-bpb``; by default
:data:`BASELINE`'s (``dense``) mean final bpb plus :data:`TARGET_MARGIN` =
0.1 bits per byte, a level the dense run reaches by construction at any
``--steps`` (a fixed number would depend on the run's length and on the
Python version's library) with a margin above its seed-to-seed spread. Per
seed, :func:`time_to_target`: the first crossing of the eval curve,
interpolated linearly in the step between the two evals around it (for a
convex falling curve, a late estimate), priced on the cluster's clock; mean
over the seeds that reach it, "not reached" where none does.

The **unigram baseline** (``train.text.unigram_bits_per_byte`` of the train
bytes on the validation stream, read from the dataset's description in the
run's ``config.json``) heads the table: 4.96 bits per byte on Python 3.11.

**Time**: on this 2-core CPU (measured with other jobs sharing it) a
training step takes about 0.4 s (20,000 tokens/s) and an eval of the 4,096
validation windows about 13 s, so one default run (600 steps, 6 evals, the
compile) takes about 5-6 minutes and the default 10 methods x 3 seeds about
3 hours; pick a subset with ``--methods`` (``dense`` is needed for the
default target), fewer ``--seeds``, or a coarser ``--eval-every``. Writes ``transformer.json``, ``transformer.md``
and ``transformer.png`` (bpb against step and against simulated seconds on
the 16-worker cluster) to ``--out``, and each run's workdir (checkpoints
deleted) under ``--out/transformer_runs/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import convergence, gossip, schemes
from bench.convergence import _stats
from bench.output import publish

#: Workers of every run (virtual devices).
WORKERS = schemes.WORKERS
#: The described cluster of the time to target.
PRICED_WORKERS = 16
BANDWIDTH_GBPS = 10.0
TOPK_RATIO = 0.01
#: DiLoCo's inner steps per round (H) and its outer Nesterov SGD.
DILOCO_EVERY = 32
OUTER = {"outer_learning_rate": 0.7, "outer_momentum": 0.9}
#: CD-SGD: local lr (gpt_tiny's AdamW peak lr), warm-up, threshold.
CDSGD_LOCAL_LR = 3e-3
CDSGD_WARMUP = 50
CDSGD_THRESHOLD = 1.5e-3
#: CHOCO's consensus step for top-k 1 % (the gossip suite's sweep).
CHOCO_GAMMA = gossip.GAMMA["topk"]
#: The default target's reference method and its margin (bits per byte).
BASELINE = "dense"
TARGET_MARGIN = 0.1
#: The metric of every curve.
BPB = "eval_bits_per_byte"


@dataclasses.dataclass(frozen=True)
class Method:
  """One curve: a scheme, the compressor of its exchange and the fusion plan.

  Attributes:
    label: name in tables, plots and ``--methods``.
    scheme: ``config.scheme`` fields (``name`` first).
    compressor: ``config.compressor.name``.
    hyperparameters: other ``config.compressor`` fields.
    plan: ``config.fusion.plan`` (never ``"auto"``, which measures a profile).
    why: one line on the choice, copied to the JSON.
    optimizer: ``config.optimizer`` fields set over gpt_tiny's AdamW (1-bit
      Adam and DeMo replace it, with the same learning-rate schedule).
  """

  label: str
  scheme: Mapping[str, Any]
  compressor: str = "none"
  hyperparameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  plan: str = "none"
  why: str = ""
  optimizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_TOPK = {"ratio": TOPK_RATIO}
#: PowerSGD as Vogels et al. 2019 run it: rank 4 per 2-D leaf, 1-D leaves
#: (biases, LayerNorm) sent dense. Under plan ``"single"`` LayerFusion runs its
#: per-leaf form (the default ``per_leaf=None``): each leaf its own P, Q, equal
#: shapes batched, two all-reduces per step for the whole model; the same as
#: plan ``"layerwise"`` (two all-reduces per leaf) within float32
#: (tests/test_fusion_semantics.py).
POWERSGD = {"rank": 4, "vectors": "dense"}
_DILOCO = {"name": "local_sgd", "every": DILOCO_EVERY, **OUTER}
_SYNC = {"name": "none"}


def _cdsgd(k: int) -> Method:
  return Method(
    f"cdsgd_k{k}",
    {
      "name": "cdsgd",
      "local_learning_rate": CDSGD_LOCAL_LR,
      "k": k,
      "warmup_steps": CDSGD_WARMUP,
    },
    "threshold_quantize",
    {"threshold": CDSGD_THRESHOLD},
    "single",
    why=f"2-bit codes, full precision every {k} steps, AdamW global optimizer, "
    "local lr = AdamW peak lr (untuned)",
  )


METHODS: dict[str, Method] = {
  m.label: m
  for m in (
    Method("dense", _SYNC, why="fp32 all-reduce every step"),
    Method("topk", _SYNC, "topk", _TOPK, "single", why="global top-k 1 %, EF"),
    Method(
      "powersgd",
      _SYNC,
      "powersgd",
      POWERSGD,
      "single",
      why="rank 4 per leaf, as published: each 2-D leaf its own P, Q, 1-D "
      "leaves dense; LayerFusion's per-leaf form, one exchange per step",
    ),
    Method("ef_signsgd", _SYNC, "ef_signsgd", plan="single", why="scaled sign, EF"),
    Method("qsgd", _SYNC, "qsgd", plan="single", why="default levels"),
    Method("diloco", _DILOCO, why="dense mean pseudo-gradient, outer Nesterov"),
    Method(
      "diloco_topk",
      _DILOCO,
      "topk",
      _TOPK,
      "single",
      why="pseudo-gradient top-k 1 % with EF, outer Nesterov",
    ),
    _cdsgd(2),
    _cdsgd(10),
    Method(
      "choco_ring",
      {"name": "gossip", "topology": "ring", "gamma": CHOCO_GAMMA},
      "topk",
      _TOPK,
      why="CHOCO-SGD, top-k 1 % of x - x_hat per leaf, ring",
    ),
  )
}
#: 1-bit Adam's dense AdamW updates before the freeze: 1/6 of the 600 steps
#: (Tang et al. warm up for about 15-25 % of a run), after AdamW's own
#: 50-step learning-rate warm-up.
FREEZE_STEP = 100
#: 0/1 Adam's schedule on a 600-step run: DeepSpeed's 100,000-step freeze
#: and 32,678-step local-interval scaler assume runs of hundreds of
#: thousands of steps; scaled down, the variance freezes halfway and the
#: synchronisation interval doubles every 50 steps (1, 2, 4, 8, 16). The
#: variance scaler (16) and the interval cap (16) are DeepSpeed's.
ZERO_ONE_FREEZE = 300
ZERO_ONE_LOCAL_SCALER = 50
#: Whole optimizers that compress their own momentum (``gradcomp.optimizers``),
#: not in the default set: ``python -m bench adaptive`` runs them
#: beside the naive chains (compressor, then AdamW).
ADAPTIVE: dict[str, Method] = {
  m.label: m
  for m in (
    Method(
      "onebit_adam",
      _SYNC,
      optimizer={"name": "onebit_adam", "freeze_step": FREEZE_STEP},
      why=f"1-bit Adam, {FREEZE_STEP} dense AdamW updates, then 1-bit momentum",
    ),
    Method(
      "zero_one_adam",
      _SYNC,
      optimizer={
        "name": "zero_one_adam",
        "var_freeze_step": ZERO_ONE_FREEZE,
        "local_step_scaler": ZERO_ONE_LOCAL_SCALER,
      },
      why=f"0/1 Adam: variance at doubling intervals (16 each), 1-bit rounds; "
      f"local steps after {ZERO_ONE_FREEZE}, intervals doubling every "
      f"{ZERO_ONE_LOCAL_SCALER} steps up to 16",
    ),
    Method(
      "demo",
      _SYNC,
      optimizer={"name": "demo"},
      why="DeMo: top-32 of each 64 (x 64) DCT chunk of the momentum, sign steps",
    ),
    Method(
      "demo_lr1e-3",
      _SYNC,
      optimizer={"name": "demo", "learning_rate": 1e-3},
      why="DeMo at a third of AdamW's peak lr: a sign step moves every "
      "coordinate by the full lr, Adam's by less",
    ),
  )
}
DEFAULT_METHODS = tuple(METHODS)
METHODS.update(ADAPTIVE)
#: Exchanges that scale with the workers (DESIGN §7), beside their gather form.
METHODS["qsgd_scatter"] = Method(
  "qsgd_scatter",
  _SYNC,
  "qsgd",
  {"exchange": "scatter"},
  "single",
  why="QSGD's reduce-scatter form: link bytes about twice the payload at any n",
)
#: The adaptive-optimizer comparison: dense AdamW, the naive chains, and the
#: optimizers that compress their momentum.
ADAPTIVE_METHODS = (
  "dense",
  "topk",
  "powersgd",
  "ef_signsgd",
  "onebit_adam",
  "zero_one_adam",
  "demo",
)


def cluster():
  """The described cluster of the simulated times (module docstring)."""
  import gradcomp

  return gradcomp.sim.Cluster(PRICED_WORKERS, bandwidth_gbps=BANDWIDTH_GBPS)


def cluster_note(per_worker_batch: int) -> str:
  """The cluster in words, with the per-worker batch the re-pricing keeps."""
  return (
    f"{PRICED_WORKERS} homogeneous workers, {BANDWIDTH_GBPS:g} Gbps, 8 TFLOP/s, "
    f"per-worker batch of the {WORKERS}-worker runs kept ({per_worker_batch} "
    "windows)"
  )


def base_config():
  """``configs/gpt_tiny.py``'s config."""
  from configs import gpt_tiny

  return gpt_tiny.get_config()


def configure(
  method: Method,
  *,
  seed: int,
  steps: int,
  eval_every: int,
  overrides: Mapping[str, Any] | None = None,
):
  """gpt_tiny with ``method``'s scheme, compressor and plan, then ``overrides``.

  Logs at every eval and checkpoints only at the end
  (``convergence.configure``). ``overrides`` are dotted config fields
  (e.g. ``{"dataset.context": 32}``), set last.
  """
  from configs import default

  base = convergence.Method(
    method.label, method.compressor, method.plan, dict(method.hyperparameters)
  )
  config = convergence.configure(
    base_config, base, seed=seed, steps=steps, eval_every=eval_every
  )
  config.scheme = default.scheme(**method.scheme)
  config.update_from_flattened_dict(
    {f"optimizer.{k}": v for k, v in method.optimizer.items()}
  )
  config.update_from_flattened_dict(dict(overrides or {}))
  return config


def reprice(inputs: Mapping[str, Any], config, cluster_, steps: int) -> np.ndarray:
  """Simulated seconds after each step ``0 .. steps`` of a run on ``cluster_``.

  Args:
    inputs: the run's ``sim.json`` (:func:`schemes.priced_inputs`).
    config: the run's config (its scheme's schedule).
    cluster_: a ``gradcomp.sim.Cluster``.
    steps: the run's steps.

  Returns:
    float64 array of shape ``(steps + 1,)``: gossip (a ``topology`` in
    ``inputs``) by ``gossip.reprice``; CD-SGD (``full_wire``) by
    ``gradcomp.sim.simulate_delayed``; Streaming DiLoCo (``fragment_wire``)
    by ``gradcomp.sim.simulate_overlapped_rounds``; otherwise a barrier and
    the round's wire on the scheme's round steps,
    ``gradcomp.sim.simulate_rounds``.
  """
  import gradcomp
  from train import optimizer

  if "topology" in inputs:
    return gossip.reprice(inputs, cluster_, steps)
  flops = inputs["flops_per_step"]
  if "phase_wire" in inputs:  # Rounds that change by phase.
    from train import pricing

    kinds, _ = optimizer.exchange_phases(config, steps)
    return pricing.simulate_kinds(
      cluster_, flops, kinds, _phase_rounds(inputs, config, cluster_.workers)
    )
  if "full_wire" in inputs:
    return gradcomp.sim.simulate_delayed(
      cluster_,
      flops,
      inputs["full_wire"],
      inputs["compressed_wire"] or None,
      k=config.scheme.get("k") or 2,
      warmup_steps=config.scheme.warmup_steps,
      steps=steps,
    )
  if "fragment_wire" in inputs:  # Streaming DiLoCo: one fragment per send.
    wires, every = inputs["fragment_wire"], config.scheme.every
    spacing = every // len(wires)
    return gradcomp.sim.simulate_overlapped_rounds(
      cluster_,
      flops,
      lambda step: step % spacing == 0,
      lambda step: wires[(step % every) // spacing],
      steps,
      inputs["overlap"],
    )
  return gradcomp.sim.simulate_rounds(
    cluster_,
    flops,
    optimizer.round_steps(config),
    _round_wire(inputs, config, cluster_.workers),
    steps,
  )


#: gpt_tiny's vocabulary: bytes.
BYTE_VOCABULARY = 256


def _phase_rounds(
  inputs: Mapping[str, Any], config, workers: int
) -> dict[str, dict[str, int]]:
  """``{kind: {collective: bytes}}`` of a run's phases, on ``workers`` workers.

  The phases of ``train.optimizer.exchange_phases``: ``"dense"`` (the
  float32 all-reduce of the ``d`` parameters: a warm-up, a freeze step, 0/1
  Adam's variance steps), ``"onebit"`` (1-bit and 0/1 Adam's two-stage 1-bit
  all-reduce, whose chunks depend on ``workers``: ``train.pricing.
  self_exchange_rounds`` on ``d``), ``"warmup"`` (1-bit Adam's warm-up
  through ``optimizer.warmup_bits``' reduce-scatter, traced again for
  ``workers``), ``"none"`` (0/1 Adam's local steps) and
  ``"compressed"`` (the codec's exchange after ``compressor.warmup_steps`` or
  ``compressed_adam``'s freeze: the logged round, a reduce-scatter form's
  traced again for ``workers`` by :func:`_round_wire`).
  """
  from train import optimizer, pricing

  logged = inputs["phase_wire"]
  rounds = {kind: dict(wire) for kind, wire in logged.items()}
  if "dense" in logged:
    d = logged["dense"]["all-reduce"] // 4
  else:  # A quantized warm-up sends no dense round to read d from.
    d = _model_size(config)
  if "onebit" in rounds:
    rounds["onebit"] = pricing.self_exchange_rounds(d, workers)["onebit"]
  if "warmup" in rounds:
    rounds["warmup"] = _traced(
      lambda axis: optimizer.warmup_codec(config.optimizer, axis), d, workers
    )
  if "compressed" in rounds:
    rounds["compressed"] = _round_wire(
      {"round_wire": logged["compressed"]}, config, workers
    )
  rounds.setdefault("none", {})
  return rounds


def _round_wire(inputs: Mapping[str, Any], config, workers: int) -> dict[str, int]:
  """The run's round wire, a reduce-scatter form's traced again for ``workers``.

  A gathered payload's bytes do not depend on the workers, but a scatter
  form's chunks do (its all-gather carries ``1/n`` of the buffer): its
  collectives are traced on ``workers`` for the one fused buffer of the
  run's ``"single"`` plan, and replace the logged ones of their kinds (the
  program's own 16-byte all-reduce is kept).
  """
  wire = dict(inputs["round_wire"])
  if config.compressor.get("exchange") != "scatter":
    return wire
  from train import optimizer

  if config.fusion.plan != "single":
    raise ValueError(
      f"re-pricing a scatter form needs fusion.plan='single', got {config.fusion.plan!r}"
    )
  wire.update(
    _traced(
      lambda axis: optimizer.compressor(config.compressor, axis),
      _model_size(config),
      workers,
    )
  )
  return wire


def _model_size(config) -> int:
  """The values of ``config``'s GPT (one fused buffer of every leaf)."""
  from gradcomp.models import shapes

  return shapes.total_size(shapes.gpt_shapes(config.model.name, BYTE_VOCABULARY))


def _traced(build, size: int, workers: int) -> dict[str, int]:
  """``{collective: bytes}`` of ``build(axis)`` on one buffer of ``size`` values,
  traced on ``workers`` workers."""
  from gradcomp.parallel.traced import traced_wire

  traced = traced_wire(build, size, workers)
  return {kind: nbytes for kind, (nbytes, _) in traced.items()}


def time_to_target(
  steps: Sequence[int],
  bpb: Sequence[float],
  clock: Sequence[float],
  target: float,
) -> tuple[float, float] | None:
  """``(step, seconds)`` at which an eval curve first reaches ``target``.

  The first eval at or below ``target``; if the eval before it is above,
  the step is interpolated linearly between the two (bpb linear in the step
  between evals), else it is that eval's step. The seconds are ``clock`` at
  that step, interpolated between whole steps.

  Args:
    steps: the eval steps, increasing.
    bpb: bits per byte at those steps (NaN: not evaluated, e.g. stopped).
    clock: seconds after each step ``0 .. len(clock) - 1``.
    target: bits per byte.

  Returns:
    ``(step, seconds)``, or ``None`` if no eval reaches ``target``.

  Examples:
    >>> time_to_target([10, 20], [3.0, 2.0], [0.5 * s for s in range(21)], 2.5)
    (15.0, 7.5)
  """
  x = np.asarray(steps, np.float64)
  y = np.asarray(bpb, np.float64)
  hits = np.flatnonzero(y <= target)  # NaN compares False.
  if not hits.size:
    return None
  i = int(hits[0])
  step = float(x[i])
  if i > 0 and y[i - 1] > target:  # Finite: NaN > target is False.
    frac = (y[i - 1] - target) / (y[i - 1] - y[i])
    step = float(x[i - 1] + frac * (x[i] - x[i - 1]))
  seconds = np.interp(step, np.arange(len(clock)), np.asarray(clock, np.float64))
  return step, float(seconds)


def tokens_per_sec(rows: Sequence[Mapping[str, Any]]) -> float:
  """The run's logged training throughput in tokens/s, weighted by steps.

  Total tokens over total seconds of the logged windows
  (``convergence.throughput`` on the ``tokens_per_sec`` column).
  """
  timed = [
    {"step": r["step"], "samples_per_sec": r["tokens_per_sec"]}
    for r in rows
    if "tokens_per_sec" in r
  ]
  return convergence.throughput(timed, 1, 0)


def _curve(rows: Sequence[Mapping[str, Any]], eval_steps: Sequence[int]) -> dict:
  """One run's bpb and logged simulated seconds at ``eval_steps`` (NaN if absent)."""
  evals = {r["step"]: r for r in rows if BPB in r}
  sim_at = {
    r["step"]: r["sim_seconds"] for r in rows if r.get("sim_seconds") is not None
  }
  nan = math.nan

  def value(v):
    return nan if v is None else float(v)

  return {
    "step": list(eval_steps),
    "bpb": [value(evals.get(s, {}).get(BPB)) for s in eval_steps],
    "program_sim_seconds": [value(sim_at.get(s)) for s in eval_steps],
  }


def unigram_baseline(workdir: str | Path) -> tuple[float | None, str | None]:
  """The unigram bits per byte and the dataset's description from ``config.json``."""
  from train import train

  fields = json.loads((Path(workdir) / train.CONFIG_FILE).read_text())
  description = fields.get("dataset_identity", {}).get("description")
  found = re.search(r"unigram baseline ([0-9.]+) bits/byte", description or "")
  return (float(found.group(1)) if found else None), description


def _reach(curves, clocks, target: float) -> dict[str, Any]:
  """Per seed, the time to ``target``; stats over the seeds that reach it."""
  hits = [
    time_to_target(c["step"], c["bpb"], clock, target)
    for c, clock in zip(curves, clocks, strict=True)
  ]
  seconds = [h[1] for h in hits if h is not None]
  out = {
    "reached": len(seconds),
    "seeds": len(hits),
    "step": [None if h is None else h[0] for h in hits],
    "seconds": [None if h is None else h[1] for h in hits],
  }
  return out | ({"mean": None} if not seconds else _stats(seconds))


def summarize(runs: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any]:
  """Over seeds: final bpb, curves, bytes, throughput and simulated time."""
  curves = [r["curve"] for r in runs]
  steps = curves[0]["step"]
  bpb = np.asarray([c["bpb"] for c in curves])
  # A run stopped before its first log has no bytes; the others must agree.
  wires = {r["wire_bytes_per_step"] for r in runs} - {None}
  if len(wires) > 1:
    raise ValueError(f"seeds of one method logged different bytes per step: {wires}")
  clocks = [np.asarray(r["clock"]) for r in runs]
  at = np.asarray([clock[steps] for clock in clocks])
  logged = np.asarray([c["program_sim_seconds"] for c in curves])
  program = np.asarray([r["program_clock"] for r in runs])
  return {
    "step": steps,
    "bpb_mean": bpb.mean(0).tolist(),
    "bpb_min": bpb.min(0).tolist(),
    "bpb_max": bpb.max(0).tolist(),
    "final_bpb": _stats(bpb[:, -1]),
    "wire_bytes_per_step": wires.pop() if wires else None,
    "tokens_per_sec": _stats([r["tokens_per_sec"] for r in runs]),
    "stopped": sum(bool(r.get("stopped")) for r in runs),
    "run_seconds": _stats([r["run_seconds"] for r in runs]),
    "sim_seconds": at.mean(0).tolist(),
    "sim_end": float(np.mean([clock[-1] for clock in clocks])),
    "reach": _reach(curves, clocks, target),
    # The post-hoc clock of the program's cluster against the run's own column.
    "program_clock_max_rel_diff": float(np.nanmax(np.abs(logged - program) / program)),
  }


def _log(text: str) -> None:
  print(f"# transformer: {text}", file=sys.stderr, flush=True)


#: Config fields that change what an eval scores, never the trajectory: a
#: finished run is read back whatever they were.
EVAL_ONLY_FIELDS = ("eval_each_worker",)


def _set_fields(fields):
  """A config's JSON without its unset (``None``) fields, at every depth.

  An unset placeholder added to the configs later (a new optimizer's field)
  leaves an earlier run's config the same config.
  """
  if isinstance(fields, dict):
    return {k: _set_fields(v) for k, v in fields.items() if v is not None}
  return fields


def finished_run(config, workdir: Path, steps: int) -> dict[str, Any] | None:
  """The run of ``config`` already finished in ``workdir``, read back; else ``None``.

  Finished: ``config.json`` holds the same config (the corpus identity,
  unset fields and :data:`EVAL_ONLY_FIELDS` aside),
  ``metrics.jsonl`` an eval at ``steps`` and ``sim.json`` the clock's inputs.
  ``run_seconds`` is then the logged seconds of training
  (``logs.elapsed_seconds``: compile and evals included, as a fresh run's).
  """
  from train import logs, train

  metrics, saved = workdir / logs.METRICS_FILE, workdir / train.CONFIG_FILE
  if not (
    metrics.is_file() and saved.is_file() and (workdir / train.SIM_FILE).is_file()
  ):
    return None
  fields = json.loads(saved.read_text())
  fields.pop("dataset_identity", None)
  wanted = json.loads(config.to_json_best_effort())
  for f in EVAL_ONLY_FIELDS:  # What is scored, not what is trained.
    fields.pop(f, None)
    wanted.pop(f, None)
  if _set_fields(fields) != _set_fields(wanted):
    return None
  rows = logs.read_metrics(metrics)
  if not any(r.get("step") == steps and "eval_loss" in r for r in rows):
    return None
  wire = [r["wire_bytes_per_step"] for r in rows if "wire_bytes_per_step" in r]
  return {
    "workdir": str(workdir),
    "rows": rows,
    "final": {},
    "run_seconds": logs.elapsed_seconds(rows)[-1],
    "wire_bytes_per_step": wire[-1] if wire else None,
    "reused": True,
  }


def one_run(
  config, workdir: Path, eval_steps: Sequence[int], priced_on, *, reuse: bool
) -> dict[str, Any]:
  """One training run of ``config`` in ``workdir``, as the suites record it.

  Trains it (``schemes._train``: a run stopped by non-finite steps keeps
  what it logged, with ``stopped``), or with ``reuse`` reads back a run
  already finished there (:func:`finished_run`).

  Returns:
    ``workdir``, ``run_seconds``, ``wire_bytes_per_step`` (``stopped``,
    ``reused`` when so), ``seed``, ``curve`` (:func:`_curve` at
    ``eval_steps``), ``tokens_per_sec``, ``clock`` (:func:`reprice` on
    ``priced_on``, after each step ``0 .. steps``), ``program_clock`` (on the
    program's own cluster, at ``eval_steps``) and ``sim_inputs`` (the run's
    ``sim.json``).
  """
  from train import pricing

  steps = config.num_train_steps
  r = (reuse and finished_run(config, workdir, steps)) or schemes._train(
    config, workdir
  )
  rows = r.pop("rows")
  r.pop("final", None)
  r["seed"] = config.seed
  r["curve"] = _curve(rows, eval_steps)
  r["tokens_per_sec"] = tokens_per_sec(rows)
  sim = schemes.priced_inputs(workdir)
  r["clock"] = reprice(sim, config, priced_on, steps).tolist()
  program = reprice(sim, config, pricing.cluster_of(config, WORKERS), steps)
  r["program_clock"] = program[list(eval_steps)].tolist()
  r["sim_inputs"] = sim
  return r


def run_line(r: Mapping[str, Any]) -> str:
  """A log line of :func:`one_run`'s record."""
  stop = f" (stopped: {r['stopped'][:60]}...)" if r.get("stopped") else ""
  return (
    f"bpb {r['curve']['bpb'][-1]:.4f}, {r['wire_bytes_per_step'] or 0:,.0f} B/step, "
    f"{r['tokens_per_sec']:,.0f} tokens/s, {r['run_seconds']:.1f} s{stop}"
  )


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 3,
  steps: int | None = None,
  eval_every: int = 100,
  target_bpb: float | None = None,
  out_dir: str = "bench_out",
  overrides: Mapping[str, Any] | None = None,
  reuse: bool = False,
) -> dict[str, Any]:
  """Runs the suite, prints its table, writes ``transformer.{json,md,png}``.

  Args:
    methods: the curves (default: every one of :data:`METHODS`).
    seeds: runs per method, seeds ``0 .. seeds - 1``.
    steps: training steps of each run (default: the config's, 600).
    eval_every: eval (and log) interval, in steps; the last step is always
      evaluated.
    target_bpb: the time-to-target level; ``None``: :data:`BASELINE`'s mean
      final bpb plus :data:`TARGET_MARGIN` (then ``dense`` must be run).
    out_dir: where the outputs and the runs' workdirs go.
    overrides: dotted config fields set on every run (e.g. a smaller
      context for a smoke run), recorded in the JSON.
    reuse: read back each run already finished in its workdir with the same
      config (:func:`finished_run`) instead of training it again, e.g. to add
      seeds to an earlier invocation's runs.

  Raises:
    ValueError: a bad run shape, ``steps`` not above the AdamW warm-up, or
      no target and no ``dense`` run.
  """
  import gradcomp
  from bench.compress import machine_info

  if methods is None:
    methods = [METHODS[m] for m in DEFAULT_METHODS]
  steps = base_config().num_train_steps if steps is None else steps
  methods = schemes.check_run(methods, seeds, steps, eval_every)
  if target_bpb is None and BASELINE not in {m.label for m in methods}:
    raise ValueError(f"without --target-bpb the methods must include {BASELINE!r}")
  overrides = dict(overrides or {})
  first = configure(
    methods[0], seed=0, steps=steps, eval_every=eval_every, overrides=overrides
  )
  if first.optimizer.warmup_steps >= steps:
    raise ValueError(
      f"steps={steps} must exceed the AdamW warm-up, "
      f"optimizer.warmup_steps={first.optimizer.warmup_steps}"
    )
  runs_dir = Path(out_dir) / "transformer_runs"
  eval_steps = sorted({*range(eval_every, steps + 1, eval_every), steps})
  t_start = time.perf_counter()
  info = machine_info()
  _log(
    f"{len(methods)} methods x {seeds} seeds x {steps} steps of gpt_tiny, "
    f"{WORKERS} workers ({info['backend']}), {info['cpu_count']} CPUs"
  )
  priced_on = cluster()
  per_method: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
  inputs: dict[str, dict[str, Any]] = {}
  unigram, description, batch, context = None, None, None, None
  for seed in range(seeds):
    for m in methods:
      config = configure(
        m, seed=seed, steps=steps, eval_every=eval_every, overrides=overrides
      )
      batch, context = config.global_batch_size, config.dataset.context
      workdir = runs_dir / m.label / f"seed{seed}"
      r = one_run(config, workdir, eval_steps, priced_on, reuse=reuse)
      inputs.setdefault(m.label, r.pop("sim_inputs"))
      if unigram is None:
        unigram, description = unigram_baseline(workdir)
      per_method[m.label].append(r)
      _log(f"{m.label} seed {seed}: {run_line(r)}")
  if target_bpb is None:
    finals = [r["curve"]["bpb"][-1] for r in per_method[BASELINE]]
    target_bpb = float(np.mean(finals)) + TARGET_MARGIN
    rule = f"{BASELINE}'s mean final bpb + {TARGET_MARGIN:g}"
  else:
    rule = "--target-bpb"
  summaries = {
    label: {**summarize(rs, target_bpb), "sim_inputs": inputs[label]}
    for label, rs in per_method.items()
  }
  dense_bytes = (
    summaries[BASELINE]["wire_bytes_per_step"] if BASELINE in summaries else None
  )
  for s in summaries.values():
    s["bytes_ratio_to_dense"] = (
      None if dense_bytes is None else s["wire_bytes_per_step"] / dense_bytes
    )
  result = {
    "suite": "transformer",
    "machine": info,
    "config": "configs/gpt_tiny.py",
    "overrides": overrides,
    "workers": WORKERS,
    "steps": steps,
    "eval_every": eval_every,
    "seeds": seeds,
    "global_batch_size": batch,
    "context": context,
    "unigram_bits_per_byte": unigram,
    "dataset": description,
    "target_bpb": target_bpb,
    "target_rule": rule,
    "cluster": {
      **dataclasses.asdict(priced_on),
      "note": cluster_note(batch // WORKERS),
    },
    "methods": {m.label: dataclasses.asdict(m) for m in methods},
    "results": {
      label: {"summary": summaries[label], "runs": per_method[label]}
      for label in per_method
    },
    "gradcomp_version": getattr(gradcomp, "__version__", None),
    "wall_s": time.perf_counter() - t_start,
    "loadavg_end": list(os.getloadavg()),
  }
  publish(out_dir, "transformer", result, format_tables(result), plot)
  return result


def _seconds(x: float | None) -> str:
  if x is None or not math.isfinite(x):
    return "-"
  return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _bpb(stats: Mapping[str, Any]) -> str:
  std = "" if stats["std"] is None else f" ± {stats['std']:.3f}"
  return f"{stats['mean']:.3f}{std}"


def _fields(method: Mapping[str, Any]) -> str:
  """A method's config fields, as ``--config.`` overrides would set them."""
  parts = [
    f"scheme.{k}={v:g}" if isinstance(v, float) else f"scheme.{k}={v}"
    for k, v in method["scheme"].items()
  ]
  parts.append(f"compressor.name={method['compressor']}")
  parts += [
    f"compressor.{k}={v:g}" if isinstance(v, float) else f"compressor.{k}={v}"
    for k, v in method["hyperparameters"].items()
  ]
  parts.append(f"fusion.plan={method['plan']}")
  parts += [f"optimizer.{k}={v}" for k, v in method.get("optimizer", {}).items()]
  return ", ".join(parts)


def format_tables(result: Mapping[str, Any]) -> str:
  """Markdown tables of a :func:`run` result."""
  res, mi = result["results"], result["machine"]
  unigram = result["unigram_bits_per_byte"]
  over = ", ".join(f"{k}={v}" for k, v in result["overrides"].items())
  lines = [
    f"gpt_tiny on bytes of the standard library ({result['config']}"
    + (f"; overrides: {over}" if over else "")
    + f"), {result['workers']} workers ({mi['backend']}), {result['steps']} "
    f"steps of {result['global_batch_size']} windows of {result['context']} "
    f"bytes, {result['seeds']} seeds, eval every {result['eval_every']} steps. "
    f"Unigram baseline: "
    + ("-" if unigram is None else f"{unigram:.3f}")
    + f" bits/byte. Target: {result['target_bpb']:.3f} bits/byte "
    f"({result['target_rule']}). Final bpb: last eval, mean ± std over seeds "
    "(ddof=1); bytes per worker per step as logged (amortised); simulated "
    f"seconds on {result['cluster']['note']} (first crossing, interpolated "
    "between evals; mean over the seeds that reach it, their count if not "
    "all); tokens/s measured on this machine's virtual devices",
    "",
    "| method | final bpb | bytes/step | / dense | sim. s to target "
    "| sim. s, whole run | tokens/s |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for label, entry in res.items():
    s = entry["summary"]
    reach = s["reach"]
    if reach["reached"] == 0:
      to_target = "not reached"
    else:
      n, seeds = reach["reached"], reach["seeds"]
      note = "" if n == seeds else f" ({n}/{seeds})"
      to_target = _seconds(reach["mean"]) + note
    ratio = s["bytes_ratio_to_dense"]
    stopped = f" ({s['stopped']} stopped)" if s["stopped"] else ""
    lines.append(
      f"| {label} | {_bpb(s['final_bpb'])}{stopped} "
      f"| {s['wire_bytes_per_step']:,.0f} "
      f"| {'-' if ratio is None else f'{ratio:.3g}'} | {to_target} "
      f"| {_seconds(s['sim_end'])} | {s['tokens_per_sec']['mean']:,.0f} |"
    )
  lines += ["", "| method | config fields | why |", "| --- | --- | --- |"]
  for label, m in result["methods"].items():
    lines.append(f"| {label} | {_fields(m)} | {m['why']} |")
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str | Path) -> Path:
  """Validation bpb against step and against simulated seconds on the cluster."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  res = result["results"]
  fig = Figure(figsize=(12, 4.6), layout="constrained")
  FigureCanvasAgg(fig)
  by_step, by_time = fig.subplots(1, 2, sharey=True)
  for label, entry in res.items():
    s = entry["summary"]
    for ax, x in ((by_step, s["step"]), (by_time, s["sim_seconds"])):
      (line,) = ax.plot(x, s["bpb_mean"], marker=".", label=label)
      ax.fill_between(x, s["bpb_min"], s["bpb_max"], color=line.get_color(), alpha=0.15)
  unigram = result["unigram_bits_per_byte"]
  for ax in (by_step, by_time):
    ax.axhline(result["target_bpb"], color="k", ls="--", lw=0.8, label="target")
    if unigram is not None:
      ax.axhline(unigram, color="grey", ls=":", lw=0.8, label="unigram")
    ax.grid(alpha=0.3, which="both")
  values = [v for e in res.values() for v in e["summary"]["bpb_min"] if v == v]
  if unigram is not None and values and min(values) < unigram:
    by_step.set_ylim(min(values) - 0.05, unigram + 0.5)  # Early evals cut.
  by_step.set(xlabel="step", ylabel="validation bits per byte")
  by_time.set(
    xlabel=f"simulated seconds, {PRICED_WORKERS} workers, {BANDWIDTH_GBPS:g} Gbps",
    xscale="log",
  )
  by_step.legend(loc="upper right", fontsize="small")
  fig.suptitle(
    f"gpt_tiny, {result['workers']} workers, {result['steps']} steps: mean of "
    f"{result['seeds']} seeds, band min-max"
  )
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  return path
