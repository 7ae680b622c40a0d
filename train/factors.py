"""Sufficient-factor broadcasting in the training program (survey 004 §2.5).

With ``config.sufficient_factors=True`` (synchronous training only) the step
sends, for every ``nn.Dense`` layer where that moves fewer bytes, the layer's
sufficient factors ``U`` (its inputs) and ``V`` (the loss's gradient at its
outputs) instead of its kernel gradient ``U^T V``
(``gradcomp.models.sufficient_factors``). One step:

1. ``value_grad_and_factors`` gives the loss, the local gradient and every
   Dense layer's factors;
2. each factored layer's ``(U, V)`` is all-gathered and the mean kernel
   gradient rebuilt (``sufficient_factor_mean``); it replaces the local kernel
   gradient in what ``tx.update`` receives;
3. ``tx``'s compressor (with its LayerFusion plan) runs through
   ``optax.masked`` on every other leaf (biases included), so the factored
   kernels pass it untouched (already the workers' mean), and SGD applies the
   whole tree.

The choice is made once at set-up (:func:`plan`), per layer, by Poseidon's rule
``choose(kernel shape, rows per worker, workers, alternative)``: the factors'
rows come from the traced step on one worker's batch (examples, or examples x
positions for a sequence model), and the alternative is the configured
compressor's per-worker link bytes on that kernel alone, compiled as a
layer-wise exchange (``None`` for ``compressor.name="none"``: the dense
all-reduce). On 8 workers the digits MLP of ``configs/default.py`` (batch 16
per worker) keeps both layers dense; the rule is the whole point, not a flag
per layer. A layer the rule keeps off factors (``"dense"`` or
``"alternative"``) goes through the configured compressor like the rest of
the tree: the program has one exchange besides the factors. When no layer is
chosen the step is the plain one.

Fusion. LayerFusion never sees the factored kernels: its plan is built over
the compressed leaves only (their gradient-ready order, restricted), so every
plan (``layerwise``, ``single``, ``auto``, ``none``) works; ``plan.json`` holds
that restricted plan.

Non-finite steps. ``apply_if_finite`` sees what ``tx.update`` receives: the
local gradient of the compressed leaves (poisoned with NaN when the local loss
is non-finite, as in the plain step) and the rebuilt means of the factored
kernels, whose ``V`` is poisoned the same way before the all-gather. A NaN or
inf in any worker's factors or loss makes the mean non-finite on every worker,
so the step is skipped everywhere, as before. The local kernel gradient of a
factored layer is not looked at (it is not sent): a finite ``U`` and ``V``
whose local product overflows while the mean does not is applied. The logged
``l2_grads`` is still the norm of the local gradient, factored kernels
included (computed for it: one ``K x M x N`` product per factored layer, what
a dense backward computes anyway).

State. ``optax.masked``'s state holds the compressor's state of the
compressed leaves only (``MaskedNode`` where a factored kernel is); its
shapes depend on the choice, which depends on the worker count, so a run
resumes on the same number of workers (as a LayerFusion plan requires too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradcomp.models import sufficient_factors as sf
from train import optimizer as optimizer_lib
from train import pricing
from train import step as step_lib

Path = tuple[str, ...]


def enabled(config) -> bool:
  """``config.sufficient_factors``; configs written before it are ``False``."""
  return bool(config.get("sufficient_factors", False))


def check(config) -> None:
  """Raises ``ValueError`` for a config that cannot send sufficient factors.

  Only synchronous training (``config.scheme.name="none"``): a scheme's
  exchange is of params or pseudo-gradients (local SGD, EASGD, gossip) or of a
  delayed message (CD-SGD), not of one step's per-example factors.
  """
  if not enabled(config):
    return
  scheme = optimizer_lib.scheme_name(config)
  if scheme != "none":
    raise ValueError(
      f"config.sufficient_factors=True needs synchronous training "
      f"(config.scheme.name='none'), not {scheme!r}: a scheme exchanges params, "
      f"pseudo-gradients or delayed messages, not one step's per-example factors"
    )


@dataclasses.dataclass(frozen=True)
class Layer:
  """One ``nn.Dense`` layer and the rule's choice for it.

  Attributes:
    path: the module path (its kernel is ``params[*path]["kernel"]``).
    kernel: ``(M, N)``.
    rows: ``K``, factor rows per worker and step.
    dense_bytes: per-worker link bytes of the kernel's ring all-reduce.
    factor_bytes: per-worker link bytes of the factors' all-gather.
    alternative_bytes: the compressor's per-worker link bytes on the kernel
      alone, or ``None`` (``compressor.name="none"``).
    choice: ``"factors"``, ``"dense"`` or ``"alternative"``
      (``sufficient_factors.choose``).
  """

  path: Path
  kernel: tuple[int, int]
  rows: int
  dense_bytes: float
  factor_bytes: float
  alternative_bytes: float | None
  choice: str


def _get(tree, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)


def poison_factors(loss: jax.Array, factors: sf.Factors) -> sf.Factors:
  """``V`` all NaN when the local loss is not finite (as the plain step's
  gradient): the rebuilt mean is then NaN on every worker."""
  v = jnp.where(jnp.isfinite(loss), factors.v, jnp.nan).astype(factors.v.dtype)
  return sf.Factors(factors.u, v)


@dataclasses.dataclass(frozen=True)
class Factored:
  """The layers of a run and which of them exchange factors.

  Attributes:
    layers: every ``nn.Dense`` layer, in the order the model calls them.
    workers: ``P``.
    axis_name: the workers' mesh axis.
  """

  layers: tuple[Layer, ...]
  workers: int
  axis_name: str = step_lib.AXIS

  @property
  def paths(self) -> tuple[Path, ...]:
    """The layers whose factors the step sends."""
    return tuple(x.path for x in self.layers if x.choice == "factors")

  @property
  def active(self) -> bool:
    return bool(self.paths)

  def mask(self, tree):
    """``optax.masked``'s mask: ``True`` where the compressor runs (every
    leaf but the factored kernels)."""
    chosen = set(self.paths)
    return jax.tree_util.tree_map_with_path(
      lambda p, _: not (_keys(p)[-1:] == ("kernel",) and _keys(p)[:-1] in chosen),
      tree,
    )

  def compressed(self, params) -> list[bool]:
    """:meth:`mask` per param leaf, in tree order."""
    return jax.tree.leaves(self.mask(params))

  def restrict(
    self, params, order: Sequence[int], sizes: Sequence[int]
  ) -> tuple[list[int], list[int]]:
    """``order`` and ``sizes`` of the compressed leaves only, re-indexed.

    The gradient-ready order of the tree ``optax.masked`` hands the
    compressor (the factored kernels left out), for its fusion plan.
    """
    keep = self.compressed(params)
    rank = np.cumsum(keep) - 1
    new_order = [int(rank[i]) for i in order if keep[i]]
    new_sizes = [int(s) for s, k in zip(sizes, keep, strict=True) if k]
    return new_order, new_sizes

  def gradients(self, loss: Callable[..., Any], params, *args):
    """``((value, aux), local grads, sent)``: what the step differentiates and sends.

    ``loss(params, *args) -> (value, aux)`` (as ``train.step.loss_fn``).
    ``grads`` is the local gradient, poisoned with NaN when the local value is
    not finite; ``sent`` is ``grads`` with each factored kernel replaced by
    the workers' mean rebuilt from the gathered factors.
    """
    out, grads, factors = sf.value_grad_and_factors(loss, has_aux=True)(params, *args)
    value = out[0]
    grads = step_lib.poison_nonfinite(value, grads)
    means = {
      p: sf.sufficient_factor_mean(*poison_factors(value, factors[p]), self.axis_name)
      for p in self.paths
    }
    return out, grads, sf.replace_kernels(grads, means)

  def record(self) -> list[dict[str, Any]]:
    """The choice per layer, JSON-ready (``sim.json``'s ``sufficient_factors``)."""
    return [
      {**dataclasses.asdict(x), "path": "/".join(x.path), "kernel": list(x.kernel)}
      for x in self.layers
    ]

  def summary(self) -> str:
    """One line per layer: the log line of the run's choice."""
    lines = [
      f"sufficient factors on {self.workers} workers: "
      + (
        f"{len(self.paths)} of {len(self.layers)} Dense layers send factors"
        if self.active
        else "no Dense layer sends factors (the plain step)"
      )
    ]
    for x in self.layers:
      other = (
        ""
        if x.alternative_bytes is None
        else f", compressor {x.alternative_bytes:,.0f}"
      )
      lines.append(
        f"  {'/'.join(x.path)} {x.kernel[0]}x{x.kernel[1]}, {x.rows} rows: "
        f"{x.choice} (factors {x.factor_bytes:,.0f}, dense {x.dense_bytes:,.0f}"
        f"{other} bytes per worker)"
      )
    return "\n".join(lines)


def _compressor_link_bytes(config, mesh, shape, dtype) -> float:
  """The configured compressor's per-worker link bytes on one kernel alone."""
  tx = optimizer_lib.compressor(config.compressor, step_lib.AXIS)
  like = {"kernel": jax.ShapeDtypeStruct((mesh.size, *shape), dtype)}
  operands = pricing.round_wire(tx, mesh, like)
  return sf.ring_link_bytes(operands, mesh.size)


def plan(
  config, model, mesh, params, model_state, batch_like, criterion=step_lib.cross_entropy
) -> Factored:
  """The rule's choice for every ``nn.Dense`` of ``model`` in this run.

  Args:
    config: the run's config (``compressor``: the alternative exchange).
    model: the flax module.
    mesh: the workers' mesh (its size is ``P``).
    params: one worker's params (arrays or ``jax.ShapeDtypeStruct``).
    model_state: its non-param collections.
    batch_like: ``jax.ShapeDtypeStruct`` of the global batch.
    criterion: the workload's, as for ``train.step.loss_fn``.

  Raises:
    ValueError: if the model calls no ``nn.Dense``.
  """
  workers = mesh.size
  local = tuple(
    jax.ShapeDtypeStruct((b.shape[0] // workers, *b.shape[1:]), b.dtype)
    for b in batch_like
  )
  loss = lambda p, s, x, y: step_lib.loss_fn(
    model, p, s, x, y, train=True, criterion=criterion
  )
  _, _, factors = jax.eval_shape(
    sf.value_grad_and_factors(loss, has_aux=True), params, model_state, *local
  )
  if not factors:
    raise ValueError(
      f"config.sufficient_factors=True: model {config.model.name!r} calls no "
      f"flax nn.Dense layer (outside lifted transforms) whose factors could be sent"
    )
  layers = []
  for path, f in factors.items():
    kernel = _get(params, path)["kernel"]
    shape = tuple(int(d) for d in kernel.shape)
    rows = int(f.u.shape[0])
    value_bytes = int(np.dtype(kernel.dtype).itemsize)
    alternative = None
    if config.compressor.name != "none" and workers > 1:
      alternative = _compressor_link_bytes(config, mesh, shape, kernel.dtype)
    layers.append(
      Layer(
        path=tuple(path),
        kernel=shape,
        rows=rows,
        dense_bytes=sf.dense_bytes(shape, workers, value_bytes),
        factor_bytes=sf.factor_bytes(shape, rows, workers, value_bytes),
        alternative_bytes=alternative,
        choice=sf.choose(shape, rows, workers, alternative, value_bytes=value_bytes),
      )
    )
  return Factored(tuple(layers), workers)
