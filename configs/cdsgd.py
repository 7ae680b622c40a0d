r"""CD-SGD (paper 001) on digits: 2-bit threshold codes, a full-precision message every k = 2.

Each worker steps its local weights with its own gradient at the local
learning rate 0.1 while the previous step's message is exchanged (the
exchange runs under the next step's compute); every ``k = 2``-th message
goes in full precision (the correction), the rest as 2-bit threshold codes
(``threshold_quantize``, threshold 0.01 on mean gradients); the global
weights take the server optimizer (``config.optimizer``: SGD lr 0.1,
momentum 0.9). 50 synchronous warm-up steps first (the paper gives none;
OD-SGD's code uses 200 of much longer runs).

  python -m train --config configs/cdsgd.py --workdir /tmp/wd_cdsgd

Expected (measured on the 2-core CPU): 13.5 s end to end; test accuracy 0.983
for the local and the global weights (``eval_global_accuracy``); 21,883
bytes sent per step per worker, and ``sim_seconds`` priced with the
exchange under the next step's compute (paper 001 eqs. 6-7).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.compressor = default.compressor("threshold_quantize", threshold=0.01)
  config.fusion.plan = "none"
  config.scheme = default.scheme("cdsgd", local_learning_rate=0.1, warmup_steps=50, k=2)
  return config
