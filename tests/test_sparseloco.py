"""SparseLoCo (gradcomp.schemes.sparseloco): Alg. 1 of Sarfi et al. 2025 on 4 workers.

Checked against a NumPy float64 transcription of the paper's round (inner
SGD steps, the decayed error feedback, per-tile top-k, 2-bit codes, the mean
over all workers, plain outer SGD), the error-feedback mass across rounds,
its reduction to DiLoCo with an SGD outer step, the named errors, and the
bytes of a round in the compiled program against its docstring.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import topk as topk_lib
from gradcomp.optimizers import demo
from gradcomp.schemes.sparseloco import ratio, sparseloco
from tests import harness

# One worker runs the module: its tests share the module's SparseLoCo run (``run``),
# built once.
pytestmark = pytest.mark.xdist_group("sparseloco")

AXIS = "data"
N, EVERY, ROUNDS = 4, 3, 3
STEPS = EVERY * ROUNDS
LR, ALPHA, BETA, BITS = 0.1, 0.8, 0.9, 2
CHUNK, K = 8, 8  # 8 of each 8 x 8 tile; 1 of a vector's chunk of 8
SHAPES = {"w": (16, 24), "b": (24,)}
U = float(np.finfo(np.float32).eps) / 2


@pytest.fixture(scope="module")
def mesh4():
  return Mesh(np.array(jax.devices()[:N]), (AXIS,))


def _grads(seed):
  rng = np.random.default_rng(seed)
  return {
    k: rng.standard_normal((STEPS, N, *s)).astype(np.float32) for k, s in SHAPES.items()
  }


def _run(tx, grads, mesh):
  """Every step's params (per worker) and the final state, in one scan."""

  def steps(params, grads):
    grads = jax.tree.map(lambda g: g[:, 0], grads)

    def body(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), params

    first = jax.tree.map(lambda g: g[0], grads)
    carry, p0 = body((params, tx.init(params)), first)
    (_, state), rest = jax.lax.scan(body, carry, jax.tree.map(lambda g: g[1:], grads))
    history = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), p0, rest)
    return gradcomp.add_worker_axis((history, state))

  f = jax.shard_map(steps, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P(AXIS))
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  grads = jax.device_put(grads, NamedSharding(mesh, P(None, AXIS)))
  return jax.jit(f)(params, grads)


def _tiles(x):
  """(tiles, h * w) of a leaf, DeMo's cut written out."""
  rows, cols = (1, x.shape[0]) if x.ndim == 1 else x.shape
  h, w = demo.chunk_size(rows, CHUNK), demo.chunk_size(cols, CHUNK)
  blocks = [(i, j) for i in range(0, rows, h) for j in range(0, cols, w)]
  m = x.reshape(rows, cols)
  return np.stack([m[i : i + h, j : j + w].reshape(-1) for i, j in blocks]), (
    blocks,
    h,
    w,
  )


def _q_topk(e, margins):
  """Q(Top-k(e)) per tile, float64, dense, and where it was sent.

  Records its distance to ties and bin edges in ``margins``.
  """
  t, (blocks, h, w) = _tiles(e)
  k = max(1, math.floor(K * t.shape[1] / CHUNK**2))
  out = np.zeros((1, e.shape[0]) if e.ndim == 1 else e.shape)
  chosen = np.zeros(out.shape, bool)
  levels = 2**BITS
  for row, (i, j) in zip(t, blocks, strict=True):
    order = np.argsort(-np.abs(row), kind="stable")
    kth = abs(row[order[k - 1]])
    margins.append((kth - abs(row[order[k]])) / kth)
    v = row[order[:k]]
    step = 6.0 * np.sqrt(np.mean(v**2)) / levels
    z = v / step
    margins.append(np.min(np.abs(z - np.round(z)) / (1 + np.abs(z))))
    codes = np.clip(np.floor(z) + levels // 2, 0, levels - 1)
    sent = np.zeros(h * w)
    sent[order[:k]] = (codes - levels // 2 + 0.5) * step
    out[i : i + h, j : j + w] = sent.reshape(h, w)
    chosen[i : i + h, j : j + w] = (
      (np.arange(h * w) == order[:k, None]).any(0).reshape(h, w)
    )
  return out.reshape(e.shape), chosen.reshape(e.shape)


def _reference(grads, mean="workers"):
  """Alg. 1 with inner SGD: the shared params after each round, and each e_r.

  ``mean="senders"``: each coordinate's sum over the workers that sent it,
  divided by their number (Templar's ``scatter_reduce("mean")``), not by N.
  """
  theta = {k: np.zeros(s) for k, s in SHAPES.items()}
  error = {k: np.zeros((N, *s)) for k, s in SHAPES.items()}
  rounds, margins = [], []
  for t in range(ROUNDS):
    new = {}
    for k in SHAPES:
      total, senders = 0.0, 0
      for r in range(N):
        local = theta[k].copy()
        for s in range(t * EVERY, (t + 1) * EVERY):
          local = local - LR * grads[k][s, r].astype(np.float64)
        error[k][r] = BETA * error[k][r] + (theta[k] - local)
        sent, chosen = _q_topk(error[k][r], margins)
        error[k][r] = error[k][r] - sent
        total, senders = total + sent, senders + chosen
      divisor = np.maximum(senders, 1) if mean == "senders" else N
      new[k] = theta[k] - ALPHA * total / divisor
    theta = new
    rounds.append(theta)
  return rounds, error, min(margins)


def _tx(**kw):
  args = dict(every=EVERY, outer_learning_rate=ALPHA, k=K, chunk=CHUNK, value_bits=BITS)
  return sparseloco(optax.sgd(LR), **{**args, "ef_decay": BETA, **kw})


@pytest.fixture(scope="module")
def run(mesh4):
  grads = _grads(seed=0)
  history, state = _run(_tx(axis_name=AXIS), grads, mesh4)
  return grads, history, state


@pytest.fixture(scope="module")
def run_senders(mesh4):
  grads = _grads(seed=0)
  history, state = _run(_tx(axis_name=AXIS, mean="senders"), grads, mesh4)
  return grads, history, state


def test_matches_a_float64_transcription_of_alg1_on_4_workers(run):
  _check_against_the_reference(*run, mean="workers")


def test_the_mean_over_senders_matches_templars_reading_on_4_workers(run_senders, run):
  _check_against_the_reference(*run_senders, mean="senders")
  # Some coordinate was sent by fewer than all 4 workers, so the readings differ.
  assert any(
    np.any(np.asarray(run_senders[1][k]) != np.asarray(run[1][k])) for k in SHAPES
  )


def _check_against_the_reference(grads, history, state, mean):
  rounds, error, margin = _reference(grads, mean)
  # Away from ties and bin edges by 10x what float32 moves them (~16 u).
  assert margin > 10 * 16 * U
  for t, theta in enumerate(rounds):
    for k in SHAPES:
      got = np.asarray(history[k])[:, (t + 1) * EVERY - 1]  # every worker
      # Float32 bound: the local steps, memory, RMS (k = 8 squares) and
      # mean (N terms) round; (EVERY + K + N + 8) u per round on magnitudes
      # at most the summed gradients' (LR * EVERY * max|g| per round).
      scale = LR * EVERY * np.abs(grads[k]).max() * (t + 1) * 2
      bound = (t + 1) * (EVERY + K + N + 8) * U * scale
      np.testing.assert_allclose(got, np.broadcast_to(theta[k], got.shape), atol=bound)
      assert np.any(theta[k] != 0)
  for k in SHAPES:
    residual = np.asarray(state.compressor_state.leaves[k].residual)
    scale = LR * EVERY * np.abs(grads[k]).max() * ROUNDS * 2
    bound = ROUNDS * (EVERY + K + N + 8) * U * scale
    np.testing.assert_allclose(residual, error[k], atol=bound)


def test_error_feedback_conserves_the_decayed_mass(run):
  """mean_r e_r + sum_t beta^(T-t) mean_t = sum_t beta^(T-t) mean_r Delta_r,t.

  The sent means are read off the shared params, ``mean_t = (theta_{t-1} -
  theta_t) / alpha``; with inner SGD from the shared params, ``Delta_r,t``
  is ``LR`` times round t's gradients of worker r, whatever theta is.
  """
  grads, history, state = run
  weights = BETA ** np.arange(ROUNDS - 1, -1, -1, dtype=np.float64)
  for k, s in SHAPES.items():
    thetas = [np.zeros(s)] + [
      np.asarray(history[k], np.float64)[0, (t + 1) * EVERY - 1] for t in range(ROUNDS)
    ]
    means = np.stack([(thetas[t] - thetas[t + 1]) / ALPHA for t in range(ROUNDS)])
    g = grads[k].astype(np.float64).mean(axis=1).reshape(ROUNDS, EVERY, *s)
    deltas = LR * g.sum(axis=1)
    residual = np.asarray(state.compressor_state.leaves[k].residual, np.float64)
    got = residual.mean(axis=0) + np.tensordot(weights, means, axes=1)
    want = np.tensordot(weights, deltas, axes=1)
    scale = np.abs(deltas).max() * ROUNDS
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * ROUNDS * U * scale / ALPHA)
    assert np.any(residual != 0)


def test_everything_sent_exactly_is_diloco_with_an_sgd_outer_step():
  """One worker, k = chunk**2, float32 values: local_sgd(outer=optax.sgd(alpha))."""
  params = {"w": jnp.zeros((16, 24)), "b": jnp.zeros(24)}
  inner = optax.adam(0.05)
  sl = sparseloco(
    inner,
    every=EVERY,
    outer_learning_rate=ALPHA,
    k=CHUNK**2,
    chunk=CHUNK,
    value_bits=32,
    ef_decay=0.5,
  )
  dl = gradcomp.local_sgd(inner, EVERY, outer=optax.sgd(ALPHA))
  grads = _grads(seed=3)
  got, want = params, params
  s1, s2 = sl.init(params), dl.init(params)
  u1, u2 = jax.jit(sl.update), jax.jit(dl.update)
  for step in range(STEPS):
    g = {k: jnp.asarray(v[step, 0]) for k, v in grads.items()}
    a, s1 = u1(g, s1, got)
    b, s2 = u2(g, s2, want)
    got, want = optax.apply_updates(got, a), optax.apply_updates(want, b)
  for k in params:
    np.testing.assert_array_equal(got[k], want[k])
    np.testing.assert_array_equal(s1.compressor_state.leaves[k].residual, 0.0)
  assert np.any(np.asarray(got["w"]) != 0)


def test_a_round_sends_what_the_docstring_says():
  """Bytes per worker from the compiled program: 116 per 64 x 64 tile at k = 64."""
  params = {"w": jnp.zeros((128, 128)), "b": jnp.zeros(128)}
  tx = sparseloco(optax.sgd(LR), every=2, outer_learning_rate=1.0, k=64, axis_name=AXIS)
  grads = jax.tree.map(lambda p: jnp.zeros((1, harness.WORKERS, *p.shape)), params)
  sharded = harness.shard(grads, P(None, AXIS))
  sent = gradcomp.wire_bytes(harness.scheme_steps(tx), params, sharded)
  # w: 4 tiles x (64 x 12 bits + 64 x 2 bits) / 8 + 4 float32 scales;
  # b: 2 chunks of 64, 1 value each: 6-bit positions, 2-bit codes, 2 scales.
  assert sent == 4 * 116 + (2 + 1 + 8)
  payload = sum(
    topk_lib.payload_bytes(p.shape, ratio(64, 64), 64, 2) for p in params.values()
  )
  assert sent == payload
  dense = 4 * (128 * 128 + 128)
  assert dense / sent > 100


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"k": 0}, r"k must be an integer in \[1, 64\], got 0"),
    ({"k": 65}, r"k must be an integer in \[1, 64\], got 65"),
    ({"chunk": 0}, r"chunk must be an integer in \[1, inf\), got 0"),
    ({"value_bits": 9}, r"value_bits must be an integer in \[1, 8\].*got 9"),
    ({"ef_decay": 1.2}, r"ef_decay must be a number in \[0, 1\], got 1.2"),
    ({"every": 0}, r"every must be an integer in \[1, inf\), got 0"),
    ({"outer_learning_rate": 0.0}, r"outer_learning_rate must be .* > 0, got 0.0"),
    ({"outer_learning_rate": float("nan")}, r"outer_learning_rate .*got nan"),
    ({"mean": "all"}, r"mean must be 'workers' or 'senders', got 'all'"),
  ],
)
def test_bad_hyperparameters_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _tx(**kwargs)


def test_ratio_keeps_exactly_k():
  for chunk in (50, 64, 7, 1):
    for k in {1, 2, chunk, chunk * chunk // 3 or 1, chunk * chunk}:
      assert max(1, int(ratio(k, chunk) * chunk * chunk)) == k
