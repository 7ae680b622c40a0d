"""The transformer study: one fair protocol for every method (issue 42, DESIGN §11).

``python -m bench study [--phase grid|seeds|all|page] [--methods dense,topk]
[--steps 600] [--windows-per-worker 8[,16]] [--seeds 3] [--reuse]
[--out bench_out/study] [--page docs/compressing_a_transformer.md]
[--override KEY=VALUE ...] [--smoke]``

Every run is the training program on ``configs/gpt_tiny.py`` through the
transformer suite's machinery (:func:`bench.transformer.configure`,
:func:`bench.transformer.one_run`, :func:`bench.transformer.reprice`,
:func:`bench.transformer.summarize`); this module adds the protocol:

1. **Its own learning rate.** Each method has a grid of at least three rates
   around its family's usual value (:data:`ADAMW_RATES` for AdamW and the
   Adam variants, :data:`SIGN_RATES` for DeMo's sign steps, :data:`MUON_RATES`
   for Muon). Periodic methods also have an outer-rate grid; their grid is a
   cross through the usual point (every inner rate at the usual outer rate,
   every outer rate at the usual inner rate: 5 runs, not 9); when the seed-0
   choice lies off the usual point, the cross through the choice is run too
   (:func:`cross_through_choice`), so an inner rate that only wins at another
   outer rate is found one step away (:func:`grown`: edges first, then the
   cross, until neither adds a point).
2. **Chosen on seed 0** by the final validation bits per byte
   (:func:`choose`): the lowest wins; runs within :data:`TIE_BPB` of it are
   tied and the one nearest the usual point wins; a run stopped by non-finite
   steps or with a non-finite bpb is never chosen. A choice at the edge of its
   grid is flagged and the grid grows one step beyond that edge
   (:func:`extension`), up to :data:`MAX_EXTENSIONS` points.
3. **Three seeds** at the chosen point: seed 0 is the grid's run (the same
   workdir, so ``--reuse`` reads it back), seeds 1 and 2 are trained.
4. **One clipping rule and one decay mask** (:data:`PROTOCOL_FIELDS`):
   every method clips each worker's own gradient at gpt_tiny's norm 1.0
   before any exchange (``optimizer.clip_scope="worker"``: the only rule the
   self-exchanging optimizers can follow, since they never see a mean
   gradient), and AdamW's decay mask (matrices and embeddings, not norms and
   biases) applies to every optimizer, DeMo's included
   (``optimizer.mask_decay=True``). A field the program does not have yet is
   reported in the JSON (``protocol_missing``) and on the page.
5. **A dense warm-up** for every every-step compressor:
   ``compressor.warmup_steps`` = :data:`DENSE_WARMUP` (gpt_tiny's AdamW
   warm-up); the frozen-variance optimizers (1-bit Adam, compressed-momentum
   Adam) warm up through ``freeze_step`` = :data:`FREEZE_STEP`, their own
   dense phase, which also estimates the variance they freeze (1-bit Adam
   also at :data:`SHORT_FREEZE_STEP`, the longest dense freeze that leaves
   the run at 20x fewer bytes, and with its warm-up's gradients as int codes,
   :data:`INT8_WARMUP` and :data:`INT4_WARMUP`); 0/1 Adam and DeMo follow
   their own schedules. The bytes are over the whole run, the dense phases
   included.
6. **The per-worker batch** is a parameter (``--windows-per-worker``,
   default :data:`WINDOWS_PER_WORKER`); the whole protocol runs at each size
   given (e.g. ``8,16``, :data:`LARGER_WINDOWS`), each size its own grid and
   choice; a size may hold only some of the methods.

**Measured and simulated** as in ``bench.transformer``: final bpb mean ± std
over seeds (ddof 1), bytes per worker per step over the run as the program
logs them, and every run re-priced on 16 workers at each of
:data:`BANDWIDTHS_GBPS` (the transformer suite's cluster otherwise:
8 TFLOP/s, 25 us, ring), with the time to the target (dense AdamW's mean
final bpb + ``transformer.TARGET_MARGIN``) and the whole run's time.
**What to pick** (:func:`recommend`): at each bandwidth and in each family,
the method fastest to the target among those whose mean final bpb is within
:data:`QUALITY` of dense AdamW's.

Writes ``study.json`` and ``study.md`` to ``--out``; ``--page PATH`` renders
the recommendation page from that JSON (:func:`bench.study_page.render`);
``--phase page`` only renders it. The full study is about 110 runs of 5-10
minutes each on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import gradcomp
from bench import transformer
from bench.convergence import _stats
from bench.output import write_json
from bench.transformer import Method
from gradcomp.compressors import checks

#: The protocol's fields, set on every run of every method (issue 42).
PROTOCOL_FIELDS: dict[str, Any] = {
  "optimizer.clip_scope": "worker",
  "optimizer.mask_decay": True,
  # The periodic methods' evals score the workers' average only: every
  # worker's own model on the whole set was 8 evaluations, 70 % of a DiLoCo
  # run. It changes no trajectory (``transformer.EVAL_ONLY_FIELDS``).
  "eval_each_worker": False,
}
#: Dense all-reduce steps before an every-step compressor's first exchange
#: (``compressor.warmup_steps``): gpt_tiny's AdamW warm-up.
DENSE_WARMUP = 50
#: The frozen-variance optimizers' dense AdamW steps (``freeze_step``).
FREEZE_STEP = transformer.FREEZE_STEP
#: 1-bit Adam's shortest-freeze variant: the longest dense phase that leaves a
#: 600-step run at 20x fewer bytes than dense. Its 1-bit phase sends 1/28.4 of
#: dense's bytes per step (measured: the 100-step run's 349,607 bytes per step
#: against dense's 1,783,824), so ``w`` dense steps give
#: ``600 / (w + (600 - w) / 28.4)``: 20.1x at w = 9, 20.8x at w = 8.
SHORT_FREEZE_STEP = 8
#: 1-bit Adam's variants at 20x with a quantized warm-up: the dense phase's
#: gradients as int8 or int4 codes in a reduce-scatter
#: (``optimizer.warmup_bits``), so a warm-up as long as the dense one that held
#: (seed 0 at 6e-3: 1.869 at 35 dense steps, 1.866 at 50, 1.881 at 100) fits
#: in 20x: ``600 / (w / c + (600 - w) / 28.4)`` for ``w`` steps whose round
#: is ``c`` times smaller than the all-reduce. int8 in blocks of 64 (533,052
#: bytes a round, c = 3.35): 33 steps, 20.1x; int4 in blocks of 512 (254,772,
#: c = 7.0): 50 steps, 22.6x.
INT8_WARMUP = {"freeze_step": 33, "warmup_bits": 8, "warmup_block_size": 64}
INT4_WARMUP = {"freeze_step": 50, "warmup_bits": 4}
#: 0/1 Adam's variant at 20x: its variance interval doubles after every 2
#: updates instead of 16, so 600 steps hold 15 dense variance steps, not 67
#: (``zero_one_adam.exchange_schedule``); with the reference's freeze at 300
#: and local intervals doubling every 50 steps the run sends 21.0x fewer
#: bytes than dense (the dense and 1-bit steps' bytes as 1-bit Adam's).
SPARSE_VAR_UPDATE_SCALER = 2
#: Inner steps per round of every periodic method.
EVERY = transformer.DILOCO_EVERY
#: Learning-rate grids, the family's usual value in the middle.
ADAMW_RATES = (1.5e-3, 3e-3, 6e-3)  # gpt_tiny's AdamW peak 3e-3
SIGN_RATES = (3e-4, 1e-3, 3e-3)  # sign steps: Lion's 3-10x below AdamW's
MUON_RATES = (0.01, 0.02, 0.04)  # Muon's usual 0.02 (Jordan et al. 2024)
OUTER_RATES = (0.5, 0.7, 1.0)  # DiLoCo's outer Nesterov lr 0.7
SPARSELOCO_OUTER_RATES = (0.5, 1.0, 2.0)  # SparseLoCo's plain outer SGD at 1.0
#: SparseLoCo's denser variant: its outer grid around the base's chosen 4
#: (the base's cross went 1.0 -> 2 -> 4 -> 8 and chose 4).
SPARSELOCO_DENSE_OUTER_RATES = (2.0, 4.0, 8.0)
#: Its top-k per 64 x 64 tile: twice the paper's 64 (3.1 % instead of 1.56 %),
#: still about 70x fewer bytes per round than DiLoCo's dense mean.
DENSE_SPARSELOCO_K = 128
#: Seeds at the chosen point, and the default per-worker windows.
SEEDS = 3
WINDOWS_PER_WORKER = 8
#: The larger per-worker batch the study reports beside the default: twice the
#: windows, so a worker's gradient averages twice the tokens (its noise std
#: 1/sqrt(2) of the default's) at about twice a run's time; 32 windows ran
#: about 25 minutes a run on the 2-core CPU, too long for a grid and seeds.
LARGER_WINDOWS = 16
#: Link speeds of the described cluster the page compares (Gbit/s).
BANDWIDTHS_GBPS = (1.0, 10.0, 100.0)
#: "Keeps the model": mean final bpb within this fraction of dense AdamW's.
QUALITY = 0.02
#: Seed-0 finals closer than this (bits per byte) are a tie.
TIE_BPB = 1e-3
#: Points added beyond a grid's edge while the choice stays at it.
MAX_EXTENSIONS = 2
#: The families, in the page's order.
FAMILIES = ("every-step", "periodic")
PHASES = ("grid", "seeds", "all", "page")
DEFAULT_OUT = "bench_out/study"
DEFAULT_PAGE = "docs/compressing_a_transformer.md"


@dataclasses.dataclass(frozen=True)
class Entry:
  """One method of the study: a transformer-suite :class:`Method` and its grid.

  Attributes:
    method: the run's scheme, compressor, plan and optimizer.
    family: one of :data:`FAMILIES`.
    title: the method in the page's words.
    rates: ``optimizer.learning_rate`` grid, increasing, the usual in the middle.
    outer_rates: ``scheme.outer_learning_rate`` grid (periodic methods).
    rate_note: why this grid.
  """

  method: Method
  family: str
  title: str
  rates: tuple[float, ...]
  outer_rates: tuple[float, ...] = ()
  rate_note: str = ""


_SYNC = {"name": "none"}
_TOPK = {"ratio": transformer.TOPK_RATIO}
_WARM = {"warmup_steps": DENSE_WARMUP}
_DILOCO = {"name": "local_sgd", "every": EVERY, **transformer.OUTER}
_ADAMW_NOTE = "AdamW's peak 3e-3 halved and doubled"
_SPARSELOCO = {
  "name": "sparseloco",
  "every": EVERY,
  "outer_learning_rate": 1.0,
  "k": 64,
  "chunk": 64,
  "value_bits": 2,
  "ef_decay": 0.95,
}


def _entries() -> tuple[Entry, ...]:
  every, periodic = FAMILIES
  return (
    Entry(
      Method("dense", _SYNC, why="fp32 all-reduce every step"),
      every,
      "dense AdamW",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        "topk",
        _SYNC,
        "topk",
        {**_TOPK, **_WARM},
        "single",
        why=f"global top-k 1 % of one fused buffer, EF, after {DENSE_WARMUP} dense "
        "steps, then AdamW",
      ),
      every,
      "top-k 1 % + EF -> AdamW",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        "powersgd",
        _SYNC,
        "powersgd",
        {**transformer.POWERSGD, **_WARM},
        "single",
        why="rank 4 per 2-D leaf, 1-D leaves dense (Vogels et al. 2019): "
        "each leaf its own factors, LayerFusion's per-leaf form in one "
        "exchange per step; after "
        f"{DENSE_WARMUP} dense steps, then AdamW",
      ),
      every,
      "PowerSGD rank 4 per leaf -> AdamW",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        "ef_signsgd",
        _SYNC,
        "ef_signsgd",
        dict(_WARM),
        "single",
        why="scaled sign with EF, its scale per leaf as published "
        f"(LayerFusion's per-leaf form); after {DENSE_WARMUP} dense "
        "steps, then AdamW",
      ),
      every,
      "EF-signSGD -> AdamW",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        "onebit_adam",
        _SYNC,
        optimizer={"name": "onebit_adam", "freeze_step": FREEZE_STEP},
        why=f"1-bit Adam: {FREEZE_STEP} dense AdamW steps, then the 1-bit momentum",
      ),
      every,
      "1-bit Adam",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        f"onebit_adam_freeze{SHORT_FREEZE_STEP}",
        _SYNC,
        optimizer={"name": "onebit_adam", "freeze_step": SHORT_FREEZE_STEP},
        why=f"1-bit Adam: {SHORT_FREEZE_STEP} dense AdamW steps (the longest dense "
        "phase that leaves the run at 20x fewer bytes), then the 1-bit momentum "
        f"with the variance of those {SHORT_FREEZE_STEP} steps frozen",
      ),
      every,
      f"1-bit Adam, {SHORT_FREEZE_STEP}-step freeze",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    _quantized_warmup_entry(INT8_WARMUP, every),
    _quantized_warmup_entry(INT4_WARMUP, every),
    Entry(
      Method(
        "compressed_adam_topk",
        _SYNC,
        "topk",
        dict(_TOPK),
        "single",
        optimizer={"name": "compressed_adam", "freeze_step": FREEZE_STEP},
        why=f"compressed-momentum Adam: {FREEZE_STEP} dense AdamW steps, then "
        "the momentum through global top-k 1 % with EF",
      ),
      every,
      "compressed-momentum Adam, top-k 1 %",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      dataclasses.replace(transformer.ADAPTIVE["zero_one_adam"]),
      every,
      "0/1 Adam",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        f"zero_one_adam_scaler{SPARSE_VAR_UPDATE_SCALER}",
        _SYNC,
        optimizer={
          **transformer.ADAPTIVE["zero_one_adam"].optimizer,
          "var_update_scaler": SPARSE_VAR_UPDATE_SCALER,
        },
        why=f"0/1 Adam with its variance interval doubling every "
        f"{SPARSE_VAR_UPDATE_SCALER} updates (15 dense steps in 600, the "
        "reference's 67), the rest as the reference's: 21x fewer bytes",
      ),
      every,
      f"0/1 Adam, variance interval doubling every {SPARSE_VAR_UPDATE_SCALER}",
      ADAMW_RATES,
      rate_note=_ADAMW_NOTE,
    ),
    Entry(
      Method(
        "demo",
        _SYNC,
        optimizer={"name": "demo"},
        why="DeMo: top-32 of each 64 (x 64) DCT chunk of the momentum, sign steps",
      ),
      every,
      "DeMo",
      SIGN_RATES,
      rate_note="a sign step moves every coordinate by the whole rate: "
      "Lion's 3-10x below AdamW's",
    ),
    Entry(
      Method("diloco", _DILOCO, why="dense mean pseudo-gradient, outer Nesterov 0.9"),
      periodic,
      f"DiLoCo every {EVERY}",
      ADAMW_RATES,
      OUTER_RATES,
      rate_note=f"inner: {_ADAMW_NOTE}; outer: around DiLoCo's 0.7",
    ),
    Entry(
      Method(
        "diloco_topk",
        _DILOCO,
        "topk",
        dict(_TOPK),
        "single",
        why="pseudo-gradient top-k 1 % with EF, outer Nesterov 0.9",
      ),
      periodic,
      f"DiLoCo every {EVERY} + top-k 1 %",
      ADAMW_RATES,
      OUTER_RATES,
      rate_note=f"inner: {_ADAMW_NOTE}; outer: around DiLoCo's 0.7",
    ),
    Entry(
      Method(
        "sparseloco",
        _SPARSELOCO,
        why="SparseLoCo (Sarfi et al. 2025): top-64 of each 64 x 64 tile of "
        "the EF-decayed pseudo-gradient (1.56 %), 2-bit values, EF decay 0.95, "
        "outer SGD",
      ),
      periodic,
      f"SparseLoCo every {EVERY}",
      ADAMW_RATES,
      SPARSELOCO_OUTER_RATES,
      rate_note=f"inner: {_ADAMW_NOTE}; outer: around the paper's 1.0",
    ),
    Entry(
      Method(
        f"sparseloco_k{DENSE_SPARSELOCO_K}",
        {**_SPARSELOCO, "k": DENSE_SPARSELOCO_K},
        why=f"SparseLoCo as above with top-{DENSE_SPARSELOCO_K} of each 64 x 64 "
        f"tile ({100 * DENSE_SPARSELOCO_K / _SPARSELOCO['chunk'] ** 2:.1f} %), "
        "twice the base's density",
      ),
      periodic,
      f"SparseLoCo every {EVERY}, top-{DENSE_SPARSELOCO_K}",
      ADAMW_RATES,
      SPARSELOCO_DENSE_OUTER_RATES,
      rate_note=f"inner: {_ADAMW_NOTE}; outer: around the base SparseLoCo's chosen 4",
    ),
    Entry(
      Method(
        "muloco",
        {**_DILOCO, "outer_momentum": 0.6},
        "topk",
        dict(_TOPK),
        "layerwise",
        optimizer={"name": "muon"},
        why="MuLoCo (Therien et al. 2025, arXiv 2505.23725), as configs/muloco.py: "
        "Muon inner steps, pseudo-gradients through top-k 1 % with EF leaf by "
        "leaf, outer Nesterov momentum 0.6 (the paper's)",
      ),
      periodic,
      f"MuLoCo every {EVERY} (Muon, top-k 1 %)",
      MUON_RATES,
      OUTER_RATES,
      rate_note="inner: around Muon's usual 0.02; outer: around DiLoCo's 0.7",
    ),
    _senders_entry(_SPARSELOCO["k"], periodic),
    _senders_entry(DENSE_SPARSELOCO_K, periodic),
  )


def _quantized_warmup_entry(optimizer: dict[str, int], family: str) -> Entry:
  """1-bit Adam whose warm-up sends int codes (``optimizer``: its fields)."""
  bits, steps = optimizer["warmup_bits"], optimizer["freeze_step"]
  unset = inspect.signature(gradcomp.int_quantize).parameters["block_size"].default
  block = optimizer.get("warmup_block_size", unset)
  return Entry(
    Method(
      f"onebit_adam_int{bits}_warmup",
      _SYNC,
      optimizer={"name": "onebit_adam", **optimizer},
      why=f"1-bit Adam: {steps} AdamW steps on int{bits} gradients in blocks of "
      f"{block} (ZeRO++'s quantized reduce-scatter with LoCo's error feedback), "
      "then the 1-bit momentum",
    ),
    family,
    f"1-bit Adam, int{bits} warm-up of {steps} steps (blocks of {block})",
    ADAMW_RATES,
    rate_note=_ADAMW_NOTE,
  )


def _senders_entry(k: int, family: str) -> Entry:
  """SparseLoCo at top-``k`` per tile with Templar's mean over senders."""
  paper = k == _SPARSELOCO["k"]
  which = "at the paper's " if paper else ""
  return Entry(
    Method(
      "sparseloco_senders" if paper else f"sparseloco_k{k}_senders",
      {**_SPARSELOCO, "k": k, "mean": "senders"},
      why=f"SparseLoCo {which}top-{k} averaged as Templar's code averages "
      "(scatter_reduce mean): each coordinate over the workers that sent it, "
      "not over all 8 (Alg. 1); the same wire",
    ),
    family,
    f"SparseLoCo every {EVERY}{'' if paper else f', top-{k}'}, mean over senders",
    ADAMW_RATES,
    SPARSELOCO_OUTER_RATES,
    rate_note=f"inner: {_ADAMW_NOTE}; outer: around the paper's 1.0",
  )


#: Every method of the study, by label, in the page's order.
ENTRIES: dict[str, Entry] = {e.method.label: e for e in _entries()}
DEFAULT_METHODS = tuple(ENTRIES)


def _centre(values: Sequence[float]) -> float:
  return values[len(values) // 2]


def grid_points(entry: Entry) -> list[dict[str, float]]:
  """The grid of ``entry`` as config overrides, the usual point first.

  Every-step methods: one point per rate. Periodic methods: a cross through
  the usual point (every inner rate at the usual outer rate, then every other
  outer rate at the usual inner rate).

  Examples:
    >>> [p["optimizer.learning_rate"] for p in grid_points(ENTRIES["dense"])]
    [0.003, 0.0015, 0.006]
    >>> len(grid_points(ENTRIES["diloco"]))
    5
  """
  lr, outer = "optimizer.learning_rate", "scheme.outer_learning_rate"
  rates = [_centre(entry.rates)] + [r for r in entry.rates if r != _centre(entry.rates)]
  if not entry.outer_rates:
    return [{lr: r} for r in rates]
  o = _centre(entry.outer_rates)
  points = [{lr: r, outer: o} for r in rates]
  return points + [
    {lr: _centre(entry.rates), outer: x} for x in entry.outer_rates if x != o
  ]


def rate_text(x: float) -> str:
  """A rate in few characters: ``1.5e-3``, ``3e-4``, ``0.02``, ``0.7``.

  Examples:
    >>> [rate_text(x) for x in (1.5e-3, 3e-3, 3e-4, 0.02, 0.7, 2.0)]
    ['1.5e-3', '3e-3', '3e-4', '0.02', '0.7', '2']
  """
  if x >= 0.01:
    return f"{x:g}"
  mantissa, exponent = f"{x:.6e}".split("e")
  return f"{float(mantissa):g}e{int(exponent)}"


def point_key(point: Mapping[str, float]) -> str:
  """A grid point's name (its workdir): ``lr3e-3`` or ``lr3e-3_outer0.7``.

  Examples:
    >>> point_key({"optimizer.learning_rate": 1.5e-3, "scheme.outer_learning_rate": 0.7})
    'lr1.5e-3_outer0.7'
  """
  parts = []
  for field, value in point.items():
    if field == "optimizer.learning_rate":
      parts.append(f"lr{rate_text(value)}")
    elif field == "scheme.outer_learning_rate":
      parts.append(f"outer{rate_text(value)}")
    else:
      parts.append(f"{field.rsplit('.', 1)[-1]}{rate_text(value)}")
  return "_".join(parts)


def run_count(labels: Sequence[str], seeds: int) -> int:
  """Training runs of one per-worker size: every grid point, then the seeds.

  Examples:
    >>> run_count(DEFAULT_METHODS, 3)
    109
  """
  return sum(len(grid_points(ENTRIES[x])) + seeds - 1 for x in labels)


def _finite(x) -> bool:
  return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _distance(point: Mapping[str, float], centre: Mapping[str, float]) -> float:
  """How far a point lies from the usual point: summed ``|log(v / usual)|``."""
  return sum(abs(math.log(point[k] / centre[k])) for k in centre)


def choose(grid: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
  """The point of a seed-0 grid the protocol keeps; ``None`` if none can be kept.

  Args:
    grid: one item per point, the usual point first: ``key``, ``point``
      (field -> value), ``final_bpb`` (the last eval; ``None`` or non-finite
      when the run never got there) and ``stopped`` (true or a message when
      the run stopped on non-finite steps).

  Returns:
    ``{"key", "point", "final_bpb", "tied", "edge"}``: the lowest finite
    final bpb of a run that did not stop; the points within
    :data:`TIE_BPB` of it are ``tied`` and the nearest to the usual point
    wins (summed ``|log|`` distance of its rates), then the lower rates.
    ``edge``: a chosen value is the smallest or largest of its field's
    values in the grid (the best rate may lie beyond it).

  Examples:
    >>> grid = [
    ...   {"key": "a", "point": {"lr": 2.0}, "final_bpb": 2.0, "stopped": None},
    ...   {"key": "b", "point": {"lr": 1.0}, "final_bpb": 1.9, "stopped": None},
    ...   {"key": "c", "point": {"lr": 4.0}, "final_bpb": 1.0, "stopped": "nan"},
    ... ]
    >>> choose(grid)["key"], choose(grid)["edge"]
    ('b', True)
  """
  if not grid:
    return None
  centre = grid[0]["point"]
  ok = [g for g in grid if not g.get("stopped") and _finite(g.get("final_bpb"))]
  if not ok:
    return None
  best = min(g["final_bpb"] for g in ok)
  tied = [g for g in ok if g["final_bpb"] - best <= TIE_BPB]
  pick = min(
    tied,
    key=lambda g: (
      _distance(g["point"], centre),
      sum(math.log(v) for v in g["point"].values()),
    ),
  )
  edge = False
  for field, value in pick["point"].items():
    values = sorted({g["point"][field] for g in grid})
    if len(values) > 1 and value in (values[0], values[-1]):
      edge = True
  return {
    "key": pick["key"],
    "point": dict(pick["point"]),
    "final_bpb": pick["final_bpb"],
    "tied": [g["key"] for g in tied if g is not pick],
    "edge": edge,
  }


def extension(grid: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
  """The next point beyond the edge the seed-0 choice sits at, or ``None``.

  A choice at a grid's edge says the best rate may lie beyond it, so the
  grid grows one step that way, by the ratio of the edge's two neighbouring
  values (x2 on a doubling grid), the chosen point's other fields kept. One
  field per step, the first at its edge; ``None`` when the choice is
  interior, there is none, or the point was already run.

  Examples:
    >>> grid = [
    ...   {"key": "a", "point": {"lr": 2.0}, "final_bpb": 2.0, "stopped": None},
    ...   {"key": "b", "point": {"lr": 1.0}, "final_bpb": 2.1, "stopped": None},
    ...   {"key": "c", "point": {"lr": 4.0}, "final_bpb": 1.9, "stopped": None},
    ... ]
    >>> extension(grid)
    {'lr': 8.0}
    >>> extension(grid[:2] + [{**grid[2], "final_bpb": 2.5}]) is None
    True
  """
  choice = choose(grid)
  if choice is None or not choice["edge"]:
    return None
  for field, value in choice["point"].items():
    values = sorted({g["point"][field] for g in grid})
    if len(values) < 2 or value not in (values[0], values[-1]):
      continue
    if value == values[-1]:
      beyond = value * (values[-1] / values[-2])
    else:
      beyond = value / (values[1] / values[0])
    point = {**choice["point"], field: float(f"{beyond:.6g}")}
    if all(g["point"] != point for g in grid):
      return point
  return None


def cross_through_choice(grid: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
  """The points of a cross through the seed-0 choice that were not run.

  A grid of two fields (inner and outer rate) starts as a cross through the
  usual point, which never pairs an unusual inner rate with an unusual outer
  rate. When the choice lies off the usual point, the study runs the cross
  through it: for each field, the grid's values on either side of the chosen
  one, the chosen point's other fields kept. A one-field grid, or a choice at
  the usual point, has nothing to add.

  Examples:
    >>> pts = [{"lr": 2.0, "o": 1.0}, {"lr": 1.0, "o": 1.0}, {"lr": 4.0, "o": 1.0},
    ...        {"lr": 2.0, "o": 0.5}, {"lr": 2.0, "o": 2.0}]
    >>> bpb = [2.0, 2.1, 2.2, 2.3, 1.9]
    >>> grid = [{"key": str(i), "point": p, "final_bpb": b, "stopped": None}
    ...         for i, (p, b) in enumerate(zip(pts, bpb))]
    >>> cross_through_choice(grid)
    [{'lr': 1.0, 'o': 2.0}, {'lr': 4.0, 'o': 2.0}]
  """
  choice = choose(grid)
  if choice is None:
    return []
  points = []
  for field, value in choice["point"].items():
    values = sorted({g["point"][field] for g in grid})
    i = values.index(value)
    for neighbour in values[max(i - 1, 0) : i] + values[i + 1 : i + 2]:
      point = {**choice["point"], field: neighbour}
      if all(g["point"] != point for g in grid) and point not in points:
        points.append(point)
  return points


def grown(grid: list[dict[str, Any]], max_extensions: int = MAX_EXTENSIONS):
  """Grows ``grid`` until its seed-0 choice is interior and its cross is run.

  Yields each point to run and expects it appended to ``grid`` before the
  next is asked for. A choice at an edge grows the grid beyond it first
  (:func:`extension`, at most ``max_extensions`` points in all); a choice off
  the usual point then gets its cross (:func:`cross_through_choice`), interior
  or at an edge the cap left, so ``max_extensions=0`` can still add the
  cross's points; it stops when neither adds a point. Each point is new and
  the values of a field grow only by the capped extensions, so it ends.
  """
  extensions = 0
  while True:
    beyond = extension(grid) if extensions < max_extensions else None
    if beyond is not None:
      extensions += 1
      yield beyond
      continue
    cross = cross_through_choice(grid)
    if not cross:
      return
    yield from cross


def chosen_run(method: Mapping[str, Any]) -> dict[str, Any] | None:
  """Seed 0's run at a method's chosen point (its grid's), or ``None``.

  ``method``: a study record with ``grid`` and ``choice``, as the JSON holds.
  """
  choice = method.get("choice")
  if choice is None:
    return None
  return next((g.get("run") for g in method["grid"] if g["key"] == choice["key"]), None)


def _has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if part not in node:
      return False
    node = node[part]
  return True


def protocol_split(config) -> tuple[dict[str, Any], list[str]]:
  """:data:`PROTOCOL_FIELDS` the program's config has, and those it lacks."""
  present = {k: v for k, v in PROTOCOL_FIELDS.items() if _has_field(config, k)}
  return present, [k for k in PROTOCOL_FIELDS if k not in present]


def unavailable(entry: Entry) -> str | None:
  """Why the program cannot run ``entry`` yet (an optimizer it lacks), or ``None``."""
  from train import optimizer

  name = entry.method.optimizer.get("name")
  known = (*optimizer.OPTIMIZERS, *optimizer.SELF_EXCHANGING)
  if name is not None and name not in known:
    return f"the program has no config.optimizer.name={name} yet"
  return None


def protocol(windows: Sequence[int], seeds: int, steps: int = 600) -> dict[str, Any]:
  """The protocol in words and values, as the JSON and the page carry it.

  A dense phase of ``w`` of ``steps`` steps sends ``w / steps`` of dense's
  bytes by itself, so it caps the whole run's ratio at ``steps / w``
  (said in ``dense_warmup``).
  """
  return {
    "fields": dict(PROTOCOL_FIELDS),
    "clipping": "every method clips each worker's own gradient at gpt_tiny's "
    "global norm 1.0 before any exchange (optimizer.clip_scope=worker)",
    "weight_decay": "AdamW's mask for every optimizer, DeMo's included: 0.1 on "
    "matrices and embeddings, none on norms and biases (optimizer.mask_decay=True)",
    "dense_warmup": f"every-step compressors: compressor.warmup_steps={DENSE_WARMUP} "
    "(gpt_tiny's AdamW warm-up); 1-bit and compressed-momentum Adam: "
    f"freeze_step={FREEZE_STEP} (1-bit Adam also at {SHORT_FREEZE_STEP}, the "
    "longest dense freeze that leaves the run at 20x, and with its warm-up's "
    f"gradients as int8 codes for {INT8_WARMUP['freeze_step']} steps or int4 "
    f"for {INT4_WARMUP['freeze_step']}, optimizer.warmup_bits); 0/1 Adam "
    "and DeMo: their own schedules; bytes "
    "counted over the whole run, dense phases included, so a dense phase of w "
    f"of the {steps} steps caps the run's ratio to dense at {steps}/w: "
    f"{steps / DENSE_WARMUP:.3g}x for the warm-up, {steps / FREEZE_STEP:.3g}x "
    "for the freeze",
    "selection": "each method's grid on seed 0; the lowest final validation bpb "
    f"wins; within {TIE_BPB:g} bpb a tie, the point nearest the family's usual "
    "value wins; a stopped or non-finite run is never chosen; a choice at its "
    "grid's edge grows the grid one step beyond that edge (the grid's own "
    f"ratio, x2 for AdamW's), up to {MAX_EXTENSIONS} points (a run with "
    "fewer leaves its choice flagged at the edge)",
    "periodic_grid": "a cross through the usual point: every inner rate at the "
    "usual outer rate, every outer rate at the usual inner rate; then, while the "
    "seed-0 choice sits at an edge, the grid grows beyond it, and while it lies "
    "off the usual point, the cross through it is run too (its neighbouring "
    "inner rates at the chosen outer rate, and the reverse)",
    "seeds": seeds,
    "windows_per_worker": list(windows),
    "every": EVERY,
    "quality": QUALITY,
    "bandwidths_gbps": list(BANDWIDTHS_GBPS),
  }


def _config(
  entry, *, seed, point, windows, steps, eval_every, protocol_fields, overrides
):
  fields = {
    **protocol_fields,
    "global_batch_size": transformer.WORKERS * windows,
    **point,
    **overrides,
  }
  return transformer.configure(
    entry.method, seed=seed, steps=steps, eval_every=eval_every, overrides=fields
  )


def _log(text: str) -> None:
  print(f"# study: {text}", file=sys.stderr, flush=True)


def _bandwidth_times(
  entry, runs, point, windows, steps, eval_every, protocol_fields, overrides, target
) -> dict[str, Any]:
  """Per link speed: the time to ``target`` over the seeds and the whole run's."""
  import gradcomp

  out = {}
  for gbps in BANDWIDTHS_GBPS:
    cluster = gradcomp.sim.Cluster(transformer.PRICED_WORKERS, bandwidth_gbps=gbps)
    hits, ends = [], []
    for r in runs:
      config = _config(
        entry,
        seed=r["seed"],
        point=point,
        windows=windows,
        steps=steps,
        eval_every=eval_every,
        protocol_fields=protocol_fields,
        overrides=overrides,
      )
      clock = transformer.reprice(r["sim_inputs"], config, cluster, steps)
      c = r["curve"]
      hit = transformer.time_to_target(c["step"], c["bpb"], clock, target)
      hits.append(None if hit is None else hit[1])
      ends.append(float(clock[-1]))
    reached = [h for h in hits if h is not None]
    out[f"{gbps:g}"] = {
      "to_target": None if not reached else _stats(reached)["mean"],
      "reached": len(reached),
      "seeds": len(runs),
      "whole_run": float(np.mean(ends)),
    }
  return out


def recommend(size: Mapping[str, Any]) -> dict[str, Any]:
  """What to pick at each link speed, from one per-worker size's summaries.

  In each family, at each of :data:`BANDWIDTHS_GBPS`: among the methods whose
  mean final bpb is within :data:`QUALITY` of dense AdamW's, the one with the
  least mean simulated time to the target (reached by every seed); ``None``
  where no method qualifies.
  """
  methods = size["methods"]
  dense = methods.get(transformer.BASELINE, {}).get("summary")
  bar = None if dense is None else dense["final_bpb"]["mean"] * (1 + QUALITY)
  out: dict[str, Any] = {"quality_bpb": bar, "picks": {}}
  for gbps in BANDWIDTHS_GBPS:
    key = f"{gbps:g}"
    picks = {}
    for family in FAMILIES:
      best = None
      for label, m in methods.items():
        s = m.get("summary")
        if m["family"] != family or s is None or bar is None:
          continue
        t = m["bandwidth"][key]
        keeps = s["final_bpb"]["mean"] <= bar  # False for NaN: a stopped seed.
        if not keeps or t["reached"] < t["seeds"] or not t["seeds"]:
          continue
        if best is None or t["to_target"] < best[1]:
          best = (label, t["to_target"])
      picks[family] = None if best is None else {"method": best[0], "seconds": best[1]}
    out["picks"][key] = picks
  return out


def _run_size(
  entries,
  windows,
  *,
  phase,
  steps,
  seeds,
  eval_every,
  runs_dir,
  reuse,
  overrides,
  protocol_fields,
  previous,
  priced_on,
  max_extensions=MAX_EXTENSIONS,
):
  """Grid and/or seeds of every entry at one per-worker size."""
  size: dict[str, Any] = {"windows_per_worker": windows, "methods": {}}
  eval_steps = sorted({*range(eval_every, steps + 1, eval_every), steps})
  meta = {}
  for entry in entries:
    label = entry.method.label
    kept = dict(previous.get("methods", {}).get(label, {}))
    record = {
      "family": entry.family,
      "title": entry.title,
      "method": dataclasses.asdict(entry.method),
      "rates": list(entry.rates),
      "outer_rates": list(entry.outer_rates),
      "rate_note": entry.rate_note,
    }

    def train(seed, point):
      config = _config(
        entry,
        seed=seed,
        point=point,
        windows=windows,
        steps=steps,
        eval_every=eval_every,
        protocol_fields=protocol_fields,
        overrides=overrides,
      )
      meta.update(batch=config.global_batch_size, context=config.dataset.context)
      workdir = runs_dir / f"w{windows}" / label / point_key(point) / f"seed{seed}"
      r = transformer.one_run(config, workdir, eval_steps, priced_on, reuse=reuse)
      meta.setdefault("workdir", workdir)
      _log(
        f"w{windows} {label} {point_key(point)} seed {seed}: {transformer.run_line(r)}"
      )
      return r

    def grid_run(point):
      r = train(0, point)
      return {
        "key": point_key(point),
        "point": point,
        "final_bpb": r["curve"]["bpb"][-1],
        "stopped": r.get("stopped"),
        "run": r,
      }

    if phase in ("grid", "all"):
      grid = [grid_run(point) for point in grid_points(entry)]
      for point in grown(grid, max_extensions):
        grid.append(grid_run(point))
    else:
      grid = kept.get("grid")
      if not grid:
        raise ValueError(
          f"--phase seeds needs {label}'s grid at {windows} windows per worker in "
          "the study's JSON: run --phase grid first (same --out, --steps, overrides)"
        )
    record["grid"] = grid
    record["choice"] = choose(grid)
    if phase in ("seeds", "all") and record["choice"] is not None:
      point = record["choice"]["point"]
      record["runs"] = [chosen_run(record)] + [train(s, point) for s in range(1, seeds)]
    elif phase == "grid" and (runs := seeds_kept(kept, record["choice"])):
      record["runs"] = runs
    size["methods"][label] = record
  size["global_batch_size"] = meta.get("batch", previous.get("global_batch_size"))
  size["context"] = meta.get("context", previous.get("context"))
  size["workdir"] = str(meta["workdir"]) if "workdir" in meta else None
  return size


def seeds_kept(kept: Mapping[str, Any], choice: Mapping[str, Any] | None):
  """The seeds ``kept`` (a method's earlier record) ran, if still at ``choice``'s point.

  A grid that grew keeps its choice's seeds when the point is the same, though
  the choice's flags (``edge``, ``tied``) may have changed with the grid.

  >>> old = {"choice": {"key": "lr6e-3", "edge": True}, "runs": ["seed 0"]}
  >>> seeds_kept(old, {"key": "lr6e-3", "edge": False})
  ['seed 0']
  >>> seeds_kept(old, {"key": "lr3e-3", "edge": False}) is None
  True
  """
  before = kept.get("choice")
  if before is None or choice is None or before["key"] != choice["key"]:
    return None
  return kept.get("runs") or None


def _summaries(size, entries, *, steps, eval_every, overrides, protocol_fields):
  """Target, per-method summaries over seeds, link speeds and the picks."""
  methods = size["methods"]
  dense = methods.get(transformer.BASELINE, {}).get("runs")
  if dense:
    target = float(np.mean([r["curve"]["bpb"][-1] for r in dense]))
    target += transformer.TARGET_MARGIN
    rule = f"{transformer.BASELINE}'s mean final bpb + {transformer.TARGET_MARGIN:g}"
  else:
    target, rule = math.nan, "no dense seeds: no target"
  size["target_bpb"], size["target_rule"] = target, rule
  for label, m in methods.items():
    runs = m.get("runs")
    if not runs:
      m["summary"] = None
      continue
    m["summary"] = transformer.summarize(runs, target)
    m["bandwidth"] = _bandwidth_times(
      entries[label],
      runs,
      m["choice"]["point"],
      size["windows_per_worker"],
      steps,
      eval_every,
      protocol_fields,
      overrides,
      target,
    )
  dense = (methods.get(transformer.BASELINE) or {}).get("summary") or {}
  dense_bytes = dense.get("wire_bytes_per_step")
  for m in methods.values():
    s = m["summary"]
    if s is not None:
      mine = s["wire_bytes_per_step"]
      s["bytes_ratio_to_dense"] = (
        None if not (mine and dense_bytes) else mine / dense_bytes
      )
  size["recommendation"] = recommend(size)


def load(out_dir: str | Path) -> dict[str, Any] | None:
  """``study.json`` under ``out_dir``, or ``None``."""
  path = Path(out_dir) / "study.json"
  return json.loads(path.read_text()) if path.is_file() else None


def run(
  methods: Sequence[str] | None = None,
  *,
  phase: str = "all",
  steps: int | None = None,
  seeds: int = SEEDS,
  windows: Sequence[int] = (WINDOWS_PER_WORKER,),
  eval_every: int = 100,
  out_dir: str = DEFAULT_OUT,
  reuse: bool = False,
  overrides: Mapping[str, Any] | None = None,
  page: str | Path | None = None,
  max_extensions: int = MAX_EXTENSIONS,
) -> dict[str, Any]:
  """Runs the protocol (module docstring), writes ``study.{json,md}``.

  Args:
    methods: labels of :data:`ENTRIES` (default: all); a method the program
      cannot run yet is skipped and listed under ``skipped``.
    phase: ``grid`` (seed 0 of every grid point), ``seeds`` (the other seeds
      at each chosen point; the grid from ``out_dir``'s JSON), ``all`` (both)
      or ``page`` (only render ``page``, default :data:`DEFAULT_PAGE`, from
      the JSON).
    steps: steps per run (default: the config's, 600).
    seeds: seeds at the chosen point, seed 0 the grid's.
    windows: windows per worker; the protocol runs at each.
    eval_every: eval interval in steps (the last step is always evaluated).
    out_dir: the JSON, the table and the runs' workdirs (``study_runs/``).
    reuse: read back runs already finished in their workdirs.
    overrides: dotted config fields set last on every run (smoke runs).
    page: render the recommendation page there from the JSON.
    max_extensions: points a grid may grow beyond an edge its choice sits at
      (:func:`extension`); 0 keeps the grids as they are (a choice at an
      edge stays flagged).

  Raises:
    ValueError: an unknown phase or method, a bad run shape, or ``seeds``
      without a grid.
  """
  from bench import schemes, study_page
  from bench.compress import machine_info

  checks.at_least("max_extensions", max_extensions, 0)
  if phase not in PHASES:
    raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
  if phase == "page":
    result = load(out_dir)
    if result is None:
      raise ValueError(f"no study.json under {out_dir}: run the study first")
    study_page.write(result, DEFAULT_PAGE if page is None else page)
    return result
  labels = list(methods or DEFAULT_METHODS)
  unknown = [x for x in labels if x not in ENTRIES]
  if unknown:
    raise ValueError(f"unknown methods {unknown}; known: {', '.join(ENTRIES)}")
  windows = [int(w) for w in windows]
  if not windows or min(windows) < 1:
    raise ValueError(f"windows per worker must be >= 1, got {windows}")
  steps = transformer.base_config().num_train_steps if steps is None else steps
  skipped = {x: why for x in labels if (why := unavailable(ENTRIES[x]))}
  entries = [ENTRIES[x] for x in labels if x not in skipped]
  if not entries:
    raise ValueError(f"no method the program can run: {skipped}")
  schemes.check_run(entries, seeds, steps, eval_every)
  overrides = dict(overrides or {})
  probe = transformer.base_config()
  protocol_fields, missing = protocol_split(probe)
  first = _config(
    entries[0],
    seed=0,
    point=grid_points(entries[0])[0],
    windows=windows[0],
    steps=steps,
    eval_every=eval_every,
    protocol_fields=protocol_fields,
    overrides=overrides,
  )
  if first.optimizer.warmup_steps >= steps:
    raise ValueError(
      f"steps={steps} must exceed the AdamW warm-up, "
      f"optimizer.warmup_steps={first.optimizer.warmup_steps}"
    )
  for x, why in skipped.items():
    _log(f"skipping {x}: {why}")
  if missing:
    _log(f"the program lacks the protocol's {', '.join(missing)}: runs without them")
  shape = {
    "steps": steps,
    "eval_every": eval_every,
    "overrides": overrides,
    "protocol": protocol(windows, seeds, steps),
  }
  previous = load(out_dir) or {}
  same = all(previous.get(k) == v for k, v in shape.items() if k != "protocol") and (
    previous.get("protocol", {}).get("fields") == shape["protocol"]["fields"]
  )
  if previous and not same:
    if phase == "seeds":
      raise ValueError(
        f"{out_dir}/study.json has another run shape (steps, eval interval, "
        "overrides or protocol): run --phase grid with these first"
      )
    _log(f"{out_dir}/study.json has another run shape: starting a new one")
    previous = {}
  info = machine_info()
  t_start = time.perf_counter()
  runs_dir = Path(out_dir) / "study_runs"
  priced_on = transformer.cluster()
  by_label = {e.method.label: e for e in entries}
  sizes = dict(previous.get("sizes", {}))
  for w in windows:
    size = _run_size(
      entries,
      w,
      phase=phase,
      steps=steps,
      seeds=seeds,
      eval_every=eval_every,
      runs_dir=runs_dir,
      reuse=reuse,
      overrides=overrides,
      protocol_fields=protocol_fields,
      previous=sizes.get(str(w), {}),
      priced_on=priced_on,
      max_extensions=max_extensions,
    )
    kept = sizes.get(str(w), {}).get("methods", {})
    size["methods"] = {
      **{k: v for k, v in kept.items() if k not in size["methods"]},
      **size["methods"],
    }
    all_entries = {**{k: ENTRIES[k] for k in size["methods"]}, **by_label}
    _summaries(
      size,
      all_entries,
      steps=steps,
      eval_every=eval_every,
      overrides=overrides,
      protocol_fields=protocol_fields,
    )
    sizes[str(w)] = size
  unigram, description = previous.get("unigram_bits_per_byte"), previous.get("dataset")
  for size in sizes.values():
    if unigram is None and size.get("workdir"):
      unigram, description = transformer.unigram_baseline(size["workdir"])
  # Every invocation that wrote into this study, in order: a study can run
  # method by method and phase by phase, each reading back the runs before it.
  this = command(labels, steps, windows, seeds, overrides, phase, max_extensions)
  earlier = previous.get("commands", [previous.get("command")])
  commands = [c for c in earlier if c and c != this] + [this]
  # The protocol ran at every size the JSON holds, not only this invocation's.
  shape["protocol"]["windows_per_worker"] = sorted(int(w) for w in sizes)
  result = {
    "suite": "study",
    **shape,
    "protocol_missing": missing,
    "skipped": skipped,
    "machine": info,
    "config": "configs/gpt_tiny.py",
    "workers": transformer.WORKERS,
    "seeds": seeds,
    "unigram_bits_per_byte": unigram,
    "dataset": description,
    "cluster": {
      "workers": transformer.PRICED_WORKERS,
      "bandwidths_gbps": list(BANDWIDTHS_GBPS),
      "note": f"{transformer.PRICED_WORKERS} homogeneous workers, 8 TFLOP/s, 25 us, "
      "ring all-reduce, the runs' per-worker batch kept",
    },
    "command": this,
    "commands": commands,
    "sizes": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))),
    "wall_s": time.perf_counter() - t_start + previous.get("wall_s", 0.0),
    "loadavg_end": list(os.getloadavg()),
  }
  table = study_page.render(result)
  print(table)
  path = write_json(out_dir, "study.json", result)
  Path(out_dir, "study.md").write_text(table)
  _log(f"wrote {path} and study.md ({result['wall_s']:.0f} s)")
  if page is not None:
    study_page.write(result, page)
  return result


def command(
  labels,
  steps,
  windows,
  seeds,
  overrides,
  phase: str = "all",
  max_extensions: int = MAX_EXTENSIONS,
) -> str:
  """The command line that reproduces a study (``--reuse`` reads runs back)."""
  parts = [f"python -m bench study --phase {phase} --reuse"]
  if list(labels) != list(DEFAULT_METHODS):
    parts.append(f"--methods {','.join(labels)}")
  if steps != 600:
    parts.append(f"--steps {steps}")
  if list(windows) != [WINDOWS_PER_WORKER]:
    parts.append(f"--windows-per-worker {','.join(str(w) for w in windows)}")
  if seeds != SEEDS:
    parts.append(f"--seeds {seeds}")
  if max_extensions != MAX_EXTENSIONS:
    parts.append(f"--max-extensions {max_extensions}")
  parts += [f"--override {k}={json.dumps(v)}" for k, v in overrides.items()]
  parts.append(f"--page {DEFAULT_PAGE}")
  return " ".join(parts)


def _value(text: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def cli(args: argparse.Namespace) -> None:
  """``python -m bench study``: the parsed flags to :func:`run`."""
  import jax
  from absl import logging

  from bench import workloads

  overrides = dict(workloads.SMOKE) if args.smoke else {}
  for item in args.override or ():
    key, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"python -m bench study: error: --override {item!r}: KEY=VALUE")
    overrides[key] = _value(value)
  try:
    windows = [int(w) for w in args.windows_per_worker.split(",") if w.strip()]
  except ValueError:
    raise SystemExit(
      f"python -m bench study: error: --windows-per-worker {args.windows_per_worker!r}"
    ) from None
  jax.config.update("jax_num_cpu_devices", transformer.WORKERS)
  logging.set_verbosity(logging.WARNING)
  try:
    run(
      [m for m in args.methods.split(",") if m.strip()] if args.methods else None,
      phase=args.phase,
      steps=args.steps,
      seeds=args.seeds,
      windows=windows,
      eval_every=args.eval_every,
      out_dir=args.out,
      reuse=args.reuse,
      overrides=overrides,
      page=args.page,
      max_extensions=args.max_extensions,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench study: error: {e}") from None


def add_parser(suites) -> argparse.ArgumentParser:
  """Adds ``study`` to ``python -m bench``'s sub-commands."""
  p = suites.add_parser(
    "study",
    help="the transformer study: every method at its own rate (grid on seed 0, "
    "then 3 seeds), one clipping rule and decay mask, dense warm-ups; the "
    "recommendation page from its JSON",
  )
  p.add_argument("--phase", default="all", choices=PHASES)
  p.add_argument("--methods", default=None, help=f"default: {','.join(ENTRIES)}")
  p.add_argument("--steps", type=int, default=None, help="default: the config's")
  p.add_argument("--seeds", type=int, default=SEEDS, help="seeds at the chosen rate")
  p.add_argument(
    "--windows-per-worker",
    default=str(WINDOWS_PER_WORKER),
    help="comma-separated per-worker batch sizes, e.g. 8,16",
  )
  p.add_argument("--eval-every", type=int, default=100)
  p.add_argument("--reuse", action="store_true", help="read back finished runs")
  p.add_argument("--out", default=DEFAULT_OUT, help="study.json, study.md, runs")
  p.add_argument("--page", default=None, help=f"render the page, e.g. {DEFAULT_PAGE}")
  p.add_argument(
    "--override", action="append", help="KEY=VALUE config field on every run"
  )
  p.add_argument("--smoke", action="store_true", help="bench.workloads.SMOKE's sizes")
  p.add_argument(
    "--max-extensions",
    type=int,
    default=MAX_EXTENSIONS,
    help="points a grid may grow beyond the edge its choice sits at (0: none)",
  )
  p.set_defaults(func=cli)
  return p
