"""Fusion keeps each codec's semantics (DESIGN §14, issue 43).

Every registered compressor declares what fusion may change
(``gradcomp.compressors.scopes``), and ``layerfusion(powersgd(...), plan)``
runs PowerSGD per leaf inside the fused program: on 8 workers (shard_map),
over several steps with error feedback, it equals ``powersgd`` applied leaf by
leaf (the layer-wise plan of the same gradient-ready order) within the float32
bound derived in :func:`_bound`, and sends two all-reduces per group.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from gradcomp.compressors import scopes
from gradcomp.compressors.powersgd import goes_dense, headroom, matrix_shape
from gradcomp.compressors.powersgd_groups import PowerSGDGroupState
from gradcomp.fusion.layerfusion import auto_plan
from gradcomp.fusion.plan import Plan
from gradcomp.sim.cluster import Cluster
from gradcomp.sim.profile import Profile, label_of

import harness

# One worker builds each module fixture once (split over two, the fixtures
# of a parameter were built on both).
pytestmark = pytest.mark.xdist_group("fusion_semantics")

RANK = 4
STEPS = 3
U = 2.0**-24  # float32 unit roundoff
# Sorted keys are the tree order. Matrix shapes: (16, 24) x3, (24, 16) x2, the
# conv kernels as (36, 8) x2, the vectors as the padded near-square (15, 14); the
# bias, the tiny matrix and the scalar go dense (factors not smaller).
SHAPES = {
  "a_qkv0": (16, 24),
  "a_qkv1": (16, 24),
  "a_qkv2": (16, 24),
  "b_bias": (24,),
  "c_proj0": (24, 16),
  "c_proj1": (24, 16),
  "d_conv0": (3, 3, 4, 8),
  "d_conv1": (3, 3, 4, 8),
  "e_vec": (200,),
  "e_vec2": (205,),  # also (15, 14): batched with e_vec, padded differently
  "f_tiny": (2, 3),
  "g_scalar": (),
}
NAMES = sorted(SHAPES)
ORDER = tuple(reversed(range(len(NAMES))))  # gradient-ready: last leaf first
PLAN = Plan(num_leaves=12, groups=((11, 10, 9, 8), (7, 6, 5, 4, 3), (2, 1, 0)))


# -- 1. Every compressor declares a scope ----------------------------------------


def test_every_registered_compressor_declares_its_scope():
  assert set(scopes.DECLARED) >= set(gradcomp.names())
  for name in gradcomp.names():
    tx = gradcomp.get(name, **harness.REQUIRED.get(name, {}))
    assert scopes.scope_of(tx) == scopes.DECLARED[name] in scopes.SCOPES, name
    # Only per-leaf codecs have a per-leaf form; PowerSGD has one.
    has_form = scopes.per_leaf_form(tx) is not None
    assert not has_form or scopes.DECLARED[name] == scopes.LEAF, name
    assert has_form or name != "powersgd"


def test_scope_of_undeclared_and_per_leaf_overrides():
  import optax

  assert scopes.scope_of(optax.sgd(0.1)) is None
  assert scopes.per_leaf_form(optax.sgd(0.1)) is None
  with pytest.raises(ValueError, match="per_leaf=True"):
    gradcomp.layerfusion(gradcomp.topk(0.5), "single", per_leaf=True)
  with pytest.raises(ValueError, match="per_leaf must be"):
    gradcomp.layerfusion(gradcomp.powersgd(), "single", per_leaf="yes")
  with pytest.raises(ValueError, match="vectors must be one of"):
    gradcomp.powersgd(vectors="flat")


# -- 2. PowerSGD per leaf, batched, equals the layer-wise plan ----------------------


def _warm_starts() -> dict[str, np.ndarray]:
  """Each compressed leaf's initial ``Q`` (``cols x rank``), as the plans draw it."""
  tx = gradcomp.layerfusion(
    gradcomp.powersgd(RANK), "layerwise", order=ORDER, per_leaf=True
  )
  state = tx.init({k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()})
  out = {}
  for j, i in enumerate(ORDER):
    qs = state.inner.leaves[j].inner.qs
    if qs:
      out[NAMES[i]] = np.asarray(qs[0][0], np.float64)
  return out


def _low_rank_grads(seed: int = 0) -> dict[str, np.ndarray]:
  """``(STEPS, workers, *shape)`` gradients whose workers' mean is of rank 4.

  Each worker's gradient is ``L_t + N_w``: noise ``N_w`` summing to zero over
  the workers, and ``L_t = 2 A_t V^T`` as the leaf's matrix, ``A_t`` a fresh
  orthonormal ``rows x 4`` each step and ``V`` the orthonormal basis of the
  leaf's initial ``Q``. So ``P = M Q~`` is well conditioned from the first
  step on (the bound below divides by its ``sigma_r``), as it is for a
  gradient whose row space drifts slowly under the warm start. The vectors'
  ``A_t`` has a zero last row, so their padding (the last 10 and 5 entries of
  their 15 x 14 matrices) is zero and their rank stays 4. Leaves sent dense:
  any values.
  """
  rng = np.random.default_rng(seed)
  starts = _warm_starts()
  W = harness.WORKERS
  out = {}
  for name in NAMES:
    shape = SHAPES[name]
    n, _ = matrix_shape(shape)
    size = math.prod(shape)
    steps = []
    for _ in range(STEPS):
      if goes_dense(shape, RANK):
        steps.append(rng.standard_normal((W, *shape)))
        continue
      a = np.linalg.qr(rng.standard_normal((n, RANK)))[0]
      if name.startswith("e_vec"):
        a[-1] = 0.0
      low = 2.0 * a @ np.linalg.qr(starts[name])[0].T
      low = low.reshape(-1)[:size]
      noise = rng.standard_normal((W, size))
      noise -= noise.mean(axis=0)
      steps.append((low + 0.5 * noise).reshape(W, *shape))
    out[name] = np.stack(steps).astype(np.float32)
  return out


def _run(tx, grads):
  """Per step: every worker's output and every worker's state *before* the step."""
  params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
  return harness.every_step(tx, grads, params, state_after=False)


def _bound(name: str, g: np.ndarray, residual: np.ndarray, q: np.ndarray):
  """Per step, the float32 bound on ``||out_fused - out_layerwise||_F`` of a leaf.

  ``g``, ``residual``: ``(STEPS, workers, *shape)``, the gradients and the
  layer-wise run's residuals before each step; ``q``: ``(STEPS, cols, rank)``,
  its warm starts. Both programs compute, in float32, the same map on
  ``M_w = r_w + g_w`` and ``Q~ = unit_columns(Q) 2^-a``:
  ``P = mean_w M_w Q~``, ``P^ = orth(P)``, ``Q = mean_w M_w^T P^``,
  ``out = P^ Q^T = P^ P^^T M`` (``M`` the workers' mean); only summation
  orders differ (batched products, another QR driver). First order in ``u``:

  * ``P``: a dot of length ``m`` errs by ``gamma_m |M_w| |Q~|``; the mean over
    ``W`` workers by ``gamma_W`` of the summands; Householder QR is backward
    stable, ``||dP|| <= 4 n r u ||P||`` (Higham, *Accuracy and Stability*,
    Thm 19.4). Per program ``dP = gamma_m ||Q~||_F mean_w ||M_w||_F +
    (gamma_W + 4 n r u) ||P||_F``.
  * ``M`` has rank ``<= r`` (the test's gradients, and the mean residual
    ``M - out`` is 0 in exact arithmetic), so ``out = M`` for every basis:
    the warm start and the basis of ``P^`` do not matter, only the subspace,
    which moves by ``sin theta <= (dP_A + dP_B) / sigma_r(P)`` (Wedin), moving
    ``out`` by ``sin theta ||M||_2``.
  * ``Q`` and ``P^ Q^T``: dots of length ``n`` and ``r`` and the mean over
    workers, ``(gamma_n + gamma_r + gamma_W) sqrt(r) ||M||_F`` per program.
  * What one step's outputs differ by stays in the residuals (``r = M - out``,
    plus ``u |r|`` per subtraction): the next ``M`` differs by ``D``, which
    reaches the output directly and through the subspace,
    ``D (1 + ||Q~||_2 ||M||_2 / sigma_r(P))``.

  The returned bound doubles this first-order sum for the neglected
  second-order terms. Dense leaves are all-reduced from the same values in
  both programs: bound 0 (checked bit for bit).
  """
  shape = SHAPES[name]
  if goes_dense(shape, RANK):
    return np.zeros(STEPS)
  n, m = matrix_shape(shape)
  size = math.prod(shape)
  W = g.shape[1]
  gamma = lambda k: k * U / (1 - k * U)  # noqa: E731
  bounds, carried = [], 0.0
  for t in range(STEPS):
    mw = (residual[t] + g[t]).reshape(W, -1).astype(np.float64)
    mw = np.pad(mw, ((0, 0), (0, n * m - size))).reshape(W, n, m)
    mean = mw.mean(axis=0)
    qt = q[t].astype(np.float64)
    qt = qt / np.linalg.norm(qt, axis=0, keepdims=True) * headroom(m)
    p = mean @ qt
    sigma = np.linalg.svd(p, compute_uv=False)[RANK - 1]
    norm_q = np.linalg.norm(qt)
    norm_m2 = np.linalg.norm(mean, 2)
    norm_mf = np.linalg.norm(mean)
    d_p = gamma(m) * norm_q * np.mean(np.linalg.norm(mw, axis=(1, 2)))
    d_p += (gamma(W) + 4 * n * RANK * U) * np.linalg.norm(p)
    step = 2 * d_p / sigma * norm_m2
    step += 2 * (gamma(n) + gamma(RANK) + gamma(W)) * math.sqrt(RANK) * norm_mf
    step += carried * (1 + np.linalg.norm(qt, 2) * norm_m2 / sigma)
    bounds.append(2 * step)
    carried = step + 2 * U * np.max(np.linalg.norm(residual[t].reshape(W, -1), axis=1))
  return np.array(bounds)


def _leaves_of(groups_out, plan: Plan) -> dict[str, np.ndarray]:
  """``{name: array}`` from per-group tuples (or fused buffers) in plan order."""
  out = {}
  for group, value in zip(plan.groups, groups_out, strict=True):
    if isinstance(value, tuple):
      pieces = value
    else:
      flat = value.reshape(*value.shape[:2], -1)
      sizes = [math.prod(SHAPES[NAMES[i]]) for i in group]
      pieces = np.split(flat, np.cumsum(sizes)[:-1], axis=-1)
    for i, piece in zip(group, pieces, strict=True):
      out[NAMES[i]] = piece.reshape(*piece.shape[:2], *SHAPES[NAMES[i]])
  return out


@pytest.fixture(scope="module")
def runs():
  grads = _low_rank_grads()
  axis = harness.AXIS
  layerwise = gradcomp.layerfusion(
    gradcomp.powersgd(RANK, axis_name=axis), "layerwise", order=ORDER, per_leaf=False
  )
  fused = gradcomp.layerfusion(
    gradcomp.powersgd(RANK, axis_name=axis), PLAN, per_leaf=True
  )
  old = gradcomp.layerfusion(
    gradcomp.powersgd(RANK, axis_name=axis), PLAN, per_leaf=False
  )
  # The default: plan "auto", per_leaf=None (the per-leaf form).
  auto = gradcomp.layerfusion(
    gradcomp.powersgd(RANK, axis_name=axis),
    "auto",
    order=ORDER,
    profile=_hand_made_profile(),
    cluster=Cluster(harness.WORKERS),
  )
  return grads, {
    "layerwise": _run(layerwise, grads),
    "fused": _run(fused, grads),
    "old": _run(old, grads),
    "auto": _run(auto, grads),
  }


def _hand_made_profile() -> Profile:
  """A profile (0.2 ms a call, 4 ns a value) under which "auto" fuses leaves."""
  sizes = (16, 2**10)
  tx = gradcomp.powersgd(RANK, axis_name=harness.AXIS)
  return Profile(
    label_of(tx),
    "hand-made",
    1,
    sizes,
    [2e-4 + 4e-9 * x for x in sizes],
    [2e-4 + 5e-9 * x for x in sizes],
    {"all-reduce": (64, 4096)},
    {"all-reduce": (2, 2)},
  )


def _outputs_and_bounds(runs, which: str):
  grads, by_name = runs
  (ref_out, ref_state) = by_name["layerwise"]
  out, state = by_name[which]
  layerwise_plan = Plan.layerwise(ORDER)
  residuals = _leaves_of(
    [s.residual for s in ref_state.inner.leaves], layerwise_plan
  )  # (STEPS, W, ...)
  qs = {}
  for j, i in enumerate(ORDER):
    inner = ref_state.inner.leaves[j].inner
    if inner != ():
      qs[NAMES[i]] = inner.q[:, 0]  # identical on every worker
  bounds = {
    k: _bound(k, grads[k], residuals[k], qs.get(k)) if k in qs else np.zeros(STEPS)
    for k in NAMES
  }
  return ref_out, out, state, residuals, bounds


def test_per_leaf_powersgd_equals_the_layerwise_plan(runs):
  ref_out, out, state, residuals, bounds = _outputs_and_bounds(runs, "fused")
  for k in NAMES:
    np.testing.assert_array_equal(out[k], np.broadcast_to(out[k][:, :1], out[k].shape))
    # Every worker's copy, every step: within the bound of its step.
    per_step = np.linalg.norm(
      (out[k] - ref_out[k]).reshape(STEPS, harness.WORKERS, -1), axis=-1
    ).max(axis=1)
    assert np.all(per_step <= bounds[k]), (k, per_step, bounds[k])
    if goes_dense(SHAPES[k], RANK):
      np.testing.assert_array_equal(out[k], ref_out[k])
  # Error feedback: each group's fused residual is the leaves' residuals.
  fused_res = _leaves_of([s.residual for s in state.inner.leaves], PLAN)
  for k in NAMES:
    diff = np.linalg.norm(
      (fused_res[k] - residuals[k]).reshape(STEPS, harness.WORKERS, -1), axis=-1
    ).max(axis=1)
    # A residual differs from the other program's as its previous outputs did.
    carried = np.concatenate([[0.0], bounds[k][:-1]])
    assert np.all(diff <= carried), (k, diff, carried)


def test_the_default_auto_plan_is_powersgd_leaf_by_leaf(runs):
  """``layerfusion(powersgd(4), "auto")``, per_leaf left at its default, fuses
  leaves and equals the layer-wise plan within the bound, error feedback
  included (8 workers, 3 steps)."""
  sizes = tuple(math.prod(SHAPES[k]) for k in NAMES)
  plan = auto_plan(sizes, ORDER, _hand_made_profile(), Cluster(harness.WORKERS))
  assert max(len(g) for g in plan.groups) > 1, plan.groups
  ref_out, out, state, residuals, bounds = _outputs_and_bounds(runs, "auto")
  assert all(
    isinstance(s.inner, PowerSGDGroupState) for s in state.inner.leaves
  )  # the per-leaf form ran
  for k in NAMES:
    per_step = np.linalg.norm(
      (out[k] - ref_out[k]).reshape(STEPS, harness.WORKERS, -1), axis=-1
    ).max(axis=1)
    assert np.all(per_step <= bounds[k]), (k, per_step, bounds[k])
  fused_res = _leaves_of([s.residual for s in state.inner.leaves], plan)
  for k in NAMES:
    diff = np.linalg.norm(
      (fused_res[k] - residuals[k]).reshape(STEPS, harness.WORKERS, -1), axis=-1
    ).max(axis=1)
    assert np.all(diff <= np.concatenate([[0.0], bounds[k][:-1]])), (k, diff)


def test_the_bound_separates_per_leaf_from_one_matrix_per_group(runs):
  """The seed's fused PowerSGD (one near-square matrix per group) is outside it."""
  ref_out, out, _, _, bounds = _outputs_and_bounds(runs, "old")
  over = [
    k
    for k in NAMES
    if np.any(
      np.linalg.norm(
        (out[k] - ref_out[k]).reshape(STEPS, harness.WORKERS, -1), axis=-1
      ).max(axis=1)
      > bounds[k]
    )
  ]
  assert len(over) >= 5, over
  # And the bound is not vacuous: far below the outputs themselves.
  for k in NAMES:
    if not goes_dense(SHAPES[k], RANK):
      size = np.linalg.norm(ref_out[k].reshape(STEPS, harness.WORKERS, -1), axis=-1)
      assert np.all(bounds[k] < 1e-2 * size.min(axis=1)), (k, bounds[k])


def test_factors_per_leaf_batched_by_shape(runs):
  _, by_name = runs
  _, state = by_name["fused"]
  qs = [[q.shape[2:] for q in s.inner.qs] for s in state.inner.leaves]
  # (STEPS, W) lead; then (leaves, cols, rank) per matrix shape of each group.
  assert qs == [
    [(2, 14, RANK)],  # e_vec, e_vec2 as (15, 14); the tiny matrix, the scalar dense
    [(2, 8, RANK), (2, 16, RANK)],  # the conv kernels, then the projections
    [(3, 24, RANK)],  # the three (16, 24) matrices
  ]


def _all_reduces(tx, grads) -> int:
  """The all-reduces (psum) in one traced step on the workers."""
  params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
  f = harness.sharded_update(tx, jit=False)
  one = harness.shard(jax.tree.map(lambda x: x[0], grads))
  jaxpr = jax.make_jaxpr(f)(one, harness.worker_state(tx, params))

  def count(j) -> int:
    total = 0
    for eqn in j.eqns:
      total += eqn.primitive.name.startswith("psum")
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            total += count(inner)
    return total

  return count(jaxpr.jaxpr)


def test_two_all_reduces_per_group():
  grads = _low_rank_grads()
  axis = harness.AXIS
  fused = gradcomp.layerfusion(
    gradcomp.powersgd(RANK, axis_name=axis), PLAN, per_leaf=True
  )
  assert _all_reduces(fused, grads) == 2 * len(PLAN.groups)
  layerwise = gradcomp.layerfusion(
    gradcomp.powersgd(RANK, axis_name=axis), "layerwise", order=ORDER, per_leaf=False
  )
  dense = sum(goes_dense(s, RANK) for s in SHAPES.values())
  assert _all_reduces(layerwise, grads) == 2 * (len(SHAPES) - dense) + dense


def test_vectors_dense_sends_1d_leaves_uncompressed():
  """``vectors="dense"``: a 1-D leaf is all-reduced whole, fused or not."""
  g = {"v": jnp.linspace(-1.0, 1.0, 200), "w": jnp.ones((16, 24))}
  for tx in (
    gradcomp.powersgd(RANK, vectors="dense"),
    gradcomp.layerfusion(gradcomp.powersgd(RANK, vectors="dense"), "single"),
  ):
    out, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(out["v"], g["v"])


def test_householder_columns_is_lapack_s_qr():
  """The per-leaf form's orthogonalisation against NumPy's float64 QR (LAPACK's
  sign convention): orthonormal to float32 rounding, equal to the exact Q
  within the first-order bound ``4 n r u kappa(P)`` (Higham Thm 19.4, the
  perturbation of Q by ``kappa``), and the identity's columns for a zero P."""
  from gradcomp.compressors.powersgd import householder_columns

  rng = np.random.default_rng(0)
  p = rng.standard_normal((3, 50, RANK)).astype(np.float32)
  p[1, :, 2] = 0.0  # a zero column: no reflection, as LAPACK
  p[2] *= 1e30  # near the float32 range: scaled by a power of two first
  got = np.asarray(householder_columns(jnp.asarray(p)), np.float64)
  n = p.shape[1]
  for b in range(p.shape[0]):
    want = np.linalg.qr(p[b].astype(np.float64))[0]
    np.testing.assert_allclose(got[b].T @ got[b], np.eye(RANK), atol=8 * n * U)
    if b == 1:  # rank-deficient: the column space of P, then any unit vector
      np.testing.assert_allclose(got[b][:, :2], want[:, :2], atol=1e-5)
      continue
    kappa = np.linalg.cond(p[b].astype(np.float64))
    assert np.abs(got[b] - want).max() <= 4 * n * RANK * U * kappa, b
  np.testing.assert_array_equal(
    householder_columns(jnp.zeros((2, 7, RANK))),
    np.broadcast_to(np.eye(7, RANK), (2, 7, RANK)),
  )


def test_an_auto_plan_is_priced_in_the_form_it_runs(monkeypatch):
  """``layerfusion(powersgd(4), "auto")`` times its fused pieces per leaf; with
  ``per_leaf=False`` it times the one-buffer form it will run, a profile of
  its own (the cache keys on the form). One size, one repeat: what is timed
  matters here, not the time."""
  from gradcomp.fusion import profiling

  asked, timed = [], []
  real_profile, real_fused = profiling.profile, profiling.fused

  def profile(tx, sizes, *, workers, per_leaf):
    asked.append(per_leaf)
    return real_profile(tx, (64,), workers=workers, per_leaf=per_leaf, repeats=1)

  def fused(inner, plan, forms=None, per_leaf=None):
    timed.append(per_leaf is not None)
    return real_fused(inner, plan, forms, per_leaf)

  monkeypatch.setattr(profiling, "profile", profile)
  monkeypatch.setattr(profiling, "fused", fused)
  monkeypatch.setattr(profiling, "_PROFILES", {})
  for per_leaf in (None, False):
    gradcomp.layerfusion(
      gradcomp.powersgd(4), "auto", cluster=Cluster(2), per_leaf=per_leaf
    )
  assert asked == [True, False] and timed == [True, False]
  assert sorted(k[-1] for k in profiling._PROFILES) == [False, True]
