r"""MuLoCo on gpt_tiny: DiLoCo with Muon inside and top-k 1 % pseudo-gradients.

Thérien et al. 2025, "MuLoCo: Muon is a practical inner optimizer for
DiLoCo" (arXiv 2505.23725, Algorithm 1): each of 8 workers takes ``every =
32`` steps of Muon (``optax.contrib.muon``: Nesterov momentum 0.95
orthogonalised by five Newton-Schulz steps on each matrix and embedding,
AdamW on biases and norms, ``train.optimizer.muon``) on its own gradient;
then its pseudo-gradient (the params' change over the round) goes through
top-k 1 % with error feedback (``config.compressor``, kept across rounds,
one leaf at a time: ``fusion.plan=layerwise``), and the mean feeds outer
Nesterov SGD at rate 0.7, momentum 0.6 (the paper's MuLoCo defaults; its
reference, ``bentherien/muloco-1``, uses the same). The inner rate 0.02 is
Muon's usual (the paper's and modded-nanogpt's), warmed up and
cosine-decayed as gpt_tiny's AdamW; weight decay 0.1 on matrices and
embeddings only (``mask_decay=True``), clipping at 1.0 on each worker's own
gradient (``clip_scope="worker"``): the transformer study's protocol
(DESIGN §11). ``every = 32`` (the paper's H = 30) so the run compares with
BUILD_NOTES' "DiLoCo every 32" and "DiLoCo + top-k 1 %" rows on gpt_tiny.

  python -m train --config configs/muloco.py --workdir /tmp/muloco

Measured (seed 0, one run, untuned rates, 2026-11-28): validation
``eval_bits_per_byte`` 3.053 at step 600 (3.488 at 200, 3.189 at 400;
unigram baseline 4.958), sending 1,088 bytes per step per worker (one
35,584-byte top-k round every 32 steps): against BUILD_NOTES' gpt_tiny rows,
below DiLoCo + top-k 1 % with AdamW inside (3.446-3.482, the same bytes) and
above dense DiLoCo every 32 (2.691, 53,534 bytes per step) and dense AdamW
(1.976, 1,783,824). About 35 minutes end to end on the shared 2-core CPU
under load (600 steps about 15 of them; each evaluation of the average and
the 8 workers' models 3-7 minutes; the first attempt was killed for memory
at the last evaluation and resumed from step 400, bit for bit the same
losses). Dense pseudo-gradients: ``--config.compressor.name=none``;
synchronous Muon: ``--config.scheme.name=none``.
"""

from configs import default, gpt_tiny


def get_config():
  config = gpt_tiny.get_config()
  config.optimizer.name = "muon"
  config.optimizer.learning_rate = 0.02
  config.optimizer.beta = 0.95  # Muon's momentum
  config.optimizer.weight_decay = 0.1
  config.optimizer.mask_decay = True
  config.optimizer.clip_norm = 1.0
  config.optimizer.clip_scope = "worker"
  config.scheme = default.scheme(
    "local_sgd", every=32, outer_learning_rate=0.7, outer_momentum=0.6
  )
  config.compressor = default.compressor("topk", ratio=0.01)
  config.fusion.plan = "layerwise"
  return config
