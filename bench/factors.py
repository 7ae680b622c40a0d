"""Sufficient-factor broadcasting: bytes per step against dense, exactness, measured wire.

Survey 004 §2.5 (Xie et al. 2016; Poseidon, Zhang et al. 2017), issue 17.
Three heads of ``nn.Dense`` layers, each at 4, 8, 16 and 64 workers:

* **mlp**: the digits MLP of ``configs/default.py`` (64 -> 128 -> 10), batch 16
  per worker (the default global batch 128 over 8 workers);
* **vgg16_cifar**: the classifier of ``zoo.VGG16`` (``gradcomp.models.shapes``'
  ``vgg16``: one ``Dense(512, 10)``), batch 32 per worker;
* **vgg16_imagenet**: Simonyan & Zisserman's ImageNet classifier fc6-fc8
  (``7 x 7 x 512 -> 4096 -> 4096 -> 1000``, the layers SFB was proposed for;
  the zoo's CIFAR variant drops them), batch 32 per worker.

Per layer: the per-worker link bytes of the kernel's ring all-reduce
(``dense_bytes``, ``2 (P-1)/P M N`` values), of its factors' all-gather
(``factor_bytes``, ``(P-1) K (M+N)`` values), and Poseidon's choice
(``choose``). Per head: the bytes per step of the hybrid exchange (chosen
kernels plus the biases, always all-reduced) against all of it dense. The
factor rows ``K`` and kernel shapes are read off the flax modules
(``value_grad_and_factors`` under ``jax.eval_shape``).

**Exactness.** On one batch (digits for the MLP, random images / pool5
features for the VGG heads), the rebuilt kernel gradient ``U^T V`` against
``jax.grad``: ``max |rebuilt - grad| / max |grad|`` per layer.

**Measured.** The real training program (``python -m train``, compressor
``none``, layer-wise, batch 16 per worker) for a few steps on 4 and 8 virtual
CPU workers, with and without ``config.sufficient_factors``: the logged
``wire_bytes_per_step`` (the compiled step's collective operand bytes) and, from
its ``sim.json`` ``round_wire``, the same step's per-worker link bytes
(``ring_link_bytes``), against the table's hybrid prediction (the difference is
the step's 16 bytes of logged means and finite-step agreement).

Run: ``python -m bench factors`` (about a minute on 2 cores). Writes
``factors.json`` and ``factors.md`` to ``--out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench.output import write_json
from gradcomp.models import shapes, zoo
from gradcomp.models import sufficient_factors as sf

#: The heads of the tables, in order.
MODELS = ("mlp", "vgg16_cifar", "vgg16_imagenet")
WORKERS = (4, 8, 16, 64)
MEASURE_WORKERS = (4, 8)
ROOT = Path(__file__).resolve().parents[1]


class Layer(NamedTuple):
  """One ``nn.Dense`` of a head: its path, kernel ``(M, N)`` and factor rows ``K``."""

  name: str
  kernel: tuple[int, int]
  rows: int


class Head(NamedTuple):
  """The Dense layers of a model and their bias sizes (always all-reduced)."""

  name: str
  layers: tuple[Layer, ...]
  biases: tuple[int, ...]
  batch: int


# -- the table's arithmetic ---------------------------------------------------


def layer_rows(head: Head, workers: int, value_bytes: int = 4) -> list[dict[str, Any]]:
  """Per layer at ``workers``: dense and factor link bytes, the choice, what is sent."""
  rows = []
  for layer in head.layers:
    dense = sf.dense_bytes(layer.kernel, workers, value_bytes)
    factor = sf.factor_bytes(layer.kernel, layer.rows, workers, value_bytes)
    choice = sf.choose(layer.kernel, layer.rows, workers, value_bytes=value_bytes)
    rows.append(
      {
        "model": head.name,
        "layer": layer.name,
        "kernel": list(layer.kernel),
        "rows": layer.rows,
        "workers": workers,
        "dense_bytes": dense,
        "factor_bytes": factor,
        "choice": choice,
        "sent_bytes": factor if choice == "factors" else dense,
      }
    )
  return rows


def head_summary(head: Head, workers: int, value_bytes: int = 4) -> dict[str, Any]:
  """Bytes per step per worker of the head: hybrid (the rule's) against dense."""
  rows = layer_rows(head, workers, value_bytes)
  biases = sum(sf.dense_bytes((1, n), workers, value_bytes) for n in head.biases)
  dense = sum(r["dense_bytes"] for r in rows) + biases
  sent = sum(r["sent_bytes"] for r in rows) + biases
  return {
    "model": head.name,
    "workers": workers,
    "factored": [r["layer"] for r in rows if r["choice"] == "factors"],
    "dense_bytes": dense,
    "hybrid_bytes": sent,
    "ratio": sent / dense if dense else 1.0,
  }


# -- the heads, read off the flax modules ---------------------------------------


class VGG16ImageNetHead(nn.Module):
  """VGG-16's ImageNet classifier (Simonyan & Zisserman 2015): pool5 -> fc6-8.

  Dropout is left out (it scales rows of ``U``; the factors stay exact).
  """

  num_classes: int = 1000

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(4096, name="fc6")(x))
    x = nn.relu(nn.Dense(4096, name="fc7")(x))
    return nn.Dense(self.num_classes, name="fc8")(x)


def _cases() -> dict[str, tuple[nn.Module, tuple[int, ...], int]]:
  """``name -> (model, input shape of one example, batch per worker)``."""
  from configs import default

  mlp = default.get_config().model
  cifar = shapes.CIFAR_INPUT_SIZE
  return {
    "mlp": (zoo.create(mlp.name, 10, features=mlp.features), (8, 8, 1), 16),
    "vgg16_cifar": (zoo.VGG16(num_classes=10), (cifar, cifar, 3), 32),
    "vgg16_imagenet": (VGG16ImageNetHead(), (7, 7, 512), 32),
  }


def _loss(model):
  """Mean cross-entropy; BatchNorm in training mode (as the training step)."""

  def loss(params, state, x, y):
    variables = {"params": params, **state}
    if state:
      logits, _ = model.apply(variables, x, train=True, mutable=list(state))
    else:
      logits = model.apply(variables, x, train=True)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

  return loss


def head(name: str) -> Head:
  """The Dense layers of case ``name`` (shapes only: nothing runs)."""
  model, example, batch = _cases()[name]
  x = jax.ShapeDtypeStruct((batch, *example), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  variables = dict(jax.eval_shape(model.init, jax.random.key(0), x))
  params = variables.pop("params")
  _, _, factors = jax.eval_shape(
    sf.value_grad_and_factors(_loss(model)), params, variables, x, y
  )
  layers, biases = [], []
  for path, f in factors.items():
    leaf = params
    for key in path:
      leaf = leaf[key]
    layers.append(Layer("/".join(path), tuple(leaf["kernel"].shape), f.u.shape[0]))
    biases.append(int(np.prod(leaf["bias"].shape)))
  if name == "vgg16_cifar":  # The model gradcomp.models.shapes describes.
    described = dict(shapes.vgg16_shapes())
    assert [(x.name, x.kernel) for x in layers] == [
      ("classifier", described["classifier/kernel"])
    ]
  return Head(name, tuple(layers), tuple(biases), batch)


# -- exactness -----------------------------------------------------------------


def _batch(name: str, model, example, batch, rng):
  if name == "mlp":
    from train import data

    ds = data.load("digits")
    return jnp.asarray(ds.x_train[:batch]), jnp.asarray(ds.y_train[:batch])
  x = rng.standard_normal((batch, *example), dtype=np.float32)
  if name == "vgg16_imagenet":
    x = np.maximum(x, 0)  # pool5 follows a ReLU
  classes = 1000 if name == "vgg16_imagenet" else 10
  return jnp.asarray(x), jnp.asarray(rng.integers(0, classes, batch), jnp.int32)


def _params(name: str, model, x, rng):
  """Initial variables; the ImageNet head's 124M from NumPy (faster than init)."""
  if name != "vgg16_imagenet":
    variables = dict(jax.jit(model.init)(jax.random.key(0), x[:1]))
    return variables.pop("params"), variables
  abstract = jax.eval_shape(model.init, jax.random.key(0), x[:1])["params"]

  def draw(leaf):
    fan_in = leaf.shape[0] if len(leaf.shape) == 2 else 1
    scale = (2.0 / fan_in) ** 0.5 if len(leaf.shape) == 2 else 0.0
    return jnp.asarray(rng.standard_normal(leaf.shape, dtype=np.float32) * scale)

  return jax.tree.map(draw, abstract), {}


def exactness(name: str, seed: int = 0) -> list[dict[str, Any]]:
  """Rebuilt kernel gradients against ``jax.grad`` on one batch of ``name``."""
  model, example, batch = _cases()[name]
  rng = np.random.default_rng(seed)
  x, y = _batch(name, model, example, batch, rng)
  params, state = _params(name, model, x, rng)
  loss = _loss(model)

  @jax.jit
  def compare(params, state, x, y):
    _, _, factors = sf.value_grad_and_factors(loss)(params, state, x, y)
    reference = jax.grad(loss)(params, state, x, y)
    out = {}
    for path, f in factors.items():
      want = reference
      for key in path:
        want = want[key]
      want = want["kernel"]
      diff = jnp.max(jnp.abs(sf.rebuild(f.u, f.v) - want))
      out["/".join(path)] = (diff, jnp.max(jnp.abs(want)), f.u.shape[0])
    return out

  found = jax.device_get(compare(params, state, x, y))
  return [
    {
      "model": name,
      "layer": layer,
      "rows": int(rows),
      "max_abs_diff": float(diff),
      "max_abs_grad": float(scale),
      "max_rel_diff": float(diff / scale) if scale else float(diff),
    }
    for layer, (diff, scale, rows) in found.items()
  ]


# -- measured: the training program with and without factors ------------------------


def measure(workers: int, factors: bool, steps: int, workdir: Path) -> dict[str, Any]:
  """One short run of ``python -m train`` (digits MLP, ``none``, layer-wise)."""
  from train import logs

  batch = 16 * workers
  cmd = [
    sys.executable,
    "-m",
    "train",
    f"--config={ROOT / 'configs' / 'default.py'}",
    f"--workdir={workdir}",
    f"--num_cpu_devices={workers}",
    "--config.compressor.name=none",
    "--config.fusion.plan=layerwise",
    f"--config.global_batch_size={batch}",
    f"--config.num_train_steps={steps}",
    f"--config.log_every_steps={steps}",
    f"--config.eval_every_steps={steps}",
    f"--config.checkpoint_every_steps={steps}",
    f"--config.sufficient_factors={factors}",
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
  rows = logs.read_metrics(workdir / logs.METRICS_FILE)
  sim = json.loads((workdir / "sim.json").read_text())
  logged = [r["wire_bytes_per_step"] for r in rows if "wire_bytes_per_step" in r]
  evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
  return {
    "workers": workers,
    "sufficient_factors": factors,
    "wire_bytes_per_step": logged[-1],
    "round_wire": sim["round_wire"],
    "link_bytes_per_step": sf.ring_link_bytes(sim["round_wire"], workers),
    "factored": [
      x["path"] for x in sim.get("sufficient_factors", []) if x["choice"] == "factors"
    ],
    "eval_accuracy": evals[-1] if evals else None,
  }


# -- the report --------------------------------------------------------------------


def _mb(b: float) -> str:
  return f"{b / 1e6:,.3f}" if b < 1e8 else f"{b / 1e6:,.1f}"


def render(result: dict[str, Any]) -> str:
  lines = [
    "Sufficient factors (survey 004 §2.5): per-worker link bytes per step, "
    "MB (ring all-reduce 2(P-1)/P MN vs all-gather (P-1) K (M+N), float32)",
    "",
    "| model | layer | M x N | K | P | dense | factors | choice |",
    "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
  ]
  for r in result["layers"]:
    m, n = r["kernel"]
    lines.append(
      f"| {r['model']} | {r['layer']} | {m} x {n} | {r['rows']} | {r['workers']} "
      f"| {_mb(r['dense_bytes'])} | {_mb(r['factor_bytes'])} | {r['choice']} |"
    )
  lines += [
    "",
    "Per head (kernels + biases), bytes per step per worker:",
    "",
    "| model | P | dense (MB) | hybrid (MB) | hybrid / dense | factored |",
    "| --- | ---: | ---: | ---: | ---: | --- |",
  ]
  for s in result["summary"]:
    lines.append(
      f"| {s['model']} | {s['workers']} | {_mb(s['dense_bytes'])} "
      f"| {_mb(s['hybrid_bytes'])} | {s['ratio']:.3f} "
      f"| {', '.join(s['factored']) or '-'} |"
    )
  lines += [
    "",
    "Exactness on one batch: rebuilt U^T V against jax.grad",
    "",
    "| model | layer | K | max abs diff | max abs grad | max rel diff |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]
  for e in result["exactness"]:
    lines.append(
      f"| {e['model']} | {e['layer']} | {e['rows']} | {e['max_abs_diff']:.3g} "
      f"| {e['max_abs_grad']:.3g} | {e['max_rel_diff']:.3g} |"
    )
  if result["measured"]:
    lines += [
      "",
      f"Measured: python -m train, digits MLP, compressor none, batch 16 per "
      f"worker, {result['measure_steps']} steps (bytes per step per worker)",
      "",
      "| P | factors | factored layers | logged wire_bytes_per_step | all-reduce "
      "| all-gather | link bytes | table's hybrid | eval acc |",
      "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    predicted = {
      (s["model"], s["workers"]): s for s in result["summary"] if s["model"] == "mlp"
    }
    for m in result["measured"]:
      p = m["workers"]
      s = predicted.get(("mlp", p))
      table = (
        "-"
        if s is None
        else f"{s['hybrid_bytes' if m['sufficient_factors'] else 'dense_bytes']:,.0f}"
      )
      acc = "-" if m["eval_accuracy"] is None else f"{m['eval_accuracy']:.3f}"
      lines.append(
        f"| {p} | {'yes' if m['sufficient_factors'] else 'no'} "
        f"| {', '.join(m['factored']) or '-'} | {m['wire_bytes_per_step']:,.0f} "
        f"| {m['round_wire'].get('all-reduce', 0):,} "
        f"| {m['round_wire'].get('all-gather', 0):,} "
        f"| {m['link_bytes_per_step']:,.0f} | {table} | {acc} |"
      )
  return "\n".join(lines)


def run(
  workers: Sequence[int] = WORKERS,
  measure_workers: Sequence[int] = MEASURE_WORKERS,
  steps: int = 20,
  models: Sequence[str] = MODELS,
  out_dir: str = "bench_out/",
) -> dict[str, Any]:
  """The tables, the exactness check and the measured runs; prints and saves them."""
  start = time.perf_counter()
  heads = [head(name) for name in models]
  result: dict[str, Any] = {
    "workers": list(workers),
    "heads": [h._asdict() for h in heads],
    "layers": [r for h in heads for p in workers for r in layer_rows(h, p)],
    "summary": [head_summary(h, p) for h in heads for p in workers],
    "exactness": [e for name in models for e in exactness(name)],
    "measure_steps": steps,
    "measured": [],
  }
  if "mlp" in models:
    with tempfile.TemporaryDirectory() as tmp:
      for p in measure_workers:
        for factors in (False, True):
          workdir = Path(tmp) / f"p{p}_{'sfb' if factors else 'dense'}"
          result["measured"].append(measure(p, factors, steps, workdir))
  result["wall_s"] = time.perf_counter() - start
  table = render(result)
  print(table)
  path = write_json(out_dir, "factors.json", result)
  Path(out_dir, "factors.md").write_text(table + "\n")
  print(f"\nwrote {path}, factors.md ({result['wall_s']:.0f} s)")
  return result
