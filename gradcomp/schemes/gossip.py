r"""Decentralized SGD: D-PSGD over a topology, and CHOCO-SGD with any gathered codec.

Survey 004 §2.3 (gossiping SGD: workers average only with neighbours). Two
algorithms on a :class:`~gradcomp.topology.Topology` (its mixing
matrix :math:`W_t` at step :math:`t` is doubly stochastic):

* **D-PSGD** (Lian et al. 2017, "Can Decentralized Algorithms Outperform
  Centralized Algorithms?", Alg. 1): :math:`x_{t+1} = W_t x_t + u_t`, with
  :math:`u_t` the inner optimizer's update from the gradient taken at
  :math:`x_t`. Neighbours mix the params the gradient was taken at, so no
  operand of the ``ppermute`` depends on this step's gradient: the exchange
  may run under the backward pass (the structural test of paper 001's
  issue applies).
* **CHOCO-SGD** (Koloskova, Stich, Jaggi 2019, "Decentralized Stochastic
  Optimization and Gossip Algorithms with Compressed Communication", Alg. 2;
  the memory-efficient form of Koloskova et al. 2020, Alg. 1). Each worker
  keeps a public copy :math:`\hat x_i` of its params and the weighted sum of
  its neighbourhood's public copies :math:`s_i = \sum_j W_{ij} \hat x_j`:

  .. math::

    x^{t+1/2}_i = x^t_i + u^t_i, \quad
    q_i = Q(x^{t+1/2}_i - \hat x_i), \quad
    \hat x_i \mathrel{+}= q_i, \quad
    s_i \mathrel{+}= \textstyle\sum_j W_{ij} q_j, \quad
    x^{t+1}_i = x^{t+1/2}_i + \gamma (s_i - \hat x_i)

  :math:`q_j` crosses the wire as the codec's payload ((values, int32
  indices) for top-k, packed bits and a scale for the scaled sign, ...),
  through one ``collective-permute`` per edge, and is decoded by the
  receiver (``exchange.Neighbours``). The codec is used *memoryless*: the
  public copy is CHOCO's memory, and a compressor's own error feedback on top
  would send the withheld part twice, so each step starts the compressor from
  its ``init`` state (its PRNG stream advanced by the step). Codecs whose
  exchange needs a global reduction (PowerSGD, random-k's agreed indices, the
  Count Sketch, fp16's all-reduce) raise a ``ValueError``.

``public_copies=False`` is the scheme CHOCO fixes, kept for comparison:
gossip on the compressed params themselves, :math:`x_i \leftarrow
x^{t+1/2}_i + \gamma (\sum_j W_{ij} Q(x^{t+1/2}_j) - Q(x^{t+1/2}_i))` (the
"Q2" quantized gossip of Carli et al. 2007 that Koloskova et al. 2019 §5
compare against). With a biased codec such as top-k it does not reach
consensus: what :math:`Q` drops is never exchanged (a test and the gossip
benchmark show it).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp import topology as topology_lib
from gradcomp.compressors import exchange
from gradcomp.compressors.base import CompressorState
from gradcomp.compressors.spec import spec_of
from gradcomp.parallel import mixing
from gradcomp.schemes import base


class GossipState(NamedTuple):
  """State of :func:`gossip`.

  Attributes:
    count: shape=(), int32: steps taken (chooses the topology's phase);
      replicated.
    inner_state: the local optimizer's state; per worker.
    public: CHOCO's public copy :math:`\\hat x_i` of the worker's params
      (zeros at first); per worker. ``optax.EmptyState()`` for D-PSGD.
    neighbourhood: CHOCO's :math:`s_i = \\sum_j W_{ij} \\hat x_j`; per
      worker. ``optax.EmptyState()`` for D-PSGD.
  """

  count: jax.Array
  inner_state: optax.OptState
  public: optax.Params
  neighbourhood: optax.Params


def _topology(topology, axis_name):
  """The :class:`Topology` for the mapped axis (a name is built for its size)."""
  n = exchange.num_workers(axis_name)
  if isinstance(topology, str):
    return topology_lib.get(topology, n)
  if topology.workers != n:
    raise ValueError(
      f"topology {topology.name!r} is for {topology.workers} workers, but "
      f"axis {axis_name!r} has {n}"
    )
  return topology


def gossip(
  inner: optax.GradientTransformation,
  topology: topology_lib.Topology | str,
  *,
  compressor: optax.GradientTransformation | None = None,
  gamma: float | None = None,
  public_copies: bool = True,
  axis_name: str | None = None,
) -> optax.GradientTransformation:
  r"""D-PSGD, or CHOCO-SGD with a ``compressor``, over ``topology``.

  See the module docstring for both algorithms.

  **Reductions** (tests): ``complete`` mixing with every worker's update the
  same is synchronous SGD; one worker is ``inner``; doubly stochastic mixing
  keeps the workers' average (D-PSGD: the average moves by the mean update
  alone).

  Args:
    inner: the worker's local optimizer.
    topology: a :class:`~gradcomp.topology.Topology` for the
      axis's worker count, or a name (``ring``, ``torus``, ``exponential``,
      ``one_peer_exponential``, ``complete``) built for it.
    compressor: a gradcomp compressor (any ``axis_name``: it is rebuilt for
      the neighbour exchange) for CHOCO-SGD; ``None``: D-PSGD.
    gamma: CHOCO's consensus step size in (0, 1]; required with a
      compressor, unused without.
    public_copies: CHOCO's public copies (default); ``False`` gossips the
      compressed params themselves (Carli et al. 2007's "Q2" gossip, for
      comparison: it does not reach consensus with a biased codec).
    axis_name: the mapped axis of the workers, or ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`GossipState`; its
    ``update`` requires ``params``.

  Raises:
    ValueError: for a bad ``inner``, ``compressor`` or ``gamma``, an unknown
      topology name, a topology for another worker count, a time-varying
      topology with a compressor (CHOCO's public copies assume fixed
      neighbours), or a codec that needs a global reduction.

  Examples:
    One worker has no neighbour to mix with: D-PSGD is its ``inner``
    optimizer, here a step of ``-0.5 g``.

    >>> import jax.numpy as jnp, optax, gradcomp
    >>> tx = gradcomp.gossip(optax.sgd(0.5), "ring")
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> grads = {"w": jnp.array([1.0, -2.0])}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> updates["w"].tolist(), int(state.count)
    ([-0.5, 1.0], 1)

  References:
    Survey 004 §2.3; Lian et al. 2017; Koloskova et al. 2019 (Alg. 2).
  """
  inner = base.transformation("inner", inner)
  compressor = base.transformation("compressor", compressor, optional=True)
  if not isinstance(topology, str | topology_lib.Topology):
    raise ValueError(
      f"topology must be a gradcomp Topology or a name, got {topology!r}"
    )
  if isinstance(topology, str):
    topology_lib.get(topology, 1)  # An unknown name fails here, not in a trace.
  if compressor is not None:
    if gamma is None or not 0 < gamma <= 1:
      raise ValueError(
        f"gamma must be in (0, 1] with a compressor (CHOCO's consensus step), "
        f"got {gamma!r}"
      )
    spec = spec_of(compressor)
    if spec is None:
      raise ValueError(
        "compressor must be built by a gradcomp factory (its codec is rebuilt "
        "for the neighbour exchange)"
      )
  elif gamma is not None:
    raise ValueError(f"gamma is CHOCO's step and needs a compressor, got {gamma!r}")
  if not isinstance(public_copies, bool):
    raise ValueError(f"public_copies must be True or False, got {public_copies!r}")

  def init_fn(params):
    if compressor is None or not public_copies:
      public = neighbourhood = optax.EmptyState()
    else:
      public = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
      neighbourhood = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    return GossipState(
      count=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
      public=public,
      neighbourhood=neighbourhood,
    )

  def compressed_gossip(tree, count, topo):
    """``(Q(x_i), sum_j W_ij Q(x_j))`` of ``tree``, the codec's payload on the wire."""
    if len(topo.phases) > 1:
      raise ValueError(
        f"CHOCO-SGD here needs a static topology (its public copies assume "
        f"fixed neighbours); {topo.name!r} has {len(topo.phases)} phases"
      )
    leaves, treedef = jax.tree.flatten(tree)
    pattern = exchange.Neighbours(topo, count, axis_name)
    codec = spec_of(compressor).build(axis_name=pattern)
    codec_state = codec.init(tree)
    if isinstance(codec_state, CompressorState):  # a fresh stream per step
      codec_state = codec_state._replace(
        count=count, key=jax.random.fold_in(codec_state.key, count)
      )
    codec.update(tree, codec_state)
    sent = iter(zip(pattern.own, pattern.mixed, strict=True))
    own, mixed = [], []
    for leaf in leaves:
      if leaf.size == 0:  # Nothing was exchanged for it.
        own.append(jnp.zeros_like(leaf))
        mixed.append(jnp.zeros_like(leaf))
        continue
      q, m = next(sent)
      own.append(q.reshape(leaf.shape).astype(leaf.dtype))
      mixed.append(m.reshape(leaf.shape).astype(leaf.dtype))
    return treedef.unflatten(own), treedef.unflatten(mixed)

  def choco(half, state, topo):
    """Alg. 2 lines 4-9: compress the move, update the public copies, mix."""
    diff = jax.tree.map(jnp.subtract, half, state.public)
    own, mixed = compressed_gossip(diff, state.count, topo)
    public = jax.tree.map(jnp.add, state.public, own)
    neighbourhood = jax.tree.map(jnp.add, state.neighbourhood, mixed)
    new = jax.tree.map(lambda h, s, x: h + gamma * (s - x), half, neighbourhood, public)
    return new, public, neighbourhood

  def q2(half, state, topo):
    """Carli et al. 2007: gossip on the compressed params, no public copies."""
    own, mixed = compressed_gossip(half, state.count, topo)
    new = jax.tree.map(lambda h, m, q: h + gamma * (m - q), half, mixed, own)
    return new, state.public, state.neighbourhood

  def update_fn(grads, state, params=None):
    params = base.require_params(params, "gossip")
    topo = _topology(topology, axis_name)
    u, inner_state = inner.update(grads, state.inner_state, params)
    if compressor is None:
      # D-PSGD: the mix reads the params the gradient was taken at.
      mixed = mixing.mix(topo, params, state.count, axis_name)
      new = jax.tree.map(jnp.add, mixed, u)
      public, neighbourhood = state.public, state.neighbourhood
    else:
      half = optax.apply_updates(params, u)
      step = choco if public_copies else q2
      new, public, neighbourhood = step(half, state, topo)
    updates = jax.tree.map(jnp.subtract, new, params)
    return updates, GossipState(
      optax.safe_increment(state.count), inner_state, public, neighbourhood
    )

  return optax.GradientTransformation(init_fn, update_fn)
