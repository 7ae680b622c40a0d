"""The compress suite's naive-JAX peers (gradcomp/bench/peers.py, issue 18).

Each peer must do the work it is compared for: top-k keeps the k largest
magnitudes (gradcomp's own top-k on one worker, exactly), random-k at most k
entries of its input, signs and fp16 their closed forms, and error feedback
conserves mass (the outputs and the last residual add up to the inputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from gradcomp.bench import peers


def _tensors(seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((40, 25), (300,))]


def _run(label, error_feedback, steps=1):
  peer = peers.lift(label, error_feedback)
  xs = _tensors()
  state = peer.init(xs)
  update = jax.jit(peer.update)
  outs = []
  for t in range(steps):
    step_in = [x * (t + 1) for x in xs]
    out, state = update(step_in, state)
    outs.append(out)
  return xs, outs, state


def test_topk_matches_gradcomp_on_one_worker():
  xs, (outs,), _ = _run("topk", False)
  tx = gradcomp.topk(ratio=0.01, error_feedback=False)
  want, _ = tx.update(xs, tx.init(xs))
  for got, w in zip(outs, want, strict=True):
    np.testing.assert_array_equal(got, w)


def test_randomk_keeps_at_most_k_entries_of_its_input():
  xs, (outs,), _ = _run("randomk", False)
  for x, out in zip(xs, outs, strict=True):
    kept = np.flatnonzero(np.asarray(out))
    assert 0 < kept.size <= max(1, int(np.ceil(0.01 * x.size)))
    np.testing.assert_array_equal(
      np.asarray(out).ravel()[kept], np.asarray(x).ravel()[kept]
    )


@pytest.mark.parametrize(
  ("label", "closed_form"),
  [
    ("signsgd", np.sign),
    ("ef_signsgd", lambda x: np.mean(np.abs(x)) * np.sign(x)),
    ("fp16", lambda x: x.astype(np.float16).astype(np.float32)),
  ],
)
def test_elementwise_peers_closed_form(label, closed_form):
  xs, (outs,), _ = _run(label, False)
  for x, out in zip(xs, outs, strict=True):
    np.testing.assert_allclose(out, closed_form(np.asarray(x)), rtol=1e-6)


@pytest.mark.parametrize("label", ["randomk", "topk", "powersgd"])
def test_error_feedback_conserves_mass(label):
  """sum_t out_t + r_T = sum_t g_t: float32 sums of 3 steps, values ~N(0, 9)."""
  steps = 3
  xs, outs, (_, residuals, _) = _run(label, True, steps)
  for i, x in enumerate(xs):
    sent = sum(np.asarray(o[i], np.float64) for o in outs)
    total = sum((t + 1) * np.asarray(x, np.float64) for t in range(steps))
    bound = 4 * steps * np.finfo(np.float32).eps * np.abs(total).max() * steps
    np.testing.assert_allclose(sent + np.asarray(residuals[i]), total, atol=bound)
