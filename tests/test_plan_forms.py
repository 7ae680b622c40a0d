"""LayerFusion choosing each group's exchange form, gather or scatter (DESIGN §7)."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

import gradcomp
from gradcomp.fusion import search as fusion_search
from gradcomp.fusion.layerfusion import in_forms, layerfusion
from gradcomp.fusion.plan import Plan
from gradcomp.sim import Cluster, CostModel, Profile, Workload
from gradcomp.sim.profile import label_of

import harness

SIZES = (16, 4096)


def _profile(label, seconds, wire_bytes, wire_messages):
  return Profile(
    compressor=label,
    backend="hand-made",
    devices=1,
    sizes=SIZES,
    seconds=seconds,
    fused_seconds=tuple(1.2 * s for s in seconds),
    wire_bytes=wire_bytes,
    wire_messages=wire_messages,
    workers=8,
  )


def _codec_profiles(inner):
  """One byte per value, gathered to 7 peers or scattered (all-to-all + 1/8 gathered)."""
  build = in_forms(inner)
  gather = _profile(
    label_of(build("gather")),
    (1e-5, 2e-5),
    {"all-gather": SIZES},
    {"all-gather": (1, 1)},
  )
  scatter = _profile(
    label_of(build("scatter")),
    (1.5e-5, 3e-5),
    {"all-to-all": SIZES, "all-gather": tuple(s / 8 for s in SIZES)},
    {"all-to-all": (1, 1), "all-gather": (1, 1)},
  )
  return {"gather": gather, "scatter": scatter}


def test_plan_forms_round_trip_and_errors():
  plan = Plan.from_boundaries((1, 0, 2), (1,)).with_forms(["scatter", "gather"])
  assert plan.forms == ("scatter", "gather")
  assert Plan.from_json(plan.to_json()) == plan
  assert plan.with_forms(None).forms is None
  assert "forms" not in plan.with_forms(None).to_json()
  with pytest.raises(ValueError, match="one exchange form per group"):
    plan.with_forms(("gather",))
  with pytest.raises(ValueError, match=r"forms\[1\] must be one of"):
    plan.with_forms(("gather", "ring"))


def test_cost_model_picks_the_best_form_per_group_exactly_without_overlap():
  """Without overlap ``T`` is a sum over groups, so the per-group choice is the
  optimum over every partition *and* every assignment of forms: checked
  against all of them, priced from the profiles and the cluster directly."""
  inner = gradcomp.int_quantize(8, 16, axis_name="data")
  # Compression 10x slower, fusing 3x dearer per value than one leaf alone:
  # so fusing does not always pay, and the optimum mixes the forms.
  profiles = {
    form: dataclasses.replace(
      p,
      seconds=tuple(10 * t for t in p.seconds),
      fused_seconds=tuple(30 * t for t in p.seconds),
    )
    for form, p in _codec_profiles(inner).items()
  }
  cluster = Cluster(64, bandwidth_gbps=10.0, latency_us=2.0, overlap=False)
  rng = np.random.default_rng(0)
  sizes = tuple(int(s) for s in rng.integers(100, 8000, 6))
  work = Workload(sizes, tuple(rng.uniform(1e-5, 1e-4, 6)), 3e-5, 1e-5)
  model = CostModel(profiles, cluster, work)

  def group_seconds(profile, leaves):
    size = sum(sizes[i] for i in leaves)
    comp = profile.comp_seconds(size, fused=len(leaves) > 1)
    return float(comp + cluster.comm_seconds(profile.wire(size)))

  n, best = len(sizes), np.inf
  fixed = work.forward_seconds + sum(work.backward_seconds) + work.update_seconds
  for y in range(n):
    for cuts in itertools.combinations(range(1, n), y):
      edges = (0, *cuts, n)
      groups = [range(a, b) for a, b in itertools.pairwise(edges)]
      for forms in itertools.product(profiles, repeat=len(groups)):
        t = fixed + sum(
          group_seconds(profiles[f], g) for f, g in zip(forms, groups, strict=True)
        )
        best = min(best, t)
  boundaries, seconds = fusion_search.optimal_search(model)
  np.testing.assert_allclose(seconds, best, rtol=1e-12)
  forms = model.group_forms(boundaries)
  assert set(forms) == {"gather", "scatter"}
  for p in profiles.values():  # better than either form throughout
    assert seconds < fusion_search.optimal_search(CostModel(p, cluster, work))[1]
  timeline = model.timeline(boundaries)
  assert timeline.forms == forms
  np.testing.assert_allclose(timeline.iteration_seconds, best, rtol=1e-12)
  plan = fusion_search.search_plan(model, range(n), "optimal")
  assert plan.forms == forms and plan.boundaries == boundaries


def test_with_overlap_the_searches_weigh_what_each_form_hides():
  """With overlap a form's extra Comp delays the backward while its smaller
  Comm may hide: the DP over partitions and forms equals every partition
  and assignment timed by the model, and the heuristic is never slower
  than one form throughout."""
  inner = gradcomp.int_quantize(8, 16, axis_name="data")
  profiles = _codec_profiles(inner)
  cluster = Cluster(16, bandwidth_gbps=10.0, latency_us=2.0)
  rng = np.random.default_rng(1)
  n = 6
  sizes = tuple(int(s) for s in rng.integers(100, 8000, n))
  work = Workload(sizes, tuple(rng.uniform(1e-5, 3e-4, n)), 3e-5, 1e-5)
  model = CostModel(profiles, cluster, work)
  best = np.inf
  for y in range(n):
    for cuts in itertools.combinations(range(1, n), y):
      assignments = np.array(list(itertools.product(range(2), repeat=y + 1)))
      rows = np.broadcast_to(np.array(cuts, np.int64), (len(assignments), y))
      best = min(best, float(model.iteration_seconds(rows, assignments).min()))
  plan = fusion_search.search_plan(model, range(n), "optimal")
  np.testing.assert_allclose(model.timeline(plan).iteration_seconds, best, rtol=1e-12)
  np.testing.assert_allclose(fusion_search.optimal_search(model)[1], best, rtol=1e-12)
  heuristic = model.timeline(
    fusion_search.search_plan(model, range(n))
  ).iteration_seconds
  for p in profiles.values():
    alone = CostModel(p, cluster, work)
    assert heuristic <= fusion_search.heuristic_search(alone)[1] * (1 + 1e-12)
  for b in [(), tuple(range(1, n))]:
    forms, seconds = model.best_forms(b)
    assert seconds <= model.iteration_seconds(b)[0] * (1 + 1e-12)
    assert (
      seconds
      == model.timeline(
        Plan.from_boundaries(range(n), b).with_forms(forms)
      ).iteration_seconds
    )


def test_small_groups_gather_and_large_groups_scatter():
  """The closed form's crossing: scatter pays 7 more latencies and saves 5.25
  bytes' time per value on 8 workers, so groups above ``7 alpha / (5.25
  beta)`` values scatter (Comp differs too, by 5e-6 s over the sizes here)."""
  inner = gradcomp.int_quantize(8, 16, axis_name="data")
  cluster = Cluster(8, bandwidth_gbps=8.0, latency_us=1.0)  # beta = 1 ns per byte
  work = Workload((16, 4096), (0.0, 0.0))
  model = CostModel(_codec_profiles(inner), cluster, work)
  assert model.group_forms((1,)) == ("gather", "scatter")
  assert model.group_forms(()) == ("scatter",)


def test_a_plan_with_forms_sends_each_group_through_its_form():
  """Each group's output is what its form's compressor makes of that buffer
  alone; the state holds one inner state per form."""
  inner = gradcomp.int_quantize(8, 16, axis_name=harness.AXIS)
  shapes = {"a": (40,), "b": (3, 8), "c": (100,)}
  params = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()}
  # Tree order a, b, c: a alone gathers, b and c fused scatter.
  plan = Plan(((0,), (1, 2)), 3, ("gather", "scatter"))
  tx = layerfusion(inner, plan)
  state = harness.worker_state(tx, params)
  assert set(state.inner) == {"gather", "scatter"}
  grads = harness.shard(harness.random_grads(shapes, seed=3))
  out, _ = harness.sharded_update(tx)(grads, state)

  build = in_forms(inner)
  alone = {"a": grads["a"]}
  want_a, _ = harness.sharded_update(build("gather"))(
    alone, harness.worker_state(build("gather"), {"a": params["a"]})
  )
  fused = harness.shard(
    {"bc": np.concatenate([np.reshape(grads["b"], (8, -1)), grads["c"]], axis=1)}
  )
  scattered = build("scatter")
  want_bc, _ = harness.sharded_update(scattered)(
    fused, harness.worker_state(scattered, {"bc": np.zeros(124, np.float32)})
  )
  np.testing.assert_array_equal(out["a"], want_a["a"])
  got_bc = np.concatenate([np.asarray(out["b"]).reshape(8, -1), out["c"]], axis=1)
  np.testing.assert_array_equal(got_bc, want_bc["bc"])


def test_exchange_auto_plans_with_both_profiles():
  inner = gradcomp.int_quantize(8, 16, axis_name="data")
  profiles = _codec_profiles(inner)
  cluster = Cluster(8, bandwidth_gbps=8.0, latency_us=1.0)
  params = {"big": jax.ShapeDtypeStruct((4096,), np.float32)}
  tx = layerfusion(inner, exchange="auto", profile=profiles, cluster=cluster)
  assert set(tx.init(params).inner) == {"scatter"}
  # A compressor with a seed gives its other form a stream of its own.
  seeded = gradcomp.fixed_point(8, seed=5, axis_name="data", exchange="scatter")
  other = gradcomp.compressors.spec.spec_of(in_forms(seeded)("gather"))
  assert dict(other.arguments)["seed"] == 6
  assert in_forms(seeded)("scatter") is seeded


def test_exchange_auto_errors():
  inner = gradcomp.int_quantize(8, 16, axis_name="data")
  profiles = _codec_profiles(inner)
  with pytest.raises(ValueError, match="exchange= keyword"):
    layerfusion(gradcomp.topk(0.1), exchange="auto", profile=profiles)
  with pytest.raises(ValueError, match='needs plan="auto"'):
    layerfusion(inner, "single", exchange="auto")
  with pytest.raises(ValueError, match="must map each form"):
    layerfusion(inner, exchange="auto", profile=profiles["gather"])
  with pytest.raises(ValueError, match="measured for"):
    swapped = {"gather": profiles["scatter"], "scatter": profiles["gather"]}
    layerfusion(inner, exchange="auto", profile=swapped)
  with pytest.raises(ValueError, match='exchange must be None or "auto"'):
    layerfusion(inner, exchange="scatter")
  with pytest.raises(ValueError, match="exchange forms"):
    bad = dataclasses.replace(Plan.single((0,)), forms=("scatter",))
    layerfusion(gradcomp.topk(0.1), bad)


def test_the_program_plans_forms_with_config_fusion_exchange(monkeypatch):
  """``config.fusion.exchange="auto"``: the run's plan carries each group's
  form, priced from both forms' profiles on the run's cluster."""
  import ml_collections

  from train import optimizer as optimizer_lib

  inner = gradcomp.int_quantize(8, 16, axis_name="data")
  profiles = _codec_profiles(inner)
  by_label = {p.compressor: p for p in profiles.values()}
  monkeypatch.setattr(
    gradcomp.fusion, "profile_for", lambda tx, **_: by_label[label_of(tx)]
  )
  cfg = ml_collections.ConfigDict(
    {"plan": "auto", "search": "optimal", "exchange": "auto"}
  )
  cluster = Cluster(8, bandwidth_gbps=8.0, latency_us=1.0)
  sizes, order = (4096, 16), (1, 0)
  plan = optimizer_lib.fusion_plan(cfg, order, sizes, inner, cluster=cluster)
  want = fusion_search.search_plan(
    CostModel(profiles, cluster, Workload((16, 4096), (0.0, 0.0))), order, "optimal"
  )
  assert plan == want and plan.forms is not None
  cfg.exchange = "inner"
  assert (
    optimizer_lib.fusion_plan(cfg, order, sizes, inner, cluster=cluster).forms is None
  )
  cfg.plan = "single"
  cfg.exchange = "auto"
  with pytest.raises(ValueError, match="needs config.fusion.plan='auto'"):
    optimizer_lib.fusion_plan(cfg, order, sizes, inner, cluster=cluster)
  cfg.exchange = "scatter"
  with pytest.raises(ValueError, match="config.fusion.exchange must be one of"):
    optimizer_lib.fusion_plan(cfg, order, sizes, inner, cluster=cluster)


def test_the_command_line_plans_forms(monkeypatch, tmp_path, capsys):
  from gradcomp.fusion import cli

  inner = gradcomp.int_quantize(8, 16)
  by_label = {p.compressor: p for p in _codec_profiles(inner).values()}
  monkeypatch.setattr(cli, "profile", lambda tx, *_, **__: by_label[label_of(tx)])
  out = tmp_path / "plan.json"
  argv = ["--model", "resnet20", "--compressor", "int_quantize", "--set", "bits=8"]
  argv += ["--set", "block_size=16", "--workers", "64", "--exchange", "auto"]
  assert cli.main([*argv, "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "| scattered |" in printed and "every group in the scatter form" in printed
  assert Plan.from_json(out.read_text()).forms is not None
  assert cli.main([*argv, "--profile", str(out)]) == 2
  assert "--exchange auto measures both" in capsys.readouterr().err
