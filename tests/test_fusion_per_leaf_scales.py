"""Per-leaf scales inside fused groups equal the layer-wise plan, bit for bit.

DESIGN §14 / issue 43 item 3: ``layerfusion(tx, plan, per_leaf=True)`` for
EF-signSGD, TernGrad, QSGD, int_quantize, FP8, FP4 and 1-bit SGD
(``compressors.per_leaf_scales``) computes each leaf's own scale (its
buckets and blocks inside the leaf, its own random draws) inside the group's
program, sends each group's payload in one all-gather, and must equal ``layerfusion(tx, "layerwise")`` of the same
gradient-ready order: outputs on every worker, error-feedback residuals, and
bytes on the wire. On 8 workers over a few steps, with 1-D and 2-D leaves, a
leaf smaller than a bucket, leaves not a multiple of the bucket, a scalar, an
empty leaf and a one-leaf group (its residual keeps the leaf's shape). The
per-buffer form (``per_leaf=False``: one scale per group, buckets across
leaves) must differ, and the per-leaf form's state must have its shapes.

Independent references: EF-signSGD's first step in NumPy (float64: each
worker's ``||g||_1 / d sign(g)`` per leaf, averaged), within the float32 bound
of the sum; error feedback's conservation (the workers' mean output plus
their mean residual is the mean of what entered the step).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import scopes
from gradcomp.fusion.plan import Plan

import harness

# One worker builds each module fixture once (split over two, the fixtures
# of a parameter were built on both).
pytestmark = pytest.mark.xdist_group("per_leaf_scales")

STEPS = 3
BUCKET = 16  # QSGD's buckets and int_quantize's blocks
U = 2.0**-24  # float32 unit roundoff
# Tree order is the sorted keys. With buckets of 16: a_w 3 full buckets,
# b_bias one of 5 (smaller than a bucket), c_w 2 full and a tail of 3, d_vec
# 2 full and a tail of 8, e_scalar one of 1, f_empty none, g_conv 4 full.
SHAPES = {
  "a_w": (4, 12),
  "b_bias": (5,),
  "c_w": (5, 7),
  "d_vec": (40,),
  "e_scalar": (),
  "f_empty": (0,),
  "g_conv": (2, 2, 4, 4),
}
NAMES = sorted(SHAPES)
ORDER = tuple(reversed(range(len(NAMES))))  # gradient-ready: last leaf first
PLAN = Plan(num_leaves=7, groups=((6, 5, 4, 3), (2,), (1, 0)))
W = harness.WORKERS

CODECS = {
  "ef_signsgd": lambda axis: gradcomp.ef_signsgd(axis_name=axis),
  "terngrad": lambda axis: gradcomp.terngrad(seed=3, axis_name=axis),
  "qsgd": lambda axis: gradcomp.qsgd(
    4, bucket_size=BUCKET, seed=5, axis_name=axis, error_feedback=True
  ),
  "int_quantize": lambda axis: gradcomp.int_quantize(8, BUCKET, axis_name=axis),
  "fp8": lambda axis: gradcomp.fp8(axis_name=axis, error_feedback=True),
  "fp4": lambda axis: gradcomp.fp4(
    block_size=BUCKET, stochastic=True, seed=2, axis_name=axis
  ),
  "onebit_sgd": lambda axis: gradcomp.onebit_sgd(axis_name=axis),
}
HAS_RESIDUAL = {
  "ef_signsgd": True,
  "terngrad": False,
  "qsgd": True,
  "int_quantize": True,
  "fp8": True,
  "fp4": False,
  "onebit_sgd": True,
}


def _grads(seed: int = 0) -> dict[str, np.ndarray]:
  """``(STEPS, workers, *shape)`` float32 of mixed magnitudes per leaf."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, (name, shape) in enumerate(SHAPES.items()):
    scale = 10.0 ** (k - 3)  # leaves of very different scales
    out[name] = (scale * rng.standard_normal((STEPS, W, *shape))).astype(np.float32)
  return out


def _params():
  return {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def _plans(make):
  """The three programs: layer-wise, per-leaf fused and per-buffer fused."""
  axis = harness.AXIS
  return {
    "layerwise": gradcomp.layerfusion(
      make(axis), "layerwise", order=ORDER, per_leaf=False
    ),
    "per_leaf": gradcomp.layerfusion(make(axis), PLAN, per_leaf=True),
    "per_buffer": gradcomp.layerfusion(make(axis), PLAN, per_leaf=False),
  }


def _run(txs: dict, grads):
  """Every plan's per-step outputs (all workers) and final states, one compile."""

  def steps(g, states):
    states = gradcomp.drop_worker_axis(states)

    def body(states, g):
      outs, new = {}, {}
      for name, tx in txs.items():
        outs[name], new[name] = tx.update(jax.tree.map(lambda x: x[0], g), states[name])
      return new, gradcomp.add_worker_axis(outs)

    states, outs = jax.lax.scan(body, states, g)
    return outs, gradcomp.add_worker_axis(states)

  f = jax.shard_map(
    steps,
    mesh=harness.mesh(),
    in_specs=(P(None, harness.AXIS), P(harness.AXIS)),
    out_specs=(P(None, harness.AXIS), P(harness.AXIS)),
  )
  states = {k: tx.init(_params()) for k, tx in txs.items()}
  outs, final = jax.jit(f)(
    harness.shard(grads, P(None, harness.AXIS)),
    harness.shard(gradcomp.add_worker_axis(states, W)),
  )
  return jax.tree.map(np.asarray, outs), jax.tree.map(np.asarray, final), states


@pytest.fixture(scope="module")
def grads():
  return _grads()


@pytest.fixture(scope="module", params=list(CODECS))
def run(request, grads):
  name = request.param
  txs = _plans(CODECS[name])
  outs, final, initial = _run(txs, grads)
  return name, txs, outs, final, initial


def _residuals(state, plan: Plan) -> dict[str, np.ndarray]:
  """``{leaf: (workers, *shape)}`` from a plan's per-group residuals."""
  out = {}
  for group, s in zip(plan.groups, state.inner.leaves, strict=True):
    flat = s.residual.reshape(W, -1)
    sizes = [math.prod(SHAPES[NAMES[i]]) for i in group]
    for i, piece in zip(
      group, np.split(flat, np.cumsum(sizes)[:-1], axis=1), strict=True
    ):
      out[NAMES[i]] = piece.reshape(W, *SHAPES[NAMES[i]])
  return out


def test_per_leaf_equals_the_layerwise_plan_bit_for_bit(run):
  name, _, outs, final, _ = run
  for k in NAMES:
    np.testing.assert_array_equal(
      outs["per_leaf"][k], outs["layerwise"][k], err_msg=f"{name}: {k}"
    )
    # The same mean on every worker.
    np.testing.assert_array_equal(
      outs["per_leaf"][k],
      np.broadcast_to(outs["per_leaf"][k][:, :1], (STEPS, W, *SHAPES[k])),
    )
  if HAS_RESIDUAL[name]:
    fused = _residuals(final["per_leaf"], PLAN)
    layerwise = _residuals(final["layerwise"], Plan.layerwise(ORDER))
    for k in NAMES:
      np.testing.assert_array_equal(fused[k], layerwise[k], err_msg=f"{name}: {k}")


def test_per_buffer_scales_differ(run):
  """The must-fail case: one scale per group is another algorithm."""
  name, _, outs, _, _ = run
  differ = [
    k for k in NAMES if not np.array_equal(outs["per_buffer"][k], outs["layerwise"][k])
  ]
  # a_w and d_vec share a group (a buffer's scale, or buckets across the two)
  # with a leaf 10 times larger; g_conv, the group's largest and first leaf,
  # may keep its scale.
  assert {"a_w", "d_vec"} <= set(differ) and len(differ) >= 3, (name, differ)


def test_state_has_the_fused_state_shapes(run):
  _, txs, _, _, initial = run
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), initial["per_buffer"])
  assert jax.tree.map(lambda x: (x.shape, x.dtype), initial["per_leaf"]) == shapes
  # A one-leaf group keeps its leaf's shape (sharded like it), others are flat.
  leaves = initial["per_leaf"].inner.leaves
  if leaves[0]:
    assert [s.residual.shape for s in leaves] == [(105,), (5, 7), (53,)]


def test_error_feedback_conserves_mass(run, grads):
  """Mean output + mean residual = mean residual before + mean gradient."""
  name, _, outs, final, _ = run
  if not HAS_RESIDUAL[name]:
    pytest.skip(f"{name} keeps no residual")
  fused = _residuals(final["per_leaf"], PLAN)
  for k in NAMES:
    sent = outs["per_leaf"][k][:, 0].astype(np.float64).sum(axis=0)
    kept = fused[k].astype(np.float64).mean(axis=0)
    total = grads[k].astype(np.float64).sum(axis=0).mean(axis=0)
    # Each of 3 steps rounds r + g, the decoded mean and the remainder once.
    bound = 4 * STEPS * U * (np.abs(grads[k]).sum(axis=0).max(axis=0) + np.abs(sent))
    assert np.all(np.abs(sent + kept - total) <= bound + 1e-30), (name, k)


def test_ef_signsgd_first_step_matches_numpy(run, grads):
  """Independent reference: each leaf's own ``||g||_1 / d`` (float64)."""
  name, _, outs, _, _ = run
  if name != "ef_signsgd":
    pytest.skip("EF-signSGD's reference")
  for k in NAMES:
    g = grads[k][0].reshape(W, -1).astype(np.float64)
    if g.shape[1] == 0:
      continue
    scale = np.abs(g).mean(axis=1, keepdims=True)
    ref = np.mean(np.where(g >= 0, scale, -scale), axis=0)
    got = outs["per_leaf"][k][0, 0].reshape(-1)
    bound = (g.shape[1] + W + 2) * U * scale.max()
    np.testing.assert_array_less(np.abs(got - ref), bound + 1e-30, err_msg=k)


def _gathers(tx) -> list[int]:
  """Bytes of each all-gather operand in one traced step on the workers."""
  f = harness.sharded_update(tx, jit=False)
  one = harness.shard(jax.tree.map(lambda x: x[0], _grads()))
  jaxpr = jax.make_jaxpr(f)(one, harness.worker_state(tx, _params()))
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name.startswith("all_gather"):
        aval = eqn.invars[0].aval
        found.append(math.prod(aval.shape) * aval.dtype.itemsize)
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("name", list(CODECS))
def test_one_gather_per_group_same_bytes(name):
  txs = _plans(CODECS[name])
  fused, layerwise = _gathers(txs["per_leaf"]), _gathers(txs["layerwise"])
  assert len(fused) == len(PLAN.groups)  # every group has a non-empty leaf
  assert len(layerwise) >= 2 * (len(NAMES) - 1)  # codes and scales per leaf
  assert sum(fused) == sum(layerwise) > 0


def test_forms_are_declared_and_fall_back():
  for name, make in CODECS.items():
    assert scopes.per_leaf_form(make(None)) is not None, name
  # The scatter forms and LoCo's 8-bit residuals keep fused buffers.
  assert scopes.per_leaf_form(gradcomp.qsgd(exchange="scatter", axis_name="d")) is None
  assert scopes.per_leaf_form(gradcomp.int_quantize(residual_bits=8)) is None
  with pytest.raises(ValueError, match="per_leaf=True"):
    gradcomp.layerfusion(
      gradcomp.terngrad(exchange="scatter", axis_name="d"), "single", per_leaf=True
    )
