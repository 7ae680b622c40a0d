"""Reproducing paper 001 (CD-SGD): accuracy, simulated epoch times, measured steps.

``python -m bench cdsgd`` (issue 13). Three parts:

1. **Accuracy** (the paper's claims 1-3, §4.2-4.3): S-SGD, BIT-SGD, OD-SGD
   and CD-SGD with k = 2, 5, 10, 20, on the real training program
   (``configs/default.py``: MLP on scikit-learn digits, 8 workers, 600 steps
   of 128, plan ``single``), ``seeds`` seeds each. The paper's claims:
   CD-SGD (k=2) >= BIT-SGD and within 0.3 points of S-SGD; accuracy does not
   rise as k grows. CIFAR-10 is not on this machine (no network), so the
   ResNet-20 accuracy runs are not made; ResNet-20 enters parts 2-3 through
   its shapes and FLOPs only.
2. **Table 2 and Fig. 10 analogues**: the paper's time model (eqs. 2-9,
   ``gradcomp.sim.delayed``) on its clusters, from
   :mod:`bench.cdsgd_time`.
3. **Measured step time** on 8 virtual CPU devices for the same methods
   (the training program's logged throughput, compile excluded), next to
   the model's prediction from measured ``tau`` (a step that exchanges
   nothing: ``local_sgd`` that never averages), ``phi`` (S-SGD minus tau)
   and ``delta + psi`` (BIT-SGD minus tau).

**Hyper-parameters.** Every method's server (global) optimizer is the
config's: SGD lr 0.1, momentum 0.9. OD-SGD's and CD-SGD's local learning
rate is :data:`LOCAL_LR`; the warm-up is :data:`WARMUP` synchronous steps
(the paper gives none; OD-SGD's code uses 200 of its much longer runs).
The threshold is the paper's 0.5 **in MXNet's units**: pushes are sums over
the worker's batch, so CD-SGD runs with ``message_scale`` = the per-worker
batch (16) and BIT-SGD (a synchronous chain, no ``message_scale``) with the
same threshold on mean gradients, 0.5 / 16 (equal arithmetic: 16 is a power
of two).

**Workloads** (``--workload``, :mod:`bench.workloads`). Part 1 runs
on ``digits`` by default; ``--workload gpt_tiny`` runs the same methods on
``configs/gpt_tiny.py`` (AdamW is then every method's server optimizer) and
reports the final validation bits per byte (lower is better) of the local
average, of the global weights and the workers' mean in place of the worst
worker's accuracy. :func:`methods_for` rebuilds the suite's methods for a
workload: the local lr is the workload's (gpt_tiny: 3e-3, AdamW's peak lr,
the transformer suite's ``CDSGD_LOCAL_LR``: untuned), ``message_scale`` the
config's per-worker batch, and the threshold the workload's on mean
gradients (gpt_tiny: 1.5e-3, ``CDSGD_THRESHOLD``) times that batch in
MXNet's units (the small setting 1/100 of it, as on digits); the warm-up
stays :data:`WARMUP` = 50 (gpt_tiny's AdamW warm-up too). The claims compare
bits per byte: CD-SGD (k=2) at most as many bits per byte as BIT-SGD; within
``workloads.BPB_MARGIN`` = 0.1 bits per byte of S-SGD; bits per byte not
falling as k grows. Parts 2-3 are unchanged: Table 2 and Fig. 10 are the
paper's time model on its clusters and models (workload-independent), and the
measured steps are the chosen workload's runs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import cdsgd_time, schemes, workloads
from bench.convergence import _stats
from bench.output import publish
from bench.schemes import Method
from bench.workloads import DIGITS, Workload

WORKERS = schemes.WORKERS
#: The digits config's global batch over 8 workers.
PER_WORKER_BATCH = 16
#: Paper 001 §4.2: threshold 0.5 on batch-summed gradients (MXNet's units).
THRESHOLD = 0.5
#: A second setting, 100x smaller (MXNet units), at which BIT-SGD trains on
#: digits (the paper's 0.5 makes it diverge here: BUILD_NOTES).
SMALL_THRESHOLD = 0.005
SMALL_SUFFIX = "_small"
LOCAL_LR = 0.1
WARMUP = 50
KS = (2, 5, 10, 20)
#: Claim 1's margin: CD-SGD (k=2) within this many points of S-SGD.
SSGD_PP = 0.3


#: The small setting's threshold over the first's.
SMALL_FACTOR = 100


def methods_for(workload: Workload, per_worker_batch: int) -> dict[str, Method]:
  """The suite's methods on ``workload`` with ``per_worker_batch`` per worker.

  Local lr: ``workload.local_learning_rate``; thresholds in MXNet's units
  (batch sums): ``workload.threshold * per_worker_batch`` and
  1 / :data:`SMALL_FACTOR` of it (digits: :data:`THRESHOLD`,
  :data:`SMALL_THRESHOLD`), ``message_scale = per_worker_batch``; BIT-SGD's
  on mean gradients, over ``per_worker_batch``.
  """
  big = workload.threshold * per_worker_batch

  def cd(k: int, compressor: str = "threshold_quantize", small: bool = False):
    scheme = {
      "name": "cdsgd",
      "local_learning_rate": workload.local_learning_rate,
      "warmup_steps": WARMUP,
      "k": k,
    }
    if compressor == "none":
      return Method("odsgd", scheme, why="local update, full precision every step")
    threshold = big / SMALL_FACTOR if small else big
    return Method(
      f"cdsgd_k{k}" + (SMALL_SUFFIX if small else ""),
      {**scheme, "message_scale": float(per_worker_batch)},
      compressor,
      {"threshold": threshold},
      why=f"2-bit codes (threshold {threshold:g} on batch sums), full precision "
      f"every {k}th message",
    )

  def bit(small: bool = False) -> Method:
    threshold = big / SMALL_FACTOR if small else big
    return Method(
      "bitsgd" + (SMALL_SUFFIX if small else ""),
      {"name": "none"},
      "threshold_quantize",
      {"threshold": threshold / per_worker_batch},
      why=f"2-bit codes with residual, synchronous (eq. 5), threshold "
      f"{threshold:g} on batch sums",
    )

  return {
    m.label: m
    for m in (
      Method("ssgd", {"name": "none"}, why="dense fp32 all-reduce every step"),
      bit(),
      cd(1, "none"),
      *(cd(k) for k in KS),
      bit(small=True),
      *(cd(k, small=True) for k in (2, 20)),
      Method(
        "compute_only",
        {"name": "local_sgd", "every": 10**6},
        why="never exchanges: the measured tau of part 3",
      ),
    )
  }


METHODS: dict[str, Method] = methods_for(DIGITS, PER_WORKER_BATCH)
DEFAULT_METHODS = tuple(METHODS)


def _step_seconds(rows: Sequence[Mapping[str, Any]], batch: int) -> float | None:
  """Median wall seconds per step over the logged windows after the first.

  The first window holds the compile (excluded by the program) and, for
  CD-SGD, the warm-up.
  """
  rates = [r["samples_per_sec"] for r in rows if r.get("samples_per_sec")]
  rates = rates[1:] or rates
  return float(batch / np.median(rates)) if rates else None


def measured_vs_model(steps: Mapping[str, float]) -> list[dict[str, Any]]:
  """Part 3: each method's measured step next to eqs. 2, 4, 5 and 7.

  ``tau`` is the compute-only step, ``phi = T_ssgd - tau``, ``delta + psi =
  T_bitsgd - tau``. For CD-SGD the mean over a cycle of ``k`` steps: one full
  message and ``k - 1`` compressed. Both readings are given: overlapped
  (``max``, the paper's) and sequential (``tau + phi_i``, what a device that
  cannot run a collective beside compute pays).
  """
  if not {"compute_only", "ssgd", "bitsgd"} <= set(steps):
    return []
  tau = steps["compute_only"]
  phi = max(steps["ssgd"] - tau, 0.0)
  comp = max(steps["bitsgd"] - tau, 0.0)
  rows = []
  for label, measured in steps.items():
    if label == "compute_only" or label.endswith(SMALL_SUFFIX):
      continue
    if label == "ssgd":
      overlap = sequential = tau + phi
    elif label == "bitsgd":
      overlap = sequential = tau + comp
    elif label == "odsgd":
      overlap, sequential = max(tau, phi), tau + phi
    else:
      k = int(label.removeprefix("cdsgd_k"))
      overlap = (max(tau, phi) + (k - 1) * max(tau, comp)) / k
      sequential = tau + (phi + (k - 1) * comp) / k
    rows.append(
      {
        "method": label,
        "measured_ms": 1e3 * measured,
        "model_overlapped_ms": 1e3 * overlap,
        "model_sequential_ms": 1e3 * sequential,
      }
    )
  return rows


def accuracy_checks(
  summaries: Mapping[str, Mapping[str, Any]],
  workload: Workload = DIGITS,
  thresholds: Sequence[float] = (THRESHOLD, SMALL_THRESHOLD),
) -> list[dict]:
  """Claims 1-3 of §4.2-4.3, for each threshold setting whose methods ran.

  In the workload's metric (``difference_pp`` on digits, ``difference_bpb``
  on gpt_tiny: how much better the first method ends, ``Workload.advantage``);
  ``thresholds``: the two settings' thresholds, named in the claims.
  """
  w = workload
  mean = lambda m: summaries[m][f"final_{w.key}"]["mean"]
  checks = []
  for suffix, threshold in zip(("", SMALL_SUFFIX), thresholds, strict=True):
    at = f" (threshold {threshold:g})"
    cd2, bit = f"cdsgd_k2{suffix}", f"bitsgd{suffix}"
    if {cd2, bit} <= set(summaries):
      diff = w.advantage(mean(cd2), mean(bit))
      checks.append(
        {
          "claim": f"CD-SGD (k=2) {w.key} at least as good as BIT-SGD's{at}",
          w.difference_key: diff,
          "holds": diff >= 0,
        }
      )
    if {cd2, "ssgd"} <= set(summaries):
      diff = w.advantage(mean(cd2), mean("ssgd"))
      checks.append(
        {
          "claim": f"CD-SGD (k=2) within {w.tolerance(SSGD_PP):g} {w.unit} of "
          f"S-SGD{at}",
          w.difference_key: diff,
          "holds": w.within(mean(cd2), mean("ssgd"), SSGD_PP),
        }
      )
    ks = [k for k in KS if f"cdsgd_k{k}{suffix}" in summaries]
    if len(ks) > 1:
      acc = [mean(f"cdsgd_k{k}{suffix}") for k in ks]
      rises = [
        w.advantage(b, a) for a, b in zip(acc, acc[1:], strict=False) if w.better(b, a)
      ]
      checks.append(
        {
          "claim": f"{w.key} does not improve as k grows (k = "
          + ", ".join(map(str, ks))
          + f"){at}",
          "values": acc,
          f"largest_rise_{w.suffix}": max(rises, default=0.0),
          "holds": not rises,
        }
      )
  return checks


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 3,
  steps: int = 600,
  eval_every: int = 100,
  out_dir: str = "bench_out",
  docs_png: str | Path | None = None,
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """Runs the suite, prints its tables, writes ``cdsgd.{json,md,png}``.

  The suite's own methods (those equal to :data:`METHODS`' of their label)
  are rebuilt for ``workload`` by :func:`methods_for`; others run as given.
  """
  import gradcomp
  from bench.compress import machine_info

  w = workload
  per_worker = w.config().global_batch_size // WORKERS
  table = methods_for(w, per_worker)
  methods = schemes.check_run(
    [
      table[m.label] if METHODS.get(m.label) == m else m
      for m in (methods or [METHODS[m] for m in DEFAULT_METHODS])
    ],
    seeds,
    steps,
    eval_every,
  )
  runs_dir = Path(out_dir) / "cdsgd_runs"
  eval_steps = sorted({*range(eval_every, steps + 1, eval_every), steps})
  t_start = time.perf_counter()
  info = machine_info()
  schemes._log(
    f"{len(methods)} methods x {seeds} seeds x {steps} steps on {w.name}, "
    f"{WORKERS} workers ({info['backend']}), {info['cpu_count']} CPUs"
  )
  per_method: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
  for seed in range(seeds):
    for m in methods:
      config = schemes.configure(
        m, seed=seed, steps=steps, eval_every=eval_every, workload=w
      )
      workdir = runs_dir / m.label / f"seed{seed}"
      r = schemes._train(config, workdir)
      rows = r.pop("rows")
      r["seed"] = seed
      r["curve"] = schemes._curve(rows, eval_steps, w)
      evals = {row["step"]: row for row in rows if "eval_loss" in row}
      r["curve"][f"global_{w.key}"] = [
        None
        if "eval_global_loss" not in evals.get(s, {})
        else w.value(evals[s], "eval_global")
        for s in eval_steps
      ]
      r["step_seconds"] = _step_seconds(rows, config.global_batch_size)
      per_method[m.label].append(r)
      schemes._log(
        f"{m.label} seed {seed}: {w.key} {r['curve'][f'eval_{w.key}'][-1]:.4f}, "
        f"{r['wire_bytes_per_step']:,.0f} B/step, "
        f"{1e3 * (r['step_seconds'] or np.nan):.2f} ms/step"
      )
  summaries = {}
  for label, rs in per_method.items():
    curves = [r["curve"] for r in rs]
    acc = np.asarray([c[f"eval_{w.key}"] for c in curves], float)
    glob = [c[f"global_{w.key}"][-1] for c in curves]
    summaries[label] = {
      "step": eval_steps,
      f"{w.key}_mean": acc.mean(0).tolist(),
      f"final_{w.key}": _stats(acc[:, -1]),
      f"final_global_{w.key}": None if None in glob else _stats(glob),
      f"final_{w.worker_key}": _stats([c[w.worker_key][-1] for c in curves]),
      "wire_bytes_per_step": rs[0]["wire_bytes_per_step"],
      "step_seconds": _stats([r["step_seconds"] for r in rs]),
    }
  steps_measured = {label: s["step_seconds"]["mean"] for label, s in summaries.items()}
  result = {
    "suite": "cdsgd",
    "machine": info,
    "workload": w.describe(),
    "config": f"{w.config_file} (fusion.plan='single')",
    "workers": WORKERS,
    "steps": steps,
    "seeds": seeds,
    "local_learning_rate": w.local_learning_rate,
    "warmup_steps": WARMUP,
    "threshold_mxnet_units": w.threshold * per_worker,
    "thresholds_mxnet_units": [
      w.threshold * per_worker,
      w.threshold * per_worker / SMALL_FACTOR,
    ],
    "message_scale": per_worker,
    "methods": {m.label: dataclasses.asdict(m) for m in methods},
    "results": {
      label: {"summary": summaries[label], "runs": per_method[label]}
      for label in per_method
    },
    "claims": accuracy_checks(
      summaries, w, (w.threshold * per_worker, w.threshold * per_worker / SMALL_FACTOR)
    ),
    "measured_vs_model": measured_vs_model(steps_measured),
    "table2": cdsgd_time.table2_rows(),
    "fig10": cdsgd_time.fig10_rows(),
    "gradcomp_version": getattr(gradcomp, "__version__", None),
    "wall_s": time.perf_counter() - t_start,
    "loadavg_end": list(os.getloadavg()),
  }
  publish(out_dir, "cdsgd", result, format_tables(result), plot, docs_png)
  return result


def _thresholds(result: Mapping[str, Any]) -> list[float]:
  """The two settings' thresholds (MXNet units) of a result."""
  return result.get("thresholds_mxnet_units", [THRESHOLD, SMALL_THRESHOLD])


def format_tables(result: Mapping[str, Any]) -> str:
  """Markdown: the metric, claims, measured steps, and the simulated tables."""
  w = workloads.get(result.get("workload"))
  unit = "%" if w.higher_is_better else "bits/byte"
  title = "Accuracy" if w.higher_is_better else "Bits per byte"
  name = "digits" if w.name == "digits" and not w.overrides else w.heading()
  lines = [
    f"### {title}: {name}, {result['workers']} workers, {result['steps']} steps, "
    f"{result['seeds']} seeds",
    "",
    f"| method | final {w.key}, local avg ({unit}) | global weights ({unit}) "
    f"| {w.worker_title} ({unit}) | bytes/step |",
    "| --- | ---: | ---: | ---: | ---: |",
  ]
  for label, r in result["results"].items():
    s = r["summary"]
    if label == "compute_only":
      continue
    lines.append(
      f"| {label} | {w.fmt_stats(s[f'final_{w.key}'])} "
      f"| {w.fmt_stats(s[f'final_global_{w.key}'])} "
      f"| {w.fmt_stats(s[f'final_{w.worker_key}'])} | {s['wire_bytes_per_step']:,.0f} |"
    )
  lines += ["", "| claim | measured | holds |", "| --- | --- | --- |"]
  digits = 3 if w.from_loss else 2
  for c in result["claims"]:
    what = (
      f"{c[w.difference_key]:+.{digits}f} {w.unit}"
      if w.difference_key in c
      else ", ".join(w.fmt(a) for a in c["values"])
    )
    lines.append(f"| {c['claim']} | {what} | {'yes' if c['holds'] else 'no'} |")
  if result["measured_vs_model"]:
    lines += [
      "",
      "### Step time on 8 virtual CPU devices (ms): measured vs eqs. 2-7",
      "",
      "| method | measured | model, overlapped | model, sequential |",
      "| --- | ---: | ---: | ---: |",
    ]
    for row in result["measured_vs_model"]:
      lines.append(
        f"| {row['method']} | {row['measured_ms']:.2f} | "
        f"{row['model_overlapped_ms']:.2f} | {row['model_sequential_ms']:.2f} |"
      )
  lines += ["", cdsgd_time.render_table2(result["table2"])]
  lines += ["", cdsgd_time.render_fig10(result["fig10"])]
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str | Path) -> Path:
  """Metric curves, final metric against k, and Table 2 next to the paper."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  w = workloads.get(result.get("workload"))
  unit = "%" if w.higher_is_better else "bits/byte"
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  ax = axes[0]
  for label, r in result["results"].items():
    if label == "compute_only":
      continue
    s = r["summary"]
    ax.plot(s["step"], w.scale * np.asarray(s[f"{w.key}_mean"]), label=label)
  ax.set(xlabel="step", ylabel=f"{w.metric} ({unit}), mean over seeds")
  if w.higher_is_better:
    ax.set_ylim(80, 100)
  ax.axvline(result["warmup_steps"], color="grey", lw=0.8, ls=":")
  ax.legend(fontsize=7)
  ax.set_title(f"{w.name}, 8 workers")
  ax = axes[1]
  for suffix, threshold in zip(("", SMALL_SUFFIX), _thresholds(result), strict=True):
    points = [
      (k, result["results"][f"cdsgd_k{k}{suffix}"]["summary"][f"final_{w.key}"])
      for k in KS
      if f"cdsgd_k{k}{suffix}" in result["results"]
    ]
    if points:
      ax.errorbar(
        [k for k, _ in points],
        [w.scale * a["mean"] for _, a in points],
        yerr=[w.scale * (a["std"] or 0) for _, a in points],
        marker="o",
        label=f"CD-SGD, threshold {threshold:g}",
      )
      ax.set_xscale("log")
      ax.set_xticks(KS, [str(k) for k in KS])
      ax.minorticks_off()
  for label, style in (
    ("ssgd", "--"),
    ("odsgd", "-."),
    ("bitsgd", ":"),
    ("bitsgd" + SMALL_SUFFIX, (0, (1, 4))),
  ):
    if label in result["results"]:
      ax.axhline(
        w.scale * result["results"][label]["summary"][f"final_{w.key}"]["mean"],
        ls=style,
        color="grey",
        label=label,
      )
  ax.set(xlabel="k (one full-precision message in k)")
  ax.set(ylabel=f"final {w.metric} ({unit})")
  ax.legend(fontsize=7)
  ax.set_title("k-step correction (§4.3)")
  cdsgd_time.plot_table2(axes[2], result["table2"])
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return Path(path)
