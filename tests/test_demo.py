"""DeMo (``gradcomp/optimizers/demo.py``) against a NumPy float64 transcription.

The transcription follows the paper's Algorithm 1 as the reference
implementation (bloc97/DeMo) runs it, with SciPy's DCT and NumPy's sort, and
shares no code with the module: decoupled weight decay, ``delta = beta *
delta + lr * g``, an orthonormal DCT-II of each chunk (1-D) or tile (2-D),
the top-k of each by magnitude, the transmitted part subtracted, the
(index, value) pairs of every worker averaged over their senders, the inverse
DCT and a sign step. Gradients are random and continuous, so ties in a
top-k or a decoded 0 have probability 0.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.fft
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.optimizers.demo import (
  DeMoState,
  chunked_dct,
  chunked_idct,
  demo,
  payload_bytes,
)
from gradcomp.parallel import wire

# One worker runs the module: its tests share the module's DeMo run (``run``), built
# once.
pytestmark = pytest.mark.xdist_group("demo")

AXIS = "data"
WORKERS = 4
STEPS = 5
CHUNK, TOPK, BETA, WD = 8, 3, 0.9, 0.1
# chunk 8 does not divide 20 (chunks of 5) nor 12 (tiles of 6 x 8); "conv" is
# the 6 x 8 matrix (2 * 3, 8); "bias" is smaller than topk (clamped to 2).
SHAPES = {"vec": (20,), "mat": (12, 16), "conv": (2, 3, 8), "bias": (2,), "scalar": ()}


def lr_schedule(count):
  return 0.01 * (1.0 + count)


# The reference, NumPy float64 and SciPy only.


def _split(n: int, chunk: int) -> int:
  return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def _tiling(shape, chunk):
  if len(shape) == 0:
    rows, cols = 1, 1
  elif len(shape) == 1:
    rows, cols = 1, shape[0]
  else:
    rows, cols = math.prod(shape[:-1]), shape[-1]
  return rows, cols, _split(rows, chunk), _split(cols, chunk)


def np_dct(x, chunk):
  """(tiles, h * w): scipy's orthonormal DCT-II of each h x w tile, row-major."""
  rows, cols, h, w = _tiling(x.shape, chunk)
  t = x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
  return scipy.fft.dctn(t, axes=(2, 3), norm="ortho").reshape(-1, h * w)


def np_idct(c, shape, chunk):
  rows, cols, h, w = _tiling(shape, chunk)
  t = scipy.fft.idctn(c.reshape(rows // h, cols // w, h, w), axes=(2, 3), norm="ortho")
  return t.transpose(0, 2, 1, 3).reshape(shape)


def np_top(c, topk):
  """Mask of the top-k magnitudes of each row."""
  k = min(topk, c.shape[1])
  mask = np.zeros(c.shape, bool)
  np.put_along_axis(mask, np.argsort(-np.abs(c), axis=1)[:, :k], True, axis=1)
  return mask


def reference(grads, params, steps, decayed=None):
  """Per step: updates (replicated), every worker's delta, and its largest
  magnitude before the subtraction (the error scale), float64. ``decayed``:
  the leaves weight decay reaches (``None``: all)."""
  decayed = decayed or dict.fromkeys(SHAPES, True)
  delta = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(WORKERS)]
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  all_updates, all_deltas, all_scales = [], [], []
  for t in range(steps):
    lr = lr_schedule(t)
    updates, scales = {}, [{} for _ in range(WORKERS)]
    for name, shape in SHAPES.items():
      sums, senders = 0.0, 0
      for w in range(WORKERS):
        d = BETA * delta[w][name] + lr * np.asarray(grads[name][t, w], np.float64)
        scales[w][name] = np.abs(d).max()
        c = np_dct(d, CHUNK)
        mask = np_top(c, TOPK)
        delta[w][name] = d - np_idct(np.where(mask, c, 0.0), shape, CHUNK)
        sums, senders = sums + np.where(mask, c, 0.0), senders + mask
      mean = np.where(senders > 0, sums / np.maximum(senders, 1), 0.0)
      decoded = np_idct(mean, shape, CHUNK)
      decay = -lr * WD * params[name] if decayed[name] else 0.0
      updates[name] = decay - lr * np.sign(decoded)
      params[name] = params[name] + updates[name]
    all_updates.append(updates)
    all_deltas.append([dict(d) for d in delta])
    all_scales.append(scales)
  return all_updates, all_deltas, all_scales


# The JAX run: STEPS steps of WORKERS workers under shard_map, in one program.


def _mesh():
  return jax.make_mesh((WORKERS,), (AXIS,), devices=jax.devices()[:WORKERS])


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  grads = {
    k: rng.standard_normal((STEPS, WORKERS, *s)).astype(np.float32)
    for k, s in SHAPES.items()
  }
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  return grads, params


def _tx(mask=None):
  return demo(
    lr_schedule,
    beta=BETA,
    chunk=CHUNK,
    topk=TOPK,
    weight_decay=WD,
    mask=mask,
    axis_name=AXIS,
  )


def _steps(tx):
  """shard_map of a scan over steps: each step's updates and state, per worker."""

  def run(grads, state, params):
    one = gradcomp.drop_worker_axis((state, params))
    grads = jax.tree.map(lambda g: g[:, 0], grads)

    def body(carry, g):
      state, params = carry
      updates, state = tx.update(g, state, params)
      return (state, optax.apply_updates(params, updates)), (updates, state.delta)

    _, per_step = jax.lax.scan(body, one, grads)
    return jax.tree.map(lambda x: x[:, None], per_step)

  return jax.jit(
    jax.shard_map(
      run,
      mesh=_mesh(),
      in_specs=(P(None, AXIS), P(AXIS), P(AXIS)),
      out_specs=P(None, AXIS),
    )
  )


def _run(tx):
  grads, params = _inputs()
  sharded = NamedSharding(_mesh(), P(AXIS))
  state = jax.device_put(gradcomp.add_worker_axis(tx.init(params), WORKERS), sharded)
  stacked = jax.device_put(gradcomp.add_worker_axis(params, WORKERS), sharded)
  grads_on = jax.device_put(grads, NamedSharding(_mesh(), P(None, AXIS)))
  updates, deltas = jax.device_get(_steps(tx)(grads_on, state, stacked))
  return grads, params, updates, deltas


@pytest.fixture(scope="module")
def run():
  return _run(_tx())


def test_chunked_dct_is_scipys_orthonormal_dct_per_chunk_and_tile():
  rng = np.random.default_rng(1)
  for shape in [(20,), (12, 16), (2, 3, 8), (7,), ()]:
    x = rng.standard_normal(shape)
    got = np.asarray(chunked_dct(jnp.asarray(x, jnp.float32), CHUNK))
    want = np_dct(x, CHUNK)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    back = chunked_idct(jnp.asarray(want, jnp.float32), shape, CHUNK)
    np.testing.assert_allclose(np.asarray(back), x, rtol=1e-5, atol=1e-5)
  # The layout, spelled out: 20 is cut in chunks of 5, 12 x 16 in 6 x 8 tiles.
  x = rng.standard_normal((12, 16))
  tiles = np.asarray(chunked_dct(jnp.asarray(x, jnp.float32), CHUNK))
  assert tiles.shape == (4, 48)
  np.testing.assert_allclose(
    tiles[1].reshape(6, 8), scipy.fft.dctn(x[:6, 8:], norm="ortho"), atol=1e-5
  )
  v = rng.standard_normal(20)
  chunks = np.asarray(chunked_dct(jnp.asarray(v, jnp.float32), CHUNK))
  np.testing.assert_allclose(chunks[3], scipy.fft.dct(v[15:], norm="ortho"), atol=1e-5)


def test_matches_the_numpy_reference_on_4_workers(run):
  grads, params, updates, deltas = run
  want_updates, want_deltas, scales = reference(grads, params, STEPS)
  # float32 against float64, unit roundoff u = 6e-8. Each step applies four
  # matrix products to delta (a DCT and an inverse per tile axis), each a sum
  # of at most 8 terms with |D| <= 1: each errs by at most about 8 u times
  # the sum of the terms' magnitudes, <= 8 sqrt(8) u = 1.4e-6 of delta's
  # largest magnitude. With the subtraction and the momentum update that is
  # under 1e-5 per step, and beta = 0.9 damps what accumulates over 5 steps
  # (sum 0.9^j < 5, while the scale grows with lr): atol 5e-5 of the step's
  # largest |delta| before the subtraction (after it, a chunk sent whole is
  # 0). Observed: 2e-7. Updates are -lr * wd * p - lr * sign(...): the signs
  # agree exactly (no decoded value within 1e-5 of 0, no top-k tie within
  # 1e-5), the rest is float32 arithmetic on p and lr, a few u: rtol 1e-5.
  for t in range(STEPS):
    for name in SHAPES:
      got = updates[name][t]  # (workers, ...): every worker's view
      for w in range(WORKERS):
        np.testing.assert_allclose(
          got[w], want_updates[t][name], rtol=1e-5, atol=1e-7, err_msg=f"{t} {name}"
        )
        want = want_deltas[t][w][name]
        np.testing.assert_allclose(
          deltas[name][t, w],
          want,
          rtol=0,
          atol=5e-5 * scales[t][w][name],
          err_msg=f"step {t}, worker {w}, {name}",
        )


def test_delta_before_is_transmitted_plus_delta_after(run):
  """Mass conservation, per worker and step: what left delta is exactly the
  inverse DCT of the top-k coefficients of each tile of delta before the
  subtraction, and delta after has nothing left at those coefficients."""
  grads, _, _, deltas = run
  for name, shape in SHAPES.items():
    for w in range(WORKERS):
      previous = np.zeros(shape)
      for t in range(STEPS):
        after = np.asarray(deltas[name][t, w], np.float64)
        before = BETA * previous + lr_schedule(t) * grads[name][t, w]
        c_before, transmitted = np_dct(before, CHUNK), np_dct(before - after, CHUNK)
        mask = np_top(c_before, TOPK)
        scale = 1e-5 * np.abs(c_before).max()
        np.testing.assert_allclose(
          transmitted, np.where(mask, c_before, 0.0), atol=scale
        )
        np.testing.assert_allclose(np_dct(after, CHUNK)[mask], 0.0, atol=scale)
        previous = after


def test_pmap_matches_the_reference_first_step(run):
  grads, params, _, _ = run
  tx = _tx()
  devices = jax.devices()[:WORKERS]
  first = jax.tree.map(lambda g: g[0], grads)
  updates, state = jax.pmap(tx.update, axis_name=AXIS, devices=devices)(
    first,
    gradcomp.add_worker_axis(tx.init(params), WORKERS),
    gradcomp.add_worker_axis(params, WORKERS),
  )
  want_updates, want_deltas, scales = reference(grads, params, 1)
  for name in SHAPES:
    for w in range(WORKERS):
      np.testing.assert_allclose(updates[name][w], want_updates[0][name], rtol=1e-5)
      np.testing.assert_allclose(
        state.delta[name][w],
        want_deltas[0][w][name],
        rtol=0,
        atol=5e-5 * scales[0][w][name],
      )
  assert state.count.tolist() == [1] * WORKERS


def test_wire_carries_only_indices_and_values():
  """Compiled HLO of one step on 8 workers: all-gathers only, of uint8 /
  uint16 positions and float32 values, as many bytes as ``topk`` pairs per
  tile: 20 (one chunk of 20), 32 x 48 (two 32 x 24 tiles, 768 positions:
  uint16), (2, 3, 8) (one 6 x 8 tile), a scalar (one value, k = 1)."""
  mesh = jax.make_mesh((8,), (AXIS,))
  chunk, topk = 32, 5
  tx = demo(0.1, chunk=chunk, topk=topk, axis_name=AXIS)
  shapes = {"vec": (20,), "mat": (32, 48), "conv": (2, 3, 8), "scalar": ()}

  def step(g, p):
    return tx.update(gradcomp.drop_worker_axis(g), tx.init(p), p)[0]

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P()))
  g = {
    k: jax.ShapeDtypeStruct((8, *s), jnp.float32, sharding=NamedSharding(mesh, P(AXIS)))
    for k, s in shapes.items()
  }
  p = {
    k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P()))
    for k, s in shapes.items()
  }
  text = f.lower(g, p).compile().as_text()
  got = wire.collective_bytes(text)
  # (tiles, k, index bytes) per leaf; values are 4 bytes each.
  budget = {"vec": (1, 5, 1), "mat": (2, 5, 2), "conv": (1, 5, 1), "scalar": (1, 1, 1)}
  want = sum(tiles * k * (index + 4) for tiles, k, index in budget.values())
  assert want == sum(payload_bytes(s, chunk, topk) for s in shapes.values())
  assert got["all-gather"] == want == 115
  assert sum(got.values()) == got["all-gather"]  # no all-reduce, no other collective
  gathered = sorted(
    line.split("=")[1].split("{")[0].strip()
    for line in text.splitlines()
    if " all-gather(" in line
  )
  assert gathered == sorted(
    ["u8[8,1,5]", "f32[8,1,5]", "u16[8,2,5]", "f32[8,2,5]"]
    + ["u8[8,1,5]", "f32[8,1,5]", "u8[8,1,1]", "f32[8,1,1]"]
  )


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"learning_rate": 0.0}, r"learning_rate must be a finite number > 0, got 0.0"),
    ({"learning_rate": float("nan")}, r"learning_rate must be .*got nan"),
    ({"beta": 1.0}, r"beta must be in \[0.0, 1.0\), got 1.0"),
    ({"beta": -0.5}, r"beta must be in \[0.0, 1.0\), got -0.5"),
    ({"chunk": 0}, r"chunk must be an integer in \[1, inf\), got 0"),
    ({"chunk": 8.0}, r"chunk must be an integer in \[1, inf\), got 8.0"),
    ({"topk": 0}, r"topk must be an integer in \[1, inf\), got 0"),
    ({"weight_decay": -0.1}, r"weight_decay must be a finite number >= 0, got -0.1"),
  ],
)
def test_bad_hyper_parameters_raise_naming_them(kwargs, message):
  kwargs = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(ValueError, match=message):
    demo(**kwargs)


def test_update_needs_params():
  tx = demo(0.1)
  g = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="needs params"):
    tx.update(g, tx.init(g))


def test_bf16_params_and_hostile_finite_gradients():
  """bf16 params: float32 state, bf16 updates of -lr * sign (no weight decay);
  finite gradients at float32's edge (|g| up to 3e38, lr 10) leave a finite
  state and finite updates. One compiled update for both."""
  shapes = {"w": ((8, 12), jnp.bfloat16), "b": ((10,), jnp.bfloat16)}
  shapes["f"] = ((6, 4), jnp.float32)
  params = {k: jnp.ones(s, d) for k, (s, d) in shapes.items()}
  rng = np.random.default_rng(2)
  tx = demo(10.0, chunk=4, topk=2)
  update = jax.jit(tx.update)

  def run(scale):
    state = tx.init(params)
    for _ in range(3):
      grads = {
        k: jnp.asarray(np.clip(scale * rng.standard_normal(s), -3e38, 3e38), d)
        for k, (s, d) in shapes.items()
      }
      updates, state = update(grads, state, params)
    return updates, state

  updates, state = run(1.0)
  assert isinstance(state, DeMoState)
  for k, (_, dtype) in shapes.items():
    assert updates[k].dtype == dtype
    assert state.delta[k].dtype == jnp.float32
    magnitudes = set(np.abs(np.asarray(updates[k], np.float32)).ravel().tolist())
    assert magnitudes <= {10.0, 0.0}, magnitudes
  updates, state = run(1e38)
  for leaf in jax.tree.leaves((updates, state)):
    assert np.isfinite(np.asarray(leaf, np.float32)).all()
  assert np.abs(np.asarray(state.delta["f"])).max() > 1e30  # it did saturate


def test_apply_if_finite_skips_a_nan_step():
  """The library's guard: a NaN step returns zero updates and keeps delta."""
  tx = gradcomp.apply_if_finite(demo(0.1, chunk=4, topk=1), max_consecutive_errors=2)
  update = jax.jit(tx.update)
  params = {"w": jnp.zeros(4)}
  g = {"w": jnp.array([1.0, 2.0, 3.0, 4.0])}
  _, state = update(g, tx.init(params), params)
  delta = np.asarray(state.inner_state.delta["w"])
  updates, state = update({"w": g["w"].at[1].set(jnp.nan)}, state, params)
  assert np.asarray(updates["w"]).tolist() == [0.0] * 4
  np.testing.assert_array_equal(state.inner_state.delta["w"], delta)
  assert int(state.notfinite_count) == 1 and int(state.inner_state.count) == 1


# The weight-decay mask (optax.adamw's convention): AdamW's rule, matrices
# decayed and vectors not, as the transformer study compares DeMo with AdamW.
MASK = {k: len(s) >= 2 for k, s in SHAPES.items()}


def test_mask_matches_the_reference_with_decay_on_the_masked_leaves_only():
  """4 workers, 5 steps, the callable form of the mask (the program's
  ``decay_mask``): the reference with decay on "mat" and "conv" only, at the
  same tolerances as the unmasked comparison."""
  grads, params, updates, deltas = _run(
    _tx(mask=lambda p: jax.tree.map(lambda x: np.ndim(x) >= 2, p))
  )
  want_updates, want_deltas, scales = reference(grads, params, STEPS, MASK)
  unmasked, _, _ = reference(grads, params, STEPS)
  for t in range(STEPS):
    for name in SHAPES:
      for w in range(WORKERS):
        np.testing.assert_allclose(
          updates[name][t, w], want_updates[t][name], rtol=1e-5, atol=1e-7
        )
        np.testing.assert_allclose(
          deltas[name][t, w],
          want_deltas[t][w][name],
          rtol=0,
          atol=5e-5 * scales[t][w][name],
        )
  # The masked leaves did lose their decay (the test can tell).
  assert not np.allclose(want_updates[-1]["vec"], unmasked[-1]["vec"], rtol=1e-3)


@pytest.mark.parametrize(
  "mask",
  [MASK, {"vec": False, "mat": True, "conv": True, "bias": False, "scalar": False}],
  ids=["tree", "same"],
)
def test_masked_leaves_keep_their_params_under_a_zero_gradient(mask):
  """Closed form: a zero gradient leaves the momentum 0 and the decoded
  direction 0 (sign 0), so each step is the decay alone: a decayed leaf is
  ``p_0 prod_s (1 - lr_s wd)`` after the steps, a masked one stays ``p_0``."""
  _, params = _inputs()
  params = {k: jnp.asarray(v) for k, v in params.items()}
  tx = demo(lr_schedule, chunk=CHUNK, topk=TOPK, weight_decay=WD, mask=mask)
  update = jax.jit(tx.update)
  zeros = jax.tree.map(jnp.zeros_like, params)
  state, p = tx.init(params), params
  for _ in range(STEPS):
    updates, state = update(zeros, state, p)
    p = optax.apply_updates(p, updates)
  factor = np.prod([1 - lr_schedule(t) * WD for t in range(STEPS)])
  for name in SHAPES:
    p0 = np.asarray(params[name], np.float64)
    want = p0 * factor if mask[name] else p0
    # Each step rounds lr * wd * p and p + update: a few u of |p| per step.
    atol = 4 * STEPS * np.finfo(np.float32).eps * np.abs(p0).max()
    np.testing.assert_allclose(np.asarray(p[name]), want, rtol=0, atol=atol)
    if not mask[name]:
      np.testing.assert_array_equal(np.asarray(p[name]), np.asarray(params[name]))


def test_a_mask_prefix_decays_whole_subtrees():
  params = {"a": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}, "c": jnp.ones(4)}
  tx = demo(0.1, chunk=4, topk=1, weight_decay=0.5, mask={"a": False, "c": True})
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  assert not np.any(updates["a"]["w"]) and not np.any(updates["a"]["b"])
  np.testing.assert_allclose(updates["c"], -0.05, rtol=1e-6)


@pytest.mark.parametrize(
  ("mask", "message"),
  [
    ({"w": 1}, r"mask must be a tree of Python bools .*got a leaf 1"),
    (lambda p: {"w": True, "x": True}, "mask must have the params' tree structure"),
  ],
)
def test_a_bad_mask_is_named(mask, message):
  params = {"w": jnp.ones(4)}
  with pytest.raises(ValueError, match=message):
    tx = demo(0.1, weight_decay=0.1, mask=mask)
    tx.update(params, tx.init(params), params)
