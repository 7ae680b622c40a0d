r"""DeMo: decoupled momentum, exchanged as the top-k of its chunked DCT.

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", 2024,
arXiv 2411.19870v1 (§3, Algorithm 1), and its reference implementation
(bloc97/DeMo, ``demo.py``), whose choices settle what the paper leaves open
(listed in :func:`demo`). Each worker keeps its own momentum; only its fast
components, the largest coefficients of a chunked orthonormal DCT-II, cross
the wire, as (index, value) pairs; what was sent is subtracted from the
momentum, which is therefore also the error-feedback memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import axes, checks, exchange
from gradcomp.kernels import numerics
from gradcomp.kernels.tiles import chunk_size as chunk_size
from gradcomp.kernels.tiles import matrix_shape as matrix_shape
from gradcomp.kernels.tiles import tile_shape as tile_shape

_HIGHEST = jax.lax.Precision.HIGHEST


class DeMoState(NamedTuple):
  """State of :func:`demo`.

  Attributes:
    count: shape=(), int32: steps taken, the learning-rate schedule's argument;
      replicated (so are the updates, computed from the gathered payloads).
    delta: the decoupled momentum, one float32 array of each leaf's shape;
      per worker (varying under ``shard_map``): workers add their own gradients.
  """

  count: jax.Array
  delta: optax.Updates


@functools.cache
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix of size ``n``, float64: ``dct(x) = D @ x``.

  ``D[k, i] = s_k cos(pi (2 i + 1) k / (2 n))`` with ``s_0 = sqrt(1 / n)`` and
  ``s_k = sqrt(2 / n)``: ``scipy.fft.dct(x, norm="ortho")``. Orthonormal, so
  the inverse (DCT-III) is ``D.T``.
  """
  k = np.arange(n)[:, None]
  i = np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  d[0] /= np.sqrt(2.0)
  d.setflags(write=False)
  return d


def chunked_dct(x: jax.Array, chunk: int) -> jax.Array:
  """Orthonormal DCT-II of each tile of ``x``, shape ``(tiles, h * w)``, float32.

  Tiles are in row-major order over the leaf's matrix (:func:`matrix_shape`);
  within a tile, coefficient ``(b, d)`` (``b`` along rows, ``d`` along
  columns) is at ``b * w + d``. For a vector (``h = 1``) this is the 1-D DCT of
  each chunk of ``w`` entries. A matrix product with :func:`dct_matrix`
  (``Precision.HIGHEST``: no reduced-precision passes on accelerators).
  """
  rows, cols = matrix_shape(x.shape)
  h, w = tile_shape(x.shape, chunk)
  t = x.astype(jnp.float32).reshape(rows // h, h, cols // w, w)
  t = jnp.einsum(
    "yhxw,dw->yhxd", t, jnp.asarray(dct_matrix(w), jnp.float32), precision=_HIGHEST
  )
  if h > 1:
    t = jnp.einsum(
      "yhxd,bh->yxbd", t, jnp.asarray(dct_matrix(h), jnp.float32), precision=_HIGHEST
    )
  else:
    t = t.transpose(0, 2, 1, 3)
  return t.reshape(-1, h * w)


def chunked_idct(
  coefficients: jax.Array, shape: Sequence[int], chunk: int
) -> jax.Array:
  """Inverse of :func:`chunked_dct`: a float32 array of ``shape``."""
  rows, cols = matrix_shape(shape)
  h, w = tile_shape(shape, chunk)
  t = coefficients.reshape(rows // h, cols // w, h, w)
  t = jnp.einsum(
    "yxbd,dw->yxbw", t, jnp.asarray(dct_matrix(w), jnp.float32), precision=_HIGHEST
  )
  if h > 1:
    t = jnp.einsum(
      "yxbw,bh->yhxw", t, jnp.asarray(dct_matrix(h), jnp.float32), precision=_HIGHEST
    )
  else:
    t = t.transpose(0, 2, 1, 3)
  return t.reshape(shape)


def index_dtype(tile: int) -> jnp.dtype:
  """The narrowest integer type holding the positions ``0 .. tile - 1`` of a tile."""
  if tile <= 1 << 8:
    return jnp.dtype(jnp.uint8)
  if tile <= 1 << 16:
    return jnp.dtype(jnp.uint16)
  return jnp.dtype(jnp.int32)


def payload_bytes(shape: Sequence[int], chunk: int, topk: int) -> int:
  """Bytes one worker sends for a leaf of ``shape``: indices and float32 values.

  Examples:
    A 128 x 128 matrix is four 64 x 64 tiles; 32 coefficients of each, as a
    uint16 position in its tile and a float32 value:

    >>> from gradcomp.optimizers.demo import payload_bytes
    >>> payload_bytes((128, 128), 64, 32)
    768
  """
  if math.prod(shape) == 0:
    return 0
  h, w = tile_shape(shape, chunk)
  tiles = math.prod(shape) // (h * w) if shape else 1
  k = min(topk, h * w)
  return tiles * k * (index_dtype(h * w).itemsize + 4)


def _bound(tile: int) -> float:
  """Where the momentum saturates, so that no finite input overflows.

  A matrix product along a tile axis of ``n`` entries multiplies the largest
  magnitude by at most ``sqrt(2 n)`` (``n`` terms, ``|D[k, i]| <= sqrt(2 /
  n)``), so a tile's DCT, forth or back, by at most ``2 sqrt(tile)``, and a
  mean of sent values is at most the largest value sent. From the momentum to
  the decoded update the largest magnitude grows at most ``4 tile`` times:
  ``2**122`` at most, and the momentum left after the subtraction is below
  ``2**123``.
  """
  return float(2.0 ** (120 - math.ceil(math.log2(tile))))


def _decayed(mask, params):
  """Per leaf of ``params``, whether weight decay reaches it (``mask``: see :func:`demo`).

  ``params=None`` only checks a fixed ``mask``'s leaves.

  Raises:
    ValueError: a mask leaf that is not a bool, or a mask that is neither
      the params' structure nor a prefix of it.
  """
  if mask is None:
    return jax.tree.map(lambda _: True, params)
  for m in jax.tree.leaves(mask):
    if not isinstance(m, (bool, np.bool_)):
      raise ValueError(
        f"mask must be a tree of Python bools (or a callable returning one), "
        f"got a leaf {m!r}"
      )
  if params is None:
    return None
  try:
    return jax.tree.map(
      lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask, params
    )
  except ValueError as e:
    raise ValueError(
      f"mask must have the params' tree structure or a prefix of it: {e}"
    ) from e


def demo(
  learning_rate: optax.ScalarOrSchedule,
  *,
  beta: float = 0.999,
  chunk: int = 64,
  topk: int = 32,
  weight_decay: float = 0.0,
  mask=None,
  axis_name: exchange.AxisName = None,
) -> optax.GradientTransformation:
  r"""DeMo: sign steps along the gathered top-k DCT components of each worker's momentum.

  Each worker :math:`w` keeps its own momentum :math:`\delta_w` (float32). A
  step, per leaf, with :math:`\eta` the learning rate at this step's count:

  .. math::

    p &\leftarrow (1 - \eta\lambda)\, p \\
    \delta_w &\leftarrow \beta\,\delta_w + \eta\, g_w \\
    q_w &= \operatorname{top}_k\!\big(\operatorname{DCT}(\delta_w)\big)
      \quad\text{(per tile, by magnitude)} \\
    \delta_w &\leftarrow \delta_w - \operatorname{DCT}^{-1}(q_w) \\
    Q &= \operatorname{mean}_{w \ni i}\, q_{w,i}
      \quad\text{(over the workers that sent coefficient } i\text{; 0 if none)} \\
    p &\leftarrow p - \eta \operatorname{sign}\!\big(\operatorname{DCT}^{-1}(Q)\big)

  and the updates returned are the new params minus the old (weight decay
  included), in each param's dtype. These are the steps of the paper's
  Algorithm 1 (arXiv v1): accumulate the gradient in the momentum (with
  :math:`\eta`, see below), ``ExtractFastComponents`` (chunked DCT, top-k),
  remove them from the momentum, ``Synchronize`` them, and step (with the
  sign).

  **Chunks.** A leaf is a matrix (:func:`matrix_shape`): a vector is one row,
  a scalar a vector of one, and a leaf of more dimensions is
  ``(prod(shape[:-1]), shape[-1])``. Each axis is cut in chunks of the
  largest divisor of its size that is at most ``chunk`` (:func:`chunk_size`),
  so a vector is in 1-D chunks and a matrix in 2-D tiles, each transformed by
  an orthonormal DCT-II (separable on tiles). ``topk`` coefficients of each
  tile are kept (all of a tile smaller than ``topk``).

  **Wire.** Each worker all-gathers, per leaf, ``topk`` positions per tile in
  the narrowest integer type holding the tile's size (uint8 up to 256, uint16
  up to 65536) and as many float32 values (:func:`payload_bytes`); nothing
  else. With the defaults a 64 x 64 tile sends 32 of 4096 coefficients, 192
  bytes for 16 KiB of float32 (85x less), and a 64-chunk of a vector 32 of
  64 (160 bytes for 256).

  **Readings the paper leaves open**, settled as the reference does unless
  said:

  * *Learning rate in the momentum.* Algorithm 1 adds the raw gradient; the
    reference adds ``lr * grad`` (``delta.add_(grad, alpha=lr)``), as here.
    With a constant rate the two differ by a scale that neither top-k nor the
    sign sees; with a schedule, earlier gradients keep the rate they came
    with.
  * *The step.* Algorithm 1 steps by :math:`Q`; the paper's experiments and
    the reference take its sign (signum), as here.
  * *Synchronize.* A mean over the workers that sent each coefficient, not
    over all workers (the reference's ``scatter_reduce("mean",
    include_self=False)``): a coefficient sent by one worker of eight counts
    fully. A worker's own positions within a tile are distinct (top-k), so
    the count is the number of senders.
  * *Chunk shapes.* Square tiles of side ``chunk`` for matrices, ``chunk``
    entries for vectors, ``topk`` per tile (so a 2-D tile keeps a 128th of
    its coefficients with the defaults, a vector chunk a half); an axis
    ``chunk`` does not divide uses its largest smaller divisor. Leaves of more
    than two dimensions and scalars, which the reference does not handle, are
    flattened to a matrix and a vector as above (a choice of ours).
  * *Weight decay.* Decoupled, applied before the step,
    :math:`p \leftarrow p(1 - \eta\lambda)`, as the reference, on every
    leaf; ``mask`` (``optax.adamw``'s convention) limits it to some, e.g.
    AdamW's usual matrices-and-embeddings rule, so a comparison with AdamW
    decays the same leaves (a choice of ours: the paper's configs use no
    decay).
  * *Precision.* The momentum and the transforms are float32 whatever the
    params' dtype (the reference keeps them in the params' dtype); the
    updates are cast to each param's dtype.
  * *Finite inputs.* Not a topic of the paper: the momentum saturates at
    ``2**120 / tile`` (``2**108``, 3e32, for 64 x 64 tiles), so no finite
    input overflows a transform and the state stays finite.
    Non-finite gradients make the momentum non-finite; wrap the optimizer in
    :func:`gradcomp.apply_if_finite` to skip such steps.

  Args:
    learning_rate: a float > 0 or an ``optax`` schedule of the step count.
    beta: momentum decay, in [0, 1).
    chunk: the side of a tile (the length of a vector's chunk), >= 1.
    topk: coefficients sent per tile, >= 1 (clamped to the tile's size).
    weight_decay: decoupled weight decay :math:`\lambda`, >= 0.
    mask: which leaves weight decay reaches, as ``optax.adamw``'s ``mask``:
      a tree of Python bools with the params' structure (or a prefix of
      it), or a callable returning one from the params; ``True`` decays the
      leaf. ``None`` (the default): every leaf.
    axis_name: the mapped axis of the workers (``shard_map`` or ``pmap``), or
      ``None`` for one worker.

  Returns:
    An ``optax.GradientTransformation`` with :class:`DeMoState`, used alone
    (not chained after another optimizer); its ``update`` requires
    ``params``.

  Raises:
    ValueError: a hyper-parameter out of its range, naming it.

  Examples:
    One worker, one chunk of 4: the constant (first) coefficient of the
    momentum ``0.1 * g`` is the largest, so its mean, 0.25, is sent and taken
    from the momentum; every param steps by ``-lr`` along its sign.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from gradcomp.optimizers.demo import demo
    >>> tx = demo(0.1, chunk=4, topk=1)
    >>> params = {"w": jnp.zeros(4)}
    >>> grads = {"w": jnp.array([1.0, 2.0, 3.0, 4.0])}
    >>> updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    >>> rounded = lambda x: np.asarray(x, float).round(6).tolist()
    >>> rounded(updates["w"]), rounded(state.delta["w"])
    ([-0.1, -0.1, -0.1, -0.1], [-0.15, -0.05, 0.05, 0.15])

    On the wire, each of 8 workers sends 32 coefficients of each of the four
    64 x 64 tiles of a 128 x 128 matrix, a uint16 and a float32 each (dense
    float32 would be 65536 bytes):

    >>> import gradcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = demo(0.1, axis_name="data")
    >>> step = jax.shard_map(
    ...   lambda g, p: tx.update(g, tx.init(p), p)[0],
    ...   mesh=mesh, in_specs=(P("data"), P()), out_specs=P(),
    ... )
    >>> g = jax.ShapeDtypeStruct((8 * 128, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    >>> p = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
    >>> gradcomp.wire_bytes(step, g, p)  # 4 tiles * 32 * (2 + 4)
    768

  References:
    Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization",
    arXiv 2411.19870v1 (2024), §3, Algorithm 1; reference implementation
    https://github.com/bloc97/DeMo (``demo.py``).
  """
  if not callable(learning_rate):
    checks.positive("learning_rate", learning_rate)
  beta = checks.in_range("beta", beta, 0.0, 1.0)
  chunk = checks.at_least("chunk", chunk, 1)
  topk = checks.at_least("topk", topk, 1)
  if not (
    isinstance(weight_decay, (int, float))
    and not isinstance(weight_decay, bool)
    and math.isfinite(weight_decay)
    and weight_decay >= 0
  ):
    raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
  weight_decay = float(weight_decay)
  if mask is not None and not callable(mask):
    _decayed(mask, None)  # A fixed tree is checked now, a callable's at update.

  def init_fn(params):
    delta = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    return DeMoState(count=jnp.zeros([], jnp.int32), delta=delta)

  def gathered_mean(positions, values, tile):
    """Per coefficient, the mean of the values sent by the workers that sent it."""
    n = exchange.num_workers(axis_name)
    all_positions, all_values = exchange.all_gather((positions, values), axis_name)
    tiles = values.shape[0]
    flat = jnp.arange(tiles)[:, None] * tile + all_positions.astype(jnp.int32)
    flat = flat.reshape(-1)
    zeros = jnp.zeros(tiles * tile, jnp.float32)
    # Values are divided by n before the sum and the sum by the count after,
    # then multiplied back by n: each partial result is at most the largest
    # value, so a finite mean never overflows on the way.
    sums = zeros.at[flat].add(all_values.reshape(-1) / n)
    counts = zeros.at[flat].add(1.0)
    mean = sums / jnp.maximum(counts, 1.0) * n
    return mean.reshape(tiles, tile)

  def leaf(g, delta, p, lr, decayed):
    shape = jnp.shape(p)
    decay = 0.0
    if weight_decay and decayed:
      decay = -(lr * weight_decay) * p.astype(jnp.float32)
    if math.prod(shape) == 0:
      return jnp.zeros(shape, p.dtype), delta
    h, w = tile_shape(shape, chunk)
    bound = _bound(h * w)
    delta = jnp.clip(beta * delta + lr * g.astype(jnp.float32), -bound, bound)
    coefficients = chunked_dct(delta, chunk)
    tiles = coefficients.shape[0]
    k = min(topk, h * w)
    _, positions = jax.lax.top_k(jnp.abs(coefficients), k)
    values = jnp.take_along_axis(coefficients, positions, axis=-1)
    rows = jnp.arange(tiles)[:, None]
    sent = jnp.zeros_like(coefficients).at[rows, positions].set(values)
    delta = delta - chunked_idct(sent, shape, chunk)
    mean = gathered_mean(positions.astype(index_dtype(h * w)), values, h * w)
    decoded = chunked_idct(mean, shape, chunk)
    update = decay - lr * jnp.sign(decoded)
    return numerics.saturate(update, p.dtype), delta

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("demo's update needs params (for the weight decay and the step)")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    lr = jnp.asarray(lr, jnp.float32)
    decayed = _decayed(mask(params) if callable(mask) else mask, params)
    pairs = jax.tree.map(
      lambda g, d, p, m: leaf(g, d, p, lr, m), updates, state.delta, params, decayed
    )
    outer = jax.tree.structure(updates)
    new_updates, delta = jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
    return new_updates, DeMoState(optax.safe_increment(state.count), delta)

  # Its axes filed so hierarchical() can take it as its inner;
  # params that are shards of a partition across axis_name are refused.
  return axes.checked(
    optax.GradientTransformation(init_fn, update_fn), axis_name, strict=False
  )
