"""Predicted vs measured: does the LayerFusion cost model order plans as reality does?

Paper 000 §4.3. On this machine's virtual CPU devices (8 by default, sharing
the host's cores), for a model-shaped gradient tree and a compressor:

1. measure the cost of launching one (trivial) program on all devices: every
   timed call below pays it once, a step pays it once, not once per group;
2. profile the compressor with all devices compressing at once
   (``gradcomp.fusion.profile(..., devices=8)``), minus the launch: ``Comp`` as a
   worker sees it here;
3. calibrate a :class:`Cluster` for the in-process "network": time
   chains of all-reduces and all-gathers of float32 buffers inside one
   program (each is a rendezvous of all device threads), minus the launch,
   and fit the ring model's latency and bandwidth (least squares, both kept
   >= 0);
4. predict the step time (launch + compression + exchange; the trees have
   no backward pass, so there is nothing to overlap) of the layer-wise,
   single and auto (heuristic) plans with the timeline simulator;
5. measure the same steps: ``jit(shard_map(tx.update))`` with the state
   donated, median of ``repeats`` calls taken round-robin over the plans.

The calibrated cluster has ``overlap=False``: between virtual devices the
device threads copy the bytes themselves, so an exchange cannot hide behind
the next group's compression (the pipelining a real link allows).

Writes ``fusion_check.json`` and prints a markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from bench.output import write_json
from gradcomp.compressors import registry
from gradcomp.fusion.profiling import backend_name, steady_state_seconds
from gradcomp.models import shapes
from gradcomp.parallel.workers import sharded_update
from gradcomp.sim.model_workload import model_workload
from gradcomp.sim.profile import DEFAULT_SIZES

AXIS = "data"


def launch_seconds(mesh, repeats: int = 20) -> float:
  """Median time of a trivial jitted ``shard_map`` step on every device of ``mesh``."""
  f = jax.jit(
    jax.shard_map(
      lambda s: (s + 1,), mesh=mesh, in_specs=P(AXIS), out_specs=(P(AXIS),)
    ),
    donate_argnums=0,
  )
  s = jax.device_put(jnp.zeros((mesh.devices.size,)), NamedSharding(mesh, P(AXIS)))
  return steady_state_seconds(lambda s: f(s), s, repeats=repeats)


def _fit_ring(rows, targets) -> tuple[float, float]:
  """Least-squares ``(alpha, seconds per byte)``, each constrained to be >= 0."""
  a, t = np.asarray(rows, np.float64), np.asarray(targets, np.float64)
  (alpha, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
  if alpha < 0:
    alpha, per_byte = 0.0, float(a[:, 1] @ t / (a[:, 1] @ a[:, 1]))
  if per_byte <= 0:
    alpha, per_byte = max(float(a[:, 0] @ t / (a[:, 0] @ a[:, 0])), 0.0), 1e-15
  return alpha, per_byte


#: Collectives chained in one program when calibrating: inside a step every
#: collective is a rendezvous of all device threads, which a lone collective
#: would hide in the program's launch cost.
CHAIN = 16


def _chain(x, kind: str):
  """``CHAIN`` dependent collectives of ``kind`` on ``x``."""
  for _ in range(CHAIN):
    if kind == "all-reduce":
      x = jax.lax.psum(x, AXIS) * (1.0 / jax.lax.axis_size(AXIS))
    else:
      x = jax.lax.all_gather(x, AXIS, to="invarying")[-1] * 0.5
    x = jax.lax.pcast(x, AXIS, to="varying") if AXIS not in _varying_axes(x) else x
  return x


def _varying_axes(x):
  return getattr(jax.typeof(x).manual_axis_type, "varying", ())


#: Values per device of the calibration collectives: latency-bound (2^8) to
#: bandwidth-bound (2^22 float32, 16 MiB per device).
CALIBRATION_SIZES = (2**8, 2**12, 2**16, 2**20, 2**22)


def calibrate_cluster(
  mesh, launch: float, repeats: int = 5, sizes=CALIBRATION_SIZES
) -> tuple[gradcomp.sim.Cluster, list[dict]]:
  """The ring model's latency and bandwidth that best fit this mesh's collectives.

  Chains of all-reduces and of all-gathers of ``sizes`` float32 values per
  device are timed (median of ``repeats``); at least two sizes, so that the
  fit can tell the latency from the per-byte time.
  """
  sizes = tuple(sizes)
  if len(sizes) < 2 or len(set(sizes)) < len(sizes) or min(sizes) < 1:
    raise ValueError(
      f"sizes must be at least two distinct positive sizes, got {sizes!r}"
    )
  n = mesh.devices.size
  if n == 1:
    # One device exchanges nothing: every collective is free, whatever the
    # link (a lent single GPU). Nothing to fit.
    return gradcomp.sim.Cluster(1, latency_us=0.0, overlap=False), []
  rows, targets, samples = [], [], []
  for kind in ("all-reduce", "all-gather"):
    for size in sizes:
      f = jax.jit(
        jax.shard_map(
          lambda x, s, kind=kind: (_chain(x, kind), s),
          mesh=mesh,
          in_specs=P(AXIS),
          out_specs=(P(AXIS), P(AXIS)),
        )
      )
      x = jax.device_put(
        jnp.ones((n * size,), jnp.float32), NamedSharding(mesh, P(AXIS))
      )
      s = jax.device_put(jnp.zeros((n,), jnp.float32), NamedSharding(mesh, P(AXIS)))
      total = steady_state_seconds(f, s, x, repeats=repeats)
      seconds = max(total - launch, 0.0) / CHAIN
      steps, volume = (
        (2 * (n - 1), 2 * (n - 1) / n) if kind == "all-reduce" else (n - 1, n - 1)
      )
      rows.append([steps, volume * 4 * size])
      targets.append(seconds)
      samples.append({"kind": kind, "values": size, "ms": seconds * 1e3})
  alpha, per_byte = _fit_ring(rows, targets)
  # The device threads copy the bytes themselves: no exchange hides behind
  # computation on this "network".
  cluster = gradcomp.sim.Cluster(
    n, bandwidth_gbps=8 / per_byte / 1e9, latency_us=alpha * 1e6, overlap=False
  )
  return cluster, samples


def _sharded_update(tx, tree, mesh):
  """``(jitted step, grads, state)``: ``tx.update`` on per-worker copies of ``tree``."""
  n = mesh.devices.size
  # One program puts every leaf's copies on the devices: leaf by leaf, each
  # shape would compile its own broadcast and resharding.
  per_worker = jax.jit(
    lambda tree: gradcomp.add_worker_axis((tree, tx.init(tree)), n),
    out_shardings=NamedSharding(mesh, P(AXIS)),
  )
  grads, state = per_worker(tree)
  return jax.jit(sharded_update(tx, mesh, AXIS), donate_argnums=1), grads, state


def measure_steps(txs: dict, tree, mesh, repeats: int) -> dict[str, tuple[float, ...]]:
  """Per named ``tx``: ``repeats`` step times, measured round-robin.

  Timing the plans in turn, one call each per round, exposes them to the same
  drift of a shared machine (on 8 virtual devices sharing 2 cores, a plan
  timed alone moved by up to 2x between runs); the median of each is then
  comparable.
  """
  steps = {name: _sharded_update(tx, tree, mesh) for name, tx in txs.items()}
  states = {}
  for name, (f, grads, state) in steps.items():
    for _ in range(2):  # compile, then warm up
      _, state = jax.block_until_ready(f(grads, state))
    states[name] = state
  times = {name: [] for name in txs}
  for _ in range(repeats):
    for name, (f, grads, _) in steps.items():
      t0 = time.perf_counter()
      _, states[name] = jax.block_until_ready(f(grads, states[name]))
      times[name].append(time.perf_counter() - t0)
  return {name: tuple(t) for name, t in times.items()}


def run(
  models=("resnet20", "resnet50"),
  compressor: str = "topk",
  hyperparameters: dict | None = None,
  repeats: int = 5,
  out_dir: str = "bench_out/",
  sizes=DEFAULT_SIZES,
  calibration_sizes=CALIBRATION_SIZES,
) -> dict:
  """Predicted and measured step times of three plans per model; returns the results.

  ``sizes`` are the compressor's profile sizes, ``calibration_sizes`` those of
  the collectives the ring is fitted to (:func:`calibrate_cluster`).
  """
  hyperparameters = {"ratio": 0.01} if hyperparameters is None else hyperparameters
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), (AXIS,))
  tx = registry.get(compressor, axis_name=AXIS, **hyperparameters)
  launch = launch_seconds(mesh)
  cluster, samples = calibrate_cluster(mesh, launch, repeats, calibration_sizes)
  measured = gradcomp.fusion.profile(tx, sizes, devices=len(devices), repeats=repeats)
  profile = dataclasses.replace(
    measured,
    seconds=tuple(max(t - launch, 0.0) for t in measured.seconds),
    fused_seconds=tuple(max(t - launch, 0.0) for t in measured.fused_seconds),
  )
  result = {
    "backend": profile.backend,
    "launch_ms": launch * 1e3,
    "compressor": profile.compressor,
    "cluster": {
      "latency_us": cluster.latency_us,
      "bandwidth_gbps": cluster.bandwidth_gbps,
    },
    "collectives": samples,
    "profile": json.loads(profile.to_json()),
    "models": {},
  }
  for model in models:
    work = model_workload(model, backward_ms=0.0)
    workload = dataclasses.replace(work.workload, forward_seconds=launch)
    cost = gradcomp.sim.CostModel(profile, cluster, workload)
    tree = shapes.make_tree(shapes.MODELS[model]())
    plans = {
      method: gradcomp.fusion.search_plan(cost, work.order, method)
      for method in ("layerwise", "single", "heuristic")
    }
    # Plans found equal are one program: measured once, reported for each.
    distinct = {}
    for method, plan in plans.items():
      distinct.setdefault(plan.boundaries, method)
    times = measure_steps(
      {m: gradcomp.layerfusion(tx, plans[m]) for m in distinct.values()},
      tree,
      mesh,
      repeats,
    )
    rows = {}
    for method, plan in plans.items():
      seconds = times[distinct[plan.boundaries]]
      rows[method] = {
        "groups": len(plan.groups),
        "predicted_ms": cost.iteration_seconds(plan.boundaries)[0] * 1e3,
        "measured_ms": float(np.median(seconds)) * 1e3,
        "measured_spread_ms": [min(seconds) * 1e3, max(seconds) * 1e3],
      }
      print(f"{model} {method}: {rows[method]}", flush=True)
    by_prediction = sorted(rows, key=lambda m: rows[m]["predicted_ms"])
    by_measurement = sorted(rows, key=lambda m: rows[m]["measured_ms"])
    result["models"][model] = {
      "tensors": len(workload.sizes),
      "values": int(sum(workload.sizes)),
      "plans": rows,
      "order_predicted": by_prediction,
      "order_measured": by_measurement,
    }
  write_json(out_dir, "fusion_check.json", result)
  print(format_table(result))
  return result


def format_table(result: dict) -> str:
  c = result["cluster"]
  lines = [
    f"{result['compressor']} on {result['backend']}; launch "
    f"{result['launch_ms']:.2f} ms; calibrated ring: "
    f"{c['latency_us']:.1f} us, {c['bandwidth_gbps']:.1f} Gbps",
    "",
    "| model | plan | groups | predicted ms | measured ms | measured / predicted |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]
  for model, m in result["models"].items():
    for method, r in m["plans"].items():
      label = "auto (heuristic)" if method == "heuristic" else method
      lines.append(
        f"| {model} | {label} | {r['groups']} | {r['predicted_ms']:.1f} "
        f"| {r['measured_ms']:.1f} | {r['measured_ms'] / r['predicted_ms']:.2f} |"
      )
    same = m["order_predicted"] == m["order_measured"]
    lines.append(
      f"| {model} | order | | {' < '.join(m['order_predicted'])} "
      f"| {' < '.join(m['order_measured'])} | {'match' if same else 'MISMATCH'} |"
    )
  return "\n".join(lines)


#: One configuration per registered compressor for the search table.
SEARCH_COMPRESSORS = {
  "none": {},
  "fp16": {},
  "topk": {"ratio": 0.01},
  "randomk": {"ratio": 0.01},
  "dgc": {"ratio": 0.01},
  "qsgd": {},
  "terngrad": {},
  "signsgd": {},
  "ef_signsgd": {},
  "powersgd": {},
  "threshold_quantize": {},
  "sketch_topk": {"ratio": 0.01},
  "onebit_sgd": {},
  "fixed_point": {"bits": 8},
  "dynamic_fixed_point": {"bits": 12},
  "sparse_quantize": {"threshold": 2.6},
  "fp8": {},
  "fp4": {},
  "int_quantize": {},
  "qgz": {},
}


def search_table(
  bandwidths=(1.0, 10.0, 20.0, 100.0),
  workers: int = 16,
  repeats: int = 3,
  profile_dir: str | None = None,
  out_dir: str = "bench_out/",
) -> dict:
  """Heuristic (§4.3) vs DP optimum, predicted, on every model x compressor x bandwidth.

  Profiles are measured on one device of this backend (or loaded from
  ``profile_dir/<compressor>.json`` when present, and saved there otherwise);
  compute time per model comes from its FLOPs at the default throughput
  (``gradcomp.sim.model_workload``).
  """
  rows = []
  for name, kwargs in SEARCH_COMPRESSORS.items():
    tx = registry.get(name, **kwargs)
    path = os.path.join(profile_dir, f"{name}.json") if profile_dir else None
    if path and os.path.exists(path):
      profile = gradcomp.sim.Profile.load(path)
      profile.check_for(tx)
    else:
      profile = gradcomp.fusion.profile(tx, DEFAULT_SIZES, repeats=repeats)
      if path:
        os.makedirs(profile_dir, exist_ok=True)
        profile.save(path)
    for model in shapes.MODELS:
      work = model_workload(model)
      for bandwidth in bandwidths:
        cost = gradcomp.sim.CostModel(
          profile, gradcomp.sim.Cluster(workers, bandwidth), work.workload
        )
        t0 = time.perf_counter()
        heuristic, heuristic_s = gradcomp.fusion.heuristic_search(cost)
        search_s = time.perf_counter() - t0
        optimal, optimal_s = gradcomp.fusion.optimal_search(cost)
        rows.append(
          {
            "compressor": name,
            "model": model,
            "bandwidth_gbps": bandwidth,
            "heuristic_groups": len(heuristic) + 1,
            "optimal_groups": len(optimal) + 1,
            "heuristic_ms": heuristic_s * 1e3,
            "optimal_ms": optimal_s * 1e3,
            "layerwise_ms": float(
              cost.iteration_seconds(tuple(range(1, cost.num_leaves)))[0]
            )
            * 1e3,
            "single_ms": float(cost.iteration_seconds(())[0]) * 1e3,
            "gap": heuristic_s / optimal_s - 1,
            "search_ms": search_s * 1e3,
          }
        )
    print(
      f"{name}: worst gap {max(r['gap'] for r in rows if r['compressor'] == name):.4%}",
      flush=True,
    )
  result = {"backend": backend_name(1), "workers": workers, "rows": rows}
  write_json(out_dir, "fusion_search.json", result)
  print(format_search_table(result))
  return result


def format_search_table(result: dict) -> str:
  rows = result["rows"]
  lines = [
    f"{result['workers']} workers; profiles from {result['backend']}; "
    "gap = heuristic / optimal - 1 (predicted iteration time)",
    "",
    "| compressor | model | worst gap | at Gbps | groups heur / opt | max search ms |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]
  for name in dict.fromkeys(r["compressor"] for r in rows):
    for model in dict.fromkeys(r["model"] for r in rows):
      sel = [r for r in rows if r["compressor"] == name and r["model"] == model]
      worst = max(sel, key=lambda r: r["gap"])
      lines.append(
        f"| {name} | {model} | {worst['gap']:.3%} | {worst['bandwidth_gbps']:g} "
        f"| {worst['heuristic_groups']} / {worst['optimal_groups']} "
        f"| {max(r['search_ms'] for r in sel):.0f} |"
      )
  worst = max(rows, key=lambda r: r["gap"])
  lines.append(
    f"\nworst over all {len(rows)} settings: {worst['gap']:.3%} "
    f"({worst['compressor']}, {worst['model']}, {worst['bandwidth_gbps']:g} Gbps); "
    f"slowest heuristic search {max(r['search_ms'] for r in rows):.0f} ms"
  )
  return "\n".join(lines)
