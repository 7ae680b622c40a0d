"""Per-leaf scales and selections inside LayerFusion against the other plans, CPU.

Issue 43 item 3: the quantizers and sign codecs run per leaf inside the fused
program (``gradcomp.compressors.per_leaf_scales``), and so do the sparsifiers
at 1 % (:data:`SELECTIONS`: random-k, DGC, top-k with ``per_leaf=True`` and
SparseLoCo's chunked top-k, ``selection_groups``). For each codec this times,
on one device (``axis_name=None``: the exchange is the identity, so a call is
compress + decompress) and on the ResNet-50 gradient (161 leaves), a jitted
``tx.update`` of

* ``layerwise``: ``layerfusion(tx, "layerwise", per_leaf=False)``, one call
  of the codec per leaf;
* ``per-leaf``: ``layerfusion(tx, "single", per_leaf=True)``, every leaf in
  one group, each with its own scale;
* ``per-buffer``: ``layerfusion(tx, "single", per_leaf=False)``, the seed's
  fused form (one scale or bucket layout for the whole buffer).

The three are timed in interleaved rounds (:func:`bench.timing.interleaved`),
the state fed back unchanged each call; the minimum of the rounds is printed,
with each program's compile time.

Run: ``python -m bench.per_leaf_scales --codecs ef_signsgd,qsgd --repeats 7``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import gradcomp
from bench import timing
from gradcomp.models import shapes as shapes_lib

SCALES = ("ef_signsgd", "terngrad", "qsgd", "int_quantize", "fp8", "fp4", "onebit_sgd")
#: The per-leaf selections, each at 1 % (chunked: 64 of each 4096-value tile).
SELECTIONS = {
  "randomk": lambda: gradcomp.randomk(0.01),
  "dgc": lambda: gradcomp.dgc(0.01),
  "topk_per_leaf": lambda: gradcomp.topk(0.01, per_leaf=True),
  "topk_chunk": lambda: gradcomp.topk(64 / 4096, chunk=64),
}
CODECS = (*SCALES, *SELECTIONS)
PLANS = {
  "layerwise": ("layerwise", False),
  "per-leaf": ("single", True),
  "per-buffer": ("single", False),
}


def resnet50_grads(seed: int = 0) -> dict[str, jax.Array]:
  """Normal float32 values in the ResNet-50 shapes, keys in forward order."""
  rng = np.random.default_rng(seed)
  return {
    f"{i:03d}_{name}": jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    for i, (name, shape) in enumerate(shapes_lib.resnet50_shapes())
  }


def time_codec(name: str, grads, repeats: int) -> dict[str, tuple[float, float]]:
  """``{plan: (min ms per call, compile s)}`` for the codec ``name``."""
  programs, compiled = [], {}
  for label, (plan, per_leaf) in PLANS.items():
    codec = SELECTIONS[name]() if name in SELECTIONS else gradcomp.get(name)
    tx = gradcomp.layerfusion(codec, plan, per_leaf=per_leaf)
    f = jax.jit(tx.update)
    state = tx.init(grads)
    start = time.perf_counter()
    jax.block_until_ready(f(grads, state))
    compiled[label] = time.perf_counter() - start
    programs.append((lambda: None, lambda _, f=f, s=state: f(grads, s)))
  times = timing.interleaved(programs, repeats)
  return {
    label: (min(t), compiled[label]) for label, t in zip(PLANS, times, strict=True)
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--codecs", default=",".join(SCALES), help=", ".join(CODECS))
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args(argv)
  codecs = [c for c in args.codecs.split(",") if c]
  unknown = sorted(set(codecs) - set(CODECS))
  if unknown:
    parser.error(f"--codecs must be among {CODECS}, got {unknown}")
  grads = resnet50_grads()
  print(f"ResNet-50: {len(grads)} leaves, {sum(x.size for x in grads.values())} values")
  for name in codecs:
    row = time_codec(name, grads, args.repeats)
    cells = "  ".join(f"{k} {ms:7.1f} ms ({c:.0f} s)" for k, (ms, c) in row.items())
    ratio = row["per-leaf"][0] / row["per-buffer"][0]
    print(f"{name:13s} {cells}  per-leaf / per-buffer {ratio:.2f}", flush=True)


if __name__ == "__main__":
  main()
