"""Muon (``--config.optimizer.name=muon``) and MuLoCo, DiLoCo with Muon inside.

Thérien et al. 2025 (arXiv 2505.23725, Algorithm 1): each worker takes
``every`` Muon steps (``optax.contrib.muon``), then the mean of the
pseudo-gradients (through ``config.compressor``) feeds outer Nesterov SGD.
Checked: one worker with ``every=1``, outer rate 1 and no outer momentum is
plain Muon (the round puts the params back where the inner step took them);
Muon's step on a matrix is orthogonalised (its singular values sit in the
Newton-Schulz band) while vectors take the AdamW fallback; weight decay
follows ``mask_decay`` (closed form with a zero gradient); in the program a
MuLoCo run with top-k pseudo-gradients resumed from the whole run's mid-run
checkpoint ends bit for bit where the whole run ends; a config Muon cannot run is a
one-line error. Digits with 16 hidden units: the program's paths are a long
run's, the compiles short.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train_adaptive import STEPS, tiny

import gradcomp
from configs import default
from configs import muloco as recipe
from train import optimizer as optimizer_lib
from train import train

import harness

EPS32 = float(np.finfo(np.float32).eps)
LR, WD = 0.02, 0.1
SHAPES = {"kernel": (12, 6), "bias": (6,)}


def muon_config(**fields):
  cfg = default.get_config().optimizer
  cfg.update({"name": "muon", "learning_rate": LR, "weight_decay": WD, **fields})
  return cfg


def inputs(steps, seed=0):
  rng = np.random.default_rng(seed)
  grads = [
    {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
    for _ in range(steps)
  ]
  params = {
    k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()
  }
  return grads, params


def steps_of(tx, grads, params):
  """The params after each step of ``tx`` on the fixed gradients ``grads``."""
  update = jax.jit(tx.update)
  state, out = tx.init(params), []
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    out.append(params)
  return out


def test_one_worker_muloco_every_step_at_outer_rate_one_is_muon():
  """Local SGD on one worker, ``every=1``, outer SGD at rate 1, momentum 0.

  The round's pseudo-gradient is ``anchor - (params + u)`` and the outer
  step moves the anchor by minus it: the params land at ``params + u``, as
  plain Muon's. Rounding: each round rounds the pseudo-gradient, the anchor
  and ``anchor - params`` (a few ulp of the largest param), and the next
  steps' Muon updates are the same (the gradients are fixed, the decay's
  share of a param's ulp is ``lr * wd`` of it): at most 4 u max|p| per step.
  """
  steps = 6
  grads, params = inputs(steps)
  inner = optax.chain(*optimizer_lib.local_optimizer(muon_config(), steps))
  outer = optax.sgd(1.0, momentum=0.0, nesterov=True)  # the program's outer form
  muloco = gradcomp.local_sgd(inner, every=1, outer=outer)
  plain, rounds = steps_of(inner, grads, params), steps_of(muloco, grads, params)
  scale = max(float(np.abs(np.asarray(p)).max()) for p in jax.tree.leaves(plain))
  for t, (want, got) in enumerate(zip(plain, rounds, strict=True)):
    for k in SHAPES:
      np.testing.assert_allclose(
        got[k], want[k], rtol=0, atol=4 * (t + 1) * EPS32 * scale, err_msg=k
      )
  # And the steps moved the params (the check is not of a no-op).
  assert (
    np.abs(np.asarray(plain[-1]["kernel"]) - np.asarray(params["kernel"])).max() > 1e-3
  )


def test_muon_orthogonalises_matrices_and_steps_vectors_with_adamw():
  """One step from zero state, no decay: the kernel's update is ``-lr * s *
  NS(g / |g|_F)``, with ``s = sqrt(max(1, fan_out / fan_in))`` (1 here: 12 x
  6) and NS five quintic Newton-Schulz steps, whose coefficients (3.4445,
  -4.775, 2.0315) send every singular value into about [0.68, 1.13]
  (Jordan et al. 2024); the bias's is the first step of optax's fallback,
  AdamW with Nesterov momentum (``nesterov=True``, as ``optax.contrib.muon``
  builds it): the bias-corrected first moment ``b1 m_1 / (1 - b1**2) + (1 -
  b1) g / (1 - b1)`` with ``m_1 = (1 - b1) g`` is ``(1 + b1 / (1 + b1)) g``,
  over ``sqrt(v_hat) = |g|``: ``-lr (1 + b1 / (1 + b1)) sign(g)`` up to eps.
  """
  grads, params = inputs(1, seed=1)
  tx = optax.chain(*optimizer_lib.local_optimizer(muon_config(weight_decay=0.0), 1))
  updates, _ = jax.jit(tx.update)(grads[0], tx.init(params), params)
  sv = np.linalg.svd(np.asarray(updates["kernel"], np.float64) / -LR, compute_uv=False)
  assert sv.min() > 0.6 and sv.max() < 1.2, sv
  g = np.asarray(grads[0]["bias"], np.float64)
  b1, b2 = 0.9, 0.999
  want = -LR * (1 + b1 / (1 + b1)) * g / (np.abs(g) + 1e-8)
  # b2 = 0.999 is not a float32: 1 - b2 in float32 is off by up to u / (1 -
  # b2) relatively (the moment and its bias correction round it apart), half
  # of that through the square root, plus a few u of arithmetic.
  np.testing.assert_allclose(updates["bias"], want, rtol=EPS32 / (1 - b2))
  # An AdamW step on the kernel would have |entries| = lr, far from an
  # orthogonal matrix's spread.
  assert not np.allclose(np.abs(np.asarray(updates["kernel"])), LR, rtol=0.1)


@pytest.mark.parametrize(
  ("mask_decay", "bias_decayed"), [(None, False), (True, False), (False, True)]
)
def test_muon_weight_decay_follows_mask_decay(mask_decay, bias_decayed):
  """Zero gradient: the kernel steps by ``-lr * wd * p`` (Muon of a zero
  momentum is zero), the bias by that too only when every leaf is decayed."""
  cfg = muon_config()
  cfg.mask_decay = mask_decay
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 2.0)}
  tx = optax.chain(*optimizer_lib.local_optimizer(cfg, 10))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  decay = -LR * WD * 2.0
  np.testing.assert_allclose(updates["kernel"], decay, rtol=4 * EPS32)
  np.testing.assert_allclose(
    updates["bias"], decay if bias_decayed else 0.0, rtol=4 * EPS32, atol=0
  )


MULOCO = {
  "optimizer.name": "muon",
  "optimizer.learning_rate": 0.02,
  "optimizer.weight_decay": 0.1,
  "optimizer.clip_norm": 1.0,
  "optimizer.clip_scope": "worker",
  "optimizer.mask_decay": True,
  "scheme.name": "local_sgd",
  "scheme.every": 3,
  "scheme.outer_learning_rate": 0.7,
  "scheme.outer_momentum": 0.6,
  "compressor.name": "topk",
  "compressor.ratio": 0.05,
}


def test_muloco_in_the_program_resumes_bit_for_bit(tmp_path):
  whole = train.train_and_evaluate(tiny(**MULOCO), tmp_path / "whole")
  # Preempted after the checkpoint at step 6, between rounds (every 3).
  resumed_dir = tmp_path / "resumed"
  assert harness.preempted_copy(tmp_path / "whole", resumed_dir) == STEPS // 2
  resumed = train.train_and_evaluate(tiny(**MULOCO), resumed_dir)
  harness.assert_resumed_after(resumed_dir, STEPS // 2)
  for part in ("params", "opt_state"):
    leaves = zip(
      jax.tree.leaves(resumed.state[part]),
      jax.tree.leaves(whole.state[part]),
      strict=True,
    )
    for a, b in leaves:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.isfinite(whole.eval_metrics["eval_loss"])
  # Rounds ran: top-k's error feedback holds what the payloads left.
  residuals = [
    np.asarray(x)
    for path, x in jax.tree_util.tree_leaves_with_path(whole.state["opt_state"])
    if "residual" in jax.tree_util.keystr(path)
  ]
  assert residuals and any(np.any(r) for r in residuals)


def test_the_recipe_is_gpt_tiny_muloco():
  config = train.validate(recipe.get_config())
  assert config.model.name == "gpt_tiny" and config.optimizer.name == "muon"
  assert config.scheme.name == "local_sgd" and config.scheme.outer_momentum == 0.6


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    (
      {**MULOCO, "optimizer.beta": 1.0},
      r"config.optimizer.beta \(muon\) must be in \[0, 1\), got 1.0",
    ),
    (
      {
        **MULOCO,
        "scheme.name": "none",
        "optimizer.clip_scope": None,
        "mesh": "data=2,fsdp=4",
      },
      "muon orthogonalises whole matrices: not on an FSDP mesh",
    ),
  ],
)
def test_a_config_muon_cannot_run_is_one_line(overrides, message):
  with pytest.raises(ValueError, match=message) as error:
    train.validate(tiny(**overrides))
  assert "\n" not in str(error.value)
