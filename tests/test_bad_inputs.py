"""Defined behaviour on hostile inputs, for every compressor (issue 11 §6).

Every registered compressor, layer-wise on 1 and on 8 workers and fused
(``layerfusion(plan="single")``) on 8, takes one *hostile* step (on 8 workers
only worker 0's gradient is hostile, the others are clean) and then one clean
step. Every case must end with

- finite compressor state after the hostile step and after the clean step;
- outputs of each leaf's dtype, finite on the clean step, and finite on the
  hostile step too when every hostile input was finite (an output that does
  not fit the leaf's dtype saturates at its finite range);
- the same clean-step output on every worker.

A compressor may instead reject an input with a clear ``ValueError`` /
``TypeError`` at construction or trace time (DESIGN's validation rule); none
needs to today, so an exception fails the test.

Cost. Values change data, not shapes: one program per (compressor, workers,
layout) runs both steps (a two-step ``scan``, so ``update`` is traced once) and
returns the state's finiteness; it is compiled once and called for every value
case. The dtype and shape cases (float16, bfloat16, a scalar, a 0-size and a
1-element leaf) are leaves of the same tree, hit by every value case.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import scatter

import harness

# Small hyper-parameters so that every leaf of the tiny tree stays tiny.
CONFIGS = {
  "none": {},
  "fp16": {},
  "topk": {"ratio": 0.25},
  "randomk": {"ratio": 0.25},
  "dgc": {"ratio": 0.25},
  "qsgd": {"levels": 4, "bucket_size": 16},
  "terngrad": {},
  "signsgd": {},
  "ef_signsgd": {},
  "powersgd": {"rank": 2},
  "threshold_quantize": {"threshold": 0.5},
  "sketch_topk": {"ratio": 0.25},
  "onebit_sgd": {},
  "fixed_point": {"bits": 4},
  "dynamic_fixed_point": {"bits": 12, "block_size": 16},
  "sparse_quantize": {"threshold": 0.5, "max_ratio": 0.25},
  "fp8": {"format": "e5m2", "block_size": 16, "error_feedback": True},
  "fp4": {"block_size": 16},
  "int_quantize": {"bits": 8, "block_size": 16},
  "qgz": {"block_size": 16},
}
# The reduce-scatter forms of the quantizing codecs (exchange="scatter",
# compressors/scatter.py), each a case "name:scatter" with the config above;
# int_quantize's also with its 8-bit residuals (LoCo).
SCATTER = {
  f"{name}:scatter": (name, {**CONFIGS[name], "exchange": "scatter"})
  for name in scatter.SCATTERED
}
SCATTER["int_quantize:scatter-int8"] = (
  "int_quantize",
  {**CONFIGS["int_quantize"], "exchange": "scatter", "residual_bits": 8},
)
CASES_BY_NAME = {name: (name, config) for name, config in CONFIGS.items()} | SCATTER
NAMES = sorted(CASES_BY_NAME)

LEAVES, CASES = harness.HOSTILE_LEAVES, harness.HOSTILE_CASES
WORKERS = (1, harness.WORKERS)
LAYOUTS = ("layerwise", "fused")


def _params():
  return {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in LEAVES.items()}


@functools.cache
def _clean(workers: int):
  """Clean gradients of the two steps, per leaf of shape (2, workers, ...)."""
  rng = np.random.default_rng(0)
  return {
    k: rng.standard_normal((2, workers, *shape)).astype(dtype)
    for k, (shape, dtype) in LEAVES.items()
  }


def _grads(workers: int, case: str):
  """Step 0 has the hostile gradient on worker 0, step 1 is clean."""
  out = {}
  for k, clean in _clean(workers).items():
    g = clean.copy()
    g[0, 0] = harness.hostile(clean[0, 0], case)
    out[k] = g
  return out


def _finite_flags(tree):
  """Per leaf of ``tree``: whether all of it is finite (non-float leaves are)."""

  def flag(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.all(jnp.isfinite(x))
    return jnp.array(True)

  return jax.tree.map(flag, tree)


@functools.cache
def _program(name: str, workers: int, layout: str):
  """``f(grads) -> (updates, state_finite)``, both with leading (workers, 2)."""
  axis = None if workers == 1 else harness.AXIS
  factory, config = CASES_BY_NAME[name]
  tx = gradcomp.get(factory, axis_name=axis, **config)
  if layout == "fused":
    tx = gradcomp.layerfusion(tx, plan="single")
  params = _params()

  def two_steps(grads, state):
    def body(state, g):
      updates, state = tx.update(g, state)
      return state, (updates, _finite_flags(state))

    return jax.lax.scan(body, state, grads)[1]

  if workers == 1:
    state = tx.init(params)

    def run(grads, state):
      out = two_steps(jax.tree.map(lambda g: g[:, 0], grads), state)
      return jax.tree.map(lambda x: x[None], out)

    run = jax.jit(run)
  else:
    state = harness.worker_state(tx, params)

    def per_worker(grads, state):
      grads = jax.tree.map(lambda g: g[:, 0], grads)
      out = two_steps(grads, gradcomp.drop_worker_axis(state))
      return gradcomp.add_worker_axis(out)

    run = jax.jit(
      jax.shard_map(
        per_worker,
        mesh=harness.mesh(),
        in_specs=(P(None, harness.AXIS), P(harness.AXIS)),
        out_specs=P(harness.AXIS),
      )
    )
    return lambda grads: run(harness.shard(grads, P(None, harness.AXIS)), state)
  return lambda grads: run(grads, state)


def _problems(name: str, workers: int, layout: str, case: str):
  """Everything undefined about one case, as readable lines (empty: defined)."""
  where = f"{name} {workers} worker(s) {layout} {case}:"
  grads = _grads(workers, case)
  updates, state_finite = jax.device_get(_program(name, workers, layout)(grads))
  problems = []
  for path, flags in jax.tree_util.tree_flatten_with_path(state_finite)[0]:
    for step, label in enumerate(("hostile", "clean")):
      if not np.all(flags[:, step]):
        problems.append(
          f"{where} state{jax.tree_util.keystr(path)} non-finite after the {label} step"
        )
  hostile_finite = all(
    np.all(np.isfinite(g[0].astype(np.float32))) for g in grads.values()
  )
  for k, (_, dtype) in LEAVES.items():
    out = updates[k]
    if out.dtype != jnp.dtype(dtype):
      problems.append(f"{where} output {k!r} is {out.dtype}, the leaf is {dtype}")
    out = out.astype(np.float32)
    if hostile_finite and not np.all(np.isfinite(out[:, 0])):
      problems.append(f"{where} finite inputs, non-finite output {k!r} (hostile step)")
    if not np.all(np.isfinite(out[:, 1])):
      problems.append(f"{where} non-finite output {k!r} on the clean step")
    elif not all(np.array_equal(out[w, 1], out[0, 1]) for w in range(workers)):
      problems.append(f"{where} clean-step output {k!r} differs between workers")
  return problems


def test_every_registered_compressor_is_covered():
  assert set(gradcomp.names()) == set(CONFIGS)


# A scatter form on one worker is its codec's encode and decode of one chunk,
# which the gather form's one-worker runs and test_scatter_forms.py's
# one-device references cover: its hostile matrix runs on 8 workers, leaf by
# leaf (the dtype and shape cases; fused, one float32 buffer is one of them).
# The fused layout runs on 8 workers only: its one buffer is a float32 leaf
# the layer-wise one-worker run already takes through the codec alone, and 8
# workers add what fusing can break (worker 0's hostile values in the one
# buffer's exchange, beside clean workers).
RUNS = [
  (name, workers, layout)
  for name in NAMES
  for workers in WORKERS
  for layout in LAYOUTS
  if (workers > 1 or layout == "layerwise")
  and (name not in SCATTER or (workers > 1 and layout == "layerwise"))
]


@pytest.mark.parametrize(("name", "workers", "layout"), RUNS)
def test_hostile_step_then_clean_step(name, workers, layout):
  problems = []
  for case in CASES:
    problems += _problems(name, workers, layout, case)
  assert not problems, "\n".join(problems)
