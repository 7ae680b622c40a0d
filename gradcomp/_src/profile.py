"""Measured compression profiles: ``Comp(x)`` and the wire payload of a compressor.

Paper 000 §3.2 (Fig. 1b): the cost of one compression call hardly grows from
2^4 to 2^20 values on a GPU, so layer-wise compression pays a fixed overhead
per tensor; §4.3, eq. 7: LayerFusion minimises ``sum Comp(x_i) + sum
Comm(x_i) + beta - sum p(x_i)``. ``Comp`` must be measured on the backend,
not assumed: on a CPU a call costs little and fusing costs a concatenation
and cache locality (PERFORMANCE_NOTES: one top-k over 25.6M values takes
longer than over its 161 tensors). :func:`profile` therefore times the
compressor at sizes ``2^4 .. 2^24`` both on one buffer and on the same number
of values fused from several leaves by :func:`~gradcomp.layerfusion`, and a
:class:`Profile` interpolates the two piecewise-linear curves. It also counts,
by tracing the compressor on an abstract mesh, the bytes and messages each
collective sends per worker, from which ``cluster.py`` prices ``Comm(x)``.
Profiles are JSON, so a plan can be made for a cluster one is not on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomp._src import spec as spec_lib
from gradcomp._src.fusion_plan import Plan
from gradcomp._src.workers import add_worker_axis, sharded_update

#: Sizes timed by default: 2^4, 2^6, ..., 2^24 values (paper 000 Fig. 1b's range).
DEFAULT_SIZES = tuple(2**p for p in range(4, 25, 2))
#: Sizes timed when ``layerfusion(plan="auto")`` measures a profile itself.
AUTO_SIZES = tuple(2**p for p in range(4, 25, 4))
#: Leaves fused into one buffer for the fused curve.
FUSED_PIECES = 4
#: Collective kinds, named as in the HLO (``wire.py``).
KINDS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "collective-permute",
  "all-to-all",
)

_PRIMITIVE_KINDS = {
  "psum": "all-reduce",
  "psum_invariant": "all-reduce",
  "pmax": "all-reduce",
  "pmin": "all-reduce",
  "all_gather": "all-gather",
  "all_gather_invariant": "all-gather",
  "reduce_scatter": "reduce-scatter",
  "ppermute": "collective-permute",
  "all_to_all": "all-to-all",
}
_TRACE_AXIS = "gradcomp_profile"
_TRACE_WORKERS = 2


def _validated_sizes(sizes) -> tuple[int, ...]:
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
    wire_bytes: per collective kind, bytes one worker sends at each size.
    wire_messages: per collective kind, collectives issued at each size.
  """

  compressor: str
  backend: str
  devices: int
  sizes: tuple[int, ...]
  seconds: tuple[float, ...]
  fused_seconds: tuple[float, ...]
  wire_bytes: dict[str, tuple[float, ...]]
  wire_messages: dict[str, tuple[int, ...]]

  def __post_init__(self):
    sizes = _validated_sizes(self.sizes)
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
      unknown = set(table) - set(KINDS)
      if unknown:
        raise ValueError(f"{field}: unknown collective kinds {sorted(unknown)}")
      for kind, values in table.items():
        if len(values) != len(sizes):
          raise ValueError(f"{field}[{kind!r}] needs one value per size")
      object.__setattr__(self, field, {k: tuple(v) for k, v in table.items()})

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
    """Per collective kind: (bytes, messages) one worker sends for ``size`` values.

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

  # -- JSON --------------------------------------------------------------------

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> Profile:
    data = json.loads(text)
    fields = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, dict) or set(data) != fields:
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
    """Raises ``ValueError`` unless this profile was measured for ``tx_or_label``."""
    label = tx_or_label if isinstance(tx_or_label, str) else _label_of(tx_or_label)
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


def _label_of(tx: optax.GradientTransformation) -> str:
  spec = spec_lib.spec_of(tx)
  if spec is None:
    raise ValueError(
      "the transformation was not built by a gradcomp factory, so it cannot be "
      "profiled or matched to a profile; build it with gradcomp.<name>(...) or "
      "gradcomp.get(name, ...)"
    )
  return spec.label()


# -- wire payloads, from the traced program ------------------------------------


def _collectives(jaxpr, totals: dict[str, list], scale: int = 1) -> None:
  """Adds the operand bytes and message count of every collective in ``jaxpr``."""
  for eqn in jaxpr.eqns:
    kind = _PRIMITIVE_KINDS.get(eqn.primitive.name)
    if kind is not None:
      nbytes = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
      totals[kind][0] += scale * nbytes
      totals[kind][1] += scale
    inner_scale = scale * int(eqn.params.get("length", 1))
    for name, value in eqn.params.items():
      branches = value if isinstance(value, tuple | list) else (value,)
      subs = [getattr(b, "jaxpr", b) for b in branches]
      subs = [s for s in subs if hasattr(s, "eqns")]
      if not subs:
        continue
      if name == "branches":  # lax.cond: one branch runs; count the largest.
        options = []
        for s in subs:
          part = {k: [0, 0] for k in KINDS}
          _collectives(s, part, inner_scale)
          options.append(part)
        best = max(options, key=lambda p: sum(v[0] for v in p.values()))
        for k in KINDS:
          totals[k][0] += best[k][0]
          totals[k][1] += best[k][1]
      else:
        for s in subs:
          _collectives(s, totals, inner_scale)


def traced_collectives(tx, tree, axis_name: str, workers: int):
  """``{kind: (bytes, messages)}`` one worker sends updating gradients ``tree``.

  ``tx`` exchanges over ``axis_name``; ``tree`` holds arrays or
  ``jax.ShapeDtypeStruct``. The update is traced (not compiled or run) under
  ``shard_map`` on an abstract mesh of ``workers``, so this needs no
  devices. Counting from the program catches indices, padding and second
  rounds; ``wire.wire_bytes`` reads the same from the compiled HLO.
  """
  mesh = AbstractMesh((workers,), (axis_name,))
  state = jax.eval_shape(lambda: add_worker_axis(tx.init(tree), workers))
  grads = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((workers, *x.shape), x.dtype), tree
  )
  f = sharded_update(tx, mesh, axis_name)
  totals = {k: [0, 0] for k in KINDS}
  _collectives(jax.make_jaxpr(f)(grads, state).jaxpr, totals)
  return {k: (b, m) for k, (b, m) in totals.items() if m}


def traced_wire(tx_for_axis, size: int) -> dict[str, tuple[int, int]]:
  """:func:`traced_collectives` of one float32 buffer of ``size`` values.

  ``tx_for_axis(axis_name)`` builds the compressor exchanging over
  ``axis_name``; it is traced on two workers.
  """
  leaf = jax.ShapeDtypeStruct((size,), jnp.float32)
  return traced_collectives(
    tx_for_axis(_TRACE_AXIS), (leaf,), _TRACE_AXIS, _TRACE_WORKERS
  )


# -- timing ------------------------------------------------------------------


def steady_state_seconds(fn, state, *args, repeats: int) -> float:
  """Median of ``repeats`` calls of ``fn(*args, state)``, after a warm-up.

  ``fn`` returns a tuple whose last entry is the next ``state`` (donated and
  fed back, as in a training step).
  """
  out = fn(*args, state)
  jax.block_until_ready(out)
  state = out[-1]
  times = []
  for _ in range(repeats + 1):
    t0 = time.perf_counter()
    out = fn(*args, state)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
    state = out[-1]
  return statistics.median(times[1:])


def _time_update(tx, leaves: list, devices: int, repeats: int) -> float:
  """Seconds per ``tx.update`` of ``leaves`` on ``devices`` workers at once.

  The state is donated and fed back, as in a training step. With several
  devices each runs its own copy (no exchange): the time one worker's
  compression takes while ``devices`` workers share this host.
  """
  if devices == 1:
    state = tx.init(leaves)
    fn = jax.jit(lambda g, s: tx.update(g, s), donate_argnums=1)
    return steady_state_seconds(fn, state, leaves, repeats=repeats)
  mesh = jax.make_mesh((devices,), ("devices",))
  sharding = NamedSharding(mesh, P("devices"))
  grads = jax.device_put(add_worker_axis(leaves, devices), sharding)
  state = jax.device_put(add_worker_axis(tx.init(leaves), devices), sharding)
  fn = jax.jit(sharded_update(tx, mesh, "devices"), donate_argnums=1)
  return steady_state_seconds(fn, state, grads, repeats=repeats)


def _pieces(size: int, count: int) -> list[int]:
  count = min(count, size)
  return [size // count + (1 if i < size % count else 0) for i in range(count)]


def backend_name(devices: int = 1) -> str:
  """``"cpu (8 devices)"``: the platform and device kind the profile ran on."""
  device = jax.devices()[0]
  kind = device.device_kind
  name = (
    device.platform if kind.lower() == device.platform else f"{device.platform} {kind}"
  )
  return f"{name} ({devices} device{'s' if devices > 1 else ''})"


def profile(
  compressor: str | optax.GradientTransformation,
  sizes: Sequence[int] = DEFAULT_SIZES,
  *,
  devices: int = 1,
  repeats: int = 5,
  **hyperparameters,
) -> Profile:
  """Measures ``Comp(x)`` of a compressor on this backend (paper 000 §4.3, eq. 7).

  For every size ``x`` the compressor (built with ``axis_name=None``, so the
  exchange is the identity and the payload still materialises) is jitted on a
  float32 buffer of ``x`` values, and on ``x`` values in
  :data:`FUSED_PIECES` leaves under ``layerfusion(..., "single")``; each is
  timed as the median of ``repeats`` steady-state calls with the state donated.
  The wire payload per size comes from tracing the compressor on an abstract
  mesh (:func:`traced_wire`).

  Args:
    compressor: a transformation built by a gradcomp factory (its
      ``axis_name`` is ignored), or a registered name with its
      ``hyperparameters`` as keyword arguments.
    sizes: increasing buffer sizes; default 2^4, 2^6, ..., 2^24.
    devices: how many local devices compress at once (each its own buffer);
      use the number of virtual devices that share this host to price a step
      on them.
    repeats: timed calls per size.
    **hyperparameters: the factory's arguments when ``compressor`` is a name.

  Returns:
    A :class:`Profile`.

  Raises:
    ValueError: for bad sizes, ``devices`` or ``repeats``, an unknown name, or
      a transformation not built by a gradcomp factory.
  """
  from gradcomp._src import registry  # registry imports the factories
  from gradcomp._src.layerfusion import layerfusion

  sizes = _validated_sizes(sizes)
  if (
    isinstance(devices, bool)
    or not isinstance(devices, int)
    or not 1 <= devices <= len(jax.devices())
  ):
    raise ValueError(
      f"devices must be in [1, {len(jax.devices())}] (the local devices), got {devices!r}"
    )
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
  if isinstance(compressor, str):
    tx = registry.get(compressor, **hyperparameters)
  elif hyperparameters:
    raise ValueError("hyper-parameters go with a compressor name, not a transformation")
  else:
    tx = compressor
  _label_of(tx)  # raises for a transformation gradcomp did not build
  spec = spec_lib.spec_of(tx)
  local = spec.build(axis_name=None)
  seconds, fused = [], []
  for size in sizes:
    leaf = jnp.zeros((size,), jnp.float32) + jnp.linspace(-1.0, 1.0, size)
    seconds.append(_time_update(local, [leaf], devices, repeats))
    pieces = [leaf[:n] * (i + 1) for i, n in enumerate(_pieces(size, FUSED_PIECES))]
    single = layerfusion(local, Plan.single(range(len(pieces))))
    fused.append(_time_update(single, pieces, devices, repeats))
  wire_bytes = {k: [] for k in KINDS}
  wire_messages = {k: [] for k in KINDS}
  for size in sizes:
    traced = traced_wire(lambda axis: spec.build(axis_name=axis), size)
    for k in KINDS:
      b, m = traced.get(k, (0, 0))
      wire_bytes[k].append(b)
      wire_messages[k].append(m)
  used = [k for k in KINDS if any(wire_messages[k])]
  return Profile(
    compressor=spec.label(),
    backend=backend_name(devices),
    devices=devices,
    sizes=sizes,
    seconds=tuple(seconds),
    fused_seconds=tuple(fused),
    wire_bytes={k: tuple(wire_bytes[k]) for k in used},
    wire_messages={k: tuple(wire_messages[k]) for k in used},
  )


_PROFILES: dict[tuple[str, tuple[int, ...]], Profile] = {}


def profile_for(
  tx: optax.GradientTransformation, sizes=AUTO_SIZES, up_to: int | None = None
) -> Profile:
  """:func:`profile` of ``tx`` on one device, measured once per process and sizes.

  With ``up_to``, only the sizes up to the first one that reaches ``up_to``
  are timed (a small model need not be timed at 2^24 values).
  """
  sizes = _validated_sizes(sizes)
  if up_to is not None:
    reach = next((s for s in sizes if s >= up_to), sizes[-1])
    sizes = tuple(s for s in sizes if s <= reach)
  key = (_label_of(tx), sizes)
  if key not in _PROFILES:
    _PROFILES[key] = profile(tx, key[1])
  return _PROFILES[key]
