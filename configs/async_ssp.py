r"""An asynchronous parameter server with stale-synchronous parallel (bound 4) on a mixed cluster.

Survey 004 §2.3 (``gradcomp.async_ps``): workers at speeds (1, 1, 1, 1, 2,
2, 4, 4) push their gradients to the server as they finish and pull its
params back; a worker more than ``staleness_bound = 4`` pushes ahead of the
slowest waits (SSP). Each push is applied as it arrives, with plain SGD at
lr 0.05: eight pushes per round at 0.05 are one step at 0.4 on the mean, and
momentum per push mixes stale with fresh gradients (BUILD_NOTES, "Training
schemes"; at the default lr 0.1 with momentum 0.9 the server never leaves
chance). ``sim_seconds`` counts the fastest worker's cycles.

  python -m train --config configs/async_ssp.py --workdir /tmp/wd_ssp

Expected (measured on the 2-core CPU): 12.6 s end to end; test accuracy
0.978; ``staleness_mean`` 7.0 pushes in every row (pushes applied between
a worker's pull and its push) and a ``staleness_histogram`` in TensorBoard.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.compressor = default.compressor("none")
  config.fusion.plan = "none"
  config.optimizer.learning_rate = 0.05
  config.optimizer.momentum = 0.0
  config.scheme = default.scheme("async_ps", staleness_bound=4)
  config.cluster.speeds = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
  return config
