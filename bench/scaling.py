"""Scaling factor and throughput, layer-wise vs LayerFusion, on a simulated cluster.

Paper 000 §5 (Table 4, Figs. 3-5): every compressor of the registry on
ResNet-20, ResNet-50 and the LSTM, 2 to 16 workers on 20 Gbps Ethernet,
compressed layer-wise (one call per tensor) and with LayerFusion (the plan of
the §4.3 heuristic search, ``gradcomp.fusion.heuristic_search``). Nothing is trained:
the wait-free-backprop timeline (``gradcomp.sim.CostModel``) plays one iteration
out, and reports the scaling factor ``T_1 / T_n`` (eq. 1; ``T_1`` is one
worker alone, no compression, no exchange) and the throughput ``n * b / T_n``
(samples/s; an LSTM sample is one sequence of 35 tokens).

Two sources of ``Comp(x)``, both reported:

* **measured**: each compressor's profile measured on this backend (one
  device, ``gradcomp.fusion.profile``), cached as JSON in ``--profiles`` under the
  same names and hyper-parameters as the ``search`` suite
  (``bench.fusion.SEARCH_COMPRESSORS``), so either suite reuses the other's;
  a missing one is measured on the :data:`MEASURE_SIZES` grid. Compute
  comes from the models' FLOPs at ``gradcomp.sim.model_workload.DEFAULT_TFLOPS`` with
  Table 3's batch, exactly as ``gradcomp.sim.model_workload`` does: this
  machine's own forward and backward would be a CPU's, not a GPU's. Each
  timed call is a whole jitted program, so a layer-wise leaf also pays the
  dispatch of one (a real step dispatches one program for all leaves).
* **paper**: a V100 as paper 000 describes it (``bench.paper``). Compute from
  FLOPs at :func:`bench.paper.v100_tflops` (8.76 TFLOP/s: a V100's measured
  fp32 ResNet-50 training throughput, 56 % of peak) with Table 3's batch.
  ``Comp`` is a synthetic :class:`~gradcomp.sim.Profile` per compressor,
  ``Comp(x) = c + s x`` (a per-call overhead and a per-value slope),
  calibrated to Table 1 (``bench.paper.v100_profile``). Table 1 gives one
  total per method, read as the layer-wise one (161 calls on ResNet-50); the
  split between ``c`` and ``s`` is the one §3.1 allows with the largest
  slope, ``Comp(2^20) = 2 Comp(2^4)`` (the overhead "not doubling" over that
  range), i.e. the least favourable to fusion. Fusing adds a concatenation
  and a split, priced as copies at the V100's 900 GB/s. Compressors without
  a Table 1 row use a related row scaled by the ratio of memory-traffic
  floors (``bench.paper.TABLE1_PROXY``); ``none`` costs nothing.

In both, the wire payload per size comes from tracing the compressor
(``gradcomp.profile.traced_wire``, no devices needed) and ``Comm`` from the
ring alpha-beta model of ``gradcomp.sim.Cluster`` (20 Gbps, 25 us per message
unless told otherwise); a layer-wise leaf is priced as a 1-D buffer of its
size, as the planner does.

The suite then checks three claims of paper 000 §5.1 against its own numbers
(:func:`claims`): LayerFusion improves every compressor, Sketch-Fusion
(``layerfusion(sketch_topk)``) has the best scaling factor, PowerSGD gains
little from fusion.

Run: ``python -m bench scaling [--sources paper] [--only topk,dgc]``;
writes ``scaling.json``, ``scaling.md`` and ``scaling_<source>.png`` to
``--out``. With the profiles cached it takes well under a minute on a 2-core
CPU; a first run measures the 12 profiles first (about 2-6 minutes there,
most of it compiling and timing the 2^22 and 2^24 sizes).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

import gradcomp
from bench import paper
from bench.fusion import SEARCH_COMPRESSORS
from bench.output import write_json
from gradcomp.compressors import registry
from gradcomp.models import shapes
from gradcomp.sim.model_workload import DEFAULT_TFLOPS, model_workload
from gradcomp.sim.profile import AUTO_SIZES

SOURCES = ("measured", "paper")
MODELS = ("resnet20", "resnet50", "lstm_ptb")
WORKERS = (2, 4, 8, 16)
PLANS = ("layerwise", "layerfusion")
#: Grid a missing measured profile is timed on: the grid of
#: ``layerfusion(plan="auto")`` (2^4, 2^8, ..., 2^24) plus 2^22, between which
#: lie the largest tensors of ResNet-50 (2.4M values) and the LSTM (6.5M); a
#: CPU's time jumps between 2^20 and 2^24 (caches, fresh pages), so a straight
#: line across that gap overprices them. About 60 % of the time of the full
#: ``DEFAULT_SIZES`` grid.
MEASURE_SIZES = tuple(sorted({*AUTO_SIZES, 2**22}))
#: Relative gain below which the claims call a fusion gain "little": at most
#: half the median gain of the other compressors.
LITTLE = 0.5


def measured_profile(
  name: str,
  kwargs: Mapping,
  profile_dir: str | None,
  sizes: Sequence[int] = MEASURE_SIZES,
  repeats: int = 3,
) -> tuple[gradcomp.sim.Profile, dict]:
  """The profile measured on this backend, from ``profile_dir`` when cached there.

  Returns the profile and a note ``{"path", "cached", "seconds"}``.
  """
  tx = registry.get(name, **kwargs)
  path = os.path.join(profile_dir, f"{name}.json") if profile_dir else None
  if path and os.path.exists(path):
    profile = gradcomp.sim.Profile.load(path)
    try:
      profile.check_for(tx)
    except ValueError as e:
      raise ValueError(f"{path}: {e}; remove it to measure again") from None
    return profile, {"path": path, "cached": True, "seconds": 0.0}
  print(f"measuring {name} at {len(sizes)} sizes ...", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  profile = gradcomp.fusion.profile(tx, sizes, repeats=repeats)
  seconds = time.perf_counter() - t0
  if path:
    os.makedirs(profile_dir, exist_ok=True)
    profile.save(path)
  return profile, {"path": path, "cached": False, "seconds": seconds}


# -- simulation ------------------------------------------------------------------


def batch_size(model: str) -> int:
  """Per-worker batch of ``model``: Table 3's; for a model not in it
  (``gpt2_small``), ``gradcomp.sim.model_workload.BATCH_SIZES``' (8 sequences
  of 1,024 tokens: a sample is a sequence).

  Raises:
    ValueError: a model with neither.
  """
  from gradcomp.sim.model_workload import BATCH_SIZES

  found = paper.TABLE3_BATCH.get(model, BATCH_SIZES.get(model))
  if found is None:
    raise ValueError(f"no batch size for model {model!r}")
  return found


def workload(model: str, source: str, paper_tflops: float | None = None):
  """The model's :class:`~gradcomp.fusion.ModelWorkload` for a cost source."""
  batch = batch_size(model)
  if source == "paper":
    tflops = paper.v100_tflops() if paper_tflops is None else paper_tflops
  elif source == "measured":
    tflops = DEFAULT_TFLOPS
  else:
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  return model_workload(model, batch_size=batch, tflops=tflops)


def simulate(
  profile: gradcomp.sim.Profile,
  work: gradcomp.sim.Workload,
  workers: int,
  *,
  bandwidth_gbps: float = paper.BANDWIDTH_GBPS,
  latency_us: float = 25.0,
  batch: int = 1,
  eps: float = 1e-3,
) -> dict[str, dict]:
  """Layer-wise and LayerFusion (heuristic plan) timelines on ``workers`` workers.

  Returns ``{plan: row}``; a row holds groups, iteration_ms, scaling_factor
  (eq. 1), throughput (``workers * batch / T_n``), comp_ms, comm_ms,
  exposed_comm_ms (``T_n - T_1 - comp``: exchange not hidden by backprop) and
  search_ms.
  """
  cluster = gradcomp.sim.Cluster(workers, bandwidth_gbps, latency_us)
  cost = gradcomp.sim.CostModel(profile, cluster, work)
  rows = {}
  for plan in PLANS:
    t0 = time.perf_counter()
    if plan == "layerwise":
      boundaries = tuple(range(1, cost.num_leaves))
    else:
      boundaries, _ = gradcomp.fusion.heuristic_search(cost, eps)
    search_ms = (time.perf_counter() - t0) * 1e3
    t = cost.timeline(boundaries)
    comp = sum(t.comp_seconds)
    comm = sum(t.comm_seconds)
    rows[plan] = {
      "groups": len(t.groups),
      "iteration_ms": t.iteration_seconds * 1e3,
      "scaling_factor": t.scaling_factor,
      "throughput": workers * batch / t.iteration_seconds,
      "comp_ms": comp * 1e3,
      "comm_ms": comm * 1e3,
      "exposed_comm_ms": (comm - t.overlap_seconds) * 1e3,
      "search_ms": search_ms,
    }
  return rows


# -- claims ----------------------------------------------------------------------


def _at(rows, model, workers, compressor=None, plan=None):
  return [
    r
    for r in rows
    if r["model"] == model
    and r["workers"] == workers
    and (compressor is None or r["compressor"] == compressor)
    and (plan is None or r["plan"] == plan)
  ]


def _one(rows, model, workers, compressor, plan):
  (row,) = _at(rows, model, workers, compressor, plan)
  return row


def _overhead(r) -> str:
  return (
    f"{r['compressor']} {r['plan']}: Comp {r['comp_ms']:.1f} ms + exposed Comm "
    f"{r['exposed_comm_ms']:.1f} ms"
  )


def claims(rows: Sequence[dict], eps: float = 1e-3) -> dict:
  """Paper 000 §5.1's three claims, evaluated on one source's rows.

  At the largest worker count, per model:

  1. LayerFusion improves every compressor: fused scaling factor >=
     layer-wise for each, up to ``eps`` (the search never returns a plan
     slower than layer-wise by more than its ``eps``, so this holds by
     construction; ``gains`` shows by how much).
  2. Sketch-Fusion is best: ``layerfusion(sketch_topk)`` has the highest
     scaling factor of all compressors and plans.
  3. PowerSGD gains little: its relative gain from fusion is at most
     :data:`LITTLE` times the median gain of the other compressors (``none``
     excluded: plain all-reduce has nothing to compress).

  Args:
    rows: the rows of one source (``run``'s ``result["rows"]``, filtered).
    eps: tolerance of claim 1, the search's stopping tolerance.

  Returns:
    ``{claim: {"holds": bool | None, "models": {model: {...}}}}``; a failed
    model carries a one-line ``reason`` naming the cost that decides it.
  """
  workers = max(r["workers"] for r in rows)
  models = list(dict.fromkeys(r["model"] for r in rows))
  names = list(dict.fromkeys(r["compressor"] for r in rows))
  out = {
    "improves_every_compressor": {"models": {}},
    "sketch_fusion_best": {"models": {}},
    "powersgd_gains_little": {"models": {}},
  }
  for model in models:
    gains = {}
    for name in names:
      lw = _one(rows, model, workers, name, "layerwise")
      lf = _one(rows, model, workers, name, "layerfusion")
      gains[name] = lf["scaling_factor"] / lw["scaling_factor"] - 1
    worse = [n for n, g in gains.items() if g < -eps]
    entry = {
      "holds": not worse,
      "gains": gains,
      "min_gain": min(gains, key=gains.get),
      "below_1_percent": [n for n, g in gains.items() if g < 0.01],
    }
    if worse:
      n = worse[0]
      entry["reason"] = (
        f"{n}: {_overhead(_one(rows, model, workers, n, 'layerfusion'))} vs "
        f"{_overhead(_one(rows, model, workers, n, 'layerwise'))}"
      )
    out["improves_every_compressor"]["models"][model] = entry

    if "sketch_topk" in names:
      sketch = _one(rows, model, workers, "sketch_topk", "layerfusion")
      best = max(_at(rows, model, workers), key=lambda r: r["scaling_factor"])
      entry = {
        "holds": best["scaling_factor"] <= sketch["scaling_factor"],
        "sketch_fusion": sketch["scaling_factor"],
        "best": f"{best['compressor']} {best['plan']}",
        "best_scaling_factor": best["scaling_factor"],
        "rank": 1
        + sum(
          r["scaling_factor"] > sketch["scaling_factor"]
          for r in _at(rows, model, workers)
        ),
        "of": len(_at(rows, model, workers)),
      }
      if not entry["holds"]:
        comp = sketch["comp_ms"] - best["comp_ms"]
        comm = sketch["exposed_comm_ms"] - best["exposed_comm_ms"]
        entry["reason"] = (
          f"{_overhead(sketch)} vs {_overhead(best)}: sketch_topk loses on "
          f"{'Comp' if comp >= comm else 'exposed Comm'}"
        )
      out["sketch_fusion_best"]["models"][model] = entry
    else:
      out["sketch_fusion_best"]["models"][model] = {
        "holds": None,
        "reason": "sketch_topk not simulated",
      }

    others = [g for n, g in gains.items() if n not in ("powersgd", "none")]
    if "powersgd" in gains and others:
      median = statistics.median(others)
      entry = {
        "holds": gains["powersgd"] <= LITTLE * median,
        "gain": gains["powersgd"],
        "median_other_gain": median,
        "rank_from_top": 1 + sum(g > gains["powersgd"] for g in others),
        "of": len(others) + 1,
      }
      if not entry["holds"]:
        lw = _one(rows, model, workers, "powersgd", "layerwise")
        lf = _one(rows, model, workers, "powersgd", "layerfusion")
        comp = lw["comp_ms"] - lf["comp_ms"]
        comm = lw["exposed_comm_ms"] - lf["exposed_comm_ms"]
        entry["reason"] = (
          f"fusion cuts PowerSGD's Comp {lw['comp_ms']:.1f} -> {lf['comp_ms']:.1f} ms "
          f"and exposed Comm {lw['exposed_comm_ms']:.1f} -> "
          f"{lf['exposed_comm_ms']:.1f} ms; mostly "
          f"{'Comp (per-call overhead)' if comp >= comm else 'Comm'}"
        )
      out["powersgd_gains_little"]["models"][model] = entry
    else:
      out["powersgd_gains_little"]["models"][model] = {
        "holds": None,
        "reason": "powersgd (or a compressor to compare with) not simulated",
      }
  for claim in out.values():
    verdicts = [m["holds"] for m in claim["models"].values()]
    claim["holds"] = None if None in verdicts else all(verdicts)
    claim["workers"] = workers
  return out


# -- the suite -------------------------------------------------------------------


def run(
  models: Sequence[str] = MODELS,
  workers: Sequence[int] = WORKERS,
  *,
  sources: Sequence[str] = SOURCES,
  compressors: Sequence[str] | None = None,
  bandwidth_gbps: float = paper.BANDWIDTH_GBPS,
  latency_us: float = 25.0,
  paper_tflops: float | None = None,
  profile_dir: str | None = "bench_out/profiles",
  measure_sizes: Sequence[int] = MEASURE_SIZES,
  paper_sizes: Sequence[int] = paper.PROFILE_SIZES,
  repeats: int = 3,
  eps: float = 1e-3,
  out_dir: str = "bench_out/",
  plots: bool = True,
) -> dict:
  """Simulates every model x compressor x workers x plan for each cost source.

  Args:
    models: keys of ``shapes.MODELS``.
    workers: worker counts (eq. 1's ``n``).
    sources: ``"measured"`` and / or ``"paper"`` (see the module docstring).
    compressors: names from ``bench.fusion.SEARCH_COMPRESSORS`` (default all).
    bandwidth_gbps, latency_us: the ring cluster.
    paper_tflops: V100 compute throughput of the paper source (default
      ``bench.paper.v100_tflops()``).
    profile_dir: cache of measured profiles (JSON per compressor).
    measure_sizes: grid a missing measured profile is timed on.
    paper_sizes: grid of the synthetic profiles (and their traced wire).
    repeats: timed calls per size when measuring.
    eps: the heuristic's stopping tolerance (§4.3).
    out_dir: where ``scaling.json``, ``scaling.md`` and the PNGs go.
    plots: write the PNGs.

  Returns:
    The result written to ``scaling.json``.
  """
  t_start = time.perf_counter()
  compressors = tuple(SEARCH_COMPRESSORS) if compressors is None else tuple(compressors)
  for name in compressors:
    if name not in SEARCH_COMPRESSORS:
      raise ValueError(
        f"unknown compressor {name!r}; valid: {list(SEARCH_COMPRESSORS)}"
      )
  from gradcomp.sim.model_workload import BATCH_SIZES

  valid = sorted({*paper.TABLE3_BATCH, *BATCH_SIZES})
  for model in models:
    if model not in valid:
      raise ValueError(f"unknown model {model!r}; valid: {valid}")
  for source in sources:
    if source not in SOURCES:
      raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
  workers = tuple(workers)
  if not workers or any(isinstance(n, bool) or int(n) != n or n < 1 for n in workers):
    raise ValueError(f"workers must be integers >= 1, got {workers}")
  tflops = paper.v100_tflops() if paper_tflops is None else paper_tflops
  result = {
    "setting": {
      "models": list(models),
      "workers": list(workers),
      "bandwidth_gbps": bandwidth_gbps,
      "latency_us": latency_us,
      "topology": "ring",
      "batch": {m: batch_size(m) for m in models},
      "eps": eps,
      "layerfusion_plan": "heuristic_search (paper 000 §4.3)",
    },
    "sources": {},
    "rows": [],
    "claims": {},
  }
  for source in sources:
    t0 = time.perf_counter()
    profiles, notes = _profiles(
      source, compressors, profile_dir, measure_sizes, paper_sizes, repeats
    )
    result["sources"][source] = {
      **_describe(source, tflops),
      "profiles": notes,
      "profile_seconds": time.perf_counter() - t0,
    }
    rows = []
    for model in models:
      work = workload(model, source, tflops)
      batch = batch_size(model)
      for name in compressors:
        for n in workers:
          sim = simulate(
            profiles[name],
            work.workload,
            n,
            bandwidth_gbps=bandwidth_gbps,
            latency_us=latency_us,
            batch=batch,
            eps=eps,
          )
          for plan, row in sim.items():
            rows.append(
              {
                "source": source,
                "model": model,
                "compressor": name,
                "workers": n,
                "plan": plan,
                "single_worker_ms": work.workload.single_worker_seconds * 1e3,
                **row,
              }
            )
      print(f"{source} {model}: done", file=sys.stderr, flush=True)
    result["rows"] += rows
    result["claims"][source] = claims(rows, eps)
    powersgd = result["claims"][source]["powersgd_gains_little"]
    if source == "paper" and powersgd["holds"] is False:
      powersgd["note"] = (
        "the paper source gives every Table 1 row the same per-call share "
        "(§3.1's bound), so PowerSGD's per-call overhead fuses away like the "
        "others'; Table 1's one total cannot show the per-value (low-rank "
        "matmul) bottleneck §5.1 blames"
      )
  result["seconds"] = time.perf_counter() - t_start
  write_json(out_dir, "scaling.json", result)
  text = format_tables(result)
  with open(os.path.join(out_dir, "scaling.md"), "w") as f:
    f.write(text + "\n")
  if plots:
    for source in sources:
      _plot(result, source, os.path.join(out_dir, f"scaling_{source}.png"))
  print(text)
  return result


def _profiles(source, compressors, profile_dir, measure_sizes, paper_sizes, repeats):
  """Per compressor: its profile for ``source`` and a note on where it came from."""
  profiles, notes = {}, {}
  for name in compressors:
    kwargs = SEARCH_COMPRESSORS[name]
    if source == "measured":
      profiles[name], note = measured_profile(
        name, kwargs, profile_dir, measure_sizes, repeats
      )
      note.update(backend=profiles[name].backend, sizes=list(profiles[name].sizes))
    else:
      profiles[name] = paper.v100_profile(name, kwargs, paper_sizes)
      total, origin = paper.table1_ms(name, kwargs)
      per_call, per_value = paper.calibrate(total)
      single = per_call + per_value * shapes.RESNET50_NUM_PARAMS
      note = {
        "resnet50_layerwise_ms": total,
        "origin": origin,
        "per_call_ms": per_call * 1e3,
        "per_million_values_ms": per_value * 1e9,
        "resnet50_single_buffer_ms": single * 1e3,
      }
    notes[name] = {"compressor": profiles[name].compressor, **note}
  return profiles, notes


def _describe(source: str, tflops: float) -> dict:
  if source == "measured":
    return {
      "compute_tflops": DEFAULT_TFLOPS,
      "compute": f"FLOPs at gradcomp.sim.model_workload.DEFAULT_TFLOPS = {DEFAULT_TFLOPS:g} "
      "TFLOP/s",
      "comp": "measured on this backend (gradcomp.fusion.profile, 1 device)",
    }
  return {
    "compute_tflops": tflops,
    "compute": f"FLOPs at {tflops:.2f} TFLOP/s (V100 fp32 ResNet-50 at "
    f"{paper.V100_RESNET50_FP32_IMAGES_PER_S:g} img/s, NVIDIA DeepLearningExamples)",
    "comp": f"Table 1 calibrated, Comp(x) = c + s x with Comp(2^20) = "
    f"{paper.FIG1B_GROWTH:g} Comp(2^4); fusion copies at {paper.V100_HBM_GBPS:g} GB/s",
  }


# -- output ----------------------------------------------------------------------


def _sf(rows, model, name, plan, workers) -> str:
  return " / ".join(
    f"{_one(rows, model, n, name, plan)['scaling_factor']:.2f}" for n in workers
  )


def _yes(holds) -> str:
  return {True: "yes", False: "NO", None: "n/a"}[holds]


def format_claims(claims_: dict) -> list[str]:
  lines = []
  c = claims_["improves_every_compressor"]
  lines.append(
    f"1. LayerFusion improves every compressor ({c['workers']} workers): "
    f"{_yes(c['holds'])}"
  )
  for model, m in c["models"].items():
    low = m["min_gain"]
    flat = m["below_1_percent"]
    lines.append(
      f"   - {model}: smallest gain {low} {m['gains'][low]:+.1%}; "
      f"{len(m['gains']) - len(flat)} of {len(m['gains'])} gain >= 1 %"
      + (f" (not: {', '.join(flat)})" if flat else "")
      + (f"; {m['reason']}" if "reason" in m else "")
    )
  c = claims_["sketch_fusion_best"]
  lines.append(f"2. Sketch-Fusion has the best scaling factor: {_yes(c['holds'])}")
  for model, m in c["models"].items():
    if m["holds"] is None:
      lines.append(f"   - {model}: {m['reason']}")
      continue
    lines.append(
      f"   - {model}: sketch_topk layerfusion {m['sketch_fusion']:.3f}, rank "
      f"{m['rank']} of {m['of']}; best {m['best']} {m['best_scaling_factor']:.3f}"
      + (f"; {m['reason']}" if "reason" in m else "")
    )
  c = claims_["powersgd_gains_little"]
  lines.append(
    f"3. PowerSGD gains little (<= {LITTLE:g} x median of the others): "
    f"{_yes(c['holds'])}"
  )
  for model, m in c["models"].items():
    if m["holds"] is None:
      lines.append(f"   - {model}: {m['reason']}")
      continue
    lines.append(
      f"   - {model}: gain {m['gain']:+.1%}, median of the others "
      f"{m['median_other_gain']:+.1%}, gain rank {m['rank_from_top']} of {m['of']} "
      "(largest first)" + (f"; {m['reason']}" if "reason" in m else "")
    )
  if "note" in c:
    lines.append(f"   Note: {c['note']}.")
  return lines


def format_tables(result: dict) -> str:
  s = result["setting"]
  workers = s["workers"]
  top = max(workers)
  lines = [
    f"Simulated ring of {', '.join(map(str, workers))} workers at "
    f"{s['bandwidth_gbps']:g} Gbps, {s['latency_us']:g} us per message; "
    f"LayerFusion = {s['layerfusion_plan']}; scaling factor = T_1 / T_n (eq. 1)",
  ]
  for source, info in result["sources"].items():
    rows = [r for r in result["rows"] if r["source"] == source]
    names = list(dict.fromkeys(r["compressor"] for r in rows))
    lines += [
      "",
      f"## Source: {source}",
      "",
      f"Compute: {info['compute']}. Comp: {info['comp']}.",
    ]
    for model in s["models"]:
      t1 = next(r["single_worker_ms"] for r in rows if r["model"] == model)
      lines += [
        "",
        f"### {model} ({source}; T_1 = {t1:.1f} ms, batch {s['batch'][model]})",
        "",
        f"| compressor | layer-wise SF @ {' / '.join(map(str, workers))} "
        f"| LayerFusion SF | groups @ {top} | Comp ms lw / lf @ {top} "
        f"| exposed Comm ms lw / lf @ {top} | samples/s lw / lf @ {top} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
      ]
      for name in names:
        lw = _one(rows, model, top, name, "layerwise")
        lf = _one(rows, model, top, name, "layerfusion")
        lines.append(
          f"| {name} | {_sf(rows, model, name, 'layerwise', workers)} "
          f"| {_sf(rows, model, name, 'layerfusion', workers)} "
          f"| {lf['groups']} | {lw['comp_ms']:.1f} / {lf['comp_ms']:.1f} "
          f"| {lw['exposed_comm_ms']:.1f} / {lf['exposed_comm_ms']:.1f} "
          f"| {lw['throughput']:.0f} / {lf['throughput']:.0f} |"
        )
    table4 = top == paper.MAX_WORKERS  # Table 4 is for 16 GPUs
    lines += [
      "",
      f"### Throughput at {top} workers ({source}), samples/s: layer-wise / "
      "LayerFusion (gain)"
      + ("; paper = Table 4 of paper 000, 16 V100s" if table4 else ""),
      "",
      "| compressor | " + " | ".join(s["models"]) + " |",
      "| --- |" + " ---: |" * len(s["models"]),
    ]
    for name in names:
      cells = []
      for model in s["models"]:
        lw = _one(rows, model, top, name, "layerwise")["throughput"]
        lf = _one(rows, model, top, name, "layerfusion")["throughput"]
        cell = f"{lw:.0f} / {lf:.0f} ({lf / lw - 1:+.0%})"
        p_lw = paper.TABLE4_THROUGHPUT["layerwise"].get(name, {}).get(model)
        p_lf = paper.TABLE4_THROUGHPUT["layerfusion"].get(name, {}).get(model)
        if table4 and p_lf is not None:
          cell += (
            f"; paper {p_lw} / {p_lf} ({p_lf / p_lw - 1:+.0%})"
            if p_lw
            else f"; paper - / {p_lf}"
          )
        cells.append(cell)
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
      "",
      f"### Claims ({source})",
      "",
      *format_claims(result["claims"][source]),
    ]
  return "\n".join(lines)


def _plot(result: dict, source: str, path: str) -> None:
  """Scaling factor vs workers: one panel per model, solid LayerFusion, dashed layer-wise."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D

  rows = [r for r in result["rows"] if r["source"] == source]
  models = result["setting"]["models"]
  workers = result["setting"]["workers"]
  names = list(dict.fromkeys(r["compressor"] for r in rows))
  # tab20's dark shades first, so that up to 10 lines get 10 distinct hues.
  cmap = plt.get_cmap("tab20")
  palette = [cmap(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]

  def colors(i):
    return palette[i % len(palette)]

  fig, axes = plt.subplots(
    1, len(models), figsize=(4.2 * len(models) + 2.2, 4.2), squeeze=False
  )
  for ax, model in zip(axes[0], models, strict=True):
    for i, name in enumerate(names):
      for plan, style in (("layerfusion", "-"), ("layerwise", "--")):
        sf = [_one(rows, model, n, name, plan)["scaling_factor"] for n in workers]
        ax.plot(workers, sf, style, color=colors(i), marker=".", linewidth=1.3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(n) for n in workers])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("workers")
    ax.set_title(model)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("scaling factor T_1 / T_n")
  handles = [
    Line2D([], [], color=colors(i), label=name) for i, name in enumerate(names)
  ]
  handles += [
    Line2D([], [], color="k", linestyle="-", label="LayerFusion"),
    Line2D([], [], color="k", linestyle="--", label="layer-wise"),
  ]
  s = result["setting"]
  fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
  fig.suptitle(
    f"Simulated scaling factor, {source} costs ({s['bandwidth_gbps']:g} Gbps ring)"
  )
  fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
