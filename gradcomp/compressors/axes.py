"""Refusing an ``axis_name`` across which the params are different shards.

A compressor returns the mean over ``axis_name`` of its workers' decoded
gradients. On a mesh ``("data", "model")`` with the params sharded over
``"model"`` and replicated over ``"data"``, compressing over ``"data"`` gives
each device the mean of its own block's gradients (per-shard compression:
the top-k of each block of a block partition). Compressing over ``("data",
"model")`` would add the gradients of *different* blocks coordinate by
coordinate: a wrong answer, and JAX raises nothing (issue 32).
:func:`check_params` refuses it from the types JAX gives values inside
``shard_map``, their varying manual axes (``jax.typeof(x).manual_axis_type.
varying`` on JAX 0.10, ``.vma`` on earlier versions; read by
``branches.varying_axes``). :func:`checked` runs it in a transformation's
``init`` and, when ``params`` are given, in its ``update``. Every public
factory goes through it (``spec.recorded``), and ``layerfusion`` runs it on
the unfused params.

**The rule.** A leaf of ``params`` typed varying over any axis of
``axis_name`` is refused: the compressor would average values that differ
across that axis. The params a synchronous step passes are replicated over
the axes it averages over. The training schemes of ``gradcomp.schemes`` hand
their compressor values that differ between workers by design (CD-SGD's
message, local SGD's and Streaming DiLoCo's pseudo-gradients), and pass it no
params (no compressor reads them), so the rule does not see them. This
catches issue 32's ``axis_name=("data", "model")`` with the params sharded
over ``"model"``, and ``axis_name="model"`` alone. ``init`` is often given
per-worker gradients for their shapes (a state built inside ``shard_map``),
so there only a block of a partition is refused: a leaf varying over some
axes of ``axis_name`` and replicated over the others (issue 32's case; not
``"model"`` alone, which ``update`` catches).

Where nothing is typed the check does nothing: outside ``shard_map`` (one
device; ``pmap``, whose values carry no varying axes; ``init`` on global
arrays before the step), under ``shard_map(..., check_vma=False)``, for
``params=None``, and for an exchange ``Pattern`` (gossip's neighbours, a
server's pushes), which does not average over a group of axes.
"""

from __future__ import annotations

import weakref

import jax
import optax
from jax.sharding import NamedSharding

from gradcomp.compressors import exchange
from gradcomp.parallel import branches

#: The mesh axes each checked transformation averages over, filed by
#: :func:`record` under its ``update`` function (weakly, as ``spec.py`` does).
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_axes(axis_name: exchange.AxisName) -> tuple[str, ...]:
  """The mesh axes a compressor averages over: ``()`` for ``None`` or a pattern."""
  if axis_name is None or isinstance(axis_name, exchange.Pattern):
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def axis_size(axis: str, tree=None) -> int:
  """The size of mesh axis ``axis``: bound inside ``shard_map``, else from a mesh.

  Outside ``shard_map`` it is read from the mesh set by ``jax.set_mesh``, or
  from the ``NamedSharding`` of a leaf of ``tree`` (global arrays, tracers or
  ``jax.ShapeDtypeStruct`` placed on a mesh): what an ``init`` needs when its
  state is shaped by the mesh (a shard's residual).

  Raises:
    ValueError: none of these knows ``axis``.

  Examples:
    >>> import jax
    >>> from gradcomp.compressors import axes
    >>> with jax.set_mesh(jax.make_mesh((2, 4), ("node", "local"))):
    ...   axes.axis_size("local")
    4
  """
  try:
    return int(jax.lax.axis_size(axis))
  except NameError:
    pass
  mesh = jax.sharding.get_abstract_mesh()
  if axis in mesh.axis_names:
    return int(mesh.shape[axis])
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      sharding = leaf.sharding
    elif isinstance(leaf, jax.Array):  # also a tracer, whose type holds it
      sharding = jax.typeof(leaf).sharding
    else:
      continue
    if isinstance(sharding, NamedSharding) and axis in sharding.mesh.axis_names:
      return int(sharding.mesh.shape[axis])
  raise ValueError(
    f"the size of mesh axis {axis!r} is unknown here: call init inside "
    f"shard_map, under jax.set_mesh(mesh), or on params placed on a mesh "
    f"with that axis"
  )


def check_params(params, axis_name: exchange.AxisName, *, strict: bool = True) -> None:
  """Raises ``ValueError`` if ``params`` are different shards across ``axis_name``.

  Args:
    params: the params given to ``init`` or ``update`` (arrays, tracers or
      ``jax.ShapeDtypeStruct``), or ``None``.
    axis_name: the compressor's ``axis_name``.
    strict: refuse a leaf varying over any axis of ``axis_name`` (``update``'s
      params); ``False`` refuses only a block of a partition, a leaf varying
      over some axes of ``axis_name`` and replicated over others (``init``,
      which is also given per-worker gradients for their shapes: a state of
      per-worker residuals built inside ``shard_map``).

  Raises:
    ValueError: a leaf of ``params`` is typed varying over an axis of
      ``axis_name``; the message names the axis and the leaf.

  Examples:
    Outside ``shard_map`` nothing is typed, so nothing is refused:

    >>> import jax.numpy as jnp
    >>> from gradcomp.compressors import axes
    >>> axes.check_params({"w": jnp.ones(3)}, ("data", "model"))
  """
  group = group_axes(axis_name)
  if params is None or not group:
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
      continue  # NumPy arrays and Python scalars: not typed, replicated.
    varying = branches.varying_axes(leaf)
    differ = [a for a in group if a in varying]
    if differ and (strict or len(differ) < len(group)):
      a = differ[0]
      raise ValueError(
        f"axis_name includes {a!r}, but the params differ across {a!r} (they "
        f"vary over it inside shard_map; params{jax.tree_util.keystr(path)} "
        f"varies over {sorted(varying)}): a compressor averages across "
        f"axis_name, so it would mix different shards; compress over the axes "
        f"the params are replicated on"
      )


def checked(
  tx: optax.GradientTransformation,
  axis_name: exchange.AxisName,
  *,
  strict: bool = True,
) -> optax.GradientTransformation:
  """``tx`` with :func:`check_params` run in ``init`` and (params given) ``update``.

  The check is static Python on the types, run once per trace; ``tx`` is
  returned unchanged when ``axis_name`` names no mesh axis. The result's
  axes are filed for :func:`group_of`. ``strict=False`` applies ``init``'s
  weaker rule in ``update`` too (only shards of a partition are refused):
  for the optimizers, which may be given each worker's own params.
  """
  if not group_axes(axis_name):
    return tx

  def init_fn(params):
    check_params(params, axis_name, strict=False)
    return tx.init(params)

  def update_fn(updates, state, params=None):
    check_params(params, axis_name, strict=strict)
    return tx.update(updates, state, params)

  return record(optax.GradientTransformation(init_fn, update_fn), axis_name)


def record(
  tx: optax.GradientTransformation, axis_name: exchange.AxisName
) -> optax.GradientTransformation:
  """Files the mesh axes ``tx`` averages over, for :func:`group_of`; returns ``tx``.

  :func:`checked` files its ``axis_name``; a wrapper that checks its params
  another way (``hierarchical(..., gather=False)``, whose params are shards)
  files its group here.
  """
  group = group_axes(axis_name)
  if group:
    _GROUPS[tx.update] = group
  return tx


def group_of(tx: optax.GradientTransformation) -> tuple[str, ...]:
  """The mesh axes ``tx`` averages over, ``()`` if none is known.

  Every public factory's ``axis_name`` is filed (``spec.recorded`` runs
  :func:`checked`), ``layerfusion`` files its inner's and ``hierarchical``
  its inner's with its fast axis, so wrappers see through one another:
  ``hierarchical(layerfusion(topk(0.01, axis_name="node")), "local")``
  reads ``("node",)``.

  Examples:
    >>> import gradcomp
    >>> from gradcomp.compressors import axes
    >>> axes.group_of(gradcomp.topk(0.5, axis_name="node"))
    ('node',)
    >>> axes.group_of(gradcomp.layerfusion(gradcomp.none(("a", "b")), "single"))
    ('a', 'b')
    >>> axes.group_of(gradcomp.topk(0.5))  # one device: no axis
    ()
  """
  try:
    return _GROUPS.get(tx.update, ())
  except TypeError:  # an update that cannot be weakly referenced
    return ()
