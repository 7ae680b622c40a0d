"""Command line of the benchmarks: ``python -m bench <suite> [flags]``.

Example::

  python -m bench compress --model resnet50 --repeats 7 --only topk,dgc
  python -m bench floor --model resnet50 --repeats 9
  python -m bench per-leaf --models resnet50,gpt2_small --plans single,auto
  python -m bench sketch
  python -m bench fusion --models resnet20,resnet50 --compressor topk
  python -m bench search
  python -m bench sizes --only topk,dgc --repeats 7
  python -m bench wire --models resnet20,resnet50,lstm_ptb
  python -m bench step --compressors none,topk,sketch_topk --plans layerwise,single,auto
  python -m bench convergence --seeds 3
  python -m bench scaling --sources paper
  python -m bench schemes --seeds 3
  python -m bench cdsgd --seeds 3
  python -m bench gossip --seeds 3
  python -m bench async --seeds 3
  python -m bench schemes --workload gpt_tiny --seeds 1 --steps 200
  python -m bench factors
  python -m bench collectives --bandwidth-gbps 10 --latency-us 25
  python -m bench predictor --repeats 3
  python -m bench edgegossip --seeds 3
  python -m bench transformer --methods dense,topk,diloco --seeds 3
  python -m bench streaming --seeds 1
  python -m bench device-step --model gpt2_small --batch 8
  python -m bench hierarchy --models resnet50,gpt2_small
  python -m bench islands --failures 10 --rounds 3000
  python -m bench study --phase grid --methods dense,topk,powersgd
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from bench import (
  async_ps,
  cdsgd,
  compress,
  gossip,
  islands,
  schemes,
  sketch,
  study,
  transformer,
  workloads,
)
from gradcomp.models import shapes


def _compress(args: argparse.Namespace) -> None:
  try:
    compress.run(
      model=args.model,
      repeats=args.repeats,
      only=args.only,
      out_dir=args.out,
      warmup=args.warmup,
      with_peers=not args.no_peers,
      layouts=tuple(args.layouts.split(",")),
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench compress: error: {e}") from None


def _floor(args: argparse.Namespace) -> None:
  from bench import floor

  try:
    if args.stages:
      floor.stages(
        model=args.model, only=args.stages, repeats=args.repeats, out_dir=args.out
      )
      return
    floor.run(
      model=args.model,
      repeats=args.repeats,
      only=args.only,
      out_dir=args.out,
      warmup=args.warmup,
      with_peers=not args.no_peers,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench floor: error: {e}") from None


def _per_leaf(args: argparse.Namespace) -> None:
  from bench import per_leaf

  try:
    per_leaf.run(
      args.models.split(","), args.rank, args.plans.split(","), args.repeats, args.out
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench per-leaf: error: {e}") from None


def _sketch(args: argparse.Namespace) -> None:
  sketch.run(repeats=args.repeats, out_dir=args.out, model=args.model)


def _fusion(args: argparse.Namespace) -> None:
  import jax

  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", args.devices)
  from bench import fusion

  fusion.run(
    models=tuple(args.models.split(",")),
    compressor=args.compressor,
    hyperparameters={} if args.ratio <= 0 else {"ratio": args.ratio},
    repeats=args.repeats,
    out_dir=args.out,
  )


def _search(args: argparse.Namespace) -> None:
  from bench import fusion

  fusion.search_table(
    workers=args.workers,
    repeats=args.repeats,
    profile_dir=args.profiles,
    out_dir=args.out,
  )


def _scaling(args: argparse.Namespace) -> None:
  from bench import scaling

  def names(text):
    return tuple(x for x in text.split(",") if x)

  try:
    scaling.run(
      models=names(args.models),
      workers=tuple(int(n) for n in names(args.workers)),
      sources=names(args.sources),
      compressors=names(args.only) or None,
      bandwidth_gbps=args.bandwidth_gbps,
      latency_us=args.latency_us,
      paper_tflops=args.paper_tflops,
      profile_dir=args.profiles or None,
      repeats=args.repeats,
      out_dir=args.out,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench scaling: error: {e}") from None


def _methods(suite: str, text: str, known, *, empty: bool = False) -> list[str]:
  """The labels of a comma-separated ``--methods``; unknown (or none) exits."""
  labels = [x for x in text.split(",") if x]
  unknown = sorted(set(labels) - set(known))
  if unknown or not (labels or empty):
    raise SystemExit(
      f"python -m bench {suite}: error: unknown --methods {unknown}; "
      f"known: {', '.join(known)}"
    )
  return labels


def _convergence(args: argparse.Namespace) -> None:
  import jax
  from absl import logging

  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", args.devices)
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  from bench import convergence

  labels = _methods("convergence", args.methods, convergence.METHODS)
  resnet = _methods(
    "convergence", args.throughput_methods, convergence.METHODS, empty=True
  )
  convergence.run(
    methods=[convergence.METHODS[x] for x in labels],
    seeds=args.seeds,
    steps=args.steps,
    eval_every=args.eval_every,
    throughput_steps=args.throughput_steps,
    throughput_methods=[convergence.METHODS[x] for x in resnet] if resnet else None,
    out_dir=args.out,
    workload=workloads.get(args.workload),
  )


def _seeded_arguments(parser, module, suite: str, methods_help: str) -> None:
  """``--methods --seeds --steps --eval-every --out`` of a seeded suite."""
  parser.add_argument(
    "--methods", default=",".join(module.DEFAULT_METHODS), help=methods_help
  )
  parser.add_argument("--seeds", type=int, default=3, help="runs per method")
  parser.add_argument("--steps", type=int, default=600, help="steps per run")
  parser.add_argument("--eval-every", type=int, default=100, help="eval interval")
  parser.add_argument("--out", default="bench_out/", help=f"directory for {suite}.*")
  _workload_argument(parser)


def _workload_argument(parser) -> None:
  """``--workload``: the base config and metric (``bench.workloads``)."""
  parser.add_argument(
    "--workload",
    default="digits",
    choices=sorted(workloads.WORKLOADS),
    help="digits (MLP, accuracy) or gpt_tiny (GPT on bytes of text, bits per "
    "byte); default digits",
  )


def _seeded_suite(suite: str, module, args: argparse.Namespace, docs: bool) -> None:
  """``module.run`` of a suite of seeded training runs (schemes, cdsgd).

  ``--methods`` are ``module.METHODS`` labels; the figure goes to ``docs/``
  with ``docs`` or with the defaults (methods, 3 seeds, 600 steps, eval
  every 100).
  """
  import jax
  from absl import logging

  labels = _methods(suite, args.methods, module.METHODS)
  for name in ("seeds", "steps", "eval_every"):
    if getattr(args, name) < 1:
      flag = "--" + name.replace("_", "-")
      raise SystemExit(
        f"python -m bench {suite}: error: {flag} must be >= 1, "
        f"got {getattr(args, name)}"
      )
  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", module.WORKERS)
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  run_shape = (args.seeds, args.steps, args.eval_every)
  defaults = (
    labels == list(module.DEFAULT_METHODS)
    and run_shape == (3, 600, 100)
    and args.workload == "digits"
  )
  module.run(
    methods=[module.METHODS[x] for x in labels],
    seeds=args.seeds,
    steps=args.steps,
    eval_every=args.eval_every,
    out_dir=args.out,
    docs_png=Path(__file__).resolve().parents[1] / "docs" / f"{suite}.png"
    if (docs or defaults)
    else None,
    workload=workloads.get(args.workload),
  )


def _schemes(args: argparse.Namespace) -> None:
  _seeded_suite("schemes", schemes, args, args.docs)


def _async(args: argparse.Namespace) -> None:
  _seeded_suite("async", async_ps, args, docs=False)


def _cdsgd(args: argparse.Namespace) -> None:
  _seeded_suite("cdsgd", cdsgd, args, docs=False)


def _gossip(args: argparse.Namespace) -> None:
  if args.gamma_sweep is None:
    _seeded_suite("gossip", gossip, args, docs=False)
    return
  import jax
  from absl import logging

  if args.workload != "digits":
    raise SystemExit("python -m bench gossip: error: --gamma-sweep runs on digits only")
  try:
    gammas = [float(x) for x in args.gamma_sweep.split(",") if x]
  except ValueError as e:
    raise SystemExit(f"python -m bench gossip: error: {e}") from None
  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", gossip.WORKERS)
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  try:
    gossip.gamma_sweep(
      gammas, steps=args.steps, eval_every=args.eval_every, out_dir=args.out
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench gossip: error: {e}") from None


def _cdsgd_model(args: argparse.Namespace) -> None:
  from bench import cdsgd_time
  from gradcomp.models import shapes
  from gradcomp.sim.cluster import Cluster

  if args.model not in shapes.MODELS:
    raise SystemExit(
      f"python -m bench cdsgd-model: error: unknown --model "
      f"{args.model!r}; known: {', '.join(shapes.MODELS)}"
    )
  try:
    cluster = Cluster(
      args.workers,
      bandwidth_gbps=args.bandwidth_gbps,
      latency_us=args.latency_us,
      topology=args.topology,
      flops_per_second=args.flops_per_second,
    )
    rows = cdsgd_time.predict(
      args.model,
      cluster,
      batch_per_worker=args.batch,
      memory_gbps=args.memory_gbps,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench cdsgd-model: error: {e}") from e
  print(
    cdsgd_time.render_prediction(
      rows,
      f"Paper 001 eqs. 2-7: {args.model}, batch {args.batch} per worker, "
      f"{args.workers} workers, {args.topology}, {args.bandwidth_gbps} Gbit/s, "
      f"{args.flops_per_second:.3g} FLOP/s",
    )
  )


def _step(args: argparse.Namespace) -> None:
  import jax

  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", args.devices)
  from bench import fusion, step

  names = lambda text: tuple(x for x in text.split(",") if x)
  if args.compressors:
    compressors = names(args.compressors)
  else:
    compressors = tuple(fusion.SEARCH_COMPRESSORS) if args.full else None
  compressors = compressors or step.DEFAULT_COMPRESSORS
  try:
    step.validate(compressors, names(args.plans), args.batch, args.devices)
  except ValueError as e:
    raise SystemExit(f"python -m bench step: error: {e}") from None
  step.run(
    compressors=compressors,
    plans=names(args.plans),
    batch=args.batch,
    repeats=args.repeats,
    out_dir=args.out,
  )


def _sizes(args: argparse.Namespace) -> None:
  from bench import sizes

  sizes.run(
    compressors=args.only,
    sizes=args.sizes,
    repeats=args.repeats,
    out_dir=args.out,
  )


def _wire(args: argparse.Namespace) -> None:
  import jax

  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", args.devices)
  from bench import wire_suite

  wire_suite.run(
    models=tuple(x for x in args.models.split(",") if x),
    compressors=args.only,
    workers=args.devices,
    out_dir=args.out,
    compile_layerwise=args.compile_layerwise,
  )


def _factors(args: argparse.Namespace) -> None:
  from absl import logging

  from bench import factors

  names = lambda text: tuple(x for x in text.split(",") if x)
  try:
    workers = tuple(int(x) for x in names(args.workers))
    measure = tuple(int(x) for x in names(args.measure_workers))
  except ValueError as e:
    raise SystemExit(f"python -m bench factors: error: {e}") from None
  models = names(args.models)
  unknown = sorted(set(models) - set(factors.MODELS))
  if unknown or not models or any(p < 1 for p in workers + measure) or args.steps < 1:
    raise SystemExit(
      f"python -m bench factors: error: models must be among "
      f"{', '.join(factors.MODELS)} (got {unknown or 'none'}), worker counts and "
      f"--steps >= 1"
    )
  logging.set_verbosity(logging.WARNING)
  factors.run(
    workers=workers,
    measure_workers=measure,
    steps=args.steps,
    models=models,
    out_dir=args.out,
  )


def _predictor(args: argparse.Namespace) -> None:
  from bench import predictor

  def floats(text):
    return tuple(float(x) for x in text.split(",") if x)

  try:
    result = predictor.run(
      intensities=floats(args.intensities),
      held_out=floats(args.held_out),
      disk=floats(args.disk),
      repeats=args.repeats,
      sample_seconds=args.sample_seconds,
      regression=args.regression,
      out_dir=args.out,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench predictor: error: {e}") from None
  print(predictor.render(result))


def _edgegossip(args: argparse.Namespace) -> None:
  import jax
  from absl import logging

  from bench import edgegossip

  def numbers(text, kind):
    return tuple(kind(x) for x in text.split(",") if x)

  try:
    workers = numbers(args.workers, int)
    ratios = numbers(args.ratios, float)
    aggregation = numbers(args.aggregation_ratios, int)
    methods = tuple(x for x in args.methods.split(",") if x)
  except ValueError as e:
    raise SystemExit(f"python -m bench edgegossip: error: {e}") from None
  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", edgegossip.DEVICES)
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  defaults = (
    workers == edgegossip.WORKERS
    and ratios == tuple(float(r) for r in edgegossip.SPEED_RATIOS)
    and (args.seeds, args.epochs) == (edgegossip.SEEDS, edgegossip.EPOCHS)
    and methods == tuple(edgegossip.DEFAULT_METHODS)
    and aggregation == tuple(edgegossip.AGGREGATION_RATIOS)
    and not (args.no_cifar or args.no_predictor or args.quick)
  )
  try:
    edgegossip.run(
      workers=workers,
      ratios=ratios,
      seeds=args.seeds,
      epochs=args.epochs,
      methods=methods,
      aggregation_ratios=aggregation,
      cifar=not args.no_cifar,
      predictor=not args.no_predictor,
      real_check=not args.no_real_check,
      quick=args.quick,
      out_dir=args.out,
      docs_png=Path(__file__).resolve().parents[1] / "docs" / "edgegossip.png"
      if (args.docs or defaults)
      else None,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench edgegossip: error: {e}") from None


def _transformer(args: argparse.Namespace) -> None:
  import jax
  from absl import logging

  if args.suite == "streaming":
    from bench import streaming

    known, runner = streaming.METHODS, streaming.run
  else:
    known, runner = transformer.METHODS, transformer.run
  labels = _methods(args.suite, args.methods, known)
  for name in ("seeds", "steps", "eval_every"):
    value = getattr(args, name)
    if value is not None and value < 1:
      flag = "--" + name.replace("_", "-")
      raise SystemExit(
        f"python -m bench {args.suite}: error: {flag} must be >= 1, got {value}"
      )
  # Before any computation: virtual CPU devices must be configured first.
  jax.config.update("jax_num_cpu_devices", transformer.WORKERS)
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  try:
    runner(
      methods=[known[x] for x in labels],
      seeds=args.seeds,
      steps=args.steps,
      eval_every=args.eval_every,
      target_bpb=args.target_bpb,
      out_dir=args.out,
      reuse=args.reuse,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench {args.suite}: error: {e}") from None


def _streaming_methods() -> tuple[str, ...]:
  from bench import streaming

  return streaming.DEFAULT_METHODS


def _transformer_flags(p, methods, out: str) -> None:
  """The transformer suite's flags (``transformer``, ``adaptive``, ``streaming``)."""
  p.add_argument(
    "--methods",
    default=",".join(methods),
    help=f"comma-separated labels (default: {','.join(methods)})",
  )
  p.add_argument("--seeds", type=int, default=3, help="runs per method")
  p.add_argument(
    "--steps", type=int, default=None, help="steps per run (default: the config's)"
  )
  p.add_argument("--eval-every", type=int, default=100, help="eval interval")
  p.add_argument(
    "--reuse",
    action="store_true",
    help="read back runs already finished under --out with the same config "
    "instead of training them again (e.g. to add seeds)",
  )
  p.add_argument(
    "--target-bpb",
    type=float,
    default=None,
    help="bits per byte of the time to target (default: dense's mean final "
    f"bpb + {transformer.TARGET_MARGIN:g})",
  )
  p.add_argument("--out", default=out, help="directory for transformer.*")
  p.set_defaults(func=_transformer)


def _hierarchy(args: argparse.Namespace) -> None:
  import jax

  # Before any computation: the (2, 4) and (8,) meshes need 8 devices.
  jax.config.update("jax_num_cpu_devices", 8)
  from bench import hierarchy

  try:
    nodes = tuple(int(n) for n in args.nodes.split(",") if n.strip())
    hierarchy.run(
      models=tuple(m for m in args.models.split(",") if m.strip()),
      nodes=nodes,
      exchanges=tuple(e for e in args.exchanges.split(",") if e.strip()),
      out_dir=args.out,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench hierarchy: error: {e}") from None


def _device_step(args: argparse.Namespace) -> None:
  from bench import device_step

  specs = tuple(x for x in args.compressors.split(",") if x)
  specs = specs or device_step.DEFAULT_COMPRESSORS
  setup = device_step.Setup(
    size=args.model.removeprefix("gpt_"),
    vocab_size=args.vocab,
    batch=args.batch,
    length=args.length,
    dtype=args.dtype,
  )
  try:
    for spec in specs:
      device_step.parse(spec)
    setup.model()
  except (ValueError, KeyError) as e:
    raise SystemExit(f"python -m bench device-step: error: {e}") from None
  device_step.run(specs, setup, repeats=args.repeats, out_dir=args.out)


def _collectives(args: argparse.Namespace) -> None:
  from bench import collectives

  try:
    collectives.run(
      bandwidth_gbps=args.bandwidth_gbps,
      latency_us=args.latency_us,
      out_dir=args.out,
    )
  except ValueError as e:
    raise SystemExit(f"python -m bench collectives: error: {e}") from None


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m bench",
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
  p.add_argument(
    "--no-peers", action="store_true", help="skip the naive-JAX peers (peers.py)"
  )
  p.add_argument(
    "--layouts",
    default="layerwise,fused",
    help="gradcomp's layouts and the peers' matching ones (fused skips per-leaf "
    "compiles)",
  )
  p.set_defaults(func=_compress)
  fl = suites.add_parser(
    "floor",
    help="issue 43's seven codecs fused against one read + write of the gradient "
    "(x * -1, donated), interleaved in one process, and their peers",
  )
  fl.add_argument("--model", default="resnet50", choices=sorted(shapes.MODELS))
  fl.add_argument("--repeats", type=int, default=9, help="interleaved rounds")
  fl.add_argument("--warmup", type=int, default=1, help="untimed calls after the first")
  fl.add_argument("--only", default=None, help="comma-separated codec labels")
  fl.add_argument("--out", default="bench_out/", help="directory for floor.json")
  fl.add_argument("--no-peers", action="store_true", help="skip the peers")
  fl.add_argument(
    "--stages",
    default="",
    help="instead: time these codecs' passes alone against the floor "
    "(e.g. qsgd,sketch_topk,powersgd,threshold_quantize,ef_signsgd)",
  )
  fl.set_defaults(func=_floor)
  pl = suites.add_parser(
    "per-leaf",
    help="PowerSGD per leaf inside LayerFusion against the seed's single buffer, "
    "interleaved in one process",
  )
  pl.add_argument("--models", default="resnet50,gpt2_small")
  pl.add_argument("--rank", type=int, default=4)
  pl.add_argument("--plans", default="single,auto", help="comma-separated plans")
  pl.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
  pl.add_argument("--out", default="bench_out/", help="directory for per_leaf.json")
  pl.set_defaults(func=_per_leaf)
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
  sc = suites.add_parser(
    "scaling",
    help="simulated scaling factor and throughput, layer-wise vs LayerFusion, "
    "2-16 workers at 20 Gbps (measured and paper-calibrated costs)",
  )
  sc.add_argument("--models", default="resnet20,resnet50,lstm_ptb")
  sc.add_argument("--workers", default="2,4,8,16", help="comma-separated counts")
  sc.add_argument("--sources", default="measured,paper", help="measured and/or paper")
  sc.add_argument("--only", default="", help="comma-separated compressors (all)")
  sc.add_argument("--bandwidth-gbps", type=float, default=20.0)
  sc.add_argument("--latency-us", type=float, default=25.0)
  sc.add_argument(
    "--paper-tflops", type=float, default=None,
    help="V100 compute of the paper source (default: from 356 img/s ResNet-50)",
  )  # fmt: skip
  sc.add_argument("--repeats", type=int, default=3, help="timed calls per profile size")
  sc.add_argument("--profiles", default="bench_out/profiles", help="profile JSON cache")
  sc.add_argument("--out", default="bench_out/", help="directory for scaling.*")
  sc.set_defaults(func=_scaling)
  cv = suites.add_parser(
    "convergence",
    help="eval accuracy vs steps and time per compressor on digits (paper 000 "
    "Fig. 6), ResNet-20 throughput",
  )
  cv.add_argument("--methods", default="dense,dgc,sketch_fusion,topk,signsgd")
  cv.add_argument("--seeds", type=int, default=3, help="digits runs per method")
  cv.add_argument("--steps", type=int, default=600, help="steps per digits run")
  cv.add_argument("--eval-every", type=int, default=50, help="digits eval interval")
  cv.add_argument(
    "--throughput-steps", type=int, default=12, help="ResNet-20 steps; 0 skips it"
  )
  cv.add_argument(
    "--throughput-methods", default="", help="ResNet-20 methods (default: all but dgc)"
  )
  cv.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
  cv.add_argument("--out", default="bench_out/", help="directory for convergence.*")
  _workload_argument(cv)
  cv.set_defaults(func=_convergence)
  sm = suites.add_parser(
    "schemes",
    help="sync, local SGD, DiLoCo (dense, top-k, signSGD) and EASGD on digits: "
    "accuracy, bytes/step, simulated time on two described clusters",
  )
  _seeded_arguments(
    sm, schemes, "schemes", "comma-separated labels (also: diloco_ef_signsgd)"
  )
  sm.add_argument(
    "--docs",
    action="store_true",
    help="copy schemes.png to docs/ (default: only with the default methods, "
    "seeds, steps and eval interval)",
  )
  sm.set_defaults(func=_schemes)
  cd = suites.add_parser(
    "cdsgd",
    help="paper 001: S-SGD, BIT-SGD, OD-SGD, CD-SGD k=2..20 on digits (accuracy, "
    "measured step vs eqs. 2-7), simulated Table 2 and Fig. 10",
  )
  _seeded_arguments(cd, cdsgd, "cdsgd", "comma-separated labels")
  cd.set_defaults(func=_cdsgd)
  asy = suites.add_parser(
    "async",
    help="survey 004 §2: BSP, ASP, SSP, DC-ASGD, backup workers on digits on "
    "heterogeneous and equal speeds (accuracy, simulated time, staleness), "
    "injected staleness (Fig. 2), and which all-reduce the cost model picks",
  )
  _seeded_arguments(asy, async_ps, "async", "comma-separated labels")
  asy.set_defaults(func=_async)
  gs = suites.add_parser(
    "gossip",
    help="all-reduce, D-PSGD on four graphs, CHOCO (top-k 1 %%, sign), Q2, GoSGD "
    "on digits: accuracy, consensus, bytes, simulated time on 16 and 64 workers",
  )
  _seeded_arguments(gs, gossip, "gossip", "comma-separated labels")
  gs.add_argument(
    "--gamma-sweep",
    nargs="?",
    const=",".join(f"{g:g}" for g in gossip.SWEEP_GAMMAS),
    default=None,
    metavar="GAMMAS",
    help="instead: CHOCO's gamma sweep on seed 0 for top-k 1 %% and the sign "
    "(comma-separated gammas; default "
    + ",".join(f"{g:g}" for g in gossip.SWEEP_GAMMAS)
    + ")",
  )
  gs.set_defaults(func=_gossip)
  cm = suites.add_parser(
    "cdsgd-model",
    help="paper 001 eqs. 2-7: predicted step of S-SGD, BIT-SGD, OD-SGD and "
    "CD-SGD for a model on a described cluster",
  )
  cm.add_argument("--model", default="resnet20", help="a gradcomp.models shape")
  cm.add_argument("--batch", type=int, default=32, help="batch per worker")
  cm.add_argument("--workers", type=int, default=4, help="workers (nodes)")
  cm.add_argument("--bandwidth-gbps", type=float, default=56.0, help="link Gbit/s")
  cm.add_argument("--latency-us", type=float, default=25.0, help="per message")
  cm.add_argument(
    "--topology", default="parameter_server", help="parameter_server or ring"
  )
  cm.add_argument(
    "--flops-per-second", type=float, default=4.29e11, help="effective, per worker"
  )
  cm.add_argument(
    "--memory-gbps", type=float, default=900.0, help="prices the codec (delta)"
  )
  cm.set_defaults(func=_cdsgd_model)
  st = suites.add_parser(
    "step",
    help="ResNet-20 train step on virtual devices per compressor and plan: "
    "measured (time, samples/s, compile) vs predicted",
  )
  st.add_argument("--compressors", default="", help="comma-separated (a default set)")
  st.add_argument("--full", action="store_true", help="all twelve compressors")
  st.add_argument("--plans", default="layerwise,auto", help="layerwise,single,auto")
  st.add_argument("--batch", type=int, default=128, help="global batch (Table 3)")
  st.add_argument("--repeats", type=int, default=5, help="timed steps (median)")
  st.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
  st.add_argument("--out", default="bench_out/", help="directory for step.*")
  st.set_defaults(func=_step)
  z = suites.add_parser(
    "sizes",
    help="compress + decompress time per call vs tensor size 2^4..2^24 "
    "(paper 000 Fig. 1b) and the per-call overhead reading",
  )
  z.add_argument("--only", default=None, help="comma-separated compressors (all)")
  z.add_argument(
    "--full", action="store_true", help="every power of two (default: every second)"
  )
  z.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 16,65536")
  z.add_argument("--repeats", type=int, default=7, help="timed calls per size (median)")
  z.add_argument("--out", default="bench_out/", help="directory for sizes.json/.png")
  z.set_defaults(func=_sizes)
  w = suites.add_parser(
    "wire",
    help="bytes per step on the wire per compressor, layer-wise vs fused, "
    "on model gradient trees",
  )
  w.add_argument("--models", default="resnet20,resnet50,lstm_ptb")
  w.add_argument("--only", default=None, help="comma-separated compressors (all)")
  w.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
  w.add_argument(
    "--compile-layerwise",
    action="store_true",
    help="read layer-wise bytes from compiled HLO too (slow) instead of the trace",
  )
  w.add_argument("--out", default="bench_out/", help="directory for wire.json/.png")
  w.set_defaults(func=_wire)
  sfb = suites.add_parser(
    "factors",
    help="sufficient-factor broadcasting: per-layer bytes vs dense on the digits "
    "MLP and VGG-16 heads at 4-64 workers, exactness, measured training wire",
  )
  sfb.add_argument("--workers", default="4,8,16,64", help="comma-separated counts")
  sfb.add_argument(
    "--measure-workers",
    default="4,8",
    help="virtual CPU workers of the measured MLP runs ('' skips them)",
  )
  sfb.add_argument("--steps", type=int, default=20, help="steps per measured run")
  sfb.add_argument("--models", default="mlp,vgg16_cifar,vgg16_imagenet")
  sfb.add_argument("--out", default="bench_out/", help="directory for factors.*")
  sfb.set_defaults(func=_factors)
  co = suites.add_parser(
    "collectives",
    help="which all-reduce (ring, halving/doubling, tree) the cost model picks "
    "for 2-1024 workers and 1 KB-1 GB, and its time against the ring's",
  )
  co.add_argument("--bandwidth-gbps", type=float, default=10.0, help="link Gbit/s")
  co.add_argument("--latency-us", type=float, default=25.0, help="per message")
  co.add_argument("--out", default="bench_out/", help="directory for collectives.*")
  co.set_defaults(func=_collectives)
  pr = suites.add_parser(
    "predictor",
    help="paper 002 §3.3-4.4: fit t = t0 RG(U) on a training step under "
    "co-runners of known intensity on this machine; held-out error vs 4.30 %%",
  )
  pr.add_argument("--intensities", default="0,0.25,0.5,0.75,1", help="CPU co-runners")
  pr.add_argument("--held-out", default="0.25,0.75", help="intensities not fitted")
  pr.add_argument("--disk", default="0.25,0.5,0.75,1", help="disk co-runners")
  pr.add_argument("--repeats", type=int, default=3, help="passes over the settings")
  pr.add_argument("--sample-seconds", type=float, default=2.5, help="per window")
  pr.add_argument("--regression", default="linear", help="RG's form")
  pr.add_argument("--out", default="bench_out/", help="directory for predictor.*")
  pr.set_defaults(func=_predictor)
  eg = suites.add_parser(
    "edgegossip",
    help="paper 002: EdgeGossip vs GoSGD on digits (4 and 8 workers, speed "
    "ratios 1-10), imbalance, time to accuracy, ablation, aggregation ratio, "
    "loss-evaluation overhead, a CIFAR-format time run, a predictor-driven run",
  )
  eg.add_argument("--workers", default="4,8", help="worker counts")
  eg.add_argument("--ratios", default="1,2,3,5,10", help="slow:fast speed ratios")
  eg.add_argument("--seeds", type=int, default=3)
  eg.add_argument("--epochs", type=int, default=60)
  eg.add_argument(
    "--methods", default="gosgd,edgegossip,random", help="gosgd is always trained"
  )
  eg.add_argument("--aggregation-ratios", default="5,10,20", help="'' skips")
  eg.add_argument("--no-cifar", action="store_true", help="skip the CIFAR-format run")
  eg.add_argument("--no-predictor", action="store_true", help="skip the predictor run")
  eg.add_argument(
    "--no-real-check", action="store_true", help="skip GoSGD's re-pricing check"
  )
  eg.add_argument("--quick", action="store_true", help="a smoke run (~10 s)")
  eg.add_argument("--docs", action="store_true", help="write docs/edgegossip.png")
  eg.add_argument("--out", default="bench_out/", help="directory for edgegossip.*")
  eg.set_defaults(func=_edgegossip)
  tf = suites.add_parser(
    "transformer",
    help="gpt_tiny on bytes of text: dense, top-k, PowerSGD, EF-signSGD, QSGD, "
    "DiLoCo (dense, top-k), CD-SGD, CHOCO: bits per byte, bytes/step, "
    "simulated time to a target on 16 workers at 10 Gbps, tokens/s",
  )
  _transformer_flags(tf, transformer.DEFAULT_METHODS, "bench_out/")
  ad = suites.add_parser(
    "adaptive",
    help="the transformer suite on the adaptive-optimizer comparison: dense AdamW, "
    "AdamW after top-k / PowerSGD / EF-signSGD, 1-bit Adam, DeMo",
  )
  _transformer_flags(ad, transformer.ADAPTIVE_METHODS, "bench_out/adaptive/")
  sd = suites.add_parser(
    "streaming",
    help="Streaming DiLoCo on gpt_tiny: DDP, DiLoCo, F = 4 fragments with overlap "
    "0 / 1 / 5, eager updates, fp8 / fp4 / top-k outer gradients: loss, mean and "
    "peak bytes, simulated time on WAN clusters",
  )
  _transformer_flags(sd, _streaming_methods(), "bench_out/streaming/")
  sd.set_defaults(seeds=1)
  hi = suites.add_parser(
    "hierarchy",
    help="flat, reduce-scatter, hierarchical and qgZ exchanges on (2, 4) and (8,) "
    "meshes: bytes per axis from the HLO; simulated step time on two-tier "
    "clusters of 4-64 nodes x 8 GPUs",
  )
  hi.add_argument("--models", default="resnet50,gpt2_small")
  hi.add_argument("--nodes", default="4,8,16,48,64", help="simulated node counts")
  hi.add_argument(
    "--exchanges",
    default="dense,topk,ef_sign,int4,ef_sign_scatter,int4_scatter,hier_dense,"
    "hier_topk,hier_sign,hier_int4,qgz",
    help="comma-separated, 'dense' among them",
  )
  hi.add_argument("--out", default="bench_out/hierarchy/", help="directory")
  hi.set_defaults(func=_hierarchy)
  ds = suites.add_parser(
    "device-step",
    help="the compressor's share of a GPT AdamW step on one device (a GPU where "
    "there is one): dense vs each compressor fused",
  )
  ds.add_argument(
    "--model", default="gpt2_small", choices=["gpt_tiny", "gpt_small", "gpt2_small"]
  )
  ds.add_argument("--vocab", type=int, default=50_257, help="GPT-2's BPE by default")
  ds.add_argument("--batch", type=int, default=8, help="sequences per step")
  ds.add_argument("--length", type=int, default=None, help="tokens (the context)")
  ds.add_argument("--dtype", default="bfloat16", help="the computation's dtype")
  ds.add_argument(
    "--compressors",
    default="",
    help="comma-separated name:plan, plan single or layerwise (default: top-k, "
    "PowerSGD, EF-signSGD, signSGD, QSGD)",
  )
  ds.add_argument("--repeats", type=int, default=20, help="timed steps (median)")
  ds.add_argument("--out", default="bench_out/", help="directory for device_step.*")
  ds.set_defaults(func=_device_step)
  islands.add_parser(suites)
  study.add_parser(suites)
  args = parser.parse_args(argv)
  if args.suite in ("sizes", "wire"):
    from bench import sizes, wire_suite

    try:
      sizes.select(args.only)
      if args.suite == "sizes":
        args.sizes = sizes.grid(args.sizes, full=args.full)
      else:
        wire_suite.check_models(args.models)
        if args.devices < 2:
          raise ValueError(f"--devices must be >= 2, got {args.devices}")
    except ValueError as e:
      (z if args.suite == "sizes" else w).error(str(e))
  if args.suite == "compress":
    try:
      compress.select(args.only)
    except ValueError as e:
      p.error(str(e))
  args.func(args)


if __name__ == "__main__":
  main()
