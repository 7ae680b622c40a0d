"""Wire and link bytes of the quantizing codecs' gather and scatter forms (issue 32).

``python -m bench.scatter_wire [--size 1000000] [--workers 8] [--wide 64]``

For ``size`` values on ``workers`` virtual CPU devices, each codec's gather
and scatter (``exchange="scatter"``) forms are compiled and their
collectives' operand bytes read from the optimized HLO (DESIGN §4); link
bytes per worker use ``gradcomp.sim``'s volumes (an all-gather's operand
crosses ``n - 1`` links, an all-to-all sends ``(n - 1) / n`` of its
operand). At ``wide`` workers the scatter form's closed form
(``scatter.scatter_wire``) is priced against the dense float32 ring
all-reduce, ``2 (n - 1) / n x 4d`` bytes per worker.
"""

from __future__ import annotations

import argparse


def codecs():
  """``{label: (factory, kwargs, chunk codec, bits per code)}``."""
  from gradcomp.compressors import fixed_point, intq, onebit, quantizers, signs

  return {
    "signsgd": ("signsgd", {}, signs.SIGN_VOTE, 1),
    "ef_signsgd": ("ef_signsgd", {}, signs.MEAN_SIGN, 1),
    "onebit_sgd": ("onebit_sgd", {}, onebit.TWO_MEANS, 1),
    "terngrad": ("terngrad", {}, quantizers.TERNARY_CHUNKS, 2),
    "qsgd(4), buckets of 512": ("qsgd", {}, quantizers.qsgd_chunks(4, 512), 8),
    "fixed_point(8)": (
      "fixed_point",
      {"bits": 8},
      fixed_point.fixed_point_chunks(8, 7),
      8,
    ),
    "dynamic_fixed_point(12)": (
      "dynamic_fixed_point",
      {"bits": 12},
      fixed_point.dynamic_chunks(12, None, True),
      12,
    ),
    "dynamic_fixed_point(8), groups of 512": (
      "dynamic_fixed_point",
      {"bits": 8, "block_size": 512},
      fixed_point.dynamic_chunks(8, 512, True),
      8,
    ),
    "int_quantize(8), blocks of 512": (
      "int_quantize",
      {"bits": 8},
      intq.int_chunks(8, 512),
      8,
    ),
    "int_quantize(4), blocks of 512": (
      "int_quantize",
      {"bits": 4},
      intq.int_chunks(4, 512),
      4,
    ),
  }


def hlo_bytes(tx, size: int, mesh) -> dict[str, int]:
  """Operand bytes per collective kind of one compiled update of ``size`` values."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from gradcomp.parallel import wire, workers

  n = mesh.devices.size
  sharded = NamedSharding(mesh, P("data"))
  g = jax.ShapeDtypeStruct((n, size), jnp.float32, sharding=sharded)
  state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharded),
    jax.eval_shape(tx.init, jax.ShapeDtypeStruct((size,), jnp.float32)),
  )
  step = jax.jit(workers.sharded_update(tx, mesh, "data"))
  text = step.lower(g, state).compile().as_text()
  return {k: v for k, v in wire.collective_bytes(text).items() if v}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=1_000_000)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--wide", type=int, default=64)
  args = parser.parse_args(argv)
  import jax

  jax.config.update("jax_num_cpu_devices", args.workers)
  import gradcomp
  from gradcomp.compressors import scatter

  d, n = args.size, args.workers
  mesh = jax.make_mesh((n,), ("data",))
  print(f"d = {d:,}, n = {n}: operand bytes per worker from the compiled HLO")
  print(
    "| codec | gather payload | gather link | scatter all-to-all | scatter all-gather "
    "| scatter link | link / payload | closed form |"
  )
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
  wide = []
  for label, (name, kwargs, codec, bits) in codecs().items():
    gather = hlo_bytes(gradcomp.get(name, axis_name="data", **kwargs), d, mesh)
    tx = gradcomp.get(name, axis_name="data", exchange="scatter", **kwargs)
    scattered = hlo_bytes(tx, d, mesh)
    payload = sum(gather.values())
    link = scatter.link_bytes(scattered, n)
    same = scatter.scatter_wire(codec, d, n) == scattered
    print(
      f"| {label} | {payload:,} | {(n - 1) * payload:,} "
      f"| {scattered.get('all-to-all', 0):,} | {scattered.get('all-gather', 0):,} "
      f"| {link:,.0f} | {link / payload:.3f} | {'matches' if same else 'DIFFERS'} |"
    )
    wide.append((label, bits, scatter.scatter_wire(codec, d, args.wide)))
  wide.append(("onebit_allreduce (1-bit Adam)", 1, scatter.onebit_wire(d, args.wide)))
  m = args.wide
  dense = 2 * (m - 1) / m * 4 * d
  print()
  print(f"n = {m}, closed form: scatter link bytes against the dense ring all-reduce's")
  print(
    f"{dense:,.0f} (2 (n - 1) / n x 4d); targets 1/4 for 8-bit codes, 1/16 for signs"
  )
  print("| codec | scatter link bytes | / dense | target | holds |")
  print("| --- | ---: | ---: | ---: | --- |")
  for label, bits, w in wide:
    link = scatter.link_bytes(w, m)
    target = {1: 16, 8: 4}.get(bits)
    holds = "-" if target is None else ("yes" if link * target <= dense else "no")
    shown = "-" if target is None else f"1/{target}"
    print(f"| {label} | {link:,.0f} | {link / dense:.4f} | {shown} | {holds} |")


if __name__ == "__main__":
  main()
