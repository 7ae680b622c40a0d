"""The training program on multi-axis meshes: FSDP on ``data=2,fsdp=4`` (DESIGN §7).

With ``none`` the FSDP run is the replicated ``data=8`` run in another
layout: the same rows per worker, the same mean gradient (summed in
another order), the same elementwise optimizer on shards. So their states
agree to a float32 bound (:data:`TOL`); the optimizer state's per-device
bytes are 1/F of the replicated layout's (plus padding); a run resumed on
its own mesh is bit-exact, and one resumed on the other mesh shape
continues the same trajectory. Bad ``config.mesh`` values are one-line
``ValueError``\\ s naming the field.
"""

import json
import math
import re
import shutil
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import gradcomp
from configs import default
from train import logs, optimizer, reshard, schemes, train
from train import mesh as mesh_lib

import harness

# One worker runs the module: its tests share the module's program runs (``pair``),
# built once.
pytestmark = pytest.mark.xdist_group("train_fsdp")

F = 4
FSDP = f"data=2,fsdp={F}"
STEPS = 8
TINY = {
  "model.features": (16,),
  "compressor.name": "none",
  "compressor.ratio": None,
  "fusion.plan": "single",
  "global_batch_size": 64,
  "num_train_steps": STEPS,
  "log_every_steps": STEPS,
  "eval_every_steps": STEPS,
  "checkpoint_every_steps": STEPS // 2,
}
#: AdamW with everything the optimizer config offers that a shard could get
#: wrong: the decay mask (matrices only), clipping by the global norm.
ADAMW = {
  "optimizer.name": "adamw",
  "optimizer.learning_rate": 0.01,
  "optimizer.weight_decay": 0.1,
  "optimizer.clip_norm": 0.5,
}
#: SGD with momentum (the default's), clipped: the mean gradient's norm is
#: above 0.2 throughout (the workers' own are ~0.9), so a norm taken over
#: one device's shards instead of the whole gradient would show.
SGD = {"optimizer.clip_norm": 0.2}
U = 2.0**-24  # float32 unit roundoff
#: How far the FSDP and replicated runs may drift, in units of each leaf's
#: largest value. Their only difference is the order of the float32 sums
#: of the exchanged mean of 8 gradients (an all-reduce of 8; a
#: reduce-scatter of 4, then an all-reduce of 2) and of the clip norm's
#: squares: each order is within gamma_8 ~ 8u of the summed magnitudes
#: (Higham, Accuracy and Stability of Numerical Algorithms, 2002, §4.2), so
#: a step's update differs by at most 16u of the gradient's scale. Momentum
#: (beta = 0.9) carries a step's difference into the next 1 / (1 - beta) =
#: 10 updates; AdamW's division by sqrt(v) passes a relative error of the
#: gradient on to the update at most 1.5 times, and the trajectory's
#: response to a perturbed param over 8 steps at these learning rates is
#: allowed another 10x (lr times the loss's curvature is below 1 on this
#: MLP). Per step 16u x 10 x 10, over 8 steps: 7.6e-4. What a wrong layout
#: does is far outside: biases decayed by a wrong mask move by lr x wd x 8 =
#: 8e-3 of themselves (10x the bound), a per-shard clip norm rescales
#: updates by up to 2x, a wrong shard or mean is wrong by O(1).
TOL = STEPS * 16 * U * 10 * 10


def config(mesh=None, **overrides):
  c = default.get_config()
  c.update_from_flattened_dict({**TINY, **overrides})
  c.mesh = mesh
  return c


def comparable(state, shapes):
  """``(params, local optimizer state)`` as full host arrays.

  ``shapes``: the replicated run's params (their full shapes). The
  exchange's state (the chain's first part) is left out: FSDP wraps it in
  ``hierarchical``, and with ``none`` it holds only counters.
  """
  params = state["params"]
  local = state["opt_state"].inner_state[1:]
  if tuple(jax.tree.leaves(params)[0].sharding.spec)[:1] == ("fsdp",):
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    layout = mesh_lib.ShardedParams("fsdp", F, like)
    is_params = lambda t: isinstance(t, dict) and t.keys() == like.keys()
    params = layout.full(params)
    local = jax.tree.map(
      lambda t: layout.full(t) if is_params(t) else t, local, is_leaf=is_params
    )
  return jax.tree.map(np.asarray, (params, local))


@pytest.fixture(scope="module", params=["sgd", "adamw"])
def pair(request, tmp_path_factory):
  """``{mesh: (workdir, result)}`` for data=8 and data=2,fsdp=4, trained once."""
  overrides = ADAMW if request.param == "adamw" else SGD
  runs = {}
  for mesh in (None, FSDP):
    workdir = tmp_path_factory.mktemp(f"{request.param}_{mesh or 'data'}")
    runs[mesh] = workdir, train.train_and_evaluate(config(mesh, **overrides), workdir)
  return request.param, overrides, runs


def test_fsdp_trains_as_replicated(pair):
  _, _, runs = pair
  (_, want), (_, got) = runs[None], runs[FSDP]
  shapes = want.state["params"]
  assert all(
    x.shape[0] == F and x.sharding.spec[0] == "fsdp"
    for x in jax.tree.leaves(got.state["params"])
  )
  harness.assert_states_close(
    comparable(got.state, shapes), comparable(want.state, shapes), rel=TOL
  )
  assert got.eval_metrics["eval_loss"] == pytest.approx(
    want.eval_metrics["eval_loss"], rel=TOL
  )


def per_device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_optimizer_state_is_one_fth_per_device(pair):
  name, _, runs = pair
  (_, want), (_, got) = runs[None], runs[FSDP]
  sizes = [x.size for x in jax.tree.leaves(want.state["params"])]
  # Momentum (SGD) or mu and nu (AdamW): param-shaped, float32.
  copies = 2 if name == "adamw" else 1
  local = lambda r: r.state["opt_state"].inner_state[1:]
  counters = per_device_bytes(local(want)) - copies * 4 * sum(sizes)
  assert counters < 16  # Adam's step count: one int32.
  assert per_device_bytes(local(want)) == copies * 4 * sum(sizes) + counters
  shards = sum(math.ceil(d / F) for d in sizes)  # Each leaf padded to F rows.
  assert per_device_bytes(local(got)) == copies * 4 * shards + counters
  assert shards - sum(sizes) / F < len(sizes)  # Padding: under a value per leaf.
  # Params too: each device holds 1/F of them.
  assert per_device_bytes(got.state["params"]) == 4 * shards


def test_same_mesh_resume_is_exact(pair, tmp_path):
  """A run killed after its mid-run checkpoint and restarted ends where the whole run ends."""
  _, overrides, runs = pair
  workdir, want = runs[FSDP]
  (tmp_path / "checkpoints").mkdir()
  shutil.copytree(
    workdir / "checkpoints" / str(STEPS // 2),
    tmp_path / "checkpoints" / str(STEPS // 2),
  )
  shutil.copy(workdir / train.PLAN_FILE, tmp_path / train.PLAN_FILE)
  got = train.train_and_evaluate(config(FSDP, **overrides), tmp_path)
  for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(want.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(("saved", "resumed"), [(None, FSDP), (FSDP, None)])
def test_other_mesh_shape_resumes_the_same_trajectory(pair, tmp_path, saved, resumed):
  """data=8 <-> data=2,fsdp=4 at the mid-run checkpoint: params and the
  optimizer's moments are re-laid out exactly (no residuals with ``none``),
  so the resumed run ends where the uninterrupted one on its mesh does."""
  _, overrides, runs = pair
  workdir, _ = runs[saved]
  (tmp_path / "checkpoints").mkdir()
  shutil.copytree(
    workdir / "checkpoints" / str(STEPS // 2),
    tmp_path / "checkpoints" / str(STEPS // 2),
  )
  got = train.train_and_evaluate(config(resumed, **overrides), tmp_path)
  want = runs[resumed][1]
  shapes = runs[None][1].state["params"]
  harness.assert_states_close(
    comparable(got.state, shapes), comparable(want.state, shapes), rel=TOL
  )
  rows = logs.read_metrics(tmp_path / logs.METRICS_FILE)
  (moved,) = [r["remesh"] for r in rows if "remesh" in r]
  assert moved["from_mesh"] == str(mesh_lib.parse(saved, 8))
  assert moved["to_mesh"] == str(mesh_lib.parse(resumed, 8))
  leaves = len(jax.tree.leaves(shapes))
  assert moved["rules"]["params"] == leaves
  assert moved["rules"]["param_shaped"] == leaves * (2 if overrides is ADAMW else 1)
  assert "residual" not in moved["rules"]


def test_residuals_move_with_their_mass():
  """The residual rule against NumPy: 8 workers' residuals of a fused group
  of two leaves, flat (data=8) and as fast-axis chunks (fsdp=4), in both
  directions. What the next update owes is conserved: the mean over all
  workers (flat), or per chunk j the mean over the devices at fast index j."""
  rng = np.random.default_rng(0)
  shapes = [(3, 5), (6,)]  # 21 values; chunks of ceil(15/4)=4 and ceil(6/4)=2
  n, g = 8, F
  flat = rng.standard_normal((n, 21)).astype(np.float32)
  owed = [
    m.reshape(s)
    for m, s in zip(
      np.split(flat.astype(np.float64).mean(0), [15]), shapes, strict=True
    )
  ]
  leaves = reshard._unfused_mean(flat, shapes, None)
  for a, b in zip(leaves, owed, strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-15)
  chunks = reshard._fused_rows(leaves, g, n, (6,), np.float32)
  # Device r holds chunk r % g of each leaf; the chunks' means are E's.
  for r in range(n):
    want = np.concatenate([mesh_lib.host_shard(x, g)[r % g] for x in owed])
    np.testing.assert_allclose(chunks[r], want, rtol=U, atol=0)
  back = reshard._unfused_mean(chunks, shapes, g)
  for a, b in zip(back, owed, strict=True):
    np.testing.assert_allclose(a, b, rtol=U, atol=0)
  # Chunks that differ between replicas: each chunk's mean over its replicas.
  noisy = chunks + rng.standard_normal(chunks.shape).astype(np.float32)
  got = reshard._unfused_mean(noisy, shapes, g)
  for i, (x, s) in enumerate(zip(got, shapes, strict=True)):
    c = math.ceil(math.prod(s) / g)
    start = 0 if i == 0 else 4
    per_chunk = [
      noisy[j::g, start : start + c].astype(np.float64).mean(0) for j in range(g)
    ]
    np.testing.assert_allclose(
      np.ravel(x), np.concatenate(per_chunk)[: math.prod(s)], rtol=0, atol=1e-12
    )
  rows = reshard._fused_rows(got, None, n, (21,), np.float32)
  np.testing.assert_array_equal(rows[0], rows[-1])


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    ({"mesh": "data=3,fsdp=4"}, r"config.mesh='data=3,fsdp=4' has 12 devices.*8"),
    ({"mesh": "data=2,model=4"}, r"unknown axis 'model'.*data, fsdp, node, local"),
    ({"mesh": "data=2,local=4"}, r"config.mesh=.*valid: data=\.\.\. or"),
    ({"mesh": "data:8"}, r"config.mesh='data:8': 'data:8' is not name=size"),
    ({"mesh": "data=0"}, r"size of 'data' must be an integer >= 1"),
    ({"mesh": "data=8,data=1"}, r"axis 'data' is given twice"),
    (
      {"compressor.hierarchical": "local"},
      r"config.compressor.hierarchical='local' on config.mesh='data=8'",
    ),
    (
      {"mesh": "node=2,local=4", "compressor.hierarchical": "fsdp"},
      r"config.compressor.hierarchical='fsdp'.*valid: None or 'local'",
    ),
    (
      {"mesh": FSDP, "scheme.name": "local_sgd", "scheme.every": 2},
      r"synchronous data parallelism only: config.scheme.name='local_sgd'",
    ),
    ({"mesh": FSDP, "step": "pmap"}, r"config.step='pmap' is not supported"),
  ],
)
def test_bad_mesh_is_a_clear_error(tmp_path, overrides, message):
  c = default.get_config()
  c.update_from_flattened_dict({**TINY, **overrides})
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(c, tmp_path)


def test_fsdp_exchange_is_hierarchical_gather_false():
  """The synchronous optimizer on an FSDP mesh: hierarchical over fsdp, shards out."""
  like = {"w": jax.ShapeDtypeStruct((10,), np.float32)}
  tx, _ = schemes.build(config(FSDP), [0], 1, [10], like=like)
  with jax.set_mesh(jax.make_mesh((2, F), ("data", "fsdp"))):
    state = tx.init({"w": np.zeros(10, np.float32)})
  exchange, *_ = state.inner_state
  assert isinstance(exchange, gradcomp.fusion.HierarchicalState)
  # The local optimizer's momentum is the shard's: ceil(10 / 4) values.
  assert jax.tree.leaves(state.inner_state[1:])[0].shape == (3,)


def test_node_local_hierarchical_keeps_the_shards_residual(tmp_path):
  """node=2,local=4 with compressor.hierarchical=local: top-k runs across the
  nodes on each device's quarter of the node's mean, so each device's
  error-feedback residual is its shard: ceil(d / 4) values per leaf."""
  overrides = {
    "compressor.name": "topk",
    "compressor.ratio": 0.1,
    "compressor.hierarchical": "local",
  }
  result = train.train_and_evaluate(config("node=2,local=4", **overrides), tmp_path)
  exchange = result.state["opt_state"].inner_state[0]
  assert isinstance(exchange, gradcomp.fusion.HierarchicalState)
  (residual,) = jax.tree.leaves(exchange.inner.inner.leaves)
  sizes = [x.size for x in jax.tree.leaves(result.state["params"])]
  assert residual.shape == (8, sum(math.ceil(d / F) for d in sizes))
  assert residual.sharding.spec[0] == ("node", "local")
  assert per_device_bytes(residual) == 4 * sum(math.ceil(d / F) for d in sizes)
  rows = [r for r in logs.read_metrics(tmp_path / logs.METRICS_FILE) if "loss" in r]
  assert np.isfinite(rows[-1]["loss"]) and result.eval_metrics["eval_accuracy"] > 0.1
  # Two link classes: the node's collectives on the intra-node link, the rest
  # on the cluster's; every step a barrier of compute plus that exchange.
  sim = json.loads((tmp_path / train.SIM_FILE).read_text())
  by_axes, comm = sim["wire_by_axes"], sim["step_comm_seconds"]
  assert sim["fast_axes"] == ["local"] and {"local", "node"} <= set(by_axes)
  cluster = optimizer.cluster_of(config("node=2,local=4"), 8)
  slow = 8 / (cluster.bandwidth_gbps * 1e9)
  fast = 8 / (cluster.intra_bandwidth_gbps * 1e9)
  local = by_axes["local"]["link"]
  rest = sum(v["link"] for k, v in by_axes.items() if k != "local")
  assert local > 0 and local * fast + rest * slow <= comm
  assert comm < sim["step_comm_seconds_one_link"]
  compute = sim["flops_per_step"] / cluster.flops_per_second
  for r in rows:
    assert r["sim_seconds"] == pytest.approx(r["step"] * (compute + comm), rel=1e-9)


class Odd(NamedTuple):
  """A state of no kind train/reshard.py knows."""

  memory: Any


@pytest.mark.parametrize(
  ("memory", "saved", "per_worker", "message"),
  [
    ((8, 3), (8, 3), True, r"a per-worker leaf of no known kind"),
    ((3,), (5,), False, r"shaped \(5,\) when saved and \(3,\) here"),
  ],
)
def test_a_leaf_no_rule_moves_is_a_clear_error(memory, saved, per_worker, message):
  zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype)
  like = {
    "params": {"w": zeros((4, F))},
    "model_state": {},
    "opt_state": Odd(zeros(memory)),
    "step": zeros((), np.int32),
    "rng": zeros((2,), np.uint32),
  }
  arrays = {
    "params.w": zeros((4, F)),
    "opt_state.memory": zeros(saved),
    "step": like["step"],
    "rng": like["rng"],
  }
  layout = SimpleNamespace(fsdp=None, per_worker=Odd(per_worker), sharded=None)
  saved_spec, spec = mesh_lib.parse("node=2,local=4", 8), mesh_lib.parse(None, 8)
  path = re.escape("no rule for state['opt_state'].memory (")
  with pytest.raises(ValueError, match=rf"node=2,local=4.*data=8.*{path}{message}"):
    reshard.move(arrays, like, layout, saved_spec, spec, None)


def test_another_mesh_and_worker_count_is_a_clear_error():
  checkpoints = SimpleNamespace(
    saved_mesh=lambda step: {"mesh": FSDP, "hierarchical": "fsdp"},
    saved=lambda step: (8, {}),
  )
  with pytest.raises(ValueError, match=r"saved on config.mesh='data=2,fsdp=4' \(8"):
    reshard.restore(
      checkpoints, 4, {}, None, None, mesh_lib.parse("data=2,fsdp=2", 4), None
    )
