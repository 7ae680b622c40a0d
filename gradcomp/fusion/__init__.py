"""LayerFusion's planner (paper 000 §4): gradient order, profiles and the searches.

:func:`gradcomp.layerfusion` and :class:`gradcomp.Plan` are what a training
script uses; this package holds what they are built from, for reading a plan
or making one by hand:

* :func:`gradient_order` -- the leaves in the order backprop produces their
  gradients (§4.1, Algorithm 2).
* :func:`profile` and :func:`profile_for` -- a compressor's measured cost on
  this backend (a :class:`gradcomp.sim.Profile`).
* :func:`heuristic_search`, :func:`optimal_search`, :func:`search_plan` and
  :func:`auto_plan` -- plans that minimise eq. 7 under a
  :class:`gradcomp.sim.CostModel` (§4.3).
* :func:`in_forms` and :data:`FORMS` -- a codec in each of its exchange
  forms, for plans whose groups are gathered or reduce-scattered
  (:attr:`gradcomp.Plan.forms`, ``layerfusion(..., exchange="auto")``).
* :func:`shard` and :func:`unshard` -- the per-device shards of
  ``gradcomp.hierarchical(..., gather=False)`` (ZeRO's layout), and back.

``python -m gradcomp.fusion`` compares plans for a built-in model on a described
cluster (:mod:`gradcomp.fusion.cli`). Imports compressors, parallel and sim.
"""

from gradcomp.fusion.fused import LayerFusionState as LayerFusionState
from gradcomp.fusion.hierarchical import HierarchicalState as HierarchicalState
from gradcomp.fusion.hierarchical import shard as shard
from gradcomp.fusion.hierarchical import unshard as unshard
from gradcomp.fusion.layerfusion import auto_plan as auto_plan
from gradcomp.fusion.layerfusion import in_forms as in_forms
from gradcomp.fusion.order import gradient_order as gradient_order
from gradcomp.fusion.plan import FORMS as FORMS
from gradcomp.fusion.profiling import profile as profile
from gradcomp.fusion.profiling import profile_for as profile_for
from gradcomp.fusion.search import heuristic_search as heuristic_search
from gradcomp.fusion.search import optimal_search as optimal_search
from gradcomp.fusion.search import search_plan as search_plan
