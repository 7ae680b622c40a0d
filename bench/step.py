"""Measured training-step time of ResNet-20 per compressor and plan, beside the model's.

Paper 000 §4.3 and §5 (Table 3's ResNet-20). The step is the training
program's (``train/step.py``): a flax ResNet-20 (``gradcomp/models/zoo.py``) forward
and backward on this worker's shard of a synthetic CIFAR-10 batch, the
compressed exchange inside ``layerfusion(compressor, plan)``, SGD with
momentum and the non-finite guard (``train/optimizer.py``), as
``jit(shard_map)`` over the virtual CPU devices (8 by default) with params and
optimizer state donated. The batch is put on the devices once; the input
pipeline is not timed.

For every compressor (``fusion.SEARCH_COMPRESSORS``' hyper-parameters) and
plan (``layerwise``, ``single``, ``auto``):

* **measured**: the step's compile time (trace + lower + XLA compile), then
  the median of ``repeats`` steady-state steps after a warm-up
  (``profile.steady_state_seconds``); samples/s = batch / median step.
* **predicted**: the timeline simulator (``gradcomp.sim.CostModel``) with the
  calibration of ``bench/fusion.py``: the launch cost of a trivial
  program, a ring fitted to chained collectives on these devices, ``Comp``
  profiled with all devices compressing at once (minus the launch), and the
  compute time taken from the measured dense step: the ``none`` / ``single``
  step minus its predicted launch, compression and exchange is forward +
  backward (1 : 2), split over the leaves by their forward FLOPs
  (``shapes.derive`` of the flax model, as ``shapes.forward_flops``). That
  one step is the calibration point, so its prediction equals its
  measurement by construction (marked in the table), unless the predicted
  launch, compression and exchange alone exceed it: compute is then 0 and
  the prediction that overhead (a profile read on a loaded machine).
* ``auto`` is the §4.3 heuristic's plan under that calibrated model (what
  ``layerfusion`` would choose for this machine), not the training program's
  ``plan="auto"``, which plans for a nominal 20 Gbps cluster. When it equals
  the layer-wise or single plan, the same compiled step is reused.

Default run (``python -m bench step``; the figures below were
once taken with jemalloc preloaded, issue 18's with glibc): ResNet-20 at
Table 3's global batch 128 (16 per device), plans ``layerwise`` and ``auto``, 5 repeats, and
:data:`DEFAULT_COMPRESSORS`, one per family: ``none`` (measured anyway: it
calibrates), ``fp16``, ``topk``, ``signsgd``, ``powersgd``, ``sketch_topk``.
Compiling dominates: 4-60 s per step program on 2 cores, slowest for the
layer-wise plans of ``sketch_topk``, ``randomk`` and ``dgc`` (a compressor per
leaf, 59 leaves), plus profiling each compressor at 9 sizes on 8 devices and
the collective calibration (~20 s). On the 2-core CPU shared with other jobs
the default took 6-6.5 min (5.4 min of CPU); ``--full`` (all twelve
compressors) took 16 min there (9 min of CPU) and would sit near 10 minutes on
a quiet machine, so it is opt-in. Issue 5's throughput table, ``--compressors
none,topk,sketch_topk --plans layerwise,single,auto``, took 4.5 min.

``depth`` (default 20) picks a shallower ResNet of the same family, 6n + 2
layers with n basic blocks per stage (``ResNet20.blocks_per_stage``): the
tests time ResNet-8, whose step compiles in a fraction of ResNet-20's time.

Writes ``step.json``, ``step.md`` (the table, then samples/s per compressor
and plan) and ``step.png`` (measured vs predicted bars) to ``--out``. The
calibration step is timed again at the end: a large change means the machine
was not quiet and the predictions rest on a stale compute time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import gradcomp
from bench import fusion
from bench.output import write_json
from configs import default as default_config
from configs import resnet20_cifar10
from gradcomp.fusion.profiling import backend_name, steady_state_seconds
from gradcomp.models import shapes
from gradcomp.models import zoo as models
from gradcomp.parallel.wire import collective_bytes
from train import data as data_lib
from train import schemes
from train import step as step_lib

AXIS = step_lib.AXIS
PLANS = ("layerwise", "single", "auto")
#: Compressors of the default run (see the module docstring for the time).
DEFAULT_COMPRESSORS = ("none", "fp16", "topk", "signsgd", "powersgd", "sketch_topk")
#: Profile sizes: one leaf of ResNet-20 (16 values) up to past the whole model.
PROFILE_SIZES = tuple(2**p for p in range(4, 21, 2))
#: The dense step whose time gives the compute time of the prediction.
CALIBRATION = ("none", "single")


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
  """The model and one batch, as the training program builds them."""

  model: object
  params: dict
  model_state: dict
  batch: tuple  # (x, y), global, on the host.
  order: tuple[int, ...]  # gradient-ready order of the param leaves.
  sizes: tuple[int, ...]  # values per param leaf, tree order.
  flops: tuple[float, ...]  # forward FLOPs per sample per param leaf, tree order.


def leaf_flops(model, input_shape: Sequence[int]) -> list[float]:
  """Forward FLOPs per sample attributed to each param leaf of ``model`` (tree order).

  ``shapes.derive``'s, read from the jaxpr of the model's forward pass (the
  numbers of ``shapes.forward_flops``), put in the tree's order: flax sorts
  parameter names at every level.
  """
  sample = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  tensors = shapes.derive(model, sample)
  return [t.flops for t in sorted(tensors, key=lambda t: t.name.split("/"))]


def _blocks_per_stage(depth: int) -> int:
  """Basic blocks per stage of the CIFAR ResNet of ``depth`` = 6n + 2 layers: n.

  Raises:
    ValueError: unless ``depth`` is 6n + 2 for some n >= 1 (8, 14, 20, ...).
  """
  if (
    isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or depth % 6 != 2
  ):
    raise ValueError(
      f"depth must be 6n + 2 for an integer n >= 1 (8, 14, 20, ...), got {depth!r}"
    )
  return (depth - 2) // 6


@functools.lru_cache(maxsize=2)
def build(batch: int, seed: int = 0, depth: int = 20) -> Setup:
  """ResNet-``depth`` and one synthetic CIFAR-10 batch, initialised as ``train.py`` does.

  Cached: initialising compiles the model's init (seconds on a CPU).
  """
  ds = data_lib.synthetic_like("cifar10", seed=seed, num_train=batch, num_test=8)
  model = models.create(
    "resnet20", ds.num_classes, blocks_per_stage=_blocks_per_stage(depth)
  )
  init_rng, _ = jax.random.split(jax.random.PRNGKey(seed))
  params, model_state = step_lib.init_model(
    model, init_rng, ds.input_shape, ds.x_train.dtype
  )
  x, y = next(data_lib.batches(ds.x_train, ds.y_train, batch, seed))
  order = step_lib.gradient_order(model, params, model_state, x, y)
  return Setup(
    model=model,
    params=params,
    model_state=model_state,
    batch=(x, y),
    order=tuple(order),
    sizes=tuple(int(np.size(v)) for v in jax.tree.leaves(params)),
    flops=tuple(leaf_flops(model, ds.input_shape)),
  )


def config_for(compressor: str, hyperparameters: dict, plan, batch: int):
  """Table 3's ResNet-20 config with this compressor, plan and batch."""
  config = resnet20_cifar10.get_config()
  config.dataset.synthetic = True
  config.global_batch_size = batch
  config.compressor = default_config.compressor(compressor, **hyperparameters)
  config.fusion.plan = "auto" if isinstance(plan, gradcomp.Plan) else plan
  return config


def make_step(setup: Setup, mesh, config, plan: gradcomp.Plan | None = None):
  """``(train_step, (params, model_state, opt_state), batch)`` on ``mesh``.

  The optimizer, layout and step are the training program's
  (``schemes.build``, ``step.infer_layout``, ``step.make_train_step``).
  ``plan`` (for ``config.fusion.plan="auto"``) is handed to
  ``schemes.build`` as a resumed run's saved plan, so the program uses it
  instead of planning for its nominal cluster.
  """
  sizes = list(setup.sizes)
  tx, used = schemes.build(config, setup.order, 1, sizes, plan)
  if plan is not None and used != plan:
    raise RuntimeError(f"schemes.build did not use the given plan {plan}")
  params = jax.tree.map(jnp.copy, setup.params)
  model_state = jax.tree.map(jnp.copy, setup.model_state)
  opt_state = tx.init(params)
  batch = step_lib.shard_batch(mesh, setup.batch)
  layout = step_lib.infer_layout(
    setup.model, tx, mesh, params, model_state, opt_state, batch
  )
  carry = layout.place(params, model_state, layout.to_global(opt_state))
  return step_lib.make_train_step(setup.model, tx, layout), carry, batch


def compile_step(train_step, carry, batch) -> tuple[Callable, dict]:
  """``train_step`` compiled for these arguments, with its compile time and wire.

  Returns the compiled step (called like ``train_step``) and ``{"trace_s",
  "compile_s", "wire_bytes"}``: seconds to trace and lower, seconds to trace,
  lower and compile, and the bytes one worker sends per step (its optimized
  HLO's collectives, ``wire.collective_bytes``).
  """
  t0 = time.perf_counter()
  lowered = train_step.lower(*carry, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  wire = sum(collective_bytes(compiled.as_text()).values())
  return compiled, {"trace_s": t1 - t0, "compile_s": t2 - t0, "wire_bytes": wire}


def step_seconds(compiled, carry, batch, repeats: int) -> tuple[float, tuple, dict]:
  """Median seconds of ``repeats`` steps after a warm-up, the state fed back.

  Returns the median, the state after the last step (``carry`` is donated)
  and that step's metrics.
  """
  last = {}

  def step(batch, carry):
    *carry, metrics = compiled(*carry, batch)
    last.update(carry=tuple(carry), metrics=metrics)
    return metrics, last["carry"]

  seconds = steady_state_seconds(step, carry, batch, repeats=repeats)
  return seconds, last["carry"], last["metrics"]


def _profile(tx, launch: float, repeats: int, sizes) -> gradcomp.sim.Profile:
  """``Comp`` with every device compressing at once, minus the launch."""
  measured = gradcomp.fusion.profile(
    tx, sizes, devices=len(jax.devices()), repeats=repeats
  )
  return dataclasses.replace(
    measured,
    seconds=tuple(max(t - launch, 0.0) for t in measured.seconds),
    fused_seconds=tuple(max(t - launch, 0.0) for t in measured.fused_seconds),
  )


def workload(setup: Setup, launch: float, backward: float) -> gradcomp.sim.Workload:
  """Leaves in gradient-ready order; forward = launch + backward / 2."""
  return gradcomp.sim.Workload.from_weights(
    [setup.sizes[i] for i in setup.order],
    [setup.flops[i] for i in setup.order],
    backward,
    forward_seconds=launch + backward / 2,
  )


def validate(
  compressors: Sequence[str],
  plans: Sequence[str],
  batch: int,
  devices: int,
  depth: int = 20,
) -> None:
  """Raises ``ValueError`` naming what is wrong with a run's arguments."""
  _blocks_per_stage(depth)
  unknown = [c for c in compressors if c not in fusion.SEARCH_COMPRESSORS]
  if unknown or not compressors:
    raise ValueError(
      f"unknown compressors {unknown or '(none given)'}; valid: "
      f"{', '.join(fusion.SEARCH_COMPRESSORS)}"
    )
  bad = [p for p in plans if p not in PLANS]
  if bad or not plans:
    raise ValueError(
      f"unknown plans {bad or '(none given)'}; valid: {', '.join(PLANS)}"
    )
  if batch < devices or batch % devices:
    raise ValueError(
      f"batch={batch} must be a positive multiple of the {devices} devices "
      "(each worker takes an equal shard)"
    )


def run(
  compressors: Sequence[str] = DEFAULT_COMPRESSORS,
  plans: Sequence[str] = ("layerwise", "auto"),
  batch: int = 128,
  repeats: int = 5,
  out_dir: str = "bench_out/",
  profile_sizes: Sequence[int] = PROFILE_SIZES,
  cluster: gradcomp.sim.Cluster | None = None,
  depth: int = 20,
) -> dict:
  """Measured and predicted step time of every compressor x plan; returns results.

  Args:
    compressors: names of ``fusion.SEARCH_COMPRESSORS``, in table order.
    plans: some of :data:`PLANS`.
    batch: the global batch, a multiple of the device count.
    repeats: timed steps per setting (median), and timed calls per profile
      size and per calibration collective.
    out_dir: where ``step.json``, ``step.md`` and ``step.png`` go.
    profile_sizes: buffer sizes at which ``Comp`` is profiled.
    cluster: the cluster the prediction assumes; by default one calibrated on
      these devices (``fusion.calibrate_cluster``).
    depth: layers of the ResNet, 6n + 2 (20: ResNet-20, the paper's).

  Raises:
    ValueError: for an unknown compressor or plan, an indivisible batch or a
      depth not of the form 6n + 2.
  """
  validate(compressors, plans, batch, len(jax.devices()), depth)
  mesh = jax.make_mesh((len(jax.devices()),), (AXIS,))
  t_start, cpu_start = time.perf_counter(), time.process_time()

  def elapsed() -> str:
    return (
      f"{time.perf_counter() - t_start:.0f} s, "
      f"cpu {time.process_time() - cpu_start:.0f} s"
    )

  setup = build(batch, depth=depth)
  launch = fusion.launch_seconds(mesh)
  samples = []
  if cluster is None:
    cluster, samples = fusion.calibrate_cluster(mesh, launch, repeats)
  log = functools.partial(print, flush=True)
  log(
    f"launch {launch * 1e3:.2f} ms; ring {cluster.latency_us:.1f} us, "
    f"{cluster.bandwidth_gbps:.1f} Gbps ({elapsed()})"
  )

  measured: dict[tuple, dict] = {}  # (compressor, boundaries) -> measurement
  kept = {}  # The calibration step, timed again at the end.

  def measure_plan(name: str, plan: gradcomp.Plan, label: str) -> dict:
    key = (name, plan.boundaries)
    if key not in measured:
      # Layer-wise and single by name, as a config would give them; auto's
      # plan as a resumed run's saved plan.
      chosen = plan if label == "auto" else label
      config = config_for(name, fusion.SEARCH_COMPRESSORS[name], chosen, batch)
      saved = plan if label == "auto" else None
      train_step, carry, sharded = make_step(setup, mesh, config, saved)
      compiled, info = compile_step(train_step, carry, sharded)
      seconds, carry, metrics = step_seconds(compiled, carry, sharded, repeats)
      measured[key] = dict(
        info,
        step_s=seconds,
        plan=label,
        loss=float(metrics["loss"]),
        skipped=bool(metrics["skipped"]),
      )
      if (name, label) == CALIBRATION:
        kept.update(compiled=compiled, carry=carry, batch=sharded)
    return measured[key]

  # The calibration step: compute = dense single step - launch - Comp - Comm.
  name, label = CALIBRATION
  single = gradcomp.Plan.single(setup.order)
  dense = measure_plan(name, single, label)
  profiles = {
    name: _profile(
      gradcomp.get(name, axis_name=AXIS, **fusion.SEARCH_COMPRESSORS[name]),
      launch,
      repeats,
      profile_sizes,
    )
  }
  bare = gradcomp.sim.CostModel(profiles[name], cluster, workload(setup, launch, 0.0))
  overhead = float(bare.iteration_seconds(())[0])
  backward = max(dense["step_s"] - overhead, 0.0) / 1.5
  log(
    f"dense step {dense['step_s'] * 1e3:.1f} ms: compute {1.5 * backward * 1e3:.1f}"
    f" ms (forward + backward), launch + Comp + Comm {overhead * 1e3:.1f} ms "
    f"({elapsed()})"
  )
  work = workload(setup, launch, backward)

  rows = []
  for name in compressors:
    hp = fusion.SEARCH_COMPRESSORS[name]
    if name not in profiles:
      tx = gradcomp.get(name, axis_name=AXIS, **hp)
      profiles[name] = _profile(tx, launch, repeats, profile_sizes)
    cost = gradcomp.sim.CostModel(profiles[name], cluster, work)
    for label in plans:
      method = "heuristic" if label == "auto" else label
      plan = gradcomp.fusion.search_plan(cost, setup.order, method)
      m = measure_plan(name, plan, label)
      timeline = cost.timeline(plan)
      row = {
        "compressor": name,
        "hyperparameters": hp,
        "plan": label,
        "groups": len(plan.groups),
        "same_program_as": None if m["plan"] == label else m["plan"],
        "calibration": (name, label) == CALIBRATION,
        "compile_s": m["compile_s"],
        "measured_ms": m["step_s"] * 1e3,
        "predicted_ms": timeline.iteration_seconds * 1e3,
        "predicted_comp_ms": sum(timeline.comp_seconds) * 1e3,
        "predicted_comm_ms": sum(timeline.comm_seconds) * 1e3,
        "predicted_hidden_ms": timeline.overlap_seconds * 1e3,
        "samples_per_s": batch / m["step_s"],
        "wire_bytes": m["wire_bytes"],
        "loss": m["loss"],
        "skipped": m["skipped"],
      }
      rows.append(row)
      log(
        f"{name} {label}: {row['groups']} groups, compile {row['compile_s']:.1f} s, "
        f"{row['measured_ms']:.1f} ms measured, {row['predicted_ms']:.1f} predicted "
        f"({elapsed()})"
      )
  # Drift of the machine over the run: the calibration step timed again.
  again, *_ = step_seconds(kept["compiled"], kept["carry"], kept["batch"], repeats)
  log(f"dense step again: {again * 1e3:.1f} ms ({elapsed()})")
  result = {
    "backend": backend_name(mesh.size),
    "model": f"resnet{depth}",
    "data": "synthetic cifar10",
    "global_batch": batch,
    "devices": mesh.size,
    "repeats": repeats,
    "num_params": int(sum(setup.sizes)),
    "num_leaves": len(setup.sizes),
    "launch_ms": launch * 1e3,
    "cluster": {
      "latency_us": cluster.latency_us,
      "bandwidth_gbps": cluster.bandwidth_gbps,
    },
    "collectives": samples,
    "calibration": {
      "compressor": CALIBRATION[0],
      "plan": CALIBRATION[1],
      "measured_ms": dense["step_s"] * 1e3,
      "measured_again_ms": again * 1e3,
      "compute_ms": 1.5 * backward * 1e3,
      "forward_ms": backward / 2 * 1e3,
      "backward_ms": backward * 1e3,
    },
    "profile_sizes": list(profile_sizes),
    "rows": rows,
    "total_s": time.perf_counter() - t_start,
    "total_cpu_s": time.process_time() - cpu_start,
  }
  write_json(out_dir, "step.json", result)
  table = format_table(result)
  with open(os.path.join(out_dir, "step.md"), "w") as f:
    f.write(table + "\n")
  plot(result, os.path.join(out_dir, "step.png"))
  print(table)
  return result


def _title(result: dict) -> str:
  """``"ResNet-20"`` for ``result["model"] == "resnet20"``."""
  return "ResNet-" + result["model"].removeprefix("resnet")


def format_table(result: dict) -> str:
  c, cal = result["cluster"], result["calibration"]
  lines = [
    f"{_title(result)}, synthetic CIFAR-10, global batch {result['global_batch']} on "
    f"{result['backend']}; median of {result['repeats']} steps. Model: launch "
    f"{result['launch_ms']:.2f} ms, ring {c['latency_us']:.1f} us / "
    f"{c['bandwidth_gbps']:.1f} Gbps, compute {cal['compute_ms']:.1f} ms from "
    f"the {cal['compressor']} / {cal['plan']} step (*), which took "
    f"{cal['measured_ms']:.1f} ms first and {cal['measured_again_ms']:.1f} ms "
    "at the end of the run.",
    "",
    "| compressor | plan | groups | compile s | measured ms | predicted ms "
    "| measured / predicted | samples/s | wire bytes |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in result["rows"]:
    plan = r["plan"] + (f" (= {r['same_program_as']})" if r["same_program_as"] else "")
    mark = " (*)" if r["calibration"] else ""
    if r["skipped"]:  # A non-finite step: apply_if_finite skipped the update.
      mark += " (non-finite)"
    lines.append(
      f"| {r['compressor']} | {plan} | {r['groups']} | {r['compile_s']:.1f} "
      f"| {r['measured_ms']:.1f} | {r['predicted_ms']:.1f}{mark} "
      f"| {r['measured_ms'] / r['predicted_ms']:.2f} | {r['samples_per_s']:.0f} "
      f"| {r['wire_bytes']:,} |"
    )
  lines += ["", throughput_table(result)]
  return "\n".join(lines)


def throughput_table(result: dict) -> str:
  """Samples/s, one row per compressor and one column per plan (issue 5)."""
  rows = result["rows"]
  plans = list(dict.fromkeys(r["plan"] for r in rows))
  lines = [
    "| samples/s | " + " | ".join(plans) + " |",
    "| --- |" + " ---: |" * len(plans),
  ]
  for name in dict.fromkeys(r["compressor"] for r in rows):
    by_plan = {r["plan"]: r for r in rows if r["compressor"] == name}
    cells = [
      f"{by_plan[p]['samples_per_s']:.0f}" if p in by_plan else "" for p in plans
    ]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """Grouped bars per compressor: measured (solid) and predicted (hatched) per plan."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = result["rows"]
  names = list(dict.fromkeys(r["compressor"] for r in rows))
  plans = list(dict.fromkeys(r["plan"] for r in rows))
  width = 0.8 / (2 * len(plans))
  bars = 2 * len(names) * len(plans)
  fig, ax = plt.subplots(figsize=(min(max(3.0 + 0.25 * bars, 8.0), 18.0), 4.5))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for j, plan in enumerate(plans):
    by_name = {r["compressor"]: r for r in rows if r["plan"] == plan}
    xs = np.arange(len(names)) - 0.4 + width * (2 * j + 0.5)
    measured = [by_name[n]["measured_ms"] if n in by_name else 0.0 for n in names]
    predicted = [by_name[n]["predicted_ms"] if n in by_name else 0.0 for n in names]
    color = colors[j % len(colors)]
    ax.bar(xs, measured, width, color=color, label=f"{plan} measured")
    ax.bar(
      xs + width,
      predicted,
      width,
      color="white",
      edgecolor=color,
      hatch="//",
      label=f"{plan} predicted",
    )
  ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
  ax.set_ylabel("step time, ms")
  ax.set_title(
    f"{_title(result)} train step, global batch {result['global_batch']}, "
    f"{result['backend']}\nmeasured (solid) vs predicted (hatched)",
    fontsize=10,
  )
  ax.set_xlim(-0.5, len(names) - 0.5)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
