"""EdgeGossip's performance predictor, fitted and tested on this machine.

Paper 002 §3.3 predicts a training task's time per unit of data under
co-running load as ``t = t0 * RG(U)``, ``U`` = (core, network, disk) usage of
the co-running jobs and ``RG`` a regression fitted on profiled samples; §4.4
co-runs MapReduce jobs of 13 input sizes on a 4-core VM and reports a mean
prediction error of 4.30 %. This suite repeats that experiment for real, with
:mod:`gradcomp.edgegossip.predictor`:

* **The task** is a real training step, in this process: the digits config's
  MLP (``configs/default.py``: one hidden layer of 128, ``gradcomp.models.zoo``)
  forward and backward on one synthetic digits-shaped batch (128 by default,
  ``train.data.synthetic_like``), SGD with momentum 0.9 (optax), ``jax.jit``
  with the state donated, on one device (``jax.devices()[0]``). The batch
  stays on the device; no input pipeline is timed.
* **The co-runners** (:func:`~gradcomp.edgegossip.predictor.co_runner`) are
  child processes of known intensity: each is busy for ``intensity`` of every
  10 ms, spinning the CPU (1 or 2 processes) or writing 1 MiB blocks with
  ``fsync`` to a temporary file (``disk``, 1 process). A setting without a
  co-runner (``none``) measures ``t0``.
* **One window** per setting and pass: start the co-runner, wait ``settle``
  seconds for it to run, then for ``sample_seconds`` run the step back to back
  (blocking on each) while a background thread reads ``U`` over the same
  interval with :func:`~gradcomp.edgegossip.predictor.sample_usage` (busy CPU
  of the whole machine minus this process's own, disk and network bytes per
  second). ``t`` is the window's seconds per sample (elapsed / (steps *
  batch)): a throughput, as §3.3's "processing time per unit of input data".
  The median step is recorded too; it hides the contention, since most steps
  run between the scheduler's preemptions at full speed.
* **Passes.** ``repeats`` passes over all settings, each in a shuffled order
  (seeded), so that a drift of the machine's other load is spread over the
  settings rather than confounded with one.
* **Fit and test.** ``t0`` is the median ``t`` of the ``none`` windows. The
  :class:`~gradcomp.edgegossip.predictor.Predictor` (linear least squares on
  standardised ``U`` by default) is fitted to ``t / t0`` on the windows whose
  intensity is not in ``held_out`` (``none`` included), and its mean relative
  error ``mean |t_pred - t| / t`` is reported on the held-out windows (never
  seen by the fit) beside the paper's 4.30 %, with the in-sample error and
  the error of predicting ``t0`` everywhere (no predictor) as a baseline.
* **The regression's form** is unstated (§3.3: "a regression model"). The
  reported one is ``regression`` (linear by default, the predictor's); every
  form of :data:`REGRESSIONS` is fitted to the same windows and reported
  beside it, ``inverse_idle`` (linear in ``1 / (1 - U_core)``) among them:
  on a 2-core machine the co-runners, the task and other jobs fill the cores,
  ``U_core`` then reads ``1 - (the task's share) / cores`` and the task's time
  grows as ``1 / (1 - U_core)``, not linearly (:func:`regressor`).

``U`` measures all co-running load, the co-runners' and whatever else runs on
the machine (on a shared box, other jobs); that is the paper's point (§3.3:
"co-running programs ... and node's hardware/software activities"). The
co-runners' own CPU use (cores, from their ``/proc`` times) is recorded for
comparison with their nominal intensity: their duty cycle is in wall-clock
time, so on a full machine they get fewer cycles than ``intensity`` says.
Because ``U_core`` excludes only the task's own CPU time, on a full machine it
carries the task's share back (``1 - share / cores``, read over the same
window as ``t``): a real reading, but one that is partly the response itself.

**Feeding the simulator.** :func:`speeds_for` maps each worker's co-running
usage to the relative speed ``t0 / t = 1 / RG(U)`` the simulator's
``Cluster(speeds=...)`` takes (times a base speed per worker), by refitting
the predictor from the result's samples (:func:`predictor_from`); a platform's
rate is ``sum_i speed_i / t0`` samples per second (§3.3's extended
estimator, :func:`~gradcomp.edgegossip.predictor.platform_rate`).

``python -m bench predictor`` (or :func:`run`). The default (15
settings: ``none``, CPU intensities 0 to 1 with 1 and 2 co-runners, disk
writers at 0.25 to 1; 3 passes of 2.5 s windows) took 2 min 20 s on a shared
2-core machine (compiling the step: 2-4 s).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from gradcomp.compressors import checks
from gradcomp.edgegossip import predictor as predictor_lib

#: §4.4's mean prediction error.
PAPER_ERROR = 0.043
#: CPU co-runner intensities (busy fraction of each 10 ms period).
DEFAULT_INTENSITIES = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Intensities whose windows the fit never sees.
DEFAULT_HELD_OUT = (0.25, 0.75)
#: Intensities of the 1-process disk-writing co-runner.
DEFAULT_DISK = (0.25, 0.5, 0.75, 1.0)
#: Forms of ``RG`` this suite fits (see :func:`regressor`).
REGRESSIONS = ("linear", "ridge", "inverse_idle")
#: ``inverse_idle``'s cap on ``U_core`` (``1 / (1 - U_core)`` <= 100).
MAX_CORE = 0.99


def _log(msg: str, log) -> None:
  if log is not None:
    print(msg, file=log, flush=True)


def label(setting: Mapping[str, Any]) -> str:
  """A setting's name: ``none``, ``cpu 0.50 x2`` or ``disk 0.50``."""
  if setting["processes"] == 0:
    return "none"
  kind = "disk" if setting["disk"] else "cpu"
  procs = f" x{setting['processes']}" if setting["processes"] > 1 else ""
  return f"{kind} {setting['intensity']:.2f}{procs}"


def settings(
  intensities: Sequence[float],
  processes: Sequence[int],
  disk: Sequence[float],
) -> list[dict[str, Any]]:
  """``none``, each CPU intensity with each process count, each disk intensity."""
  out = [{"intensity": 0.0, "processes": 0, "disk": False}]
  out += [
    {"intensity": float(i), "processes": int(p), "disk": False}
    for i in intensities
    for p in processes
  ]
  out += [{"intensity": float(i), "processes": 1, "disk": True} for i in disk]
  return out


def _check_run(intensities, held_out, processes, disk, repeats, sample_seconds, batch):
  for name, values in (("intensities", intensities), ("disk", disk)):
    if not all(0.0 <= float(v) <= 1.0 for v in values):
      raise ValueError(f"{name} must lie in [0, 1], got {tuple(values)!r}")
  if not intensities:
    raise ValueError("intensities must hold at least one intensity, got ()")
  if not processes or not all(
    isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in processes
  ):
    raise ValueError(f"processes must be integers >= 1, got {tuple(processes)!r}")
  known = {float(v) for v in (*intensities, *disk)}
  unknown = [h for h in held_out if float(h) not in known]
  if unknown:
    raise ValueError(
      f"held_out must be among the intensities {sorted(known)}, got {unknown!r}"
    )
  checks.at_least("repeats", repeats, 1)
  checks.at_least("batch", batch, 1)
  if not 0 < sample_seconds < np.inf:
    raise ValueError(f"sample_seconds must be in (0, inf), got {sample_seconds!r}")


def build_step(model: str = "mlp", batch: int = 128, seed: int = 0):
  """The jitted training step on one device: ``(step, state, x, y)``.

  The digits config's model (``configs/default.py``: ``mlp`` with one hidden
  layer of 128; any ``gradcomp.models.zoo`` name that takes 8x8x1 images),
  softmax cross-entropy, ``optax.sgd(0.1, momentum=0.9)``; ``step(state, x,
  y) -> (state, loss)`` with ``state = (params, opt_state)`` donated.
  """
  import jax
  import optax

  from gradcomp.models import zoo
  from train import data as data_lib

  ds = data_lib.synthetic_like("digits", seed=seed, num_train=batch, num_test=1)
  net = zoo.create(model, ds.num_classes)
  device = jax.devices()[0]
  x = jax.device_put(ds.x_train[:batch], device)
  y = jax.device_put(ds.y_train[:batch], device)
  params = net.init(jax.random.PRNGKey(seed), x[:1])
  tx = optax.sgd(0.1, momentum=0.9)
  state = jax.device_put((params, tx.init(params)), device)

  def step(state, x, y):
    params, opt_state = state

    def loss_fn(p):
      logits = net.apply(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(step, donate_argnums=0), state, x, y


def _cpu_seconds(pids: Sequence[int]) -> float:
  total = 0.0
  for pid in pids:
    try:
      t = psutil.Process(pid).cpu_times()
    except psutil.Error:
      continue
    total += t.user + t.system
  return total


def _window(box: list, step, x, y, batch: int, seconds: float, pids) -> dict[str, Any]:
  """Run the step for ``seconds`` while a thread reads ``U``; one sample."""
  usage: dict[str, predictor_lib.Usage] = {}
  sampler = threading.Thread(
    target=lambda: usage.update(u=predictor_lib.sample_usage(seconds)), daemon=True
  )
  co0 = _cpu_seconds(pids)
  sampler.start()
  times = []
  start = time.perf_counter()
  end = start + seconds
  while True:
    a = time.perf_counter()
    box[0], loss = step(box[0], x, y)
    loss.block_until_ready()
    b = time.perf_counter()
    times.append(b - a)
    if b >= end:
      break
  sampler.join()
  elapsed = time.perf_counter() - start
  u = usage["u"]
  return {
    "usage": u._asdict(),
    "t": (b - start) / (len(times) * batch),
    "t_median": statistics.median(times) / batch,
    "steps": len(times),
    "seconds": elapsed,
    "corunner_cores": (_cpu_seconds(pids) - co0) / elapsed if pids else 0.0,
    "loss": float(loss),
  }


def _usage_matrix(samples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  return np.array(
    [[s["usage"][f] for f in predictor_lib.FEATURES] for s in samples], np.float64
  ).reshape(-1, len(predictor_lib.FEATURES))


def _inverse_idle(u: np.ndarray) -> np.ndarray:
  """``U`` with ``U_core`` replaced by ``1 / (1 - min(U_core, MAX_CORE))``."""
  u = np.array(u, dtype=np.float64)
  u[:, 0] = 1.0 / (1.0 - np.minimum(u[:, 0], MAX_CORE))
  return u


def regressor(name: str):
  """The :class:`~gradcomp.edgegossip.predictor.Predictor` argument for ``name``.

  §3.3 leaves ``RG``'s form open ("a regression model"):

  * ``"linear"`` and ``"ridge"``: the predictor's own, linear in ``U``
    (``../shared/papers/NOTES.md``'s reading).
  * ``"inverse_idle"``: linear in ``(1 / (1 - U_core), U_net, U_disk)``
    (scikit-learn's ``FunctionTransformer``, then least squares on
    standardised features). A CPU-bound task's speed is proportional to the
    share of the cores it gets; once co-runners and the task fill the cores,
    ``U_core`` (busy time minus the task's own) is ``1 - own / cores``, so the
    task's time grows as ``1 / (1 - U_core)``, which a line in ``U_core``
    cannot follow. ``U_core`` is capped at :data:`MAX_CORE`.
  """
  if name not in REGRESSIONS:
    raise ValueError(f"regression must be one of {REGRESSIONS}, got {name!r}")
  if name != "inverse_idle":
    return name
  from sklearn.linear_model import LinearRegression
  from sklearn.pipeline import make_pipeline
  from sklearn.preprocessing import FunctionTransformer, StandardScaler

  return make_pipeline(
    FunctionTransformer(_inverse_idle), StandardScaler(), LinearRegression()
  )


def predictor_from(
  result: Mapping[str, Any], regression: str | None = None
) -> predictor_lib.Predictor:
  """The result's predictor, refitted on its training samples and ``t0``.

  Least squares (and ridge) on the same numbers gives the same fit, so this
  is the predictor :func:`run` reported. ``regression`` (one of
  :data:`REGRESSIONS`) overrides the result's.
  """
  train = [s for s in result["samples"] if not s["held_out"]]
  if not train:
    raise ValueError("the result has no training samples (all are held out)")
  name = result["regression"] if regression is None else regression
  return predictor_lib.Predictor(regressor(name)).fit(
    _usage_matrix(train), [s["t"] for s in train], t0=result["t0"]
  )


def speeds_for(
  result: Mapping[str, Any],
  usages,
  *,
  base: float | Sequence[float] = 1.0,
  regression: str | None = None,
) -> np.ndarray:
  """Per-worker speeds for the simulator's ``Cluster(speeds=...)``.

  .. math::

    s_w = b_w \\cdot t_0 / t_w = b_w / RG(\\vec U_w)

  with ``RG`` the result's fitted regression (paper 002 §3.3) and ``b_w`` the
  worker's speed without co-running load relative to the reference device.

  Args:
    result: a :func:`run` result (its ``samples``, ``t0``, ``regression``).
    usages: ``(W, 3)`` co-running usage per worker (:class:`Usage` rows, or
      one ``(3,)`` usage).
    base: ``b_w``, a scalar or ``W`` values > 0.
    regression: a form of :data:`REGRESSIONS` other than the result's.

  Returns:
    ``(W,)`` float64 speeds, each finite and > 0.

  Raises:
    ValueError: if ``RG(U_w) <= 0`` for some worker (a linear fit
      extrapolated far outside its samples), or ``base`` is not > 0.
  """
  ratio = predictor_from(result, regression).ratio(usages)
  b = np.broadcast_to(np.asarray(base, np.float64), ratio.shape)
  if not np.all((b > 0) & np.isfinite(b)):
    raise ValueError(f"base must be finite and > 0, got {base!r}")
  if not np.all((ratio > 0) & np.isfinite(ratio)):
    raise ValueError(
      f"RG(U) must be > 0 to give a speed, got {ratio.tolist()} (U outside the fit)"
    )
  return b / ratio


def features(regression: str, usage) -> np.ndarray:
  """``RG``'s features of ``usage`` ``(V, 3)`` as reported: per MB/s for the bytes.

  ``(U_core, U_net, U_disk)``, or ``1 / (1 - U_core)`` first for
  ``"inverse_idle"``.
  """
  u = np.asarray(usage, np.float64).reshape(-1, len(predictor_lib.FEATURES))
  if regression == "inverse_idle":
    u = _inverse_idle(u)
  return u / np.array([1.0, 1e6, 1e6])


def coefficients(p: predictor_lib.Predictor, regression: str) -> dict[str, float]:
  """``RG(U) = intercept + sum_k c_k f_k(U)``, read off ``p.ratio`` at four ``U``.

  ``f`` is :func:`features` (``core`` or ``inverse_idle``, then
  ``network_per_MBps``, ``disk_per_MBps``). Exact for the linear forms of
  :data:`REGRESSIONS` (``RG`` is affine in ``f``).
  """
  probes = np.array([[0.0, 0, 0], [0.5, 0, 0], [0, 1e6, 0], [0, 0, 1e6]])
  design = np.column_stack([np.ones(4), features(regression, probes)])
  c = np.linalg.solve(design, p.ratio(probes))
  first = "inverse_idle" if regression == "inverse_idle" else "core"
  names = ("intercept", first, "network_per_MBps", "disk_per_MBps")
  return dict(zip(names, map(float, c), strict=True))


def _errors(
  result: Mapping[str, Any], regression: str
) -> tuple[predictor_lib.Predictor, np.ndarray, dict[str, Any]]:
  """The refitted predictor, its predicted ``t`` per sample, and its errors."""
  p = predictor_from(result, regression)
  samples = result["samples"]
  t = np.array([s["t"] for s in samples])
  pred = p.predict(_usage_matrix(samples))
  held = np.array([s["held_out"] for s in samples])
  rel = np.abs(pred - t) / t
  return (
    p,
    pred,
    {
      "held_out": float(np.mean(rel[held])) if held.any() else None,
      "in_sample": float(np.mean(rel[~held])),
      "coefficients": coefficients(p, regression),
    },
  )


def summarise(result: Mapping[str, Any]) -> dict[str, Any]:
  """The fit, errors and per-setting rows of a result holding ``samples`` and ``t0``.

  Returns ``{"fit", "error", "regressions", "rows"}``: the result's
  regression's coefficients and mean relative errors (held-out, in-sample,
  and predicting ``t0`` everywhere), every form of :data:`REGRESSIONS` fitted
  to the same windows (errors, coefficients), and per setting the mean ``U``,
  measured and predicted mean ``t`` and the speeds ``t0 / t``.
  """
  samples = result["samples"]
  t0 = float(result["t0"])
  t = np.array([s["t"] for s in samples])
  held = np.array([s["held_out"] for s in samples])
  _, pred, main = _errors(result, result["regression"])
  rel = np.abs(pred - t) / t
  rel0 = np.abs(t0 - t) / t

  def order(s):  # none, the CPU settings, the disk ones; by intensity
    x = s.get("setting")
    if x is None:
      return ()
    return (x["disk"], x["processes"] > 1, x["processes"] > 0, x["intensity"])

  rows = []
  for name in dict.fromkeys(s["label"] for s in sorted(samples, key=order)):
    idx = [i for i, s in enumerate(samples) if s["label"] == name]
    u = _usage_matrix([samples[i] for i in idx]).mean(axis=0)
    rows.append(
      {
        "label": name,
        "held_out": bool(held[idx[0]]),
        "windows": len(idx),
        "usage": dict(zip(predictor_lib.FEATURES, map(float, u), strict=True)),
        "corunner_cores": float(np.mean([samples[i]["corunner_cores"] for i in idx])),
        "t": float(np.mean(t[idx])),
        "t_pred": float(np.mean(pred[idx])),
        "t_median": float(np.mean([samples[i]["t_median"] for i in idx])),
        "error": float(np.mean(rel[idx])),
        "speed": t0 / float(np.mean(t[idx])),
        "speed_pred": t0 / float(np.mean(pred[idx])),
      }
    )
  return {
    "fit": {
      "coefficients": main["coefficients"],
      "train_windows": int((~held).sum()),
      "held_out_windows": int(held.sum()),
    },
    "error": {
      "held_out": main["held_out"],
      "in_sample": main["in_sample"],
      "held_out_constant": float(np.mean(rel0[held])) if held.any() else None,
      "paper": PAPER_ERROR,
    },
    "regressions": {name: _errors(result, name)[2] for name in REGRESSIONS},
    "rows": rows,
  }


def run(
  *,
  intensities: Sequence[float] = DEFAULT_INTENSITIES,
  held_out: Sequence[float] = DEFAULT_HELD_OUT,
  processes: Sequence[int] = (1, 2),
  disk: Sequence[float] = DEFAULT_DISK,
  repeats: int = 3,
  sample_seconds: float = 2.5,
  settle: float = 0.4,
  batch: int = 128,
  model: str = "mlp",
  regression: str = "linear",
  seed: int = 0,
  out_dir: str | None = None,
  log=sys.stderr,
) -> dict[str, Any]:
  """Profiles the step under co-runners, fits ``RG``, tests it on held-out ones.

  Paper 002 §3.3 (the predictor), §4.4 (its accuracy, 4.30 %); the module
  docstring says what is measured and how.

  Args:
    intensities: CPU co-runner intensities in ``[0, 1]``, each run with every
      count in ``processes``.
    held_out: intensities (CPU or disk) whose windows are kept out of the fit
      and predicted (the ``none`` windows are always fitted).
    processes: co-runner process counts of the CPU settings, each >= 1.
    disk: intensities of a 1-process disk-writing co-runner (``()``: none).
    repeats: passes over all settings, each window one sample, >= 1.
    sample_seconds: each window's length, > 0.
    settle: seconds between starting a co-runner and its window.
    batch: samples per step.
    model: a ``gradcomp.models.zoo`` name for 8x8x1 images.
    regression: the reported form, one of :data:`REGRESSIONS`; the others
      are fitted to the same windows too (``result["regressions"]``).
    seed: data, init and the passes' order.
    out_dir: writes ``predictor.json`` and ``predictor.md`` there if given.
    log: progress stream (``None``: quiet).

  Returns:
    The result: settings, every window's sample (``setting``, ``label``,
    ``held_out``, ``pass``, ``usage``, ``t`` and ``t_median`` seconds per
    sample, ``steps``, ``corunner_cores``, ``pids``), ``t0``, and
    :func:`summarise`'s ``fit``, ``error``, ``regressions`` and ``rows``.
  """
  from bench.compress import machine_info

  intensities, held_out = tuple(intensities), tuple(held_out)
  processes, disk = tuple(processes), tuple(disk)
  _check_run(intensities, held_out, processes, disk, repeats, sample_seconds, batch)
  regressor(regression)  # validates the name
  grid = settings(intensities, processes, disk)
  held = {float(h) for h in held_out}
  t_start = time.perf_counter()
  info = machine_info()  # its load average is the start's
  step, state, x, y = build_step(model, batch, seed)
  box = [state]
  for _ in range(20):  # compile and warm up
    box[0], loss = step(box[0], x, y)
  loss.block_until_ready()
  compile_s = time.perf_counter() - t_start
  _log(
    f"predictor: {model} batch {batch}, {len(grid)} settings x {repeats} passes "
    f"of {sample_seconds:g} s (compile + warm-up {compile_s:.1f} s)",
    log,
  )
  rng = np.random.default_rng(seed)
  samples = []
  for k in range(repeats):
    for i in rng.permutation(len(grid)):
      setting = grid[i]
      name = label(setting)
      is_held = setting["processes"] > 0 and setting["intensity"] in held
      if setting["processes"] == 0:
        sample, pids = _window(box, step, x, y, batch, sample_seconds, []), []
      else:
        with predictor_lib.co_runner(
          setting["intensity"],
          settle + sample_seconds + 60.0,  # they exit by themselves if we die
          processes=setting["processes"],
          disk=setting["disk"],
        ) as load:
          pids = load.pids
          time.sleep(settle)
          sample = _window(box, step, x, y, batch, sample_seconds, pids)
      sample = {
        "setting": setting,
        "label": name,
        "held_out": is_held,
        "pass": k,
        **sample,
        "pids": pids,
      }
      samples.append(sample)
      u = sample["usage"]
      _log(
        f"  pass {k} {name:>12}: t {sample['t'] * 1e6:7.3f} us/sample, U core "
        f"{u['core']:.2f} disk {u['disk'] / 1e6:6.1f} MB/s "
        f"(co-runner {sample['corunner_cores']:.2f} cores)",
        log,
      )
  t0 = statistics.median(s["t"] for s in samples if s["setting"]["processes"] == 0)
  result: dict[str, Any] = {
    "suite": "predictor",
    "paper": "002 §3.3, §4.4",
    "machine": info,
    "model": model,
    "batch": batch,
    "regression": regression,
    "intensities": list(intensities),
    "held_out": list(held_out),
    "processes": list(processes),
    "disk": list(disk),
    "repeats": repeats,
    "sample_seconds": sample_seconds,
    "settle": settle,
    "seed": seed,
    "compile_s": compile_s,
    "t0": t0,
    "samples": samples,
  }
  result.update(summarise(result))
  result["wall_s"] = time.perf_counter() - t_start
  result["loadavg_end"] = list(os.getloadavg())
  if out_dir is not None:
    from bench.output import write_json

    write_json(out_dir, "predictor.json", result)
    Path(out_dir, "predictor.md").write_text(render(result) + "\n")
  return result


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.2f} %"


def _formula(c: Mapping[str, float]) -> str:
  first = "inverse_idle" if "inverse_idle" in c else "core"
  name = "1/(1 - core)" if first == "inverse_idle" else "core"
  return (
    f"{c['intercept']:.3f} + {c[first]:.3f} {name} "
    f"+ {c['network_per_MBps']:.3g} net + {c['disk_per_MBps']:.3g} disk"
  )


def render(result: Mapping[str, Any]) -> str:
  """Markdown: the errors beside the paper's, ``t0``, each fit, one row per setting."""
  e = result["error"]
  load = result["machine"].get("loadavg", [float("nan")])[0]
  lines = [
    f"Predictor (paper 002 §3.3, §4.4) on {result['model']} batch "
    f"{result['batch']}, {result['machine']['cpu_count']} CPUs (1-min load "
    f"{load:.1f} at start), {result['repeats']} passes of "
    f"{result['sample_seconds']:g} s windows; held-out intensities "
    f"{result['held_out']}; reported RG: {result['regression']}.",
    "",
    "| | mean relative error |",
    "| --- | ---: |",
    f"| held-out windows ({result['fit']['held_out_windows']}) "
    f"| {_pct(e['held_out'])} |",
    f"| paper 002 §4.4 | {_pct(e['paper'])} |",
    f"| in-sample ({result['fit']['train_windows']} fitted windows) "
    f"| {_pct(e['in_sample'])} |",
    f"| held-out, predicting t0 everywhere | {_pct(e['held_out_constant'])} |",
    "",
    f"t0 = {result['t0'] * 1e6:.4f} us/sample ({1 / result['t0']:.0f} samples/s), "
    "the median of the `none` windows.",
    "",
    "| RG form | held-out error | in-sample error | RG(U), bytes in MB/s |",
    "| --- | ---: | ---: | --- |",
  ]
  for name, r in result["regressions"].items():
    lines.append(
      f"| {name} | {_pct(r['held_out'])} | {_pct(r['in_sample'])} "
      f"| {_formula(r['coefficients'])} |"
    )
  lines += [
    "",
    f"Per setting (means over its windows; predictions by {result['regression']}):",
    "",
    "| setting | split | U core | U disk MB/s | U net MB/s | co-runner cores "
    "| t us/sample | predicted | error | speed t0/t | predicted speed |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in result["rows"]:
    u = r["usage"]
    lines.append(
      f"| {r['label']} | {'held out' if r['held_out'] else 'fit'} "
      f"| {u['core']:.3f} | {u['disk'] / 1e6:.1f} | {u['network'] / 1e6:.2f} "
      f"| {r['corunner_cores']:.2f} | {r['t'] * 1e6:.3f} | {r['t_pred'] * 1e6:.3f} "
      f"| {_pct(r['error'])} | {r['speed']:.3f} | {r['speed_pred']:.3f} |"
    )
  return "\n".join(lines)
