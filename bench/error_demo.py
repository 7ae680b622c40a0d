"""What each compressor sends, and how close its result is to the dense mean.

``python -m bench.error_demo`` (``make demo``): 8 virtual CPU workers, each
holding a different gradient of a small MLP-shaped tree (a shared signal plus
per-worker noise). For every compressor it prints the bytes one worker sends per step, read from the compiled program, as
a fraction of the dense fp32 all-reduce, and the relative error against the
exact mean after one step and for the sum over 20 steps (where error feedback
catches up on what single steps leave behind).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Virtual devices must be requested before JAX starts its CPU backend.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gradcomp  # noqa: E402

AXIS = "data"
STEPS = 20
SHAPES = {
  "w1": (784, 256),
  "b1": (256,),
  "w2": (256, 256),
  "b2": (256,),
  "w3": (256, 10),
}
COMPRESSORS = [
  ("none", {}),
  ("fp16", {}),
  ("topk", {"ratio": 0.01}),
  ("randomk", {"ratio": 0.01}),
  ("dgc", {"ratio": 0.01, "momentum": 0.0}),
  ("qsgd", {"levels": 4}),
  ("terngrad", {}),
  ("signsgd", {}),
  ("ef_signsgd", {}),
  ("powersgd", {"rank": 4}),
  ("threshold_quantize", {"threshold": 0.05}),
  ("sketch_topk", {"ratio": 0.01}),
]


def worker_gradients(mesh, workers: int, steps: int):
  """(steps, workers, ...) gradients: a low-rank signal shared by all + noise."""
  rng = np.random.default_rng(0)
  grads = {}
  for name, shape in SHAPES.items():
    signal = rng.standard_normal(shape) * (1.0 / np.sqrt(shape[0]))
    noise = rng.standard_normal((steps, workers, *shape)) * 0.5 / np.sqrt(shape[0])
    grads[name] = (signal + noise).astype(np.float32)
  return jax.device_put(grads, NamedSharding(mesh, P(None, AXIS)))


def run(tx, mesh, grads):
  """All steps in one compiled scan; returns per-step mean updates."""

  def steps(grads, state):
    state = gradcomp.drop_worker_axis(state)

    def body(state, g):
      updates, state = tx.update(g, state)
      return state, updates

    grads = jax.tree.map(lambda g: g[:, 0], grads)
    state, updates = jax.lax.scan(body, state, grads)
    return updates, gradcomp.add_worker_axis(state)

  fn = jax.jit(
    jax.shard_map(
      steps, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS)), out_specs=(P(), P(AXIS))
    )
  )
  params = {k: jnp.zeros(v, jnp.float32) for k, v in SHAPES.items()}
  state = gradcomp.add_worker_axis(tx.init(params), mesh.size)
  state = jax.device_put(state, NamedSharding(mesh, P(AXIS)))
  one_step = jax.tree.map(lambda g: g[:1], grads)
  sent = gradcomp.wire_bytes(fn, one_step, state)
  return sent, fn(grads, state)[0]


def relative_error(approx, exact) -> float:
  a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(approx)])
  e = np.concatenate([np.ravel(x) for x in jax.tree.leaves(exact)])
  return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def main() -> None:
  workers = len(jax.devices())
  mesh = jax.make_mesh((workers,), (AXIS,))
  grads = worker_gradients(mesh, workers, STEPS)
  exact = jax.tree.map(lambda g: np.asarray(g).mean(axis=1), grads)
  size = sum(int(np.prod(s)) for s in SHAPES.values())
  print(
    f"{workers} workers on {jax.devices()[0].platform}, {size:,} parameters per gradient\n"
  )
  print(
    "| compressor | bytes sent / step | vs fp32 | rel. error, 1 step | rel. error, sum of 20 | time |"
  )
  print("|---|---:|---:|---:|---:|---:|")
  dense = None
  for name, kwargs in COMPRESSORS:
    start = time.perf_counter()
    tx = gradcomp.get(name, axis_name=AXIS, **kwargs)
    sent, updates = run(tx, mesh, grads)
    dense = dense or sent
    first = relative_error(
      jax.tree.map(lambda u: np.asarray(u)[0], updates),
      jax.tree.map(lambda e: e[0], exact),
    )
    total = relative_error(
      jax.tree.map(lambda u: np.asarray(u).sum(0), updates),
      jax.tree.map(lambda e: e.sum(0), exact),
    )
    label = name + "".join(f" {k}={v}" for k, v in kwargs.items())
    print(
      f"| {label} | {sent:,} | {sent / dense:.4f} | {first:.3f} | {total:.3f} "
      f"| {time.perf_counter() - start:.1f}s |"
    )
  print(
    "\nsignSGD returns the majority vote (a sign vector), not a mean, so its "
    "error is measured against the mean only for reference."
  )


if __name__ == "__main__":
  main()
