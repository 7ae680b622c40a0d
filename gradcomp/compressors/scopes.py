"""What fusion may change: each compressor's unit of compression.

``gradcomp.layerfusion`` hands a compressor one buffer per group of leaves.
Whether that changes the algorithm depends on what the algorithm computes
from more than one coordinate:

* :data:`ELEMENT` -- nothing: every coordinate is compressed on its own
  (a cast, a fixed threshold or format, a sign vote). Fused equals layer-wise.
* :data:`LEAF` -- the published algorithm computes something per layer: a
  scale or a norm (TernGrad, EF-signSGD, the FP8/FP4 and integer scales,
  QSGD's and the block codecs' buckets, which must not straddle two layers),
  a selection budget (random-k, DGC, Strom's slots), a layer's own low-rank
  factors (PowerSGD) or its columns (1-bit SGD). On a fused buffer these
  become one per buffer, which is another algorithm.
* :data:`BUFFER` -- the group is the unit by design: the seed's fused top-k
  (one global selection across the group's layers) and Sketch-Fusion (one
  sketch of the fused gradient, paper 003).

:func:`scope_of` reads a compressor's declaration from :data:`DECLARED`, the
one table every registered name is in (tests/test_fusion_semantics.py checks
``gradcomp.names()`` against it); a compressor built with ``per_leaf=True``
is per leaf whatever its default. :func:`per_leaf_form` gives, for the per-leaf
codecs that have one, the transformation LayerFusion runs instead so that the
fused program keeps the per-leaf semantics.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import optax

from gradcomp.compressors import per_leaf_scales
from gradcomp.compressors.dgc_groups import dgc_per_leaf
from gradcomp.compressors.powersgd_groups import powersgd_per_leaf
from gradcomp.compressors.randomk_groups import randomk_per_leaf
from gradcomp.compressors.sparse_quantize_groups import sparse_quantize_per_leaf
from gradcomp.compressors.spec import spec_of
from gradcomp.compressors.topk_groups import topk_per_leaf

ELEMENT = "element"
LEAF = "leaf"
BUFFER = "buffer"
#: The three scopes, from the one fusion never changes to the one it defines.
SCOPES = (ELEMENT, LEAF, BUFFER)

#: Every registered compressor's scope, by factory name.
DECLARED = MappingProxyType(
  {
    "none": ELEMENT,  # dense mean
    "fp16": ELEMENT,  # a cast per value
    "signsgd": ELEMENT,  # a majority vote per coordinate
    "threshold_quantize": ELEMENT,  # a fixed threshold t
    "fixed_point": ELEMENT,  # a fixed <IL, FL> format
    "topk": BUFFER,  # the seed's fused top-k: one selection per group
    "sketch_topk": BUFFER,  # Sketch-Fusion: one sketch per group (paper 003)
    "powersgd": LEAF,  # each layer's own P, Q (Vogels et al. 2019)
    "randomk": LEAF,  # k = ratio * d per layer
    "dgc": LEAF,  # a sampled threshold and k per layer (Lin et al. 2018)
    "sparse_quantize": LEAF,  # slots per layer (Strom 2015)
    "qsgd": LEAF,  # norms per bucket of a layer (Alistarh et al. 2017 §5)
    "terngrad": LEAF,  # max |g| per layer (Wen et al. 2017)
    "ef_signsgd": LEAF,  # ||e||_1 / d per layer (Karimireddy et al. 2019)
    "onebit_sgd": LEAF,  # two means per column of a layer (Seide et al. 2014)
    "dynamic_fixed_point": LEAF,  # a shared exponent per layer or block
    "fp8": LEAF,  # a scale per layer or block
    "fp4": LEAF,  # a scale per layer or block
    "int_quantize": LEAF,  # a scale per block of a layer
    "qgz": LEAF,  # a scale per block of a layer
  }
)

#: Per-leaf codecs whose per-leaf form runs inside the fused program, built
#: from the compressor's own arguments.
_PER_LEAF_FORMS: dict[str, Callable[..., optax.GradientTransformation]] = {
  "powersgd": powersgd_per_leaf,
  "randomk": randomk_per_leaf,
  "dgc": dgc_per_leaf,
  "topk": topk_per_leaf,  # with per_leaf=True or chunk=C (LEAF by scope_of)
  "sparse_quantize": sparse_quantize_per_leaf,
  "ef_signsgd": per_leaf_scales.ef_signsgd_per_leaf,  # None when scattered
  "terngrad": per_leaf_scales.terngrad_per_leaf,
  "qsgd": per_leaf_scales.qsgd_per_leaf,
  "int_quantize": per_leaf_scales.int_quantize_per_leaf,
  "fp8": per_leaf_scales.fp8_per_leaf,
  "fp4": per_leaf_scales.fp4_per_leaf,
  "onebit_sgd": per_leaf_scales.onebit_sgd_per_leaf,
}


def scope_of(tx: optax.GradientTransformation) -> str | None:
  """``tx``'s scope (one of :data:`SCOPES`), or ``None`` if it declares none.

  A transformation gradcomp did not build, or a factory registered without a
  :data:`DECLARED` entry, declares none; LayerFusion then treats each buffer
  as one unit, as it always has.

  Examples:
    >>> import gradcomp
    >>> from gradcomp.compressors.scopes import scope_of
    >>> scope_of(gradcomp.fp16()), scope_of(gradcomp.powersgd()), scope_of(
    ...   gradcomp.sketch_topk(0.01))
    ('element', 'leaf', 'buffer')
  """
  spec = spec_of(tx)
  if spec is None:
    return None
  if dict(spec.arguments).get("per_leaf") is True:
    return LEAF
  if spec.name == "topk" and dict(spec.arguments).get("chunk") is not None:
    return LEAF  # SparseLoCo's tiles are cut from each leaf on its own
  return DECLARED.get(spec.name)


def per_leaf_form(
  tx: optax.GradientTransformation,
) -> optax.GradientTransformation | None:
  """The transformation that runs ``tx`` per leaf on groups of leaves, if any.

  It takes a tuple of groups, each a tuple of leaves, and treats every leaf
  as ``tx`` would treat it alone, while batching and exchanging a group at
  once (e.g. :func:`~gradcomp.compressors.powersgd_groups.powersgd_per_leaf`).
  ``None`` for a per-element or per-buffer compressor (fusing changes nothing,
  or is the algorithm) and for per-leaf ones without such a form yet.
  """
  spec = spec_of(tx)
  if spec is None or scope_of(tx) != LEAF or spec.name not in _PER_LEAF_FORMS:
    return None
  return _PER_LEAF_FORMS[spec.name](**dict(spec.arguments))
