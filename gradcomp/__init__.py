"""gradcomp: gradient compression for communication-efficient data-parallel JAX.

Every compressor is an ``optax.GradientTransformation`` whose ``update`` returns
the mean over workers (``axis_name``) of the decompressed gradients. See
DESIGN §1 and the README.
"""

from gradcomp.compressors.base import CompressorState as CompressorState
from gradcomp.compressors.base import LeafCodec as LeafCodec
from gradcomp.compressors.base import leafwise as leafwise
from gradcomp.compressors.dense import fp16 as fp16
from gradcomp.compressors.dense import none as none
from gradcomp.compressors.dgc import dgc as dgc
from gradcomp.compressors.finite import apply_if_finite as apply_if_finite
from gradcomp.compressors.fixed_point import (
  DynamicFixedPointState as DynamicFixedPointState,
)
from gradcomp.compressors.fixed_point import dynamic_fixed_point as dynamic_fixed_point
from gradcomp.compressors.fixed_point import fixed_point as fixed_point
from gradcomp.compressors.memory import error_feedback as error_feedback
from gradcomp.compressors.onebit import onebit_sgd as onebit_sgd
from gradcomp.compressors.powersgd import powersgd as powersgd
from gradcomp.compressors.quantizers import qsgd as qsgd
from gradcomp.compressors.quantizers import terngrad as terngrad
from gradcomp.compressors.randomk import randomk as randomk
from gradcomp.compressors.registry import get as get
from gradcomp.compressors.registry import names as names
from gradcomp.compressors.registry import register as register
from gradcomp.compressors.signs import ef_signsgd as ef_signsgd
from gradcomp.compressors.signs import signsgd as signsgd
from gradcomp.compressors.sketch_topk import sketch_topk as sketch_topk
from gradcomp.compressors.sparse_quantize import sparse_quantize as sparse_quantize
from gradcomp.compressors.threshold import threshold_quantize as threshold_quantize
from gradcomp.compressors.topk import topk as topk
from gradcomp.fusion.fused import LayerFusionState as LayerFusionState
from gradcomp.fusion.gradient_order import gradient_order as gradient_order
from gradcomp.fusion.layerfusion import auto_plan as auto_plan
from gradcomp.fusion.layerfusion import layerfusion as layerfusion
from gradcomp.fusion.plan import Plan as Plan
from gradcomp.fusion.profiling import profile as profile
from gradcomp.fusion.profiling import profile_for as profile_for
from gradcomp.fusion.search import heuristic_search as heuristic_search
from gradcomp.fusion.search import optimal_search as optimal_search
from gradcomp.fusion.search import search_plan as search_plan
from gradcomp.parallel.topology import Topology as Topology
from gradcomp.parallel.topology import complete as complete
from gradcomp.parallel.topology import exponential as exponential
from gradcomp.parallel.topology import get as get_topology  # noqa: F401 (get: the registry)
from gradcomp.parallel.topology import one_peer_exponential as one_peer_exponential
from gradcomp.parallel.topology import ring as ring
from gradcomp.parallel.topology import torus as torus
from gradcomp.parallel.wire import wire_bytes as wire_bytes
from gradcomp.parallel.workers import add_worker_axis as add_worker_axis
from gradcomp.parallel.workers import drop_worker_axis as drop_worker_axis
from gradcomp.schemes.async_ps import AsyncPSState as AsyncPSState
from gradcomp.schemes.async_ps import async_ps as async_ps
from gradcomp.schemes.backup import BackupState as BackupState
from gradcomp.schemes.backup import backup_workers as backup_workers
from gradcomp.schemes.cdsgd import CDSGDState as CDSGDState
from gradcomp.schemes.cdsgd import cdsgd as cdsgd
from gradcomp.schemes.easgd import EASGDState as EASGDState
from gradcomp.schemes.easgd import easgd as easgd
from gradcomp.schemes.gosgd import GoSGDState as GoSGDState
from gradcomp.schemes.gosgd import gosgd as gosgd
from gradcomp.schemes.gossip import GossipState as GossipState
from gradcomp.schemes.gossip import gossip as gossip
from gradcomp.schemes.local_sgd import LocalSGDState as LocalSGDState
from gradcomp.schemes.local_sgd import local_sgd as local_sgd
from gradcomp.schemes.stale import StaleState as StaleState
from gradcomp.schemes.stale import stale_sgd as stale_sgd
from gradcomp.sim.clock import SimClock as SimClock
from gradcomp.sim.clock import forward_flops_per_sample as forward_flops_per_sample
from gradcomp.sim.clock import local_sgd_round_seconds as local_sgd_round_seconds
from gradcomp.sim.clock import simulate_rounds as simulate_rounds
from gradcomp.sim.clock import synchronous_step_seconds as synchronous_step_seconds
from gradcomp.sim.clock import training_flops as training_flops
from gradcomp.sim.cluster import Cluster as Cluster
from gradcomp.sim.cluster import Failure as Failure
from gradcomp.sim.cluster import Slowdown as Slowdown
from gradcomp.sim.collectives import allreduce_table as allreduce_table
from gradcomp.sim.collectives import best_allreduce as best_allreduce
from gradcomp.sim.delayed import delayed_exchange as delayed_exchange
from gradcomp.sim.delayed import method_step_seconds as method_step_seconds
from gradcomp.sim.delayed import saving_over_bitsgd as saving_over_bitsgd
from gradcomp.sim.delayed import saving_over_local_update as saving_over_local_update
from gradcomp.sim.delayed import simulate_delayed as simulate_delayed
from gradcomp.sim.delayed import steady_step_seconds as steady_step_seconds
from gradcomp.sim.epochs import EpochTimes as EpochTimes
from gradcomp.sim.epochs import simulate_masked_epoch as simulate_masked_epoch
from gradcomp.sim.gossip import gossip_step_seconds as gossip_step_seconds
from gradcomp.sim.gossip import gossip_worker_seconds as gossip_worker_seconds
from gradcomp.sim.gossip import simulate_gossip as simulate_gossip
from gradcomp.sim.profile import Profile as Profile
from gradcomp.sim.timeline import CostModel as CostModel
from gradcomp.sim.timeline import Timeline as Timeline
from gradcomp.sim.timeline import Workload as Workload

__version__ = "0.1.0"
