"""Command line of the benchmarks: ``python -m gradcomp.bench <suite> [flags]``.

Example::

  python -m gradcomp.bench compress --model resnet50 --repeats 7 --only topk,dgc
  python -m gradcomp.bench sketch
  python -m gradcomp.bench fusion --models resnet20,resnet50 --compressor topk
  python -m gradcomp.bench search
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradcomp._src import shapes
from gradcomp.bench import compress, sketch


def _compress(args: argparse.Namespace) -> None:
  compress.run(
    model=args.model,
    repeats=args.repeats,
    only=args.only,
    out_dir=args.out,
    warmup=args.warmup,
  )


def _sketch(args: argparse.Namespace) -> None:
  sketch.run(repeats=args.repeats, out_dir=args.out, model=args.model)


def _fusion(args: argparse.Namespace) -> None:
  import jax

  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", args.devices)
  from gradcomp.bench import fusion

  fusion.run(
    models=tuple(args.models.split(",")),
    compressor=args.compressor,
    hyperparameters={} if args.ratio <= 0 else {"ratio": args.ratio},
    repeats=args.repeats,
    out_dir=args.out,
  )


def _search(args: argparse.Namespace) -> None:
  from gradcomp.bench import fusion

  fusion.search_table(
    workers=args.workers,
    repeats=args.repeats,
    profile_dir=args.profiles,
    out_dir=args.out,
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m gradcomp.bench",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  suites = parser.add_subparsers(dest="suite", required=True)
  p = suites.add_parser(
    "compress", help="compress + decompress time per compressor, layer-wise and fused"
  )
  p.add_argument("--model", default="resnet50", choices=sorted(shapes.MODELS))
  p.add_argument("--repeats", type=int, default=7, help="timed calls (median)")
  p.add_argument("--warmup", type=int, default=1, help="untimed calls after the first")
  p.add_argument("--only", default=None, help="comma-separated labels, e.g. topk,bf16")
  p.add_argument("--out", default="bench_out/", help="directory for compress.json")
  p.set_defaults(func=_compress)
  s = suites.add_parser(
    "sketch", help="Count Sketch / sketch_topk stages: time and peak memory"
  )
  s.add_argument("--model", default="resnet50", choices=sorted(shapes.MODELS))
  s.add_argument("--repeats", type=int, default=7, help="timed calls (median)")
  s.add_argument("--out", default="bench_out/", help="directory for sketch.json")
  s.set_defaults(func=_sketch)
  f = suites.add_parser(
    "fusion", help="LayerFusion: predicted vs measured step time of three plans"
  )
  f.add_argument("--models", default="resnet20,resnet50")
  f.add_argument("--compressor", default="topk")
  f.add_argument(
    "--ratio", type=float, default=0.01, help="0 for compressors without one"
  )
  f.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
  f.add_argument("--repeats", type=int, default=5, help="timed calls (median)")
  f.add_argument("--out", default="bench_out/", help="directory for fusion_check.json")
  f.set_defaults(func=_fusion)
  h = suites.add_parser(
    "search", help="LayerFusion: heuristic vs DP optimum on every model x compressor"
  )
  h.add_argument("--workers", type=int, default=16)
  h.add_argument("--repeats", type=int, default=3, help="timed calls per profile size")
  h.add_argument("--profiles", default="bench_out/profiles", help="profile JSON cache")
  h.add_argument("--out", default="bench_out/", help="directory for fusion_search.json")
  h.set_defaults(func=_search)
  args = parser.parse_args(argv)
  if args.suite == "compress":
    try:
      compress.select(args.only)
    except ValueError as e:
      p.error(str(e))
  args.func(args)


if __name__ == "__main__":
  main()
