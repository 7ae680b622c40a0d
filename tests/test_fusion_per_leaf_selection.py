"""Per-leaf selection inside fused groups equals the layer-wise plan, bit for bit.

DESIGN §14 / issue 43 item 3: ``layerfusion(tx, plan, per_leaf=True)`` for
random-k, DGC, Strom's sparse_quantize and top-k with ``per_leaf=True`` (and with
``chunk``) runs each
leaf's own budget inside the group's program (one collective per group) and
must equal ``layerfusion(tx, "layerwise")`` of the same gradient-ready order:
outputs, error-feedback state and bytes on the wire. On 8 workers, over a
few steps, with 1-D and 2-D leaves of different ``k``, a leaf whose ``k``
rounds to its minimum 1, a scalar (``k = d``), an empty leaf, two leaves of
one size (batched into one ``lax.top_k``), tied magnitudes, and one leaf
large enough for the sampled selections (``top_k_magnitude``'s and DGC's
threshold). The per-buffer form (``per_leaf=False``) must differ.

Independent references: the first step's per-leaf top-k in NumPy (a stable
argsort, lowest index first among ties, as ``lax.top_k``; the workers'
values added in float32 in worker order); error feedback's conservation
(what was sent plus the workers' mean residual is the mean gradient).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from gradcomp.compressors import scopes
from gradcomp.fusion.plan import Plan

import harness

# One worker builds each module fixture once (split over two, the fixtures
# of a parameter were built on both).
pytestmark = pytest.mark.xdist_group("per_leaf_selection")

STEPS = 3
RATIO = 0.1
# Tree order is the sorted keys. k = max(1, floor(0.1 d)): 38, 1 (of 16),
# 2048 (sampled selections), 38, 1 (of 7: rounds to the minimum), 1 (= d,
# the scalar), none (empty), 38.
SHAPES = {
  "a_w": (24, 16),
  "b_bias": (16,),
  "c_big": (160, 128),
  "d_w2": (16, 24),
  "e_vec": (7,),
  "f_scalar": (),
  "g_empty": (0,),
  "h_w3": (16, 24),  # d_w2's size, in its group: one batched top_k
}
NAMES = sorted(SHAPES)
ORDER = tuple(reversed(range(len(NAMES))))  # gradient-ready: last leaf first
# c_big shares a group (the sampled selections on a slice of it); a_w is a
# group of one leaf (the layer-wise codec itself).
PLAN = Plan(num_leaves=8, groups=((7, 6, 5, 4, 3), (2, 1), (0,)))
W = harness.WORKERS


def _grads(seed: int = 0) -> dict[str, np.ndarray]:
  """``(STEPS, workers, *shape)`` float32; b_bias and d_w2 with tied magnitudes."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in SHAPES.items():
    g = rng.standard_normal((STEPS, W, *shape))
    if name in ("b_bias", "d_w2", "h_w3"):
      g = np.round(2 * g) / 2  # magnitudes in {0, 0.5, 1, ...}: many ties
    out[name] = g.astype(np.float32)
  return out


GRADS = _grads()
PARAMS = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def _builders():
  axis = harness.AXIS
  return {
    "topk": lambda: gradcomp.topk(RATIO, axis_name=axis, per_leaf=True),
    "topk_chunk": lambda: gradcomp.topk(RATIO, axis_name=axis, chunk=8, value_bits=2),
    # Templar's mean over senders (SparseLoCo's other reading).
    "topk_chunk_senders": lambda: gradcomp.topk(
      RATIO, axis_name=axis, chunk=8, value_bits=2, mean="senders"
    ),
    "randomk": lambda: gradcomp.randomk(RATIO, axis_name=axis, seed=3),
    "dgc": lambda: gradcomp.dgc(0.05, axis_name=axis, momentum=0.5),
    "sparse_quantize": lambda: gradcomp.sparse_quantize(
      1.0, max_ratio=RATIO, axis_name=axis
    ),
    # Two stages (densities 0.25 then 0.1), one step each; clipped leaves.
    "dgc_warmup": lambda: gradcomp.dgc(
      0.1, axis_name=axis, warmup_steps=1, clip_norm=5.0
    ),
  }


def _run(tx):
  """Per step: every worker's outputs, and every worker's state after the step."""
  return harness.every_step(tx, GRADS, PARAMS)


#: The codecs whose per-buffer form is run too (the must-fail case).
PER_BUFFER = ("topk", "randomk", "dgc", "sparse_quantize")


def _plans(build, per_buffer: bool = True):
  plans = {
    "layerwise": gradcomp.layerfusion(build(), "layerwise", order=ORDER),
    "per_leaf": gradcomp.layerfusion(build(), PLAN, per_leaf=True),
  }
  if per_buffer:
    plans["per_buffer"] = gradcomp.layerfusion(build(), PLAN, per_leaf=False)
  return plans


@pytest.fixture(scope="module", params=list(_builders()))
def runs(request):
  name = request.param
  plans = _plans(_builders()[name], per_buffer=name in PER_BUFFER)
  return name, {plan: _run(tx) for plan, tx in plans.items()}


def _leaves(buffers, plan: Plan) -> dict[str, np.ndarray]:
  """``{name: (STEPS, W, *shape)}`` from per-group buffers in plan order."""
  out = {}
  for group, value in zip(plan.groups, buffers, strict=True):
    flat = value.reshape(*value.shape[:2], -1)
    sizes = [math.prod(SHAPES[NAMES[i]]) for i in group]
    pieces = np.split(flat, np.cumsum(sizes)[:-1], axis=-1)
    for i, piece in zip(group, pieces, strict=True):
      out[NAMES[i]] = piece.reshape(*piece.shape[:2], *SHAPES[NAMES[i]])
  return out


def _state_buffers(state, name: str) -> list[list[np.ndarray]]:
  """The arrays of each group's state, per group (its leaves' order)."""
  return [jax.tree.leaves(s) for s in state.inner.leaves]


def _bits(x: np.ndarray) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


def _assert_bitwise(a: dict, b: dict):
  for k in NAMES:
    np.testing.assert_array_equal(_bits(a[k]), _bits(b[k]), err_msg=k)


def _states_by_leaf(state, plan: Plan) -> list[dict[str, np.ndarray]]:
  """Each state array of the groups (residual; or momentum, velocity) by leaf."""
  per_group = _state_buffers(state, "")
  width = {len(arrays) for arrays in per_group}
  assert len(width) == 1, width
  return [
    _leaves([arrays[a] for arrays in per_group], plan) for a in range(width.pop())
  ]


def test_per_leaf_equals_the_layerwise_plan_bit_for_bit(runs):
  name, by_plan = runs
  ref_out, ref_state = by_plan["layerwise"]
  out, state = by_plan["per_leaf"]
  _assert_bitwise(out, ref_out)
  for got, want in zip(
    _states_by_leaf(state, PLAN),
    _states_by_leaf(ref_state, Plan.layerwise(ORDER)),
    strict=True,
  ):
    _assert_bitwise(got, want)
  # Every worker holds the same mean.
  for k in NAMES:
    np.testing.assert_array_equal(out[k], np.broadcast_to(out[k][:, :1], out[k].shape))


def test_the_per_buffer_form_differs(runs):
  """Must fail: one budget per group is another algorithm (the test can fail)."""
  name, by_plan = runs
  if name not in PER_BUFFER:
    pytest.skip("run for the codecs of PER_BUFFER")
  ref_out, _ = by_plan["layerwise"]
  out, _ = by_plan["per_buffer"]
  differ = [k for k in NAMES if not np.array_equal(_bits(out[k]), _bits(ref_out[k]))]
  assert differ, name


def test_state_keeps_the_fused_layout(runs):
  name, by_plan = runs
  _, state = by_plan["per_leaf"]
  lead = (STEPS, W)
  sizes = [sum(math.prod(SHAPES[NAMES[i]]) for i in g) for g in PLAN.groups]
  for group, arrays, size in zip(
    PLAN.groups, _state_buffers(state, name), sizes, strict=True
  ):
    want = (*lead, *SHAPES[NAMES[group[0]]]) if len(group) == 1 else (*lead, size)
    assert arrays and all(a.shape == want for a in arrays), (name, group)


def test_error_feedback_conserves_the_gradient(runs):
  """Sent so far plus the mean residual is the mean gradient so far (float32 bound)."""
  name, by_plan = runs
  if name.startswith("dgc"):
    pytest.skip("DGC's memory is momentum-corrected, not e = r + g")
  if name == "topk_chunk_senders":  # its memory: test_sparseloco.py, float64
    pytest.skip("a mean over senders is not the mean of what was sent")
  out, state = by_plan["per_leaf"]
  residual = _states_by_leaf(state, PLAN)[0]
  u = 2.0**-24
  for k in NAMES:
    g = GRADS[k].astype(np.float64)
    sent = np.cumsum(out[k][:, 0].astype(np.float64), axis=0)
    kept = residual[k].astype(np.float64).mean(axis=1)
    want = np.cumsum(g.mean(axis=1), axis=0)
    scale = np.cumsum(np.abs(g).max(axis=1), axis=0)
    # Per step: r + g, the quantiser's rounding (2 bits: at most the value)
    # and the mean over W workers each round once per value.
    bound = (4 * STEPS + 2 * W) * u * scale
    if name == "topk_chunk":  # quantised values: what the code missed is kept
      bound = bound + 0.0
    np.testing.assert_array_less(np.abs(sent + kept - want), bound + 1e-30, err_msg=k)


def test_first_step_topk_is_numpys_per_leaf_selection(runs):
  """Step 1 (no residual yet): each worker's own k_j by a stable argsort."""
  name, by_plan = runs
  if name != "topk":
    pytest.skip("top-k's exact selection")
  out, _ = by_plan["per_leaf"]
  for k in NAMES:
    g = GRADS[k][0].reshape(W, -1)
    d = g.shape[1]
    if d == 0:
      continue
    keep = max(1, int(RATIO * d))
    total = np.zeros(d, np.float32)
    for w in range(W):  # the workers' scaled values, added in worker order
      chosen = np.argsort(-np.abs(g[w]), kind="stable")[:keep]
      total[chosen] += g[w][chosen] * np.float32(1.0 / W)
    np.testing.assert_array_equal(_bits(out[k][0, 0].reshape(-1)), _bits(total))


def _traced(tx):
  f = harness.sharded_update(tx, jit=False)
  one = harness.shard({k: v[0] for k, v in GRADS.items()})
  return f, (one, harness.worker_state(tx, PARAMS))


def _collectives(tx) -> dict[str, int]:
  """``{primitive: count}`` of the collectives in one traced step (branches too)."""
  f, args = _traced(tx)
  counts: dict[str, int] = {}

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      for kind in ("all_gather", "psum", "pmax"):  # e.g. all_gather_invariant
        if eqn.primitive.name.startswith(kind):
          counts[kind] = counts.get(kind, 0) + 1
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            visit(inner)

  visit(jax.make_jaxpr(f)(*args).jaxpr)
  return counts


# The two groups of several leaves send one collective each; the group of
# one leaf (a_w) runs the layer-wise codec itself: top-k's and DGC's values
# and indices (2), the tiles' positions, codes and steps (3), Strom's codes (1).
@pytest.mark.parametrize(
  "name, want",
  [
    ("topk", {"all_gather": 2 + 2}),
    ("topk_chunk", {"all_gather": 2 + 3}),
    ("randomk", {"psum": 3, "pmax": 1}),  # the key agreed, as leafwise agrees it
    ("dgc", {"all_gather": 2 + 2}),
    ("sparse_quantize", {"all_gather": 2 + 1}),
    ("dgc_warmup", {"all_gather": (2 + 2) * 2}),  # in each of the two stages
  ],
)
def test_one_collective_per_group(name, want):
  tx = gradcomp.layerfusion(_builders()[name](), PLAN, per_leaf=True)
  assert _collectives(tx) == want


@pytest.mark.parametrize("name", ["topk", "dgc", "sparse_quantize"])
def test_same_bytes_as_the_layerwise_plan(name):
  plans = _plans(_builders()[name])
  sent = {}
  for plan in ("per_leaf", "layerwise"):
    f, args = _traced(plans[plan])
    sent[plan] = gradcomp.wire_bytes(jax.jit(f), *args)
  assert sent["per_leaf"] == sent["layerwise"] > 0


def test_scopes_and_forms():
  assert scopes.scope_of(gradcomp.topk(0.1)) == scopes.BUFFER
  assert scopes.per_leaf_form(gradcomp.topk(0.1)) is None
  assert scopes.scope_of(gradcomp.topk(0.1, per_leaf=True)) == scopes.LEAF
  assert scopes.scope_of(gradcomp.topk(0.1, chunk=8)) == scopes.LEAF
  for tx in (
    gradcomp.topk(0.1, per_leaf=True),
    gradcomp.topk(0.1, chunk=8),
    gradcomp.randomk(0.1),
    gradcomp.dgc(0.1),
    gradcomp.sparse_quantize(0.5),
  ):
    assert scopes.per_leaf_form(tx) is not None
  # Labels of today's compressors are unchanged (profiles carry them).
  from gradcomp.compressors.spec import spec_of

  assert spec_of(gradcomp.topk(0.01)).label() == (
    "topk(error_feedback=True, ratio=0.01)"
  )
  with pytest.raises(ValueError, match="per_leaf must be True or False"):
    gradcomp.topk(0.1, per_leaf="yes")
  from gradcomp.compressors.randomk_groups import randomk_per_leaf

  with pytest.raises(ValueError, match="ratio"):
    randomk_per_leaf(1.5)
