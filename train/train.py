"""The training loop: ``train_and_evaluate(config, workdir)`` (DESIGN §3).

A run is a workload (``train/workload.py``: dataset, model, metrics) trained
under a scheme (``train/schemes/``: optimizer, checkpointed extras, clock,
evaluations, logs). This module knows neither by name: it builds both from
the config, restores the latest checkpoint of ``workdir`` if there is one,
then trains the ``shard_map`` (or ``pmap``, ``config.step``) step of
``train/step.py``, logging to ``metrics.jsonl``, TensorBoard and stderr,
evaluating every ``eval_every_steps`` and checkpointing every
``checkpoint_every_steps`` and at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel import wire
from train import checkpoint as checkpoint_lib
from train import logs, pricing, reshard, schemes
from train import mesh as mesh_lib
from train import optimizer as optimizer_lib
from train import step as step_lib
from train import workload as workload_lib
from train.evaluation import Evaluator
from train.recording import NonFiniteError, StepLog

CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
#: The simulated clock's inputs: ``flops_per_step``, ``round_wire`` ({kind:
#: bytes} of one exchange round), ``wire_bytes_per_step``.
SIM_FILE = "sim.json"
CHECKPOINT_DIR = "checkpoints"
FUSION_PLANS = ("layerwise", "single", "auto", "none")

__all__ = ["NonFiniteError", "Result", "train_and_evaluate", "validate"]


class Result(NamedTuple):
  """What a finished run returns.

  Attributes:
    state: the final train state, as checkpointed (``params``,
      ``model_state``, ``opt_state``, ``step``, ``rng``, and a scheme's own
      entries).
    eval_metrics: ``{"eval_loss", "eval_accuracy", ...}`` at the last step.
  """

  state: dict[str, Any]
  eval_metrics: dict[str, float]


class Program(NamedTuple):
  """A run, built: its optimizer, plan, layout, step, initial state and clock inputs."""

  tx: Any
  plan: gradcomp.Plan | None
  layout: step_lib.Layout
  train_step: Any
  state: dict[str, Any]
  factors: Any
  batch_like: tuple
  num_steps: int
  flops: float


def _variant(config) -> str:
  """``config.step``; configs written before it had the field are shard_map."""
  return config.get("step", "shard_map")


def validate(config):
  """The config a run uses, checked before any data is read or anything traced.

  The scheme's honest defaults are filled in (``train/schemes/``); every
  field that can be checked without the dataset is.

  Raises:
    ValueError: one line naming the field, its value and what is valid.
  """
  config = schemes.get(config).resolve(config)
  step_lib.check_variant(_variant(config))
  workers = optimizer_lib.num_workers(config)
  spec = optimizer_lib.mesh_spec(config)
  mesh_lib.check_program(
    spec,
    scheme=optimizer_lib.scheme_name(config),
    step=_variant(config),
    self_exchanging=optimizer_lib.exchanges_itself(config.optimizer),
    factors=bool(config.get("sufficient_factors")),
  )
  batch = config.global_batch_size
  if batch % workers:
    raise ValueError(
      f"config.global_batch_size={batch} is not divisible by the {workers} "
      f"devices: every worker takes an equal shard of each batch; use a "
      f"multiple of {workers}."
    )
  for name in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    if config[name] < 1:
      raise ValueError(f"config.{name} must be >= 1, got {config[name]}")
  if config.max_consecutive_nonfinite < 1:
    raise ValueError(
      f"config.max_consecutive_nonfinite must be >= 1, got "
      f"{config.max_consecutive_nonfinite}"
    )
  if config.fusion.plan not in FUSION_PLANS:
    raise ValueError(
      f"unknown fusion plan {config.fusion.plan!r} (config.fusion.plan); valid: "
      f"{', '.join(FUSION_PLANS)}"
    )
  workload_lib.check(config)
  optimizer_lib.compressor(config.compressor, spec.exchange_axis)  # Its checks.
  return config


def _write_sim_file(workdir: Path, **fields) -> None:
  """``sim.json``: what the simulated clock priced, for re-pricing elsewhere."""
  (workdir / SIM_FILE).write_text(json.dumps(fields, indent=2) + "\n")


def _write_run_files(workdir: Path, config, plan, ds) -> None:
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


def _build(config, work, scheme, mesh, workdir: Path) -> Program:
  """Initial params, the scheme's optimizer and plan, the layout, the step, the state.

  On an FSDP mesh the params are placed as shards and the optimizer is
  built for them (``train/mesh.py``).
  """
  spec = optimizer_lib.mesh_spec(config)
  model, ds = work.model, work.dataset
  batch_like = scheme.batch_like(work.batch_like(config.global_batch_size))
  rng = jax.random.PRNGKey(config.seed)  # Raw uint32[2]: checkpointable as is.
  init_rng, rng = jax.random.split(rng)
  params, model_state = step_lib.init_model(
    model, init_rng, ds.input_shape, ds.x_train.dtype
  )
  order = step_lib.gradient_order(
    model, params, model_state, *batch_like[:2], criterion=work.criterion
  )
  sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
  order, sizes, factors = scheme.gradient_plan(
    params, model_state, batch_like, order, sizes
  )
  flops = pricing.flops_per_step(model, ds, config.global_batch_size // mesh.size)
  num_steps = scheme.prepare(params, flops)
  mask = None if factors is None else factors.mask
  like = jax.eval_shape(lambda: params)
  tx, plan = scheme.optimizer(order, sizes, _saved_plan(workdir), num_steps, mask, like)
  # gradcomp.hierarchical's state is shaped by its fast axis, read from the mesh.
  with jax.set_mesh(mesh) if spec.hierarchical else contextlib.nullcontext():
    opt_state = tx.init(params)
  layout = step_lib.infer_layout(
    model,
    tx,
    mesh,
    params,
    model_state,
    opt_state,
    batch_like,
    factors,
    criterion=work.criterion,
    fsdp=spec.sharded_params(like),
  )
  params, model_state, opt_state = layout.place(
    *layout.global_params(params, model_state), layout.to_global(opt_state)
  )
  replicated = NamedSharding(mesh, P())
  state = {
    "params": params,
    "model_state": model_state,
    "opt_state": opt_state,
    "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
    "rng": jax.device_put(rng, replicated),
    **scheme.initial_state(),
  }
  train_step = step_lib.make_train_step(
    model, tx, layout, scheme.variant, factors, criterion=work.criterion
  )
  return Program(
    tx, plan, layout, train_step, state, factors, batch_like, num_steps, flops
  )


def _price(program: Program, scheme, train_step, placed, workdir: Path, lead: bool):
  """The scheme's bytes per step and clock, from the compiled step's collectives.

  Process 0 writes what was priced to ``sim.json``.
  """
  layout = program.layout
  example = step_lib.example_batch(layout.mesh, program.batch_like, scheme.variant)
  compiled = train_step.lower(*placed, example).compile()
  text = compiled.as_text()
  step_wire = wire.collective_bytes(text)
  scheme.step_records = wire.collectives(text, layout.mesh)
  priced = scheme.price(
    program.plan,
    program.state["params"],
    step_wire,
    program.num_steps,
    program.flops,
  )
  if lead:
    _write_sim_file(
      workdir,
      flops_per_step=program.flops,
      round_wire=priced.round_wire,
      wire_bytes_per_step=priced.wire_bytes_per_step,
      peak_bytes_per_step=priced.peak_bytes_per_step,
      **priced.fields,
    )
  return priced


def _announce(progress, config, work, scheme, mesh, priced, start: int) -> None:
  """The run's first lines: what trains where, what it sends, from which step."""
  progress.message(
    f"{config.model.name} on {work.name}, {mesh.size} workers "
    f"({jax.devices()[0].platform}), compressor {config.compressor.name}, "
    f"plan {config.fusion.plan}, scheme {scheme.name}: "
    f"{priced.wire_bytes_per_step:,.0f} bytes sent per step per worker "
    f"({sum(priced.round_wire.values()):,} per exchange round); "
    f"steps {start} -> {progress.total}"
    + (" (resumed from its checkpoint)" if start else "")
  )
  for line in (*scheme.messages(), *work.describe()):
    progress.message(line)


def _checkpointed(mesh, step: int, placed, rng, scheme) -> dict[str, Any]:
  """The state a checkpoint holds at ``step``: ``placed`` in the shard_map layout."""
  params, model_state, opt_state = placed
  at = jax.device_put(jnp.asarray(step, jnp.int32), NamedSharding(mesh, P()))
  return {
    "params": params,
    "model_state": model_state,
    "opt_state": opt_state,
    "step": at,
    "rng": rng,
    **scheme.saved_state(),
  }


def _resume(checkpoints, program: Program, scheme, spec):
  """(state, moved): the latest checkpoint's state, else the program's fresh one.

  A checkpoint saved on another number of workers is moved to this run's
  (elastic resume), one saved on another mesh shape re-laid out; ``moved``
  describes that, None when nothing moved. The scheme reads its own state.
  """
  state, moved = program.state, None
  if (latest := checkpoints.latest_step()) is not None:
    state, moved = reshard.restore(
      checkpoints, latest, state, program.layout, scheme, spec, program.plan
    )
  scheme.restore(state, program.layout)
  return state, moved


def _announce_move(moved, start: int, writer, progress) -> None:
  """Logs and prints what a resume moved (nothing when it moved nothing)."""
  if moved is not None:
    writer.write(start, **{reshard.log_key(moved): moved})
    progress.message(reshard.describe(moved))


def train_and_evaluate(config, workdir: str | Path) -> Result:
  """Trains and evaluates ``config``, resuming from ``workdir`` if it holds a run.

  Args:
    config: a ``ConfigDict`` as returned by ``configs/*.py``.
    workdir: directory for checkpoints, ``metrics.jsonl``, TensorBoard event
      files, ``config.json``, ``plan.json``, ``sim.json`` and ``profile/``
      (with ``config.profile_steps``); created if missing.

  Returns:
    The final state and evaluation.

  Raises:
    ValueError: for an invalid config (unknown names, indivisible batch).
    NonFiniteError: after ``config.max_consecutive_nonfinite`` skipped steps
      in a row.
  """
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  config = validate(config)
  lead, variant = jax.process_index() == 0, _variant(config)
  workers = optimizer_lib.num_workers(config)
  spec = optimizer_lib.mesh_spec(config)
  mesh = spec.make(jax.devices()[:workers])
  work = workload_lib.create(config)
  scheme = schemes.get(config)(config, work, mesh, variant)
  scheme.check()
  program = _build(config, work, scheme, mesh, workdir)
  layout, num_steps = program.layout, program.num_steps

  checkpoints = checkpoint_lib.Checkpointer(
    workdir / CHECKPOINT_DIR,
    config.checkpoints_to_keep,
    workers=mesh.size,
    mesh=spec.record(),
  )
  state, moved = _resume(checkpoints, program, scheme, spec)
  start = int(state["step"])
  if lead:
    _write_run_files(workdir, config, program.plan, work.dataset)
  train_step = program.train_step
  # Checkpoints hold the shard_map layout whatever the variant (train/step.py).
  params, model_state, opt_state = layout.to_variant(
    variant, state["params"], state["model_state"], state["opt_state"]
  )
  placed = (params, model_state, opt_state)
  priced = _price(program, scheme, train_step, placed, workdir, lead)

  def sim_at(step: int) -> float | None:
    seconds = float(priced.sim_seconds[step])
    return seconds if math.isfinite(seconds) else None

  def global_state():
    """Params, model state and optimizer state in the checkpoint's layout."""
    return layout.from_variant(variant, params, model_state, opt_state)

  writer = logs.MetricWriter(workdir, resume_step=start, enabled=lead)
  progress = logs.Progress(num_steps, enabled=lead)
  _announce(progress, config, work, scheme, mesh, priced, start)
  _announce_move(moved, start, writer, progress)
  record = StepLog(
    config,
    work,
    scheme,
    layout.params_per_worker,
    (writer, progress),
    (priced.wire_bytes_per_step, priced.peak_bytes_per_step, sim_at),
    (start, num_steps),
    global_state,
    checkpoints.latest_step,
  )
  evaluate = Evaluator.from_config(config, work, scheme, layout, variant)
  last: dict[str, Any] = {}

  def run_eval(step: int) -> None:
    last.update(evaluate(params, model_state, global_state))
    record.evaluation(step, last)

  batches = scheme.batches(start)
  profiler = logs.Profiler(
    workdir, start, num_steps, config.profile_steps, lead, progress
  )
  pending = None
  try:
    for step in range(start + 1, num_steps + 1):
      host_batch = scheme.batch(step, batches, lambda: (params, model_state))
      batch = step_lib.shard_batch(mesh, host_batch, variant)
      profiler.before(step)
      params, model_state, opt_state, metrics = train_step(
        params, model_state, opt_state, batch
      )
      profiler.after(step, metrics)
      if pending is not None:  # The previous step's metrics, read while this one runs.
        record(*pending)
      scheme.after_step(step, writer, sim_at)
      pending = (step, metrics)
      do_eval = step % config.eval_every_steps == 0 or step == num_steps
      do_save = step % config.checkpoint_every_steps == 0 or step == num_steps
      if do_eval or do_save:
        record(*pending)
        pending = None
      if do_eval:
        run_eval(step)
      if do_save:
        checkpoints.save(
          step, _checkpointed(mesh, step, global_state(), state["rng"], scheme)
        )
      if do_eval or do_save:  # Throughput counts training steps only.
        record.restart_clock(step)
    if pending is not None:
      record(*pending)
    if not last:  # Resumed from the final checkpoint: nothing was trained.
      run_eval(num_steps)
  finally:
    profiler.close()
    checkpoints.close()
    writer.close()
  final = _checkpointed(mesh, num_steps, global_state(), state["rng"], scheme)
  return Result({**final, "step": jnp.asarray(num_steps, jnp.int32)}, dict(last))
