"""The program's plugin shape: schemes and workloads behind interfaces (train/schemes, train/workload).

Checked: every registered scheme, named alone, either validates with its
declared defaults or stops with one line naming the field; a scheme and a
workload declared outside ``train/`` (in a config file) train through
``python -m train``, and the toy scheme (each worker's step, then the
params averaged) ends where synchronous SGD on the mean gradient ends, as
linearity says it must.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import default
from train import launch, logs, schemes, train, workload

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", launch.ENV_CPU_DEVICES: "8"}


def alone(name: str):
  """The default config with only ``scheme.name`` set, as a new user would."""
  config = default.get_config()
  config.scheme.name = name
  return config


@pytest.mark.parametrize("name", schemes.names())
def test_every_scheme_alone_validates_or_names_its_field_in_one_line(name):
  cls = schemes.REGISTRY[name]
  if cls.required:
    with pytest.raises(ValueError) as error:
      train.validate(alone(name))
    field, example = next(iter(cls.required.items()))
    message = str(error.value)
    assert "\n" not in message
    assert f"config.scheme.{field}" in message
    assert f"--config.scheme.{field}={example}" in message
    return
  config = alone(name)
  resolved = train.validate(config)
  assert config.scheme.name == name and resolved is not config or not cls.defaults
  for field in cls.defaults:
    assert config.scheme[field] is None  # The caller's config is not changed.
    assert resolved.scheme[field] is not None


def test_defaults_are_the_papers():
  workers = jax.device_count()
  assert train.validate(alone("local_sgd")).scheme.every == 8
  assert train.validate(alone("gossip")).scheme.topology == "ring"
  # EASGD's §3: beta = n alpha = 0.9.
  assert train.validate(alone("easgd")).scheme.alpha == pytest.approx(0.9 / workers)


@pytest.mark.parametrize("name", ["gossip", "async_ps"])
def test_a_codec_a_scheme_cannot_send_is_replaced_by_dense(name):
  # The default sketch_topk agrees its hash key with an all-reduce, which a
  # neighbour's or a server's exchange cannot do.
  config = alone(name)
  resolved = train.validate(config)
  assert config.compressor.name == "sketch_topk"
  assert resolved.compressor.name == "none"
  assert resolved.compressor.ratio is None
  # A codec whose payloads are gathered is kept.
  config.compressor.name = "topk"
  assert train.validate(config).compressor.name == "topk"


def test_a_config_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
  command = [
    sys.executable,
    "-m",
    "train",
    f"--config={ROOT / 'configs' / 'default.py'}",
    f"--workdir={tmp_path}",
    "--config.scheme.name=cdsgd",
  ]
  plain = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True)
  assert plain.returncode == 1
  lines = plain.stderr.strip().splitlines()
  assert len(lines) == 1, plain.stderr
  assert lines[0].startswith(
    "error: scheme cdsgd needs config.scheme.local_learning_rate"
  )
  debug = subprocess.run(
    [*command, "--debug"], cwd=ROOT, env=ENV, capture_output=True, text=True
  )
  assert debug.returncode == 1
  assert "Traceback" in debug.stderr and "local_learning_rate" in debug.stderr


# A scheme and a workload declared outside train/: a config file registers
# them when the program loads it.
TOY = textwrap.dedent(
  '''
  """A toy: Gaussian blobs, a linear classifier, params averaged every step."""

  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from configs import default
  from train import data, schemes, workload


  class Linear(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      return nn.Dense(2)(x)


  def squared_error(outputs, targets):
    """The workload's own criterion: squared error to one-hot targets, and accuracy."""
    one_hot = jax.nn.one_hot(targets, outputs.shape[-1])
    correct = (jnp.argmax(outputs, -1) == targets).astype(jnp.float32)
    return jnp.sum((outputs - one_hot) ** 2, axis=-1), correct


  def blobs(config):
    rng = np.random.default_rng(0)
    centers = 3.0 * rng.normal(size=(2, 4))
    y = rng.integers(0, 2, 512).astype(np.int32)
    x = (centers[y] + rng.normal(size=(512, 4))).astype(np.float32)
    ds = data.Dataset("blobs", x[:384], y[:384], x[384:], y[384:], num_classes=2)
    return workload.Workload(ds, Linear(), criterion=squared_error)


  def average_every_step(inner, *, axis_name=None):
    """Each worker's own step of ``inner``, then the workers' params averaged."""

    def update(grads, state, params):
      updates, state = inner.update(grads, state, params)
      mean = jax.tree.map(lambda p, u: jax.lax.pmean(p + u, axis_name), params, updates)
      return jax.tree.map(lambda m, p: m - p, mean, params), state

    return optax.GradientTransformation(inner.init, update)


  class AverageEveryStep(schemes.Scheme):
    name = "average_every_step"
    factory = staticmethod(average_every_step)


  def base_config():
    config = default.get_config()
    config.dataset.name = "blobs"
    config.model.name = "linear"
    config.compressor = default.compressor("none")
    config.fusion.plan = "none"
    config.global_batch_size = 64
    config.num_train_steps = 20
    config.log_every_steps = 10
    config.eval_every_steps = 20
    config.checkpoint_every_steps = 20
    return config


  def get_config():
    schemes.register(AverageEveryStep)
    workload.register("blobs", blobs)
    config = base_config()
    config.scheme = default.scheme("average_every_step")
    return config
  '''
)


def test_a_scheme_and_a_workload_from_outside_train_run_through_the_program(
  tmp_path, monkeypatch
):
  path = tmp_path / "toy.py"
  path.write_text(TOY)
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "train",
      f"--config={path}",
      f"--workdir={tmp_path / 'toy'}",
    ],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert "scheme average_every_step" in run.stderr

  # The reference: synchronous SGD (momentum 0.9) on the mean gradient, in
  # this process, on the same workload. Averaging params after each worker's
  # step equals it: the momentum and the step are linear in the gradient.
  spec = importlib.util.spec_from_file_location("toy", path)
  toy = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(toy)
  monkeypatch.setitem(workload._REGISTRY, "blobs", toy.blobs)
  reference = train.train_and_evaluate(toy.base_config(), tmp_path / "reference")

  # The toy's optimizer state has its own structure: restored as saved.
  manager = ocp.CheckpointManager(tmp_path / "toy" / train.CHECKPOINT_DIR)
  try:
    got = manager.restore(20, args=ocp.args.StandardRestore())
  finally:
    manager.close()
  # The two differ by the order of float32 roundings: a few ulps of the
  # params per step, 20 steps: well under 1e-5 of the largest weight; a
  # step that skipped the average or the momentum would differ by percents.
  for a, b in zip(
    jax.tree.leaves(got["params"]),
    jax.tree.leaves(reference.state["params"]),
    strict=True,
  ):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())

  # The evaluation used the workload's criterion: the toy's last eval_loss is
  # the squared error of its final params on the test set, recomputed here.
  ds = toy.blobs(None).dataset
  dense = got["params"]["Dense_0"]
  outputs = ds.x_test @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
  want = np.mean(np.sum((outputs - np.eye(2)[ds.y_test]) ** 2, axis=-1))
  rows = logs.read_metrics(tmp_path / "toy" / logs.METRICS_FILE)
  assert [r for r in rows if "eval_loss" in r][-1]["eval_loss"] == pytest.approx(
    want, rel=1e-5
  )


def test_the_loop_stays_a_recipe():
  """``train_and_evaluate`` is the recipe of a run, kept under 120 lines.

  Variants belong in scheme and workload plugins (the loop knows interfaces,
  not names); a loop that grows past its budget is taking their work.
  """
  import ast
  import inspect

  from train import train as train_lib

  tree = ast.parse(inspect.getsource(train_lib))
  (loop,) = [
    node
    for node in tree.body
    if isinstance(node, ast.FunctionDef) and node.name == "train_and_evaluate"
  ]
  assert loop.end_lineno - loop.lineno + 1 < 120
