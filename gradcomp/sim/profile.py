"""A compressor's measured cost profile: ``Comp(x)`` and its wire payload vs size.

Paper 000 §3.2 (Fig. 1b): the cost of one compression call hardly grows from
2^4 to 2^20 values on a GPU, so layer-wise compression pays a fixed overhead
per tensor; §4.3, eq. 7: LayerFusion minimises ``sum Comp(x_i) + sum
Comm(x_i) + beta - sum p(x_i)``. A :class:`Profile` holds what
:func:`gradcomp.fusion.profiling.profile` measured on a backend (one buffer,
and the same values fused from several leaves) and interpolates the two
piecewise-linear curves; with the bytes and messages each collective sends per
worker, ``cluster.py`` prices ``Comm(x)``. Profiles are JSON, so a plan can be
made for a cluster one is not on.

A wire key is a collective kind (over all the cluster's workers) or
``"<kind>@fast"`` / ``"<kind>@slow"``, a ring inside a node or across nodes
(``Cluster.link_seconds``). :meth:`Profile.hierarchical` lifts a compressor's
profile into that of ``gradcomp.hierarchical(inner, fast_axis)``, whose
reduce-scatter and all-gather run inside nodes and whose inner exchange runs
across them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import optax

from gradcomp.compressors import spec as spec_lib
from gradcomp.parallel.wire import COLLECTIVES as KINDS  # noqa: F401 (for profiling)
from gradcomp.sim.cluster import Cluster, split_wire_key

#: Sizes timed by default: 2^4, 2^6, ..., 2^24 values (paper 000 Fig. 1b's range).
DEFAULT_SIZES = tuple(2**p for p in range(4, 25, 2))
#: Sizes timed when ``layerfusion(plan="auto")`` measures a profile itself.
AUTO_SIZES = tuple(2**p for p in range(4, 25, 4))
#: Leaves fused into one buffer for the fused curve.
FUSED_PIECES = 4


def validated_sizes(sizes) -> tuple[int, ...]:
  sizes = tuple(sizes)
  if not sizes:
    raise ValueError("sizes must list at least one size")
  for s in sizes:
    if isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 1:
      raise ValueError(f"sizes must be integers >= 1, got {s!r}")
  if list(sizes) != sorted(set(sizes)):
    raise ValueError(f"sizes must be strictly increasing, got {sizes}")
  return tuple(int(s) for s in sizes)


@dataclasses.dataclass(frozen=True)
class Profile:
  """Compression time and wire payload of one compressor against buffer size.

  Attributes:
    compressor: the compressor's label (``CompressorSpec.label``), e.g.
      ``"topk(error_feedback=True, ratio=0.01)"``.
    backend: where the times were measured, e.g. ``"cpu (8 devices)"``.
    devices: how many workers compressed at once on this host while timed
      (1: one device alone; 8: eight virtual devices sharing the CPU).
    sizes: the buffer sizes (number of values), increasing.
    seconds: compress + decompress time of one buffer of each size (the
      exchange is the identity), median of the timed calls.
    fused_seconds: the same for that many values fused from
      :data:`FUSED_PIECES` leaves, concatenation and split included.
    wire_bytes: per wire key, bytes one worker sends at each size: a
      collective kind (over all the cluster's workers), or ``"<kind>@fast"``
      / ``"<kind>@slow"`` (a ring inside a node / across nodes).
    wire_messages: per wire key, collectives issued at each size.
    workers: the workers the wire was traced on (a gathered payload's bytes
      do not depend on them; a reduce-scatter form's and qgZ's do); with
      ``@fast`` / ``@slow`` keys, the cluster's workers it was made for.
    workers_per_node: the ``g`` devices per node the ``@fast`` / ``@slow``
      keys were made for (1: a flat profile, no such keys); it divides
      ``workers``.

  Examples:
    A profile written by hand: a codec costing 1 us per value and sending
    4 bytes per value in one all-reduce, measured at 100 and 1000 values.

    >>> from gradcomp.sim import Profile
    >>> p = Profile(compressor="none()", backend="synthetic", devices=1,
    ...             sizes=(100, 1000), seconds=(1e-4, 1e-3),
    ...             fused_seconds=(2e-4, 2e-3), wire_bytes={"all-reduce": (400, 4000)},
    ...             wire_messages={"all-reduce": (1, 1)})
    >>> p.comp_seconds([50, 550, 2000]).round(6).tolist()  # flat, linear, extrapolated
    [0.0001, 0.00055, 0.002]
    >>> nbytes, messages = p.wire(550)["all-reduce"]
    >>> float(nbytes), int(messages)
    (2200.0, 1)
    >>> Profile.from_json(p.to_json()) == p
    True
  """

  compressor: str
  backend: str
  devices: int
  sizes: tuple[int, ...]
  seconds: tuple[float, ...]
  fused_seconds: tuple[float, ...]
  wire_bytes: dict[str, tuple[float, ...]]
  wire_messages: dict[str, tuple[int, ...]]
  workers: int = 2
  workers_per_node: int = 1

  def __post_init__(self):
    for field in ("workers", "workers_per_node"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
    sizes = validated_sizes(self.sizes)
    object.__setattr__(self, "sizes", sizes)
    for field in ("seconds", "fused_seconds"):
      values = tuple(float(v) for v in getattr(self, field))
      if len(values) != len(sizes) or not all(np.isfinite(values)) or min(values) < 0:
        raise ValueError(
          f"{field} must hold one finite time >= 0 per size ({len(sizes)}), "
          f"got {values}"
        )
      object.__setattr__(self, field, values)
    for field in ("wire_bytes", "wire_messages"):
      table = dict(getattr(self, field))
      for key in table:
        try:
          split_wire_key(key)
        except ValueError as e:
          raise ValueError(f"{field}: {e}") from None
      for kind, values in table.items():
        if len(values) != len(sizes):
          raise ValueError(f"{field}[{kind!r}] needs one value per size")
      object.__setattr__(self, field, {k: tuple(v) for k, v in table.items()})
    if self.linked and (
      self.workers_per_node < 2 or self.workers % self.workers_per_node
    ):
      raise ValueError(
        f"wire keys with '@fast' / '@slow' need workers_per_node > 1 dividing "
        f"workers = {self.workers} (the nodes they were made for), got "
        f"workers_per_node={self.workers_per_node}"
      )

  @property
  def linked(self) -> bool:
    """Whether a wire key names a link class (``@fast`` / ``@slow``)."""
    return any(split_wire_key(k)[1] for k in self.wire_bytes)

  def check_cluster(self, cluster: Cluster) -> None:
    """Raises ``ValueError`` unless ``cluster`` has the nodes this profile was made for.

    A flat profile (no ``@fast`` / ``@slow`` key) fits any cluster. One with
    such keys prices rings of ``workers_per_node`` devices and of ``workers
    / workers_per_node`` nodes, so the cluster must have the same
    ``workers`` and ``workers_per_node``.
    """
    if not self.linked:
      return
    want = (self.workers, self.workers_per_node)
    got = (cluster.workers, cluster.workers_per_node)
    if want != got:
      raise ValueError(
        f"the profile of {self.compressor} was made for {self.workers} workers "
        f"in nodes of {self.workers_per_node} (workers_per_node="
        f"{self.workers_per_node}); the cluster has workers={cluster.workers}, "
        f"workers_per_node={cluster.workers_per_node}: describe the same nodes, or "
        f"make the profile for this cluster"
      )

  # -- the fitted model ------------------------------------------------------

  def comp_seconds(self, size, fused=False) -> np.ndarray:
    """``Comp(x)``: the piecewise-linear fit at ``size`` (arrays broadcast).

    Between measured sizes the time is interpolated linearly; below the
    smallest it is the smallest's; above the largest it grows with the slope
    of the last segment. Each curve is first made non-decreasing (a running
    maximum), so that timing noise cannot make a bigger buffer look cheaper.
    """
    size = np.asarray(size, np.float64)
    fused = np.broadcast_to(np.asarray(fused, bool), size.shape)
    return np.where(
      fused,
      _curve(self.sizes, self.fused_seconds)(size),
      _curve(self.sizes, self.seconds)(size),
    )

  def wire(self, size) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per wire key: (bytes, messages) one worker sends for ``size`` values.

    Bytes are interpolated linearly between the traced sizes (payloads are
    affine in the size between roundings) and extrapolated with the last
    slope; the message count is the one at the nearest traced size.
    """
    size = np.asarray(size, np.float64)
    grid = np.asarray(self.sizes, np.float64)
    nearest = np.abs(np.log(np.maximum(size, 1.0))[..., None] - np.log(grid)).argmin(-1)
    out = {}
    for kind, values in self.wire_bytes.items():
      messages = np.asarray(self.wire_messages[kind])[nearest]
      out[kind] = (_curve(self.sizes, values, monotone=False)(size), messages)
    return out

  # -- hierarchical ------------------------------------------------------------

  def hierarchical(self, g: int, *, scatter_dtype=None, gather: bool = True) -> Profile:
    """The profile of ``gradcomp.hierarchical(inner, fast_axis)``, from ``inner``'s.

    ``self`` is ``inner``'s flat profile, its wire traced on the ``n / g``
    nodes as its workers (``workers``). A group of ``x`` values is
    reduce-scattered inside each node of ``g`` devices, ``inner`` compresses
    and exchanges each device's shard of ``c = ceil(x / g)`` values across the
    nodes, and the shards are all-gathered inside the node again:

    * ``Comp(x) = inner.Comp(c)``: the reduce-scatter and the all-gather are
      collectives (no compute of the compressor); a fused group's
      concatenation is counted at the shard's size, as ``inner``'s fused
      curve measured it;
    * the wire: ``inner``'s kinds as ``"<kind>@slow"`` at ``c`` values, plus
      ``"reduce-scatter@fast"`` of ``g c`` values of ``scatter_dtype``
      (float32 by default) and, with ``gather``, ``"all-gather@fast"`` of
      ``c`` float32 values, one message each.

    The lifted profile is ``inner``'s tables on the sizes ``g s`` for
    ``inner``'s sizes ``s``, so its piecewise-linear curves at ``x`` are
    ``inner``'s at ``x / g``: exact at multiples of ``g``, and elsewhere
    short of the padding to ``g c`` (under ``g`` values, e.g. fewer than
    ``4 g`` bytes of the reduce-scatter's). Its ``workers`` are ``g`` times
    ``inner``'s and ``workers_per_node`` is ``g``, so
    :meth:`check_cluster` accepts only that cluster.

    Args:
      g: devices per node (the size of the fast axis), an integer >= 2.
      scatter_dtype: the reduce-scatter's payload type: ``None`` or float32,
        float16 or bfloat16 (as ``gradcomp.hierarchical`` takes it).
      gather: whether the result is all-gathered inside the node.

    Returns:
      A :class:`Profile` labelled ``"hierarchical(<inner label>, g=<g>,
      scatter_dtype=..., gather=...)"``.

    Raises:
      ValueError: a bad ``g``, ``scatter_dtype`` or ``gather``, or a profile
        that is not flat (already has ``@fast`` / ``@slow`` keys).

    Examples:
      Top-k 1 % as 8 bytes per kept value in one all-gather, traced on 16
      nodes, lifted to nodes of 8: 8,192 values are shards of 1,024 per
      device; inside the node 32 KiB are reduce-scattered and 4 KiB gathered.

      >>> inner = Profile(compressor="topk(error_feedback=True, ratio=0.01)",
      ...                 backend="synthetic", devices=1, sizes=(1024, 4096),
      ...                 seconds=(1e-4, 2e-4), fused_seconds=(1e-4, 2e-4),
      ...                 wire_bytes={"all-gather": (80, 320)},
      ...                 wire_messages={"all-gather": (1, 1)}, workers=16)
      >>> p = inner.hierarchical(8)
      >>> p.compressor
      'hierarchical(topk(error_feedback=True, ratio=0.01), g=8, scatter_dtype=None, gather=True)'
      >>> p.sizes, p.workers, p.workers_per_node
      ((8192, 32768), 128, 8)
      >>> {k: float(b) for k, (b, m) in p.wire(8192).items()}
      {'all-gather@slow': 80.0, 'reduce-scatter@fast': 32768.0, 'all-gather@fast': 4096.0}
      >>> float(p.comp_seconds(8192)) == float(inner.comp_seconds(1024))
      True
    """
    if isinstance(g, bool) or not isinstance(g, int | np.integer) or g < 2:
      raise ValueError(f"g (devices per node) must be an integer >= 2, got {g!r}")
    if not isinstance(gather, bool):
      raise ValueError(f"gather must be True or False, got {gather!r}")
    dtype = _scatter_dtype_name(scatter_dtype)
    if self.linked or self.workers_per_node != 1:
      raise ValueError(
        f"the profile of {self.compressor} already prices links inside and "
        f"across nodes (workers_per_node={self.workers_per_node}); lift a flat "
        "profile of the inner compressor"
      )
    g = int(g)
    scatter_bytes = 4 if dtype is None else jnp.dtype(dtype).itemsize
    wire_bytes = {f"{k}@slow": v for k, v in self.wire_bytes.items()}
    wire_messages = {f"{k}@slow": v for k, v in self.wire_messages.items()}
    wire_bytes["reduce-scatter@fast"] = tuple(g * s * scatter_bytes for s in self.sizes)
    wire_messages["reduce-scatter@fast"] = (1,) * len(self.sizes)
    if gather:
      wire_bytes["all-gather@fast"] = tuple(4 * s for s in self.sizes)
      wire_messages["all-gather@fast"] = (1,) * len(self.sizes)
    return dataclasses.replace(
      self,
      compressor=hierarchical_label(self.compressor, g, dtype, gather),
      sizes=tuple(g * s for s in self.sizes),
      wire_bytes=wire_bytes,
      wire_messages=wire_messages,
      workers=self.workers * g,
      workers_per_node=g,
    )

  # -- JSON --------------------------------------------------------------------

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> Profile:
    data = json.loads(text)
    fields = {f.name for f in dataclasses.fields(cls)}
    # A profile saved before ``workers`` was recorded was traced on 2; one
    # saved before ``workers_per_node``, flat (1).
    optional = {"workers", "workers_per_node"}
    if not isinstance(data, dict) or set(data) - optional != fields - optional:
      raise ValueError(f"a profile is a JSON object with the fields {sorted(fields)}")
    return cls(**data)

  def save(self, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def load(cls, path: str | os.PathLike) -> Profile:
    with open(path) as f:
      return cls.from_json(f.read())

  def check_for(self, tx_or_label) -> None:
    """Raises ``ValueError`` unless this profile was measured for ``tx_or_label``.

    A ``gradcomp.hierarchical`` transformation does not know its fast axis'
    size; it is labelled with this profile's ``workers_per_node`` (which
    :meth:`check_cluster` matches against the cluster).
    """
    label = (
      tx_or_label
      if isinstance(tx_or_label, str)
      else label_of(tx_or_label, self.workers_per_node)
    )
    if label != self.compressor:
      raise ValueError(
        f"the profile was measured for {self.compressor}, not for {label}"
      )


def _curve(sizes, values, monotone: bool = True):
  x = np.asarray(sizes, np.float64)
  y = np.asarray(values, np.float64)
  if monotone:
    y = np.maximum.accumulate(y)
  slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if len(x) > 1 else 0.0
  slope = max(slope, 0.0) if monotone else slope

  def at(size):
    inside = np.interp(size, x, y)
    return np.where(size > x[-1], y[-1] + slope * (size - x[-1]), inside)

  return at


def _scatter_dtype_name(scatter_dtype) -> str | None:
  """``None`` for float32 (or ``None``), else ``"float16"`` or ``"bfloat16"``."""
  try:
    name = None if scatter_dtype is None else jnp.dtype(scatter_dtype).name
  except TypeError:
    name = repr(scatter_dtype)
  if name not in (None, "float32", "float16", "bfloat16"):
    raise ValueError(
      f"scatter_dtype must be None, float32, float16 or bfloat16, got {scatter_dtype!r}"
    )
  return None if name == "float32" else name


def hierarchical_label(inner_label: str, g: int, scatter_dtype, gather: bool) -> str:
  """The label of ``hierarchical(inner, fast_axis, ...)`` on nodes of ``g`` devices.

  Examples:
    >>> hierarchical_label("topk(error_feedback=True, ratio=0.01)", 8, "bfloat16", True)
    "hierarchical(topk(error_feedback=True, ratio=0.01), g=8, scatter_dtype='bfloat16', gather=True)"
  """
  dtype = _scatter_dtype_name(scatter_dtype)
  return (
    f"hierarchical({inner_label}, g={int(g)}, scatter_dtype={dtype!r}, "
    f"gather={gather!r})"
  )


def label_of(tx: optax.GradientTransformation, workers_per_node: int = 1) -> str:
  """The label a profile of ``tx`` carries (``CompressorSpec.label``).

  ``gradcomp.hierarchical(inner, ...)`` is labelled by :func:`hierarchical_label`
  from ``inner``'s label and ``workers_per_node`` (its fast axis' size, which
  the transformation does not know).
  """
  spec = spec_lib.spec_of(tx)
  if spec is None:
    raise ValueError(
      "the transformation was not built by a gradcomp factory, so it cannot be "
      "profiled or matched to a profile; build it with gradcomp.<name>(...) or "
      "gradcomp.get(name, ...)"
    )
  if spec.factory.__module__ == _HIERARCHICAL_MODULE:
    # Read from its recorded arguments: ``gradcomp.fusion`` sits above ``sim``.
    args = dict(spec.arguments)
    return hierarchical_label(
      label_of(args["inner"]), workers_per_node, args["scatter_dtype"], args["gather"]
    )
  return spec.label()


#: Where ``gradcomp.hierarchical`` is defined (above this package's layer).
_HIERARCHICAL_MODULE = "gradcomp.fusion.hierarchical"
