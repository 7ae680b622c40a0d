r"""The run's mesh: ``config.mesh`` parsed and built, and the FSDP layout of params.

DESIGN §3 and §7. ``config.mesh`` names the mesh axes and their sizes,
``"name=size,..."``; every device is a data-parallel worker whatever the
axes, so the step's batch is split over all of them (:attr:`MeshSpec.
worker_axis`). Three shapes are known, slow axis first:

* ``data=N`` (the default, ``N`` the run's workers: ``config.workers`` or
  every device): one axis, the program as it always was.
* ``data=D,fsdp=F``: params, and the optimizer state shaped like them, are
  sharded over ``fsdp`` (:class:`ShardedParams`); each device all-gathers
  the params at use inside the step, and the gradient is reduce-scattered
  over ``fsdp`` and averaged over ``data`` by
  ``gradcomp.hierarchical(compressor over "data", "fsdp", gather=False)``
  (ZeRO / FSDP), so each device's optimizer updates only its shards.
* ``node=N,local=M``: params replicated; the compressor averages over
  both axes, or, with ``config.compressor.hierarchical="local"``, becomes
  ``gradcomp.hierarchical(compressor over "node", "local")``: dense
  reduce-scatter inside a node, compression between nodes.

With several processes (``jax.distributed``) the slow axis crosses them:
each process is a granule of the slow axis, as
``mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True)`` lays
it out, and the fast axis stays inside a process.

Only the synchronous scheme (``config.scheme.name=none``) under
``config.step=shard_map`` runs on a mesh other than ``data=N``
(:func:`check_program`).

**FSDP layout.** Each param leaf ``x`` of ``d`` values is raveled,
zero-padded to ``F c`` values (``c = ceil(d / F)``) and stored as an
``(F, c)`` array whose row ``j`` lives on the devices at ``fsdp`` index
``j`` (spec ``P("fsdp")``): exactly ``gradcomp.fusion.shard``'s chunk
``j``, so the shard a device holds is the one
``hierarchical(..., gather=False)`` returns to it. The padding stays zero:
its gradient is zero, and so are its SGD and Adam updates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.fusion.hierarchical import shard_size

#: The step's data-parallel axis on the default mesh.
DATA = "data"
#: Axis names ``config.mesh`` may use.
AXES = ("data", "fsdp", "node", "local")
#: The meshes the program runs, by their axes, slow axis first.
SHAPES = (("data",), ("data", "fsdp"), ("node", "local"))
#: Per shape: the fast axis a compressor may reduce-scatter over
#: (``config.compressor.hierarchical``); FSDP always does.
FAST = {("data", "fsdp"): "fsdp", ("node", "local"): "local"}

AxisName = str | tuple[str, ...]


def _one(axes: tuple[str, ...]) -> AxisName:
  """One axis as its name (so ``data=N`` is the program it always was), else the tuple."""
  return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """A parsed ``config.mesh`` (with ``config.compressor.hierarchical``).

  Attributes:
    names: the axes, slow first (one of :data:`SHAPES`).
    sizes: their sizes.
    hierarchical: the fast axis the compressor reduce-scatters over
      (``"fsdp"`` on an FSDP mesh, ``"local"`` when configured), or ``None``.
  """

  names: tuple[str, ...]
  sizes: tuple[int, ...]
  hierarchical: str | None = None

  def __str__(self) -> str:
    return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))

  @property
  def size(self) -> int:
    """The number of workers: every device of the mesh."""
    return math.prod(self.sizes)

  @property
  def shape(self) -> dict[str, int]:
    return dict(zip(self.names, self.sizes, strict=True))

  @property
  def worker_axis(self) -> AxisName:
    """The step's data-parallel axis: every mesh axis (``"data"`` on the default mesh)."""
    return _one(self.names)

  @property
  def fsdp(self) -> str | None:
    """The axis params are sharded over, or ``None`` (replicated)."""
    return "fsdp" if "fsdp" in self.names else None

  @property
  def exchange_axis(self) -> AxisName:
    """The axis the compressor itself averages over: all but the fast one."""
    return _one(tuple(n for n in self.names if n != self.hierarchical))

  def record(self) -> dict[str, Any]:
    """What a checkpoint records of the mesh (:func:`from_record` reads it back)."""
    return {"mesh": str(self), "hierarchical": self.hierarchical}

  def sharded_params(self, like) -> ShardedParams | None:
    """The FSDP layout of params shaped like ``like``, or ``None`` (replicated)."""
    if self.fsdp is None:
      return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
    return ShardedParams(self.fsdp, self.shape[self.fsdp], shapes)

  def make(self, devices) -> Mesh:
    """The mesh over ``devices`` (all of them, in several processes).

    One process: ``jax.make_mesh``. Several: the slow axis crosses the
    processes (each process one granule of it), the fast axis stays inside
    each, as ``create_hybrid_device_mesh(..., process_is_granule=True)``.
    """
    processes = jax.process_count()
    if len(self.names) == 1 or processes == 1:
      return jax.make_mesh(self.sizes, self.names, devices=devices)
    slow, fast = self.sizes
    if slow % processes:
      raise ValueError(
        f"config.mesh={str(self)!r}: the slow axis {self.names[0]!r} ({slow}) "
        f"crosses the {processes} processes, so its size must be a multiple "
        f"of theirs"
      )
    grid = mesh_utils.create_hybrid_device_mesh(
      (slow // processes, fast), (processes, 1), devices, process_is_granule=True
    )
    return Mesh(grid, self.names, axis_types=(AxisType.Explicit,) * 2)


def parse(text: str | None, workers: int, hierarchical: str | None = None) -> MeshSpec:
  """``config.mesh`` (and ``config.compressor.hierarchical``) as a :class:`MeshSpec`.

  Args:
    text: ``"data=2,fsdp=4"``, or ``None`` for ``data=<workers>``. Axes may
      be given in either order; the mesh puts the slow one first.
    workers: the run's number of workers (``config.workers`` or every
      device): the product of the sizes must equal it.
    hierarchical: ``config.compressor.hierarchical``: ``None``, or the fast
      axis of the mesh (``"local"`` on ``node=N,local=M``; ``"fsdp"`` on an
      FSDP mesh, where it is implied).

  Raises:
    ValueError: naming the field, its value and what is valid.

  Examples:
    >>> from train import mesh
    >>> spec = mesh.parse("fsdp=4,data=2", 8)
    >>> str(spec), spec.worker_axis, spec.fsdp, spec.exchange_axis
    ('data=2,fsdp=4', ('data', 'fsdp'), 'fsdp', 'data')
    >>> mesh.parse(None, 8).worker_axis
    'data'
  """
  shapes = " or ".join(",".join(f"{n}=..." for n in shape) for shape in SHAPES)
  if text is None:
    axes = {DATA: workers}
  else:
    if not isinstance(text, str) or not text.strip():
      raise ValueError(
        f"config.mesh must be a string like 'data=2,fsdp=4', got {text!r}"
      )
    axes = {}
    for item in text.split(","):
      name, sep, size = (part.strip() for part in item.partition("="))
      if not sep or not name:
        raise ValueError(
          f"config.mesh={text!r}: {item.strip()!r} is not name=size; e.g. "
          f"'data=2,fsdp=4'"
        )
      if name not in AXES:
        raise ValueError(
          f"config.mesh={text!r}: unknown axis {name!r}; known axes: {', '.join(AXES)}"
        )
      if name in axes:
        raise ValueError(f"config.mesh={text!r}: axis {name!r} is given twice")
      if not size.isdigit() or int(size) < 1:
        raise ValueError(
          f"config.mesh={text!r}: the size of {name!r} must be an integer >= 1, "
          f"got {size!r}"
        )
      axes[name] = int(size)
  names = next((s for s in SHAPES if set(s) == set(axes)), None)
  if names is None:
    raise ValueError(
      f"config.mesh={text!r}: axes {', '.join(axes)} are not a mesh the program "
      f"runs; valid: {shapes}"
    )
  spec = MeshSpec(names, tuple(axes[n] for n in names))
  if spec.size != workers:
    raise ValueError(
      f"config.mesh={text!r} has {spec.size} devices, the run has {workers} "
      f"workers (config.workers, or every device): the sizes' product must "
      f"equal it"
    )
  fast = FAST.get(names)
  if hierarchical is not None and hierarchical != fast:
    valid = f"None or {fast!r}" if fast else "None (it needs a fast axis)"
    raise ValueError(
      f"config.compressor.hierarchical={hierarchical!r} on config.mesh="
      f"{str(spec)!r}: valid: {valid}; the fast axes are 'fsdp' "
      f"(data=D,fsdp=F) and 'local' (node=N,local=M)"
    )
  if spec.fsdp is not None:
    hierarchical = spec.fsdp  # FSDP reduce-scatters its gradients.
  return dataclasses.replace(spec, hierarchical=hierarchical)


def from_record(record: dict[str, Any]) -> MeshSpec:
  """The :class:`MeshSpec` a checkpoint recorded (:meth:`MeshSpec.record`)."""
  sizes = [int(item.partition("=")[2]) for item in record["mesh"].split(",")]
  return parse(record["mesh"], math.prod(sizes), record.get("hierarchical"))


def check_program(
  spec: MeshSpec, *, scheme: str, step: str, self_exchanging: bool, factors: bool
) -> None:
  """Raises ``ValueError`` where a mesh other than ``data=N`` meets what it cannot run.

  Multi-axis meshes run synchronous training (``config.scheme.name=none``)
  under ``config.step=shard_map``, with a compressor of gradcomp's (not an
  optimizer that exchanges its own momentum) and without sufficient factors.
  """
  if len(spec.names) == 1:
    return
  for ok, field, value, valid in (
    (scheme == "none", "config.scheme.name", scheme, "none"),
    (step == "shard_map", "config.step", step, "shard_map"),
    (not self_exchanging, "config.optimizer.name", "(self-exchanging)", "sgd, adamw"),
    (not factors, "config.sufficient_factors", True, "False"),
  ):
    if not ok:
      raise ValueError(
        f"config.mesh={str(spec)!r} runs synchronous data parallelism only: "
        f"{field}={value!r} is not supported there; valid: {valid}"
      )


# -- FSDP: params sharded over an axis ---------------------------------------


def host_shard(x, g: int) -> np.ndarray:
  """``x`` raveled, zero-padded and cut in ``g`` rows: ``(g, ceil(x.size / g))``."""
  flat = np.ravel(np.asarray(x))
  c = shard_size(flat.size, g)
  return np.pad(flat, (0, g * c - flat.size)).reshape(g, c)


def host_unshard(rows, shape) -> np.ndarray:
  """:func:`host_shard`'s inverse: the ``(g, c)`` rows joined, unpadded, reshaped."""
  return np.ravel(np.asarray(rows))[: math.prod(shape)].reshape(shape)


@dataclasses.dataclass(frozen=True)
class ShardedParams:
  """Params (and state shaped like them) sharded over ``axis`` (the FSDP layout).

  Attributes:
    axis: the mesh axis the shards are spread over.
    size: its size ``F``.
    like: the full params, a tree of ``jax.ShapeDtypeStruct``.
  """

  axis: str
  size: int
  like: Any

  @property
  def spec(self) -> P:
    """Spec of each ``(F, c)`` param leaf: row ``j`` at ``axis`` index ``j``."""
    return P(self.axis)

  def shard(self, params):
    """The ``(F, c)`` global leaves of full ``params`` (``jnp``: traceable)."""
    g = self.size

    def one(x):
      c = shard_size(x.size, g)
      return jnp.pad(jnp.ravel(x), (0, g * c - x.size)).reshape(g, c)

    return jax.tree.map(one, params)

  def shards_like(self):
    """One device's shards as ``jax.ShapeDtypeStruct``: ``(c,)`` per leaf."""
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((shard_size(x.size, self.size),), x.dtype),
      self.like,
    )

  def gather(self, shards):
    """Inside ``shard_map``: the full params from this device's ``(c,)`` shards."""
    return gradcomp.fusion.unshard(shards, self.like, self.axis)

  def full(self, params):
    """Outside: host arrays of the full params from the global ``(F, c)`` leaves."""
    return jax.tree.map(
      lambda rows, x: host_unshard(jax.device_get(rows), x.shape), params, self.like
    )


def sharded_chain(exchange, *local, shards: ShardedParams):
  """``optax.chain(exchange, *local)`` whose ``local`` part starts on the shards.

  ``exchange`` (``hierarchical(..., gather=False)``) takes the full params
  at ``init``; the ``local`` optimizer updates this device's shards, so its
  state (momentum, Adam's moments) starts shaped like them: zeros of
  ``(c,)`` per leaf, the same on every device before the first step.
  """
  tx = optax.chain(exchange, *local)
  rest = optax.chain(*local)

  def init_fn(params):
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shards.shards_like())
    return (exchange.init(params), *rest.init(zeros))

  return optax.GradientTransformation(init_fn, tx.update)


def clip_by_global_norm(max_norm: float, axis: str) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` on shards: the norm is summed over ``axis``.

  Each device holds its shards of the mean gradient (padding zero); the
  global norm is ``sqrt(psum(sum of squares, axis))``, the same on every
  device, and each shard is scaled as ``optax`` scales the whole gradient.
  """

  def update_fn(updates, state, params=None):
    del params
    norm = jnp.sqrt(jax.lax.psum(optax.tree.norm(updates, squared=True), axis))
    trigger = norm < max_norm
    updates = jax.tree.map(
      lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
      updates,
    )
    return updates, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
