"""Wire bytes per mesh axis (DESIGN §7): each collective labelled with its axes.

One program on a (2 x 4) mesh ``("node", "local")`` holds one collective of
each kind over known axes; its records are checked against closed forms of
the operand bytes, the group sizes and the ring link bytes the cost model
assumes, and the two-link-class pricing against its formula.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel import wire

# One worker runs the module: its tests share the module's compiled program
# (``records``), built once.
pytestmark = pytest.mark.xdist_group("axis_wire")

MESH = jax.make_mesh((2, 4), ("node", "local"))
SPEC = P(("node", "local"))
D = 64  # floats per device


def _program(x):
  a = jax.lax.psum(x, "local")
  b = jax.lax.all_gather(x[:8], "node", tiled=True)
  c = jax.lax.psum_scatter(x, "local", tiled=True)
  d = jax.lax.psum(x[:16], ("node", "local"))
  e = jax.lax.all_to_all(x[:32], "node", 0, 0, tiled=True)
  f = jax.lax.ppermute(x[:4], "node", [(0, 1), (1, 0)])
  return (a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum())[None]


@pytest.fixture(scope="module")
def records():
  f = jax.shard_map(_program, mesh=MESH, in_specs=SPEC, out_specs=SPEC)
  x = jax.ShapeDtypeStruct((8 * D,), jnp.float32, sharding=NamedSharding(MESH, SPEC))
  text = jax.jit(f).lower(x).compile().as_text()
  return text, wire.collectives(text, MESH)


def test_each_collective_has_its_axes_group_and_bytes(records):
  _, got = records
  found = {(r.kind, r.axes): r for r in got}
  want = {  # (kind, axes): (operand bytes, group, link factor)
    ("all-reduce", ("local",)): (4 * D, 4, 2 * 3 / 4),
    ("all-gather", ("node",)): (4 * 8, 2, 1.0),
    ("reduce-scatter", ("local",)): (4 * D, 4, 3 / 4),
    ("all-reduce", ("node", "local")): (4 * 16, 8, 2 * 7 / 8),
    ("all-to-all", ("node",)): (4 * 32, 2, 1 / 2),
    ("collective-permute", ("node",)): (4 * 4, 2, 1.0),
  }
  assert set(found) == set(want), sorted(found)
  for key, (nbytes, group, factor) in want.items():
    r = found[key]
    assert (r.operand_bytes, r.group) == (nbytes, group), (key, r)
    assert r.link_bytes == nbytes * factor


def test_records_add_up_to_collective_bytes_and_split_by_axes(records):
  text, got = records
  totals = wire.collective_bytes(text)
  for kind in wire.COLLECTIVES:
    assert sum(r.operand_bytes for r in got if r.kind == kind) == totals[kind]
  by_axes = wire.bytes_by_axes(got)
  assert by_axes[("node",)]["operand"] == 4 * (8 + 32 + 4)
  assert by_axes[("local",)]["link"] == 4 * D * (1.5 + 0.75)
  assert all(r.axes is None for r in wire.collectives(text))  # No mesh, no labels.


def test_iota_replica_groups_are_read():
  line = "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}"
  groups = wire._groups(line)
  assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert wire._axes_of(groups, MESH) == ("node",)
  assert wire._axes_of(wire._groups("replica_groups=[2,4]<=[8]"), MESH) == ("local",)
  assert wire._axes_of([[0, 1, 4, 5], [2, 3, 6, 7]], MESH) is None  # Half an axis.


def test_two_link_classes_price_each_axis_on_its_own(records):
  _, got = records
  cluster = gradcomp.sim.Cluster(
    8,
    bandwidth_gbps=10.0,
    latency_us=30.0,
    intra_bandwidth_gbps=1000.0,
    intra_latency_us=2.0,
  )
  steps = {"all-reduce": lambda g: 2 * (g - 1), "collective-permute": lambda g: 1}

  def seconds(r, gbps, us):
    hops = steps.get(r.kind, lambda g: g - 1)(r.group)
    return hops * us * 1e-6 + r.link_bytes * 8 / (gbps * 1e9)

  want = sum(
    seconds(r, 1000.0, 2.0) if r.axes == ("local",) else seconds(r, 10.0, 30.0)
    for r in got
  )
  assert cluster.axis_seconds(got, fast_axes=("local",)) == pytest.approx(want)
  slow = sum(seconds(r, 10.0, 30.0) for r in got)
  assert cluster.axis_seconds(got) == pytest.approx(slow) and slow > want
  assert np.isclose(cluster.axis_seconds([]), 0.0)


def test_the_traced_program_gives_the_same_records(records):
  """Traced on an abstract mesh (no devices), the same six collectives."""
  from jax.sharding import AbstractMesh

  from gradcomp.parallel import traced

  _, compiled = records
  abstract = AbstractMesh((2, 4), ("node", "local"))
  f = jax.shard_map(_program, mesh=abstract, in_specs=SPEC, out_specs=SPEC)
  x = jax.ShapeDtypeStruct(
    (8 * D,), jnp.float32, sharding=NamedSharding(abstract, SPEC)
  )
  got = traced.traced_axis_wire(f, x, mesh=abstract)
  key = lambda r: (r.kind, r.axes, r.operand_bytes, r.group)
  assert sorted(map(key, got)) == sorted(map(key, compiled))
  big = AbstractMesh((16, 8), ("node", "local"))
  f = jax.shard_map(_program, mesh=big, in_specs=SPEC, out_specs=SPEC)
  x = jax.ShapeDtypeStruct((128 * D,), jnp.float32, sharding=NamedSharding(big, SPEC))
  groups = {(r.kind, r.axes): r.group for r in traced.traced_axis_wire(f, x, mesh=big)}
  assert groups[("all-gather", ("node",))] == 16
  assert groups[("all-reduce", ("node", "local"))] == 128
