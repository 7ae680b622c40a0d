"""What a run trains: dataset, model, loss and metrics, behind one interface.

A workload is chosen by ``config.dataset.name``. The built-in ones (digits,
CIFAR-10, ImageNet, PTB, text: ``train.data.NAMES``) pair a dataset of
``train.data`` with a model of ``gradcomp.models.zoo`` (``config.model``)
and the per-example cross-entropy of ``train.step``. Another one is
:func:`register`\\ ed under a new name, from any module imported before the
run (a config file, say), and the program trains it unchanged::

  workload.register("my_data", lambda config: workload.Workload(...))

The loop asks a workload only for what is on :class:`Workload`: its data,
model and criterion (the loss, cross-entropy unless it says otherwise);
language models add bits per token to their evaluations and tokens per
second to their throughput from ``Dataset.token``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from gradcomp.models import zoo as models
from train import data as data_lib
from train import step as step_lib


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
  """A dataset and the model trained on it.

  Attributes:
    dataset: the examples, in host memory (``train.data.Dataset``).
    model: a flax module mapping a batch of ``dataset.x_*`` to outputs
      (logits over ``dataset.num_classes``, per position for sequences),
      called as ``model.apply(variables, x, train=...)``.
    criterion: ``criterion(outputs, targets) -> (losses, scores)``, per
      example (per position for sequences): the loss trained and evaluated
      (``eval_loss``), and the score evaluated (``eval_accuracy``).
      Default: cross-entropy and top-1 accuracy.
  """

  dataset: data_lib.Dataset
  model: nn.Module
  criterion: Callable = step_lib.cross_entropy

  @property
  def name(self) -> str:
    return self.dataset.name

  def batch_like(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes and dtypes of one global training batch ``(x, y)``."""
    ds = self.dataset
    return (
      jax.ShapeDtypeStruct((batch_size, *ds.input_shape), ds.x_train.dtype),
      jax.ShapeDtypeStruct((batch_size, *ds.y_train.shape[1:]), ds.y_train.dtype),
    )

  def throughput(self, samples_per_sec: float) -> dict[str, float]:
    """Language models: target tokens (bytes, words) per second, beside samples."""
    if self.dataset.token is None:
      return {}
    return {
      "tokens_per_sec": samples_per_sec * math.prod(self.dataset.y_train.shape[1:])
    }

  def eval_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` and, for a language model, its loss in bits per token."""
    if self.dataset.token is None:
      return {}
    return {f"eval_bits_per_{self.dataset.token}": metrics["eval_loss"] / math.log(2)}

  def describe(self) -> list[str]:
    """Lines for the run's log: what was read, where the dataset says."""
    return [] if self.dataset.description is None else [self.dataset.description]


def load_dataset(config) -> data_lib.Dataset:
  """``data.load`` with the set fields of ``config.dataset`` (e.g. ``seq_len``)."""
  d = dict(config.dataset)
  name, data_dir, synthetic = d.pop("name"), d.pop("data_dir"), d.pop("synthetic")
  kwargs = {k: v for k, v in d.items() if v is not None}
  return data_lib.load(name, data_dir, synthetic=synthetic, seed=config.seed, **kwargs)


def _builtin(config) -> Workload:
  """A dataset of ``train.data`` and the zoo's ``config.model``."""
  model_cfg = dict(config.model)
  name = model_cfg.pop("name")
  models.check_name(name)  # Before loading a dataset.
  ds = load_dataset(config)
  return Workload(ds, models.create(name, ds.num_classes, **model_cfg))


_REGISTRY: dict[str, Callable[[Any], Workload]] = dict.fromkeys(
  data_lib.NAMES, _builtin
)


def register(name: str, build: Callable[[Any], Workload]) -> None:
  """Makes ``config.dataset.name=name`` train ``build(config)``'s workload."""
  _REGISTRY[name] = build


def names() -> tuple[str, ...]:
  return tuple(_REGISTRY)


def check(config) -> None:
  """Raises ``ValueError`` unless ``config.dataset.name`` is a registered workload."""
  name = config.dataset.name
  if name not in _REGISTRY:
    raise ValueError(
      f"unknown dataset {name!r} (config.dataset.name); valid: {', '.join(_REGISTRY)}"
    )


def create(config) -> Workload:
  """The workload of ``config.dataset.name``.

  Raises:
    ValueError: an unknown name or model.
    train.data.DatasetNotFoundError: the dataset's files are missing.
  """
  check(config)
  return _REGISTRY[config.dataset.name](config)
