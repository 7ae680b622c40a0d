"""Top-k sparsification: send the k coordinates of largest magnitude.

Paper 000 Table 1 (Top-K 1%); paper 004 §4 (drop-ratio sparsification with
error feedback, Aji & Heafield 2017).
"""

from __future__ import annotations

import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels.selection import top_k_magnitude


@recorded
def topk(
  ratio: float,
  *,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
) -> optax.GradientTransformation:
  """Magnitude top-k with error feedback; payloads are all-gathered.

  Each worker keeps ``k = max(1, floor(ratio * d))`` coordinates of each leaf
  (exactly the k largest ``|e_i|``) and sends them as float32 values and int32
  indices; every worker scatter-adds all ``n * k`` pairs and divides by ``n``.

  .. math::
    e = r + g,\\quad S = \\operatorname{argtop}_k |e|,\\quad
    \\bar g = \\tfrac{1}{n}\\sum_w e_w \\odot 1_{S_w},\\quad r = e \\odot 1_{\\bar S}

  Bad input: with error feedback NaN or Inf gradient coordinates are dropped
  by the memory (``memory.py``), so state and output stay finite; without it NaN or
  Inf coordinates can be selected and reach that step's output (nothing is
  stored). Finite values are sent exactly and divided by ``n`` before the
  workers' values are added, so their mean is finite.

  Args:
    ratio: fraction of coordinates kept, in (0, 1].
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: keep what was not sent and add it to the next gradient.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.topk(0.5)  # k = 2 of 4
    >>> update = jax.jit(tx.update)
    >>> g = {"w": jnp.array([0.5, -3.0, 1.5, 2.0])}
    >>> out, state = update(g, tx.init(g))
    >>> out["w"].tolist(), state.leaves["w"].residual.tolist()
    ([0.0, -3.0, 0.0, 2.0], [0.5, 0.0, 1.5, 0.0])
    >>> update(g, state)[0]["w"].tolist()  # e = r + g: 1.5 + 1.5 now beats 2.0
    [0.0, -3.0, 3.0, 0.0]

    On the wire, 8 workers each sending k = 16 of 64 coordinates as a float32
    value and an int32 index:

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = gradcomp.topk(0.25, axis_name="data")
    >>> step = jax.shard_map(
    ...   lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("data"), out_specs=P()
    ... )
    >>> g = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    >>> gradcomp.wire_bytes(step, g)  # bytes each worker sends: 16 * (4 + 4)
    128

  References:
    Paper 000 Table 1; Aji & Heafield, *Sparse communication for distributed
    gradient descent*, 2017 (paper 004 §4).
  """
  ratio = checks.fraction("ratio", ratio)

  def apply(x, state, key, step):
    del key, step
    flat = x.reshape(-1)
    k = checks.keep_count(ratio, flat.shape[0])
    values, indices = top_k_magnitude(flat, k)
    mean = sparse.gather_mean(values, indices, x.shape, axis_name)
    return mean, sparse.zero_at(x, indices, after=values), state

  codec = LeafCodec(stateless_init, apply)
  return leafwise(memory.maybe_error_feedback(codec, error_feedback))
