"""LayerFusion's planner: profiles, the alpha-beta model, the timeline and the search.

Paper 000 §4.3 (eq. 7) and eq. 1. Closed forms for the cost model, an
event-by-event replay for the vectorised timeline, brute force for the DP, the
compiled HLO for the traced wire payloads.
"""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomp
from bench.fusion import SEARCH_COMPRESSORS
from gradcomp.compressors.spec import spec_of
from gradcomp.fusion import search as fusion_search
from gradcomp.parallel.traced import traced_wire
from gradcomp.parallel.wire import collective_bytes

import harness

REGISTRY_KWARGS = SEARCH_COMPRESSORS  # one configuration per compressor


def synthetic_profile(call=2e-4, per_value=4e-9, fused_extra=1e-9, label="x"):
  """A profile with a known affine cost and top-k-like payload (8 bytes per 1 %)."""
  sizes = (16, 256, 4096, 65536, 2**20)
  return gradcomp.sim.Profile(
    compressor=label,
    backend="synthetic",
    devices=1,
    sizes=sizes,
    seconds=tuple(call + per_value * s for s in sizes),
    fused_seconds=tuple(call + (per_value + fused_extra) * s for s in sizes),
    wire_bytes={"all-gather": tuple(8 * max(1, s // 100) for s in sizes)},
    wire_messages={"all-gather": (2,) * len(sizes)},
  )


# -- compressor specs ------------------------------------------------------------


def test_every_registered_compressor_records_its_spec():
  assert set(REGISTRY_KWARGS) == set(gradcomp.names())
  for name, kwargs in REGISTRY_KWARGS.items():
    tx = gradcomp.get(name, axis_name="data", **kwargs)
    spec = spec_of(tx)
    assert spec.name == name and spec.axis_name == "data"
    assert spec_of(spec.build(axis_name=None)).label() == spec.label()
  assert spec_of(optax.sgd(0.1)) is None
  label = spec_of(gradcomp.topk(0.01)).label()
  assert label == "topk(error_feedback=True, ratio=0.01)"
  assert spec_of(gradcomp.topk(0.02)).label() != label


# -- wire payloads: traced program vs compiled HLO ---------------------------------


@pytest.mark.parametrize("name", sorted(REGISTRY_KWARGS))
def test_traced_wire_equals_compiled_hlo(name):
  size = 3000
  kwargs = REGISTRY_KWARGS[name]
  traced = traced_wire(
    lambda axis: gradcomp.get(name, axis_name=axis, **kwargs), size, harness.WORKERS
  )
  tx = gradcomp.get(name, axis_name=harness.AXIS, **kwargs)
  grads = harness.shard({"x": jnp.zeros((harness.WORKERS, size))})
  state = harness.worker_state(tx, {"x": jax.ShapeDtypeStruct((size,), jnp.float32)})
  text = harness.sharded_update(tx).lower(grads, state).compile().as_text()
  compiled = {k: v for k, v in collective_bytes(text).items() if v}
  assert {k: b for k, (b, _) in traced.items()} == compiled


# -- profiles ----------------------------------------------------------------------


def test_profile_fit_interpolates_extrapolates_and_is_monotone():
  p = gradcomp.sim.Profile(
    compressor="x",
    backend="b",
    devices=1,
    sizes=(10, 20, 40),
    seconds=(1.0, 3.0, 2.0),  # noise: 40 looks cheaper than 20
    fused_seconds=(2.0, 2.0, 6.0),
    wire_bytes={"all-reduce": (40, 80, 160)},
    wire_messages={"all-reduce": (1, 1, 2)},
  )
  np.testing.assert_allclose(p.comp_seconds([5, 10, 15, 30, 40]), [1, 1, 2, 3, 3])
  np.testing.assert_allclose(p.comp_seconds([30, 60], fused=True), [4, 10])
  nbytes, messages = p.wire([15, 80])["all-reduce"]
  np.testing.assert_allclose(nbytes, [60, 320])
  np.testing.assert_array_equal(messages, [1, 2])


def test_profile_json_round_trip_and_file(tmp_path):
  p = synthetic_profile()
  assert gradcomp.sim.Profile.from_json(p.to_json()) == p
  p.save(tmp_path / "p.json")
  assert gradcomp.sim.Profile.load(tmp_path / "p.json") == p
  with pytest.raises(ValueError, match="fields"):
    gradcomp.sim.Profile.from_json(json.dumps({"sizes": [1]}))


@pytest.mark.parametrize(
  "change, message",
  [
    ({"sizes": (16, 16, 4096, 65536, 2**20)}, "increasing"),
    ({"seconds": (1.0,)}, "one finite time"),
    ({"fused_seconds": (float("nan"),) * 5}, "one finite time"),
    ({"wire_bytes": {"broadcast": (0,) * 5}}, "unknown collective"),
  ],
)
def test_bad_profiles_raise(change, message):
  fields = {**synthetic_profile().__dict__, **change}
  with pytest.raises(ValueError, match=message):
    gradcomp.sim.Profile(**fields)


def test_measured_profile_on_this_backend():
  p = gradcomp.fusion.profile("topk", (16, 4096), repeats=2, ratio=0.01)
  assert p.compressor == "topk(error_feedback=True, ratio=0.01)"
  assert p.backend.startswith("cpu") and p.devices == 1
  assert all(t > 0 for t in p.seconds + p.fused_seconds)
  # k = 1 and 40 (value f32 + index s32), all-gathered as two arrays.
  assert p.wire_bytes == {"all-gather": (8, 320)}
  assert p.wire_messages == {"all-gather": (2, 2)}
  with pytest.raises(ValueError, match="measured for topk"):
    p.check_for(gradcomp.topk(0.02))
  p.check_for(gradcomp.topk(0.01, axis_name="data"))  # axis_name does not matter


@pytest.mark.parametrize(
  "args, kwargs, message",
  [
    (("topk", (0, 16)), {"ratio": 0.1}, "sizes"),
    (("topk", (16,)), {"ratio": 0.1, "devices": 99}, "devices"),
    (("topk", (16,)), {"ratio": 0.1, "repeats": 0}, "repeats"),
    (("nope", (16,)), {}, "unknown compressor"),
    ((optax.sgd(0.1), (16,)), {}, "not built by a gradcomp factory"),
  ],
)
def test_profile_rejects_bad_input(args, kwargs, message):
  with pytest.raises(ValueError, match=message):
    gradcomp.fusion.profile(*args, **kwargs)


# -- the alpha-beta model ------------------------------------------------------------


def test_ring_and_parameter_server_closed_forms():
  c = gradcomp.sim.Cluster(workers=4, bandwidth_gbps=8.0, latency_us=10.0)
  byte = 1e-9  # 8 Gbit/s is one byte per ns
  assert c.exchange_seconds("all-reduce", 1000) == pytest.approx(
    6 * 10e-6 + 1.5 * 1000 * byte
  )
  assert c.exchange_seconds("all-gather", 1000, 2) == pytest.approx(
    2 * 3 * 10e-6 + 3 * 1000 * byte
  )
  ps = gradcomp.sim.Cluster(4, 8.0, 10.0, topology="parameter_server")
  assert ps.exchange_seconds("all-reduce", 1000) == pytest.approx(
    2 * 10e-6 + 8 * 1000 * byte
  )
  assert ps.exchange_seconds("all-gather", 1000) == pytest.approx(
    2 * 10e-6 + 20 * 1000 * byte
  )
  assert gradcomp.sim.Cluster(1).comm_seconds({"all-reduce": (1e9, 1)}) == 0


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"workers": 0}, "workers"),
    ({"workers": 2.5}, "workers"),
    ({"workers": 2, "bandwidth_gbps": 0}, "bandwidth_gbps"),
    ({"workers": 2, "latency_us": -1}, "latency_us"),
    ({"workers": 2, "topology": "torus"}, "topology"),
    ({"workers": 2, "overlap": "no"}, "overlap"),
  ],
)
def test_bad_clusters_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    gradcomp.sim.Cluster(**kwargs)


# -- the timeline --------------------------------------------------------------------


def random_model(rng, n, workers=8, bandwidth=10.0, overlap=True):
  workload = gradcomp.sim.Workload(
    sizes=tuple(int(s) for s in rng.integers(1, 2**21, n)),
    backward_seconds=tuple(rng.uniform(0, 3e-3, n)),
    forward_seconds=1e-3,
    update_seconds=2e-4,
  )
  cluster = gradcomp.sim.Cluster(workers, bandwidth, overlap=overlap)
  return gradcomp.sim.CostModel(synthetic_profile(), cluster, workload)


def test_timeline_closed_form_two_groups():
  profile = synthetic_profile(call=1.0, per_value=0.0, fused_extra=0.0)
  workload = gradcomp.sim.Workload((10, 10, 10), (2.0, 1.0, 4.0), forward_seconds=3.0)
  cluster = gradcomp.sim.Cluster(2, latency_us=1e6, bandwidth_gbps=1e9)  # alpha = 1 s
  model = gradcomp.sim.CostModel(profile, cluster, workload)
  # all-gather of 2 messages on 2 workers: 2 s per group (bytes are ~free).
  t = model.timeline((2,))
  # Group 1 (leaves 0-1): ready 3+3=6, compressed 7, exchanged 7..9.
  # Group 2 (leaf 2): ready 7+4=11, compressed 12, exchanged 12..14.
  assert t.ready == pytest.approx((6.0, 11.0))
  assert t.comm_start == pytest.approx((7.0, 12.0))
  assert t.iteration_seconds == pytest.approx(14.0)
  assert t.scaling_factor == pytest.approx((3 + 7) / 14)
  assert t.overlap_seconds == pytest.approx(2.0)  # group 1 hidden by leaf 2
  assert model.iteration_seconds((2,))[0] == pytest.approx(14.0)


def test_without_overlap_exchanges_run_on_the_compute_stream():
  profile = synthetic_profile(call=1.0, per_value=0.0, fused_extra=0.0)
  workload = gradcomp.sim.Workload((10, 10, 10), (2.0, 1.0, 4.0), forward_seconds=3.0)
  cluster = gradcomp.sim.Cluster(2, latency_us=1e6, bandwidth_gbps=1e9, overlap=False)
  model = gradcomp.sim.CostModel(profile, cluster, workload)
  t = model.timeline((2,))
  # Group 1: ready 6, compressed 7, exchanged 7..9 on the stream; leaf 2's
  # backward waits for it: ready 9+4=13, compressed 14, exchanged 14..16.
  assert t.ready == pytest.approx((6.0, 13.0))
  assert t.comm_start == pytest.approx((7.0, 14.0))
  assert t.iteration_seconds == pytest.approx(16.0)
  assert t.overlap_seconds == 0.0
  assert model.iteration_seconds((2,))[0] == pytest.approx(16.0)
  # Serial exchanges: the sum of every cost, whatever the plan.
  assert model.iteration_seconds(())[0] == pytest.approx(3 + 7 + 1 + 2)


@pytest.mark.parametrize("overlap", [True, False])
def test_vectorised_cost_equals_the_event_replay(overlap):
  rng = np.random.default_rng(0)
  model = random_model(rng, 9, overlap=overlap)
  rows = np.array(list(itertools.combinations(range(1, 9), 3)))
  batched = model.iteration_seconds(rows)
  for row, seconds in zip(rows, batched, strict=True):
    assert model.timeline(tuple(row)).iteration_seconds == pytest.approx(seconds)


# -- the search ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_and_heuristic_is_bounded(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 13))
  model = random_model(
    rng, n, int(rng.integers(1, 17)), float(rng.choice([1, 100])), seed % 2 == 0
  )
  optimal, optimal_f = gradcomp.fusion.optimal_search(model)
  _, brute_f = fusion_search.brute_force_search(model)
  assert optimal_f == pytest.approx(brute_f, rel=1e-12)
  assert model.iteration_seconds(optimal)[0] == pytest.approx(optimal_f)
  heuristic, heuristic_f = gradcomp.fusion.heuristic_search(model)
  assert model.iteration_seconds(heuristic)[0] == pytest.approx(heuristic_f)
  assert optimal_f <= heuristic_f * (1 + 1e-12)
  assert heuristic_f <= model.iteration_seconds(())[0]
  assert heuristic_f <= model.iteration_seconds(tuple(range(1, n)))[0]


def test_heuristic_returns_the_better_extreme_unless_a_partition_gains_eps():
  # One worker, leaves of 2^20, 16 and 16 values: a call costs 5e-7 s and
  # fusing 1e-12 s per value (1e-6 s for the big leaf). Two groups (big leaf
  # alone) save one call over layer-wise, about 1.2e-4 of the step, and a
  # little more over one group.
  profile = synthetic_profile(call=5e-7, per_value=4e-9, fused_extra=1e-12)
  workload = gradcomp.sim.Workload((2**20, 16, 16), (0.0, 0.0, 0.0))
  model = gradcomp.sim.CostModel(profile, gradcomp.sim.Cluster(1), workload)
  assert gradcomp.fusion.heuristic_search(model, eps=0.0)[0] == (1,)
  assert gradcomp.fusion.heuristic_search(model, eps=1e-3)[0] == (1, 2)
  assert gradcomp.fusion.heuristic_search(model, eps=1e-5)[0] == (1,)


def test_heuristic_on_resnet50_is_fast_near_optimal_and_deterministic():
  import math
  import time

  from gradcomp.models import shapes

  named = shapes.resnet50_shapes()[::-1]
  flops = shapes.forward_flops("resnet50")[::-1]
  workload = gradcomp.sim.Workload.from_weights(
    [math.prod(s) for _, s in named], flops, backward_seconds=0.1
  )
  model = gradcomp.sim.CostModel(
    synthetic_profile(), gradcomp.sim.Cluster(16), workload
  )
  t0 = time.perf_counter()
  plan = gradcomp.fusion.search_plan(model, range(161))
  elapsed = time.perf_counter() - t0
  _, optimal_f = gradcomp.fusion.optimal_search(model)
  predicted = model.iteration_seconds(plan.boundaries)[0]
  assert predicted <= 1.02 * optimal_f
  assert gradcomp.fusion.search_plan(model, range(161)) == plan
  assert gradcomp.Plan.from_json(plan.to_json()) == plan
  assert elapsed < 5.0  # the 1 s target is a benchmark; this only catches blow-ups


def test_search_plan_rejects_bad_input():
  model = random_model(np.random.default_rng(0), 4)
  with pytest.raises(ValueError, match="method"):
    gradcomp.fusion.search_plan(model, range(4), "greedy")
  with pytest.raises(ValueError, match="order"):
    gradcomp.fusion.search_plan(model, range(3))
  with pytest.raises(ValueError, match="eps"):
    gradcomp.fusion.heuristic_search(model, eps=1.5)


# -- plan="auto" inside layerfusion ----------------------------------------------------


def test_auto_plan_follows_the_costs():
  sizes, order = (1000, 10, 2000, 30), (3, 2, 1, 0)
  costly_calls = synthetic_profile(call=1.0, per_value=0.0)
  lonely = gradcomp.fusion.auto_plan(
    sizes, order, costly_calls, gradcomp.sim.Cluster(8)
  )
  assert lonely == gradcomp.Plan.single(order)
  # Free calls, a slow link and a long backward: exchange each leaf as it is ready.
  overlap = synthetic_profile(call=0.0, per_value=0.0, fused_extra=1e-3)
  plan = gradcomp.fusion.auto_plan(
    sizes, order, overlap, gradcomp.sim.Cluster(8, bandwidth_gbps=0.01), 10.0
  )
  assert plan == gradcomp.Plan.layerwise(order)


def test_auto_plan_inside_jit_and_shard_map():
  tx_inner = gradcomp.topk(0.25, axis_name=harness.AXIS)
  label = spec_of(tx_inner).label()
  profile = synthetic_profile(call=1e-3, label=label)
  tx = gradcomp.layerfusion(tx_inner, profile=profile)
  params = harness.MIXED_PARAMS
  per_worker = [harness.grads_like(params, seed=w) for w in range(harness.WORKERS)]
  grads = harness.shard(jax.tree.map(lambda *xs: jnp.stack(xs), *per_worker))
  state = harness.worker_state(tx, params)
  auto_out, _ = harness.sharded_update(tx)(grads, state)
  # The same plan given explicitly gives the same result.
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
  order = tuple(range(len(sizes)))
  plan = gradcomp.fusion.auto_plan(
    sizes, order, profile, gradcomp.sim.Cluster(jax.device_count())
  )
  explicit = gradcomp.layerfusion(tx_inner, plan)
  explicit_out, _ = harness.sharded_update(explicit)(
    grads, harness.worker_state(explicit, params)
  )
  jax.tree.map(np.testing.assert_array_equal, auto_out, explicit_out)
  assert 1 < len(plan.groups) < len(sizes) or plan == gradcomp.Plan.single(order)


def test_auto_plan_measures_its_own_profile():
  tx = gradcomp.layerfusion(gradcomp.none())
  params = {"a": jnp.ones((3, 4)), "b": jnp.ones(5)}
  updates, _ = jax.jit(tx.update)(params, tx.init(params))
  jax.tree.map(np.testing.assert_array_equal, updates, params)


def test_auto_plan_rejects_a_profile_for_another_compressor():
  profile = synthetic_profile(label=spec_of(gradcomp.topk(0.1)).label())
  gradcomp.layerfusion(gradcomp.topk(0.1, axis_name="data"), profile=profile)
  with pytest.raises(ValueError, match="measured for topk"):
    gradcomp.layerfusion(gradcomp.signsgd(), profile=profile)
  with pytest.raises(ValueError, match="not built by a gradcomp factory"):
    gradcomp.layerfusion(optax.identity())
  with pytest.raises(ValueError, match="search"):
    gradcomp.layerfusion(gradcomp.topk(0.1), profile=profile, search="greedy")


# -- the command line ------------------------------------------------------------------


def test_fusion_command_line_compares_plans(tmp_path, capsys):
  from gradcomp.fusion import cli as fusion

  profile_path, plan_path = tmp_path / "topk.json", tmp_path / "plan.json"
  synthetic_profile(label=spec_of(gradcomp.topk(0.01)).label()).save(profile_path)
  argv = ["--model", "resnet20", "--compressor", "topk", "--ratio", "0.01"]
  argv += ["--workers", "16", "--profile", str(profile_path), "--out", str(plan_path)]
  assert fusion.main(argv) == 0
  out = capsys.readouterr().out
  for method in ("heuristic", "optimal", "layerwise", "single"):
    assert f"| {method} |" in out
  plan = gradcomp.Plan.from_json(plan_path.read_text())
  assert plan.num_leaves == 59
  # Leaf indices refer to the sorted-name tree; the first ready is the fc bias.
  from gradcomp.models import shapes

  names = sorted(n for n, _ in shapes.resnet20_shapes())
  assert names[plan.order[0]] == "fc/bias"
  assert names[plan.order[-1]] == "conv1/kernel"


@pytest.mark.parametrize(
  "extra, message",
  [
    (["--workers", "0"], "workers must be"),
    (["--ratio", "0.5"], "measured for topk"),
    (["--allreduce", "sharded_parameter_server", "--servers", "0"], "servers must be"),
    (
      ["--allreduce", "sharded_parameter_server", "--servers", "17", "--colocated"],
      r"servers must be in [1, workers = 16] when colocated, got 17",
    ),
    (
      ["--allreduce", "hierarchical", "--workers-per-node", "3"],
      "workers_per_node must divide workers = 16, got 3",
    ),
    (["--topology", "parameter_server", "--allreduce", "best"], "allreduce must be"),
  ],
)
def test_fusion_command_line_rejects_bad_input(tmp_path, capsys, extra, message):
  from gradcomp.fusion import cli as fusion

  path = tmp_path / "topk.json"
  synthetic_profile(label=spec_of(gradcomp.topk(0.01)).label()).save(path)
  argv = ["--model", "lstm_ptb", "--compressor", "topk", "--ratio", "0.01"]
  assert fusion.main([*argv, "--profile", str(path), *extra]) == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize(
  "extra, want",
  [
    ([], {}),  # the cluster the command line always built
    (["--allreduce", "rabenseifner"], {"allreduce": "rabenseifner"}),
    (["--allreduce", "best"], {"allreduce": "best"}),
    (
      ["--allreduce", "sharded_parameter_server", "--servers", "4", "--colocated"],
      {"allreduce": "sharded_parameter_server", "servers": 4, "colocated": True},
    ),
    (
      ["--allreduce", "hierarchical", "--workers-per-node", "4"]
      + ["--intra-bandwidth-gbps", "200", "--intra-latency-us", "1"],
      {
        "allreduce": "hierarchical",
        "workers_per_node": 4,
        "intra_bandwidth_gbps": 200.0,
        "intra_latency_us": 1.0,
      },
    ),
  ],
)
def test_fusion_command_line_builds_the_cluster(extra, want):
  from gradcomp.fusion import cli as fusion

  argv = ["--model", "resnet20", "--compressor", "topk", "--ratio", "0.01"]
  args = fusion.parse_args([*argv, "--workers", "16", *extra])
  assert fusion.cluster_of(args) == gradcomp.sim.Cluster(16, **want)


def test_fusion_command_line_prices_the_chosen_allreduce(tmp_path, capsys):
  from gradcomp.fusion import cli as fusion

  # A dense all-reduce profile (4 bytes per value, one collective per group).
  sizes = (16, 256, 4096, 65536, 2**20)
  path = tmp_path / "none.json"
  gradcomp.sim.Profile(
    compressor=spec_of(gradcomp.none()).label(),
    backend="synthetic",
    devices=1,
    sizes=sizes,
    seconds=(1e-5,) * len(sizes),
    fused_seconds=(1e-5,) * len(sizes),
    wire_bytes={"all-reduce": tuple(4 * s for s in sizes)},
    wire_messages={"all-reduce": (1,) * len(sizes)},
  ).save(path)
  argv = ["--model", "resnet20", "--compressor", "none", "--workers", "64"]
  argv += ["--profile", str(path), "--out", str(tmp_path / "plan.json")]

  def layerwise_comm_ms(extra):
    assert fusion.main([*argv, *extra]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| layerwise |"))
    return out, float(row.split("|")[6])

  out, ring = layerwise_comm_ms([])
  assert "(all-reduce: ring, 25 us)" in out
  out, best = layerwise_comm_ms(["--allreduce", "best"])
  assert "(all-reduce: best, 25 us)" in out
  # 64 workers, a power of two: halving/doubling has the ring's bytes and
  # 2 lg 64 = 12 latencies per all-reduce against 2 * 63 = 126; 59 tensors.
  assert ring - best == pytest.approx(59 * (126 - 12) * 25e-3, abs=0.02)  # .2f


def test_profiles_record_the_workers_their_wire_was_traced_on():
  """A scatter form's bytes depend on the workers: 8 and 2 give other
  profiles, each saying which; a profile saved without the field loads as 2."""
  tx = gradcomp.ef_signsgd(exchange="scatter")
  two = gradcomp.fusion.profile(tx, (4096,), repeats=1)
  eight = gradcomp.fusion.profile(tx, (4096,), repeats=1, workers=8)
  assert (two.workers, eight.workers) == (2, 8)
  assert two.wire_bytes != eight.wire_bytes
  old = json.loads(two.to_json())
  del old["workers"]
  assert gradcomp.sim.Profile.from_json(json.dumps(old)) == two
  with pytest.raises(ValueError, match="workers must be an integer >= 1"):
    gradcomp.fusion.profile(tx, (64,), repeats=1, workers=0)
