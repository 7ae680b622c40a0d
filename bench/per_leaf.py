"""PowerSGD per leaf inside LayerFusion against the seed's single buffer, on CPU.

Issue 43 asks that ``layerfusion(powersgd(rank=4), "auto")``, which now runs
PowerSGD leaf by leaf inside the fused program (each 2-D leaf its own ``P``,
``Q``; leaves of one matrix shape batched), cost at most 1.3x the seed's
fused PowerSGD of one near-square matrix per buffer
(``layerfusion(powersgd(4), "single", per_leaf=False)``) on the gpt2_small and
resnet50 gradient shapes. For each model this suite times, on one device
(``axis_name=None``: the exchange is the identity, so a call is compress +
decompress), ``jax.jit(tx.update, donate_argnums=(0, 1))`` of:

* ``single``: the seed's form, ``per_leaf=False``, one buffer;
* ``per-leaf <plan>``: ``layerfusion(powersgd(rank), plan)`` with ``per_leaf``
  at its default (the per-leaf form), for each plan asked (``"single"``: every
  leaf in one group; ``"auto"`` plans with a given profile, see below).

The contenders of a model are timed in interleaved rounds
(:func:`bench.timing.interleaved`: one call each per round, the order
rotated), each call on its own copy of the gradient with the state donated
and fed back, so their ratio compares programs, not moments of a shared
machine. The ``"auto"`` plan needs a profile; measuring one takes minutes on a
busy CPU, so the suite plans with a hand-made one (:func:`auto_profile`: 0.2 ms
a call plus 4 ns a value fused or not), which fuses the small leaves and keeps
the large ones apart, as a measured CPU profile does.

Run: ``python -m bench.per_leaf --models resnet50,gpt2_small --repeats 7``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import gradcomp
from bench import timing
from bench.output import write_json
from gradcomp.models import shapes as shapes_lib
from gradcomp.sim.cluster import Cluster
from gradcomp.sim.profile import Profile, label_of

PLANS = ("single", "auto")


def auto_profile(tx) -> Profile:
  """A hand-made profile for ``tx``: 0.2 ms a call plus 4 ns a value."""
  sizes = (16, 2**24)
  return Profile(
    label_of(tx),
    "hand-made",
    1,
    sizes,
    [2e-4 + 4e-9 * s for s in sizes],
    [2e-4 + 4e-9 * s for s in sizes],
    {"all-reduce": (64, 2**20)},
    {"all-reduce": (2, 2)},
  )


def contenders(rank: int, plans: Sequence[str]) -> dict[str, Any]:
  """``{label: transformation}``: the seed's single buffer, then per leaf per plan."""
  out = {
    "single": gradcomp.layerfusion(gradcomp.powersgd(rank), "single", per_leaf=False)
  }
  for plan in plans:
    if plan not in PLANS:
      raise ValueError(f"plans must be among {PLANS}, got {plan!r}")
    inner = gradcomp.powersgd(rank)
    extra = {}
    if plan == "auto":
      extra = {"profile": auto_profile(inner), "cluster": Cluster(1)}
    out[f"per-leaf {plan}"] = gradcomp.layerfusion(inner, plan, **extra)
  return out


def time_model(
  model: str, rank: int, plans: Sequence[str], repeats: int
) -> dict[str, Any]:
  """Median ms of each contender on ``model``'s gradient, and their ratios."""
  tree = shapes_lib.make_tree(shapes_lib.MODELS[model](), scale=1e-3)
  timed, first = [], {}
  for label, tx in contenders(rank, plans).items():
    state = [tx.init(tree)]
    fn = jax.jit(tx.update, donate_argnums=(0, 1))
    start = time.perf_counter()
    _, state[0] = fn(jax.tree.map(jnp.copy, tree), state[0])
    jax.block_until_ready(state[0])
    first[label] = time.perf_counter() - start

    def call(g, fn=fn, state=state):
      _, state[0] = fn(g, state[0])
      return state[0]

    timed.append((label, call))
  times = timing.interleaved(
    [(lambda: jax.tree.map(jnp.copy, tree), call) for _, call in timed], repeats
  )
  medians = {
    label: statistics.median(t) for (label, _), t in zip(timed, times, strict=True)
  }
  base = medians["single"]
  return {
    "model": model,
    "leaves": len(jax.tree.leaves(tree)),
    "values": sum(x.size for x in jax.tree.leaves(tree)),
    "median_ms": medians,
    "ratio_to_single": {k: v / base for k, v in medians.items()},
    "times_ms": {label: t for (label, _), t in zip(timed, times, strict=True)},
    "first_call_s": first,
  }


def run(
  models: Sequence[str] = ("resnet50", "gpt2_small"),
  rank: int = 4,
  plans: Sequence[str] = PLANS,
  repeats: int = 7,
  out_dir: str | None = "bench_out/",
) -> list[dict[str, Any]]:
  """Times every model; prints one line per contender; writes ``per_leaf.json``."""
  results = []
  for model in models:
    if model not in shapes_lib.MODELS:
      raise ValueError(f"unknown model {model!r}; one of {sorted(shapes_lib.MODELS)}")
    r = time_model(model, rank, plans, repeats)
    for label, ms in r["median_ms"].items():
      print(
        f"{model:12s} {label:16s} {ms:8.1f} ms  x{r['ratio_to_single'][label]:.2f}"
        f"  (first call {r['first_call_s'][label]:.1f} s)",
        flush=True,
      )
    results.append(r)
  if out_dir is not None:
    write_json(
      out_dir,
      "per_leaf.json",
      {
        "rank": rank,
        "repeats": repeats,
        "machine": {
          "platform": platform.platform(),
          "cpus": os.cpu_count(),
          "jax": jax.__version__,
          "backend": jax.default_backend(),
        },
        "results": results,
      },
    )
  return results


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m bench.per_leaf", description=__doc__)
  parser.add_argument("--models", default="resnet50,gpt2_small")
  parser.add_argument("--rank", type=int, default=4)
  parser.add_argument("--plans", default=",".join(PLANS))
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out", default="bench_out/")
  args = parser.parse_args(argv)
  try:
    run(
      args.models.split(","), args.rank, args.plans.split(","), args.repeats, args.out
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench.per_leaf: error: {e}") from None


if __name__ == "__main__":
  main()
