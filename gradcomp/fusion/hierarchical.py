r"""Hierarchical compression: reduce-scatter on the fast axis, compress on the slow one.

A cluster's fast links (NVLink inside a node, ICI inside a TPU
slice) and slow ones (InfiniBand / Ethernet between nodes, DCN between
slices) are two mesh axes. Compression pays on the slow axis and mostly costs
on the fast one, so :func:`hierarchical` splits the exchange of every leaf in
three, as Horovod's hierarchical all-reduce does (Sergeev & Del Balso 2018,
``HOROVOD_HIERARCHICAL_ALLREDUCE``; BytePS, Jiang et al. OSDI 2020 §4, which
casts to fp16 inside a machine and runs the real compressor between them):

1. **reduce-scatter over the fast axis**: each leaf is flattened, zero-padded
   to a multiple of ``g`` (the fast axis' size) and ``psum_scatter``-ed, so
   the device at fast index ``j`` holds the mean over its node of chunk ``j``
   (dense float32, or ``scatter_dtype``);
2. **the inner compressor over the slow axis** compresses and exchanges that
   contiguous ``1/g`` shard; its state (error-feedback residuals) is the
   shard's, ``1/g`` of the memory, and its size-dependent settings (top-k's
   ``k``) follow the shard's size;
3. **all-gather over the fast axis** (``gather=True``) reassembles the leaf,
   or each device keeps its shard (``gather=False``: ZeRO's partitioned
   gradients, Rajbhandari et al. 2020 §5, where each device's optimizer
   updates only its shard of the params).

Shaped like ``layerfusion`` (a wrapper owning its inner's state), and
composable with it in either order. :func:`hierarchical_spec_of` reads back
how a transformation was built (its inner, fast axis, scatter type and
gather), for the planner's profile (``profiling.profile_for``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomp.compressors import axes
from gradcomp.compressors.spec import recorded, spec_of
from gradcomp.kernels import numerics

SCATTER_DTYPES = (None, jnp.float32, jnp.float16, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class HierarchicalSpec:
  """How a :func:`hierarchical` transformation was built.

  Attributes:
    inner: the compressor run across the slow axes on each shard.
    fast_axis: the mesh axis of the fast links.
    scatter_dtype: the reduce-scatter's payload type, ``None`` for float32,
      else ``jnp.dtype(float16)`` or ``jnp.dtype(bfloat16)``.
    gather: whether the result is all-gathered over ``fast_axis``.
  """

  inner: optax.GradientTransformation
  fast_axis: str
  scatter_dtype: jnp.dtype | None
  gather: bool


def _scatter_dtype(scatter_dtype) -> jnp.dtype | None:
  """``scatter_dtype`` checked and normalised: ``None`` for float32."""
  if scatter_dtype is None:
    return None
  scatter_dtype = jnp.dtype(scatter_dtype)
  if scatter_dtype not in {jnp.dtype(t) for t in SCATTER_DTYPES[1:]}:
    raise ValueError(
      f"scatter_dtype must be None, float32, float16 or bfloat16, got {scatter_dtype}"
    )
  return None if scatter_dtype == jnp.dtype(jnp.float32) else scatter_dtype


def hierarchical_spec_of(tx: optax.GradientTransformation) -> HierarchicalSpec | None:
  """The :class:`HierarchicalSpec` of a :func:`hierarchical` result, else ``None``.

  Read from the arguments :func:`~gradcomp.compressors.spec.recorded` filed
  when it was built (weakly, under its ``update``), so the wrapper itself is
  unchanged.

  Examples:
    >>> import gradcomp, jax.numpy as jnp
    >>> inner = gradcomp.topk(0.01, axis_name="node")
    >>> tx = gradcomp.hierarchical(inner, "local", scatter_dtype=jnp.bfloat16)
    >>> spec = hierarchical_spec_of(tx)
    >>> spec.inner is inner, spec.fast_axis, spec.scatter_dtype.name, spec.gather
    (True, 'local', 'bfloat16', True)
    >>> hierarchical_spec_of(inner) is None
    True
  """
  spec = spec_of(tx)
  if spec is None or spec.factory is not hierarchical:
    return None
  args = dict(spec.arguments)
  return HierarchicalSpec(
    inner=args["inner"],
    fast_axis=args["fast_axis"],
    scatter_dtype=_scatter_dtype(args["scatter_dtype"]),
    gather=args["gather"],
  )


class HierarchicalState(NamedTuple):
  """State of :func:`hierarchical`.

  Examples:
    On a ``(2, 4)`` mesh ``("node", "local")``, top-k's residual of a
    10-value leaf is this device's shard: ``ceil(10 / 4) = 3`` values.

    >>> import jax, jax.numpy as jnp, gradcomp
    >>> tx = gradcomp.hierarchical(gradcomp.topk(0.5, axis_name="node"), "local")
    >>> with jax.set_mesh(jax.make_mesh((2, 4), ("node", "local"))):
    ...   state = tx.init({"w": jnp.zeros(10)})
    >>> type(state).__name__, state.inner.leaves["w"].residual.shape
    ('HierarchicalState', (3,))
  """

  inner: (
    optax.OptState
  )  # inner's state over the shards: per leaf (ceil(d / g),) float32.


def shard_size(size: int, g: int) -> int:
  """Values in each device's shard of a ``size``-value leaf: ``ceil(size / g)``."""
  return -(-int(size) // int(g))


def _padded(x, g: int) -> jax.Array:
  """``x`` raveled and zero-padded to ``g * ceil(size / g)`` values."""
  flat = jnp.ravel(x)
  return jnp.pad(flat, (0, g * shard_size(flat.shape[0], g) - flat.shape[0]))


def shard(tree, fast_axis: str):
  """This device's shard of every leaf: chunk ``j`` of the raveled, padded leaf.

  The layout :func:`hierarchical` uses with ``gather=False``: the device at
  index ``j`` of ``fast_axis`` gets ``ravel(x)[j c : (j + 1) c]`` of each leaf
  ``x``, zero-padded to ``c = ceil(x.size / g)`` values, in ``x``'s dtype.
  Call it inside ``shard_map`` (e.g. on the params, to give a ZeRO optimizer
  its shards); ``jax.ShapeDtypeStruct`` leaves give ``jax.ShapeDtypeStruct``
  shards, also outside ``shard_map`` under ``jax.set_mesh`` (for ``init``).

  Args:
    tree: arrays (or ``jax.ShapeDtypeStruct``) of any shapes.
    fast_axis: the mesh axis the leaves are split over.

  Returns:
    The tree with each leaf replaced by its ``(c,)`` shard.
  """
  g = axes.axis_size(fast_axis, tree)

  def one(x):
    c = shard_size(np.prod(x.shape, dtype=int), g)
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((c,), x.dtype)
    start = jax.lax.axis_index(fast_axis) * c
    return jax.lax.dynamic_slice(_padded(x, g), (start,), (c,))

  return jax.tree.map(one, tree)


def unshard(shards, like, fast_axis: str | tuple[str, ...] | None = None):
  """Reassembles the leaves of ``like`` from their shards (:func:`shard`'s inverse).

  Inside ``shard_map``, with ``fast_axis``: each device's shards are
  all-gathered over ``fast_axis`` (tiled), unpadded and reshaped. Outside,
  with ``fast_axis=None``: ``shards`` are the global arrays a ``shard_map``
  returns with ``out_specs=P(fast_axis)`` (each leaf the ``g`` shards
  concatenated, ``g * c`` values), unpadded and reshaped.

  Args:
    shards: the tree of shards (``hierarchical(..., gather=False)``'s output).
    like: a tree with the full leaves' shapes and dtypes (arrays or
      ``jax.ShapeDtypeStruct``).
    fast_axis: the mesh axis to gather over inside ``shard_map`` (or axes:
      ``("node", "local")`` for ``qgz(..., gather=False)``'s chunks, owned
      in that device order), or ``None`` for concatenated shards.

  Returns:
    A tree shaped like ``like``, each leaf cast to its dtype (saturating).

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradcomp.fusion import unshard
    >>> gathered = {"w": jnp.array([1.0, 2, 3, 4, 5, 6, 0, 0])}  # g = 4, c = 2
    >>> unshard(gathered, {"w": jnp.zeros((2, 3))})["w"].tolist()
    [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
  """
  leaves, treedef = jax.tree.flatten(like)

  def one(s, x):
    if fast_axis is not None:
      s = jax.lax.all_gather(s, fast_axis, tiled=True, to="invarying")
    elif isinstance(s, jax.Array):
      # A global array split over the mesh (explicit sharding) cannot be
      # sliced across its shards' boundaries: replicate it first.
      sharding = jax.typeof(s).sharding
      if isinstance(sharding, NamedSharding) and any(sharding.spec):
        s = jax.sharding.reshard(s, NamedSharding(sharding.mesh, P()))
    size = int(np.prod(x.shape, dtype=int))
    return numerics.saturate(jnp.reshape(s[:size], x.shape), x.dtype)

  out = [one(s, x) for s, x in zip(treedef.flatten_up_to(shards), leaves, strict=True)]
  return jax.tree.unflatten(treedef, out)


def _reduce_scatter(x, fast_axis: str, g: int, scatter_dtype) -> jax.Array:
  """This device's chunk of the mean over ``fast_axis`` of ``x``, float32 ``(c,)``.

  Each device sends ``x / g`` (scale before the sum: ``g`` finite payloads
  have a finite sum); in ``scatter_dtype`` the payload is clipped to that
  type's maximum over ``g`` first, so the 16-bit sum stays finite as well.
  """
  payload = _padded(x.astype(jnp.float32) / g, g)
  if scatter_dtype is not None:
    payload = numerics.saturate(
      payload, scatter_dtype, numerics.safe_bound(scatter_dtype, g)
    )
  summed = jax.lax.psum_scatter(payload, fast_axis, scatter_dimension=0, tiled=True)
  return summed.astype(jnp.float32)


@recorded
def hierarchical(
  inner: optax.GradientTransformation,
  fast_axis: str,
  *,
  scatter_dtype=None,
  gather: bool = True,
) -> optax.GradientTransformation:
  """Reduce-scatter over ``fast_axis``, ``inner`` on each shard, all-gather.

  For each leaf (or fused buffer) ``x`` of ``d`` values on a mesh whose fast
  axis has ``g`` devices, the device at fast index ``j`` computes

  .. math::
    s_j = \\sum_{l=1}^{g} \\frac{1}{g}\\, \\operatorname{pad}(x_l)[j c : (j+1) c],
    \\quad c = \\lceil d / g \\rceil,\\qquad
    u = \\operatorname{concat}_j\\, \\operatorname{inner}(s_j)[:d]

  (``psum_scatter`` tiled, then ``inner`` built with ``axis_name`` = the slow
  axes, then ``all_gather`` tiled). With ``inner`` the mean over its axes,
  ``u`` is the mean over every worker of both axes, the same on every
  device: ``hierarchical(none(axis_name="node"), "local")`` is
  ``none(axis_name=("node", "local"))`` up to the order of the float32 sums.

  ``inner`` sees a tree shaped like the update tree with every leaf replaced
  by its float32 shard ``s_j`` of shape ``(c,)``, so each shard is one unit
  of compression: top-k keeps ``k = max(1, floor(ratio c))`` of each shard
  (per-shard top-k: the top ``k`` of chunk ``j`` of the node-mean, not of
  the whole leaf), and error-feedback residuals are ``c``-value shards, ``1/g``
  of the flat compressor's memory. Wrapped in ``layerfusion`` (either order:
  ``layerfusion(hierarchical(...))`` scatters each fused buffer,
  ``hierarchical(layerfusion(...))`` fuses each device's shards) the unit of
  compression is the shard of a fused buffer, or the fused shards.

  **gather=False** (ZeRO's partitioned gradients, Rajbhandari et al. 2020
  §5.2; FSDP): the all-gather is skipped and each leaf of the output is this
  device's shard, shape ``(c,)`` in the leaf's dtype: chunk ``j`` of the
  raveled, zero-padded mean (the last ``g c - d`` values of the last chunks
  are 0). Under ``shard_map`` with ``out_specs=P(fast_axis)`` the global
  result is the ``g`` chunks concatenated; :func:`unshard` reassembles the
  leaves (inside ``shard_map`` with ``fast_axis``, or from that global
  array) and :func:`shard` cuts params the same way for the optimizer that
  updates only its shard. ``init`` still takes the full-shaped tree.

  **params.** ``update``'s params are shaped like its output: the full
  leaves with ``gather=True`` (checked against both the slow and the fast
  axes, ``axes.check_params``: they must be replicated over both), this
  device's shards with ``gather=False`` (checked against the slow axes; they
  differ across ``fast_axis`` by design). ``inner`` receives their shards.

  **init** accepts arrays or ``jax.ShapeDtypeStruct``, inside ``shard_map``
  or outside it where the size of ``fast_axis`` can be read from a mesh
  (``jax.set_mesh``, or the params' ``NamedSharding``). The state is per
  device (each device's residual is its own chunk's), carried like every
  compressor's per-worker state.

  Bad input: a leaf with 0 values is passed through (zeros) with no
  collective. NaN / Inf reach the shards of every device of the node that
  holds them, where ``inner``'s policy applies (error feedback drops them);
  finite values give finite shards (each device divides by ``g`` before the
  sum; with ``scatter_dtype`` each payload is clipped to that type's maximum
  over ``g``). An output too large for a 16-bit leaf saturates.

  Args:
    inner: a gradcomp compressor (or ``layerfusion`` / ``hierarchical`` of
      one) built with ``axis_name`` the slow axis or axes, not including
      ``fast_axis``.
    fast_axis: the mesh axis of the fast links (inside a node).
    scatter_dtype: ``None`` (float32), ``jnp.float16`` or ``jnp.bfloat16``:
      the type of the reduce-scatter's payload, BytePS's fp16 inside a node.
      XLA:CPU computes a 16-bit reduce-scatter in float32, so the saving
      shows on GPU and in the cost model, not in CPU HLO bytes.
    gather: all-gather the result over ``fast_axis`` (``True``), or return
      each device's shard (``False``).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`HierarchicalState`.

  Raises:
    ValueError: ``inner`` averages over no mesh axis (built without
      ``axis_name``, or not by gradcomp), its axes include ``fast_axis``, a
      bad ``fast_axis``, ``scatter_dtype`` or ``gather``; at ``init`` /
      ``update``, params that differ across an axis they must be replicated
      on, ``gather=False`` params not shaped like the shards, or an unknown
      size of ``fast_axis`` at ``init``.

  Examples:
    On a ``(2, 4)`` mesh: each node reduce-scatters over ``"local"``, top-k
    runs on each 2-value shard across ``"node"``, and ``"local"`` gathers.
    Each of the 8 devices holds ``w = [1, ..., 8] * (device + 1)``; the node
    means are ``[1, ..., 8] * 2.5`` and ``* 6.5``; top-k with ``k = 1`` of 2
    keeps the odd positions (the larger of each pair), and their mean is
    ``[1, ..., 8] * 4.5`` there.

    >>> import jax, jax.numpy as jnp, gradcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
    >>> tx = gradcomp.hierarchical(gradcomp.topk(0.5, axis_name="node"), "local")
    >>> def step(g):
    ...   return tx.update({"w": g[0]}, tx.init({"w": g[0]}))[0]["w"]
    >>> g = jnp.arange(1.0, 9.0)[None, :] * jnp.arange(1.0, 9.0)[:, None]
    >>> g = jax.device_put(g, NamedSharding(mesh, P(("node", "local"))))
    >>> out = jax.jit(jax.shard_map(step, mesh=mesh,
    ...   in_specs=P(("node", "local")), out_specs=P()))(g)
    >>> out.tolist()
    [0.0, 9.0, 0.0, 18.0, 0.0, 27.0, 0.0, 36.0]

  References:
    Horovod's hierarchical all-reduce (Sergeev & Del Balso, *Horovod*, 2018;
    ``HOROVOD_HIERARCHICAL_ALLREDUCE``); Jiang et al., *A Unified
    Architecture for Accelerating Distributed DNN Training in Heterogeneous
    GPU/CPU Clusters* (BytePS), OSDI 2020 §4 (two-level compression);
    Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models*, SC 2020 (partitioned gradients);
  """
  if not isinstance(fast_axis, str) or not fast_axis:
    raise ValueError(f"fast_axis must be a mesh axis name (a str), got {fast_axis!r}")
  if not isinstance(gather, bool):
    raise ValueError(f"gather must be True or False, got {gather!r}")
  scatter_dtype = _scatter_dtype(scatter_dtype)
  slow = axes.group_of(inner)
  if not slow:
    raise ValueError(
      "inner must be a gradcomp compressor (or layerfusion / hierarchical of "
      "one) built with axis_name= the slow mesh axis, e.g. "
      "topk(0.01, axis_name='node'); this one averages over no mesh axis"
    )
  if fast_axis in slow:
    raise ValueError(
      f"inner's axis_name {slow!r} includes fast_axis {fast_axis!r}: inner "
      f"compresses across the slow axes only, after the reduce-scatter over "
      f"{fast_axis!r}; build it with axis_name= the other axes"
    )
  group = (*slow, fast_axis)

  def init_fn(params):
    g = axes.axis_size(fast_axis, params)
    shards = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        (shard_size(np.prod(x.shape, dtype=int), g),), jnp.float32
      ),
      params,
    )
    return HierarchicalState(inner=inner.init(shards))

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree.flatten(updates)
    g = int(jax.lax.axis_size(fast_axis))
    shards = []
    for x in leaves:
      c = shard_size(x.size, g)
      if c == 0:  # nothing to scatter or exchange
        shards.append(jnp.zeros((0,), jnp.float32))
      else:
        shards.append(_reduce_scatter(x, fast_axis, g, scatter_dtype))
    inner_params = None
    if params is not None:
      p_leaves = treedef.flatten_up_to(params)
      if gather:
        inner_params = treedef.flatten_up_to(
          shard(treedef.unflatten(p_leaves), fast_axis)
        )
      else:
        for i, (p, s) in enumerate(zip(p_leaves, shards, strict=True)):
          if tuple(p.shape) != tuple(s.shape):
            raise ValueError(
              f"with gather=False the params are this device's shards, shaped "
              f"like the output: leaf {i} has shape {tuple(p.shape)}, its shard "
              f"{tuple(s.shape)} (gradcomp.fusion.shard cuts them)"
            )
        inner_params = p_leaves
      inner_params = treedef.unflatten(inner_params)
    out, inner_state = inner.update(
      treedef.unflatten(shards), state.inner, inner_params
    )
    out_leaves = treedef.flatten_up_to(out)
    if gather:
      result = []
      for o, x in zip(out_leaves, leaves, strict=True):
        if x.size == 0:
          result.append(jnp.zeros(x.shape, x.dtype))
        else:
          result.append(unshard(o, x, fast_axis))
    else:
      result = [
        numerics.saturate(o, x.dtype) for o, x in zip(out_leaves, leaves, strict=True)
      ]
    return treedef.unflatten(result), HierarchicalState(inner=inner_state)

  tx = optax.GradientTransformation(init_fn, update_fn)
  if gather:
    return axes.checked(tx, group)

  def checked_init(params):
    axes.check_params(params, group, strict=False)
    return tx.init(params)

  def checked_update(updates, state, params=None):
    axes.check_params(params, slow)  # shards: they differ across fast_axis
    return tx.update(updates, state, params)

  return axes.record(optax.GradientTransformation(checked_init, checked_update), group)
