r"""One island's JAX program: a whole replica, its inner steps and the outer step.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Alg. 1) across islands, the
round of ``gradcomp.local_sgd`` with the exchange cut at the wire
(``wire.py``). Island :math:`i` holds the global params :math:`a` (the
anchor), the outer optimizer state, its inner optimizer state, its
compressor state (error feedback) and a *carry* :math:`c_i`. Round
:math:`r`:

.. math::

  x_i \leftarrow a;\quad x_i \leftarrow \text{inner}^H(x_i);\quad
  \Delta_i = a - x_i + c_i;\quad p_i = \mathrm{encode}(\Delta_i),\;
  c_i \leftarrow 0

then, with :math:`Q` the payloads of the quorum that pass the checks
(``payload.check``), in island order,

.. math::

  \bar\Delta = \frac1Q \sum_{q \in Q} \mathrm{decode}(p_q), \qquad
  a \leftarrow a + \mathrm{outer}(\bar\Delta).

The inner steps are data parallel over the island's own devices (a mesh
``data=devices_per_island``; the batch is sharded, params replicated, and
XLA all-reduces the gradient inside the island). Nothing but :math:`p_i`
leaves the island.

**Mass of a payload that is not applied** (late, dropped, or rejected):
its sender adds its own decoded payload :math:`\mathrm{decode}(p_i)` to its
carry, so it enters the next round's pseudo-gradient. The error feedback
already kept :math:`\Delta_i - \mathrm{decode}(p_i)`, so nothing the island
computed is lost: :math:`\Delta_i = \text{applied} + \text{residual} +
\text{carry}` (``tests/test_islands_units.py`` checks it). With
``compressor=none`` the carry is the whole pseudo-gradient.

**Joining.** A restarted or new island copies the global params, the outer
state, the compressor's step count and the round from a live peer
(:meth:`Replica.snapshot` / :meth:`Replica.load`), checked against the
peer's hash. Its inner optimizer state starts at zero and its error
feedback and carry are empty: residuals are per island (a peer's residual
is that peer's unsent mass; copying it would send it twice), and the dead
island's own residual died with its process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import data as data_lib
from train import optimizer as optimizer_lib
from train import step as step_lib
from train import workload as workload_lib
from train.islands import hashing
from train.islands import payload as payload_lib
from train.islands import wire as wire_lib

AXIS = "data"


def outer_optimizer(scheme_cfg) -> optax.GradientTransformation:
  """DiLoCo's outer Nesterov SGD (``outer_learning_rate``, ``outer_momentum``).

  Unset ``outer_learning_rate``: plain averaging (outer SGD at lr 1.0).
  """
  lr = scheme_cfg.get("outer_learning_rate")
  if lr is None:
    return optax.sgd(1.0)
  momentum = scheme_cfg.get("outer_momentum")
  return optax.sgd(lr, momentum=0.9 if momentum is None else momentum, nesterov=True)


def data_seed(seed: int, island: int) -> int:
  """The seed of island ``island``'s own data order."""
  return int(np.random.SeedSequence([seed, island]).generate_state(1)[0])


def _host(tree):
  return jax.tree.map(np.asarray, tree)


@dataclasses.dataclass
class Snapshot:
  """What a joining island copies from a live peer (host arrays)."""

  round: int  # rounds applied so far
  params: Any
  outer_state: Any
  compressor_count: int
  hash: str


class Replica:
  """One island's replica and its programs (no Ray: testable alone).

  Args:
    config: the run's config (``configs/islands.py``).
    island: this island's id.
    run: the run's id, stamped on its payloads.
    devices: the devices of the island's mesh (default: all local ones).
  """

  def __init__(self, config, island: int, run: str, devices=None):
    self.config, self.island, self.run = config, island, run
    self.every = int(config.scheme.every)
    self.batch = int(config.global_batch_size)
    devices = list(jax.devices() if devices is None else devices)
    if self.batch % len(devices):
      raise ValueError(
        f"config.global_batch_size={self.batch} must be a multiple of "
        f"islands.devices_per_island={len(devices)}"
      )
    self.mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    self.work = workload_lib.create(config)
    ds = self.work.dataset
    params, self.model_state = step_lib.init_model(
      self.work.model, jax.random.PRNGKey(config.seed), ds.input_shape, ds.x_train.dtype
    )
    self._replicated = NamedSharding(self.mesh, P())
    self._batched = NamedSharding(self.mesh, P(None, AXIS))
    total = self.every * int(config.islands.rounds)
    self.inner = optax.chain(*optimizer_lib.local_optimizer(config.optimizer, total))
    self.outer = outer_optimizer(config.scheme)
    self.wire = wire_lib.build_from(config.compressor)
    self.params = self._put(params)
    self.inner_state = self._put(self.inner.init(params))
    self.outer_state = self._put(self.outer.init(params))
    self.comp_state = self._put(self.wire.init(params, island))
    self.carry = self._put(jax.tree.map(jnp.zeros_like, params))
    self.round = 0  # rounds applied
    self.pending_own = None  # decode(own payload) of the round just worked
    self.worked_round = None
    self._arity = self.wire.arity(params, self.comp_state)
    self._fresh_comp = self._put(self.wire.init(params, island))
    self._compile()
    self.spec = payload_lib.spec_of(
      jax.eval_shape(self._encode, params, self.comp_state)[2]
    )

  def _put(self, tree):
    """``tree`` replicated over the island's mesh, as the programs return it."""
    return jax.device_put(tree, self._replicated)

  # -- programs ---------------------------------------------------------------

  def _compile(self):
    model, criterion = self.work.model, self.work.criterion
    model_state = self.model_state
    inner = self.inner

    def inner_steps(params, inner_state, xs, ys):
      def one(carry, batch):
        p, s = carry
        (loss, _), g = jax.value_and_grad(
          lambda p: step_lib.loss_fn(
            model, p, model_state, *batch, train=True, criterion=criterion
          ),
          has_aux=True,
        )(p)
        u, s = inner.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

      (params, inner_state), losses = jax.lax.scan(one, (params, inner_state), (xs, ys))
      return params, inner_state, jnp.mean(losses)

    self._inner_steps = jax.jit(
      inner_steps,
      in_shardings=(self._replicated, self._replicated, self._batched, self._batched),
      out_shardings=(self._replicated, self._replicated, self._replicated),
      donate_argnums=(1,),
    )
    self._encode = jax.jit(self.wire.encode)

    def pseudo(anchor, local, carry):
      return jax.tree.map(lambda a, x, c: a - x + c, anchor, local, carry)

    self._pseudo = jax.jit(pseudo)
    wire = self.wire
    outer = self.outer
    arity = self._arity

    def outer_step(stacked, weights, anchor, outer_state, comp_state):
      mean = wire.decode_mean(stacked, weights, anchor, comp_state, arity)
      updates, outer_state = outer.update(mean, outer_state, anchor)
      return optax.apply_updates(anchor, updates), outer_state

    self._outer_step = jax.jit(outer_step)

    def evaluate(params, x, y, w):
      loss, (acc, _) = step_lib.loss_fn(
        model, params, model_state, x, y, w, train=False, criterion=criterion
      )
      return jnp.stack([loss * jnp.sum(w), acc * jnp.sum(w), jnp.sum(w)])

    self._evaluate = jax.jit(evaluate)

  # -- a round ------------------------------------------------------------------

  def batches(self, round_: int):
    """This island's ``(every, batch, ...)`` inputs and targets of round ``round_``."""
    ds = self.work.dataset
    it = data_lib.batches(
      ds.x_train,
      ds.y_train,
      self.batch,
      data_seed(self.config.seed, self.island),
      start_step=round_ * self.every,
    )
    xs, ys = zip(*(next(it) for _ in range(self.every)), strict=True)
    return np.stack(xs), np.stack(ys)

  def train_round(self, round_: int) -> tuple[payload_lib.Payload, float]:
    """The inner steps of round ``round_`` from the global params, and the payload.

    Returns:
      ``(payload, mean inner loss)``.

    Raises:
      RuntimeError: the island has not applied every round before ``round_``.
    """
    if round_ != self.round:
      raise RuntimeError(
        f"island {self.island} has applied {self.round} rounds, cannot work on "
        f"round {round_}"
      )
    xs, ys = self.batches(round_)
    local, self.inner_state, loss = self._inner_steps(
      self.params, self.inner_state, xs, ys
    )
    delta = self._pseudo(self.params, local, self.carry)
    own, self.comp_state, arrays = self._encode(delta, self.comp_state)
    self.carry = jax.tree.map(jnp.zeros_like, self.carry)
    self.pending_own, self.worked_round = own, round_
    arrays = tuple(np.asarray(a) for a in arrays)
    return payload_lib.Payload(self.run, round_, self.island, arrays), float(loss)

  def slots(self, good) -> tuple[list[np.ndarray], np.ndarray]:
    """The quorum's arrays in ``S`` slots (quorum first, in island order; zeros after).

    ``S = max(islands.count, Q)``: one compiled outer step for every quorum.
    """
    size = max(int(self.config.islands.count), len(good))
    weights = np.zeros(size, np.float32)
    weights[: len(good)] = 1.0 / len(good)
    stacked = []
    for j, (shape, dtype) in enumerate(self.spec):
      a = np.zeros((size, *shape), dtype)
      for k, p in enumerate(good):
        a[k] = p.arrays[j]
      stacked.append(a)
    return stacked, weights

  def apply(self, round_: int, payloads) -> dict[str, Any]:
    """Applies round ``round_``: the mean of the valid ``payloads``, in island order.

    Args:
      round_: the round, equal to the rounds applied so far.
      payloads: the quorum's payloads (anything: each is checked).

    Returns:
      ``{"hash", "applied": [islands], "rejected": [[island, reason]],
      "bytes": [per applied payload], "carried": bool}``.
    """
    if round_ != self.round:
      raise RuntimeError(
        f"island {self.island} has applied {self.round} rounds, not {round_}"
      )
    good, rejected = [], []
    for i, p in enumerate(payloads):
      reason = payload_lib.check(p, self.spec, self.run, round_)
      sender = p.island if isinstance(p, payload_lib.Payload) else f"#{i}"
      if reason is None and any(q.island == p.island for q in good):
        reason = f"a second payload from island {p.island}"
      if reason is None:
        good.append(p)
      else:
        rejected.append([sender, reason])
    good.sort(key=lambda p: p.island)
    if good:
      stacked, weights = self.slots(good)
      self.params, self.outer_state = self._outer_step(
        stacked, weights, self.params, self.outer_state, self._fresh_comp
      )
    carried = False
    if self.worked_round == round_ and all(p.island != self.island for p in good):
      self.carry = jax.tree.map(jnp.add, self.carry, self.pending_own)
      carried = True
    self.pending_own, self.worked_round = None, None
    self.round = round_ + 1
    return {
      "hash": self.hash(),
      "applied": [p.island for p in good],
      "rejected": rejected,
      "bytes": [p.nbytes for p in good],
      "carried": carried,
    }

  def warmup(self) -> float:
    """Compiles the inner steps, the encoding and the outer step; seconds.

    Runs them on copies and throws the results away: the state is unchanged.
    """
    import time

    start = time.perf_counter()
    xs, ys = self.batches(0)
    copy = lambda t: jax.tree.map(jnp.copy, t)
    local, _, _ = self._inner_steps(self.params, copy(self.inner_state), xs, ys)
    delta = self._pseudo(self.params, local, self.carry)
    _, _, arrays = self._encode(delta, copy(self.comp_state))
    fake = payload_lib.Payload(self.run, 0, self.island, tuple(map(np.asarray, arrays)))
    stacked, weights = self.slots([fake])
    jax.block_until_ready(
      self._outer_step(
        stacked, weights, self.params, self.outer_state, self._fresh_comp
      )
    )
    return time.perf_counter() - start

  def flops_per_round(self) -> float:
    """Training FLOPs of one island's round (all its devices), from the jaxpr."""
    import gradcomp

    ds = self.work.dataset
    sample = jax.ShapeDtypeStruct((1, *ds.input_shape), ds.x_train.dtype)
    per_step = gradcomp.sim.training_flops(
      gradcomp.sim.forward_flops_per_sample(self.work.model, sample), self.batch
    )
    return float(per_step) * self.every

  # -- state --------------------------------------------------------------------

  def hash(self) -> str:
    """:func:`hashing.state_hash` of the rounds applied, global params, outer state."""
    return hashing.state_hash(self.round, _host(self.params), _host(self.outer_state))

  def snapshot(self) -> Snapshot:
    """The global state a joining island copies."""
    count = getattr(self.comp_state, "count", 0)
    return Snapshot(
      self.round,
      _host(self.params),
      _host(self.outer_state),
      int(count),
      self.hash(),
    )

  def load(self, snap: Snapshot, carry=None) -> str:
    """Takes a peer's (or a checkpoint's) global state; returns the checked hash.

    Raises:
      ValueError: the copied state does not hash to ``snap.hash``.
    """
    self.params = self._put(jax.tree.map(jnp.asarray, snap.params))
    like = self.outer_state
    self.outer_state = self._put(
      jax.tree.unflatten(
        jax.tree.structure(like),
        [jnp.asarray(x) for x in jax.tree.leaves(snap.outer_state)],
      )
    )
    self.round = snap.round
    comp_state = self.wire.init(self.params, self.island)
    if hasattr(comp_state, "count"):
      comp_state = comp_state._replace(
        count=jnp.asarray(snap.compressor_count, jnp.int32)
      )
    self.comp_state = self._put(comp_state)
    self.carry = self._put(
      jax.tree.map(jnp.zeros_like, self.params)
      if carry is None
      else jax.tree.map(jnp.asarray, carry)
    )
    self.pending_own, self.worked_round = None, None
    got = self.hash()
    if got != snap.hash:
      raise ValueError(
        f"island {self.island}: the copied state hashes to {got[:12]}, the peer's "
        f"to {snap.hash[:12]}; not joining"
      )
    return got

  def unsent(self):
    """This island's mass not yet applied: error-feedback residuals plus the carry."""
    res = wire_lib.residuals(self.comp_state, self.params)
    return _host(jax.tree.map(jnp.add, res, self.carry))

  def corrupt(self) -> None:
    """Adds 1e-3 to the first global param (the ``corrupt`` fault)."""
    leaves, treedef = jax.tree.flatten(self.params)
    leaves[0] = leaves[0] + 1e-3
    self.params = jax.tree.unflatten(treedef, leaves)

  def evaluate(self) -> dict[str, float]:
    """Loss and accuracy of the global params on the whole test set.

    In batches of ``config.eval_batch_size``, the last padded with weight 0
    (one shape, one compile).
    """
    ds = self.work.dataset
    n, size = len(ds.y_test), int(self.config.eval_batch_size)
    totals = np.zeros(3)
    for start in range(0, n, size):
      rows = np.arange(start, start + size)
      w = (rows < n).astype(np.float32)
      rows = np.minimum(rows, n - 1)
      x, y = np.asarray(ds.x_test[rows]), np.asarray(ds.y_test[rows])
      if y.ndim > 1:  # per position: every position of a row weighs as the row
        w = np.broadcast_to(w.reshape(-1, *([1] * (y.ndim - 1))), y.shape).copy()
      totals += np.asarray(self._evaluate(self.params, x, y, w), np.float64)
    loss, correct, seen = totals
    out = {"eval_loss": float(loss / seen), "eval_accuracy": float(correct / seen)}
    return {**out, **self.work.eval_metrics(out)}
