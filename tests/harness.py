"""Running a compressor on 8 virtual CPU workers (shard_map and pmap) in tests.

Per-worker values (gradients, compressor state) carry a leading worker axis
sharded over ``"data"``; outputs come back with that axis too, so a test can
check that every worker got the same result instead of trusting the typing.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.parallel import workers

AXIS = "data"
WORKERS = 8


@functools.cache
def mesh():
  return jax.make_mesh((WORKERS,), (AXIS,))


def shard(tree, spec=None):
  """Places ``tree`` on the mesh, split over workers along axis 0 by default."""
  return jax.device_put(tree, NamedSharding(mesh(), P(AXIS) if spec is None else spec))


# The hostile-value matrix (tests/test_bad_inputs.py and the wrappers' own
# tests): dtype and shape cases are leaves; "matrix" and "half" are matrices
# that PowerSGD compresses at rank 2 (the others it sends dense).
HOSTILE_LEAVES = {
  "matrix": ((6, 5), jnp.float32),
  "half": ((8, 6), jnp.float16),
  "brain": ((3, 4), jnp.bfloat16),
  "scalar": ((), jnp.float32),
  "empty": ((0,), jnp.float32),
  "one": ((1,), jnp.float32),
}

# Value cases: what worker 0 writes into every other entry of every leaf
# ("zeros": into all of them). Finite values are clipped to each leaf's finite
# range (1e38 is float16's maximum in "half"), "denormal" is 3x the smallest
# subnormal of each dtype, 6e4 is near float16's maximum (65504).
HOSTILE_CASES = {
  "clean": None,
  "nan": np.nan,
  "+inf": np.inf,
  "-inf": -np.inf,
  "zeros": 0.0,
  "+1e38": 1e38,
  "-1e38": -1e38,
  "denormal": "denormal",
  "6e4": 6e4,
}


def hostile(clean, case: str) -> np.ndarray:
  """``clean`` (an array; a 0-d one for a scalar leaf) with ``case`` written in."""
  value = HOSTILE_CASES[case]
  clean = np.asarray(clean)  # a NumPy scalar's copy would be written to and lost
  if value is None:
    return clean
  if case == "zeros":
    return np.zeros_like(clean)
  info = jnp.finfo(clean.dtype)
  if value == "denormal":
    value = 3 * float(info.smallest_subnormal)
  elif np.isfinite(value):
    value = float(np.clip(value, float(info.min), float(info.max)))
  out = np.array(clean)  # a copy, 0-d for a scalar leaf
  out.reshape(-1)[::2] = value
  return out


#: The arguments a registered compressor cannot build without, for suites
#: that build every one by name.
REQUIRED = {
  "topk": {"ratio": 0.5},
  "randomk": {"ratio": 0.5},
  "dgc": {"ratio": 0.5},
  "sketch_topk": {"ratio": 0.5},
  "sparse_quantize": {"threshold": 0.5},
}


def worker_state(tx, params):
  """``tx.init(params)`` repeated for every worker, sharded over the workers."""
  return shard(gradcomp.add_worker_axis(tx.init(params), WORKERS))


def sharded_update(tx, *, jit: bool = True):
  """``f(grads, state) -> (updates, state)``, all with a leading worker axis."""

  f = workers.sharded_update(tx, mesh(), AXIS)
  return jax.jit(f) if jit else f


def sharded_steps(tx):
  """``f(grads, state)`` over grads of shape (T, workers, ...): a scan of T steps.

  Returns the per-step updates of worker 0's view, shape (T, ...), and the
  final per-worker state.
  """

  def steps(grads, state):
    grads = jax.tree.map(lambda g: g[:, 0], grads)
    state = gradcomp.drop_worker_axis(state)

    def body(state, g):
      updates, state = tx.update(g, state)
      return state, updates

    state, updates = jax.lax.scan(body, state, grads)
    return updates, gradcomp.add_worker_axis(state)

  f = jax.shard_map(
    steps,
    mesh=mesh(),
    in_specs=(P(None, AXIS), P(AXIS)),
    out_specs=(P(), P(AXIS)),
  )
  return jax.jit(f)


def every_step(tx, grads, params, *, state_after: bool = True):
  """Every worker's output and state at each step of a scan, as NumPy.

  ``grads``: leaves (T, workers, ...); ``params`` shapes ``tx.init``. Returns
  ``(outs, states)``, each with leading axes (T, workers): the state after
  each step (``state_after``) or before it.
  """

  def steps(g, state):
    state = gradcomp.drop_worker_axis(state)

    def body(state, g):
      out, new = tx.update(jax.tree.map(lambda x: x[0], g), state)
      kept = new if state_after else state
      return new, (gradcomp.add_worker_axis(out), gradcomp.add_worker_axis(kept))

    _, per_step = jax.lax.scan(body, state, g)
    return per_step

  f = jax.shard_map(
    steps, mesh=mesh(), in_specs=(P(None, AXIS), P(AXIS)), out_specs=P(None, AXIS)
  )
  outs, states = jax.jit(f)(shard(grads, P(None, AXIS)), worker_state(tx, params))
  return jax.tree.map(np.asarray, outs), jax.tree.map(np.asarray, states)


def pmapped_update(tx):
  return jax.pmap(tx.update, axis_name=AXIS)


def assert_same_on_workers(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    for w in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(leaf[w], leaf[0])


def random_grads(shapes: dict, seed: int = 0, workers: int = WORKERS):
  """A dict of float32 gradients with a leading worker axis."""
  rng = np.random.default_rng(seed)
  return {
    name: jnp.asarray(rng.standard_normal((workers, *shape)), jnp.float32)
    for name, shape in shapes.items()
  }


# Mixed dtypes, a scalar, a matrix PowerSGD compresses and a 1-D leaf it
# reshapes; tree order: conv, dense/bias, dense/kernel, scale, vector.
MIXED_PARAMS = {
  "dense": {
    "kernel": jnp.zeros((12, 10), jnp.float32),
    "bias": jnp.zeros((10,), jnp.bfloat16),
  },
  "conv": jnp.zeros((3, 3, 4, 8), jnp.float16),
  "vector": jnp.zeros((50,), jnp.float32),
  "scale": jnp.zeros((), jnp.float32),
}


def grads_like(params, seed: int = 0):
  """Standard-normal gradients shaped and typed like ``params`` (one device)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
    treedef,
    [
      jax.random.normal(k, p.shape).astype(p.dtype)
      for k, p in zip(keys, leaves, strict=True)
    ],
  )


def assert_mean_over_workers(out, per_worker, dtype=jnp.float32, rel=0.0, tiny=0.0):
  """Asserts ``out`` is ``per_worker``'s mean over axis 0, up to the sum's rounding.

  The n workers' terms meet in one sum, in the all-reduce's order (not
  NumPy's, and not the same for every backend or process layout). Whatever
  the order, a sum of n terms rounded in ``dtype`` errs by at most
  gamma_{n-1} sum_w |term_w| <= n u sum_w |term_w| (Higham, *Accuracy and
  Stability of Numerical Algorithms*, §4.2), u the unit roundoff. That
  bound, per coordinate, holds for every summation order; a fixed ``rtol``
  does not where the terms cancel (a mean near 0 of large terms). The
  reference is the float64 mean, so only the compressor's sum rounds.

  ``rel`` adds a relative error each term may carry on its own (a scale
  computed by a float32 reduction in another program); ``tiny`` an absolute
  one (half-precision subnormals).
  """
  per_worker = np.asarray(per_worker, np.float64)
  n = per_worker.shape[0]
  expected = per_worker.mean(axis=0)
  magnitude = np.abs(per_worker).mean(axis=0)  # sum_w |term_w| / n
  unit_roundoff = float(jnp.finfo(dtype).eps) / 2  # float32 2^-24, bfloat16 2^-8
  bound = (n * unit_roundoff + rel) * magnitude + tiny
  err = np.abs(np.asarray(out, np.float64) - expected)
  if not np.all(err <= bound):
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    raise AssertionError(
      f"not the mean over workers at {i}: got {np.asarray(out)[i]!r}, mean "
      f"{expected[i]!r}, error {err[i]:.3g} > bound {bound[i]:.3g} "
      f"({np.count_nonzero(err > bound)} of {err.size} coordinates)"
    )


def assert_states_close(got, want, rel: float):
  """Two training states agree: floats to ``rel`` of each leaf's largest value.

  For runs that differ only in the order of float32 sums (pmap vs shard_map,
  two processes vs one): a reordered sum differs by a few units of roundoff
  of the summed magnitudes, so the error scales with the leaf's size, not
  with each element's (a residual entry near 0 carries the error of the
  gradient it was left from). Integer leaves (counters, keys) are exact.
  """
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    if not np.issubdtype(b.dtype, np.floating):
      np.testing.assert_array_equal(a, b)
      continue
    scale = float(np.max(np.abs(b), initial=0.0))
    err = float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0))
    assert err <= rel * scale, f"{err:.3g} > {rel:g} x {scale:.3g}"


def scheme_steps(tx, *, jit: bool = True):
  """``f(params, grads) -> (params, state)``: ``tx`` run as a scheme on 8 workers.

  ``params`` start replicated; ``grads`` have shape (T, workers, ...): step
  t's gradient of each worker (given, not computed, so a NumPy reference can
  replay them). The first step runs unrolled and the rest in a ``scan``, whose
  carry keeps the types the first step produced (params and per-worker state
  typed varying, counters and agreed values invariant), as the training
  step's layout does. Returns every worker's final params and state, each
  leaf with a leading worker axis.
  """

  def steps(params, grads):
    grads = jax.tree.map(lambda g: g[:, 0], grads)
    state = tx.init(params)

    def body(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), None

    first = jax.tree.map(lambda g: g[0], grads)
    carry, _ = body((params, state), first)
    rest = jax.tree.map(lambda g: g[1:], grads)
    (params, state), _ = jax.lax.scan(body, carry, rest)
    return gradcomp.add_worker_axis((params, state))

  f = jax.shard_map(
    steps, mesh=mesh(), in_specs=(P(), P(None, AXIS)), out_specs=P(AXIS)
  )
  return jax.jit(f) if jit else f


def scheme_grads(shapes, steps: int, seed: int = 0):
  """Float32 N(0, 1) gradients of shape ``(steps, workers, *shape)`` per key."""
  rng = np.random.default_rng(seed)
  return {
    k: rng.standard_normal((steps, WORKERS, *s)).astype(np.float32)
    for k, s in shapes.items()
  }


def scheme_params(shapes, seed: int = 1):
  """Float32 N(0, 1) params per key of ``shapes``."""
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def run_scheme(tx, params, grads):
  """:func:`scheme_steps` on NumPy ``params`` and ``grads``; NumPy results."""
  out, state = scheme_steps(tx)(
    jax.tree.map(jnp.asarray, params), shard(grads, P(None, AXIS))
  )
  return jax.tree.map(np.asarray, (out, state))


def assert_within(got, want, bound: float) -> None:
  """Every leaf of ``got`` within ``bound`` (absolute) of float64 ``want``."""
  for key in want:
    err = np.max(np.abs(np.asarray(got[key], np.float64) - want[key]))
    assert err <= bound, f"{key}: error {err:.3g} > bound {bound:.3g}"


def preempted_copy(whole: Path, workdir: Path, step: int | None = None) -> int:
  """Leaves ``workdir`` as a run of the same config preempted after ``step``.

  ``whole`` is the uninterrupted run's workdir: its checkpoint at ``step``
  (by default the latest before its last) and its fusion plan are copied,
  nothing else (no later checkpoint, no metrics). A run of the same config
  in ``workdir`` then restores the state the whole run saved mid-run, as
  after a preemption, and trains the steps after it: its end must be the
  whole run's, bit for bit. One program run per resume check, where a run
  stopped at ``step`` and then resumed takes two.

  Returns:
    The step the copy resumes from.
  """
  from train import train  # the program: only the tests that run it load it

  saved = sorted(
    int(p.name) for p in (whole / train.CHECKPOINT_DIR).iterdir() if p.name.isdigit()
  )
  if step is None:
    if len(saved) < 2:
      raise ValueError(f"{whole} holds no checkpoint before its last: {saved}")
    step = saved[-2]
  if step not in saved:
    raise ValueError(f"{whole} holds no checkpoint at step {step}: {saved}")
  shutil.copytree(
    whole / train.CHECKPOINT_DIR / str(step), workdir / train.CHECKPOINT_DIR / str(step)
  )
  if (whole / train.PLAN_FILE).exists():
    shutil.copy(whole / train.PLAN_FILE, workdir / train.PLAN_FILE)
  return step


def assert_resumed_after(workdir: Path, step: int) -> None:
  """The run in ``workdir`` logged training rows past ``step`` only.

  A run that ignored its checkpoint and trained from scratch would end where
  the whole run ends too; its rows at or before ``step`` (a log interval of at
  most ``step``) tell it apart.
  """
  from train import logs

  rows = [
    r["step"] for r in logs.read_metrics(workdir / logs.METRICS_FILE) if "loss" in r
  ]
  assert rows and min(rows) > step, rows
