"""The host side of each training step: stop on divergence, log every few steps.

Throughput excludes the first step's compile and every evaluation and
checkpoint (:meth:`StepLog.restart_clock`): it counts training steps only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from train import step as step_lib


class NonFiniteError(FloatingPointError):
  """Too many consecutive steps had a non-finite loss or gradient."""


class StepLog:
  """Reads each step's metrics and writes a row every ``config.log_every_steps``.

  Args:
    config: the run's config.
    workload: the run's workload (its throughput units).
    scheme: the run's scheme (its figures in each row).
    per_worker: whether the workers' params differ (then each row logs their
      consensus distance).
    outputs: ``(writer, progress)``: the run's ``logs.MetricWriter`` and
      ``logs.Progress``.
    clock: ``(wire_bytes, peak_bytes, sim_at)``: bytes one worker sends per
      step over the run and in its largest step, and ``step -> simulated
      seconds`` (or ``None``).
    steps: ``(start, num_steps)``: the step the run starts after, its last.
    global_state: ``() -> (params, model_state, opt_state)`` in the
      checkpoint's layout.
    last_checkpoint: ``() -> step`` of the latest checkpoint, for the error.
  """

  def __init__(
    self,
    config,
    workload,
    scheme,
    per_worker: bool,
    outputs: tuple,
    clock: tuple[float, float, Callable[[int], float | None]],
    steps: tuple[int, int],
    global_state: Callable,
    last_checkpoint: Callable[[], int | None],
  ):
    self.config, self.workload, self.scheme = config, workload, scheme
    self.per_worker = per_worker
    self.writer, self.progress = outputs
    self.wire_bytes, self.peak_bytes, self.sim_at = clock
    start, self.num_steps = steps
    self.global_state = global_state
    self.last_checkpoint = last_checkpoint
    self.losses: list[float] = []
    self.accuracies: list[float] = []
    self.t0: float | None = None
    self.s0 = start

  def restart_clock(self, step: int) -> None:
    """Throughput from here: after an evaluation or checkpoint."""
    self.t0, self.s0 = time.perf_counter(), step

  def __call__(self, step: int, metrics) -> None:
    """Host side of step ``step``.

    Raises:
      NonFiniteError: after ``config.max_consecutive_nonfinite`` skipped steps.
    """
    config = self.config
    m = jax.device_get(metrics)
    now = time.perf_counter()
    if self.t0 is None:  # Throughput excludes the first step's compile.
      self.t0, self.s0 = now, step
    if not m["skipped"]:
      self.losses.append(float(m["loss"]))
      self.accuracies.append(float(m["accuracy"]))
    if int(m["consecutive_nonfinite"]) >= config.max_consecutive_nonfinite:
      self.writer.write(step, nonfinite_steps=m["nonfinite_steps"], stopped=True)
      raise NonFiniteError(
        f"stopping at step {step}: the loss or gradient was non-finite in "
        f"{int(m['consecutive_nonfinite'])} consecutive steps "
        f"(config.max_consecutive_nonfinite={config.max_consecutive_nonfinite}). "
        f"Those steps were skipped, so the params are still finite; the last "
        f"checkpoint is step {self.last_checkpoint()}. Try a smaller "
        f"config.optimizer.learning_rate."
      )
    if step % config.log_every_steps and step != self.num_steps:
      return
    row = self._row(step, m, now)
    self.writer.write(step, **row)
    steps_per_sec = row["samples_per_sec"] / config.global_batch_size
    self.progress.update(step, row["loss"], row["samples_per_sec"], steps_per_sec)
    self.losses, self.accuracies = [], []
    self.t0, self.s0 = now, step

  def evaluation(self, step: int, metrics: dict[str, Any]) -> None:
    """Logs an evaluation's ``metrics`` at ``step``."""
    # The simulated time of the step, unless its training row carries it.
    logged = step % self.config.log_every_steps == 0 or step == self.num_steps
    extra = {} if logged else {"sim_seconds": self.sim_at(step)}
    self.writer.write(step, **extra, **metrics)
    self.progress.message(
      f"eval at step {step}: loss {metrics['eval_loss']:.4f}, "
      f"accuracy {metrics['eval_accuracy']:.4f}"
    )

  def _row(self, step: int, m, now: float) -> dict[str, Any]:
    steps = step - self.s0
    seconds = now - self.t0
    steps_per_sec = steps / seconds if steps and seconds > 0 else math.nan
    samples_per_sec = steps_per_sec * self.config.global_batch_size
    row = {
      "loss": float(np.mean(self.losses)) if self.losses else math.nan,
      "accuracy": float(np.mean(self.accuracies)) if self.accuracies else None,
      "samples_per_sec": samples_per_sec,
      **self.workload.throughput(samples_per_sec),
      "wire_bytes_per_step": self.wire_bytes,
      "peak_wire_bytes_per_step": self.peak_bytes,
      "sim_seconds": self.sim_at(step),
      "l2_grads": m["l2_grads"],
      "l2_updates": m["l2_updates"],
      "nonfinite_steps": m["nonfinite_steps"],
    }
    if self.per_worker:
      row["consensus_distance"] = float(
        step_lib.consensus_distance(self.global_state()[0])
      )
    self.scheme.log(step, row, self.writer, lambda: self.global_state()[2])
    return row
