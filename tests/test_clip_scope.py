"""The study's protocol fields: ``config.optimizer.clip_scope`` and ``mask_decay``.

``clip_scope="worker"`` in synchronous training clips each worker's own
gradient before the compressor, and the mean is not clipped again; checked
on 4 workers against a NumPy float64 transcription (clip each, top-k with
error feedback each, mean, SGD), beside ``"mean"`` (compress, mean, clip)
against its own transcription. Unset builds today's chain: the same
transformation, state and updates bit for bit as the chain written out as
before the field existed. In DiLoCo the inner optimizer already clips each
worker's gradient, so ``"worker"`` is the unset run bit for bit. Configs a
scope cannot follow are one-line errors. ``mask_decay=True`` gives SGD,
AdamW and DeMo AdamW's mask (closed form with a zero gradient).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_train_adaptive import tiny

import gradcomp
from configs import default
from train import optimizer as optimizer_lib
from train import schemes, train
from train.schemes.base import NEVER_FORCE

AXIS = "data"
WORKERS, STEPS = 4, 3
CLIP, RATIO, LR = 1.0, 0.25, 0.1
SHAPES = {"a": (6, 5), "b": (7,)}
D = sum(int(np.prod(s)) for s in SHAPES.values())
EPS32 = float(np.finfo(np.float32).eps)
# Each worker's gradient scale: two are clipped at every step, one never.
SCALES = (0.05, 0.4, 1.5, 4.0)


def config_of(**overrides):
  config = default.get_config()
  config.update_from_flattened_dict(
    {
      "workers": WORKERS,
      "compressor.name": "topk",
      "compressor.ratio": RATIO,
      "fusion.plan": "none",
      "optimizer.learning_rate": LR,
      "optimizer.momentum": 0.0,
      "optimizer.clip_norm": CLIP,
      **overrides,
    }
  )
  return config


def program_tx(config):
  """The program's optimizer for ``config``, as ``train/`` builds it."""
  config = schemes.get(config).resolve(config)
  scheme = schemes.get(config)(config, None, None, "shard_map")
  order = list(range(len(SHAPES)))
  sizes = [int(np.prod(s)) for s in SHAPES.values()]
  tx, _ = scheme.optimizer(order, sizes, None, STEPS)
  return tx


def inputs():
  rng = np.random.default_rng(0)
  grads = {
    k: rng.standard_normal((STEPS, WORKERS, *s)).astype(np.float32)
    for k, s in SHAPES.items()
  }
  norms = np.sqrt(
    sum((g**2).reshape(STEPS, WORKERS, -1).sum(-1) for g in grads.values())
  )
  scale = np.asarray(SCALES)[None, :] / norms  # worker w's norm is SCALES[w]
  for k in grads:
    grads[k] *= scale.reshape(STEPS, WORKERS, *([1] * len(SHAPES[k])))
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  return grads, params


def run(tx, grads, params, per_worker=False):
  """``STEPS`` steps on 4 workers under ``shard_map``: each step's updates.

  Params replicated as the program keeps them in synchronous training (every
  worker's updates checked equal, worker 0's returned), or ``per_worker``
  as local SGD's (every worker's returned, ``(steps, workers, ...)``).
  """
  mesh = jax.make_mesh((WORKERS,), (AXIS,), devices=jax.devices()[:WORKERS])
  on_workers = NamedSharding(mesh, P(AXIS))

  def step(g, state, params):
    state, g = gradcomp.drop_worker_axis((state, g))
    if per_worker:
      params = gradcomp.drop_worker_axis(params)
    updates, state = tx.update(g, state, params)
    return gradcomp.add_worker_axis((updates, state), 1)

  f = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(AXIS), P(AXIS), P(AXIS) if per_worker else P()),
      out_specs=P(AXIS),
    )
  )
  state = jax.device_put(gradcomp.add_worker_axis(tx.init(params), WORKERS), on_workers)
  if per_worker:
    params = jax.device_put(gradcomp.add_worker_axis(params, WORKERS), on_workers)
  else:
    params = jax.device_put(params, NamedSharding(mesh, P()))
  out = []
  for t in range(STEPS):
    g = jax.device_put(jax.tree.map(lambda x: x[t], grads), on_workers)
    updates, state = f(g, state, params)
    updates = jax.device_get(updates)
    if not per_worker:
      for leaf in jax.tree.leaves(updates):  # Every worker steps the same.
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
      updates = jax.tree.map(lambda x: x[0], updates)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return {k: np.stack([u[k] for u in out]) for k in SHAPES}


# The NumPy float64 transcription.


def clipped(tree):
  """``optax.clip_by_global_norm(CLIP)``: scaled to norm CLIP when above it."""
  norm = np.sqrt(sum(np.sum(x**2) for x in tree.values()))
  return {k: x * (CLIP / norm) if norm >= CLIP else x for k, x in tree.items()}


def top(x):
  """``x`` with all but its ``max(1, floor(RATIO * size))`` largest magnitudes zeroed."""
  k = max(1, int(np.floor(RATIO * x.size)))
  flat = x.reshape(-1)
  keep = np.zeros(flat.shape, bool)
  keep[np.argsort(-np.abs(flat))[:k]] = True
  return np.where(keep, flat, 0.0).reshape(x.shape)


def reference(grads, scope):
  """Per step, the SGD update (momentum 0) of each scope's chain, float64."""
  errors = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(WORKERS)]
  updates = []
  for t in range(STEPS):
    sent = []
    for w in range(WORKERS):
      g = {k: np.asarray(v[t, w], np.float64) for k, v in grads.items()}
      if scope == "worker":
        g = clipped(g)
      e = {k: errors[w][k] + g[k] for k in SHAPES}
      payload = {k: top(e[k]) for k in SHAPES}
      errors[w] = {k: e[k] - payload[k] for k in SHAPES}
      sent.append(payload)
    mean = {k: sum(p[k] for p in sent) / WORKERS for k in SHAPES}
    if scope == "mean":
      mean = clipped(mean)
    updates.append({k: -LR * v for k, v in mean.items()})
  return updates


@pytest.fixture(scope="module")
def data():
  return inputs()


@pytest.mark.parametrize("scope", ["worker", "mean"])
def test_synchronous_chain_clips_where_its_scope_says(scope, data):
  grads, params = data
  got = run(program_tx(config_of(**{"optimizer.clip_scope": scope})), grads, params)
  want = reference(grads, scope)
  other = reference(grads, "mean" if scope == "worker" else "worker")
  # float32 against float64, u = 1.2e-7: the global norm sums D = 37
  # squares (relative error <= D u, half of it through the square root), the
  # scale and the error-feedback sum a few u, the mean of 4 and the rate 3
  # u more; errors of earlier steps stay in the residual: (D / 2 + 10) u per
  # step, times the steps, of the largest update. Top-k picks no near-tie
  # (continuous random gradients).
  scale = max(np.abs(u[k]).max() for u in want for k in SHAPES)
  atol = STEPS * (D / 2 + 10) * EPS32 * scale
  separated = False
  for t in range(STEPS):
    for k in SHAPES:
      np.testing.assert_allclose(got[k][t], want[t][k], rtol=0, atol=atol)
      separated |= np.abs(other[t][k] - want[t][k]).max() > 100 * atol
  assert separated  # the two scopes' chains differ far beyond the tolerance


def test_unset_scope_builds_todays_chain_bit_for_bit(data):
  grads, params = data
  unset = program_tx(config_of())
  # The chain as written before clip_scope existed (DESIGN §1).
  today = gradcomp.apply_if_finite(
    optax.chain(
      gradcomp.topk(RATIO, axis_name=AXIS),
      optax.clip_by_global_norm(CLIP),
      optax.sgd(LR, momentum=0.0, nesterov=False),
    ),
    NEVER_FORCE,
    axis_name=AXIS,
  )
  assert jax.tree.structure(unset.init(params)) == jax.tree.structure(
    today.init(params)
  )
  got, want = run(unset, grads, params), run(today, grads, params)
  for k in SHAPES:
    np.testing.assert_array_equal(got[k], want[k])


def test_diloco_inner_steps_clip_each_worker_already(data):
  """``worker`` is what local SGD's inner optimizer did: the unset run, bit for bit."""
  grads, params = data
  diloco = {"scheme.name": "local_sgd", "scheme.every": 2}
  diloco["scheme.outer_learning_rate"] = 0.7
  unset = run(program_tx(config_of(**diloco)), grads, params, per_worker=True)
  worker = run(
    program_tx(config_of(**diloco, **{"optimizer.clip_scope": "worker"})),
    grads,
    params,
    per_worker=True,
  )
  for k in SHAPES:
    np.testing.assert_array_equal(worker[k], unset[k])
    assert np.any(unset[k])


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    (
      {"optimizer.clip_scope": "global"},
      r"clip_scope must be one of \('worker', 'mean'\) or unset, got 'global'",
    ),
    (
      {"optimizer.clip_scope": "mean", "scheme.name": "local_sgd"},
      "clip_scope='mean' clips an exchanged mean gradient, but scheme local_sgd",
    ),
    (
      {"optimizer.clip_scope": "mean", "optimizer.name": "demo"},
      "but config.optimizer.name=demo steps on each worker's own gradient",
    ),
    (
      {
        "optimizer.clip_scope": "worker",
        "scheme.name": "stale_sgd",
        "scheme.staleness": 2,
      },
      "clip_scope='worker' clips each worker's gradient before the exchange, "
      "but scheme stale_sgd",
    ),
    (
      {"optimizer.clip_scope": "worker", "optimizer.clip_norm": 1.0},
      None,
    ),
    (
      {
        "optimizer.clip_scope": "worker",
        "optimizer.clip_norm": 1.0,
        "mesh": "data=2,fsdp=4",
      },
      "clip_scope='worker' clips before the compressor on a data=N mesh only",
    ),
    (
      {"optimizer.mask_decay": "yes"},
      None,  # ml_collections refuses a str for a bool field itself
    ),
  ],
)
def test_a_scope_a_method_cannot_follow_is_one_line(overrides, message):
  if message is None and "optimizer.mask_decay" in overrides:
    with pytest.raises(TypeError):
      tiny(**overrides)
    return
  if message is None:
    train.validate(tiny(**overrides))  # runs as set
    return
  with pytest.raises(ValueError, match=message) as error:
    train.validate(tiny(**overrides))
  assert "\n" not in str(error.value)


# mask_decay: AdamW's mask for every optimizer. A zero gradient leaves only
# the decay, so a step's update is -lr * wd * p on decayed leaves and 0 on
# the others (SGD: -lr * wd * p too, from add_decayed_weights then SGD).

WD = 0.5
DECAYED = {"kernel": True, "bias": False}


def zero_gradient_update(name, mask_decay, **fields):
  cfg = default.get_config().optimizer
  cfg.update(
    {"name": name, "learning_rate": LR, "weight_decay": WD, "momentum": 0.0, **fields}
  )
  cfg.mask_decay = mask_decay
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 2.0)}
  if name in optimizer_lib.SELF_EXCHANGING:
    parts = optimizer_lib.self_exchanging(cfg, 10, None)
  else:
    parts = optimizer_lib.local_optimizer(cfg, 10)
  tx = optax.chain(*parts)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  return {k: np.asarray(v) for k, v in updates.items()}


@pytest.mark.parametrize("name", ["sgd", "adamw", "demo"])
@pytest.mark.parametrize("mask_decay", [True, False, None])
def test_mask_decay_masks_every_optimizer_alike(name, mask_decay):
  fields = {"chunk": 4, "topk": 1} if name == "demo" else {}
  updates = zero_gradient_update(name, mask_decay, **fields)
  if mask_decay is None:  # Each optimizer's mask before the field existed.
    decayed = DECAYED if name == "adamw" else {"kernel": True, "bias": True}
  else:
    decayed = DECAYED if mask_decay else {"kernel": True, "bias": True}
  for k, on in decayed.items():
    want = -LR * WD * 2.0 if on else 0.0
    np.testing.assert_allclose(updates[k], want, rtol=4 * EPS32, atol=0)
