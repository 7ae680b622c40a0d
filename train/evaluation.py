"""Evaluations of a run: the model (or the workers' average), and each worker's own.

Every evaluation covers the whole test set, padded to whole batches whose
padding weighs 0, so each batch has one shape (one compile).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import step as step_lib


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


class Evaluator:
  """A run's evaluation on the test set.

  Replicated params are scored as they are. Per-worker params (a scheme's,
  DESIGN §5) give two: the workers' average model (``eval_*``) and, unless
  ``each_worker`` is false (``config.eval_each_worker``), each worker's own
  (``eval_worker_*``, one evaluation per worker); the scheme adds its own
  (``scheme.evaluate``).
  """

  def __init__(
    self,
    workload,
    scheme,
    layout,
    variant: str,
    eval_batch_size: int,
    each_worker: bool = True,
  ):
    self.workload, self.scheme, self.layout, self.variant = (
      workload,
      scheme,
      layout,
      variant,
    )
    self.each_worker = each_worker
    mesh = layout.mesh
    self.batch = -(-eval_batch_size // mesh.size) * mesh.size
    model = workload.model
    if layout.params_per_worker:
      average_layout = dataclasses.replace(layout, params_per_worker=False)
      self.eval_step = step_lib.make_eval_step(
        model, average_layout, criterion=workload.criterion
      )
      self.worker_eval = step_lib.make_worker_eval_step(
        model, layout, criterion=workload.criterion
      )
      self.averager = step_lib.make_averager(layout)
    else:
      self.eval_step = step_lib.make_eval_step(
        model, layout, variant, criterion=workload.criterion
      )

  @classmethod
  def from_config(cls, config, workload, scheme, layout, variant: str) -> Evaluator:
    """The run's evaluator: ``config.eval_batch_size`` and ``eval_each_worker``
    (unset: each worker's own model is scored too)."""
    each_worker = config.get("eval_each_worker") is not False
    return cls(workload, scheme, layout, variant, config.eval_batch_size, each_worker)

  def _score(self, params, model_state, variant="shard_map") -> dict[str, float]:
    ds = self.workload.dataset
    return evaluate(
      self.eval_step,
      self.layout.mesh,
      params,
      model_state,
      ds.x_test,
      ds.y_test,
      self.batch,
      variant,
    )

  def __call__(self, params, model_state, global_state: Callable) -> dict[str, float]:
    """Metrics of the state (as the step holds it); ``global_state()`` gives
    ``(params, model_state, opt_state)`` in the checkpoint's layout."""
    if not self.layout.params_per_worker:
      metrics = self._score(params, model_state, self.variant)
    else:
      worker_params, worker_state, _ = global_state()
      average = self.averager((worker_params, worker_state))
      metrics = self._score(*average)
      if self.each_worker:
        ds = self.workload.dataset
        metrics.update(
          evaluate_workers(
            self.worker_eval,
            self.layout.mesh,
            worker_params,
            worker_state,
            ds.x_test,
            ds.y_test,
          )
        )
      opt_state = lambda: global_state()[2]
      metrics.update(self.scheme.evaluate(self._score, opt_state, average[1]))
    metrics.update(self.workload.eval_metrics(metrics))
    return metrics
