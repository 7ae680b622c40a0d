"""Described clusters, measured cost profiles, the cost model, the timeline simulator and the simulated clock.

Paper 000 §4.3 (eq. 7) and ``cluster`` describes workers (speeds,
slowdowns, failures) and links; ``clock`` advances simulated time on such a
cluster step by step, for the training program; ``gossip`` prices
decentralized steps, where each worker waits only for its neighbours;
``epochs`` prices an epoch whose workers process different amounts of data
(paper 002's balanced shares). Shared
by LayerFusion, the schemes, the training program and the benchmarks; imports
compressors (for a profile's label), models (for a model's workload and FLOPs)
and parallel (gossip topologies), never fusion, schemes or bench.
"""

from gradcomp.sim.clock import SimClock as SimClock
from gradcomp.sim.clock import forward_flops_per_sample as forward_flops_per_sample
from gradcomp.sim.clock import local_sgd_round_seconds as local_sgd_round_seconds
from gradcomp.sim.clock import simulate_overlapped_rounds as simulate_overlapped_rounds
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
