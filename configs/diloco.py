r"""DiLoCo on digits: 8 workers, 8 local SGD steps per round, outer Nesterov SGD.

Douillard et al. 2023, Alg. 1 (``gradcomp.local_sgd`` with an ``outer``
optimizer): each worker takes ``every = 8`` steps of the inner optimizer
(SGD, lr 0.1, momentum 0.9) on its own params; then the mean of the workers'
pseudo-gradients (their params' change over the round, the dense fp32
all-reduce) feeds outer Nesterov SGD at lr 0.7, momentum 0.9, the paper's
outer optimizer. H = 8, not the paper's 500: the 600-step run then has 75
outer steps (BUILD_NOTES, "Training schemes"). With
``--config.compressor.name=topk --config.compressor.ratio=0.01`` the
pseudo-gradients go through top-k 1 % with error feedback kept across
rounds.

  python -m train --config configs/diloco.py --workdir /tmp/wd_diloco

Expected (measured on the 2-core CPU): 9.6 s end to end; test accuracy
0.969 (the average model, the same as each worker's after the last round),
4,825 bytes sent per step per worker (one 38 KB round every 8 steps)
against 38,456 for synchronous SGD.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.compressor = default.compressor("none")
  config.fusion.plan = "single"
  config.scheme = default.scheme(
    "local_sgd", every=8, outer_learning_rate=0.7, outer_momentum=0.9
  )
  return config
