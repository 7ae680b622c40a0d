"""What a seeded suite trains on: the base config, the metric and its direction.

The suites of seeded training runs (``convergence``, ``schemes``, ``cdsgd``,
``gossip``, ``async``) take a :class:`Workload` (``--workload``) and run the
same methods on its base config, each method's scheme and compressor set on
top. Two are known (:data:`WORKLOADS`):

* ``digits`` (the default): ``configs/default.py``, the MLP on scikit-learn's
  digits with SGD (lr 0.1, momentum 0.9); the tables report the final eval
  accuracy in %, higher is better, and compare accuracies in percentage
  points;
* ``gpt_tiny``: ``configs/gpt_tiny.py``, the 2-layer GPT on bytes of text
  with AdamW (peak lr 3e-3, warm-up 50, cosine); the tables report the final
  validation **bits per byte** (``eval_loss / ln 2``, the program's
  ``eval_bits_per_byte``), lower is better. Every check that allows a method
  to end some percentage points of accuracy below a reference allows it
  :data:`BPB_MARGIN` bits per byte above instead (one margin for every suite:
  ``bench.transformer.TARGET_MARGIN``, the transformer suite's
  margin above dense's final bpb); a target at a fixed accuracy (the schemes
  suite's 95 and 97 %, the async suite's 95 %) has no bits-per-byte
  counterpart that holds at any run length and is not applicable
  (``absolute_levels=False``).

The hyper-parameters a suite chose for digits' SGD that have no meaning under
AdamW come from the workload too, as gpt_tiny's values the transformer suite
already chose (``bench.transformer``): the plain-SGD local step of
CD-SGD and OD-SGD (:attr:`Workload.local_learning_rate`), the 2-bit threshold
on mean gradients (:attr:`Workload.threshold`), the learning rate of the
asynchronous server on the mean gradient (:attr:`Workload.server_learning_rate`),
and whether a method's ``optimizer`` fields (SGD's momentum and lr, tuned on
digits) apply (:attr:`Workload.sgd`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: gpt_tiny's tolerance of every "within X points of" check and of the time to
#: target, in bits per byte (``bench.transformer.TARGET_MARGIN``).
BPB_MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class Workload:
  """A base config, its headline metric and the metric's direction.

  Attributes:
    name: ``--workload`` value.
    title: words heading tables and figures.
    config_module: the module whose ``get_config()`` is the base config.
    key: the metric's name in JSON keys (``final_{key}``, ``{key}_mean``).
    metric: the metric in words, with its unit.
    higher_is_better: accuracy (True) or bits per byte (False).
    from_loss: the metric is ``{prefix}_loss / ln 2`` (bits per byte) rather
      than ``{prefix}_accuracy``.
    worker_columns: the ``metrics.jsonl`` columns of the workers' own models
      by statistic: the worst and mean accuracy, or the mean loss (the
      program logs no worst loss).
    worker_stat: the statistic of :attr:`worker_columns` that tables show.
    worker_title: that column in words.
    absolute_levels: fixed-level targets (95 % accuracy) apply.
    sgd: the base optimizer is SGD with momentum: a method's ``optimizer``
      fields (tuned for it on digits) are applied; under AdamW they are not,
      as in the transformer suite (no hyper-parameter tuned per method).
    local_learning_rate: the plain-SGD local step of CD-SGD and OD-SGD.
    threshold: 2-bit threshold quantization's threshold on mean gradients.
    server_learning_rate: the asynchronous suite's lr on the mean gradient
      (a push's is this over the workers).
    overrides: dotted config fields set last (e.g. a narrow model for a
      smoke run), recorded in the JSON.
  """

  name: str
  title: str
  config_module: str
  key: str
  metric: str
  higher_is_better: bool
  from_loss: bool
  worker_columns: Mapping[str, str]
  worker_stat: str
  worker_title: str
  absolute_levels: bool
  sgd: bool
  local_learning_rate: float
  threshold: float
  server_learning_rate: float
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def config_file(self) -> str:
    """``configs/default.py``: the base config's file."""
    return self.config_module.replace(".", "/") + ".py"

  def config(self):
    """The base config with :attr:`overrides` set."""
    config = importlib.import_module(self.config_module).get_config()
    config.update_from_flattened_dict(dict(self.overrides))
    return config

  def heading(self) -> str:
    """The title, with the config file and overrides unless plain digits."""
    over = ", ".join(f"{k}={v}" for k, v in self.overrides.items())
    if self.name == "digits" and not over:
      return self.title
    return (
      f"{self.title} ({self.config_file}"
      + (f"; overrides: {over}" if over else "")
      + ")"
    )

  def with_overrides(self, overrides: Mapping[str, Any] | None) -> Workload:
    """This workload with ``overrides`` (dotted config fields) added."""
    return dataclasses.replace(self, overrides={**self.overrides, **(overrides or {})})

  def read(self, row: Mapping[str, Any], column: str) -> float:
    """``row[column]`` (a loss or an accuracy) as the metric: bits for a loss.

    NaN where the row lacks it (a run stopped before, a null).
    """
    found = row.get(column)
    if found is None:
      return math.nan
    return float(found) / math.log(2) if self.from_loss else float(found)

  def value(self, row: Mapping[str, Any], prefix: str = "eval") -> float:
    """The metric of a ``metrics.jsonl`` row (``prefix`` ``eval_global`` etc.)."""
    return self.read(row, f"{prefix}_{'loss' if self.from_loss else 'accuracy'}")

  def worker_values(self, row: Mapping[str, Any]) -> dict[str, float]:
    """``{f"worker_{key}_{stat}": value}`` of an eval row's worker columns.

    Synchronous training logs none: its one replicated model is every
    worker's, so each is then the row's metric.
    """
    return {
      f"worker_{self.key}_{stat}": self.read(row, column)
      if column in row
      else self.value(row)
      for stat, column in self.worker_columns.items()
    }

  @property
  def worker_key(self) -> str:
    """The curve key of the tables' worker column (``worker_accuracy_min``)."""
    return f"worker_{self.key}_{self.worker_stat}"

  def is_eval(self, row: Mapping[str, Any]) -> bool:
    """An eval row (it carries ``eval_loss``)."""
    return "eval_loss" in row

  @property
  def scale(self) -> float:
    """Display multiplier: accuracy in %, bits per byte as is."""
    return 1.0 if self.from_loss else 100.0

  @property
  def unit(self) -> str:
    """The display unit of a difference: ``pp`` or ``bits/byte``."""
    return "bits/byte" if self.from_loss else "pp"

  @property
  def suffix(self) -> str:
    """A difference's unit in JSON keys: ``pp`` or ``bpb``."""
    return "bpb" if self.from_loss else "pp"

  @property
  def difference_key(self) -> str:
    """The JSON key of a check's difference (``difference_pp`` on digits)."""
    return f"difference_{self.suffix}"

  def fmt(self, value: float | None) -> str:
    """One value in display units: ``97.22`` (%) or ``2.345`` (bits/byte)."""
    if value is None or not math.isfinite(value):
      return "-"
    return f"{value:.3f}" if self.from_loss else f"{100 * value:.2f}"

  def fmt_stats(self, stats: Mapping[str, Any] | None) -> str:
    """``mean ± std`` of ``convergence._stats`` in display units (``-``: none)."""
    if not stats:
      return "-"
    std = stats.get("std")
    if std is None or not math.isfinite(std):
      return self.fmt(stats["mean"])
    digits = 3 if self.from_loss else 2
    return f"{self.fmt(stats['mean'])} ± {self.scale * std:.{digits}f}"

  def advantage(self, candidate: float, reference: float) -> float:
    """How much better ``candidate`` ends than ``reference``, in display units.

    Points of accuracy (``100 (candidate - reference)``) or bits per byte
    (``reference - candidate``): positive means better, for either metric.
    """
    if self.higher_is_better:
      return self.scale * (candidate - reference)
    return self.scale * (reference - candidate)

  def tolerance(self, points: float) -> float:
    """A suite's tolerance of ``points`` percentage points, in display units.

    The points themselves on digits; :data:`BPB_MARGIN` bits per byte for a
    loss metric (module docstring).
    """
    return BPB_MARGIN if self.from_loss else points

  def within(self, candidate: float, reference: float, points: float) -> bool:
    """``candidate`` at most :meth:`tolerance` worse than ``reference``."""
    return bool(self.advantage(candidate, reference) >= -self.tolerance(points))

  def target(self, reference: float, points: float) -> float:
    """The level :meth:`tolerance` worse than ``reference`` (a time-to-target)."""
    step = self.tolerance(points) / self.scale
    return reference - step if self.higher_is_better else reference + step

  def reached(self, values: Sequence[float] | np.ndarray, level: float) -> np.ndarray:
    """Where ``values`` are at ``level`` or better (NaN: never)."""
    v = np.asarray(values, np.float64)
    with np.errstate(invalid="ignore"):
      return v >= level if self.higher_is_better else v <= level

  def better(self, a: float, b: float) -> bool:
    """``a`` strictly better than ``b``."""
    return bool(a > b) if self.higher_is_better else bool(a < b)

  @property
  def axis_label(self) -> str:
    """A figure's y-axis label."""
    return self.metric

  def describe(self) -> dict[str, Any]:
    """The JSON record of the workload (its name is what tables read back)."""
    return {
      "name": self.name,
      "config": self.config_file,
      "metric": self.metric,
      "higher_is_better": self.higher_is_better,
      "overrides": dict(self.overrides),
    }


DIGITS = Workload(
  name="digits",
  title="digits MLP",
  config_module="configs.default",
  key="accuracy",
  metric="eval accuracy",
  higher_is_better=True,
  from_loss=False,
  worker_columns={
    "mean": "eval_worker_accuracy_mean",
    "min": "eval_worker_accuracy_min",
  },
  worker_stat="min",
  worker_title="worst worker",
  absolute_levels=True,
  sgd=True,
  local_learning_rate=0.1,
  # Paper 001's 0.5 on gradients summed over the per-worker batch of 16.
  threshold=0.5 / 16,
  server_learning_rate=0.4,
)

GPT_TINY = Workload(
  name="gpt_tiny",
  title="gpt_tiny on bytes of text",
  config_module="configs.gpt_tiny",
  key="bpb",
  metric="validation bits per byte",
  higher_is_better=False,
  from_loss=True,
  worker_columns={"mean": "eval_worker_loss_mean"},
  worker_stat="mean",
  worker_title="workers' mean",
  absolute_levels=False,
  sgd=False,
  # transformer.CDSGD_LOCAL_LR: AdamW's peak lr, untuned.
  local_learning_rate=3e-3,
  # transformer.CDSGD_THRESHOLD: the RMS coordinate of a gradient at the
  # clipping norm 1.0 (1 / sqrt(445,952 params)).
  threshold=1.5e-3,
  # AdamW's peak lr on the mean gradient, as the synchronous runs.
  server_learning_rate=3e-3,
)

#: Overrides of a smoke run of gpt_tiny (the tests'): one narrow layer on
#: windows of 32 bytes, 2 per worker, 32 validation windows, a 1-step warm-up.
#: The program's paths are the same; the compile is short.
SMOKE = {
  "dataset.context": 32,
  "model.num_layers": 1,
  "model.width": 32,
  "model.num_heads": 2,
  "global_batch_size": 16,
  "dataset.max_eval_windows": 32,
  "optimizer.warmup_steps": 1,
}

#: The workloads by ``--workload`` name.
WORKLOADS: dict[str, Workload] = {w.name: w for w in (DIGITS, GPT_TINY)}


def get(name: str | Mapping[str, Any] | None) -> Workload:
  """The workload of ``name`` (or of a result's ``"workload"`` record; ``None``:
  digits, the results written before workloads existed).

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  if name is None:
    return DIGITS
  if isinstance(name, Mapping):
    return get(name["name"]).with_overrides(name.get("overrides"))
  if name not in WORKLOADS:
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
  return WORKLOADS[name]
