"""Convergence: eval accuracy against steps and wall time (paper 000 §5.2, Fig. 6).

Fig. 6 trains ResNet-20 / ResNet-50 with Sketch-Fusion SGD, layer-wise DGC and
the FP32 baseline and plots top-1 accuracy against time. Here every run is the
real training program, ``train.train.train_and_evaluate``, on config overrides:

* **digits** (``configs/default.py``: MLP on scikit-learn digits, 8 workers):
  each method of :data:`METHODS` for ``seeds`` seeds (``config.seed``: init
  and data order, as ``--config.seed``; sketch_topk's hash seed stays at its
  default), evaluated every ``eval_every`` steps; final accuracy mean ± std
  over seeds, and the target check: Sketch-Fusion within :data:`TARGET_PP`
  percentage points of dense;
* **resnet20** (``configs/resnet20_cifar10.py`` on synthetic data): a few
  steps per method, one seed, for throughput (samples/s) only.

**Workloads** (``--workload``, :mod:`bench.workloads`). The seeded
runs above are ``digits`` by default; ``--workload gpt_tiny`` runs the same
methods on ``configs/gpt_tiny.py`` (the 2-layer GPT on bytes of text, AdamW)
and reports the final validation bits per byte (lower is better) in place of
accuracy. Under AdamW a method's ``optimizer`` fields, tuned for digits' SGD
with momentum (DGC's momentum 0, signSGD's lr 1e-4), are not applied: every
method trains with the config's AdamW, as in the transformer suite. The kept
fraction stays :data:`RATIO` and Sketch-Fusion's plan ``auto`` (measured
once per process). The target check becomes: Sketch-Fusion's mean final bpb
at most ``workloads.BPB_MARGIN`` = 0.1 bits per byte above dense's. Samples
are then windows of ``dataset.context`` bytes. The ResNet-20 throughput part
is the same for either workload (its own config, the methods as listed).

Runs go seed-major (every method once, then the next seed), so drift of a
shared machine's load spreads over methods. The auto plan's profile is
measured once per process (``gradcomp.fusion.profile_for`` caches it), so the later
seeds of Sketch-Fusion reuse it and get the same plan.

Wall time. Each ``metrics.jsonl`` row carries ``samples_per_sec`` over the
steps since the previous row, timed from the end of step 1 (its compile
excluded) and restarted after every eval and checkpoint. The time of an eval
is the sum over rows of ``steps x global_batch / samples_per_sec``
(``train_seconds``): seconds of training steps only (no compile, eval,
checkpoint or logging). Beside it the JSON keeps ``elapsed_seconds`` (``train.logs.elapsed_seconds``: wall time since the
run's ``started`` row, step 1's compile, evals and checkpoints included).

Run: ``python -m bench convergence [--seeds 3] [--steps 600]``. Writes
``convergence.json``, ``convergence.md`` and ``convergence.png`` (accuracy
against step and against time: mean over seeds, min-max band) to ``--out``,
and each run's workdir (``metrics.jsonl``, ``config.json``, ``plan.json``;
checkpoints deleted) under ``--out/convergence_runs/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import workloads
from bench.output import write_json
from bench.workloads import DIGITS, Workload

#: Kept fraction of top-k, DGC and sketch_topk: the default config's 0.05 (0.01
#: diverged on the 9.6K-parameter MLP), the same for all three.
RATIO = 0.05
#: Sketch-Fusion's final accuracy may be at most this much below dense's.
TARGET_PP = 0.5


@dataclasses.dataclass(frozen=True)
class Method:
  """One curve: a compressor, its plan and the optimizer fields it changes.

  Attributes:
    label: name in tables, plots and ``--methods``.
    compressor: registered compressor name (``config.compressor.name``).
    plan: ``config.fusion.plan``.
    hyperparameters: ``config.compressor`` fields.
    optimizer: ``config.optimizer`` fields overridden.
    why: one line on the choice, copied to the JSON.
  """

  label: str
  compressor: str
  plan: str
  hyperparameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  optimizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  why: str = ""


METHODS: dict[str, Method] = {
  m.label: m
  for m in (
    Method("dense", "none", "layerwise", why="FP32 all-reduce per tensor (baseline)"),
    Method(
      "dgc",
      "dgc",
      "layerwise",
      {"ratio": RATIO, "momentum": 0.9},
      {"momentum": 0.0},
      why="DGC (layer-wise) applies momentum itself (momentum correction), "
      "so SGD without momentum after it, as its docstring says",
    ),
    Method(
      "sketch_fusion",
      "sketch_topk",
      "auto",
      {"ratio": RATIO},
      why="the default config: layerfusion(sketch_topk), auto plan",
    ),
    Method("topk", "topk", "layerwise", {"ratio": RATIO}, why="top-k with EF"),
    Method(
      "signsgd",
      "signsgd",
      "layerwise",
      optimizer={"learning_rate": 1e-4},
      why="majority vote in {-1,0,1}: lr 1e-4 (momentum 0.9), best final "
      "accuracy of 1e-4, 3e-4, 1e-3, 3e-3, 1e-2 on seed 0; larger ones "
      "peak early, then the eval loss grows",
    ),
    # Survey 004 §4.1 (issue 17); not in the CLI's default set.
    Method("onebit_sgd", "onebit_sgd", "layerwise", why="1 bit, per-column means, EF"),
    Method(
      "fixed_point_8",
      "fixed_point",
      "layerwise",
      {"bits": 8},
      why="<1, 7> fixed point, stochastic rounding, no EF (Gupta et al.)",
    ),
    Method(
      "fixed_point_12",
      "fixed_point",
      "layerwise",
      {"bits": 12},
      why="<1, 11> fixed point, stochastic rounding, no EF",
    ),
    Method(
      "dynamic_fixed_point_12",
      "dynamic_fixed_point",
      "layerwise",
      {"bits": 12},
      why="12 bits, an exponent per leaf from the overflow rate (Courbariaux "
      "et al.): the claim that 12 bits lose little",
    ),
  )
}


def _digits_config():
  return DIGITS.config()


def for_workload(method: Method, workload: Workload) -> Method:
  """``method`` as it runs on ``workload``: without its optimizer fields
  unless the workload trains with SGD (module docstring)."""
  if workload.sgd or not method.optimizer:
    return method
  return dataclasses.replace(
    method, optimizer={}, why=method.why + " (its SGD fields not applied: AdamW)"
  )


def _resnet20_config():
  from configs import resnet20_cifar10

  config = resnet20_cifar10.get_config()
  config.dataset.synthetic = True
  # Throughput only: one small eval batch, not 1,000 padded images.
  config.dataset.num_test = 64
  config.eval_batch_size = 64
  return config


def configure(
  base: Callable[[], Any],
  method: Method,
  *,
  seed: int,
  steps: int,
  eval_every: int,
  log_every: int | None = None,
):
  """``base()`` with ``method``'s compressor, plan and optimizer fields.

  Logs every ``log_every`` steps (default: every eval, so each eval row has a
  throughput row at its step) and checkpoints only at the end.
  """
  from configs import default

  config = base()
  config.seed = seed
  config.compressor = default.compressor(method.compressor, **method.hyperparameters)
  config.fusion.plan = method.plan
  for key, value in method.optimizer.items():
    config.optimizer[key] = value
  config.num_train_steps = steps
  config.num_epochs = None
  config.eval_every_steps = eval_every
  config.log_every_steps = log_every or eval_every
  config.checkpoint_every_steps = steps
  return config


def eval_curve(
  rows: Sequence[Mapping[str, Any]], batch_size: int, workload: Workload = DIGITS
) -> dict[str, Any]:
  """The eval points of one run's ``metrics.jsonl`` rows, with their time.

  ``eval_{workload.key}`` is the workload's metric (``eval_accuracy`` on
  digits). ``train_seconds`` at step ``s`` is the sum over throughput rows up
  to ``s`` of ``(step - previous step) * batch_size / samples_per_sec``
  (interpolated in the step between rows); a row without a rate (``null``)
  takes the run's mean rate.
  """
  train_rows = sorted(
    (r for r in rows if "samples_per_sec" in r), key=lambda r: r["step"]
  )
  deltas = np.diff([0] + [r["step"] for r in train_rows])
  rates = np.asarray(
    [r["samples_per_sec"] or np.nan for r in train_rows], np.float64
  ).reshape(-1)
  known = np.isfinite(rates) & (rates > 0)
  if known.any() and not known.all():  # The run's mean rate, samples per second.
    rates = np.where(known, rates, deltas[known].sum() / (deltas / rates)[known].sum())
  seconds = np.concatenate([[0.0], np.cumsum(deltas * batch_size / rates)])
  steps = [0] + [r["step"] for r in train_rows]
  evals = [r for r in rows if "eval_loss" in r]
  curve = {
    "step": [r["step"] for r in evals],
    f"eval_{workload.key}": [workload.value(r) for r in evals],
    "eval_loss": [r["eval_loss"] for r in evals],
    "train_seconds": [float(np.interp(r["step"], steps, seconds)) for r in evals],
  }
  return curve


def elapsed_at_evals(rows: Sequence[Mapping[str, Any]]) -> list[float]:
  """``train.logs.elapsed_seconds`` at each eval row.

  Wall time from the run's ``started`` row (written once the step is built):
  step 1's compile, the evals, logging and checkpoints included.
  """
  from train import logs

  elapsed = logs.elapsed_seconds(list(rows))
  return [e for r, e in zip(rows, elapsed, strict=True) if "eval_loss" in r]


def throughput(rows: Sequence[Mapping[str, Any]], batch_size: int, skip: int) -> float:
  """Samples/s over the steps after ``skip``: their samples over their seconds.

  Each throughput row covers the steps since the previous one; rows without a
  rate (``null``) are left out with their steps.
  """
  timed = sorted(
    (r for r in rows if "samples_per_sec" in r and r["step"] > skip),
    key=lambda r: r["step"],
  )
  steps = np.diff([skip] + [r["step"] for r in timed])
  rates = np.asarray([r["samples_per_sec"] or np.nan for r in timed], np.float64)
  known = np.isfinite(rates) & (rates > 0)
  if not known.any():
    return math.nan
  return float(
    steps[known].sum() * batch_size / (steps * batch_size / rates)[known].sum()
  )


def run_one(config, workdir: str | Path) -> dict[str, Any]:
  """Trains ``config`` afresh in ``workdir``; its metrics rows and summary."""
  from train import logs, train

  workdir = Path(workdir)
  shutil.rmtree(workdir, ignore_errors=True)  # Never resume a previous run.
  start = time.perf_counter()
  result = train.train_and_evaluate(config, workdir)
  seconds = time.perf_counter() - start
  shutil.rmtree(workdir / train.CHECKPOINT_DIR, ignore_errors=True)
  rows = logs.read_metrics(workdir / logs.METRICS_FILE)
  plan = json.loads((workdir / train.PLAN_FILE).read_text())
  wire = [r["wire_bytes_per_step"] for r in rows if "wire_bytes_per_step" in r]
  return {
    "workdir": str(workdir),
    "rows": rows,
    "final": dict(result.eval_metrics),
    "run_seconds": seconds,
    "groups": len(plan["groups"]) if "groups" in plan else None,
    "wire_bytes_per_step": wire[-1] if wire else None,
  }


def _stats(values: Sequence[float]) -> dict[str, Any]:
  a = np.asarray(values, np.float64)
  return {
    "mean": float(a.mean()),
    "std": float(a.std(ddof=1)) if a.size > 1 else None,  # Over seeds.
    "min": float(a.min()),
    "max": float(a.max()),
    "values": a.tolist(),
  }


def summarize(
  runs: Sequence[Mapping[str, Any]], workload: Workload = DIGITS
) -> dict[str, Any]:
  """Mean / min / max over seeds of the eval curves of one method's runs.

  Keys name the workload's metric: ``final_accuracy``, ``accuracy_mean`` on
  digits; ``final_bpb``, ``bpb_mean`` on gpt_tiny.
  """
  key = workload.key
  curves = [r["curve"] for r in runs]
  steps = curves[0]["step"]
  if any(c["step"] != steps for c in curves):
    raise ValueError("runs of one method evaluated at different steps")
  acc = np.asarray([c[f"eval_{key}"] for c in curves])
  out = {
    "step": steps,
    f"{key}_mean": acc.mean(0).tolist(),
    f"{key}_min": acc.min(0).tolist(),
    f"{key}_max": acc.max(0).tolist(),
    f"final_{key}": _stats(acc[:, -1]),
    "final_loss": _stats([c["eval_loss"][-1] for c in curves]),
  }
  for key in ("train_seconds", "elapsed_seconds"):
    if all(key in c for c in curves):
      out[f"{key}_mean"] = np.mean([c[key] for c in curves], 0).tolist()
  out["samples_per_sec"] = _stats([r["samples_per_sec"] for r in runs])
  out["run_seconds"] = _stats([r["run_seconds"] for r in runs])
  return out


def target_check(
  summaries: Mapping[str, Mapping[str, Any]], workload: Workload = DIGITS
) -> dict[str, Any] | None:
  """Sketch-Fusion's mean final metric against dense's; ``None`` if one is absent.

  On digits: at most :data:`TARGET_PP` points of accuracy below dense's
  (``difference_pp``); on gpt_tiny at most ``workloads.BPB_MARGIN`` bits per
  byte above (``difference_bpb``: dense's bpb minus Sketch-Fusion's).
  """
  if not {"dense", "sketch_fusion"} <= set(summaries):
    return None
  w = workload
  dense = summaries["dense"][f"final_{w.key}"]["mean"]
  sketch = summaries["sketch_fusion"][f"final_{w.key}"]["mean"]
  tol = w.tolerance(TARGET_PP)
  worse = "below" if w.higher_is_better else "above"
  return {
    "rule": f"sketch_fusion mean final {w.metric} at most {tol:g} {w.unit} "
    f"{worse} dense's",
    "dense": dense,
    "sketch_fusion": sketch,
    w.difference_key: w.advantage(sketch, dense),
    "tolerance": tol,
    "unit": w.unit,
    "passed": w.within(sketch, dense, TARGET_PP),
  }


def _log(text: str) -> None:
  print(f"# convergence: {text}", file=sys.stderr, flush=True)


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 3,
  steps: int = 600,
  eval_every: int = 50,
  throughput_steps: int = 12,
  throughput_skip: int = 2,
  throughput_methods: Sequence[Method] | None = None,
  out_dir: str = "bench_out",
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """Runs the suite, prints its tables, writes ``convergence.{json,md,png}``.

  Args:
    methods: the curves (default: all of :data:`METHODS`).
    seeds: seeded runs per method, seeds ``0 .. seeds - 1``.
    steps: training steps of each seeded run.
    eval_every: eval (and throughput log) interval, in steps.
    throughput_steps: steps of each ResNet-20 run; 0 skips ResNet-20.
    throughput_skip: first steps of a ResNet-20 run left out of samples/s.
    throughput_methods: the ResNet-20 runs (default: ``methods``).
    out_dir: where the outputs and the runs' workdirs go.
    workload: the seeded runs' base config and metric (its overrides
      included); its name keys the result (``result["digits"]``).
  """
  import jax

  from bench.compress import machine_info

  w = workload
  methods = list(METHODS.values()) if methods is None else list(methods)
  throughput_methods = methods if throughput_methods is None else throughput_methods
  methods = [for_workload(m, w) for m in methods]
  for name, value in (("seeds", seeds), ("steps", steps), ("eval_every", eval_every)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  runs_dir = Path(out_dir) / "convergence_runs"
  t_start = time.perf_counter()
  info = machine_info()
  _log(
    f"{len(methods)} methods x {seeds} seeds x {steps} steps on {w.name}, "
    f"{jax.device_count()} workers ({info['backend']}), {info['cpu_count']} CPUs"
  )
  batch = w.config().global_batch_size
  per_method: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
  for seed in range(seeds):
    for m in methods:
      config = configure(w.config, m, seed=seed, steps=steps, eval_every=eval_every)
      r = run_one(config, runs_dir / w.name / m.label / f"seed{seed}")
      r["seed"] = seed
      r["curve"] = eval_curve(r["rows"], batch, w)
      r["curve"]["elapsed_seconds"] = elapsed_at_evals(r["rows"])
      r["samples_per_sec"] = throughput(r["rows"], batch, skip=0)
      del r["rows"]
      per_method[m.label].append(r)
      _log(
        f"{w.name} {m.label} seed {seed}: {w.key} "
        f"{r['curve'][f'eval_{w.key}'][-1]:.4f}, {r['run_seconds']:.1f} s"
      )
  summaries = {label: summarize(rs, w) for label, rs in per_method.items()}
  seeded = {
    "config": w.config_file,
    "overrides": dict(w.overrides),
    "steps": steps,
    "eval_every": eval_every,
    "global_batch_size": batch,
    "seeds": seeds,
    "methods": {
      label: {"summary": summaries[label], "runs": per_method[label]}
      for label in per_method
    },
    "target": target_check(summaries, w),
  }
  resnet = None
  if throughput_steps > 0:
    resnet = _resnet20_throughput(
      throughput_methods, throughput_steps, throughput_skip, runs_dir
    )
    resnet["skipped"] = {
      m.label: "not selected" for m in methods if m.label not in resnet["methods"]
    }
  # The seeded runs' methods (as adapted to the workload) win a shared label.
  every = {m.label: m for m in (*throughput_methods, *methods)}
  result = {
    "suite": "convergence",
    "machine": info,
    "workload": w.describe(),
    "methods": {label: dataclasses.asdict(m) for label, m in every.items()},
    w.name: seeded,
    "resnet20": resnet,
    "wall_s": time.perf_counter() - t_start,
    "loadavg_end": list(os.getloadavg()),
  }
  table = format_tables(result)
  print(table)
  path = write_json(out_dir, "convergence.json", result)
  Path(out_dir, "convergence.md").write_text(table + "\n")
  png = plot(result, Path(out_dir) / "convergence.png")
  print(f"\nwrote {path}, convergence.md, {png.name} ({result['wall_s']:.0f} s)")
  return result


def _resnet20_throughput(
  methods: Sequence[Method], steps: int, skip: int, runs_dir: Path
) -> dict[str, Any]:
  """One short ResNet-20 run per method on synthetic CIFAR-10: samples/s."""
  if steps <= skip:
    raise ValueError(f"throughput_steps={steps} must exceed throughput_skip={skip}")
  batch = _resnet20_config().global_batch_size
  rows = {}
  for m in methods:
    config = configure(
      _resnet20_config, m, seed=0, steps=steps, eval_every=steps, log_every=1
    )
    r = run_one(config, runs_dir / "resnet20" / m.label)
    r["samples_per_sec"] = throughput(r["rows"], batch, skip=skip)
    del r["rows"]
    rows[m.label] = r
    _log(
      f"resnet20 {m.label}: {r['samples_per_sec']:,.0f} samples/s, "
      f"{r['run_seconds']:.1f} s"
    )
  return {
    "config": "configs/resnet20_cifar10.py (dataset.synthetic=True)",
    "steps": steps,
    "skipped_steps": skip,
    "global_batch_size": batch,
    "methods": rows,
  }


def _hp(m: Mapping[str, Any]) -> str:
  parts = [f"{k}={v}" for k, v in m["hyperparameters"].items()]
  parts += [f"opt.{k}={v}" for k, v in m["optimizer"].items()]
  return ", ".join(parts) or "-"


def format_tables(result: Mapping[str, Any]) -> str:
  """Markdown tables of a :func:`run` result."""
  w = workloads.get(result.get("workload"))
  d, mi = result[w.name], result["machine"]
  unit = "%" if w.higher_is_better else "bits/byte"
  time_note = (
    "train s: steps x batch / logged samples/s, training steps only "
    "(no compile, eval, checkpoint)"
  )
  lines = [
    f"{w.heading()}, {mi['device_count']} workers ({mi['backend']}), {d['steps']} "
    f"steps of {d['global_batch_size']}, {d['seeds']} seeds; final {w.metric} "
    f"mean ± std over seeds (ddof=1); {time_note}; elapsed s: wall time from "
    f"the run's start row (train.logs.elapsed_seconds: compile, evals and "
    f"checkpoint included)",
    "",
    f"| method | compressor | plan (groups) | hyper-parameters | final {w.key} "
    f"({unit}) | min - max | train s | elapsed s | samples/s | wire bytes/step |",
    "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for label, entry in d["methods"].items():
    s, m, run0 = entry["summary"], result["methods"][label], entry["runs"][0]
    fa = s[f"final_{w.key}"]
    secs = s["train_seconds_mean"][-1]
    lines.append(
      f"| {label} | {m['compressor']} | {m['plan']} ({run0['groups'] or '-'}) "
      f"| {_hp(m)} | {w.fmt_stats(fa)} "
      f"| {w.fmt(fa['min'])} - {w.fmt(fa['max'])} | {secs:.2f} "
      f"| {s['elapsed_seconds_mean'][-1]:.2f} "
      f"| {s['samples_per_sec']['mean']:,.0f} | {run0['wire_bytes_per_step']:,} |"
    )
  t = d["target"]
  if t is not None:
    lines += [
      "",
      f"target: Sketch-Fusion {w.fmt(t['sketch_fusion'])} vs dense "
      f"{w.fmt(t['dense'])} {unit}: {t[w.difference_key]:+.{3 if w.from_loss else 2}f} "
      f"{w.unit} better (tolerance -{t['tolerance']:g} {w.unit}): "
      f"{'PASS' if t['passed'] else 'FAIL'}",
    ]
  r = result["resnet20"]
  if r is not None:
    lines += [
      "",
      f"ResNet-20, synthetic CIFAR-10, {mi['device_count']} workers, "
      f"{r['steps']} steps of {r['global_batch_size']} (first "
      f"{r['skipped_steps']} not timed); throughput only",
      "",
      "| method | plan (groups) | samples/s | ms/step | wire bytes/step | run s |",
      "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, row in r["methods"].items():
      sps = row["samples_per_sec"]
      lines.append(
        f"| {label} | {result['methods'][label]['plan']} ({row['groups'] or '-'}) "
        f"| {sps:,.0f} | {1e3 * r['global_batch_size'] / sps:.0f} "
        f"| {row['wire_bytes_per_step']:,} | {row['run_seconds']:.0f} |"
      )
    lines += [f"\n{label} not run: {why}" for label, why in r["skipped"].items()]
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str | Path) -> Path:
  """Eval accuracy against step and time: mean over seeds, min-max band."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  w = workloads.get(result.get("workload"))
  d, key = result[w.name], w.key
  fig = Figure(figsize=(11, 4.2), layout="constrained")
  FigureCanvasAgg(fig)
  by_step, by_time = fig.subplots(1, 2, sharey=True)
  for label, entry in d["methods"].items():
    s = entry["summary"]
    for ax, x in ((by_step, s["step"]), (by_time, s["train_seconds_mean"])):
      (line,) = ax.plot(x, s[f"{key}_mean"], marker=".", label=label)
      ax.fill_between(
        x, s[f"{key}_min"], s[f"{key}_max"], color=line.get_color(), alpha=0.2
      )
  by_step.set(xlabel="step", ylabel=w.axis_label)
  by_time.set(xlabel="seconds of training steps (from samples/s)")
  if w.higher_is_better:  # Accuracy: up to 1; a loss metric autoscales.
    lo = min(min(e["summary"][f"{key}_min"]) for e in d["methods"].values())
    by_step.set_ylim(max(lo - 0.01, 0.0), 1.0)
  for ax in (by_step, by_time):
    ax.grid(alpha=0.3)
  by_step.legend(loc="lower right" if w.higher_is_better else "upper right")
  fig.suptitle(
    f"{w.title}, {result['machine']['device_count']} workers: mean of "
    f"{d['seeds']} seeds, band min-max (paper 000 Fig. 6 analogue)"
  )
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  return path
