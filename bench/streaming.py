"""Streaming DiLoCo on the transformer workload: loss, mean and peak bytes, WAN time.

``python -m bench streaming [--methods ...] [--seeds 1] [--reuse]
[--out bench_out/streaming/]``

The runs are the transformer suite's (``bench.transformer.run``:
the training program on ``configs/gpt_tiny.py``, 8 workers, AdamW inner
steps, 600 steps) with the methods of :data:`METHODS`:

* ``dense``: DDP AdamW, the fp32 all-reduce every step;
* ``diloco``: DiLoCo every H = 32 steps, outer Nesterov SGD (lr 0.7,
  momentum 0.9), dense pseudo-gradients;
* ``streaming_f4``: Streaming DiLoCo (Douillard et al. 2025, arXiv
  2501.18512) with F = 4 strided fragments of layers, one sent every 8
  steps, no overlap, the arriving global value replacing the fragment
  (``alpha = 0``);
* ``streaming_f4_t1`` .. ``streaming_f4_t5``: each fragment's outer update
  applied ``tau`` = 1 or 5 inner steps after it was sent, merged with
  ``alpha = 0.5`` (the paper's choice with overlap);
* ``eager_f4_t1``: Kale et al. 2025's eager updates at ``tau = 1``;
* ``split_f4_t1``: ``streaming_f4_t1`` with fragments of equal size that
  cut leaves (``split_leaves``), so each step's peak is 1/F of a round;
* ``streaming_f4_fp8``, ``streaming_f4_fp4``, ``streaming_f4_topk``: F = 4,
  ``tau = 1``, ``alpha = 0.5`` with outer gradients through ``fp8`` (E4M3),
  ``fp4`` (E2M1, 32-value blocks) or top-k 1 %, each with error feedback,
  one fused buffer per fragment.

**WAN clocks.** Each run's exchange (its ``sim.json``: the fragments' bytes
from the compiled HLO, the overlap, the FLOPs per step) is re-priced
(:func:`bench.transformer.reprice`) on described clusters of 4 to
16 datacentres x 8 workers at 1 to 100 Gbit/s between datacentres and 10 to
100 ms latency (:data:`WAN`). A datacentre is one DiLoCo worker: its 8
workers run the inner steps as data parallelism inside it, on 8 times the
run's per-worker batch in the time one worker takes for its own (the
inside-datacentre all-reduce is taken as free: it is NVLink against a WAN).
DDP all-reduces over the WAN every step. Two model sizes are priced: the
run's own (gpt_tiny, 445,952 parameters), and GPT-2 small's 124M by scaling
every byte count and the FLOPs per step by the ratio of parameters (both
are linear in the parameter count for these codecs and for a fixed number
of tokens; attention's extra FLOPs are left out): an extrapolation, marked
as such, of where bandwidth rather than latency decides.

Writes ``transformer.{json,md,png}`` (the runs' suite) and
``streaming.{json,md}`` (the WAN tables) to ``--out``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import output, transformer
from bench.transformer import Method

DILOCO_EVERY = transformer.DILOCO_EVERY
FRAGMENTS = 4
#: The merge weight of the local params when an arrival is overlapped
#: (Streaming DiLoCo's experiments with overlap use 0.5).
ALPHA = 0.5
_STREAM = {
  "name": "local_sgd",
  "every": DILOCO_EVERY,
  **transformer.OUTER,
  "fragments": FRAGMENTS,
}


def _overlapped(
  label: str, tau: int, why: str, compressor: str = "none", **kw
) -> Method:
  return Method(
    label,
    {**_STREAM, "overlap": tau, "alpha": ALPHA, **kw.pop("scheme", {})},
    compressor,
    kw.pop("hyperparameters", {}),
    "single" if compressor != "none" else "none",
    why=why,
  )


METHODS: dict[str, Method] = {
  m.label: m
  for m in (
    transformer.METHODS["dense"],
    transformer.METHODS["diloco"],
    Method(
      "streaming_f4",
      _STREAM,
      why=f"{FRAGMENTS} strided fragments, one every {DILOCO_EVERY // FRAGMENTS} "
      "steps, no overlap, alpha 0",
    ),
    _overlapped(
      "streaming_f4_t1", 1, "fragments arrive 1 step after sending, alpha 0.5"
    ),
    _overlapped(
      "streaming_f4_t5", 5, "fragments arrive 5 steps after sending, alpha 0.5"
    ),
    _overlapped(
      "eager_f4_t1",
      1,
      "eager updates (Kale et al. 2025) at tau 1",
      scheme={"eager": True},
    ),
    _overlapped(
      "split_f4_t1",
      1,
      "fragments of equal size that cut leaves (split_leaves), tau 1, alpha 0.5",
      scheme={"split_leaves": True},
    ),
    _overlapped("streaming_f4_fp8", 1, "outer gradients in fp8 E4M3, EF", "fp8"),
    _overlapped("streaming_f4_fp4", 1, "outer gradients in fp4 E2M1, EF", "fp4"),
    _overlapped(
      "streaming_f4_topk",
      1,
      "outer gradients top-k 1 %, EF",
      "topk",
      hyperparameters={"ratio": transformer.TOPK_RATIO},
    ),
  )
}
DEFAULT_METHODS = tuple(METHODS)

#: The described WAN clusters: datacentres, Gbit/s between them, latency (ms).
WAN = tuple(itertools.product((4, 16), (1.0, 10.0, 100.0), (10.0, 100.0)))
#: GPT-2 small's parameters (with tied embeddings at 50,257 tokens).
GPT2_SMALL_PARAMS = 124_439_808


def _scaled(inputs: Mapping[str, Any], factor: float) -> dict[str, Any]:
  """``sim.json`` with every byte count and the FLOPs multiplied by ``factor``."""

  def scale(x, key=""):
    if isinstance(x, Mapping):
      return {k: scale(v, k) for k, v in x.items()}
    if isinstance(x, list):
      return [scale(v, key) for v in x]
    if isinstance(x, int | float) and ("wire" in key or "bytes" in key or "-" in key):
      return x * factor
    return x

  out = scale(dict(inputs))
  out["flops_per_step"] = inputs["flops_per_step"] * factor
  return out


def wan_seconds(result: Mapping[str, Any], scale: float = 1.0) -> dict:
  """``{label: {cluster: seconds of the whole run}}`` on every cluster of :data:`WAN`.

  ``scale`` multiplies every byte count and the FLOPs per step first.
  """
  import gradcomp

  steps = result["steps"]
  out: dict[str, dict[str, float]] = {}
  for label, entry in result["results"].items():
    inputs = entry["summary"]["sim_inputs"]
    if scale != 1.0:
      inputs = _scaled(inputs, scale)
    config = _config(label, result)
    out[label] = {}
    for dcs, gbps, ms in WAN:
      cluster = gradcomp.sim.Cluster(dcs, bandwidth_gbps=gbps, latency_us=ms * 1e3)
      seconds = transformer.reprice(inputs, config, cluster, steps)
      out[label][_key(dcs, gbps, ms)] = float(seconds[-1])
  return out


def _config(label: str, result: Mapping[str, Any]):
  """The config a run of ``result`` trained with (its schedule prices it)."""
  return transformer.configure(
    METHODS.get(label) or transformer.METHODS[label],
    seed=0,
    steps=result["steps"],
    eval_every=result["eval_every"],
    overrides=result["overrides"],
  )


def _key(dcs: int, gbps: float, ms: float) -> str:
  return f"{dcs}x8, {gbps:g} Gbps, {ms:g} ms"


def _peak(inputs: Mapping[str, Any], label: str, result: Mapping[str, Any]) -> float:
  """The run's peak bytes per step, as logged; derived for runs priced before it was.

  Those runs logged the mean: every step's own bytes plus one round's on the
  round steps, amortised, so the peak is the mean plus the round's bytes times
  the fraction of steps without one.
  """
  if "peak_bytes_per_step" in inputs:
    return inputs["peak_bytes_per_step"]
  from train import optimizer

  steps = result["steps"]
  config = _config(label, result)
  is_round = optimizer.round_steps(config)
  rounds = sum(is_round(s) for s in range(1, steps + 1))
  mean = result["results"][label]["summary"]["wire_bytes_per_step"]
  if config.scheme.name == "none":  # Every step is the round.
    return mean
  return mean + sum(inputs["round_wire"].values()) * (1 - rounds / steps)


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
  """Loss, mean and peak bytes per method, beside DiLoCo's; WAN seconds."""
  res = result["results"]
  rows = {}
  diloco = res.get("diloco", {}).get("summary")
  diloco_peak = (
    None if diloco is None else _peak(diloco["sim_inputs"], "diloco", result)
  )
  for label, entry in res.items():
    s = entry["summary"]
    inputs = s["sim_inputs"]
    peak = _peak(inputs, label, result)
    rows[label] = {
      "final_bpb": s["final_bpb"],
      "wire_bytes_per_step": s["wire_bytes_per_step"],
      "peak_bytes_per_step": peak,
      "fragment_bytes": [sum(w.values()) for w in inputs.get("fragment_wire", [])],
      "bpb_over_diloco": None
      if diloco is None
      else s["final_bpb"]["mean"] / diloco["final_bpb"]["mean"] - 1.0,
      "peak_over_diloco": None
      if diloco is None or peak is None
      else peak / diloco_peak,
    }
  # The runs' parameters: DiLoCo's dense round, 4 bytes each.
  params = res["diloco"]["summary"]["sim_inputs"]["round_wire"]["all-reduce"] // 4
  return {
    "rows": rows,
    "params": params,
    "wan": wan_seconds(result),
    "wan_gpt2_small": wan_seconds(result, GPT2_SMALL_PARAMS / params),
    "wan_scale": GPT2_SMALL_PARAMS / params,
  }


def format_tables(result: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
  """The loss and bytes table, then the WAN tables (gpt_tiny, GPT-2 small scaled)."""
  lines = [
    f"Streaming DiLoCo on gpt_tiny: {result['steps']} steps, {result['seeds']} "
    f"seed(s), 8 workers, DiLoCo every {DILOCO_EVERY} steps, F = {FRAGMENTS}. "
    "Final bpb: last eval, mean ± std over seeds; bytes per worker per step "
    "from the compiled HLO: mean over the run and the largest single step",
    "",
    "| method | final bpb | vs DiLoCo | mean bytes/step | peak bytes/step "
    "| peak / DiLoCo's | fragments' bytes |",
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
  ]
  for label, r in summary["rows"].items():
    over, peak = r["bpb_over_diloco"], r["peak_bytes_per_step"]
    peak_ratio = r["peak_over_diloco"]
    lines.append(
      f"| {label} | {transformer._bpb(r['final_bpb'])} "
      f"| {'-' if over is None else f'{over:+.1%}'} "
      f"| {r['wire_bytes_per_step']:,.0f} "
      f"| {'-' if peak is None else f'{peak:,.0f}'} "
      f"| {'-' if peak_ratio is None else f'{peak_ratio:.3f}'} "
      f"| {', '.join(f'{b:,}' for b in r['fragment_bytes']) or '-'} |"
    )
  for key, title in (
    ("wan", f"gpt_tiny as run ({summary['params']:,} parameters)"),
    (
      "wan_gpt2_small",
      f"bytes and FLOPs scaled x{summary['wan_scale']:.0f} to GPT-2 small's "
      f"{GPT2_SMALL_PARAMS:,} parameters (an extrapolation)",
    ),
  ):
    table = summary[key]
    clusters = list(next(iter(table.values())))
    lines += [
      "",
      f"Simulated seconds of the whole run on datacentres x 8 workers, {title}:",
      "",
      "| method | " + " | ".join(clusters) + " |",
      "| --- | " + " | ".join("---:" for _ in clusters) + " |",
    ]
    for label, row in table.items():
      lines.append(
        f"| {label} | "
        + " | ".join(transformer._seconds(row[c]) for c in clusters)
        + " |"
      )
  return "\n".join(lines)


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 1,
  steps: int | None = None,
  eval_every: int = 100,
  target_bpb: float | None = None,
  out_dir: str = "bench_out/streaming",
  overrides: Mapping[str, Any] | None = None,
  reuse: bool = False,
) -> dict[str, Any]:
  """Runs the methods through the transformer suite, then the WAN tables.

  Raises:
    ValueError: as ``transformer.run`` (without ``target_bpb``, ``dense``
      must be among the methods); or without ``diloco`` (every ratio is
      against it).
  """
  methods = list(methods or METHODS.values())
  if "diloco" not in {m.label for m in methods}:
    raise ValueError("the methods must include 'diloco': every ratio is against it")
  result = transformer.run(
    methods,
    seeds=seeds,
    steps=steps,
    eval_every=eval_every,
    target_bpb=target_bpb,
    out_dir=out_dir,
    overrides=overrides,
    reuse=reuse,
  )
  summary = summarize(result)
  table = format_tables(result, summary)
  print(table)
  output.write_json(out_dir, "streaming.json", summary)
  Path(out_dir, "streaming.md").write_text(table + "\n")
  return {"transformer": result, "streaming": summary}
