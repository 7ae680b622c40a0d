r"""EdgeGossip (paper 002) on digits: balanced, loss-ranked epochs over GoSGD on a mixed cluster.

Han et al. §3: GoSGD (each worker pushes its params with probability ``p =
0.5``) on per-worker shards, with the paper's three parts before each
epoch: the balancer gives each worker a share of its shard by its speed
(here (1, 1, 1, 1, 0.5, 0.5, 0.25, 0.25) of an assumed 1 GFLOP/s edge
device), the aggregator's single-class subsets of about 10 samples
(``svd_kmeans``) are ranked by the worker's own loss, and whole subsets are
taken until the share is used. 64 samples per worker per step (the paper's
§4.1), 60 epochs.

  python -m train --config configs/edgegossip.py --workdir /tmp/wd_edgegossip

Expected (measured on the 2-core CPU): 10.6 s end to end (180 steps, 3 per
epoch); test accuracy 0.967 for the average model, 0.956 for the worst
worker's own; one row per epoch with the workers' ``ratios``, ``samples``
and the epoch's simulated time (``sim_epoch_seconds``).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.compressor = default.compressor("none")
  config.fusion.plan = "none"
  config.global_batch_size = 512
  config.num_train_steps = None
  config.num_epochs = 60.0
  config.scheme = default.scheme(
    "edgegossip", p=0.5, method="svd_kmeans", ratio=10, selection="loss"
  )
  config.cluster.speeds = (1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25)
  config.cluster.flops_per_second = 1e9
  return config
