r"""Sufficient factors of the ``nn.Dense`` layers: the batch's gradient as outer products.

Survey 004 §2.5 (Xie et al. 2016, *Lighter-communication distributed machine
learning via sufficient factor broadcasting*; Poseidon, Zhang et al. 2015 /
ATC 2017). A dense layer :math:`y_j = x_j W + b` over the rows
:math:`j = 1..K` of a batch (examples, or examples x positions for a sequence)
has

.. math::
  \frac{\partial L}{\partial W} = \sum_j x_j^\top \delta_j = U^\top V, \qquad
  \frac{\partial L}{\partial b} = \sum_j \delta_j = \mathbf{1}^\top V,

with :math:`U = [x_j] \in \mathbb{R}^{K \times M}` the layer's inputs and
:math:`V = [\delta_j] \in \mathbb{R}^{K \times N}`,
:math:`\delta_j = \partial L / \partial y_j`. A worker can send the factors,
``K (M + N)`` values, instead of the ``M x N`` matrix, and receivers rebuild
the matrix (:func:`rebuild`, :func:`sufficient_factor_mean`). Whether that
moves fewer bytes depends on the number of workers too (:func:`choose`).

**Getting the factors.** :func:`value_grad_and_factors` wraps a loss like
``jax.value_and_grad`` and also returns :class:`Factors` for every call of a
flax ``nn.Dense`` made inside it, keyed by the module's path, so the models of
``zoo.py`` give their factors unchanged. It intercepts ``nn.Dense.__call__``
(``nn.intercept_methods``): the layer's input is recorded as ``U``, and a zero
*perturbation* is added to its output, whose gradient is ``V`` (the trick of
flax's ``Module.perturb``). Why not ``perturb`` / ``sow`` themselves: they put
batch-shaped ``perturbations`` / ``intermediates`` collections into the model's
variables, which ``train/`` initialises, shards and checkpoints; the
interceptor leaves the models and their variables as they are. The normal
gradients come back unchanged (adding zeros changes no value), and under
``jit`` a dense kernel gradient that the step does not use is never computed
(dead code).

Limits: ``nn.Dense`` only (not ``DenseGeneral`` / ``Einsum`` / convolutions);
not inside flax lifted transforms (``nn.scan``, ``nn.vmap``, ``nn.remat``), whose
inner traces the recorder cannot leave; a layer with a custom ``dot_general``
or a ``precision`` / ``dtype`` other than the default is rebuilt in float32 at
default precision, so it matches ``jax.grad`` only up to that difference.
Models may import only ``parallel`` / ``kernels`` (the package's layers), so the
gossip exchange pattern is accepted by its interface (an object with an
``exchange(payload, decode)`` method: ``compressors.exchange.Neighbours``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from gradcomp.parallel import branches

Path = tuple[str, ...]


class Factors(NamedTuple):
  """The sufficient factors of one ``nn.Dense`` layer over a batch.

  ``rebuild(u, v)`` is the gradient of the loss with respect to the layer's
  kernel, ``v.sum(0)`` the one with respect to its bias.
  """

  u: jax.Array  # shape=(rows, M), the layer's dtype: its inputs x_j, one row each.
  v: jax.Array  # shape=(rows, N), the layer's dtype: dL/dy_j at its outputs.


class _Recorder:
  """``nn.intercept_methods`` interceptor: records each ``nn.Dense`` call.

  With ``perturbations`` it adds the i-th of them to the i-th call's output.
  """

  def __init__(self, perturbations=None):
    self.perturbations = perturbations
    self.paths: list[Path] = []
    self.inputs: list[jax.Array] = []
    self.outputs: list[jax.Array] = []

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if not (isinstance(module, nn.Dense) and context.method_name == "__call__"):
      return next_fun(*args, **kwargs)
    x = args[0] if args else kwargs["inputs"]
    y = next_fun(*args, **kwargs)
    i = len(self.paths)
    self.paths.append(tuple(module.path))
    # The input as the kernel meets it: Dense promotes it to the output dtype.
    self.inputs.append(jnp.asarray(x).astype(y.dtype).reshape(-1, x.shape[-1]))
    if self.perturbations is not None:
      y = y + self.perturbations[i]
    self.outputs.append(y)
    return y


def _group(paths: list[Path], rows: list[jax.Array]) -> dict[Path, jax.Array]:
  """Rows of the calls of one module (shared weights) concatenated, by path."""
  grouped: dict[Path, list[jax.Array]] = {}
  for path, r in zip(paths, rows, strict=True):
    grouped.setdefault(path, []).append(r)
  return {
    p: rs[0] if len(rs) == 1 else jnp.concatenate(rs) for p, rs in grouped.items()
  }


def value_grad_and_factors(
  fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, dict[Path, Factors]]]:
  """``jax.value_and_grad(fun)`` that also returns every ``nn.Dense``'s factors.

  Args:
    fun: ``fun(params, *args)``, a scalar loss (or ``(loss, aux)`` with
      ``has_aux``) that applies flax modules; it is differentiated with
      respect to ``params``. Its arguments must be arrays (close over
      anything else); it is traced twice, once abstractly to find the
      layers.
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    ``f(params, *args) -> (value, grads, factors)``: ``value`` and ``grads``
    as ``jax.value_and_grad(fun, has_aux=has_aux)`` returns them, and
    ``factors`` a dict from each ``nn.Dense``'s module path (e.g.
    ``("hidden_0",)``; its kernel is ``params[...path]["kernel"]`` when
    ``params`` is the ``params`` collection) to its :class:`Factors`. Inputs
    of more than two dimensions contribute one row per leading index (an
    LSTM decoder's ``(batch, time)``); a module called several times
    contributes the rows of every call.

  Raises:
    ValueError: if ``fun`` does not call the same layers when traced again.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from gradcomp.models import zoo
    >>> model = zoo.MLP(num_classes=3, features=(5,))
    >>> x = jnp.ones((4, 2))
    >>> params = model.init(jax.random.key(0), x)["params"]
    >>> loss = lambda p, x: jnp.sum(model.apply({"params": p}, x) ** 2)
    >>> value, grads, factors = value_grad_and_factors(loss)(params, x)
    >>> {k: (f.u.shape, f.v.shape) for k, f in factors.items()}
    {('hidden_0',): ((4, 2), (4, 5)), ('out',): ((4, 5), (4, 3))}
  """

  def run(params, *args):
    def probe(params, *args):
      recorder = _Recorder()
      with nn.intercept_methods(recorder):
        fun(params, *args)
      return recorder.outputs

    # Output types carry the mesh axes each output varies over: the zero
    # perturbations must vary over them too, or their gradient would come back
    # summed over workers (psum is the transpose of pvary).
    outputs = jax.eval_shape(probe, params, *args)
    zeros = [_zeros_like(o) for o in outputs]

    def perturbed(params, perturbations):
      recorder = _Recorder(perturbations)
      with nn.intercept_methods(recorder):
        out = fun(params, *args)
      if len(recorder.paths) != len(perturbations):
        raise ValueError(
          f"fun called {len(recorder.paths)} nn.Dense layers when traced again, "
          f"{len(perturbations)} the first time; it must be deterministic"
        )
      value, aux = out if has_aux else (out, None)
      return value, (aux, recorder.paths, recorder.inputs)

    (value, (aux, paths, inputs)), (grads, deltas) = jax.value_and_grad(
      perturbed, argnums=(0, 1), has_aux=True
    )(params, zeros)
    rows_v = [d.reshape(-1, d.shape[-1]) for d in deltas]
    us, vs = _group(paths, inputs), _group(paths, rows_v)
    factors = {p: Factors(us[p], vs[p]) for p in us}
    return ((value, aux) if has_aux else value), grads, factors

  return run


def _zeros_like(struct) -> jax.Array:
  zeros = jnp.zeros(struct.shape, struct.dtype)
  axes = tuple(sorted(branches.varying_axes(struct)))
  return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def rebuild(u: jax.Array, v: jax.Array) -> jax.Array:
  """``U^T V = sum_j u_j^T v_j``, float32, shape ``(M, N)``.

  The same contraction as the transpose of ``nn.Dense``'s matmul (over the
  rows, at default precision), so it is ``jax.grad``'s kernel gradient up to
  the order of a float32 sum of ``rows`` products.
  """
  u = jnp.asarray(u, jnp.float32)
  v = jnp.asarray(v, jnp.float32)
  return jax.lax.dot_general(u, v, (((0,), (0,)), ((), ())))


def sufficient_factor_mean(u: jax.Array, v: jax.Array, axis_name=None) -> jax.Array:
  """Mean over workers of ``rebuild(u_w, v_w)``: the factors cross the wire.

  .. math::
    \\bar G = \\tfrac{1}{n} \\sum_w U_w^\\top V_w
    = [U_1; \\dots; U_n]^\\top [V_1; \\dots; V_n] / n

  The factors are all-gathered (``K (M + N)`` values in each worker's
  payload, typed invariant, so the result is the same on every worker), ``V``
  is scaled by ``1 / n`` on arrival (scale before you sum), and one matmul
  over the ``n K`` gathered rows rebuilds the mean.

  Args:
    u: this worker's ``(K, M)`` inputs.
    v: this worker's ``(K, N)`` output gradients.
    axis_name: the mapped axis of the workers, ``None`` for one device (the
      result is ``rebuild(u, v)``), or a gossip pattern with an ``exchange(
      payload, decode)`` method (``compressors.exchange.Neighbours``), which
      permutes the factors to the neighbours and mixes the rebuilt matrices.

  Returns:
    The float32 ``(M, N)`` mean kernel gradient.
  """
  if axis_name is None:
    return rebuild(u, v)
  if hasattr(axis_name, "exchange"):
    return axis_name.exchange((u, v), rebuild)
  n = jax.lax.axis_size(axis_name)
  us, vs = jax.lax.all_gather((u, v), axis_name, to="invarying")
  scaled = vs.reshape(-1, v.shape[-1]).astype(jnp.float32) * (1.0 / n)
  return rebuild(us.reshape(-1, u.shape[-1]), scaled)


def replace_kernels(grads, kernels: Mapping[Path, jax.Array]):
  """``grads`` with ``grads[...path]["kernel"]`` replaced by ``kernels[path]``.

  For a step that exchanges some layers' factors: their mean kernel
  gradients (:func:`sufficient_factor_mean`) replace the local ones, cast to
  the leaf's dtype.

  Raises:
    KeyError: for a path without a kernel leaf in ``grads``.
  """
  found: set[Path] = set()

  def swap(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
    if keys[-1:] == ("kernel",) and keys[:-1] in kernels:
      found.add(keys[:-1])
      new = kernels[keys[:-1]]
      if new.shape != leaf.shape:
        raise ValueError(f"kernel {keys}: shape {new.shape}, leaf {leaf.shape}")
      return new.astype(leaf.dtype)
    return leaf

  out = jax.tree_util.tree_map_with_path(swap, grads)
  missing = set(kernels) - found
  if missing:
    raise KeyError(f"no kernel leaf for {sorted(missing)} in grads")
  return out


# -- what crosses the wire: Poseidon's hybrid rule (SACP / HybComm) -----------


def _check_layer(shape, batch: int, workers: int) -> tuple[int, int]:
  """Validates a layer's static description; returns ``(M, N)``."""
  for name, value in (("batch", batch), ("workers", workers)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  dims = tuple(shape) if isinstance(shape, tuple | list) else ()
  if len(dims) != 2 or not all(
    isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in dims
  ):
    raise ValueError(
      f"shape must be a kernel shape (M, N) of integers >= 1, got {shape!r}"
    )
  return dims


def factor_bytes(shape, batch: int, workers: int, value_bytes: int = 4) -> float:
  """Bytes one worker sends per step to broadcast its factors: ``(P-1) K (M+N)``.

  Peer to peer (SFB): each of the ``P`` workers sends its ``K (M + N)``
  values to each of the ``P - 1`` others. A ring all-gather, what
  :func:`sufficient_factor_mean` compiles to, sends the same per worker;
  its HLO operand (what ``gradcomp.wire_bytes`` counts) is ``K (M + N)``.
  """
  m, n = _check_layer(shape, batch, workers)
  return float((workers - 1) * batch * (m + n) * value_bytes)


def dense_bytes(shape, workers: int, value_bytes: int = 4) -> float:
  """Bytes one worker sends per step to all-reduce the matrix: ``2 (P-1)/P M N``.

  A ring all-reduce (reduce-scatter, then all-gather; Patarasuk & Yuan 2009,
  survey 004 §2.4), or a parameter server sharded over the ``P`` workers
  (Poseidon's colocated servers): each worker pushes the ``(P-1)/P`` of the
  matrix held by the other shards and serves its own shard's ``1/P`` to the
  ``P - 1`` others. (A dedicated server, not a worker, puts ``2 M N`` through
  each worker's link: push ``M N``, pull ``M N``.)
  """
  m, n = _check_layer(shape, 1, workers)
  return 2.0 * (workers - 1) / workers * m * n * value_bytes


def ring_link_bytes(operand_bytes: Mapping[str, float], workers: int) -> float:
  """Bytes one worker sends on its link, from its collectives' operand bytes.

  ``operand_bytes`` as ``gradcomp.parallel.wire.collective_bytes`` reports
  them per kind (the per-device operands of the compiled program); ring
  algorithms send ``2 (P-1)/P`` of an all-reduce's buffer, ``P - 1`` times an
  all-gather's piece, ``(P-1)/P`` of a reduce-scatter's or all-to-all's
  buffer, and a collective-permute's buffer once. This is the accounting of
  :func:`factor_bytes` and :func:`dense_bytes`, so another compressor's
  exchange can be compared with them (``choose``'s ``alternative_bytes``).
  """
  p = workers
  factors = {
    "all-reduce": 2.0 * (p - 1) / p,
    "all-gather": float(p - 1),
    "reduce-scatter": (p - 1) / p,
    "all-to-all": (p - 1) / p,
    "collective-permute": 1.0,
  }
  unknown = set(operand_bytes) - set(factors)
  if unknown:
    raise ValueError(f"unknown collective kinds {sorted(unknown)}")
  return sum(factors[k] * b for k, b in operand_bytes.items())


def choose(
  shape,
  batch: int,
  workers: int,
  alternative_bytes: float | None = None,
  *,
  value_bytes: int = 4,
) -> str:
  """Poseidon's per-layer choice: factors, the dense exchange, or another one.

  Sends the factors when they move strictly fewer bytes than every other
  option, by the per-worker link bytes of :func:`factor_bytes` and
  :func:`dense_bytes`:

  .. math::
    (P - 1) K (M + N) < \\tfrac{2 (P - 1)}{P} M N
    \\iff P K (M + N) < 2 M N \\quad (P > 1)

  Unlike the per-worker operand comparison ``K (M + N) < M N``, this grows
  with ``P``: every worker receives every other worker's factors, while the
  all-reduce's traffic per worker is bounded. Counting what each worker
  receives as well as what it sends doubles both sides and changes nothing
  (both exchanges are symmetric). On one worker nothing crosses the wire: ``"dense"`` (rebuilding
  would only add work).

  Args:
    shape: the layer's kernel shape ``(M, N)``.
    batch: rows per worker ``K`` (examples, times positions for a sequence).
    workers: ``P``.
    alternative_bytes: per-worker link bytes of another exchange for this
      layer (a compressor's, e.g. :func:`ring_link_bytes` of its wire), or
      ``None`` to compare with the dense all-reduce only.
    value_bytes: bytes per factor and dense value (4: float32).

  Returns:
    ``"factors"``, ``"dense"`` or ``"alternative"``: the cheapest; on a tie,
    the dense or alternative exchange (no rebuild), the alternative only when
    strictly cheaper than the dense one.
  """
  _check_layer(shape, batch, workers)
  if workers == 1:
    return "dense"
  costs = {"dense": dense_bytes(shape, workers, value_bytes)}
  if alternative_bytes is not None:
    if not (math.isfinite(alternative_bytes) and alternative_bytes >= 0):
      raise ValueError(
        f"alternative_bytes must be a finite number >= 0, got {alternative_bytes!r}"
      )
    costs["alternative"] = float(alternative_bytes)
  best = min(costs, key=lambda k: (costs[k], k != "dense"))
  if factor_bytes(shape, batch, workers, value_bytes) < costs[best]:
    return "factors"
  return best
