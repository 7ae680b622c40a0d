"""Synchronous SGD with backup workers against a NumPy server (survey 004 §2.2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomp
from gradcomp.schemes.async_ps import speed_table, task_durations
from gradcomp.schemes.backup import accepted_workers

import harness

N = harness.WORKERS
LR, MOMENTUM = 0.1, 0.9
T = 12
SHAPES = {"w": (3, 4), "b": (4,)}
ISSUE = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
FAILING = np.array([ISSUE] * 4 + [(0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)])


def reference(params, grads, speeds, backups, jitter):
  """The first n - b arrivals' mean through SGD with momentum, in float64."""
  table = speed_table(speeds)
  key = jax.random.PRNGKey(0)
  x = {k: np.float64(v) for k, v in params.items()}
  velocity = {k: np.zeros_like(v) for k, v in x.items()}
  clock, dropped = 0.0, np.zeros(N, np.int64)
  for t in range(T):
    d = np.asarray(task_durations(key, t, table, jitter), np.float64)
    first = sorted(range(N), key=lambda w: (d[w], w))[: N - backups]
    if not all(np.isfinite(d[w]) for w in first):
      clock = np.inf
      dropped += 1 - np.isin(np.arange(N), [w for w in first if np.isfinite(d[w])])
      continue
    dropped += 1 - np.isin(np.arange(N), first)
    clock += d[first[-1]]
    for k in x:
      g = np.mean([np.float64(grads[k][t, w]) for w in first], axis=0)
      velocity[k] = MOMENTUM * velocity[k] + g
      x[k] = x[k] - LR * velocity[k]
  return x, clock, dropped


@pytest.mark.parametrize(
  ("speeds", "backups", "jitter"),
  [(ISSUE, 0, 0.0), (ISSUE, 2, 0.0), (ISSUE, 2, 1.0), (FAILING, 1, 0.5)],
  ids=["sync", "b2", "b2_jitter", "failure_b1"],
)
def test_matches_reference(speeds, backups, jitter):
  params = harness.scheme_params(SHAPES)
  grads = harness.scheme_grads(SHAPES, T, seed=4)
  tx = gradcomp.backup_workers(
    optax.sgd(LR, momentum=MOMENTUM),
    backups,
    speeds=speeds,
    jitter=jitter,
    axis_name=harness.AXIS,
  )
  got, state = harness.run_scheme(tx, params, grads)
  want, clock, dropped = reference(params, grads, speeds, backups, jitter)
  for k in got:  # every worker holds the same params
    np.testing.assert_array_equal(got[k], np.broadcast_to(got[k][:1], got[k].shape))
  # Sum of 8 float32 gradients and a momentum recursion: a few ulps per step
  # of the largest velocity, sum |v| <= T max|g| / (1 - momentum).
  bound = 16 * np.finfo(np.float32).eps * T * LR * 4.0 / (1 - MOMENTUM) + 1e-6
  harness.assert_within(jax.tree.map(lambda a: a[0], got), want, bound)
  np.testing.assert_array_equal(state.dropped[0], dropped)
  np.testing.assert_allclose(state.clock[0], clock, rtol=1e-6)
  if jitter == 0.0 and backups == 2:  # the two slowest, by index, every round
    np.testing.assert_array_equal(dropped, [0, 0, T, T, 0, 0, 0, 0])
    assert clock == 4.0 * T  # the 6th arrival is a speed-1 worker: 4 steps


def test_accepted_workers_ties_go_to_the_lower_index():
  accepted, time = accepted_workers(jnp.array([2.0, 1.0, 2.0, jnp.inf, 2.0]), 3)
  np.testing.assert_array_equal(accepted, [True, True, True, False, False])
  assert float(time) == 2.0
  accepted, time = accepted_workers(jnp.array([1.0, jnp.inf, jnp.inf]), 2)
  np.testing.assert_array_equal(accepted, [True, False, False])
  assert time == jnp.inf


def test_one_worker_is_the_inner_optimizer():
  inner = optax.sgd(LR, momentum=MOMENTUM)
  tx = gradcomp.backup_workers(inner, 0, speeds=[2.0], jitter=0.3)
  params = {"x": jnp.ones(5)}
  state, inner_state = tx.init(params), inner.init(params)
  for seed in range(3):
    g = harness.grads_like(params, seed)
    u, state = tx.update(g, state, params)
    v, inner_state = inner.update(g, inner_state, params)
    np.testing.assert_array_equal(u["x"], v["x"])


@pytest.mark.parametrize(
  ("kw", "message"),
  [
    (dict(backups=8, speeds=ISSUE), r"backups must be in \[0, 7\] for 8 workers"),
    (dict(backups=-1, speeds=ISSUE), "backups"),
    (dict(backups=1.0, speeds=ISSUE), "backups must be an integer"),
    (dict(backups=0, speeds=[1.0], jitter=-1), "jitter must be a number"),
    (dict(backups=0, speeds=[-1.0]), "speeds must be finite and >= 0"),
  ],
)
def test_bad_hyper_parameters_name_the_argument(kw, message):
  with pytest.raises(ValueError, match=message):
    gradcomp.backup_workers(optax.sgd(LR), **kw)
