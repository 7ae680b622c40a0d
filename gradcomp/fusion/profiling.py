"""Measuring compression profiles on this backend (paper 000 §3.2, §4.3).

``Comp`` must be measured on the backend, not assumed: on a CPU a call costs
little and fusing costs a concatenation and cache locality (PERFORMANCE_NOTES:
one top-k over 25.6M values takes longer than over its 161 tensors).
:func:`profile` therefore times the compressor at sizes ``2^4 .. 2^24`` both on
one buffer and on the same number of values fused from several leaves, and
counts the bytes and messages each collective sends by tracing it on an
abstract mesh; the result is a :class:`gradcomp.sim.profile.Profile`.
For ``gradcomp.hierarchical(inner, ...)``, :func:`profile_for` measures
``inner`` on the cluster's nodes and lifts its profile
(``Profile.hierarchical``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradcomp.compressors import registry, scopes
from gradcomp.compressors import spec as spec_lib
from gradcomp.fusion.fused import fused
from gradcomp.fusion.hierarchical import hierarchical_spec_of, shard_size
from gradcomp.fusion.plan import Plan
from gradcomp.parallel.traced import traced_wire
from gradcomp.parallel.workers import add_worker_axis, sharded_update
from gradcomp.sim.profile import (
  AUTO_SIZES,
  DEFAULT_SIZES,
  FUSED_PIECES,
  KINDS,
  Profile,
  label_of,
  validated_sizes,
)


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
  workers: int = 2,
  per_leaf: bool = True,
  **hyperparameters,
) -> Profile:
  """Measures ``Comp(x)`` of a compressor on this backend (paper 000 §4.3, eq. 7).

  For every size ``x`` the compressor (built with ``axis_name=None``, so the
  exchange is the identity and the payload still materialises) is jitted on a
  float32 buffer of ``x`` values, and on ``x`` values in
  :data:`FUSED_PIECES` leaves under ``layerfusion(..., "single")`` (in the
  per-leaf form ``layerfusion`` runs by default when the codec has one,
  ``scopes.per_leaf_form``: PowerSGD's factors per piece; with ``per_leaf=
  False``, the one-buffer form ``layerfusion(..., per_leaf=False)`` runs); each is
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
    workers: the workers the wire is traced on (>= 1). A gathered payload's
      bytes do not depend on them; a reduce-scatter form's (``exchange=
      "scatter"``, ``qgz``) do: pass the run's worker count.
    per_leaf: time the fused pieces in the codec's per-leaf form (when it
      has one), as ``layerfusion`` runs them by default; ``False``: in the
      seed's one-buffer form.
    **hyperparameters: the factory's arguments when ``compressor`` is a name.

  Returns:
    A :class:`Profile`.

  Raises:
    ValueError: for bad sizes, ``devices`` or ``repeats``, an unknown name, a
      transformation not built by a gradcomp factory, or a
      ``gradcomp.hierarchical`` one (see :func:`profile_for`).

  Examples:
    signSGD sends one bit per value: 64 values are 8 bytes, all-gathered in
    one message. The times (``seconds``, ``fused_seconds``) are this
    machine's.

    >>> import gradcomp
    >>> p = gradcomp.fusion.profile("signsgd", (64,), repeats=1)
    >>> p.compressor, p.sizes, len(p.seconds), len(p.fused_seconds)
    ("signsgd(exchange='gather')", (64,), 1, 1)
    >>> p.wire_bytes, p.wire_messages
    ({'all-gather': (8,)}, {'all-gather': (1,)})
  """
  sizes = validated_sizes(sizes)
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
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
  if isinstance(compressor, str):
    tx = registry.get(compressor, **hyperparameters)
  elif hyperparameters:
    raise ValueError("hyper-parameters go with a compressor name, not a transformation")
  else:
    tx = compressor
  label_of(tx)  # raises for a transformation gradcomp did not build
  if hierarchical_spec_of(tx) is not None:
    raise ValueError(
      "profile measures one compressor; for hierarchical(inner, ...) use "
      "profile_for(tx, workers=..., workers_per_node=...), or lift inner's "
      "profile: profile(inner, workers=nodes).hierarchical(g)"
    )
  spec = spec_lib.spec_of(tx)
  local = spec.build(axis_name=None)
  seconds, fused_seconds = [], []
  for size in sizes:
    leaf = jnp.zeros((size,), jnp.float32) + jnp.linspace(-1.0, 1.0, size)
    seconds.append(_time_update(local, [leaf], devices, repeats))
    pieces = [leaf[:n] * (i + 1) for i, n in enumerate(_pieces(size, FUSED_PIECES))]
    # The form layerfusion runs: per leaf when the codec has one, unless not.
    leaf_form = scopes.per_leaf_form(local) if per_leaf else None
    single = fused(local, Plan.single(range(len(pieces))), per_leaf=leaf_form)
    fused_seconds.append(_time_update(single, pieces, devices, repeats))
  wire_bytes = {k: [] for k in KINDS}
  wire_messages = {k: [] for k in KINDS}
  for size in sizes:
    traced = traced_wire(lambda axis: spec.build(axis_name=axis), size, workers)
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
    fused_seconds=tuple(fused_seconds),
    wire_bytes={k: tuple(wire_bytes[k]) for k in used},
    wire_messages={k: tuple(wire_messages[k]) for k in used},
    workers=workers,
  )


_PROFILES: dict[tuple[str, tuple[int, ...], int, bool], Profile] = {}


def profile_for(
  tx: optax.GradientTransformation,
  sizes=AUTO_SIZES,
  up_to: int | None = None,
  workers: int = 2,
  workers_per_node: int = 1,
  per_leaf: bool = True,
) -> Profile:
  """:func:`profile` of ``tx`` on one device, measured once per process and sizes.

  With ``up_to``, only the sizes up to the first one that reaches ``up_to``
  are timed (a small model need not be timed at 2^24 values). ``workers``:
  the run's, which a reduce-scatter form's wire depends on.

  For ``gradcomp.hierarchical(inner, fast_axis, ...)``, ``inner`` is profiled
  on ``workers // workers_per_node`` workers (the nodes it exchanges across)
  at ``sizes`` (now the shard sizes; ``up_to`` is divided by
  ``workers_per_node`` too) and lifted with ``Profile.hierarchical`` to
  groups of ``workers_per_node`` times those sizes. Any other ``tx``
  exchanges over all ``workers`` on one flat axis: ``workers_per_node`` is
  ignored. ``per_leaf``: :func:`profile`'s (the fused form timed).

  Raises:
    ValueError: a transformation gradcomp did not build, bad ``sizes``, or
      for a hierarchical ``tx`` a ``workers_per_node`` that is not an integer
      > 1 dividing ``workers``.

  Examples:
    Only 64 values are timed (the first size reaching 50), and a second call
    returns the profile measured by the first.

    >>> import gradcomp
    >>> p = profile_for(gradcomp.signsgd(), (64, 4096, 2**20), up_to=50)
    >>> p.compressor, p.sizes, p.wire_bytes
    ("signsgd(exchange='gather')", (64,), {'all-gather': (8,)})
    >>> profile_for(gradcomp.signsgd(), (64, 4096, 2**20), up_to=64) is p
    True

    signSGD inside ``hierarchical`` on 4 nodes of 8: shards of 64 values
    (512 per group), 8 bytes of signs gathered across the nodes.

    >>> tx = gradcomp.hierarchical(gradcomp.signsgd(axis_name="node"), "local")
    >>> h = profile_for(tx, (64,), workers=32, workers_per_node=8)
    >>> h.sizes, h.workers, h.wire_bytes["all-gather@slow"]
    ((512,), 32, (8,))
  """
  sizes = validated_sizes(sizes)
  hier = hierarchical_spec_of(tx)
  if hier is not None:
    if (
      isinstance(workers_per_node, bool)
      or not isinstance(workers_per_node, int)
      or workers_per_node < 2
      or isinstance(workers, bool)
      or not isinstance(workers, int)
      or workers % workers_per_node
    ):
      raise ValueError(
        f"a hierarchical compressor exchanges inside nodes and across them: "
        f"workers_per_node must be an integer > 1 dividing workers = {workers!r}, "
        f"got workers_per_node={workers_per_node!r}"
      )
    g = workers_per_node
    inner = profile_for(
      hier.inner,
      sizes,
      None if up_to is None else shard_size(up_to, g),
      workers // g,
      per_leaf=per_leaf,
    )
    return inner.hierarchical(g, scatter_dtype=hier.scatter_dtype, gather=hier.gather)
  if up_to is not None:
    reach = next((s for s in sizes if s >= up_to), sizes[-1])
    sizes = tuple(s for s in sizes if s <= reach)
  key = (label_of(tx), sizes, workers, per_leaf)
  if key not in _PROFILES:
    _PROFILES[key] = profile(tx, sizes, workers=workers, per_leaf=per_leaf)
  return _PROFILES[key]
