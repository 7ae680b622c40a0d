"""Plan LayerFusion for a built-in model on a described cluster (paper 000 §4.3).

    python -m gradcomp.fusion --model resnet50 --compressor topk --ratio 0.01 \\
        --workers 16 --bandwidth-gbps 20

prints, for the layer-wise, single, heuristic (§4.3) and optimal (DP) plans,
the number of groups, the predicted iteration time and the scaling factor
(eq. 1), and writes the heuristic plan as JSON. ``Comp`` comes from a profile
measured now on this backend (or loaded with ``--profile``); ``Comm`` from the
alpha-beta model of the cluster; the backward time per leaf from the model's
FLOPs at ``--tflops`` (the total can be given with ``--backward-ms``).

``--allreduce`` chooses how the cluster's all-reduces move bytes (issue 16;
:mod:`gradcomp.sim.collectives`): ``ring`` (default),
``recursive_halving_doubling``, ``rabenseifner``, ``binary_tree``,
``hierarchical`` (with ``--workers-per-node``, ``--intra-bandwidth-gbps``,
``--intra-latency-us``), ``sharded_parameter_server`` (with ``--servers`` and
``--colocated``) or ``best`` (the cheapest flat one per message size), e.g.

    python -m gradcomp.fusion --model resnet50 --compressor none \\
        --workers 64 --allreduce best

``--hierarchical`` plans ``gradcomp.hierarchical(<compressor over 'node'>,
'local')`` on nodes of ``--workers-per-node`` devices (> 1): the compressor is
profiled on the nodes, lifted (``Profile.hierarchical``), and each group's
reduce-scatter (``--scatter-dtype``) and all-gather are priced inside a node
at ``--intra-bandwidth-gbps``, its compressed exchange across the nodes, e.g.

    python -m gradcomp.fusion --model gpt2_small --compressor topk --ratio 0.01 \\
        --workers 128 --workers-per-node 8 --bandwidth-gbps 25 \\
        --intra-bandwidth-gbps 7200 --hierarchical

Leaf indices in the plan refer to ``jax.tree.leaves`` of the flat
``{name: array}`` tree of ``gradcomp.models.shapes.make_tree`` (names sorted);
gradient-ready order is the reverse of the forward order.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import time

from gradcomp.compressors import registry
from gradcomp.fusion import search as fusion_search
from gradcomp.fusion.hierarchical import hierarchical, hierarchical_spec_of
from gradcomp.fusion.layerfusion import in_forms
from gradcomp.fusion.plan import FORMS, Plan
from gradcomp.fusion.profiling import profile
from gradcomp.models import shapes
from gradcomp.sim.cluster import (
  ALLREDUCE,
  DEFAULT_INTRA_BANDWIDTH_GBPS,
  DEFAULT_INTRA_LATENCY_US,
  TOPOLOGIES,
  Cluster,
)
from gradcomp.sim.model_workload import DEFAULT_TFLOPS, model_workload
from gradcomp.sim.profile import DEFAULT_SIZES, Profile
from gradcomp.sim.timeline import CostModel


@dataclasses.dataclass(frozen=True)
class PlanRow:
  method: str
  plan: Plan
  groups: int
  iteration_ms: float
  scaling_factor: float
  comp_ms: float
  comm_ms: float
  overlap_ms: float
  search_ms: float


def compare_plans(
  model: CostModel, order, methods=fusion_search.METHODS, eps: float = 1e-3
) -> list[PlanRow]:
  """One :class:`PlanRow` per search method, scored by ``model``."""
  rows = []
  for method in methods:
    t0 = time.perf_counter()
    plan = fusion_search.search_plan(model, order, method, eps)
    search_ms = (time.perf_counter() - t0) * 1e3
    t = model.timeline(plan)
    rows.append(
      PlanRow(
        method=method,
        plan=plan,
        groups=len(plan.groups),
        iteration_ms=t.iteration_seconds * 1e3,
        scaling_factor=t.scaling_factor,
        comp_ms=sum(t.comp_seconds) * 1e3,
        comm_ms=sum(t.comm_seconds) * 1e3,
        overlap_ms=t.overlap_seconds * 1e3,
        search_ms=search_ms,
      )
    )
  return rows


def markdown(rows: list[PlanRow]) -> str:
  """The rows as a Markdown table; with exchange forms, how many groups scatter."""
  forms = any(r.plan.forms is not None for r in rows)
  lines = [
    "| plan | groups | iteration ms | scaling factor | Comp ms | Comm ms | hidden ms "
    f"| search ms |{' scattered |' if forms else ''}",
    f"| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |{' ---: |' if forms else ''}",
  ]
  for r in rows:
    scattered = f" {(r.plan.forms or ()).count('scatter')} |" if forms else ""
    lines.append(
      f"| {r.method} | {r.groups} | {r.iteration_ms:.2f} | {r.scaling_factor:.3f} "
      f"| {r.comp_ms:.2f} | {r.comm_ms:.2f} | {r.overlap_ms:.2f} | {r.search_ms:.1f} |"
      + scattered
    )
  return "\n".join(lines)


def _hyperparameter(text: str) -> tuple[str, object]:
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m gradcomp.fusion", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--model", required=True, choices=sorted(shapes.MODELS))
  parser.add_argument("--compressor", required=True, choices=registry.names())
  parser.add_argument("--ratio", type=float, help="the compressor's ratio")
  parser.add_argument("--rank", type=int, help="PowerSGD's rank")
  parser.add_argument("--levels", type=int, help="QSGD's levels")
  parser.add_argument(
    "--set", type=_hyperparameter, action="append", default=[], metavar="KEY=VALUE",
    help="any other factory argument (repeatable)",
  )  # fmt: skip
  parser.add_argument("--workers", type=int, default=16)
  parser.add_argument("--bandwidth-gbps", type=float, default=20.0)
  parser.add_argument("--latency-us", type=float, default=25.0)
  parser.add_argument("--topology", choices=TOPOLOGIES, default="ring")
  parser.add_argument(
    "--allreduce", choices=ALLREDUCE, default="ring",
    help="how an all-reduce moves bytes (best: the cheapest flat one per size)",
  )  # fmt: skip
  parser.add_argument(
    "--servers", type=int, default=1, help="sharded_parameter_server's servers"
  )
  parser.add_argument(
    "--colocated", action="store_true",
    help="sharded_parameter_server: servers run on workers, not nodes of their own",
  )  # fmt: skip
  parser.add_argument(
    "--workers-per-node", type=int, default=1, help="hierarchical: workers per node"
  )
  parser.add_argument(
    "--intra-bandwidth-gbps", type=float, default=DEFAULT_INTRA_BANDWIDTH_GBPS,
    help="hierarchical: intra-node link Gbit/s",
  )  # fmt: skip
  parser.add_argument(
    "--intra-latency-us", type=float, default=DEFAULT_INTRA_LATENCY_US,
    help="hierarchical: intra-node latency per message",
  )  # fmt: skip
  parser.add_argument(
    "--hierarchical", action="store_true",
    help="plan hierarchical(<compressor over 'node'>, 'local'): needs "
    "--workers-per-node > 1",
  )  # fmt: skip
  parser.add_argument(
    "--scatter-dtype", choices=("float32", "float16", "bfloat16"),
    help="--hierarchical: the reduce-scatter's payload type inside a node "
    "(default float32)",
  )  # fmt: skip
  parser.add_argument(
    "--exchange", choices=("inner", "auto"), default="inner",
    help="auto: price the codec's gather and scatter forms and give each "
    "group the cheaper (a codec with an exchange= keyword)",
  )  # fmt: skip
  parser.add_argument("--batch-size", type=int, help="per worker; default Table 3's")
  parser.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS)
  parser.add_argument("--backward-ms", type=float, help="total backward time")
  parser.add_argument("--eps", type=float, default=1e-3, help="§4.3 stopping rule")
  parser.add_argument("--profile", help="load the compressor profile from this JSON")
  parser.add_argument("--save-profile", help="write the measured profile here")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per size")
  parser.add_argument("--out", default="fusion_plan.json", help="plan JSON path")
  return parser.parse_args(argv)


def cluster_of(args: argparse.Namespace) -> Cluster:
  """The :class:`Cluster` the flags describe; ``ValueError`` on a bad one."""
  return Cluster(
    args.workers,
    args.bandwidth_gbps,
    args.latency_us,
    args.topology,
    allreduce=args.allreduce,
    servers=args.servers,
    colocated=args.colocated,
    workers_per_node=args.workers_per_node,
    intra_bandwidth_gbps=args.intra_bandwidth_gbps,
    intra_latency_us=args.intra_latency_us,
  )


def _links(cluster: Cluster) -> str:
  """The topology and all-reduce algorithm, for the summary line."""
  if cluster.topology != "ring":
    return cluster.topology
  text = f"all-reduce: {cluster.allreduce}"
  if cluster.allreduce == "sharded_parameter_server":
    where = "co-located" if cluster.colocated else "dedicated"
    text += f", {cluster.servers} {where}"
  if cluster.allreduce == "hierarchical":
    text += (
      f", {cluster.workers_per_node} per node at "
      f"{cluster.intra_bandwidth_gbps:g} Gbps, {cluster.intra_latency_us:g} us"
    )
  return text


def _lifted(cluster: Cluster, args: argparse.Namespace) -> str:
  """For the summary line: how a hierarchical compressor's profile was made."""
  if not args.hierarchical:
    return ""
  g = cluster.workers_per_node
  return f" as its inner on {cluster.workers // g} nodes, lifted to nodes of {g}"


def _hierarchical(args: argparse.Namespace, hyperparameters: dict, cluster: Cluster):
  """``hierarchical(<compressor over 'node'>, 'local')``, as the flags ask."""
  g = cluster.workers_per_node
  if g < 2 or cluster.workers % g:
    raise ValueError(
      f"--hierarchical needs --workers-per-node > 1 dividing --workers = "
      f"{cluster.workers}, got {g}"
    )
  inner = registry.get(args.compressor, axis_name="node", **hyperparameters)
  return hierarchical(inner, "local", scatter_dtype=args.scatter_dtype)


def _forms(tx) -> dict:
  """``{form: tx in that form}`` for ``--exchange auto``."""
  build = in_forms(tx)
  return {form: build(form) for form in FORMS}


def main(argv=None) -> int:
  args = parse_args(argv)
  hyperparameters = dict(args.set)
  for key in ("ratio", "rank", "levels"):
    if getattr(args, key) is not None:
      hyperparameters[key] = getattr(args, key)
  try:
    cluster = cluster_of(args)
    if args.hierarchical:
      tx = _hierarchical(args, hyperparameters, cluster)
    elif args.scatter_dtype is not None:
      raise ValueError("--scatter-dtype goes with --hierarchical")
    else:
      tx = registry.get(args.compressor, **hyperparameters)
    work = model_workload(
      args.model, batch_size=args.batch_size, tflops=args.tflops,
      backward_ms=args.backward_ms,
    )  # fmt: skip
    if args.exchange == "auto" and (args.profile or args.save_profile):
      raise ValueError(
        "--exchange auto measures both forms' profiles now: drop --profile / "
        "--save-profile"
      )
    if args.exchange == "auto" and args.hierarchical:
      raise ValueError("--exchange auto plans a flat codec's forms, not --hierarchical")
    if args.profile:
      measured = Profile.load(args.profile)
      measured.check_for(tx)
      measured.check_cluster(cluster)
    else:
      print(
        f"measuring {args.compressor} at {len(DEFAULT_SIZES)} sizes ...",
        file=sys.stderr,
      )
      if args.hierarchical:  # the inner on the nodes, lifted to the groups
        g = cluster.workers_per_node
        inner = profile(
          hierarchical_spec_of(tx).inner, DEFAULT_SIZES, repeats=args.repeats,
          workers=cluster.workers // g,
        )  # fmt: skip
        measured = inner.hierarchical(g, scatter_dtype=args.scatter_dtype)
      elif args.exchange == "auto":
        measured = {
          form: profile(
            tx_form, DEFAULT_SIZES, repeats=args.repeats, workers=cluster.workers
          )
          for form, tx_form in _forms(tx).items()
        }
      else:
        measured = profile(
          tx, DEFAULT_SIZES, repeats=args.repeats, workers=cluster.workers
        )
      if args.save_profile:
        measured.save(args.save_profile)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  model = CostModel(measured, cluster, work.workload)
  rows = compare_plans(model, work.order, eps=args.eps)
  w = work.workload
  one = next(iter(measured.values())) if isinstance(measured, dict) else measured
  label = (
    "both forms of " + one.compressor
    if isinstance(measured, dict)
    else (one.compressor)
  )
  print(
    f"{args.model} ({len(w.sizes)} tensors, {sum(w.sizes):,} values), "
    f"{label} profiled on {one.backend}{_lifted(cluster, args)}, "
    f"{cluster.workers} workers "
    f"at {cluster.bandwidth_gbps:g} Gbps ({_links(cluster)}, {cluster.latency_us:g} us); "
    f"forward {w.forward_seconds * 1e3:.1f} ms + backward "
    f"{sum(w.backward_seconds) * 1e3:.1f} ms per step (T_1 = "
    f"{w.single_worker_seconds * 1e3:.1f} ms)\n"
  )
  print(markdown(rows))
  if isinstance(measured, dict):
    print()
    for form, p in measured.items():
      alone = CostModel(p, cluster, work.workload)
      seconds = fusion_search.heuristic_search(alone, args.eps)[1]
      print(f"every group in the {form} form: heuristic plan {seconds * 1e3:.2f} ms")
  heuristic = next(r for r in rows if r.method == "heuristic")
  with open(args.out, "w") as f:
    f.write(heuristic.plan.to_json())
  print(f"\nheuristic plan ({heuristic.groups} groups) written to {args.out}")
  return 0
