"""EdgeGossip's components (paper 002, Han et al., TPDS 2021), each usable alone.

* :mod:`~gradcomp.edgegossip.reduction` and
  :mod:`~gradcomp.edgegossip.aggregator` -- the input data aggregator (§3.2,
  Eq. 1, Table 3): per worker, reduce features, divide the data into
  single-class subsets of about ``ratio`` samples, average each subset over
  the original features; the three methods of §4.2 and their stage timings
  (§4.3).
* :mod:`~gradcomp.edgegossip.predictor` -- the performance predictor (§3.3):
  ``t = t0 * RG(U)`` with ``U`` read from the OS by ``psutil``, a platform's
  rate summed over its executors, and a co-runner of known intensity.
* :mod:`~gradcomp.edgegossip.balancer` -- the Gossip training balancer
  (Algorithm 1): ``r_i = T_min / T_i``, failure detection, halting.
* :mod:`~gradcomp.edgegossip.ordering` -- the accuracy-aware trainer's data
  choice (Algorithm 2): subsets by descending loss, whole subsets until ``r_i
  |X_i|`` samples, as fixed-shape masked batches for an SPMD step.

Pure NumPy, scikit-learn and psutil: no JAX here. The readings of what the
paper leaves open are in each module's docstring.
"""

from gradcomp.edgegossip.aggregator import METHODS as METHODS
from gradcomp.edgegossip.aggregator import Aggregation as Aggregation
from gradcomp.edgegossip.aggregator import StageTimes as StageTimes
from gradcomp.edgegossip.aggregator import aggregate as aggregate
from gradcomp.edgegossip.aggregator import average_subsets as average_subsets
from gradcomp.edgegossip.aggregator import divide as divide
from gradcomp.edgegossip.aggregator import kmeans_divide as kmeans_divide
from gradcomp.edgegossip.aggregator import lsh_divide as lsh_divide
from gradcomp.edgegossip.aggregator import reduce_features as reduce_features
from gradcomp.edgegossip.aggregator import subsets_per_class as subsets_per_class
from gradcomp.edgegossip.aggregator import time_aggregation as time_aggregation
from gradcomp.edgegossip.balancer import Balance as Balance
from gradcomp.edgegossip.balancer import BalancerHalted as BalancerHalted
from gradcomp.edgegossip.balancer import balance as balance
from gradcomp.edgegossip.ordering import EpochPlan as EpochPlan
from gradcomp.edgegossip.ordering import plan_epoch as plan_epoch
from gradcomp.edgegossip.ordering import random_ranking as random_ranking
from gradcomp.edgegossip.ordering import rank_subsets as rank_subsets
from gradcomp.edgegossip.ordering import select_subsets as select_subsets
from gradcomp.edgegossip.ordering import stack_plans as stack_plans
from gradcomp.edgegossip.ordering import subset_losses as subset_losses
from gradcomp.edgegossip.predictor import CoRunner as CoRunner
from gradcomp.edgegossip.predictor import Predictor as Predictor
from gradcomp.edgegossip.predictor import Usage as Usage
from gradcomp.edgegossip.predictor import co_runner as co_runner
from gradcomp.edgegossip.predictor import platform_rate as platform_rate
from gradcomp.edgegossip.predictor import sample_usage as sample_usage
from gradcomp.edgegossip.reduction import gha as gha
from gradcomp.edgegossip.reduction import gha_components as gha_components
from gradcomp.edgegossip.reduction import gha_features as gha_features
from gradcomp.edgegossip.reduction import hash_features as hash_features
from gradcomp.edgegossip.reduction import svd_features as svd_features
