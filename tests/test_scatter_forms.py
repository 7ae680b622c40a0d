"""The reduce-scatter forms (exchange="scatter", compressors/scatter.py), issue 32.

Every scatter form runs three steps on 8 workers (and on one device) in one
compiled program, and each step is checked against a NumPy reference of the
two-stage exchange fed with the program's own state before that step:
worker error, per-chunk encoding, all-to-all, the owner's mean (or vote)
plus its server error, its re-encoding, all-gather. The references round in
float32 as the codecs do and draw the same counter-based uniforms (the same
key derivation), so they agree to a bound on float32 reductions taken in
another order. The same program gives the wire bytes of its HLO (against a
closed form per codec, and the payloads' dtypes) and mass conservation.
"""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import exchange, intq, memory, scatter
from gradcomp.compressors.intq import Int8ErrorFeedbackState
from gradcomp.kernels import hashing
from gradcomp.parallel import wire

import harness

N = harness.WORKERS
STEPS = 3
U = 2.0**-24  # float32 unit roundoff
SHAPES = {"m": (6, 5), "v": (37,)}  # d = 30 and 37: 8 chunks of 4 and 5, the last short
F32 = np.float32

# name: (factory, keyword arguments)
CASES = {
  "signsgd": ("signsgd", {}),
  "ef_signsgd": ("ef_signsgd", {}),
  "onebit_sgd": ("onebit_sgd", {}),
  "qsgd": ("qsgd", {"levels": 4, "bucket_size": 2}),
  "qsgd_ef": ("qsgd", {"levels": 4, "bucket_size": 2, "error_feedback": True}),
  "terngrad": ("terngrad", {}),
  "fixed_point_ef": ("fixed_point", {"bits": 8, "int_bits": 2, "error_feedback": True}),
  "dynamic_nearest_ef": (
    "dynamic_fixed_point",
    {"bits": 8, "block_size": 2, "rounding": "nearest", "error_feedback": True},
  ),
  "dynamic_stochastic": ("dynamic_fixed_point", {"bits": 4, "block_size": 3}),
  "int8": ("int_quantize", {"bits": 8, "block_size": 2}),
  "int4": ("int_quantize", {"bits": 4, "block_size": 3}),
}


def build(case, axis_name):
  factory, kwargs = CASES[case]
  return gradcomp.get(factory, axis_name=axis_name, exchange="scatter", **kwargs)


def grads(seed, workers=N, scale=1.0):
  rng = np.random.default_rng(seed)
  return {
    k: (scale * rng.standard_normal((STEPS, workers, *s))).astype(F32)
    for k, s in SHAPES.items()
  }


def _compiled(tx, workers, g):
  """``tx`` over T steps of ``g`` (T, workers, ...) in one compiled program.

  Returns ``(updates, states, hlo)``: per step the update and the state
  before it, with leading axes (T, workers), and the optimized HLO.
  """
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}

  def steps(g, state):
    def body(state, g_t):
      updates, new = tx.update(g_t, state)
      return new, (updates, state)

    return jax.lax.scan(body, state, g)[1]

  if workers == 1:
    state = tx.init(params)
    args = (jax.tree.map(lambda x: x[:, 0], g), state)

    def run(g, state):
      return jax.tree.map(lambda x: x[:, None], steps(g, state))

  else:
    state = harness.worker_state(tx, params)
    args = (harness.shard(g, P(None, harness.AXIS)), state)

    def per_worker(g, state):
      g = jax.tree.map(lambda x: x[:, 0], g)
      out = steps(g, gradcomp.drop_worker_axis(state))
      return jax.tree.map(lambda x: x[:, None], out)

    run = jax.shard_map(
      per_worker,
      mesh=harness.mesh(),
      in_specs=(P(None, harness.AXIS), P(harness.AXIS)),
      out_specs=P(None, harness.AXIS),
    )
  compiled = jax.jit(run).lower(*args).compile()
  updates, states = jax.device_get(compiled(*args))
  return updates, states, compiled.as_text()


_RUNS = {}


def run_case(case, workers=N):
  """``(grads, updates, states, hlo)`` of ``case``'s scatter form, computed once."""
  if (case, workers) not in _RUNS:
    axis = harness.AXIS if workers > 1 else None
    g = grads(seed=zlib.crc32(case.encode()) % 1000 + workers, workers=workers)
    _RUNS[case, workers] = (g, *_compiled(build(case, axis), workers, g))
  return _RUNS[case, workers]


def errors_of(leaf_state):
  """``(worker_error, server_error)`` of a leaf's state (``None`` where not kept)."""
  worker = server = None
  if isinstance(leaf_state, memory.ErrorFeedbackState):
    worker, leaf_state = leaf_state.residual, leaf_state.inner
  if isinstance(leaf_state, scatter.ServerErrorState):
    server = leaf_state.error
  return worker, server


# -- NumPy references of the chunk codecs ---------------------------------------
# Each: enc(rows (m, c) float32, counts (m,), key, margins) -> decoded (m, c)
# float32. ``margins`` collects each decision's distance to its threshold, in
# units of the codec's full scale, where the reference's inputs may differ
# from the program's by rounding (scales from float32 sums taken in another
# order); the test asserts they exceed the rounding bound.


def _uniform(key, shape):
  return np.asarray(hashing.hash_uniform(key, shape))


def _signs(rows):
  return np.where(rows >= 0, F32(1), F32(-1))


def enc_vote(rows, counts, key, margins):
  return _signs(rows)


def enc_mean_sign(rows, counts, key, margins):
  peak = np.abs(rows).max(axis=1, keepdims=True)
  safe = np.where(peak > 0, peak, F32(1))
  mean = (np.abs(rows) / safe).astype(np.float64).sum(axis=1, keepdims=True)
  scale = (mean / counts[:, None] * safe).astype(F32)
  valid = np.arange(rows.shape[1]) < counts[:, None]
  margins.append(np.abs(rows[valid]) / max(peak.max(), F32(1e-30)))
  return _signs(rows) * np.where(peak > 0, scale, F32(0))


def enc_two_means(rows, counts, key, margins):
  valid = np.arange(rows.shape[1]) < counts[:, None]
  up = rows >= 0
  pos, neg = up & valid, ~up & valid
  n_pos = pos.sum(axis=1, keepdims=True)
  n_neg = neg.sum(axis=1, keepdims=True)
  x = rows.astype(np.float64)
  mean_pos = (
    np.where(pos, x, 0).sum(axis=1, keepdims=True) / np.maximum(n_pos, 1)
  ).astype(F32)
  mean_neg = (
    np.where(neg, x, 0).sum(axis=1, keepdims=True) / np.maximum(n_neg, 1)
  ).astype(F32)
  margins.append(np.abs(rows[valid]) / max(np.abs(rows).max(), 1e-30))
  return np.where(up, mean_pos, mean_neg)


def _row_parts(c, size):
  size = c if size is None else min(size, c)
  full = c // size
  return size, full, c - full * size


def _split(rows, c, size):
  size, full, tail = _row_parts(c, size)
  m = rows.shape[0]
  parts = [rows[:, : full * size].reshape(m, full, size)]
  if tail:
    parts.append(rows[:, full * size :].reshape(m, 1, tail))
  return parts


def enc_qsgd(levels, bucket_size):
  def enc(rows, counts, key, margins):
    out = []
    for i, part in enumerate(_split(rows, rows.shape[1], bucket_size)):
      u = _uniform(hashing.derive(key, i), part.shape)
      norm = np.sqrt((part.astype(np.float64) ** 2).sum(axis=-1, keepdims=True))
      scaled = np.abs(part) / np.where(norm > 0, norm, 1) * levels
      t = scaled + u
      margins.append(np.abs(t - np.round(t)) / levels)
      xi = np.minimum(np.floor(t), levels)
      out.append(
        (np.sign(part) * xi * (norm / levels)).astype(F32).reshape(rows.shape[0], -1)
      )
    return np.concatenate(out, axis=1)

  return enc


def enc_ternary(rows, counts, key, margins):
  scale = np.abs(rows).max(axis=1, keepdims=True)
  u = _uniform(key, rows.shape)
  keep = u * scale < np.abs(rows)
  return np.where(keep, np.sign(rows), F32(0)) * scale


def _to_codes(s, bits, u):
  low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
  c = np.clip(s, low, high)
  if u is None:
    return np.round(c)
  f = np.floor(c)
  return f + (u < c - f)


def enc_fixed(bits, frac_bits):
  def enc(rows, counts, key, margins):
    u = _uniform(key, rows.shape)
    return (
      _to_codes(rows * F32(2.0**frac_bits), bits, u) * F32(2.0**-frac_bits)
    ).astype(F32)

  return enc


def enc_dynamic(bits, block_size, stochastic):
  def enc(rows, counts, key, margins):
    u = _uniform(key, rows.shape) if stochastic else None
    c = rows.shape[1]
    us = _split(u, c, block_size) if stochastic else None
    out = []
    for i, part in enumerate(_split(rows, c, block_size)):
      top = np.abs(part).max(axis=-1, keepdims=True)
      e = np.clip(np.frexp(top)[1] - (bits - 1), -126, 128 - bits).astype(np.float64)
      s = part / 2.0**e
      codes = _to_codes(s, bits, us[i] if stochastic else None)
      out.append((codes * 2.0**e).astype(F32).reshape(rows.shape[0], -1))
    return np.concatenate(out, axis=1)

  return enc


def enc_int(bits, block_size):
  q = 2 ** (bits - 1) - 1

  def block(part):
    top = np.abs(part).max(axis=-1, keepdims=True)
    scale = np.where(top > 0, np.maximum(top * F32(1 / q), F32(2.0**-126)), F32(0))
    inverse = np.where(scale > 0, F32(1) / np.where(scale > 0, scale, F32(1)), F32(0))
    codes = np.round(np.clip(part * inverse, -q, q))
    return (codes * scale).reshape(part.shape[0], -1)

  def enc(rows, counts, key, margins):
    return np.concatenate(
      [block(p) for p in _split(rows, rows.shape[1], block_size)], 1
    )

  return enc


def _mean(decoded):
  n = decoded.shape[0]
  total = decoded[0] / F32(n)
  for w in range(1, n):
    total = total + decoded[w] / F32(n)
  return total


def _vote(decoded):
  total = decoded[0]
  for w in range(1, decoded.shape[0]):
    total = total + decoded[w]
  return total


REFERENCES = {
  "signsgd": (enc_vote, _vote),
  "ef_signsgd": (enc_mean_sign, _mean),
  "onebit_sgd": (enc_two_means, _mean),
  "qsgd": (enc_qsgd(4, 2), _mean),
  "qsgd_ef": (enc_qsgd(4, 2), _mean),
  "terngrad": (enc_ternary, _mean),
  "fixed_point_ef": (enc_fixed(8, 6), _mean),
  "dynamic_nearest_ef": (enc_dynamic(8, 2, False), _mean),
  "dynamic_stochastic": (enc_dynamic(4, 3, True), _mean),
  "int8": (enc_int(8, 2), _mean),
  "int4": (enc_int(4, 3), _mean),
}


def keys_for(state_key, leaf, n):
  """Per worker, the keys of its first encoding and of its owner's re-encoding.

  The derivation of ``base.leafwise`` (split, then a key per leaf),
  ``exchange.worker_key`` and ``scatter.stage_keys``.
  """
  step_key = jax.random.split(np.asarray(state_key))[1]
  leaf_key = hashing.derive(step_key, leaf)
  own = [leaf_key] if n == 1 else [hashing.derive(leaf_key, w) for w in range(n)]
  return [hashing.derive(k, 0) for k in own], [hashing.derive(k, 1) for k in own]


def reference_two_stage(y, server, enc, reduce, worker_keys, owner_keys):
  """The two-stage exchange of ``y`` (n, d) with server errors ``server`` (n, d) or None."""
  n, d = y.shape
  c = -(-d // n)
  counts = np.array([max(min(c, d - j * c), 1) for j in range(n)])
  margins = []
  rows = np.pad(y, ((0, 0), (0, n * c - d))).reshape(n, n, c)
  decoded = np.stack([enc(rows[w], counts, worker_keys[w], margins) for w in range(n)])
  sent = decoded.reshape(n, n * c)[:, :d]
  out = np.zeros(n * c, F32)
  new_server = None if server is None else server.copy()
  for j in range(n):
    valid = j * c + np.arange(c) < d
    z = reduce(decoded[:, j])
    if server is not None:
      own = np.pad(server[j], (0, n * c - d))[j * c : (j + 1) * c]
      z = z + own
    z = np.where(valid, z, F32(0)).astype(F32)
    own_decoded = enc(z[None], counts[j : j + 1], owner_keys[j], margins)[0]
    out[j * c : (j + 1) * c] = own_decoded
    if server is not None:
      lost = (z - own_decoded)[valid]
      new_server[j, j * c : j * c + valid.sum()] = lost
  margin = min((float(np.min(m)) for m in margins if m.size), default=np.inf)
  return out[:d], sent, new_server, margin


# Every case on 8 workers; on one device (n = 1: the worker owns the one
# chunk, the all-to-all is the identity) the cases that cover each kind of
# encoding: sign bits, a sum-scaled sign, stochastic buckets, exponents, int4.
ONE_DEVICE = ("signsgd", "ef_signsgd", "qsgd_ef", "dynamic_stochastic", "int4")


@pytest.mark.parametrize(
  "case,workers", [(c, N) for c in sorted(CASES)] + [(c, 1) for c in ONE_DEVICE]
)
def test_every_scatter_form_matches_its_numpy_reference(case, workers):
  g, updates, states, _ = run_case(case, workers)
  enc, reduce = REFERENCES[case]
  n = workers
  # Bound on the program's and the reference's float32 roundings taken in
  # another order, relative to the step's largest magnitude M: a float32 sum
  # of at most c + 1 terms (a chunk's scale; the sum of squares, or of
  # |x|, in [0, c]) errs by (c + 1) u relative, the square root halves that,
  # a scale's product and quotient add u each; the owner's mean of n decoded
  # chunks carries their scale's error plus n u; the server error's sum and
  # difference u each. With every term at most M in magnitude (the outputs
  # and decoded values are bounded by sqrt(2) M for the bucket norms of QSGD),
  # 2 (c + n + 8) u M bounds the difference, twice over.
  for t in range(STEPS):
    state_t = jax.tree.map(lambda x, t=t: x[t], states)
    for i, k in enumerate(sorted(SHAPES)):
      d = math.prod(SHAPES[k])
      c = -(-d // n)
      worker, server = errors_of(state_t.leaves[k])
      x = g[k][t].reshape(n, d)
      y = x if worker is None else (worker.reshape(n, d) + x).astype(F32)
      if server is not None:
        server = np.asarray(server, F32)
      worker_keys, owner_keys = keys_for(state_t.key[0], i, n)
      out, sent, new_server, margin = reference_two_stage(
        y, server, enc, reduce, worker_keys, owner_keys
      )
      M = max(np.abs(y).max(), np.abs(out).max(), np.abs(sent).max())
      if server is not None:
        M = max(M, np.abs(server).max())
      tol = 2 * (c + n + 8) * U * M
      # No decision of the reference lies within that bound of its threshold
      # (in units of the full scale), so the program took the same ones.
      assert margin > tol / max(M, 1e-30), (case, t, k, margin)
      got = updates[k][t].reshape(n, d)
      np.testing.assert_allclose(got, np.broadcast_to(out, got.shape), rtol=0, atol=tol)
      if t + 1 < STEPS:
        after = jax.tree.map(lambda x, t=t: x[t + 1], states)
        new_worker, new_server_got = errors_of(after.leaves[k])
        if new_worker is not None:
          np.testing.assert_allclose(
            new_worker.reshape(n, d), y - sent, rtol=0, atol=tol
          )
        if new_server is not None:
          np.testing.assert_allclose(new_server_got, new_server, rtol=0, atol=tol)


EF_CASES = (
  "ef_signsgd",
  "onebit_sgd",
  "qsgd_ef",
  "fixed_point_ef",
  "dynamic_nearest_ef",
  "int8",
  "int4",
)


@pytest.mark.parametrize("case", EF_CASES)
def test_error_feedback_conserves_mass(case):
  """mean_w(x_w + r_w) + sum_j s_j = output + mean_w(r'_w) + sum_j s'_j, per value.

  Each worker keeps r' = y - sent (y = x + r rounded, then one subtraction)
  and each owner s' = z - out, z = mean_w(sent_w) + s on its own chunk.
  In float32: y rounds by u|y|, r' by u|r'|, the owner's mean of n terms
  (each divided by n first) by n u mean_w|sent_w|, z by u|z|, s' by u|s'|.
  With |z| <= mean_w|sent_w| + |s|, the identity holds to
  u ((n + 1) mean_w(|y_w| + |sent_w| + |r'_w|) + 2 (|s| + |s'| + |out|)) per
  value, written below with a factor 2 to spare.
  """
  g, updates, states, _ = run_case(case)
  for t in range(STEPS - 1):
    before = jax.tree.map(lambda x, t=t: x[t], states)
    after = jax.tree.map(lambda x, t=t: x[t + 1], states)
    for k in SHAPES:
      d = math.prod(SHAPES[k])
      r, s = errors_of(before.leaves[k])
      r2, s2 = errors_of(after.leaves[k])
      x = g[k][t].reshape(N, d).astype(np.float64)
      r, r2 = r.reshape(N, d).astype(np.float64), r2.reshape(N, d).astype(np.float64)
      # Every owner's entries of its own chunk, summed: the server errors owed.
      owned = np.arange(d) // (-(-d // N))
      s_own = np.asarray(s, np.float64)[owned, np.arange(d)]
      s2_own = np.asarray(s2, np.float64)[owned, np.arange(d)]
      out = updates[k][t].reshape(N, d)[0].astype(np.float64)
      before_mass = (x + r).mean(axis=0) + s_own
      after_mass = out + r2.mean(axis=0) + s2_own
      y = x + r
      sent = y - r2
      bound = (
        2
        * U
        * (
          (N + 1) * (np.abs(y) + np.abs(sent) + np.abs(r2)).mean(axis=0)
          + 2 * (np.abs(s_own) + np.abs(s2_own) + np.abs(out))
        )
      )
      err = np.abs(before_mass - after_mass)
      assert np.all(err <= bound), (case, t, k, np.max(err / bound))


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_unbiased_quantizers_stay_unbiased(name):
  """The mean over T steps of the output is mean_w x_w, within 6 standard deviations.

  Variance of one step's output (independent over steps: fresh keys), from
  the two independent unbiased roundings: the owner's given the workers',
  plus the workers' averaged. TernGrad rounds x to 0 or s sign(x), variance
  |x| s - x^2 <= s^2 / 4, with s = max |x|: the workers' s_w <= S = max |x|,
  the owner's scale max |mean| <= S too, so Var <= S^2/4 + S^2/(4n). QSGD
  rounds between levels ||x_B|| / s apart, variance <= (||x_B|| / s)^2 / 4;
  a worker's bucket norm is at most sqrt(b) S, a decoded value at most that
  norm, so the owner's bucket norm is at most b S:
  Var <= (b S / s)^2 / 4 + (sqrt(b) S / s)^2 / (4 n).
  """
  levels, bucket, steps = 4, 2, 4000
  kwargs = {"levels": levels, "bucket_size": bucket} if name == "qsgd" else {}
  tx = gradcomp.get(name, axis_name=harness.AXIS, exchange="scatter", **kwargs)
  rng = np.random.default_rng(5)
  x = rng.standard_normal((N, 13)).astype(F32)
  params = {"w": jnp.zeros(13)}

  def body(g, state):
    g = {"w": g[0]}
    state = gradcomp.drop_worker_axis(state)

    def step(carry, _):
      state, total = carry
      out, state = tx.update(g, state)
      return (state, total + out["w"]), None

    (_, total), _ = jax.lax.scan(step, (state, jnp.zeros(13)), length=steps)
    return total[None]

  run = jax.jit(
    jax.shard_map(
      body,
      mesh=harness.mesh(),
      in_specs=(P(harness.AXIS), P(harness.AXIS)),
      out_specs=P(harness.AXIS),
    )
  )
  totals = np.asarray(run(harness.shard(x), harness.worker_state(tx, params)))
  mean = totals[0].astype(np.float64) / steps
  truth = x.astype(np.float64).mean(axis=0)
  S = float(np.abs(x).max())
  if name == "terngrad":
    var = S**2 / 4 + S**2 / (4 * N)
  else:
    var = (bucket * S / levels) ** 2 / 4 + (math.sqrt(bucket) * S / levels) ** 2 / (
      4 * N
    )
  # The float32 running sum of T outputs (each at most b S) errs by T u b S
  # at most; far below the statistical bound.
  bound = 6 * math.sqrt(var / steps) + steps * U * bucket * S
  assert np.all(np.abs(mean - truth) <= bound), np.max(np.abs(mean - truth) / bound)
  assert np.all(totals == totals[0])  # the same on every worker


# -- Wire bytes -----------------------------------------------------------------


def _sign_words(c):
  return 4 * math.ceil(c / 32)


def _parts(c, size):
  size = c if size is None else min(size, c)
  full, tail = divmod(c, size)
  return size, full, tail


def _int_bytes(c, bits, block):
  size, full, tail = _parts(c, block)
  codes = full * size if bits == 8 else math.ceil(full * size / 2) + math.ceil(tail / 2)
  if bits == 8:
    codes += tail
  return codes + 4 * (full + (tail > 0))


#: Closed forms: bytes of one chunk of c values, and its float32 scales.
CHUNK_BYTES = {
  "signsgd": (_sign_words, lambda c: 0),
  "ef_signsgd": (lambda c: _sign_words(c) + 4, lambda c: 1),
  "onebit_sgd": (lambda c: _sign_words(c) + 8, lambda c: 2),
  "qsgd": (
    lambda c: c + 4 * math.ceil(c / min(2, c)),
    lambda c: math.ceil(c / min(2, c)),
  ),
  "qsgd_ef": (
    lambda c: c + 4 * math.ceil(c / min(2, c)),
    lambda c: math.ceil(c / min(2, c)),
  ),
  "terngrad": (lambda c: math.ceil(c / 4) + 4, lambda c: 1),
  "fixed_point_ef": (lambda c: c, lambda c: 0),
  "dynamic_nearest_ef": (lambda c: c + math.ceil(c / min(2, c)), lambda c: 0),
  "dynamic_stochastic": (
    lambda c: math.ceil(c / 2) + math.ceil(c / min(3, c)),
    lambda c: 0,
  ),
  "int8": (lambda c: _int_bytes(c, 8, 2), lambda c: math.ceil(c / min(2, c))),
  "int4": (lambda c: _int_bytes(c, 4, 3), lambda c: math.ceil(c / min(3, c))),
}


def _collective_elements(hlo, kind):
  """{dtype: elements} of the results of every ``kind`` instruction in ``hlo``."""
  totals = {}
  for line in hlo.splitlines():
    m = wire._DEF.match(line)
    if (
      not m or m.group(3).removesuffix("-start") != kind or m.group(3).endswith("-done")
    ):
      continue
    for dtype, dims in wire._ARRAY.findall(m.group(2)):
      size = math.prod(int(x) for x in dims.split(",") if x)
      totals[dtype] = totals.get(dtype, 0) + size
  return totals


@pytest.mark.parametrize("case", sorted(CASES))
def test_hlo_wire_bytes_match_the_closed_form(case):
  """all-to-all: n chunks per leaf; all-gather: one; the packed codes' dtypes."""
  hlo = run_case(case)[3]
  got = wire.collective_bytes(hlo)
  chunk, scales = CHUNK_BYTES[case]
  want_a2a = want_ag = 0
  want_f32 = 0
  for shape in SHAPES.values():
    c = -(-math.prod(shape) // N)
    want_a2a += N * chunk(c)
    want_ag += chunk(c)
    want_f32 += N * scales(c)
  assert got["all-to-all"] == want_a2a and got["all-gather"] == want_ag, got
  assert got["all-reduce"] == got["reduce-scatter"] == got["collective-permute"] == 0
  # Floats on the wire are the scales only: the codes travel packed.
  for kind in ("all-to-all", "all-gather"):
    elements = _collective_elements(hlo, kind)
    assert elements.get("f32", 0) == want_f32, (kind, elements)
    assert set(elements) <= {"f32", "u32", "u8", "s8"}, elements
  # The library's own formula agrees.
  assert (
    sum(
      scatter.scatter_wire(_codec(case), math.prod(s), N)["all-to-all"]
      for s in SHAPES.values()
    )
    == want_a2a
  )


def _codec(case):
  from gradcomp.compressors import fixed_point, intq, onebit, quantizers, signs

  return {
    "signsgd": signs.SIGN_VOTE,
    "ef_signsgd": signs.MEAN_SIGN,
    "onebit_sgd": onebit.TWO_MEANS,
    "qsgd": quantizers.qsgd_chunks(4, 2),
    "qsgd_ef": quantizers.qsgd_chunks(4, 2),
    "terngrad": quantizers.TERNARY_CHUNKS,
    "fixed_point_ef": fixed_point.fixed_point_chunks(8, 6),
    "dynamic_nearest_ef": fixed_point.dynamic_chunks(8, 2, False),
    "dynamic_stochastic": fixed_point.dynamic_chunks(4, 3, True),
    "int8": intq.int_chunks(8, 2),
    "int4": intq.int_chunks(4, 3),
  }[case]


# -- The gather default, validation, LoCo's 8-bit residuals, elastic resume -------

GATHER = {
  "signsgd": {},
  "ef_signsgd": {},
  "onebit_sgd": {},
  "qsgd": {"levels": 4, "bucket_size": 2},
  "terngrad": {},
  "fixed_point": {"bits": 8},
  "dynamic_fixed_point": {"bits": 12, "block_size": 4},
  "int_quantize": {"bits": 4, "block_size": 4},
}


@pytest.mark.parametrize("name", sorted(GATHER))
def test_the_gather_default_is_unchanged(name):
  """The default builds the program ``exchange="gather"`` builds: all-gathers, no all-to-all.

  (The gather forms were checked bit for bit against the code before the
  scatter forms existed when they were added; their own tests pin them.)
  """
  sharded = NamedSharding(harness.mesh(), P(harness.AXIS))
  g = jax.ShapeDtypeStruct((N, 37), jnp.float32, sharding=sharded)

  def lowered(tx):
    state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((N, *x.shape), x.dtype, sharding=sharded),
      tx.init(jnp.zeros(37)),
    )
    return jax.jit(workers_update(tx)).lower(g, state).as_text()

  default = lowered(gradcomp.get(name, axis_name=harness.AXIS, **GATHER[name]))
  gather = lowered(
    gradcomp.get(name, axis_name=harness.AXIS, exchange="gather", **GATHER[name])
  )
  assert default == gather
  assert "all_to_all" not in default and "all_gather" in default


def workers_update(tx):
  from gradcomp.parallel import workers

  return workers.sharded_update(tx, harness.mesh(), harness.AXIS)


@pytest.mark.parametrize(
  "factory,kwargs,match",
  [
    ("qsgd", {"exchange": "reduce"}, "exchange must be one of"),
    ("signsgd", {"exchange": None}, "exchange must be one of"),
    ("int_quantize", {"bits": 2}, r"bits must be one of \(4, 8\), got 2"),
    ("int_quantize", {"bits": 8.0}, "bits must be one of"),
    ("int_quantize", {"block_size": 0}, r"block_size must be an integer in \[1, inf\)"),
    ("int_quantize", {"residual_bits": 16}, r"residual_bits must be one of \(8, 32\)"),
    (
      "int_quantize",
      {"residual_bits": 8, "error_feedback": False},
      "needs error_feedback",
    ),
    ("int_quantize", {"error_feedback": 1}, "error_feedback must be True or False"),
    (
      "dynamic_fixed_point",
      {"exchange": "scatter", "int_bits": 2},
      "int_bits must be None with exchange='scatter'",
    ),
  ],
)
def test_invalid_hyper_parameters_are_value_errors(factory, kwargs, match):
  with pytest.raises(ValueError, match=match):
    gradcomp.get(factory, **kwargs)


@pytest.mark.parametrize("name", sorted(GATHER))
def test_patterns_cannot_take_the_scatter_form(name):
  with pytest.raises(ValueError, match="exchange='scatter' needs an all-to-all"):
    gradcomp.get(
      name, axis_name=exchange.Pushes("data"), exchange="scatter", **GATHER[name]
    )


def test_loco_int8_residuals_track_the_float32_ones():
  """8-bit residuals: the first step is the float32 form's; stored within half a step."""
  x = grads(seed=3)
  g0 = {k: v[0] for k, v in x.items()}
  exact = build("int8", harness.AXIS)
  loco = gradcomp.get(
    "int_quantize",
    bits=8,
    block_size=2,
    exchange="scatter",
    residual_bits=8,
    axis_name=harness.AXIS,
  )
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  out = {}
  for label, tx in (("exact", exact), ("loco", loco)):
    run = harness.sharded_update(tx)
    out[label] = jax.device_get(
      run(harness.shard(g0), harness.worker_state(tx, params))
    )
  (u_exact, s_exact), (u_loco, s_loco) = out["exact"], out["loco"]
  for k in SHAPES:
    np.testing.assert_array_equal(u_loco[k], u_exact[k])
    stored = s_loco.leaves[k]
    assert isinstance(stored, Int8ErrorFeedbackState)
    assert stored.residual.codes.dtype == np.int8
    for got, want in (
      (stored.residual, s_exact.leaves[k].residual),
      (stored.server, s_exact.leaves[k].inner.error),
    ):
      d = math.prod(SHAPES[k])
      want = np.asarray(want).reshape(N, d)
      scales = np.repeat(got.scales, intq.RESIDUAL_BLOCK, axis=1)[:, :d]
      decoded = got.codes[:, :d].astype(np.float64) * scales
      assert np.all(
        np.abs(decoded - want) <= scales / 2 * (1 + 1e-5) + U * np.abs(want)
      )
  # Elastic resume, 8 -> 4 workers: train.elastic decodes each 8-bit
  # residual with its scales, moves it (the mean; each server value to its
  # new owner) and re-encodes it, within half a step of the new scales.
  import collections

  from train import elastic

  like = gradcomp.add_worker_axis(loco.init(params), 4)
  per_worker = jax.tree.map(lambda _: True, like)
  moved = elastic._opt_state(
    s_loco, like, per_worker, N, 4, step=1, counts=collections.Counter()
  )
  for k in SHAPES:
    d = math.prod(SHAPES[k])
    old, new = s_loco.leaves[k], moved.leaves[k]
    assert isinstance(new.residual, intq.Int8Residual)
    for part, move in ((old.residual, "mean"), (old.server, "owner")):
      values = np.asarray(intq.load_int8(part.codes, part.scales), np.float64)
      if move == "mean":
        want = np.broadcast_to(values.mean(axis=0), (4, d))
        got_part = new.residual
      else:
        want = elastic.owner_residual(values, 4)
        got_part = new.server
      got = np.asarray(intq.load_int8(got_part.codes, got_part.scales), np.float64)
      step = np.repeat(np.asarray(got_part.scales), intq.RESIDUAL_BLOCK, axis=1)[:, :d]
      assert np.all(np.abs(got - want) <= step / 2 * (1 + 1e-5) + 2 * U * np.abs(want))


def test_elastic_resume_moves_the_server_error_to_its_new_owner():
  """train.elastic knows the scatter forms' state: residual_mean and owner_residual."""
  from train import elastic

  states = run_case("int8")[2]
  state = jax.tree.map(lambda x: x[-1], states)  # per worker, (8, ...)
  kinds = {
    jax.tree_util.keystr(path): elastic.kind_of(state, path, True)[0]
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]
  }
  assert kinds[".leaves['v'].residual"] == "residual_mean"
  assert kinds[".leaves['v'].inner.error"] == "owner_residual"
  errors = np.asarray(state.leaves["v"].inner.error)
  moved = elastic.owner_residual(errors, 4)
  d = errors.shape[1]
  owned = errors[np.arange(d) // (-(-d // N)), np.arange(d)]
  np.testing.assert_array_equal(
    moved[np.arange(d) // (-(-d // 4)), np.arange(d)], owned
  )


def test_the_scattered_list_is_every_registered_codec_with_the_form():
  """scatter.SCATTERED (which the conformance and bad-input suites read) names
  exactly the registered compressors whose factory takes exchange='scatter'."""
  import inspect

  from gradcomp.compressors import registry, scatter

  takes = {
    n
    for n in gradcomp.names()
    if "exchange" in inspect.signature(registry._REGISTRY[n]).parameters
  }
  assert takes == set(scatter.SCATTERED)
