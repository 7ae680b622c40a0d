r"""A registered compressor split at its wire: encode on one island, decode on all.

Inside one JAX program a gradcomp compressor encodes, exchanges over
``axis_name`` and decodes in one ``update`` (DESIGN §1). Islands are
separate programs, so the exchange is cut out with the library's own hook,
an exchange :class:`gradcomp.compressors.exchange.Pattern`:

- :class:`Outbox` records the payload each leaf's codec would send (the
  wire arrays: values and indices, packed codes and scales) and hands the
  codec its own decoded payload back; the codec's error feedback then keeps
  :math:`e - \mathrm{decode}(p)` as it does on a mesh.
- :class:`Inbox` replaces each leaf's exchange by the mean of the decoded
  payloads of the islands in the quorum, in island order,
  :math:`\frac1Q \sum_q \mathrm{decode}(p_q)`, so every island computes the
  same mean bit for bit.

Only the codecs whose payloads are gathered (``exchange.GATHERED``) can be
split this way (a sum of linear payloads needs an all-reduce); ``none``
sends the dense float32 pseudo-gradient itself. The stochastic codecs draw
their per-worker streams from ``exchange.worker_key``, which reads the
axis index; each island folds its id into the compressor's key instead and
runs the update under a one-element ``vmap`` named ``"island"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.memory import ErrorFeedbackState

AXIS = "island"
DENSE = "none"
NAMES = (DENSE, *exchange.GATHERED)


class Outbox(exchange.Pattern):
  """Records each exchanged payload; returns the sender's own decoded payload."""

  what = "an island's outbox"

  def __init__(self):
    self.axis = AXIS
    self.sent: list[tuple[jax.Array, ...]] = []
    self.structures: list = []

  def exchange(self, payload, decode: Callable[..., jax.Array]) -> jax.Array:
    leaves, structure = jax.tree.flatten(tuple(payload))
    self.sent.append(tuple(leaves))
    self.structures.append(structure)
    return decode(*payload)


class Inbox(exchange.Pattern):
  """Replaces each exchange by the weighted sum of the quorum's decoded payloads.

  Args:
    received: per exchange (in call order), the payloads of that exchange,
      each array stacked on a leading axis of ``S`` slots (the islands;
      slots without a payload hold zeros).
    structures: per exchange, the tree structure of its payload
      (``Outbox.structures``).
    weights: shape ``(S,)``: ``1/Q`` for the ``Q`` slots of the quorum, 0
      for the others, so one program serves every quorum size.
  """

  what = "an island's inbox"

  def __init__(self, received: Sequence[tuple[jax.Array, ...]], structures, weights):
    self.axis = AXIS
    self._received = list(received)
    self._structures = list(structures)
    self._weights = weights
    self._next = 0

  def exchange(self, payload, decode: Callable[..., jax.Array]) -> jax.Array:
    del payload  # The receiver's own encoding is not what it applies.
    stacked = self._received[self._next]
    structure = self._structures[self._next]
    self._next += 1
    return weighted_sum(
      lambda i: decode(*jax.tree.unflatten(structure, [a[i] for a in stacked])),
      self._weights,
    )


def weighted_sum(term: Callable[[int], jax.Array], weights: jax.Array) -> jax.Array:
  """``sum_i weights[i] * term(i)`` in slot order; a zero weight adds an exact 0.

  An empty slot's term is the decoding of zeros (finite), so it adds
  ``0.0`` and the sum is that of the quorum's terms alone, in island order.
  """
  total = term(0) * weights[0]
  for i in range(1, weights.shape[0]):
    total = total + term(i) * weights[i]
  return total


def check_name(name: str) -> None:
  """Raises ``ValueError`` unless islands can send compressor ``name``."""
  if name not in NAMES:
    raise ValueError(
      f"islands cannot send compressor {name!r} (config.compressor.name): its "
      f"payloads are summed by an all-reduce, which only one program can run; "
      f"valid: {', '.join(NAMES)}"
    )


def _in_island_axis(fn):
  """``fn`` run under a one-element ``vmap`` named :data:`AXIS`."""

  def wrapped(*args):
    lifted = jax.tree.map(lambda a: jnp.asarray(a)[None], args)
    out = jax.vmap(lambda *a: fn(*a), axis_name=AXIS)(*lifted)
    return jax.tree.map(lambda a: a[0], out)

  return wrapped


class Wire:
  """Encode and decode-mean of one compressor, across islands.

  Args:
    build: ``build(axis_name) -> optax.GradientTransformation``, the
      registered compressor with that ``axis_name`` (``None`` for ``none``).
    name: the compressor's registered name.
  """

  def __init__(self, build: Callable[..., optax.GradientTransformation], name: str):
    check_name(name)
    self.name = name
    self._build = build

  @property
  def dense(self) -> bool:
    return self.name == DENSE

  def init(self, params, island: int) -> optax.OptState:
    """The compressor's state for ``island``: its key folded with the island id."""
    if self.dense:
      return optax.EmptyState()
    state = self._build(None).init(params)
    if isinstance(state, CompressorState):
      state = state._replace(key=jax.random.fold_in(state.key, island))
    return state

  def encode(self, pseudo_grads, state):
    """``(own decoded, new state, wire arrays)`` of this island's payload.

    ``own decoded`` is what the island's payload will add to the mean
    (times ``1/Q``); the new state's error feedback keeps the rest.
    """
    if self.dense:
      leaves = tuple(jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(pseudo_grads))
      return pseudo_grads, state, leaves

    def f(g, s):
      box = Outbox()
      own, s = self._build(box).update(g, s)
      return own, s, tuple(a for p in box.sent for a in p)

    return _in_island_axis(f)(pseudo_grads, state)

  def arity(self, like, state) -> tuple:
    """The tree structure of each exchange's payload in ``encode``, in call order."""
    if self.dense:
      return ()
    structures = []

    def f(g, s):
      box = Outbox()
      self._build(box).update(g, s)
      structures.extend(box.structures)
      return ()

    jax.eval_shape(_in_island_axis(f), like, state)
    return tuple(structures)

  def decode_mean(self, stacked: Sequence[jax.Array], weights, like, state, arity):
    """The mean of the quorum's decoded payloads, a tree like ``like``.

    Args:
      stacked: the wire arrays of every payload, each stacked over ``S``
        island slots (zeros where an island has no payload), in encode order.
      weights: shape ``(S,)``, ``1/Q`` at the quorum's ``Q`` slots, else 0.
      like: the params (shapes and dtypes; values unused).
      state: a compressor state (only its shapes matter: ``Inbox`` ignores
        the local encoding).
      arity: :meth:`arity` (static).
    """
    if self.dense:
      means = [weighted_sum(lambda i, a=a: a[i], weights) for a in stacked]
      return jax.tree.unflatten(
        jax.tree.structure(like),
        [m.astype(x.dtype) for m, x in zip(means, jax.tree.leaves(like), strict=True)],
      )
    groups, start = [], 0
    for structure in arity:
      k = structure.num_leaves
      groups.append(tuple(stacked[start : start + k]))
      start += k

    def f(g, s, groups, weights):
      mean, _ = self._build(Inbox(groups, arity, weights)).update(g, s)
      return mean

    zeros = jax.tree.map(jnp.zeros_like, like)
    # The stacks keep their slot axis: lift them by hand, not with the args.
    lifted = jax.tree.map(
      lambda a: jnp.asarray(a)[None], (zeros, state, groups, weights)
    )
    out = jax.vmap(f, axis_name=AXIS)(*lifted)
    return jax.tree.map(lambda a: a[0], out)


def residuals(state, like):
  """The error-feedback residuals in a compressor ``state``, a tree like ``like``.

  Zero for a leaf whose codec keeps none (or for ``none``): what the
  compressor still owes the mean, the mass elastic resume must conserve.
  """
  if not isinstance(state, CompressorState):
    return jax.tree.map(jnp.zeros_like, like)

  def one(p, s):
    if isinstance(s, ErrorFeedbackState):
      return jnp.asarray(s.residual, p.dtype)
    return jnp.zeros_like(p)

  return jax.tree.map(one, like, state.leaves)


def build_from(cfg) -> Wire:
  """The :class:`Wire` of ``config.compressor`` (``train.optimizer.compressor``)."""
  from train import optimizer as optimizer_lib

  check_name(cfg.name)
  return Wire(lambda axis: optimizer_lib.compressor(cfg, axis_name=axis), cfg.name)
