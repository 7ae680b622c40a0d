"""Parameter servers and asynchrony on digits (survey 004 §2.1-2.4; issue 16).

Every run is the real training program on ``configs/default.py`` (MLP on
scikit-learn digits, 8 workers, 600 steps of a 128 global batch, plan
``single``) with ``config.scheme`` set per method, for ``seeds`` seeds,
on two described clusters (``config.cluster.speeds``):

* **hetero**: speeds (1, 1, 1, 1, 2, 2, 4, 4), the issue's: four slow
  workers, two at twice their speed, two at four times;
* **homo**: every speed 1, the control.

**Methods** (``gradcomp.async_ps`` unless said; the server's optimizer is
plain SGD, no momentum: momentum applied per push mixes stale and fresh
gradients in ways the survey does not discuss, and it made every stale run
diverge in a first try, see BUILD_NOTES):

* ``bsp``: ``staleness_bound=0`` (every round at one params; each push at lr
  :data:`PUSH_LR`, so a round is SGD at ``8 x PUSH_LR`` on the mean);
* ``asp``: no bound; ``ssp_1``, ``ssp_4``: bounded delay 1 and 4;
* ``dc_0.04``, ``dc_0.5``: DC-ASGD (Zheng et al. 2017), no bound, lambda 0.04
  and 0.5 (their range; the survey gives no reference);
* ``backup_0``, ``backup_1``, ``backup_2``: ``gradcomp.backup_workers`` with
  b = 0, 1, 2 (Chen et al. 2017), SGD at :data:`MEAN_LR` = ``8 x PUSH_LR``
  on the mean (BSP's step), and an Exp(1) jitter of :data:`JITTER` on every
  gradient's time so that who straggles changes between rounds; ``backup_0``
  is synchronous SGD under the same jitter, their baseline;
* ``stale_{0,2,4,8,16}`` (homogeneous only, it has no speeds):
  ``gradcomp.stale_sgd``, every gradient exactly ``s`` steps late, SGD at
  ``MEAN_LR`` (survey Fig. 2's setting).

**Time** is the program's ``sim_seconds`` (``train.pricing.speed_table``): a
worker's cycle is its compute (:data:`FLOPS_PER_SECOND` x its speed: 0.9 ms
for the MLP's 16-sample batch at speed 1, an assumed edge device) plus a push
and a pull of the dense params (38 KB at 20 Gbps, 25 us each: 80 us). A step
of ``async_ps`` is the fastest cycle; a round of ``backup_workers`` waits for
the ``n - b``-th cycle to end; ``stale_sgd`` is priced as synchronous SGD on
the program's ring (its clock is not comparable with the server's, and its
table has no time column). BSP runs inside ``async_ps``: a round is the
slowest cycle, in units of the fastest.

**Staleness** is read from the last ``staleness_histogram`` row of each run
(``async_ps`` only): pushes applied between a worker's pull and its push.

**Workloads** (``--workload``, :mod:`bench.workloads`): the above is
``digits``, the default. ``--workload gpt_tiny`` runs the same methods on
``configs/gpt_tiny.py`` with its AdamW as the server's optimizer:
:func:`methods_for` sets the lr on the mean gradient to the workload's
(gpt_tiny: 3e-3, the synchronous runs' peak lr, with the config's warm-up and
cosine decay) and a push's to that over the 8 workers, the same ratio as
digits' :data:`PUSH_LR` to :data:`MEAN_LR` (8 Adam steps of lr / 8 per BSP
round); ``optimizer.momentum = 0`` is SGD's field and leaves AdamW's
``b1 = 0.9`` in place (not re-tuned for stale pushes). The tables report
the final validation bits per byte (lower is better); the time to 95 %
accuracy is not applicable (no fixed bits-per-byte level: ``-``). The
clusters' speeds and the assumed :data:`FLOPS_PER_SECOND` are digits'
(on gpt_tiny's FLOPs compute dominates the simulated time even more).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import collectives, output, schemes, workloads
from bench.convergence import _stats
from bench.workloads import DIGITS, Workload

WORKERS = schemes.WORKERS
HETERO = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
CLUSTERS = {"hetero": HETERO, "homo": (1.0,) * WORKERS}
#: The server's SGD step per push, and per round on the mean gradient.
PUSH_LR = 0.05
MEAN_LR = WORKERS * PUSH_LR
JITTER = 0.5
#: A speed-1 worker's training FLOP/s: an assumed edge device (about a
#: phone CPU's sustained fp32 rate), so that compute, not the 80 us push and
#: pull, sets most of a cycle and the speeds matter (see the module docstring).
FLOPS_PER_SECOND = 1e9
#: Accuracy at which time-to-accuracy is read.
TARGET = 0.95
STALENESS = (0, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Method:
  """One curve: ``config.scheme`` fields and the server's learning rate."""

  label: str
  scheme: Mapping[str, Any]
  learning_rate: float
  timed: bool = True  # runs on both clusters (False: homogeneous only)


def methods_for(workload: Workload) -> dict[str, Method]:
  """The suite's methods with ``workload.server_learning_rate`` on the mean
  gradient and that over :data:`WORKERS` per push (digits: :data:`MEAN_LR`,
  :data:`PUSH_LR`)."""
  a = "async_ps"
  mean = workload.server_learning_rate
  push = mean / WORKERS
  out = [
    Method("bsp", {"name": a, "staleness_bound": 0}, push),
    Method("asp", {"name": a}, push),
    Method("ssp_1", {"name": a, "staleness_bound": 1}, push),
    Method("ssp_4", {"name": a, "staleness_bound": 4}, push),
    Method("dc_0.04", {"name": a, "delay_compensation": 0.04}, push),
    Method("dc_0.5", {"name": a, "delay_compensation": 0.5}, push),
  ]
  for b in (0, 1, 2):
    scheme = {"name": "backup_workers", "backups": b, "jitter": JITTER}
    out.append(Method(f"backup_{b}", scheme, mean))
  for s in STALENESS:
    out.append(Method(f"stale_{s}", {"name": "stale_sgd", "staleness": s}, mean, False))
  return {m.label: m for m in out}


METHODS = methods_for(DIGITS)
DEFAULT_METHODS = tuple(METHODS)


def configure(
  method: Method,
  speeds,
  *,
  seed: int,
  steps: int,
  eval_every: int,
  workload: Workload = DIGITS,
):
  """``workload``'s config on ``speeds`` with ``method``'s scheme, dense, plan single."""
  base = schemes.Method(method.label, method.scheme)
  config = schemes.configure(
    base, seed=seed, steps=steps, eval_every=eval_every, workload=workload
  )
  config.optimizer.learning_rate = method.learning_rate
  config.optimizer.momentum = 0.0
  config.cluster.speeds = tuple(speeds)
  config.cluster.flops_per_second = FLOPS_PER_SECOND
  return config


def _staleness(rows) -> dict[str, Any] | None:
  hists = [r["staleness_histogram"] for r in rows if "staleness_histogram" in r]
  if not hists:
    return None
  counts = np.asarray(hists[-1], np.float64)
  values = np.arange(counts.size)
  cumulative = np.cumsum(counts) / counts.sum()
  return {
    "counts": hists[-1],
    "pushes": int(counts.sum()),
    "mean": float(values @ counts / counts.sum()),
    "p90": int(np.searchsorted(cumulative, 0.9)),
    "max": int(values[counts > 0].max()),
  }


def _summary(
  runs: Sequence[Mapping[str, Any]], steps: int, workload: Workload = DIGITS
) -> dict[str, Any]:
  w = workload
  curves = [schemes._curve(r["rows"], r["eval_steps"], w) for r in runs]
  acc = np.asarray([c[f"eval_{w.key}"] for c in curves])
  seconds = np.asarray([c["program_sim_seconds"] for c in curves])
  losses = [
    [r2["loss"] for r2 in r["rows"] if r2.get("loss") is not None][-1] for r in runs
  ]
  reach = []
  for a, s in zip(acc, seconds, strict=True):
    # A fixed accuracy: no bits-per-byte counterpart (module docstring).
    hit = np.flatnonzero(w.reached(a, TARGET)) if w.absolute_levels else []
    reach.append(float(s[hit[0]]) if len(hit) else math.nan)
  stale = [_staleness(r["rows"]) for r in runs]
  return {
    "step": curves[0]["step"],
    f"{w.key}_mean": np.nanmean(acc, 0).tolist(),
    "sim_seconds_mean": np.nanmean(seconds, 0).tolist(),
    f"final_{w.key}": _stats(acc[:, -1]),
    "final_train_loss": _stats(losses),
    "sim_seconds_end": float(np.nanmean(seconds[:, -1])),
    "time_to_target": _stats([x for x in reach if math.isfinite(x)])
    if any(math.isfinite(x) for x in reach)
    else None,
    "reached_target": sum(math.isfinite(x) for x in reach),
    "staleness": None if stale[0] is None else stale[0],
    "staleness_mean": None
    if stale[0] is None
    else _stats([s["mean"] for s in stale])["mean"],
    "pushes_per_step": None if stale[0] is None else stale[0]["pushes"] / steps,
    "stopped": sum(bool(r.get("stopped")) for r in runs),
  }


def _log(text: str) -> None:
  print(f"# async: {text}", file=sys.stderr, flush=True)


def run(
  methods: Sequence[Method] | None = None,
  seeds: int = 3,
  steps: int = 600,
  eval_every: int = 100,
  out_dir: str = "bench_out",
  docs_png: str | Path | None = None,
  workload: Workload = DIGITS,
) -> dict[str, Any]:
  """Runs the suite, prints its tables, writes ``async.{json,md,png}``.

  The suite's own methods (those equal to :data:`METHODS`' of their label)
  are rebuilt for ``workload`` by :func:`methods_for`; others run as given.
  """
  w = workload
  table = methods_for(w)
  methods = schemes.check_run(
    [
      table[m.label] if METHODS.get(m.label) == m else m
      for m in (methods or [METHODS[m] for m in DEFAULT_METHODS])
    ],
    seeds,
    steps,
    eval_every,
  )
  start = time.perf_counter()
  root = Path(out_dir) / "async_runs"
  eval_steps = list(range(eval_every, steps + 1, eval_every))
  if eval_steps[-1] != steps:
    eval_steps.append(steps)
  runs: dict[str, dict[str, list]] = {c: {} for c in CLUSTERS}
  for seed in range(seeds):
    for cluster, speeds in CLUSTERS.items():
      for m in methods:
        if not m.timed and cluster != "homo":
          continue
        config = configure(
          m, speeds, seed=seed, steps=steps, eval_every=eval_every, workload=w
        )
        workdir = root / cluster / m.label / f"seed{seed}"
        r = schemes._train(config, workdir)
        r["eval_steps"] = eval_steps
        runs[cluster].setdefault(m.label, []).append(r)
        _log(f"{cluster} {m.label} seed {seed}: {w.key} {w.value(r['final'])}")
  summaries = {
    cluster: {label: _summary(rs, steps, w) for label, rs in by.items()}
    for cluster, by in runs.items()
  }
  result = {
    "suite": "async",
    "workload": w.describe(),
    "seeds": seeds,
    "steps": steps,
    "push_lr": w.server_learning_rate / WORKERS,
    "mean_lr": w.server_learning_rate,
    "jitter": JITTER,
    "clusters": {k: list(v) for k, v in CLUSTERS.items()},
    "methods": {m.label: dict(m.scheme) for m in methods},
    "summaries": summaries,
    "collectives": collectives.tabulate(10.0, 25.0),
    "wall_s": time.perf_counter() - start,
  }
  output.publish(out_dir, "async", result, format_tables(result), plot, docs_png)
  return result


def _ms(stats: Mapping[str, Any] | None) -> str:
  return "-" if not stats else f"{1e3 * stats['mean']:.3f}"


def format_tables(result: Mapping[str, Any]) -> str:
  """Per cluster: the metric, time to target, staleness; then survey Fig. 2."""
  w = workloads.get(result.get("workload"))
  final = f"final {w.key} ({'%' if w.higher_is_better else 'bits/byte'})"
  on = "" if w.name == "digits" and not w.overrides else f"{w.heading()}, "
  lines = []
  for cluster, by in result["summaries"].items():
    speeds = result["clusters"][cluster]
    lines += [
      f"\n### {cluster}: {on}speeds {speeds}, {result['seeds']} seeds, "
      f"{result['steps']} steps",
      "",
      f"| method | {final} | final train loss | sim time (ms) | "
      f"time to {100 * TARGET:.0f} % (ms) | reached | pushes/step | "
      "staleness mean / p90 / max |",
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, s in by.items():
      if label.startswith("stale_"):
        continue
      st = s["staleness"]
      stale = (
        "-" if st is None else f"{s['staleness_mean']:.2f} / {st['p90']} / {st['max']}"
      )
      pushes = "-" if s["pushes_per_step"] is None else f"{s['pushes_per_step']:.2f}"
      reached = (
        f"{s['reached_target']}/{result['seeds']}" if w.absolute_levels else "n/a"
      )
      lines.append(
        f"| {label} | {w.fmt_stats(s[f'final_{w.key}'])} | "
        f"{s['final_train_loss']['mean']:.4f} | {1e3 * s['sim_seconds_end']:.3f} | "
        f"{_ms(s['time_to_target'])} | {reached} | {pushes} | {stale} |"
      )
  stale = {
    k: v for k, v in result["summaries"]["homo"].items() if k.startswith("stale_")
  }
  if stale:
    lines += [
      "\n### Survey Fig. 2: every gradient s steps late (stale_sgd, homogeneous)",
      "",
      f"| s | final train loss | {final} |",
      "| ---: | ---: | ---: |",
    ]
    for label, s in stale.items():
      loss = s["final_train_loss"]
      lines.append(
        f"| {label.split('_')[1]} | {loss['mean']:.4f} ± {loss['std'] or 0:.4f} | "
        f"{w.fmt_stats(s[f'final_{w.key}'])} |"
      )
  table = collectives.render(result["collectives"])
  lines += ["\n### Which all-reduce the cost model picks", "", table]
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str | Path) -> Path:
  """The metric against simulated time, per cluster, and the staleness histograms."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  w = workloads.get(result.get("workload"))
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for ax, cluster in zip(axes[:2], ("hetero", "homo"), strict=True):
    for label, s in result["summaries"][cluster].items():
      if label.startswith("stale_"):
        continue
      ax.plot(1e3 * np.asarray(s["sim_seconds_mean"]), s[f"{w.key}_mean"], label=label)
    ax.set_xlabel("simulated time (ms)")
    ax.set_ylabel(f"{w.metric} (mean over seeds)")
    if w.higher_is_better:
      ax.set_ylim(0.8, 1.0)
    ax.set_title(f"{cluster}: speeds {result['clusters'][cluster]}")
    if ax.get_legend_handles_labels()[0]:  # None when only stale_* ran.
      ax.legend(fontsize=7)
  ax = axes[2]
  for label, s in result["summaries"]["hetero"].items():
    if s["staleness"] is not None:
      counts = np.asarray(s["staleness"]["counts"], np.float64)
      ax.plot(np.arange(counts.size), counts / counts.sum(), marker=".", label=label)
  ax.set_xlabel("staleness (pushes between pull and push)")
  ax.set_ylabel("share of pushes (hetero, seed 0)")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
