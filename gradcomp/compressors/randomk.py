"""Random-k sparsification with indices shared by all workers.

Paper 000 Table 1 (Random-K 1%); Stich et al., *Sparsified SGD with memory*,
NeurIPS 2018. Because every worker draws the same indices from the shared PRNG
stream, the k values are linear in the gradient and are all-reduced: no indices
cross the wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gradcomp.compressors import checks, exchange, memory, sparse
from gradcomp.compressors.base import LeafCodec, leafwise, stateless_init
from gradcomp.compressors.spec import recorded
from gradcomp.kernels import hashing, ordering


def shared_indices(key: jax.Array, size: int, k: int) -> jax.Array:
  """k distinct indices of ``range(size)``, each kept with probability ~k/size.

  Stratified sampling: one uniform offset in each of k blocks of
  ``size // k`` coordinates, then the whole pattern rotated by a uniform shift.
  k hashed integers (``hashing.py``) instead of a permutation of ``size``
  (which ``jax.random.choice(replace=False)`` costs), and the indices are
  distinct by construction.
  """
  block = size // k
  offsets = hashing.hash_below(key, (k,), block)
  shift = hashing.hash_below(hashing.derive(key, 0), (1,), size)[0]
  starts = jnp.arange(k, dtype=jnp.int32) * block
  return (starts + offsets + shift) % size


@recorded
def randomk(
  ratio: float,
  *,
  seed: int = 0,
  axis_name: exchange.AxisName = None,
  error_feedback: bool = True,
) -> optax.GradientTransformation:
  """Random-k: all workers send the same k coordinates; values are all-reduced.

  .. math::
    S \\sim \\text{shared},\\ |S| = k,\\quad
    \\bar g_S = \\tfrac{1}{n}\\textstyle\\sum_w e_{w,S},\\quad r = e \\odot 1_{\\bar S}

  Bad input: with error feedback NaN or Inf gradient coordinates are dropped
  by the memory (``memory.py``), so state and output stay finite; without it a NaN
  or Inf at a chosen coordinate reaches that step's output (nothing is
  stored). Each worker divides its k values by ``n`` before the all-reduce,
  so finite values have a finite mean.

  Args:
    ratio: fraction of coordinates kept, in (0, 1].
    seed: seeds the index stream; must be the same on every worker.
    axis_name: the mapped axis of the workers, or ``None`` for one device.
    error_feedback: keep the unsent coordinates for later steps.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import gradcomp
    >>> tx = gradcomp.randomk(0.5)  # k = 3 of 6, one in each block of 2, shifted
    >>> update = jax.jit(tx.update)
    >>> g = {"w": jnp.arange(1.0, 7.0)}
    >>> out, state = update(g, tx.init(g))
    >>> out["w"].tolist()
    [1.0, 2.0, 0.0, 4.0, 0.0, 0.0]
    >>> (out["w"] + state.leaves["w"].residual).tolist()  # sent + kept = g
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    >>> update(g, state)[0]["w"].tolist()  # new indices; e = r + g there
    [0.0, 2.0, 6.0, 0.0, 10.0, 0.0]

  References:
    Paper 000 Table 1; Stich, Cordonnier & Jaggi 2018.
  """
  ratio = checks.fraction("ratio", ratio)
  codec = randomk_codec(ratio, axis_name, error_feedback)
  return leafwise(codec, seed=seed, agree_key_over=axis_name)


def randomk_codec(
  ratio: float, axis_name: exchange.AxisName, error_feedback: bool
) -> LeafCodec:
  """Random-k's codec of one leaf (with its in-place memory when asked)."""

  def indices_of(x, key):
    size = x.size
    return shared_indices(key, size, checks.keep_count(ratio, size))

  def apply(x, state, key, step):
    del step
    indices = indices_of(x, key)
    mean = sparse.all_reduce_mean_at(x, indices, axis_name)
    return mean, sparse.zero_at(x, indices), state

  def apply_with_memory(g, state, key, step):
    del step
    r = state.residual
    indices = indices_of(g, key)
    # memory.py's per-coordinate policy, in place: k values gathered from r
    # and g, then e = r + g written over r with the sent coordinates zeroed,
    # then the output scattered into zeros. The dependencies
    # (kernels/ordering.py) order each write after the last read of the
    # buffer it reuses, so XLA copies no full-size buffer: 2 full passes (e,
    # the output's zero fill); with the generic memory.error_feedback XLA
    # also copied e and the output and zero-filled fresh memory (BUILD_NOTES,
    # issue 18).
    local = memory.corrected(sparse.gather_at(r, indices), sparse.gather_at(g, indices))
    after = ordering.zero_after(local)  # e after the gathers
    residual = sparse.zero_at(memory.corrected(r + after, g), indices)
    # The all-reduce waits for the residual, so the output's zero fill (which
    # follows the mean) comes after the last read of g: it can take g's buffer.
    local = local + ordering.zero_after(residual)
    mean = exchange.all_reduce_mean(local, axis_name)
    out = sparse.scatter_into_zeros(mean, indices, g.shape)
    return out, residual, memory.ErrorFeedbackState(residual, ())

  codec = LeafCodec(stateless_init, apply)
  if error_feedback:
    codec = LeafCodec(memory.error_feedback(codec).init, apply_with_memory)
  return codec
