"""gradcomp: gradient compression for communication-efficient data-parallel JAX.

Every compressor is an ``optax.GradientTransformation`` whose ``update`` returns
the mean over workers (``axis_name``) of the decompressed gradients. See
DESIGN §1 and the README.
"""

from gradcomp._src.base import CompressorState as CompressorState
from gradcomp._src.base import LeafCodec as LeafCodec
from gradcomp._src.base import leafwise as leafwise
from gradcomp._src.cluster import Cluster as Cluster
from gradcomp._src.dense import fp16 as fp16
from gradcomp._src.dense import none as none
from gradcomp._src.dgc import dgc as dgc
from gradcomp._src.finite import apply_if_finite as apply_if_finite
from gradcomp._src.fusion_plan import Plan as Plan
from gradcomp._src.fusion_search import heuristic_search as heuristic_search
from gradcomp._src.fusion_search import optimal_search as optimal_search
from gradcomp._src.fusion_search import search_plan as search_plan
from gradcomp._src.gradient_order import gradient_order as gradient_order
from gradcomp._src.layerfusion import LayerFusionState as LayerFusionState
from gradcomp._src.layerfusion import auto_plan as auto_plan
from gradcomp._src.layerfusion import layerfusion as layerfusion
from gradcomp._src.memory import error_feedback as error_feedback
from gradcomp._src.powersgd import powersgd as powersgd
from gradcomp._src.profile import Profile as Profile
from gradcomp._src.profile import profile as profile
from gradcomp._src.profile import profile_for as profile_for
from gradcomp._src.quantizers import qsgd as qsgd
from gradcomp._src.quantizers import terngrad as terngrad
from gradcomp._src.randomk import randomk as randomk
from gradcomp._src.registry import get as get
from gradcomp._src.registry import names as names
from gradcomp._src.registry import register as register
from gradcomp._src.signs import ef_signsgd as ef_signsgd
from gradcomp._src.signs import signsgd as signsgd
from gradcomp._src.sketch_topk import sketch_topk as sketch_topk
from gradcomp._src.threshold import threshold_quantize as threshold_quantize
from gradcomp._src.timeline import CostModel as CostModel
from gradcomp._src.timeline import Timeline as Timeline
from gradcomp._src.timeline import Workload as Workload
from gradcomp._src.topk import topk as topk
from gradcomp._src.wire import wire_bytes as wire_bytes
from gradcomp._src.workers import add_worker_axis as add_worker_axis
from gradcomp._src.workers import drop_worker_axis as drop_worker_axis

__version__ = "0.1.0"
