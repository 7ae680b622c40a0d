"""The training loop: ``train_and_evaluate(config, workdir)`` (DESIGN §3).

Builds the dataset, model, optimizer (compressor + LayerFusion + SGD) and the
``shard_map`` (or ``pmap``, ``config.step``) step of ``train/step.py``;
restores the latest checkpoint of ``workdir`` if there is one; then trains,
logging to ``metrics.jsonl``, TensorBoard and stderr, evaluating every
``eval_every_steps`` and checkpointing every ``checkpoint_every_steps`` and at
the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.models import zoo as models
from gradcomp.parallel import wire
from train import checkpoint as checkpoint_lib
from train import data as data_lib
from train import edgegossip as edgegossip_lib
from train import factors as factors_lib
from train import logs, pricing
from train import optimizer as optimizer_lib
from train import step as step_lib

CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
#: The simulated clock's inputs: ``flops_per_step``, ``round_wire`` ({kind:
#: bytes} of one exchange round), ``wire_bytes_per_step``.
SIM_FILE = "sim.json"
CHECKPOINT_DIR = "checkpoints"


class NonFiniteError(FloatingPointError):
  """Too many consecutive steps had a non-finite loss or gradient."""


class Result(NamedTuple):
  """What a finished run returns.

  Attributes:
    state: the final train state, as checkpointed (``params``,
      ``model_state``, ``opt_state``, ``step``, ``rng``).
    eval_metrics: ``{"eval_loss", "eval_accuracy"}`` at the last step.
  """

  state: dict[str, Any]
  eval_metrics: dict[str, float]


def total_steps(config, num_train: int) -> int:
  """``config.num_train_steps`` if set, else ``num_epochs`` epochs of steps."""
  if config.get("num_train_steps"):
    return int(config.num_train_steps)
  per_epoch = data_lib.steps_per_epoch(num_train, config.global_batch_size)
  return int(math.ceil(config.num_epochs * per_epoch))


def _check(config, num_devices: int) -> None:
  step_lib.check_variant(_variant(config))
  batch = config.global_batch_size
  if batch % num_devices:
    raise ValueError(
      f"config.global_batch_size={batch} is not divisible by the {num_devices} "
      f"devices: every worker takes an equal shard of each batch; use a "
      f"multiple of {num_devices}."
    )
  factors_lib.check(config)
  for name in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    if config[name] < 1:
      raise ValueError(f"config.{name} must be >= 1, got {config[name]}")
  if config.max_consecutive_nonfinite < 1:
    raise ValueError(
      f"config.max_consecutive_nonfinite must be >= 1, got "
      f"{config.max_consecutive_nonfinite}"
    )


def _variant(config) -> str:
  """``config.step``; configs written before it had the field are shard_map."""
  return config.get("step", "shard_map")


def _dataset(config) -> data_lib.Dataset:
  """``data.load`` with the set fields of ``config.dataset`` (e.g. ``seq_len``)."""
  d = dict(config.dataset)
  name, data_dir, synthetic = d.pop("name"), d.pop("data_dir"), d.pop("synthetic")
  kwargs = {k: v for k, v in d.items() if v is not None}
  return data_lib.load(name, data_dir, synthetic=synthetic, seed=config.seed, **kwargs)


def _padded_batches(n: int, batch_size: int):
  """``(rows, weights)`` of each whole batch over ``n`` examples.

  The last batch repeats the last example, weighted 0, so every batch has
  one shape (one compile).
  """
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    yield np.minimum(rows, n - 1), (rows < n).astype(np.float32)


def evaluate(
  eval_step,
  mesh,
  params,
  model_state,
  x,
  y,
  batch_size: int,
  variant: str = "shard_map",
) -> dict[str, float]:
  """Mean loss and accuracy over all of ``(x, y)``, padded to whole batches."""
  local = batch_size // jax.process_count()
  mine = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
  totals = jnp.zeros(3)
  for rows, weights in _padded_batches(len(y), batch_size):
    batch = step_lib.shard_batch(
      mesh, (x[rows[mine]], y[rows[mine]], weights[mine]), variant
    )
    totals = totals + eval_step(params, model_state, *batch)
  loss, correct, seen = np.asarray(totals)
  return {"eval_loss": float(loss / seen), "eval_accuracy": float(correct / seen)}


def evaluate_workers(
  worker_eval, mesh, params, model_state, x, y, batch_size: int = 512
) -> dict[str, float]:
  """Every worker's own model on all of ``(x, y)``: mean and worst accuracy.

  ``params`` and ``model_state`` carry a leading worker axis; the batches are
  replicated, so each worker evaluates the whole set with its own params.
  """
  replicated = NamedSharding(mesh, P())
  put = lambda a: jax.make_array_from_process_local_data(replicated, a)
  totals = 0.0
  for rows, weights in _padded_batches(len(y), batch_size):
    totals = totals + worker_eval(
      params, model_state, put(x[rows]), put(y[rows]), put(weights)
    )
  loss, correct, seen = np.asarray(totals).T
  accuracy = correct / seen
  return {
    "eval_worker_loss_mean": float(np.mean(loss / seen)),
    "eval_worker_accuracy_mean": float(np.mean(accuracy)),
    "eval_worker_accuracy_min": float(np.min(accuracy)),
  }


def _write_sim_file(workdir: Path, **fields) -> None:
  """``sim.json``: what the simulated clock priced, for re-pricing elsewhere."""
  (workdir / SIM_FILE).write_text(json.dumps(fields, indent=2) + "\n")


def _write_run_files(workdir: Path, config, plan, ds: data_lib.Dataset) -> None:
  """``config.json`` (with the corpus's identity, if it has one) and ``plan.json``."""
  fields = json.loads(config.to_json_best_effort())
  if ds.sha256 is not None:
    fields["dataset_identity"] = {"sha256": ds.sha256, "description": ds.description}
  (workdir / CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n")
  if isinstance(plan, gradcomp.Plan):
    text = plan.to_json()
  else:  # None: no fusion.
    text = json.dumps({"plan": plan or "none"})
  (workdir / PLAN_FILE).write_text(text + "\n")


def _saved_plan(workdir: Path) -> gradcomp.Plan | None:
  """The fusion plan of the run in ``workdir``, if it saved one."""
  path = workdir / PLAN_FILE
  if not path.exists():
    return None
  try:
    return gradcomp.Plan.from_json(path.read_text())
  except ValueError:  # {"plan": "none"}: no fusion
    return None


def train_and_evaluate(config, workdir: str | Path) -> Result:
  """Trains and evaluates ``config``, resuming from ``workdir`` if it holds a run.

  Args:
    config: a ``ConfigDict`` as returned by ``configs/*.py``.
    workdir: directory for checkpoints, ``metrics.jsonl``, TensorBoard event
      files, ``config.json``, ``plan.json`` and ``profile/`` (with
      ``config.profile_steps``); created if missing.

  Returns:
    The final state and evaluation.

  Raises:
    ValueError: for an invalid config (unknown names, indivisible batch).
    NonFiniteError: after ``config.max_consecutive_nonfinite`` skipped steps
      in a row.
  """
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  lead = jax.process_index() == 0
  workers = optimizer_lib.num_workers(config)
  mesh = jax.make_mesh((workers,), (step_lib.AXIS,), devices=jax.devices()[:workers])
  _check(config, mesh.size)
  variant = _variant(config)
  scheme = optimizer_lib.scheme_name(config)

  model_cfg = dict(config.model)
  model_name = model_cfg.pop("name")
  models.check_name(model_name)  # Before loading a dataset.
  ds = _dataset(config)
  model = models.create(model_name, ds.num_classes, **model_cfg)
  batch_size = config.global_batch_size
  batch_like = (
    jax.ShapeDtypeStruct((batch_size, *ds.input_shape), ds.x_train.dtype),
    jax.ShapeDtypeStruct((batch_size, *ds.y_train.shape[1:]), ds.y_train.dtype),
  )
  edge = None
  if scheme == edgegossip_lib.NAME:  # Per-worker shards, balanced epochs.
    edgegossip_lib.check(config, ds, variant)
    batch_like += (jax.ShapeDtypeStruct((batch_size,), jnp.float32),)

  rng = jax.random.PRNGKey(config.seed)  # Raw uint32[2]: checkpointable as is.
  init_rng, rng = jax.random.split(rng)
  params, model_state = step_lib.init_model(
    model, init_rng, ds.input_shape, ds.x_train.dtype
  )
  order = step_lib.gradient_order(model, params, model_state, *batch_like[:2])
  sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
  factored = step_factors = mask = None
  if factors_lib.enabled(config):  # The rule's choice per Dense layer, once.
    factored = factors_lib.plan(config, model, mesh, params, model_state, batch_like)
    if factored.active:
      order, sizes = factored.restrict(params, order, sizes)
      step_factors, mask = factored, factored.mask
  flops = pricing.flops_per_step(model, ds, batch_size // mesh.size)
  if scheme == edgegossip_lib.NAME:
    message = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) + 4
    edge = edgegossip_lib.Trainer(
      config,
      ds,
      pricing.cluster_of(config, mesh.size),
      batch_size // mesh.size,
      flops / gradcomp.sim.training_flops(1.0, batch_size // mesh.size),
      message,
    )
    num_steps = edgegossip_lib.total_steps(config, edge.steps_per_epoch)
  else:
    num_steps = total_steps(config, len(ds.y_train))
  speeds = None
  if optimizer_lib.scheme_name(config) in optimizer_lib.TIMED_SCHEMES:
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    speeds = pricing.speed_table(config, mesh.size, num_steps, flops, param_bytes)
  tx, plan = optimizer_lib.create(
    config, order, num_steps, step_lib.AXIS, sizes, _saved_plan(workdir), mask, speeds
  )
  opt_state = tx.init(params)
  layout = step_lib.infer_layout(
    model, tx, mesh, params, model_state, opt_state, batch_like, step_factors
  )
  params, model_state, opt_state = layout.place(
    *layout.params_to_global((params, model_state)), layout.to_global(opt_state)
  )
  replicated = NamedSharding(mesh, P())
  state = {
    "params": params,
    "model_state": model_state,
    "opt_state": opt_state,
    "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
    "rng": jax.device_put(rng, replicated),
  }
  if edge is not None:
    state["edgegossip"] = edge.empty_state(mesh)

  checkpoints = checkpoint_lib.Checkpointer(
    workdir / CHECKPOINT_DIR, config.checkpoints_to_keep
  )
  start = checkpoints.latest_step()
  if start is not None:
    state = checkpoints.restore(start, like=state)
  start = int(state["step"])
  if lead:
    _write_run_files(workdir, config, plan, ds)

  train_step = step_lib.make_train_step(model, tx, layout, variant, step_factors)
  if layout.params_per_worker:  # The average model, and every worker's own.
    average_layout = dataclasses.replace(layout, params_per_worker=False)
    eval_step = step_lib.make_eval_step(model, average_layout)
    worker_eval = step_lib.make_worker_eval_step(model, layout)
    averager = step_lib.make_averager(layout)
  else:
    eval_step = step_lib.make_eval_step(model, layout, variant)
  eval_batch = -(-config.eval_batch_size // mesh.size) * mesh.size
  if edge is None:
    train_iter = data_lib.batches(
      ds.x_train,
      ds.y_train,
      batch_size,
      config.seed,
      start_step=start,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
  # Checkpoints hold the shard_map layout whatever the variant (train/step.py).
  params, model_state, opt_state = layout.to_variant(
    variant, state["params"], state["model_state"], state["opt_state"]
  )
  example = step_lib.example_batch(mesh, batch_like, variant)
  step_wire = wire.collective_bytes(
    train_step.lower(params, model_state, opt_state, example).compile().as_text()
  )
  priced = pricing.price(
    config, plan, mesh, state["params"], step_wire, num_steps, flops, speeds
  )
  wire_bytes, round_wire, sim_seconds = (
    priced.wire_bytes_per_step,
    priced.round_wire,
    priced.sim_seconds,
  )

  def sim_at(step: int) -> float | None:
    seconds = float(sim_seconds[step])
    return seconds if math.isfinite(seconds) else None

  if edge is not None:
    priced.fields.update(
      steps_per_epoch=edge.steps_per_epoch,
      shard_sizes=edge.sizes.tolist(),
      aggregated_points=edge.num_points.tolist(),
      aggregation_wall_seconds=edge.aggregation_seconds,
      push_seconds=edge.push_seconds,
    )
  if lead:
    _write_sim_file(
      workdir,
      flops_per_step=flops,
      round_wire=round_wire,
      wire_bytes_per_step=wire_bytes,
      **priced.fields,
      **({"sufficient_factors": factored.record()} if factored else {}),
    )
  writer = logs.MetricWriter(workdir, resume_step=start, enabled=lead)
  progress = logs.Progress(num_steps, enabled=lead)
  progress.message(
    f"{config.model.name} on {ds.name}, {mesh.size} workers "
    f"({jax.devices()[0].platform}), compressor {config.compressor.name}, "
    f"plan {config.fusion.plan}, scheme {scheme}: {wire_bytes:,.0f} bytes sent per "
    f"step per worker ({sum(round_wire.values()):,} per exchange round); "
    f"steps {start} -> {num_steps}"
    + (" (resumed from its checkpoint)" if start else "")
  )
  if factored is not None:
    progress.message(factored.summary())

  if ds.description is not None:
    progress.message(ds.description)
  window = {"losses": [], "accuracies": [], "t0": None, "s0": start}

  def tokens_per_sec(samples_per_sec: float) -> dict[str, float]:
    """Language models: target tokens (bytes, words) per second, beside samples."""
    if ds.token is None:
      return {}
    return {"tokens_per_sec": samples_per_sec * math.prod(ds.y_train.shape[1:])}

  last: dict[str, Any] = {}

  def record(step: int, metrics) -> None:
    """Host side of step ``step``: stop on divergence, log every few steps."""
    m = jax.device_get(metrics)
    now = time.perf_counter()
    if window["t0"] is None:  # Throughput excludes the first step's compile.
      window["t0"], window["s0"] = now, step
    if not m["skipped"]:
      window["losses"].append(float(m["loss"]))
      window["accuracies"].append(float(m["accuracy"]))
    if int(m["consecutive_nonfinite"]) >= config.max_consecutive_nonfinite:
      writer.write(step, nonfinite_steps=m["nonfinite_steps"], stopped=True)
      raise NonFiniteError(
        f"stopping at step {step}: the loss or gradient was non-finite in "
        f"{int(m['consecutive_nonfinite'])} consecutive steps "
        f"(config.max_consecutive_nonfinite={config.max_consecutive_nonfinite}). "
        f"Those steps were skipped, so the params are still finite; the last "
        f"checkpoint is step {checkpoints.latest_step()}. Try a smaller "
        f"config.optimizer.learning_rate."
      )
    if step % config.log_every_steps and step != num_steps:
      return
    steps = step - window["s0"]
    seconds = now - window["t0"]
    steps_per_sec = steps / seconds if steps and seconds > 0 else math.nan
    loss = float(np.mean(window["losses"])) if window["losses"] else math.nan
    row = {
      "loss": loss,
      "accuracy": float(np.mean(window["accuracies"]))
      if window["accuracies"]
      else None,
      "samples_per_sec": steps_per_sec * batch_size,
      **tokens_per_sec(steps_per_sec * batch_size),
      "wire_bytes_per_step": wire_bytes,
      "sim_seconds": sim_at(step),
      "l2_grads": m["l2_grads"],
      "l2_updates": m["l2_updates"],
      "nonfinite_steps": m["nonfinite_steps"],
    }
    if layout.params_per_worker:
      row["consensus_distance"] = float(
        step_lib.consensus_distance(per_worker_params()[0])
      )
    if scheme == "async_ps":
      counts = optimizer_lib.staleness_histogram(
        layout.from_variant(variant, params, model_state, opt_state)[2]
      )
      row["staleness_mean"] = float(
        counts @ np.arange(counts.size) / max(counts.sum(), 1)
      )
      writer.histogram(step, "staleness_histogram", counts)
    writer.write(step, **row)
    progress.update(step, loss, row["samples_per_sec"], steps_per_sec)
    window.update(losses=[], accuracies=[], t0=now, s0=step)

  def save(step: int) -> None:
    global_params, global_model_state, global_opt_state = layout.from_variant(
      variant, params, model_state, opt_state
    )
    saved = {
      "params": global_params,
      "model_state": global_model_state,
      "opt_state": global_opt_state,
      "step": jax.device_put(jnp.asarray(step, jnp.int32), replicated),
      "rng": state["rng"],
    }
    if edge is not None:
      saved["edgegossip"] = edge.state_of(mesh, epoch["plan"])
    checkpoints.save(step, saved)

  def per_worker_params():
    """Params and model state in the shard_map layout (leading worker axis)."""
    return layout.from_variant(variant, params, model_state, opt_state)[:2]

  def run_eval(step: int) -> None:
    if layout.params_per_worker:
      worker_params, worker_state = per_worker_params()
      average = averager((worker_params, worker_state))
      last.update(evaluate(eval_step, mesh, *average, ds.x_test, ds.y_test, eval_batch))
      last.update(
        evaluate_workers(
          worker_eval, mesh, worker_params, worker_state, ds.x_test, ds.y_test
        )
      )
      if scheme == "cdsgd":  # The global weights too, one step behind.
        opt = layout.from_variant(variant, params, model_state, opt_state)[2]
        scores = evaluate(
          eval_step,
          mesh,
          optimizer_lib.global_weights(opt),
          average[1],
          ds.x_test,
          ds.y_test,
          eval_batch,
        )
        last.update({k.replace("eval_", "eval_global_"): v for k, v in scores.items()})
    else:
      last.update(
        evaluate(
          eval_step,
          mesh,
          params,
          model_state,
          ds.x_test,
          ds.y_test,
          eval_batch,
          variant,
        )
      )
    if ds.token is not None:  # Language models: cross-entropy in bits per token.
      last[f"eval_bits_per_{ds.token}"] = last["eval_loss"] / math.log(2)
    # The simulated time of the step, unless its training row carries it.
    logged = step % config.log_every_steps == 0 or step == num_steps
    extra = {} if logged else {"sim_seconds": sim_at(step)}
    writer.write(step, **extra, **last)
    progress.message(
      f"eval at step {step}: loss {last['eval_loss']:.4f}, "
      f"accuracy {last['eval_accuracy']:.4f}"
    )

  epoch: dict[str, Any] = {"plan": None, "priced": None, "clock": None, "wall": 0.0}

  def start_epoch(plan) -> None:
    """Price a planned (or restored) epoch and fill its steps' simulated times."""
    priced = edge.price(plan)
    epoch.update(plan=plan, priced=priced, clock=priced.times)
    for j, seconds in enumerate(priced.seconds):
      if plan.first_step + j <= num_steps:
        sim_seconds[plan.first_step + j] = seconds

  if edge is not None:
    if edge.selection == "loss":
      point_losses = step_lib.make_point_losses(model, layout)
      sharded = NamedSharding(mesh, P(step_lib.AXIS))
      points = tuple(jax.device_put(a, sharded) for a in edge.points())
    restored = edge.epoch_of(jax.device_get(state["edgegossip"]))
    if restored is not None:  # Resumed: the same plan and the same clock.
      start_epoch(restored)
    else:
      epoch["clock"] = np.zeros(mesh.size)

  def edge_batch(step: int):
    """EdgeGossip's batch of ``step``, planning an epoch at its first step."""
    if (step - 1) % edge.steps_per_epoch == 0:
      losses, begin = None, time.perf_counter()
      if edge.selection == "loss":  # Alg. 2 line 1: every worker's own model.
        losses = np.asarray(point_losses(params, model_state, *points))
        losses = losses.reshape(mesh.size, -1)
      epoch["wall"] = time.perf_counter() - begin
      start_epoch(edge.plan((step - 1) // edge.steps_per_epoch, epoch["clock"], losses))
    return edge.batch_of(ds, epoch["plan"], step)

  def log_epoch(step: int) -> None:
    plan = epoch["plan"]
    if step == plan.first_step + edge.steps_per_epoch - 1 or step == num_steps:
      writer.write(
        step,
        **edge.epoch_record(plan, epoch["priced"]),
        loss_eval_wall_seconds=epoch["wall"],
        sim_seconds=sim_at(step),
      )

  # Profile steps after the first (which compiles), into workdir/profile, on
  # process 0 only: processes sharing a host would write the same file names.
  profiled = range(start + 2, min(start + 2 + config.profile_steps, num_steps + 1))
  profiled = profiled if lead else range(0)
  pending, tracing = None, False
  try:
    for step in range(start + 1, num_steps + 1):
      host_batch = next(train_iter) if edge is None else edge_batch(step)
      batch = step_lib.shard_batch(mesh, host_batch, variant)
      if profiled and step == profiled[0]:
        jax.profiler.start_trace(workdir / "profile")
        tracing = True
      params, model_state, opt_state, metrics = train_step(
        params, model_state, opt_state, batch
      )
      if profiled and step == profiled[-1]:
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        tracing = False
        progress.message(f"profiled steps {profiled[0]}-{step} into {workdir}/profile")
      # The previous step's metrics are read while this one runs.
      if pending is not None:
        record(*pending)
      if edge is not None:
        log_epoch(step)
      pending = (step, metrics)
      do_eval = step % config.eval_every_steps == 0 or step == num_steps
      do_save = step % config.checkpoint_every_steps == 0 or step == num_steps
      if do_eval or do_save:
        record(*pending)
        pending = None
      if do_eval:
        run_eval(step)
      if do_save:
        save(step)
      if do_eval or do_save:  # Throughput counts training steps only.
        window.update(t0=time.perf_counter(), s0=step)
    if pending is not None:
      record(*pending)
    if not last:  # Resumed from the final checkpoint: nothing was trained.
      run_eval(num_steps)
  finally:
    if tracing:  # A run that stops mid-trace must not leave the profiler on.
      jax.profiler.stop_trace()
    checkpoints.close()
    writer.close()
  params, model_state, opt_state = layout.from_variant(
    variant, params, model_state, opt_state
  )
  state = {
    "params": params,
    "model_state": model_state,
    "opt_state": opt_state,
    "step": jnp.asarray(num_steps, jnp.int32),
    "rng": state["rng"],
  }
  if edge is not None:
    state["edgegossip"] = edge.state_of(mesh, epoch["plan"])
  return Result(state, dict(last))
