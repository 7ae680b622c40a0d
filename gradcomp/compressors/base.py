"""The compressor skeleton: a per-leaf codec lifted to an optax transformation.

Every compressor is a codec (encode / decode of one leaf), an exchange
over ``axis_name`` and, optionally, a memory (error feedback). Here the codec and
its exchange are one :class:`LeafCodec`, because several algorithms interleave
them (PowerSGD exchanges P before it can compute Q); the memory wraps any
``LeafCodec`` (see ``memory.py``). :func:`leafwise` turns a codec into an
``optax.GradientTransformation`` that treats each leaf of the tree it receives as
one unit of compression (paper 000 §3: *layer-wise* compression; fused buffers
come from LayerFusion, which hands the compressor a tree of 1-D buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import exchange
from gradcomp.kernels import hashing, numerics

LeafState = Any


class LeafCodec(NamedTuple):
  """Compression, exchange and decompression of one leaf.

  Attributes:
    init: ``init(leaf, key) -> LeafState`` from anything with ``.shape`` and
      ``.dtype`` (an array or a ``jax.ShapeDtypeStruct``) and a PRNG key shared
      by all workers. Codecs without state return ``()``.
    apply: ``apply(x, state, key, step) -> (mean, remainder, state)``.
      ``x`` is this worker's float32 leaf; ``key`` a fresh PRNG key for this
      leaf and step, the same on every worker (derive a per-worker stream with
      ``exchange.worker_key``); ``step`` the int32 step counter.
      ``mean`` is the mean over workers of the decompressed payloads, identical
      on every worker; ``remainder`` is ``x`` minus this worker's own payload
      decompressed, i.e. what was not sent (error feedback keeps it).

  Examples:
    A codec that sends ``x`` clipped to [-1, 1], for one device (a codec for
    several workers would also all-reduce ``sent`` over the axis):

    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> def apply(x, state, key, step):
    ...   sent = jnp.clip(x, -1.0, 1.0)
    ...   return sent, x - sent, state
    >>> codec = gradcomp.LeafCodec(lambda leaf, key: (), apply)
    >>> x = jnp.array([0.5, -3.0, 2.0])
    >>> mean, remainder, state = codec.apply(x, codec.init(x, None), None, 0)
    >>> mean.tolist(), remainder.tolist(), state
    ([0.5, -1.0, 1.0], [0.0, -2.0, 1.0], ())
  """

  init: Callable[[Any, jax.Array], LeafState]
  apply: Callable[
    [jax.Array, LeafState, jax.Array, jax.Array],
    tuple[jax.Array, jax.Array, LeafState],
  ]


def stateless_init(leaf, key) -> tuple[()]:
  """``LeafCodec.init`` for codecs that keep nothing between steps."""
  del leaf, key
  return ()


class CompressorState(NamedTuple):
  """State of every gradcomp compressor.

  Per worker: under ``shard_map`` each worker carries its own copy (see
  ``workers.py``); ``leaves`` (residuals, PowerSGD's Q) differ between workers.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.topk(0.5)
    >>> g = {"w": jnp.array([1.0, -2.0])}
    >>> state = tx.init(g)
    >>> int(state.count), state.key.dtype.name, type(state.leaves["w"]).__name__
    (0, 'uint32', 'ErrorFeedbackState')
    >>> _, state = tx.update(g, state)  # k = 1: -2.0 is sent, 1.0 kept
    >>> int(state.count), state.leaves["w"].residual.tolist()
    (1, [1.0, 0.0])
  """

  count: jax.Array  # shape=(), int32: steps taken.
  key: jax.Array  # shape=(2,), uint32: PRNG stream shared by all workers.
  leaves: Any  # per-leaf codec states, a tree with the params' structure as prefix.


def leafwise(
  codec: LeafCodec, *, seed: int = 0, agree_key_over: str | None = None
) -> optax.GradientTransformation:
  """Applies ``codec`` to every leaf of the update tree.

  Leaves are compressed in float32 and the result is cast back to each leaf's
  dtype, so shapes, dtypes and the tree structure are preserved.

  Bad input, for every compressor built on this:

  - a leaf with 0 elements is passed through: its (empty) output is returned
    and its state is left as ``init`` made it; the codec never sees it;
  - an output too large for the leaf's dtype (a float16 or bfloat16 leaf whose
    float32 result exceeds its range) saturates at the dtype's largest finite
    value (``numerics.saturate``); NaN and +-Inf outputs stay as they are;
  - what a codec does with NaN / Inf gradients and with finite values near the
    float32 maximum is said in its factory's docstring. Codecs wrapped in
    error feedback (``memory.py``) drop a non-finite gradient and keep their
    memory finite; stateless codecs return a non-finite output for that step
    and are clean on the next.

  Args:
    codec: the per-leaf compression and exchange.
    seed: seeds the PRNG stream shared by all workers.
    agree_key_over: for codecs whose workers must draw the *same* random
      numbers (random-k's indices), the axis over which each step's key is
      agreed with an 8-byte all-reduce (``pmax``). Besides guarding against
      diverged states, this types the key, and what is derived from it, as
      replicated inside ``shard_map``.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` returns the mean over
    workers of the decompressed updates, and whose state is a
    :class:`CompressorState`.

  Examples:
    A one-device codec that sends ``x`` clipped to [-1, 1], applied to every
    leaf; a bfloat16 leaf is compressed in float32 and comes back bfloat16:

    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> def apply(x, state, key, step):
    ...   sent = jnp.clip(x, -1.0, 1.0)
    ...   return sent, x - sent, state
    >>> tx = gradcomp.leafwise(gradcomp.LeafCodec(lambda leaf, key: (), apply))
    >>> g = {"a": jnp.array([0.5, -3.0]), "b": jnp.array([2.0, 0.25], jnp.bfloat16)}
    >>> out, state = tx.update(g, tx.init(g))
    >>> out["a"].tolist(), out["b"].tolist(), out["b"].dtype.name, int(state.count)
    ([0.5, -1.0], [1.0, 0.25], 'bfloat16', 1)
  """

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.PRNGKey(seed)
    init_key, key = jax.random.split(key)
    states = [
      codec.init(leaf, jax.random.fold_in(init_key, i)) for i, leaf in enumerate(leaves)
    ]
    return CompressorState(
      count=jnp.zeros([], jnp.int32),
      key=key,
      leaves=jax.tree.unflatten(treedef, states),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    leaf_states = treedef.flatten_up_to(state.leaves)
    key, step_key = jax.random.split(state.key)
    if agree_key_over is not None:
      exchange._global_only(agree_key_over, "a key agreed (pmax)")
      step_key = jax.lax.pmax(step_key, agree_key_over)
    outputs, new_states = [], []
    for i, (g, s) in enumerate(zip(leaves, leaf_states, strict=True)):
      if g.size == 0:  # Nothing to compress or exchange.
        outputs.append(jnp.zeros(g.shape, g.dtype))  # replicated, like a mean
        new_states.append(s)
        continue
      mean, _, new_s = codec.apply(
        g.astype(jnp.float32), s, hashing.derive(step_key, i), state.count
      )
      outputs.append(numerics.saturate(mean, g.dtype))
      new_states.append(exchange.vary_like(new_s, s))
    new_state = CompressorState(
      count=optax.safe_increment(state.count),
      key=key,
      leaves=jax.tree.unflatten(treedef, new_states),
    )
    return jax.tree.unflatten(treedef, outputs), new_state

  return optax.GradientTransformation(init_fn, update_fn)
