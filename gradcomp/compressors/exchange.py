"""How payloads meet across workers.

Collectives are opt-in: with ``axis_name=None`` every exchange is the identity
and a compressor runs on one device. Gathers are requested *invariant*
(``to="invarying"``): every worker receives the same stacked payloads, so the
decoded mean is typed as replicated and can leave ``shard_map`` with
``out_specs=P()``.

**Pluggable exchange.** ``axis_name`` may also be a :class:`Pattern`, which
decides how gathered payloads meet; the same codec encodes once either way:

* :class:`Neighbours`: the payload meets only the worker's in-neighbours of
  a gossip topology, through one ``ppermute`` per edge, and a "mean" becomes
  the topology's weighted mix ``sum_j W[i, j] decode(p_j)`` (survey 004 §2.3;
  CHOCO-SGD, Koloskova et al. 2019);
* :class:`Pushes`: every worker's payload is all-gathered and decoded on its
  own, not summed, as a parameter server applying pushes one at a time
  needs (survey 004 §2.1, §2.3).

Exchanges that need a global reduction (all-reduce, an agreed key) raise a
``ValueError`` under a pattern.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gradcomp.kernels import hashing
from gradcomp.parallel import branches, mixing


class Pattern:
  """How gathered payloads meet, in place of the all-gather and sum.

  Subclasses define :meth:`exchange` and a ``what`` phrase for errors; the
  mesh axis of the workers is ``axis``.
  """

  axis: str
  what: str = "this exchange pattern"

  def exchange(self, payload, decode: Callable[..., jax.Array]) -> jax.Array:
    raise NotImplementedError


class Neighbours(Pattern):
  """The in-neighbours of a gossip topology at one step, as an exchange pattern.

  Passed as a compressor's ``axis_name`` (``spec.build(axis_name=Neighbours(
  ...))``): its gathered means become ``sum_j W_t[i, j] decode(p_j)``, with
  the payload on ``collective-permute`` in the codec's wire format, and
  ``num_workers`` is 1 (the mixing weights already sum to 1). Each exchange
  also records, in call order, the worker's own decoded payload (``own``)
  and the mix (``mixed``): CHOCO-SGD needs both, and a codec's output may
  post-process the mix (signSGD's majority vote). Built afresh inside each
  traced update, so the records never outlive one trace.

  Args:
    topology: a :class:`gradcomp.topology.Topology`.
    step: the step count (traced int32) choosing the topology's phase.
    axis: the mesh axis of the workers.
  """

  what = "a gossip exchange with neighbours"

  def __init__(self, topology, step, axis: str):
    self.topology, self.step, self.axis = topology, step, axis
    self.own: list[jax.Array] = []
    self.mixed: list[jax.Array] = []

  def __repr__(self) -> str:
    return (
      f"Neighbours({getattr(self.topology, 'name', self.topology)!r}, {self.axis!r})"
    )

  def exchange(self, payload, decode: Callable[..., jax.Array]) -> jax.Array:
    own = decode(*payload)
    mixed = mixing.mix_decoded(
      self.topology, tuple(payload), lambda p: decode(*p), self.step, self.axis
    )
    self.own.append(own)
    self.mixed.append(mixed)
    return mixed


class Pushes(Pattern):
  """Every worker's payload, gathered and decoded one by one: a server's pushes.

  Passed as a compressor's ``axis_name``: each exchange all-gathers the
  payloads in the codec's wire format (``to="invarying"``: every worker
  holds all of them, as each replica of a simulated server must), decodes
  each worker's payload separately and records the stack, shape
  ``(workers, ...)``, in ``decoded`` (in call order). It returns the worker's
  own decoded payload, and ``num_workers`` is 1, so the codec's output is
  its own decoded gradient. Built afresh inside each traced update.

  Args:
    axis: the mesh axis of the workers.
  """

  what = "a parameter server's pushes"

  def __init__(self, axis: str):
    self.axis = axis
    self.decoded: list[jax.Array] = []

  def __repr__(self) -> str:
    return f"Pushes({self.axis!r})"

  def exchange(self, payload, decode: Callable[..., jax.Array]) -> jax.Array:
    gathered = jax.tree.map(
      lambda a: jax.lax.all_gather(a, self.axis, to="invarying"), tuple(payload)
    )
    n = jax.tree.leaves(gathered)[0].shape[0]
    self.decoded.append(
      jnp.stack(
        [decode(*jax.tree.map(lambda a, w=w: a[w], gathered)) for w in range(n)]
      )
    )
    return decode(*payload)


#: Registered compressors whose payloads are gathered, never reduced: the ones
#: an exchange with neighbours or a server's pushes (a :class:`Pattern`) can send.
GATHERED = (
  "topk",
  "dgc",
  "qsgd",
  "terngrad",
  "threshold_quantize",
  "ef_signsgd",
  "onebit_sgd",
  "fixed_point",
  "dynamic_fixed_point",
  "sparse_quantize",
  "fp8",
  "fp4",
)


def _global_only(axis_name, what: str) -> None:
  if isinstance(axis_name, Pattern):
    raise ValueError(
      f"this compressor needs {what} over all workers, which {axis_name.what} "
      f"cannot provide; use a codec whose payloads are gathered "
      f"({', '.join(GATHERED)})"
    )


AxisName = str | tuple[str, ...] | Pattern | None


def num_workers(axis_name: AxisName) -> int:
  """Static number of workers along ``axis_name`` (1 when it is ``None``).

  1 for a :class:`Pattern` too: :class:`Neighbours`' mixing weights are
  already normalised, and :class:`Pushes` returns one worker's payload.
  """
  if axis_name is None or isinstance(axis_name, Pattern):
    return 1
  return jax.lax.axis_size(axis_name)


def worker_key(key: jax.Array, axis_name: AxisName) -> jax.Array:
  """A PRNG key independent between workers, derived from a shared one."""
  if axis_name is None:
    return key
  if isinstance(axis_name, Pattern):
    axis_name = axis_name.axis
  return hashing.derive(key, jax.lax.axis_index(axis_name))


def _on_one_device(payload):
  """The identity exchange; the payload still materialises, as on a wire.

  Left to itself XLA fuses ``decode(encode(x))`` into one loop that recomputes
  each packed byte for every coordinate it holds (4x the hashing for
  TernGrad's 2-bit codes); ``optimization_barrier`` does not stop that on CPU.
  A conditional does: its predicate is always true, but XLA cannot fold it.
  """
  leaves = jax.tree.leaves(payload)
  if not leaves or leaves[0].size == 0:
    return payload
  first = jax.lax.bitcast_convert_type(
    leaves[0].reshape(-1)[0].astype(jnp.float32), jnp.uint32
  )
  return jax.lax.cond(
    (first | 1) != 0, lambda p: p, lambda p: jax.tree.map(jnp.zeros_like, p), payload
  )


def vary_like(new, old):
  """``new`` typed as varying over every mesh axis ``old`` varies over.

  Under ``shard_map`` per-worker state enters the step typed as varying over
  the data axis; a state entry recomputed from all-reduced values (PowerSGD's
  Q) comes out typed as replicated, and a ``scan`` carry must keep its type.
  """

  def cast(n, o):
    missing = tuple(sorted(branches.varying_axes(o) - branches.varying_axes(n)))
    return jax.lax.pcast(n, missing, to="varying") if missing else n

  return jax.tree.map(cast, new, old)


def all_reduce_sum(x, axis_name: AxisName):
  """Sum of a pytree of linear payloads over workers (all-reduce)."""
  _global_only(axis_name, "an all-reduce")
  # Linear payloads are dense or tiny: nothing to protect from re-fusion.
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def all_reduce_mean(x, axis_name: AxisName):
  """Mean of a pytree of linear payloads over workers: ``psum(x / n)``.

  Each worker divides before the sum, so ``n`` finite payloads whose sum would
  overflow float32 still have a finite mean (scale before you sum). For a
  power-of-two ``n`` it equals ``psum(x) / n`` bit for bit (short of
  subnormals).
  """
  if axis_name is None:
    return x
  _global_only(axis_name, "an all-reduce")
  n = num_workers(axis_name)
  return jax.lax.psum(jax.tree.map(lambda a: a / n, x), axis_name)


def all_gather(x, axis_name: AxisName):
  """Stacks a pytree of payloads from all workers on a new leading axis."""
  _global_only(axis_name, "an all-gather")
  if axis_name is None:
    return jax.tree.map(lambda a: a[None], _on_one_device(x))
  return jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name, to="invarying"), x)


def gathered_sum(payload, decode: Callable[..., jax.Array], axis_name: AxisName):
  """``sum_w decode(*payload_w)``: all-gather the payloads, decode each, add.

  Unrolled adds rather than ``jnp.sum(axis=0)``: on CPU the reduction of a
  stacked (workers, d) array hits a slow path (PERFORMANCE_NOTES: 1.1 s vs 42 ms
  for 25.6M x 8) and materialises every decoded copy.
  """
  if isinstance(axis_name, Pattern):
    return axis_name.exchange(payload, decode)
  gathered = all_gather(payload, axis_name)
  n = jax.tree.leaves(gathered)[0].shape[0]
  total = decode(*jax.tree.map(lambda a: a[0], gathered))
  for w in range(1, n):
    total = total + decode(*jax.tree.map(lambda a, w=w: a[w], gathered))
  return total


def gathered_mean(payload, decode: Callable[..., jax.Array], axis_name: AxisName):
  """``sum_w decode(*payload_w) / n``, each decoded payload divided before the sum.

  As :func:`gathered_sum`; dividing first keeps the mean finite when the
  decoded payloads are finite but their sum is not.
  """
  n = num_workers(axis_name)
  return gathered_sum(payload, lambda *p: decode(*p) / n, axis_name)
