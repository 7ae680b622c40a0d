r"""SparseLoCo on digits: 8 workers, 8 local SGD steps per round, 2-bit top-k pseudo-gradients.

Sarfi et al. 2025 (arXiv 2508.15706), Alg. 1 (``gradcomp.schemes.sparseloco``):
each worker takes ``every = 8`` steps of the inner optimizer (SGD, lr 0.1,
momentum 0.9) on its own params; then its pseudo-gradient is added to its
error feedback (decayed by ``ef_decay = 0.95``), the top ``k`` of each 64 x 64
tile of that memory (1.56 % at ``k = 64``; a vector keeps 1 of each chunk of
64) is sent in 2-bit codes with 12-bit positions, and the anchor takes a
plain SGD step on the mean of the decoded payloads at ``outer_learning_rate``.

  python -m train --config configs/sparseloco.py --workdir /tmp/wd_sparseloco

Expected (measured on the 2-core CPU, 600 steps, 75 rounds): about 11 s end
to end when the machine is quiet (17-30 s beside other jobs); test accuracy
0.981 (eval_loss 0.087; seeds 1 and 2: 0.978 / 0.083, 0.983 / 0.073), one
287-byte round every 8 steps, 55.9 bytes per step per worker (20 of them the
logged metrics and the non-finite agreement). The dense DiLoCo recipe
(``configs/diloco.py``, Nesterov outer step) sends a 38,440-byte round, 134x
more, and ends at 0.969 / 0.230 (seeds 1, 2: 0.978 / 0.163, 0.978 / 0.249);
plain averaging every 8 steps (outer SGD at 1.0, dense) at 0.981 / 0.069.
Seed 0 with one field changed: ``value_bits=8`` 0.981 / 0.086 (399-byte
rounds), ``value_bits=32`` 0.981 / 0.088 (824), ``k=128`` 0.981 / 0.084
(542), ``ef_decay=1.0`` 0.981 / 0.094, ``outer_learning_rate=0.7`` 0.978 /
0.088, ``2.0`` 0.981 / 0.103. Digits is too easy to rank these (every run
is within 2 test images of 0.981); the transformer suite is where they
are compared.

The fields (``every``, ``outer_learning_rate``, ``k``, ``chunk``,
``value_bits``, ``ef_decay``) are set from the command line as any scheme's,
e.g. ``--config.scheme.value_bits=8`` for Templar's 8-bit codes. Unset,
``chunk``, ``value_bits`` and ``ef_decay`` take the factory's defaults (64,
2, 0.95).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.compressor = default.compressor("none")
  config.fusion.plan = "none"
  config.scheme = default.scheme("sparseloco", every=8, outer_learning_rate=1.0, k=64)
  return config
