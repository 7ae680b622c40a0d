"""The training loop: ``train_and_evaluate(config, workdir)`` (DESIGN §3).

Builds the dataset, model, optimizer (compressor + LayerFusion + SGD) and the
``shard_map`` (or ``pmap``, ``config.step``) step of ``train/step.py``;
restores the latest checkpoint of ``workdir`` if there is one; then trains,
logging to ``metrics.jsonl``, TensorBoard and stderr, evaluating every
``eval_every_steps`` and checkpointing every ``checkpoint_every_steps`` and at
the end.
"""

from __future__ import annotations

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
from train import checkpoint as checkpoint_lib
from train import data as data_lib
from train import logs
from train import optimizer as optimizer_lib
from train import step as step_lib

CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
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
  n, count = len(y), jax.process_count()
  local = batch_size // count
  offset = jax.process_index() * local
  totals = jnp.zeros(3)
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    weights = (rows < n).astype(np.float32)
    rows = np.minimum(rows, n - 1)[offset : offset + local]
    batch = step_lib.shard_batch(
      mesh, (x[rows], y[rows], weights[offset : offset + local]), variant
    )
    totals = totals + eval_step(params, model_state, *batch)
  loss, correct, seen = np.asarray(totals)
  return {"eval_loss": float(loss / seen), "eval_accuracy": float(correct / seen)}


def _write_run_files(workdir: Path, config, plan) -> None:
  (workdir / CONFIG_FILE).write_text(config.to_json_best_effort(indent=2) + "\n")
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
  mesh = jax.make_mesh((jax.device_count(),), (step_lib.AXIS,))
  _check(config, mesh.size)
  variant = _variant(config)

  model_cfg = dict(config.model)
  model_name = model_cfg.pop("name")
  models.check_name(model_name)  # Before loading a dataset.
  ds = _dataset(config)
  model = models.create(model_name, ds.num_classes, **model_cfg)
  num_steps = total_steps(config, len(ds.y_train))
  batch_size = config.global_batch_size
  batch_like = (
    jax.ShapeDtypeStruct((batch_size, *ds.input_shape), ds.x_train.dtype),
    jax.ShapeDtypeStruct((batch_size, *ds.y_train.shape[1:]), ds.y_train.dtype),
  )

  rng = jax.random.PRNGKey(config.seed)  # Raw uint32[2]: checkpointable as is.
  init_rng, rng = jax.random.split(rng)
  params, model_state = step_lib.init_model(
    model, init_rng, ds.input_shape, ds.x_train.dtype
  )
  order = step_lib.gradient_order(model, params, model_state, *batch_like)
  sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
  tx, plan = optimizer_lib.create(
    config, order, num_steps, step_lib.AXIS, sizes, _saved_plan(workdir)
  )
  opt_state = tx.init(params)
  layout = step_lib.infer_layout(
    model, tx, mesh, params, model_state, opt_state, batch_like
  )
  params, model_state, opt_state = layout.place(
    params, model_state, layout.to_global(opt_state)
  )
  replicated = NamedSharding(mesh, P())
  state = {
    "params": params,
    "model_state": model_state,
    "opt_state": opt_state,
    "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
    "rng": jax.device_put(rng, replicated),
  }

  checkpoints = checkpoint_lib.Checkpointer(
    workdir / CHECKPOINT_DIR, config.checkpoints_to_keep
  )
  start = checkpoints.latest_step()
  if start is not None:
    state = checkpoints.restore(start, like=state)
  start = int(state["step"])
  if lead:
    _write_run_files(workdir, config, plan)

  train_step = step_lib.make_train_step(model, tx, layout, variant)
  eval_step = step_lib.make_eval_step(model, layout, variant)
  eval_batch = -(-config.eval_batch_size // mesh.size) * mesh.size
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
  wire_bytes = gradcomp.wire_bytes(train_step, params, model_state, opt_state, example)
  writer = logs.MetricWriter(workdir, resume_step=start, enabled=lead)
  progress = logs.Progress(num_steps, enabled=lead)
  progress.message(
    f"{config.model.name} on {ds.name}, {mesh.size} workers "
    f"({jax.devices()[0].platform}), compressor {config.compressor.name}, "
    f"plan {config.fusion.plan}: {wire_bytes:,} bytes sent per step per worker; "
    f"steps {start} -> {num_steps}"
    + (" (resumed from its checkpoint)" if start else "")
  )

  window = {"losses": [], "accuracies": [], "t0": None, "s0": start}
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
      "wire_bytes_per_step": wire_bytes,
      "l2_grads": m["l2_grads"],
      "l2_updates": m["l2_updates"],
      "nonfinite_steps": m["nonfinite_steps"],
    }
    writer.write(step, **row)
    progress.update(step, loss, row["samples_per_sec"], steps_per_sec)
    window.update(losses=[], accuracies=[], t0=now, s0=step)

  def save(step: int) -> None:
    global_params, global_model_state, global_opt_state = layout.from_variant(
      variant, params, model_state, opt_state
    )
    checkpoints.save(
      step,
      {
        "params": global_params,
        "model_state": global_model_state,
        "opt_state": global_opt_state,
        "step": jax.device_put(jnp.asarray(step, jnp.int32), replicated),
        "rng": state["rng"],
      },
    )

  def run_eval(step: int) -> None:
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
    writer.write(step, **last)
    progress.message(
      f"eval at step {step}: loss {last['eval_loss']:.4f}, "
      f"accuracy {last['eval_accuracy']:.4f}"
    )

  # Profile steps after the first (which compiles), into workdir/profile, on
  # process 0 only: processes sharing a host would write the same file names.
  profiled = range(start + 2, min(start + 2 + config.profile_steps, num_steps + 1))
  profiled = profiled if lead else range(0)
  pending, tracing = None, False
  try:
    for step in range(start + 1, num_steps + 1):
      x, y = next(train_iter)
      batch = step_lib.shard_batch(mesh, (x, y), variant)
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
  return Result(state, dict(last))
