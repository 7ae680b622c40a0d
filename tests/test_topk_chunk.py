"""Chunked, quantised top-k with decayed error feedback (SparseLoCo's codec).

Checked against a NumPy float64 transcription of the codec (Sarfi et al. 2025,
arXiv 2508.15706, Alg. 1's ``Q(Top-k(e))`` per tile, the decayed memory
``e <- beta e + g``), on 4 workers over three steps; the error-feedback mass
with a decay; the wire bytes of the compiled exchange; and that the defaults
are today's top-k (its label, its output).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import exchange
from gradcomp.compressors import spec as spec_lib
from gradcomp.compressors import topk as topk_lib
from gradcomp.kernels import bitfields, tiles
from gradcomp.optimizers import demo
from tests import harness

AXIS = "data"
N = 4  # workers of the reference comparison
STEPS = 3
U = float(np.finfo(np.float32).eps) / 2  # float32 unit roundoff
# Leaves: a matrix of 8 x 8 tiles (6 of them), a vector of chunks of 8, a scalar.
SHAPES = {"w": (16, 24), "b": (24,), "s": ()}
CHUNK, RATIO = 8, 0.125  # k = 8 of a 64-value tile, 1 of a vector's 8


@pytest.fixture(scope="module")
def mesh4():
  return Mesh(np.array(jax.devices()[:N]), (AXIS,))


def _steps(tx, mesh):
  """``f(grads, state)``: ``T`` updates of ``tx`` on the mesh's workers in a scan.

  Returns the per-step outputs (replicated) and the final per-worker state.
  """

  def steps(grads, state):
    grads = jax.tree.map(lambda g: g[:, 0], grads)
    state = gradcomp.drop_worker_axis(state)

    def body(state, g):
      out, state = tx.update(g, state)
      return state, out

    state, outs = jax.lax.scan(body, state, grads)
    return outs, gradcomp.add_worker_axis(state)

  f = jax.shard_map(
    steps, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS)), out_specs=(P(), P(AXIS))
  )
  return jax.jit(f)


def _grads(seed, workers=N, steps=STEPS):
  rng = np.random.default_rng(seed)
  return {
    k: rng.standard_normal((steps, workers, *s)).astype(np.float32)
    for k, s in SHAPES.items()
  }


def _run(tx, grads, mesh):
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state = gradcomp.add_worker_axis(tx.init(params), mesh.size)
  state = jax.device_put(state, NamedSharding(mesh, P(AXIS)))
  grads = jax.device_put(grads, NamedSharding(mesh, P(None, AXIS)))
  return _steps(tx, mesh)(grads, state)


# -- The float64 reference --------------------------------------------------


def _ref_tiles(x, chunk):
  """The leaf as (tiles, h * w), written out from the DeMo cut (no kernel code)."""
  shape = x.shape
  if len(shape) < 2:  # a scalar is a vector of one, a vector one row
    rows, cols = 1, max(1, math.prod(shape))
  else:  # more dimensions: (prod(shape[:-1]), shape[-1])
    rows, cols = math.prod(shape[:-1]), shape[-1]
  h, w = demo.chunk_size(rows, chunk), demo.chunk_size(cols, chunk)
  m = x.reshape(rows, cols)
  out = [
    m[i : i + h, j : j + w].reshape(-1)
    for i in range(0, rows, h)
    for j in range(0, cols, w)
  ]
  return np.stack(out), (rows, cols, h, w)


def _ref_untile(t, shape, dims):
  rows, cols, h, w = dims
  m = np.zeros((rows, cols))
  it = iter(t)
  for i in range(0, rows, h):
    for j in range(0, cols, w):
      m[i : i + h, j : j + w] = next(it).reshape(h, w)
  return m.reshape(shape)


def _ref_codec(e, bits, guards):
  """Per tile of ``e``: the decoded top k (dense), float64. Records its margins."""
  t, dims = _ref_tiles(e, CHUNK)
  k = max(1, math.floor(RATIO * t.shape[1]))
  sent = np.zeros_like(t)
  for i, row in enumerate(t):
    order = np.argsort(-np.abs(row), kind="stable")
    keep = order[:k]
    if k < row.size:  # the selection is away from a tie
      kth = abs(row[order[k - 1]])
      guards.append((kth - abs(row[order[k]])) / kth)
    v = row[keep]
    if bits != 32:
      levels = 2**bits
      rms = np.sqrt(np.mean(v**2))
      step = 6.0 * rms / levels
      z = v / step
      guards.append(np.min(np.abs(z - np.round(z)) / (1 + np.abs(z))))  # bin edges
      codes = np.clip(np.floor(z) + levels // 2, 0, levels - 1)
      v = (codes - levels // 2 + 0.5) * step
    sent[i, keep] = v
  return _ref_untile(sent, e.shape, dims)


def _reference(grads, bits, decay):
  """Alg. 1's memory and codec: per step the mean of the decoded payloads."""
  residual = {k: np.zeros((N, *s)) for k, s in SHAPES.items()}
  outs, guards = {k: [] for k in SHAPES}, []
  for t in range(STEPS):
    for k in SHAPES:
      total = 0.0
      for w in range(N):
        e = decay * residual[k][w] + grads[k][t, w].astype(np.float64)
        sent = _ref_codec(e, bits, guards)
        residual[k][w] = e - sent
        total = total + sent / N
      outs[k].append(total)
  return {k: np.stack(v) for k, v in outs.items()}, residual, min(guards)


@pytest.mark.parametrize(
  ("bits", "decay", "seed"), [(32, 0.9, 0), (2, 0.95, 0), (8, 1.0, 1)]
)
def test_matches_a_float64_transcription_on_4_workers(mesh4, bits, decay, seed):
  grads = _grads(seed)
  want_out, want_res, margin = _reference(grads, bits, decay)
  # The data are away from every tie and bin edge (relative to the values)
  # by 10x what float32 arithmetic moves them (~16 u: the memory's and the
  # RMS's roundings), so both sides pick the same values and codes. (The
  # seeds are ones whose data are: 8-bit bins are 1/128 of 3 RMS wide.)
  assert margin > 10 * 16 * U
  tx = gradcomp.topk(
    RATIO, chunk=CHUNK, value_bits=bits, ef_decay=decay, axis_name=AXIS
  )
  outs, state = _run(tx, grads, mesh4)
  # Float32 error bound: each step's memory, RMS (a mean of k = 8 squares),
  # step and decoded value round a few times, and the mean sums N terms:
  # (k + N + 8) u per step on the magnitudes, over STEPS steps.
  bound = STEPS * (8 + N + 8) * U
  for k in SHAPES:
    scale = np.max(np.abs(grads[k])) * STEPS
    np.testing.assert_allclose(outs[k], want_out[k], rtol=0, atol=bound * scale)
    got_res = np.asarray(state.leaves[k].residual)
    np.testing.assert_allclose(got_res, want_res[k], rtol=0, atol=bound * scale)
  assert np.any(outs["w"] != 0) and np.any(want_res["w"] != 0)  # can fail


@pytest.mark.parametrize(("chunk", "bits"), [(CHUNK, 2), (None, 32), (None, 3)])
def test_decayed_memory_conserves_the_decayed_mass(mesh4, chunk, bits):
  """(1/n) sum_w r_w,T + sum_t beta^(T-t) out_t = sum_t beta^(T-t) mean_w g_w,t."""
  decay = 0.8
  grads = _grads(seed=7)
  tx = gradcomp.topk(
    RATIO, chunk=chunk, value_bits=bits, ef_decay=decay, axis_name=AXIS
  )
  outs, state = _run(tx, grads, mesh4)
  weights = decay ** np.arange(STEPS - 1, -1, -1, dtype=np.float64)
  for k, s in SHAPES.items():
    g = grads[k].astype(np.float64).mean(axis=1)  # (T, ...)
    want = np.tensordot(weights, g, axes=1)
    residual = np.asarray(state.leaves[k].residual, np.float64).mean(axis=0)
    got = residual + np.tensordot(weights, np.asarray(outs[k], np.float64), axes=1)
    # Rounding only: a few float32 operations per step on values <= the
    # accumulated magnitude.
    scale = np.abs(grads[k]).max() * STEPS
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * STEPS * N * U * scale)
    assert np.any(residual != 0) or math.prod(s) <= 1


def test_wire_is_the_packed_payload():
  """Bytes each of 8 workers sends, from the compiled HLO, against the format."""
  shapes = {"w": (128, 128), "v": (100,), "s": ()}
  mesh = harness.mesh()
  sharding = NamedSharding(mesh, P(AXIS))
  args = {
    k: jax.ShapeDtypeStruct(
      (harness.WORKERS * (s[0] if s else 1), *s[1:]), jnp.float32, sharding=sharding
    )
    for k, s in shapes.items()
  }
  for bits, chunk in [(2, 64), (8, 64), (32, 64), (4, None)]:
    tx = gradcomp.topk(64 / 4096, chunk=chunk, value_bits=bits, axis_name=AXIS)

    def step(g, tx=tx):
      g = {k: (v if k != "s" else v[0]) for k, v in g.items()}
      return tx.update(g, tx.init(g))[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=P(AXIS), out_specs=P())
    expected = sum(
      topk_lib.payload_bytes(s, 64 / 4096, chunk, bits) for s in shapes.values()
    )
    assert gradcomp.wire_bytes(f, args) == expected, (bits, chunk)
  # The format, written out: 4 tiles x 64 values, 12-bit positions, 2-bit
  # codes and a float32 scale per tile; a vector of 100 in 2 chunks of 50,
  # 1 value each, 6-bit positions; the scalar, 1 value, no position bits.
  assert topk_lib.payload_bytes((128, 128), 64 / 4096, 64, 2) == 384 + 64 + 16
  assert topk_lib.payload_bytes((100,), 64 / 4096, 64, 2) == 2 + 1 + 8
  assert topk_lib.payload_bytes((), 64 / 4096, 64, 32) == 0 + 4


def test_tiles_are_demos():
  rng = np.random.default_rng(0)
  # Jitted: a cut and its inverse are one program per shape, not one per op.
  to_tiles = jax.jit(tiles.to_tiles, static_argnums=1)
  from_tiles = jax.jit(tiles.from_tiles, static_argnums=(1, 2))
  for shape in [(128, 128), (100,), (17,), (3, 5, 6), (), (96, 80), (1,)]:
    for chunk in (64, 8, 1):
      assert tiles.tile_shape(shape, chunk) == demo.tile_shape(shape, chunk)
      x = rng.standard_normal(shape).astype(np.float32)
      t = np.asarray(to_tiles(jnp.asarray(x), chunk))
      np.testing.assert_array_equal(t, _ref_tiles(x, chunk)[0])
      np.testing.assert_array_equal(from_tiles(jnp.asarray(t), shape, chunk), x)


@pytest.mark.parametrize("bits", [1, 5, 12, 31, 32])
def test_bitfields_round_trip(bits):
  codes = np.random.default_rng(bits).integers(0, 2**bits, 77, dtype=np.uint64)
  packed = bitfields.pack(jnp.asarray(codes.astype(np.uint32)), bits)
  assert packed.shape == (bitfields.packed_bytes(77, bits),) == (-(-77 * bits // 8),)
  np.testing.assert_array_equal(bitfields.unpack(packed, bits, 77), codes)


def test_defaults_are_todays_topk():
  g = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((40,)), jnp.float32)}
  today = gradcomp.topk(0.25)
  assert spec_lib.spec_of(today).label() == "topk(error_feedback=True, ratio=0.25)"
  same = gradcomp.topk(0.25, chunk=None, value_bits=32, ef_decay=1.0)
  assert spec_lib.spec_of(same).label() == spec_lib.spec_of(today).label()
  chunked = gradcomp.topk(0.25, chunk=8, value_bits=2, ef_decay=0.5)
  assert spec_lib.spec_of(chunked).label() == (
    "topk(chunk=8, ef_decay=0.5, error_feedback=True, ratio=0.25, value_bits=2)"
  )
  assert spec_lib.spec_of(chunked).name == "topk"
  rebuilt = spec_lib.spec_of(chunked).build(axis_name=None)
  state = chunked.init(g)
  # Jitted: one compile each, not one per primitive (eager).
  np.testing.assert_array_equal(
    jax.jit(rebuilt.update)(g, state)[0]["w"], jax.jit(chunked.update)(g, state)[0]["w"]
  )
  # chunk=None, 32 bits, a decay: today's wire and selection, a decayed memory.
  # (0.5 r is exact, so e below rounds once whether or not XLA fuses it.)
  decayed = gradcomp.topk(0.25, ef_decay=0.5)
  update = jax.jit(decayed.update)
  s1 = update(g, decayed.init(g))[1]
  out, _ = update(g, s1)
  e = 0.5 * np.asarray(s1.leaves["w"].residual) + np.asarray(g["w"])
  keep = np.argsort(-np.abs(e), kind="stable")[:10]
  want = np.zeros_like(e)
  want[keep] = e[keep]
  np.testing.assert_array_equal(out["w"], want)
  assert gradcomp.get("topk", ratio=0.25, chunk=8, value_bits=2) is not None


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"chunk": 0}, r"chunk must be an integer in \[1, inf\), got 0"),
    ({"chunk": 2.5}, r"chunk must be an integer in \[1, inf\), got 2.5"),
    ({"value_bits": 0}, r"value_bits must be an integer in \[1, 8\].*or 32.*got 0"),
    ({"value_bits": 16}, r"value_bits must be .*got 16"),
    ({"value_bits": True}, r"value_bits must be .*got True"),
    ({"ef_decay": -0.1}, r"ef_decay must be a number in \[0, 1\], got -0.1"),
    ({"ef_decay": 1.5}, r"ef_decay must be a number in \[0, 1\], got 1.5"),
    ({"ef_decay": 0.5, "error_feedback": False}, r"ef_decay .* must be 1.0"),
    ({"ratio": 0.0, "chunk": 8}, r"ratio must be in \(0, 1\], got 0.0"),
    (
      {"mean": "median", "chunk": 8},
      r"mean must be 'workers' or 'senders', got 'median'",
    ),
    ({"mean": "senders"}, r"mean='senders' is the tiled codec's.*chunk=None"),
  ],
)
def test_bad_hyperparameters_are_named(kwargs, message):
  kwargs = {"ratio": 0.1, **kwargs}
  with pytest.raises(ValueError, match=message):
    gradcomp.topk(**kwargs)


def test_a_mean_over_senders_needs_the_payloads_gathered():
  """A pattern's receivers sum one decoded payload at a time: no sender counts."""

  class OnePeer(exchange.Pattern):
    axis = "data"

  with pytest.raises(ValueError, match=r"mean='senders' needs the workers' payloads"):
    gradcomp.topk(0.1, chunk=8, mean="senders", axis_name=OnePeer())


def test_zeros_and_huge_values_stay_finite():
  """A zero tile has step 0 (sends zeros); values near float32's maximum saturate."""
  tx = gradcomp.topk(0.5, chunk=4, value_bits=2)
  g = {"w": jnp.array([0.0, 0.0, 0.0, 0.0, 3e38, -3e38, 1e38, 1.0])}
  out, state = jax.jit(lambda g: tx.update(g, tx.init(g)))(g)
  assert np.all(np.isfinite(out["w"])) and np.all(
    np.isfinite(state.leaves["w"].residual)
  )
  np.testing.assert_array_equal(out["w"][:4], 0.0)
  assert out["w"][4] > 0 > out["w"][5]  # signs kept


def test_a_servers_pushes_decode_each_workers_payload(mesh4):
  """Under ``exchange.Pushes`` (async_ps) each worker's payload is decoded alone.

  Every worker's decoded push equals the same codec run on that worker's
  gradient alone (one device, no exchange).
  """
  grads = _grads(seed=5, steps=1)
  tx = gradcomp.topk(RATIO, chunk=CHUNK, value_bits=2, axis_name=AXIS)
  spec = spec_lib.spec_of(tx)

  def push(g):
    g = jax.tree.map(lambda a: a[0, 0], g)
    pushes = exchange.Pushes(AXIS)
    codec = spec.build(axis_name=pushes)
    out, _ = codec.update(g, codec.init(g))
    return gradcomp.add_worker_axis((out, pushes.decoded))

  f = jax.shard_map(push, mesh=mesh4, in_specs=P(None, AXIS), out_specs=P(AXIS))
  own, decoded = jax.jit(f)(jax.device_put(grads, NamedSharding(mesh4, P(None, AXIS))))
  alone = spec.build(axis_name=None)
  # One compiled program for the four workers (eagerly, every primitive of the
  # codec compiled on its own: most of this test's time).
  alone_update = jax.jit(lambda g: alone.update(g, alone.init(g))[0])
  for w in range(N):
    g = {k: jnp.asarray(v[0, w]) for k, v in grads.items()}
    want = alone_update(g)
    for i, k in enumerate(sorted(SHAPES)):  # leaves in tree order
      np.testing.assert_array_equal(own[k][w], want[k])
      np.testing.assert_array_equal(decoded[i][0][w], want[k])
