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
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import optax

from gradcomp.compressors import spec as spec_lib
from gradcomp.parallel.wire import COLLECTIVES as KINDS

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
    wire_bytes: per collective kind, bytes one worker sends at each size.
    wire_messages: per collective kind, collectives issued at each size.
    workers: the workers the wire was traced on (a gathered payload's bytes
      do not depend on them; a reduce-scatter form's and qgZ's do).

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

  def __post_init__(self):
    if isinstance(self.workers, bool) or not isinstance(self.workers, int):
      raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
    if self.workers < 1:
      raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
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
    # A profile saved before ``workers`` was recorded was traced on 2.
    if not isinstance(data, dict) or set(data) - {"workers"} != fields - {"workers"}:
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
    label = tx_or_label if isinstance(tx_or_label, str) else label_of(tx_or_label)
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


def label_of(tx: optax.GradientTransformation) -> str:
  spec = spec_lib.spec_of(tx)
  if spec is None:
    raise ValueError(
      "the transformation was not built by a gradcomp factory, so it cannot be "
      "profiled or matched to a profile; build it with gradcomp.<name>(...) or "
      "gradcomp.get(name, ...)"
    )
  return spec.label()
