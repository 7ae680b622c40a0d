"""hierarchical: reduce-scatter over the fast axis, compress over the slow one (issue 32).

On a (2 x 4) mesh ``("node", "local")`` (device ``w = 4 node + local``),
against NumPy references computed in float64 from the same float32
gradients. Every program is compiled once (a module-level cache) and runs
both the plain and the ``gather=False`` form, or both composition orders,
so the file compiles six small programs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import axes
from gradcomp.compressors.spec import spec_of
from gradcomp.parallel.branches import varying_axes

import harness

S, G = 2, 4  # nodes (slow axis), devices per node (fast axis)
MESH = jax.make_mesh((S, G), ("node", "local"))
BOTH = ("node", "local")
N = S * G
U = 2.0**-24  # float32 unit roundoff
RATIO = 0.25
STEPS = 3
SHAPES = {"kernel": (5, 6), "bias": (7,)}  # tree order: bias, kernel

rng = np.random.default_rng(0)
# Per step and device: a gradient of each leaf, shape (STEPS, N, *shape).
GRADS = {
  k: rng.standard_normal((STEPS, N, *shape)).astype(np.float32)
  for k, shape in SHAPES.items()
}


def _put(tree, spec):
  return jax.device_put(tree, NamedSharding(MESH, spec))


def _topk_node(g=True, **kw):
  return gradcomp.hierarchical(
    gradcomp.topk(RATIO, axis_name="node"), "local", gather=g, **kw
  )


def _worker_state(tx, params):
  """``tx.init`` (outside shard_map, under the mesh) with a leading device axis."""
  with jax.set_mesh(MESH):
    state = tx.init(params)
  return _put(gradcomp.add_worker_axis(state, N), P(BOTH))


def _steps_program(txs, params):
  """One jitted shard_map running each of ``txs`` for every step of its grads.

  Returns ``f(grads) -> ([outputs], [states])``: outputs of shape
  ``(N, STEPS, ...)`` (every device's view), final states with a leading
  device axis.
  """
  states = [_worker_state(tx, params) for tx in txs]

  def per_device(grads, states):
    grads = jax.tree.map(lambda x: x[:, 0], grads)
    outs, finals = [], []
    for tx, state in zip(txs, states, strict=True):

      def body(state, g, tx=tx):
        out, state = tx.update(g, state)
        return state, out

      state, out = jax.lax.scan(body, gradcomp.drop_worker_axis(state), grads)
      outs.append(out)
      finals.append(state)
    return gradcomp.add_worker_axis((outs, finals))

  f = jax.jit(
    jax.shard_map(
      per_device,
      mesh=MESH,
      in_specs=(P(None, BOTH), P(BOTH)),
      out_specs=P(BOTH),
    )
  )
  return lambda grads: jax.device_get(f(_put(grads, P(None, BOTH)), states))


# --- NumPy reference -------------------------------------------------------


def _chunks(flat, g=G):
  """``flat`` (..., d) zero-padded to g * c and split: (..., g, c)."""
  d = flat.shape[-1]
  c = -(-d // g)
  padded = np.concatenate([flat, np.zeros((*flat.shape[:-1], g * c - d))], axis=-1)
  return padded.reshape(*flat.shape[:-1], g, c)


def _topk_ef_over_nodes(units, ratio=RATIO):
  """Top-k with error feedback across the nodes, then the mean over them.

  ``units``: (STEPS, S, m) float64, each node's vector per step. Returns the
  (STEPS, m) means and the final (S, m) residuals.
  """
  steps, nodes, m = units.shape
  k = max(1, int(ratio * m))
  residual = np.zeros((nodes, m))
  out = np.zeros((steps, m))
  for t in range(steps):
    for n in range(nodes):
      e = residual[n] + units[t, n]
      top = np.argsort(-np.abs(e), kind="stable")[:k]
      sent = np.zeros(m)
      sent[top] = e[top]
      out[t] += sent / nodes
      residual[n] = e - sent
  return out, residual


def _node_means(grads):
  """Per leaf: (STEPS, S, d) float64, the mean over each node's devices."""
  return {
    k: np.asarray(g, np.float64).reshape(len(g), S, G, -1).mean(axis=2)
    for k, g in grads.items()
  }


def _reference_per_leaf(grads):
  """hierarchical(topk): per leaf and chunk j, top-k with EF across nodes.

  Returns per leaf the (STEPS, G, c) chunks of the output and the final
  (S, G, c) residuals (the residual of device (n, j) is [n, j]).
  """
  out, res = {}, {}
  for k, m in _node_means(grads).items():
    chunks = _chunks(m)  # (STEPS, S, G, c)
    per_j = [_topk_ef_over_nodes(chunks[:, :, j]) for j in range(G)]
    out[k] = np.stack([o for o, _ in per_j], axis=1)
    res[k] = np.stack([r for _, r in per_j], axis=1)
  return out, res


def _full(chunks, shape):
  """(STEPS, G, c) chunks -> (STEPS, *shape): concatenated, unpadded."""
  flat = chunks.reshape(chunks.shape[0], -1)[:, : int(np.prod(shape))]
  return flat.reshape(chunks.shape[0], *shape)


def _bound(grads, steps=STEPS):
  """Float32 error bound of hierarchical(topk) against the float64 reference.

  Per step the reduce-scatter sums g terms x / g (exact divisions by a power
  of two) in some order: error <= (g - 1) u sum_l |x_l| / g <= g u M, M the
  largest |gradient|. Adding it to the residual (|e| <= steps M) rounds
  once more: u steps M. Residuals carry every earlier step's error, and the
  mean of the sent values (x 1/2, exact) rounds once: after ``steps`` steps
  |error| <= steps (g + steps + 1) u M, provided top-k selects the same
  coordinates (the data's gaps between magnitudes are far wider).
  """
  m = max(float(np.max(np.abs(g))) for g in grads.values())
  return steps * (G + steps + 1) * U * m


# --- Programs, compiled once -----------------------------------------------

PARAMS = {k: jnp.zeros(shape, jnp.float32) for k, shape in SHAPES.items()}


@functools.cache
def _topk_run():
  f = _steps_program((_topk_node(True), _topk_node(False)), PARAMS)
  return f(GRADS)


@functools.cache
def _none_run():
  """hierarchical(none) in float32 and float16 beside the flat none, one step."""
  txs = (
    gradcomp.hierarchical(gradcomp.none("node"), "local"),
    gradcomp.hierarchical(gradcomp.none("node"), "local", scatter_dtype=jnp.float16),
    gradcomp.none(BOTH),
  )
  grads = {k: g[:1] for k, g in GRADS.items()}
  return _steps_program(txs, PARAMS)(grads)[0], grads


# --- Tests -----------------------------------------------------------------


def test_hierarchical_none_is_the_flat_mean():
  """Both compute sum_w x_w / 8 exactly, rounded in different orders.

  Each is within gamma_7 sum_w |x_w| / 8 <= 7 u mean_w |x_w| of the exact
  mean (divisions by powers of two are exact), so they differ by at most
  14 u mean_w |x_w|. The float16 scatter rounds each payload x / 4 and the
  4-term sum in float16 (u16 = 2^-11): per node <= 4 u16 sum_l |x_l| / 4,
  so <= 4 u16 mean_w |x_w| over the mean of both nodes, plus float32's.
  """
  (hier, hier16, flat), grads = _none_run()
  for k, g in grads.items():
    g = np.asarray(g[0], np.float64)  # (N, *shape)
    magnitude = np.abs(g).mean(axis=0)
    for out in (hier, hier16, flat):
      for w in range(1, N):  # the same on every device
        np.testing.assert_array_equal(out[k][w], out[k][0])
    np.testing.assert_array_less(
      np.abs(hier[k][0, 0] - flat[k][0, 0]), 14 * U * magnitude + 1e-45
    )
    np.testing.assert_array_less(
      np.abs(hier16[k][0, 0] - g.mean(axis=0)),
      (G * 2.0**-11 + 8 * U) * magnitude + 1e-45,
    )
  # The float16 payload did round: not the float32 result.
  assert any(not np.array_equal(hier16[k], hier[k]) for k in grads)


def test_hierarchical_topk_matches_the_reference_over_steps():
  (out, _), (state, _) = _topk_run()
  want, residual = _reference_per_leaf(GRADS)
  bound = _bound(GRADS)
  for k, shape in SHAPES.items():
    for w in range(N):
      np.testing.assert_allclose(out[k][w], _full(want[k], shape), rtol=0, atol=bound)
    # Device (n, j) keeps the residual of its chunk j only: c values.
    got = state.inner.leaves[k].residual  # (N, c)
    np.testing.assert_allclose(got, residual[k].reshape(N, -1), rtol=0, atol=bound)


def test_gather_false_returns_each_devices_shard():
  (_, shards), _ = _topk_run()
  want, _ = _reference_per_leaf(GRADS)
  bound = _bound(GRADS)
  for k in SHAPES:
    c = want[k].shape[-1]
    assert shards[k].shape == (N, STEPS, c)
    for w in range(N):
      np.testing.assert_allclose(shards[k][w], want[k][:, w % G], rtol=0, atol=bound)
  # unshard: the shards of one node, concatenated, are the leaves.
  full = gradcomp.fusion.unshard(
    {k: np.concatenate(list(shards[k][:G, -1])) for k in SHAPES}, PARAMS
  )
  for k, shape in SHAPES.items():
    np.testing.assert_allclose(full[k], _full(want[k], shape)[-1], atol=bound)


def test_both_composition_orders_with_layerfusion():
  """One fused buffer of (bias, kernel), in tree order.

  ``layerfusion(hierarchical(...), "single")`` scatters the fused buffer of
  37 values (c = 10): chunk j of the concatenation. ``hierarchical(
  layerfusion(..., "single"))`` scatters each leaf (c = 2 and 8) and fuses
  each device's chunks: chunk j of bias, then chunk j of kernel (10 values).
  """
  outer = gradcomp.layerfusion(_topk_node(), "single")
  inner = gradcomp.hierarchical(
    gradcomp.layerfusion(gradcomp.topk(RATIO, axis_name="node"), "single"), "local"
  )
  steps = 2
  grads = {k: g[:steps] for k, g in GRADS.items()}
  (got_outer, got_inner), _ = _steps_program((outer, inner), PARAMS)(grads)
  means = _node_means(grads)
  means = {k: m[:steps] for k, m in means.items()}
  sizes = {k: int(np.prod(s)) for k, s in SHAPES.items()}
  names = sorted(SHAPES)  # tree order

  # Outer: chunk j of the fused buffer.
  fused = _chunks(np.concatenate([means[k] for k in names], axis=-1))
  out = np.stack([_topk_ef_over_nodes(fused[:, :, j])[0] for j in range(G)], axis=1)
  flat = out.reshape(steps, -1)
  want_outer, start = {}, 0
  for k in names:
    want_outer[k] = flat[:, start : start + sizes[k]].reshape(steps, *SHAPES[k])
    start += sizes[k]

  # Inner: each leaf's chunk j, fused per device.
  chunked = {k: _chunks(means[k]) for k in names}  # (steps, S, G, c_k)
  per_j = []
  for j in range(G):
    units = np.concatenate([chunked[k][:, :, j] for k in names], axis=-1)
    per_j.append(_topk_ef_over_nodes(units)[0])
  want_inner, start = {}, 0
  for k in names:
    c = chunked[k].shape[-1]
    piece = np.stack([o[:, start : start + c] for o in per_j], axis=1)
    want_inner[k] = _full(piece, SHAPES[k])
    start += c

  bound = _bound(grads, steps)
  for got, want in ((got_outer, want_outer), (got_inner, want_inner)):
    for k in names:
      for w in range(N):
        np.testing.assert_allclose(got[k][w], want[k], rtol=0, atol=bound)
  assert not np.allclose(got_outer["kernel"][0], got_inner["kernel"][0])


def test_state_is_one_gth_of_the_flat_compressors():
  params = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}
  flat = jax.eval_shape(gradcomp.topk(0.01, axis_name=BOTH).init, params)
  tx = gradcomp.hierarchical(gradcomp.topk(0.01, axis_name="node"), "local")
  with jax.set_mesh(MESH):
    hier = jax.eval_shape(tx.init, params)
  # Without a mesh in context, the params' sharding says how big "local" is.
  placed = {
    "w": jax.ShapeDtypeStruct((1000,), jnp.float32, sharding=NamedSharding(MESH, P()))
  }

  def shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)

  assert shapes(jax.eval_shape(tx.init, placed)) == shapes(hier)
  assert flat.leaves["w"].residual.shape == (1000,)
  assert hier.inner.leaves["w"].residual.shape == (1000 // G,)
  with pytest.raises(ValueError, match="size of mesh axis .local. is unknown"):
    tx.init({"w": jnp.zeros(1000)})


def test_spec_and_axes_are_recorded():
  inner = gradcomp.topk(0.01, axis_name="node")
  tx = gradcomp.hierarchical(inner, "local", scatter_dtype=jnp.bfloat16)
  spec = spec_of(tx)
  assert spec.name == "hierarchical"
  assert dict(spec.arguments)["inner"] is inner
  assert spec.hyperparameters["fast_axis"] == "local"
  assert axes.group_of(tx) == BOTH
  assert axes.group_of(gradcomp.layerfusion(tx, "single")) == BOTH
  assert axes.group_of(_topk_node(False)) == BOTH


@pytest.mark.parametrize(
  "make, match",
  [
    (
      lambda: gradcomp.hierarchical(gradcomp.topk(0.1, axis_name="local"), "local"),
      r"inner's axis_name \('local',\) includes fast_axis 'local'",
    ),
    (
      lambda: gradcomp.hierarchical(gradcomp.topk(0.1, axis_name=BOTH), "local"),
      "includes fast_axis 'local'",
    ),
    (lambda: gradcomp.hierarchical(gradcomp.topk(0.1), "local"), "no mesh axis"),
    (
      lambda: gradcomp.hierarchical(
        gradcomp.layerfusion(gradcomp.topk(0.1), "single"), "local"
      ),
      "no mesh axis",
    ),
    (
      lambda: gradcomp.hierarchical(
        gradcomp.layerfusion(gradcomp.topk(0.1, axis_name="local"), "single"), "local"
      ),
      "includes fast_axis",
    ),
    (lambda: gradcomp.hierarchical(gradcomp.none("node"), ("local",)), "fast_axis"),
    (
      lambda: gradcomp.hierarchical(gradcomp.none("node"), "local", gather=1),
      "gather must be True or False, got 1",
    ),
    (
      lambda: gradcomp.hierarchical(
        gradcomp.none("node"), "local", scatter_dtype=jnp.int8
      ),
      "scatter_dtype must be None, float32, float16 or bfloat16, got int8",
    ),
  ],
)
def test_bad_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def _trace_with_params(tx, vary_over):
  """Traces one update whose params vary over ``vary_over`` (and only it)."""

  def step(g, p):
    g = g[0]
    p = {"w": p[0] if vary_over else p}
    missing = tuple(a for a in vary_over if a not in varying_axes(p["w"]))
    if missing:
      p = {"w": jax.lax.pcast(p["w"], missing, to="varying")}
    state = tx.init({"w": jnp.zeros(g.shape)})
    return tx.update({"w": g}, state, p)[0]["w"]

  g = jax.ShapeDtypeStruct((N, 8), jnp.float32, sharding=NamedSharding(MESH, P(BOTH)))
  if vary_over:
    spec = P(vary_over[0])
    p = jax.ShapeDtypeStruct(
      (MESH.shape[vary_over[0]], 8), jnp.float32, sharding=NamedSharding(MESH, spec)
    )
  else:
    spec = P()
    p = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(MESH, P()))
  f = jax.shard_map(step, mesh=MESH, in_specs=(P(BOTH), spec), out_specs=P())
  return jax.eval_shape(f, g, p)


def test_params_that_differ_across_either_axis_are_refused():
  tx = _topk_node()
  _trace_with_params(tx, ())  # replicated params pass
  for axis in BOTH:
    with pytest.raises(ValueError, match=f"params differ across {axis!r}"):
      _trace_with_params(tx, (axis,))
  fused = gradcomp.layerfusion(tx, "single")
  with pytest.raises(ValueError, match=r"params differ across 'local'.*params\['w'\]"):
    _trace_with_params(fused, ("local",))


def test_gather_false_takes_shards_as_params():
  """Shards differ across the fast axis by design; across the slow one they may not."""
  tx = _topk_node(False)

  def step(g, p, vary_node):
    g = g[0]
    p = gradcomp.fusion.shard({"w": p}, "local")
    if vary_node:
      p = jax.tree.map(lambda x: jax.lax.pcast(x, ("node",), to="varying"), p)
    return tx.update({"w": g}, tx.init({"w": jnp.zeros(8)}), p)[0]["w"]

  g = jax.ShapeDtypeStruct((N, 8), jnp.float32, sharding=NamedSharding(MESH, P(BOTH)))
  p = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(MESH, P()))

  def trace(vary_node):
    f = jax.shard_map(
      functools.partial(step, vary_node=vary_node),
      mesh=MESH,
      in_specs=(P(BOTH), P()),
      out_specs=P("local"),
    )
    return jax.eval_shape(f, g, p)

  assert trace(False).shape == (8,)  # 4 shards of 2
  with pytest.raises(ValueError, match="params differ across 'node'"):
    trace(True)

  def full_params(g, p):
    return tx.update({"w": g[0]}, tx.init({"w": jnp.zeros(8)}), {"w": p})[0]["w"]

  with pytest.raises(ValueError, match=r"leaf 0 has shape \(8,\), its shard \(2,\)"):
    jax.eval_shape(
      jax.shard_map(
        full_params, mesh=MESH, in_specs=(P(BOTH), P()), out_specs=P("local")
      ),
      g,
      p,
    )


# --- Hostile values (tests/test_bad_inputs.py's matrix) ----------------------

LEAVES, CASES = harness.HOSTILE_LEAVES, harness.HOSTILE_CASES


@functools.cache
def _hostile_program(kind):
  if kind == "topk":
    tx = _topk_node()
  else:  # the float16 scatter, the saturating path
    tx = gradcomp.hierarchical(
      gradcomp.none("node"), "local", scatter_dtype=jnp.float16
    )
  params = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in LEAVES.items()}
  f = _steps_program((tx,), params)

  def finite(state):
    return jax.tree.map(lambda x: np.all(np.isfinite(np.asarray(x, np.float32))), state)

  return lambda grads: (lambda r: (r[0][0], finite(r[1][0])))(f(grads))


def _hostile_grads(case):
  r = np.random.default_rng(1)
  out = {}
  for k, (shape, dtype) in LEAVES.items():
    g = r.standard_normal((2, N, *shape)).astype(dtype)
    g[0, 0] = harness.hostile(g[0, 0], case)
    out[k] = g
  return out


@pytest.mark.parametrize("kind", ["topk", "none_f16"])
def test_hostile_values_give_defined_outputs(kind):
  """A hostile step on device 0, then a clean step: state finite, the clean
  step finite and the same everywhere, finite outputs for finite inputs."""
  run = _hostile_program(kind)
  problems = []
  for case in CASES:
    grads = _hostile_grads(case)
    updates, state_finite = run(grads)
    # _steps_program returns the final state only: finite after both steps.
    if not all(jax.tree.leaves(state_finite)):
      problems.append(f"{case}: non-finite state")
    hostile_finite = all(
      np.all(np.isfinite(g[0].astype(np.float32))) for g in grads.values()
    )
    for k, (shape, dtype) in LEAVES.items():
      out = updates[k]
      assert out.dtype == jnp.dtype(dtype) and out.shape == (N, 2, *shape)
      out = out.astype(np.float32)
      if hostile_finite and not np.all(np.isfinite(out[:, 0])):
        problems.append(f"{case}: finite inputs, non-finite {k!r} (hostile step)")
      if not np.all(np.isfinite(out[:, 1])):
        problems.append(f"{case}: non-finite {k!r} on the clean step")
      elif not all(np.array_equal(out[w, 1], out[0, 1]) for w in range(N)):
        problems.append(f"{case}: clean-step {k!r} differs between devices")
  assert not problems, "\n".join(problems)
