r"""CHOCO-SGD on a ring, top-k 1 %: decentralised training with compressed gossip.

Koloskova et al. 2019 (``gradcomp.gossip`` with a compressor): each worker
takes an SGD step (lr 0.1, momentum 0.9) on its own params, then sends the
top-k 1 % of the change of its public copy to its two ring neighbours and
moves ``gamma = 0.05`` of the way to its neighbourhood's average (the
consensus step the digits sweep chose for top-k, BUILD_NOTES "Training
schemes"). No all-reduce: each worker waits for its neighbours only.

  python -m train --config configs/choco_ring.py --workdir /tmp/wd_choco

Expected (measured on the 2-core CPU): 13 s end to end; the average model's
test accuracy 0.983, the worst worker's own 0.975
(``eval_worker_accuracy_min``); 1,540 bytes sent per step per worker, and
``consensus_distance`` in every row.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.compressor = default.compressor("topk", ratio=0.01)
  config.fusion.plan = "none"
  config.scheme = default.scheme("gossip", topology="ring", gamma=0.05)
  return config
