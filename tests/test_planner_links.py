"""The planner on two link classes: ``@fast`` / ``@slow`` wire keys and hierarchical's profile.

``Profile.hierarchical`` lifts a compressor's profile into that of
``gradcomp.hierarchical(inner, "local")`` (DESIGN §7); ``Cluster.link_seconds``
prices its reduce-scatter and all-gather inside a node and its inner exchange
across the nodes. Checked against closed forms, and against the collectives of
the real hierarchical program traced on an abstract mesh (no devices, no
compiles): hand-made times, traced wire.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.fusion import profiling
from gradcomp.fusion.hierarchical import hierarchical_spec_of
from gradcomp.parallel.traced import traced_axis_wire, traced_wire
from gradcomp.parallel.wire import Collective
from gradcomp.sim.profile import label_of
from gradcomp.sim.timeline import CostModel, Workload

NODES, G = 16, 8  # a two-tier cluster: 16 nodes of 8 devices
RATIO = 0.01
SIZES = (16, 256, 4096, 65536, 2**20)
#: 25 Gbit/s and 25 us between nodes, 900 GB/s and 5 us inside one.
LINKS = dict(
  bandwidth_gbps=25.0,
  latency_us=25.0,
  intra_bandwidth_gbps=7200.0,
  intra_latency_us=5.0,
)
TOPK = "topk(error_feedback=True, ratio=0.01)"


def cluster(nodes=NODES, g=G, **kw):
  return gradcomp.sim.Cluster(nodes * g, workers_per_node=g, **{**LINKS, **kw})


def traced_profile(workers, sizes=SIZES, ratio=RATIO):
  """Top-k's profile: made-up times (0.2 ms + 4 ns per value), its traced wire."""
  wire = [
    traced_wire(lambda a: gradcomp.topk(ratio, axis_name=a), s, workers) for s in sizes
  ]
  return gradcomp.sim.Profile(
    compressor=label_of(gradcomp.topk(ratio)),
    backend="made up",
    devices=1,
    sizes=sizes,
    seconds=tuple(2e-4 + 4e-9 * s for s in sizes),
    fused_seconds=tuple(3e-4 + 5e-9 * s for s in sizes),
    wire_bytes={"all-gather": tuple(w["all-gather"][0] for w in wire)},
    wire_messages={"all-gather": tuple(w["all-gather"][1] for w in wire)},
    workers=workers,
  )


INNER = traced_profile(NODES)


def ring(kind, m, nbytes, messages, gbps, latency_us):
  """The alpha-beta price of a ring of ``m``, written out per kind."""
  alpha, beta = latency_us * 1e-6, 8.0 / (gbps * 1e9)
  steps, volume = {
    "all-reduce": (2 * (m - 1), 2 * (m - 1) / m),
    "all-gather": (m - 1, m - 1),
    "reduce-scatter": (m - 1, (m - 1) / m),
    "all-to-all": (m - 1, (m - 1) / m),
    "collective-permute": (1, 1),
  }[kind]
  return messages * steps * alpha + volume * nbytes * beta


# -- the lifted profile ------------------------------------------------------------


@pytest.mark.parametrize(
  "scatter_dtype, scatter_bytes, gather",
  [(None, 4, True), ("bfloat16", 2, True), (jnp.float16, 2, False)],
)
def test_lifted_wire_and_comp_against_the_closed_form(
  scatter_dtype, scatter_bytes, gather
):
  p = INNER.hierarchical(G, scatter_dtype=scatter_dtype, gather=gather)
  dtype = None if scatter_dtype is None else jnp.dtype(scatter_dtype).name
  assert p.compressor == (
    f"hierarchical({TOPK}, g={G}, scatter_dtype={dtype!r}, gather={gather})"
  )
  assert p.sizes == tuple(G * s for s in SIZES)
  assert (p.workers, p.workers_per_node) == (NODES * G, G)
  want_keys = {"all-gather@slow", "reduce-scatter@fast"} | (
    {"all-gather@fast"} if gather else set()
  )
  assert set(p.wire_bytes) == set(p.wire_messages) == want_keys
  # Multiples of g, on the grid and between it: shards of c = x / g values.
  for x in (*p.sizes, G * 100, G * 1000, G * 3000, G * 10**6, G * 2**21):
    c = x // G
    wire = p.wire(x)
    nbytes, messages = wire["all-gather@slow"]
    inner_bytes, inner_messages = INNER.wire(c)["all-gather"]
    assert float(nbytes) == pytest.approx(float(inner_bytes), rel=1e-12)
    assert int(messages) == int(inner_messages) == 2
    assert float(wire["reduce-scatter@fast"][0]) == pytest.approx(G * c * scatter_bytes)
    assert int(wire["reduce-scatter@fast"][1]) == 1
    if gather:
      assert float(wire["all-gather@fast"][0]) == pytest.approx(4 * c)
      assert int(wire["all-gather@fast"][1]) == 1
    for fused in (False, True):
      assert float(p.comp_seconds(x, fused)) == pytest.approx(
        float(INNER.comp_seconds(c, fused)), rel=1e-12
      )
  # Elsewhere the curves are inner's at x / g: short of the padding to g c
  # values (under g), e.g. under 4 g bytes of the reduce-scatter's.
  for x in (G * 1000 + 3, G * 5000 + 7, 123_457):
    c = math.ceil(x / G)
    wire = p.wire(x)
    scatter = float(wire["reduce-scatter@fast"][0])
    assert G * c * scatter_bytes - G * scatter_bytes < scatter <= G * c * scatter_bytes
    assert scatter == pytest.approx(x * scatter_bytes)
    assert float(wire["all-gather@slow"][0]) == pytest.approx(
      float(INNER.wire(x / G)["all-gather"][0]), rel=1e-12
    )
    if gather:
      assert 4 * (c - 1) < float(wire["all-gather@fast"][0]) <= 4 * c


def test_lifted_profile_json_round_trip_and_old_json_loads():
  p = INNER.hierarchical(G, scatter_dtype="bfloat16")
  assert gradcomp.sim.Profile.from_json(p.to_json()) == p
  old = json.loads(INNER.to_json())
  del old["workers_per_node"]  # saved before the field existed: flat
  assert gradcomp.sim.Profile.from_json(json.dumps(old)) == INNER
  assert INNER.workers_per_node == 1


def test_hierarchical_spec_and_labels():
  inner = gradcomp.topk(RATIO, axis_name="node")
  tx = gradcomp.hierarchical(inner, "local", scatter_dtype=jnp.bfloat16)
  spec = hierarchical_spec_of(tx)
  assert spec.inner is inner and spec.fast_axis == "local" and spec.gather
  assert spec.scatter_dtype == jnp.dtype(jnp.bfloat16)
  assert hierarchical_spec_of(inner) is None
  assert (
    hierarchical_spec_of(
      gradcomp.hierarchical(inner, "local", scatter_dtype="float32")
    ).scatter_dtype
    is None
  )
  lifted = INNER.hierarchical(G, scatter_dtype="bfloat16")
  assert label_of(tx, G) == lifted.compressor
  lifted.check_for(tx)  # g is the profile's own workers_per_node
  with pytest.raises(ValueError, match="measured for"):
    INNER.hierarchical(G).check_for(tx)  # float32 scatter, not bfloat16
  with pytest.raises(ValueError, match="measured for"):
    INNER.check_for(tx)


# -- pricing the link classes ------------------------------------------------------


def test_link_keys_priced_as_rings_on_their_links():
  c = cluster(nodes=4, g=8)
  fast = (7200.0, 5.0)
  slow = (25.0, 25.0)
  for kind in (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
  ):
    for nbytes, messages in ((1e6, 1), (3e5, 2)):
      got = c.comm_seconds({f"{kind}@fast": (nbytes, messages)})
      assert float(got) == pytest.approx(
        ring(kind, 8, nbytes, messages, *fast), rel=1e-12
      )
      got = c.comm_seconds({f"{kind}@slow": (nbytes, messages)})
      assert float(got) == pytest.approx(
        ring(kind, 4, nbytes, messages, *slow), rel=1e-12
      )
  # By hand: 1 MB reduce-scattered in nodes of 8 (7 x 5 us + 7/8 MB at 900
  # GB/s), 80 kB all-gathered across 4 nodes in two messages (2 x 3 x 25 us
  # + 3 x 80 kB at 25 Gbit/s), a plain all-reduce over all 32 on the ring.
  wire = {
    "reduce-scatter@fast": (1e6, 1),
    "all-gather@slow": (8e4, 2),
    "all-reduce": (4e5, 1),
  }
  want = (7 * 5e-6 + 0.875e6 / 900e9) + (6 * 25e-6 + 2.4e5 / 3.125e9)
  want += 2 * 31 * 25e-6 + 2 * 31 / 32 * 4e5 / 3.125e9
  assert float(c.comm_seconds(wire)) == pytest.approx(want, rel=1e-12)
  # Arrays broadcast, as CostModel's table of groups needs.
  got = c.comm_seconds({"all-gather@slow": (np.array([1e3, 1e6]), np.array([1, 2]))})
  np.testing.assert_allclose(
    got, [ring("all-gather", 4, b, m, *slow) for b, m in ((1e3, 1), (1e6, 2))]
  )


def test_link_keys_price_like_axis_seconds():
  """One helper prices both: a record on ``local`` is an ``@fast`` key."""
  c = cluster(nodes=4, g=8)
  for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
    group = 2 if kind == "collective-permute" else 8
    fast = c.axis_seconds([Collective(kind, 12345, group, ("local",))], ("local",))
    assert fast == pytest.approx(
      float(c.link_seconds(f"{kind}@fast", 12345)), rel=1e-15
    )
    group = 2 if kind == "collective-permute" else 4
    slow = c.axis_seconds([Collective(kind, 12345, group, ("node",))], ("local",))
    assert slow == pytest.approx(
      float(c.link_seconds(f"{kind}@slow", 12345)), rel=1e-15
    )


# -- refusals ----------------------------------------------------------------------


@pytest.mark.parametrize(
  "key, message",
  [
    (
      "all-gather@medium",
      "unknown link class 'medium' in wire key 'all-gather@medium'",
    ),
    ("broadcast@fast", "unknown collective kind 'broadcast'"),
    ("broadcast", "unknown collective kind 'broadcast'"),
  ],
)
def test_bad_wire_keys_raise(key, message):
  fields = {
    **INNER.__dict__,
    "wire_bytes": {key: (0,) * 5},
    "wire_messages": {key: (1,) * 5},
  }
  with pytest.raises(ValueError, match=message):
    gradcomp.sim.Profile(**fields)
  with pytest.raises(ValueError, match=message.split(" in ")[0]):
    cluster().comm_seconds({key: (1.0, 1)})


def test_link_keys_need_nodes():
  lifted = INNER.hierarchical(G)
  with pytest.raises(
    ValueError, match="need workers_per_node > 1 dividing workers = 128"
  ):
    gradcomp.sim.Profile(**{**lifted.__dict__, "workers_per_node": 1})
  with pytest.raises(
    ValueError, match="need workers_per_node > 1 dividing workers = 128"
  ):
    gradcomp.sim.Profile(**{**lifted.__dict__, "workers_per_node": 3})
  with pytest.raises(ValueError, match="workers_per_node must be an integer >= 1"):
    gradcomp.sim.Profile(**{**INNER.__dict__, "workers_per_node": 0})
  flat = gradcomp.sim.Cluster(128, **LINKS)
  with pytest.raises(
    ValueError, match=r"workers_per_node=1 .*profile was made for nodes"
  ):
    flat.comm_seconds(lifted.wire(2**20))
  odd = gradcomp.sim.Cluster(128, workers_per_node=3)
  with pytest.raises(ValueError, match="workers_per_node=3 for 128 workers"):
    odd.comm_seconds({"all-gather@slow": (1.0, 1)})


def test_check_cluster_refuses_other_nodes():
  lifted = INNER.hierarchical(G)
  lifted.check_cluster(cluster())
  for other in (cluster(nodes=8), cluster(nodes=32, g=4), gradcomp.sim.Cluster(128)):
    with pytest.raises(ValueError, match="made for 128 workers in nodes of 8"):
      lifted.check_cluster(other)
  INNER.check_cluster(gradcomp.sim.Cluster(3))  # a flat profile fits any cluster


def test_lifting_refuses_bad_arguments():
  for g in (1, 0, True, 2.0):
    with pytest.raises(
      ValueError, match="g .devices per node. must be an integer >= 2"
    ):
      INNER.hierarchical(g)
  with pytest.raises(ValueError, match="scatter_dtype must be"):
    INNER.hierarchical(G, scatter_dtype="float64")
  with pytest.raises(ValueError, match="gather must be True or False"):
    INNER.hierarchical(G, gather=1)
  with pytest.raises(ValueError, match="lift a flat profile"):
    INNER.hierarchical(G).hierarchical(2)


@pytest.mark.parametrize(
  "workers, per_node", [(128, 1), (12, 8), (128, 0), (128, True)]
)
def test_profile_for_hierarchical_needs_nodes_dividing_workers(workers, per_node):
  tx = gradcomp.hierarchical(gradcomp.topk(RATIO, axis_name="node"), "local")
  with pytest.raises(
    ValueError, match=r"workers_per_node must be an integer > 1 dividing workers"
  ):
    profiling.profile_for(tx, workers=workers, workers_per_node=per_node)


def test_profile_for_lifts_the_inner_profile():
  """Measured at one small size: the inner on the nodes, lifted; a flat tx
  takes and ignores ``workers_per_node``."""
  inner = gradcomp.signsgd(axis_name="node")
  tx = gradcomp.hierarchical(inner, "local", gather=False)
  got = profiling.profile_for(
    tx, (64, 4096), up_to=8 * 64, workers=32, workers_per_node=8
  )
  measured = profiling.profile_for(inner, (64,), workers=4)
  assert got == measured.hierarchical(8, gather=False)
  assert profiling.profile_for(inner, (64,), workers=4, workers_per_node=8) is measured


# -- planning ----------------------------------------------------------------------

#: Leaves of a small transformer-like model, in gradient-ready order.
READY = (768, 2**20, 3 * 2**18, 768, 2**20, 3 * 2**18, 768, 50257 * 96)


def test_hierarchical_plan_beats_the_flat_one_on_a_two_tier_cluster():
  c = cluster()
  flat = traced_profile(NODES * G)  # top-k's all-gather over all 128 workers
  lifted = INNER.hierarchical(G)
  order = tuple(range(len(READY)))[::-1]
  sizes = READY[::-1]  # tree order: order[i] is ready i-th
  workload = Workload.from_weights(READY, READY, 0.05, forward_seconds=0.0)
  best = {}
  for name, p in (("flat", flat), ("hierarchical", lifted)):
    plan = gradcomp.fusion.auto_plan(sizes, order, p, c, backward_seconds=0.05)
    best[name] = float(CostModel(p, c, workload).iteration_seconds(plan.boundaries)[0])
  assert best["hierarchical"] < best["flat"]
  # One group of 2^19 values (a traced size): shards of 65,536, top-k keeps
  # 655 of each, 8 bytes apiece in two all-gathers across the 16 nodes.
  x = G * 65536
  k = 655
  wire = lifted.wire(x)
  slow = sum(
    float(c.link_seconds(key, *wire[key])) for key in wire if key.endswith("@slow")
  )
  assert slow == pytest.approx(
    2 * (NODES - 1) * 25e-6 + (NODES - 1) * 8 * k * 8 / 25e9, rel=1e-12
  )
  fast = float(c.comm_seconds(wire)) - slow
  assert fast == pytest.approx(
    2 * (G - 1) * 5e-6 + (7 / 8 * 4 * x + 7 * 4 * x / G) * 8 / 7200e9, rel=1e-12
  )


# -- the model against the program's own collectives ---------------------------------


@pytest.mark.parametrize(
  "scatter_dtype, gather", [(None, True), (jnp.bfloat16, True), (None, False)]
)
@pytest.mark.parametrize("nodes, shard", [(4, 4096), (16, 65536)])
def test_lifted_comm_equals_the_traced_hierarchical_program(
  nodes, shard, scatter_dtype, gather
):
  """Comm of one group = axis_seconds of ``hierarchical(topk, "local")``'s records."""
  c = cluster(nodes=nodes)
  lifted = traced_profile(nodes).hierarchical(
    G, scatter_dtype=scatter_dtype, gather=gather
  )
  tx = gradcomp.hierarchical(
    gradcomp.topk(RATIO, axis_name="node"),
    "local",
    scatter_dtype=scatter_dtype,
    gather=gather,
  )
  mesh = AbstractMesh((nodes, G), ("node", "local"))
  spec = P(("node", "local"))

  def step(x):
    x = x[0]
    return tx.update(x, tx.init(jax.ShapeDtypeStruct(x.shape, x.dtype)))[0][None]

  f = jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec)
  arg = jax.ShapeDtypeStruct(
    (nodes * G, G * shard), jnp.float32, sharding=NamedSharding(mesh, spec)
  )
  records = traced_axis_wire(f, arg, mesh=mesh)
  kinds = sorted((r.kind, r.axes) for r in records)
  want = [("all-gather", ("node",))] * 2 + [("reduce-scatter", ("local",))]
  assert kinds == sorted(want + ([("all-gather", ("local",))] if gather else []))
  program = c.axis_seconds(records, fast_axes=("local",))
  assert float(c.comm_seconds(lifted.wire(G * shard))) == pytest.approx(
    program, rel=1e-12
  )


def test_profile_refuses_a_hierarchical_transformation():
  tx = gradcomp.hierarchical(gradcomp.topk(RATIO, axis_name="node"), "local")
  with pytest.raises(ValueError, match="use profile_for"):
    profiling.profile(tx, (64,), repeats=1)


# -- the command line --------------------------------------------------------------

ARGV = ["--model", "resnet20", "--compressor", "topk", "--ratio", "0.01"]
ARGV += ["--workers", "128", "--workers-per-node", "8", "--bandwidth-gbps", "25"]
ARGV += ["--intra-bandwidth-gbps", "7200"]


def test_command_line_plans_a_hierarchical_exchange(tmp_path, capsys):
  from gradcomp.fusion import cli

  path = tmp_path / "hier.json"
  INNER.hierarchical(G, scatter_dtype="bfloat16").save(path)
  argv = [*ARGV, "--profile", str(path), "--out", str(tmp_path / "plan.json")]
  assert cli.main([*argv, "--hierarchical", "--scatter-dtype", "bfloat16"]) == 0
  out = capsys.readouterr().out
  assert f"hierarchical({TOPK}, g=8, scatter_dtype='bfloat16', gather=True)" in out
  assert "| heuristic |" in out


@pytest.mark.parametrize(
  "extra, message",
  [
    (
      ["--hierarchical", "--workers-per-node", "1"],
      "--hierarchical needs --workers-per-node > 1",
    ),
    (["--hierarchical"], "measured for hierarchical"),  # a float32 scatter's profile
    (
      ["--hierarchical", "--scatter-dtype", "bfloat16", "--workers", "64"],
      "made for 128 workers",
    ),
    (["--scatter-dtype", "float16"], "--scatter-dtype goes with --hierarchical"),
  ],
)
def test_command_line_refuses_bad_hierarchical_flags(tmp_path, capsys, extra, message):
  from gradcomp.fusion import cli

  path = tmp_path / "hier.json"
  INNER.hierarchical(G, scatter_dtype="bfloat16").save(path)
  argv = [*ARGV, "--profile", str(path), "--out", str(tmp_path / "plan.json")]
  assert cli.main([*argv, *extra]) == 2
  assert message in capsys.readouterr().err
