"""Command line of the benchmarks: ``python -m gradcomp.bench <suite> [flags]``.

Example::

  python -m gradcomp.bench compress --model resnet50 --repeats 7 --only topk,dgc
  python -m gradcomp.bench sketch
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
  args = parser.parse_args(argv)
  if args.suite == "compress":
    try:
      compress.select(args.only)
    except ValueError as e:
      p.error(str(e))
  args.func(args)


if __name__ == "__main__":
  main()
